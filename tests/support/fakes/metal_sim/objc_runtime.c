/* A simulated Metal for Linux x86-64 (sim.h lists its files): the Objective-C runtime calls, Metal objects,
 * libdispatch queues and the Metal compiler service that asyncmetal's Metal backend
 * uses, behind the same C symbols it loads on a Mac. Built with clang -fblocks and
 * libBlocksRuntime (tests/support/fakes/metal_sim/__init__.py); the backend is pointed at it with
 * ASYNCMETAL_OBJC_LIB, ASYNCMETAL_METAL_LIB, ASYNCMETAL_MTLCOMPILER_LIB and
 * ASYNCMETAL_LIBSYSTEM.
 *
 * The runtime is our own (not GCC's libobjc): objects and classes are C structs, a
 * selector is an interned C string, and objc_msgSend is a few lines of assembly that
 * asks sim_lookup() for the method's C function and tail-jumps to it with every argument
 * register, vector register and stack slot as the caller left them -- so each method
 * receives its arguments exactly as the System V x86-64 ABI passes them for the
 * signature ctypes cast objc_msgSend to. A wrong argument type shows up as a wrong
 * value (or a validation failure) here. Owning our runtime also lets every message check
 * that its receiver is a live object (released objects are kept as zombies, as with
 * NSZombieEnabled) and count references exactly.
 *
 * Exported C functions: objc_getClass, sel_registerName, objc_msgSend, objc_msgSend_stret,
 * objc_autoreleasePoolPush, objc_autoreleasePoolPop, MTLCreateSystemDefaultDevice,
 * dispatch_queue_create, dispatch_data_create, dispatch_release,
 * MTLCodeGenServiceCreate, MTLCodeGenServiceBuildRequest (dispatch_queue_create only
 * for the listener); and for the tests
 * asyncmetal_sim_live (objects alive, per class), asyncmetal_sim_implicit (objects
 * autoreleased with no pool in place), asyncmetal_sim_handlers (completed handlers run,
 * and how many on the committing thread), asyncmetal_sim_fail_at (a message that makes
 * an object returns nil, as with no memory left).
 *
 * Classes and selectors: every selector the backend (backends/metal/) sends -- 39 --
 * and, marked *, those it does not send but the simulation's own tests use:
 *   NSObject        -retain -release -autorelease* -retainCount*
 *   NSString        +stringWithUTF8String: -UTF8String
 *   NSError         -localizedDescription
 *   MTLDevice       -newCommandQueueWithMaxCommandBufferCount: -newBufferWithLength:options:
 *                   -newBufferWithBytes:length:options:
 *                   -newBufferWithBytesNoCopy:length:options:deallocator:
 *                   -newSharedEvent -newLibraryWithData:error:
 *                   -newComputePipelineStateWithFunction:error: -name
 *                   -recommendedMaxWorkingSetSize -maxBufferLength
 *                   -maxThreadsPerThreadgroup (an MTLSize: objc_msgSend_stret)
 *   MTLCommandQueue -commandBuffer
 *   MTLCommandBuffer -computeCommandEncoder -blitCommandEncoder -encodeWaitForEvent:value:
 *                   -encodeSignalEvent:value: -addCompletedHandler: -commit
 *                   -waitUntilCompleted -status -error -GPUStartTime -GPUEndTime
 *   MTLComputeCommandEncoder -setComputePipelineState: -setBuffer:offset:atIndex:
 *                   -setBytes:length:atIndex: -dispatchThreads:threadsPerThreadgroup:
 *                   -dispatchThreadgroups:threadsPerThreadgroup:* -endEncoding
 *   MTLBlitCommandEncoder -copyFromBuffer:sourceOffset:toBuffer:destinationOffset:size:
 *                   -fillBuffer:range:value: -endEncoding
 *   MTLBuffer       -contents -length
 *   MTLSharedEvent  -signaledValue -setSignaledValue: -notifyListener:atValue:block:*
 *   MTLSharedEventListener +alloc* -initWithDispatchQueue:*
 *   MTLLibrary      -newFunctionWithName:
 *   MTLFunction, MTLComputePipelineState -maxTotalThreadsPerThreadgroup*
 *   OS_dispatch_queue, OS_dispatch_data (libdispatch objects are Objective-C objects)
 *
 * Behaviour modelled: command buffers of a queue run in commit order on that queue's own
 * "GPU" thread (queues run concurrently); encodeWaitForEvent:value: holds its command
 * buffer until the event reaches the value; a kernel that calls
 * __asyncmetal_sim_fault() (a simulation-only hook) makes its command buffer end with
 * MTLCommandBufferStatusError and an NSError, skipping its remaining kernels and copies
 * (its event signals still happen); completed handlers and listener blocks are copied
 * with Block_copy and run later on dispatch threads (never the caller's), then released;
 * command buffers retain what they reference until they complete; objects returned by
 * methods that do not begin with new/alloc are autoreleased. Misuse that Metal's
 * validation layer or the Objective-C runtime would trap (unrecognized selector, message
 * to a released object, encoding while another encoder is open, committing twice,
 * adding a handler after commit, a copy or fill out of bounds, an unbound kernel argument)
 * prints "asyncmetal-sim:" and aborts the process, as an uncaught exception would.
 */
#include "sim.h"

/* ---------------------------------------------------------------- failures ------ */

void fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("asyncmetal-sim: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    abort();
}

/* --------------------------------------------------------------- selectors ------ */

static pthread_mutex_t sel_lock = PTHREAD_MUTEX_INITIALIZER;
static char **sels;
static size_t nsels, capsels;

SEL sel_registerName(const char *name) {
    pthread_mutex_lock(&sel_lock);
    for (size_t i = 0; i < nsels; i++)
        if (strcmp(sels[i], name) == 0) {
            pthread_mutex_unlock(&sel_lock);
            return sels[i];
        }
    if (nsels == capsels) {
        capsels = capsels ? 2 * capsels : 64;
        sels = realloc(sels, capsels * sizeof *sels);
    }
    char *s = strdup(name);
    sels[nsels++] = s;
    pthread_mutex_unlock(&sel_lock);
    return s;
}

/* ----------------------------------------------------------------- objects ------ */

static const char *class_name(const object *o) {
    return o->is_class ? ((const sim_class *)o)->name : o->isa->name;
}

/* Every object ever made (their memory is never reused), to tell a pointer that never
 * was an object from one whose memory was overwritten. */
static pthread_mutex_t all_lock = PTHREAD_MUTEX_INITIALIZER;
static const object **all_objects;
static size_t n_objects, cap_objects;

static void check_live(const object *o, const char *what) {
    if (o->magic == MAGIC_DEAD)
        fail("%s sent to deallocated instance %p of class %s", what, (void *)o, o->isa->name);
    if (o->magic != MAGIC_LIVE) {
        pthread_mutex_lock(&all_lock);
        for (size_t i = 0; i < n_objects; i++)
            if (all_objects[i] == o)
                fail("%s sent to %p, an object whose memory was overwritten (words %#lx %#lx "
                     "%#lx %#lx %#lx %#lx)", what, (void *)o, ((unsigned long *)o)[0],
                     ((unsigned long *)o)[1], ((unsigned long *)o)[2], ((unsigned long *)o)[3],
                     ((unsigned long *)o)[4], ((unsigned long *)o)[5]);
        fail("%s sent to %p, which is not an object", what, (void *)o);
    }
}

void *new_object(sim_class *cls) {
    object *o = calloc(1, cls->size);
    if (!o) fail("out of memory");
    o->isa = cls;
    o->magic = MAGIC_LIVE;
    o->refs = 1;
    atomic_fetch_add(&cls->live, 1);
    pthread_mutex_lock(&all_lock);
    if (n_objects == cap_objects) {
        cap_objects = cap_objects ? 2 * cap_objects : 1024;
        all_objects = realloc(all_objects, cap_objects * sizeof *all_objects);
    }
    all_objects[n_objects++] = o;
    pthread_mutex_unlock(&all_lock);
    return o;
}

void *retain(void *p) {
    object *o = p;
    if (!o) return NULL;
    check_live(o, "retain");
    if (!o->is_class) atomic_fetch_add(&o->refs, 1);
    return o;
}

void release(void *p) {
    object *o = p;
    if (!o) return;
    check_live(o, "release");
    if (o->is_class) return;
    long left = atomic_fetch_sub(&o->refs, 1) - 1;
    if (left < 0) fail("over-release of %p (%s)", p, o->isa->name);
    if (left == 0) {
        for (const sim_class *c = o->isa; c; c = c->super)
            if (c->dealloc) c->dealloc(o);
        atomic_fetch_sub(&((sim_class *)o->isa)->live, 1);
        o->magic = MAGIC_DEAD;  /* kept as a zombie: a later message is reported */
    }
}

/* Autorelease pools: a per-thread stack. An object autoreleased with no pool in place
 * goes to the thread's implicit pool, which Apple's runtime drains only when the thread
 * exits -- for a long-lived thread that is a leak, counted here. */
static __thread object **pool;
static __thread size_t pool_len, pool_cap, pool_depth;
static _Atomic long implicit_count;

void *autorelease(void *p) {
    object *o = p;
    if (!o) return NULL;
    check_live(o, "autorelease");
    if (pool_depth == 0) {
        atomic_fetch_add(&implicit_count, 1);
        return o;  /* never drained while the thread lives */
    }
    if (pool_len == pool_cap) {
        pool_cap = pool_cap ? 2 * pool_cap : 64;
        pool = realloc(pool, pool_cap * sizeof *pool);
    }
    pool[pool_len++] = o;
    return o;
}

void *objc_autoreleasePoolPush(void) {
    pool_depth++;
    return (void *)(pool_len + 1);
}

void objc_autoreleasePoolPop(void *token) {
    size_t mark = (size_t)token - 1;
    if (pool_depth == 0 || mark > pool_len) fail("autorelease pool popped out of order");
    while (pool_len > mark) release(pool[--pool_len]);
    pool_depth--;
}

/* ---------------------------------------------------------------- dispatch ------ */

static void *dqueue_main(void *p) {
    dqueue *q = p;
    for (;;) {
        pthread_mutex_lock(&q->lock);
        while (!q->head) pthread_cond_wait(&q->cond, &q->lock);
        task *t = q->head;
        q->head = t->next;
        if (!q->head) q->tail = NULL;
        pthread_mutex_unlock(&q->lock);
        t->fn(t->ctx);
        free(t);
    }
    return NULL;
}

void dispatch_async_f(dqueue *q, void *ctx, void (*fn)(void *)) {
    task *t = calloc(1, sizeof *t);
    t->fn = fn;
    t->ctx = ctx;
    pthread_mutex_lock(&q->lock);
    if (q->tail) q->tail->next = t; else q->head = t;
    q->tail = t;
    if (!q->started) {
        /* Detached: like libdispatch's threads, it outlives the queue's last reference
         * only while it still has work queued. */
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&th, &attr, dqueue_main, q)) fail("pthread_create");
        pthread_attr_destroy(&attr);
        q->started = 1;
    }
    pthread_cond_signal(&q->cond);
    pthread_mutex_unlock(&q->lock);
}

static void ddata_dealloc(object *o) { free(((ddata *)o)->bytes); }

dqueue *make_dqueue(const char *label) {
    dqueue *q = new_object(&OS_dispatch_queue_class);
    pthread_mutex_init(&q->lock, NULL);
    pthread_cond_init(&q->cond, NULL);
    snprintf(q->label, sizeof q->label, "%s", label ? label : "");
    return q;
}

/* ---------------------------------------------------------- class objects ------ */

void expect(const void *p, const sim_class *cls, const char *what) {
    const object *o = p;
    if (!o) fail("%s: nil where %s was expected", what, cls->name);
    check_live(o, what);
    for (const sim_class *c = o->is_class ? NULL : o->isa; c; c = c->super)
        if (c == cls) return;
    fail("%s: %p is a %s, not a %s", what, p, class_name(o), cls->name);
}
/* ---------------------------------------------------------------- NSObject ------ */

static void *NSObject_retain(object *self, SEL s) { (void)s; return retain(self); }
static void NSObject_release(object *self, SEL s) { (void)s; release(self); }
static void *NSObject_autorelease(object *self, SEL s) { (void)s; return autorelease(self); }
static unsigned long NSObject_retainCount(object *self, SEL s) {
    (void)s;
    return (unsigned long)self->refs;
}

static const method NSObject_methods[] = {
    M("retain", NSObject_retain), M("release", NSObject_release),
    M("autorelease", NSObject_autorelease), M("retainCount", NSObject_retainCount), {0, 0}};

/* ---------------------------------------------------------- NSString, NSError ------ */

static void nsstring_dealloc(object *o) { free(((nsstring *)o)->text); }

nsstring *make_string(const char *text) {
    nsstring *s = new_object(&NSString_class);
    s->text = strdup(text);
    return s;
}

static void *NSString_stringWithUTF8String(object *cls, SEL s, const char *text) {
    (void)cls, (void)s;
    if (!text) fail("+[NSString stringWithUTF8String:]: NULL cString");
    return autorelease(make_string(text));
}

static const char *NSString_UTF8String(nsstring *self, SEL s) { (void)s; return self->text; }

static void nserror_dealloc(object *o) { release(((nserror *)o)->description); }

nserror *make_error(const char *text) {
    nserror *e = new_object(&NSError_class);
    e->description = make_string(text);
    return e;
}

static void *NSError_localizedDescription(nserror *self, SEL s) {
    (void)s;
    return autorelease(retain(self->description));
}
/* ---------------------------------------------------------------- libdispatch ------ */

void *dispatch_queue_create(const char *label, void *attr) {
    if (attr) fail("dispatch_queue_create: only serial queues (attr NULL) are simulated");
    return make_dqueue(label);
}

void *dispatch_data_create(const void *buffer, size_t size, void *queue, void *destructor) {
    if (queue || destructor)
        fail("dispatch_data_create: only DISPATCH_DATA_DESTRUCTOR_DEFAULT (copy) is simulated");
    ddata *d = new_object(&OS_dispatch_data_class);
    d->bytes = malloc(size ? size : 1);
    memcpy(d->bytes, buffer, size);
    d->size = size;
    return d;
}

void dispatch_release(void *object) { release(object); }

/* ---------------------------------------------------------------- classes ------ */

CLASS(NSObject, NULL, no_methods, NSObject_methods, object, NULL)
static const method NSString_meta_methods[] = {
    M("stringWithUTF8String:", NSString_stringWithUTF8String), {0, 0}};
static const method NSString_methods[] = {M("UTF8String", NSString_UTF8String), {0, 0}};
CLASS(NSString, &NSObject_class, NSString_meta_methods, NSString_methods, nsstring,
      nsstring_dealloc)
static const method NSError_methods[] = {
    M("localizedDescription", NSError_localizedDescription), {0, 0}};
CLASS(NSError, &NSObject_class, no_methods, NSError_methods, nserror, nserror_dealloc)
CLASS(OS_dispatch_queue, &NSObject_class, no_methods, no_methods, dqueue, NULL)
CLASS(OS_dispatch_data, &NSObject_class, no_methods, no_methods, ddata, ddata_dealloc)
const method no_methods[] = {{0, 0}};

static sim_class *const classes[] = {
    &NSObject_class, &NSString_class, &NSError_class, &MTLDevice_class,
    &MTLCommandQueue_class, &MTLCommandBuffer_class, &MTLComputeCommandEncoder_class,
    &MTLBlitCommandEncoder_class, &MTLBuffer_class, &MTLSharedEvent_class,
    &MTLSharedEventListener_class, &MTLLibrary_class, &MTLFunction_class,
    &MTLComputePipelineState_class, &OS_dispatch_queue_class, &OS_dispatch_data_class};

void *objc_getClass(const char *name) {
    for (size_t i = 0; i < sizeof classes / sizeof *classes; i++)
        if (strcmp(classes[i]->name, name) == 0) return classes[i];
    return NULL;
}

/* ------------------------------------------------------------ objc_msgSend ------ */

__attribute__((visibility("hidden"))) IMP sim_lookup(object *receiver, SEL sel);
__attribute__((visibility("hidden"))) void sim_nil(void);

/* Fault injection for the tests (asyncmetal_sim_fail_at): messages that return nil on a
 * Mac when it has no memory or no resources left -- one that makes an object (new...,
 * but those with an error: argument, which set it), a command buffer, an encoder -- are
 * counted on the thread that asked, and the nth returns nil without running. */
static atomic_long fail_count, fail_at = -1;
static pthread_t fail_thread;

static int failable(SEL sel) {
    return (strncmp(sel, "new", 3) == 0 && !strstr(sel, "error:")) ||
           strcmp(sel, "commandBuffer") == 0 || strcmp(sel, "computeCommandEncoder") == 0 ||
           strcmp(sel, "blitCommandEncoder") == 0;
}

/* From now on, the calling thread's nth failable message returns nil (0: none, counted
 * only; -1: off); returns how many it sent since the last call. */
long asyncmetal_sim_fail_at(long n) {
    long sent = atomic_exchange(&fail_count, 0);
    fail_thread = pthread_self();
    atomic_store(&fail_at, n);
    return sent;
}

IMP sim_lookup(object *receiver, SEL sel) {
    if (!receiver) return sim_nil;  /* a message to nil returns 0 / 0.0 */
    check_live(receiver, sel);
    if (atomic_load(&fail_at) >= 0 && pthread_equal(pthread_self(), fail_thread) &&
        failable(sel) && atomic_fetch_add(&fail_count, 1) + 1 == atomic_load(&fail_at))
        return sim_nil;
    for (const sim_class *c = receiver->isa; c; c = c->super)
        for (const method *m = c->methods; m->name; m++)
            if (strcmp(m->name, sel) == 0) return m->imp;
    fail("%c[%s %s]: unrecognized selector sent to %s %p", receiver->is_class ? '+' : '-',
         class_name(receiver), sel, receiver->is_class ? "class" : "instance",
         (void *)receiver);
}

/* The argument registers (integer, vector, and %al, the vector-register count of a
 * variadic call), saved in the trampoline's frame; restored, and on to the method found
 * (in %r11) by a tail jump. */
#define SAVE_ARGUMENTS \
    "    push %rbp\n" \
    "    mov %rsp, %rbp\n" \
    "    sub $0xd0, %rsp\n" \
    "    mov %rdi, 0x00(%rsp)\n" \
    "    mov %rsi, 0x08(%rsp)\n" \
    "    mov %rdx, 0x10(%rsp)\n" \
    "    mov %rcx, 0x18(%rsp)\n" \
    "    mov %r8, 0x20(%rsp)\n" \
    "    mov %r9, 0x28(%rsp)\n" \
    "    mov %rax, 0x30(%rsp)\n" \
    "    movdqa %xmm0, 0x40(%rsp)\n" \
    "    movdqa %xmm1, 0x50(%rsp)\n" \
    "    movdqa %xmm2, 0x60(%rsp)\n" \
    "    movdqa %xmm3, 0x70(%rsp)\n" \
    "    movdqa %xmm4, 0x80(%rsp)\n" \
    "    movdqa %xmm5, 0x90(%rsp)\n" \
    "    movdqa %xmm6, 0xa0(%rsp)\n" \
    "    movdqa %xmm7, 0xb0(%rsp)\n"

#define RESTORE_ARGUMENTS_AND_JUMP \
    "    mov 0x00(%rsp), %rdi\n" \
    "    mov 0x08(%rsp), %rsi\n" \
    "    mov 0x10(%rsp), %rdx\n" \
    "    mov 0x18(%rsp), %rcx\n" \
    "    mov 0x20(%rsp), %r8\n" \
    "    mov 0x28(%rsp), %r9\n" \
    "    mov 0x30(%rsp), %rax\n" \
    "    movdqa 0x40(%rsp), %xmm0\n" \
    "    movdqa 0x50(%rsp), %xmm1\n" \
    "    movdqa 0x60(%rsp), %xmm2\n" \
    "    movdqa 0x70(%rsp), %xmm3\n" \
    "    movdqa 0x80(%rsp), %xmm4\n" \
    "    movdqa 0x90(%rsp), %xmm5\n" \
    "    movdqa 0xa0(%rsp), %xmm6\n" \
    "    movdqa 0xb0(%rsp), %xmm7\n" \
    "    leave\n" \
    "    jmp *%r11\n"

/* Save the argument registers (integer, vector, and %al, the vector-register count of a
 * variadic call), look the method up, restore them and tail-jump: the method sees its
 * arguments and stack exactly as objc_msgSend's caller set them. */
__asm__(
    ".text\n"
    ".globl objc_msgSend\n"
    ".type objc_msgSend, @function\n"
    "objc_msgSend:\n"
    SAVE_ARGUMENTS
    "    call sim_lookup\n"
    "    mov %rax, %r11\n"
    RESTORE_ARGUMENTS_AND_JUMP
    ".size objc_msgSend, .-objc_msgSend\n"
    "\n"
    /* A method returning a structure in memory: the caller passes the result's address
     * in %rdi, the receiver and selector after it (in %rsi, %rdx), as the method takes
     * them. To nil: the result is left as it was, its address returned. */
    ".globl objc_msgSend_stret\n"
    ".type objc_msgSend_stret, @function\n"
    "objc_msgSend_stret:\n"
    SAVE_ARGUMENTS
    "    mov %rsi, %rdi\n"
    "    mov %rdx, %rsi\n"
    "    call sim_lookup\n"
    "    lea sim_nil_stret(%rip), %r11\n"
    "    cmpq $0, 0x08(%rsp)\n"
    "    cmovne %rax, %r11\n"
    RESTORE_ARGUMENTS_AND_JUMP
    ".size objc_msgSend_stret, .-objc_msgSend_stret\n"
    "\n"
    ".type sim_nil_stret, @function\n"
    "sim_nil_stret:\n"
    "    mov %rdi, %rax\n"
    "    ret\n"
    ".size sim_nil_stret, .-sim_nil_stret\n"
    "\n"
    ".globl sim_nil\n"
    ".hidden sim_nil\n"
    ".type sim_nil, @function\n"
    "sim_nil:\n"
    "    xor %eax, %eax\n"
    "    xor %edx, %edx\n"
    "    xorps %xmm0, %xmm0\n"
    "    xorps %xmm1, %xmm1\n"
    "    ret\n"
    ".size sim_nil, .-sim_nil\n");

/* ------------------------------------------------------------- test queries ------ */

long asyncmetal_sim_live(const char *name) {
    sim_class *cls = objc_getClass(name);
    return cls ? (long)cls->live : -1;
}

long asyncmetal_sim_implicit(void) { return (long)implicit_count; }

/* The compiler service is in compiler.c; completed handlers are counted in
 * command_buffers.c (asyncmetal_sim_handlers). */
