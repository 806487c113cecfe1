/* A simulated Metal for Linux x86-64: the Objective-C runtime calls, Metal objects,
 * libdispatch queues and the Metal compiler service that asyncmetal's Metal backend
 * uses, behind the same C symbols it loads on a Mac. Built with clang -fblocks and
 * libBlocksRuntime (tests/metal_sim/__init__.py); the backend is pointed at it with
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
 * Exported C functions: objc_getClass, sel_registerName, objc_msgSend,
 * objc_autoreleasePoolPush, objc_autoreleasePoolPop, MTLCreateSystemDefaultDevice,
 * dispatch_queue_create, dispatch_data_create, dispatch_release,
 * MTLCodeGenServiceCreate, MTLCodeGenServiceBuildRequest (dispatch_queue_create only
 * for the listener); and for the tests
 * asyncmetal_sim_live (objects alive, per class), asyncmetal_sim_implicit (objects
 * autoreleased with no pool in place), asyncmetal_sim_handlers (completed handlers run,
 * and how many on the committing thread).
 *
 * Classes and selectors: every selector the backend (backends/metal/) sends -- 36 --
 * and, marked *, those it does not send but the simulation's own tests use:
 *   NSObject        -retain -release -autorelease* -retainCount*
 *   NSString        +stringWithUTF8String: -UTF8String
 *   NSError         -localizedDescription
 *   MTLDevice       -newCommandQueueWithMaxCommandBufferCount: -newBufferWithLength:options:
 *                   -newBufferWithBytes:length:options:
 *                   -newBufferWithBytesNoCopy:length:options:deallocator:
 *                   -newSharedEvent -newLibraryWithData:error:
 *                   -newComputePipelineStateWithFunction:error: -name
 *                   -recommendedMaxWorkingSetSize
 *   MTLCommandQueue -commandBuffer
 *   MTLCommandBuffer -computeCommandEncoder -blitCommandEncoder -encodeWaitForEvent:value:
 *                   -encodeSignalEvent:value: -addCompletedHandler: -commit
 *                   -waitUntilCompleted -status -error -GPUStartTime -GPUEndTime
 *   MTLComputeCommandEncoder -setComputePipelineState: -setBuffer:offset:atIndex:
 *                   -setBytes:length:atIndex: -dispatchThreads:threadsPerThreadgroup:
 *                   -dispatchThreadgroups:threadsPerThreadgroup:* -endEncoding
 *   MTLBlitCommandEncoder -copyFromBuffer:sourceOffset:toBuffer:destinationOffset:size:
 *                   -endEncoding
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
 * adding a handler after commit, a copy out of bounds, an unbound kernel argument)
 * prints "asyncmetal-sim:" and aborts the process, as an uncaught exception would.
 */
#define _GNU_SOURCE
#include <Block.h>
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef const char *SEL;
typedef void (*IMP)(void);
typedef struct sim_class sim_class;

#define MAGIC_LIVE 0x4d544c4fu  /* "MTLO" */
#define MAGIC_DEAD 0x5a4f4d42u  /* "ZOMB" */

typedef struct object {
    const sim_class *isa;
    uint32_t magic;
    int is_class;
    _Atomic long refs;
} object;

typedef struct { const char *name; IMP imp; } method;

struct sim_class {
    object obj;                     /* a class is an object whose isa is its metaclass */
    const char *name;
    const sim_class *super;
    const method *methods;
    size_t size;                    /* instance size */
    void (*dealloc)(object *);
    _Atomic long live;              /* instances alive */
};

/* ---------------------------------------------------------------- failures ------ */

static void fail(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));
static void fail(const char *fmt, ...) {
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

static void *new_object(sim_class *cls) {
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

static void *retain(void *p) {
    object *o = p;
    if (!o) return NULL;
    check_live(o, "retain");
    if (!o->is_class) atomic_fetch_add(&o->refs, 1);
    return o;
}

static void release(void *p) {
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

static void *autorelease(void *p) {
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

typedef struct task { void (*fn)(void *); void *ctx; struct task *next; } task;

typedef struct {
    object obj;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    task *head, *tail;
    int started;
    char label[64];
} dqueue;

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

static void dispatch_async_f(dqueue *q, void *ctx, void (*fn)(void *)) {
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

typedef struct { object obj; void *bytes; size_t size; } ddata;

static void ddata_dealloc(object *o) { free(((ddata *)o)->bytes); }

/* ---------------------------------------------------------- class objects ------ */

#define M(name, fn) {name, (IMP)(fn)}

/* Forward declarations of the classes (defined with their method tables below). */
extern sim_class NSObject_class, NSString_class, NSError_class, MTLDevice_class,
    MTLCommandQueue_class, MTLCommandBuffer_class, MTLComputeCommandEncoder_class,
    MTLBlitCommandEncoder_class, MTLBuffer_class, MTLSharedEvent_class,
    MTLSharedEventListener_class, MTLLibrary_class, MTLFunction_class,
    MTLComputePipelineState_class, OS_dispatch_queue_class, OS_dispatch_data_class,
    NSString_meta, MTLSharedEventListener_meta;

static void expect(const void *p, const sim_class *cls, const char *what) {
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

typedef struct { object obj; char *text; } nsstring;
static void nsstring_dealloc(object *o) { free(((nsstring *)o)->text); }

static nsstring *make_string(const char *text) {
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

typedef struct { object obj; nsstring *description; } nserror;
static void nserror_dealloc(object *o) { release(((nserror *)o)->description); }

static nserror *make_error(const char *text) {
    nserror *e = new_object(&NSError_class);
    e->description = make_string(text);
    return e;
}

static void *NSError_localizedDescription(nserror *self, SEL s) {
    (void)s;
    return autorelease(retain(self->description));
}

/* ----------------------------------------------------------------- MTLBuffer ------ */

typedef struct {
    object obj;
    char *contents;
    unsigned long length;
    int owned;                      /* contents allocated here (not a no-copy wrapper) */
} mtlbuffer;

static void mtlbuffer_dealloc(object *o) {
    mtlbuffer *b = (mtlbuffer *)o;
    if (b->owned) free(b->contents);
}

static void *MTLBuffer_contents(mtlbuffer *self, SEL s) { (void)s; return self->contents; }
static unsigned long MTLBuffer_length(mtlbuffer *self, SEL s) { (void)s; return self->length; }

/* ----------------------------------------------------------- MTLSharedEvent ------ */

typedef struct notification {
    object *listener;
    uint64_t value;
    void (^block)(void *event, uint64_t value);
    struct notification *next;
} notification;

typedef struct {
    object obj;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    uint64_t value;
    notification *pending;
} mtlevent;

typedef struct { object obj; dqueue *queue; } mtllistener;
static void mtllistener_dealloc(object *o) { release(((mtllistener *)o)->queue); }

typedef struct { mtlevent *event; uint64_t value; notification *n; } fired;

static void run_notification(void *p) {
    fired *f = p;
    f->n->block(f->event, f->value);
    Block_release(f->n->block);
    release(f->n->listener);
    release(f->event);
    free(f->n);
    free(f);
}

static void check_block_signature(const void *block, const char *want, const char *what) {
    const struct {
        void *isa; int flags; int reserved; void *invoke;
        struct { unsigned long reserved, size; const char *signature; } *descriptor;
    } *b = block;
    if (!b) fail("%s: nil block", what);
    if (!(b->flags & (1 << 30)) || b->flags & (1 << 25))
        fail("%s: a block without a plain signature (flags %#x)", what, b->flags);
    if (strcmp(b->descriptor->signature, want) != 0)
        fail("%s: a block of signature %s, not %s", what, b->descriptor->signature, want);
}

/* Set the value and hand each notification it reached to its listener's queue. */
static void event_set(mtlevent *e, uint64_t value) {
    notification *due = NULL;
    pthread_mutex_lock(&e->lock);
    e->value = value;
    for (notification **p = &e->pending; *p;) {
        if ((*p)->value <= value) {
            notification *n = *p;
            *p = n->next;
            n->next = due;
            due = n;
        } else {
            p = &(*p)->next;
        }
    }
    pthread_cond_broadcast(&e->cond);
    pthread_mutex_unlock(&e->lock);
    while (due) {
        notification *n = due;
        due = n->next;
        fired *f = calloc(1, sizeof *f);
        f->event = retain(e);
        f->value = value;
        f->n = n;
        dispatch_async_f(((mtllistener *)n->listener)->queue, f, run_notification);
    }
}

static uint64_t MTLSharedEvent_signaledValue(mtlevent *self, SEL s) {
    (void)s;
    pthread_mutex_lock(&self->lock);
    uint64_t v = self->value;
    pthread_mutex_unlock(&self->lock);
    return v;
}

static void MTLSharedEvent_setSignaledValue(mtlevent *self, SEL s, uint64_t value) {
    (void)s;
    event_set(self, value);
}

static void MTLSharedEvent_notify(mtlevent *self, SEL s, object *listener, uint64_t value,
                                  void *block) {
    (void)s;
    expect(listener, &MTLSharedEventListener_class, "notifyListener:atValue:block:");
    check_block_signature(block, "v24@?0@8Q16", "notifyListener:atValue:block:");
    notification *n = calloc(1, sizeof *n);
    n->listener = retain(listener);
    n->value = value;
    n->block = Block_copy((void (^)(void *, uint64_t))block);
    pthread_mutex_lock(&self->lock);
    n->next = self->pending;
    self->pending = n;
    uint64_t now = self->value;
    pthread_mutex_unlock(&self->lock);
    if (now >= value) event_set(self, now);
}

static void mtlevent_dealloc(object *o) {
    mtlevent *e = (mtlevent *)o;
    /* Notifications never reached are dropped with the event (their blocks released). */
    for (notification *n = e->pending, *next; n; n = next) {
        next = n->next;
        Block_release(n->block);
        release(n->listener);
        free(n);
    }
}

static void *MTLSharedEventListener_alloc(object *cls, SEL s) {
    (void)cls, (void)s;
    return new_object(&MTLSharedEventListener_class);
}

static void *MTLSharedEventListener_init(mtllistener *self, SEL s, dqueue *queue) {
    (void)s;
    expect(queue, &OS_dispatch_queue_class, "initWithDispatchQueue:");
    self->queue = retain(queue);
    return self;
}

/* ----------------------------------------------------- library and pipelines ------ */

typedef int (*kernel_fn)(void **bindings, const unsigned *gid);

typedef struct { object obj; void *handle; } mtllibrary;
typedef struct {
    object obj;
    mtllibrary *library;
    kernel_fn fn;
    const int *params;              /* count, then each parameter's buffer index (-1: position) */
    char name[128];
} mtlfunction;
typedef struct { object obj; mtlfunction *function; } mtlpipeline;

static void mtlfunction_dealloc(object *o) { release(((mtlfunction *)o)->library); }
static void mtlpipeline_dealloc(object *o) { release(((mtlpipeline *)o)->function); }

static void *MTLLibrary_newFunctionWithName(mtllibrary *self, SEL s, nsstring *name) {
    (void)s;
    expect(name, &NSString_class, "newFunctionWithName:");
    char symbol[256];
    snprintf(symbol, sizeof symbol, "__asyncmetal_sim_kernel_%s", name->text);
    kernel_fn fn = (kernel_fn)dlsym(self->handle, symbol);
    snprintf(symbol, sizeof symbol, "__asyncmetal_sim_params_%s", name->text);
    const int *params = dlsym(self->handle, symbol);
    if (!fn || !params) return NULL;
    mtlfunction *f = new_object(&MTLFunction_class);
    f->library = retain(self);
    f->fn = fn;
    f->params = params;
    snprintf(f->name, sizeof f->name, "%s", name->text);
    return f;
}

static unsigned long MTLPipeline_maxThreads(object *self, SEL s) {
    (void)self, (void)s;
    return 1024;
}

/* ------------------------------------------------------------ command buffers ------ */

enum { CMD_WAIT, CMD_SIGNAL, CMD_DISPATCH, CMD_COPY };
#define MAX_BINDINGS 31

typedef struct command {
    int kind;
    struct command *next;
    mtlevent *event;                /* wait, signal */
    uint64_t value;
    mtlpipeline *pipeline;          /* dispatch */
    object *buffers[MAX_BINDINGS];  /* retained */
    unsigned long offsets[MAX_BINDINGS];
    void *bytes[MAX_BINDINGS];      /* setBytes: copies */
    unsigned long lengths[MAX_BINDINGS];
    unsigned long grid[3];
    mtlbuffer *src, *dst;           /* copy */
    unsigned long src_offset, dst_offset, size;
} command;

typedef struct handler {
    void (^block)(void *);
    struct handler *next;
    void *isa;                      /* the block's first words when it was copied */
    int flags;
} handler;

/* Before Metal's last Block_release of a block it kept: the block must still be the block
 * it copied (memory its owner freed, or reused, would be corrupted by the release). */
static void check_block_intact(const void *block, void *isa, int flags, const char *what) {
    const struct { void *isa; int flags; } *b = block;
    if (b->isa != isa || b->flags != flags)
        fail("%s: the block at %p was freed or overwritten while Metal still held it "
             "(isa %p flags %#x, were %p %#x)", what, block, b->isa, b->flags, isa, flags);
}

typedef struct mtlqueue mtlqueue;

typedef struct mtlcmdbuf {
    object obj;
    mtlqueue *queue;
    command *commands, *last;
    object *encoder;                /* the open encoder, if any */
    handler *handlers;
    _Atomic unsigned long status;   /* MTLCommandBufferStatus */
    nserror *error;
    double start, end;
    struct mtlcmdbuf *next;         /* in its queue's committed list */
    pthread_t committer;            /* the thread that committed it */
    pthread_mutex_t lock;
    pthread_cond_t cond;
} mtlcmdbuf;

enum { STATUS_NOT_ENQUEUED, STATUS_ENQUEUED, STATUS_COMMITTED, STATUS_SCHEDULED,
       STATUS_COMPLETED, STATUS_ERROR };

typedef struct {
    object obj;
    mtlcmdbuf *cb;                  /* retained while open */
    int ended;
    command *dispatch;              /* the bindings being set */
} mtlencoder;

struct mtlqueue {
    object obj;
    object *device;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    mtlcmdbuf *head, *tail;         /* committed, not yet run */
    int thread_started;
    unsigned long max_buffers;
    unsigned long outstanding;      /* made and not yet completed */
};

typedef struct {
    object obj;
    dqueue *completions;            /* where completed handlers run */
    nsstring *name;
} mtldevice;

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void free_command(command *c) {
    release(c->event);
    release(c->pipeline);
    for (int i = 0; i < MAX_BINDINGS; i++) {
        release(c->buffers[i]);
        free(c->bytes[i]);
    }
    release(c->src);
    release(c->dst);
    free(c);
}

static void mtlcmdbuf_dealloc(object *o) {
    mtlcmdbuf *cb = (mtlcmdbuf *)o;
    if (cb->status == STATUS_COMMITTED || cb->status == STATUS_SCHEDULED)
        fail("a command buffer was deallocated while in flight");
    for (command *c = cb->commands, *next; c; c = next) {
        next = c->next;
        free_command(c);
    }
    for (handler *h = cb->handlers, *next; h; h = next) {
        next = h->next;
        check_block_intact(h->block, h->isa, h->flags, "addCompletedHandler:");
        Block_release(h->block);
        free(h);
    }
    release(cb->error);
    release(cb->queue);
}

static void add_command(mtlcmdbuf *cb, command *c) {
    if (cb->last) cb->last->next = c; else cb->commands = c;
    cb->last = c;
}

static void check_encodable(mtlcmdbuf *cb, const char *what) {
    if (cb->status != STATUS_NOT_ENQUEUED) fail("%s on a command buffer already committed", what);
    if (cb->encoder) fail("%s while an encoder of the command buffer is still open", what);
}

static void *MTLCommandQueue_commandBuffer(mtlqueue *self, SEL s) {
    (void)s;
    pthread_mutex_lock(&self->lock);
    /* Metal blocks here while max_buffers command buffers are outstanding. */
    while (self->outstanding >= self->max_buffers) pthread_cond_wait(&self->cond, &self->lock);
    self->outstanding++;
    pthread_mutex_unlock(&self->lock);
    mtlcmdbuf *cb = new_object(&MTLCommandBuffer_class);
    cb->queue = retain(self);
    pthread_mutex_init(&cb->lock, NULL);
    pthread_cond_init(&cb->cond, NULL);
    return autorelease(cb);
}

static void *new_encoder(mtlcmdbuf *cb, sim_class *cls, const char *what) {
    check_encodable(cb, what);
    mtlencoder *e = new_object(cls);
    e->cb = retain(cb);
    cb->encoder = &e->obj;
    return autorelease(e);
}

static void *MTLCommandBuffer_computeCommandEncoder(mtlcmdbuf *self, SEL s) {
    (void)s;
    return new_encoder(self, &MTLComputeCommandEncoder_class, "computeCommandEncoder");
}

static void *MTLCommandBuffer_blitCommandEncoder(mtlcmdbuf *self, SEL s) {
    (void)s;
    return new_encoder(self, &MTLBlitCommandEncoder_class, "blitCommandEncoder");
}

static void encode_event(mtlcmdbuf *cb, int kind, mtlevent *event, uint64_t value,
                         const char *what) {
    check_encodable(cb, what);
    expect(event, &MTLSharedEvent_class, what);
    command *c = calloc(1, sizeof *c);
    c->kind = kind;
    c->event = retain(event);
    c->value = value;
    add_command(cb, c);
}

static void MTLCommandBuffer_encodeWait(mtlcmdbuf *self, SEL s, mtlevent *event, uint64_t v) {
    (void)s;
    encode_event(self, CMD_WAIT, event, v, "encodeWaitForEvent:value:");
}

static void MTLCommandBuffer_encodeSignal(mtlcmdbuf *self, SEL s, mtlevent *event, uint64_t v) {
    (void)s;
    encode_event(self, CMD_SIGNAL, event, v, "encodeSignalEvent:value:");
}

static void MTLCommandBuffer_addCompletedHandler(mtlcmdbuf *self, SEL s, void *block) {
    (void)s;
    if (self->status != STATUS_NOT_ENQUEUED)
        fail("addCompletedHandler: on a command buffer already committed");
    check_block_signature(block, "v16@?0@8", "addCompletedHandler:");
    handler *h = calloc(1, sizeof *h);
    h->block = Block_copy((void (^)(void *))block);
    h->isa = ((void **)h->block)[0];
    h->flags = ((int *)h->block)[2];
    handler **p = &self->handlers;  /* handlers run in the order they were added */
    while (*p) p = &(*p)->next;
    *p = h;
}

static void *gpu_main(void *p);

static void MTLCommandBuffer_commit(mtlcmdbuf *self, SEL s) {
    (void)s;
    if (self->status != STATUS_NOT_ENQUEUED) fail("commit of a command buffer committed before");
    if (self->encoder) fail("commit with an encoder still open (no endEncoding)");
    mtlqueue *q = self->queue;
    self->committer = pthread_self();
    retain(self);  /* the queue holds a committed command buffer until it completed */
    pthread_mutex_lock(&q->lock);
    self->status = STATUS_COMMITTED;
    if (q->tail) q->tail->next = self; else q->head = self;
    q->tail = self;
    if (!q->thread_started) {
        pthread_t th;
        retain(q);  /* the GPU thread's reference, dropped once it has nothing left */
        if (pthread_create(&th, NULL, gpu_main, q)) fail("pthread_create");
        pthread_detach(th);
        q->thread_started = 1;
    }
    pthread_cond_broadcast(&q->cond);
    pthread_mutex_unlock(&q->lock);
}

static void MTLCommandBuffer_waitUntilCompleted(mtlcmdbuf *self, SEL s) {
    (void)s;
    if (self->status == STATUS_NOT_ENQUEUED) fail("waitUntilCompleted before commit");
    pthread_mutex_lock(&self->lock);
    while (self->status < STATUS_COMPLETED) pthread_cond_wait(&self->cond, &self->lock);
    pthread_mutex_unlock(&self->lock);
}

static unsigned long MTLCommandBuffer_status(mtlcmdbuf *self, SEL s) {
    (void)s;
    return self->status;
}

static void *MTLCommandBuffer_error(mtlcmdbuf *self, SEL s) {
    (void)s;
    return self->error;  /* a property: owned by the command buffer */
}

static double MTLCommandBuffer_GPUStartTime(mtlcmdbuf *self, SEL s) {
    (void)s;
    return self->status >= STATUS_COMPLETED ? self->start : 0.0;
}

static double MTLCommandBuffer_GPUEndTime(mtlcmdbuf *self, SEL s) {
    (void)s;
    return self->status >= STATUS_COMPLETED ? self->end : 0.0;
}

/* ---------------------------------------------------------------- encoders ------ */

static mtlencoder *open_encoder(mtlencoder *e, const char *what) {
    if (e->ended) fail("%s on an encoder after endEncoding", what);
    return e;
}

static command *dispatch_state(mtlencoder *e) {
    if (!e->dispatch) e->dispatch = calloc(1, sizeof(command));
    return e->dispatch;
}

static void Compute_setPipeline(mtlencoder *self, SEL s, mtlpipeline *pipeline) {
    (void)s;
    open_encoder(self, "setComputePipelineState:");
    expect(pipeline, &MTLComputePipelineState_class, "setComputePipelineState:");
    command *c = dispatch_state(self);
    retain(pipeline);
    release(c->pipeline);
    c->pipeline = pipeline;
}

static void Compute_setBuffer(mtlencoder *self, SEL s, mtlbuffer *buffer, unsigned long offset,
                              unsigned long index) {
    (void)s;
    open_encoder(self, "setBuffer:offset:atIndex:");
    if (index >= MAX_BINDINGS) fail("setBuffer:offset:atIndex: index %lu out of range", index);
    expect(buffer, &MTLBuffer_class, "setBuffer:offset:atIndex:");
    if (offset > buffer->length)
        fail("setBuffer:offset:atIndex: offset %lu past a buffer of %lu bytes", offset,
             buffer->length);
    command *c = dispatch_state(self);
    retain(buffer);
    release(c->buffers[index]);
    free(c->bytes[index]);
    c->bytes[index] = NULL;
    c->buffers[index] = &buffer->obj;
    c->offsets[index] = offset;
}

static void Compute_setBytes(mtlencoder *self, SEL s, const void *bytes, unsigned long length,
                             unsigned long index) {
    (void)s;
    open_encoder(self, "setBytes:length:atIndex:");
    if (index >= MAX_BINDINGS) fail("setBytes:length:atIndex: index %lu out of range", index);
    if (length == 0 || length > 4096) fail("setBytes:length:atIndex: length %lu", length);
    command *c = dispatch_state(self);
    release(c->buffers[index]);
    c->buffers[index] = NULL;
    free(c->bytes[index]);
    c->bytes[index] = malloc(length);
    memcpy(c->bytes[index], bytes, length);  /* Metal copies the bytes at this call */
    c->lengths[index] = length;
}

typedef struct { unsigned long width, height, depth; } MTLSize;

static void encode_dispatch(mtlencoder *self, MTLSize grid, MTLSize group, const char *what) {
    open_encoder(self, what);
    command *state = dispatch_state(self);
    if (!state->pipeline) fail("%s without a compute pipeline state", what);
    if (!group.width || !group.height || !group.depth ||
        group.width * group.height * group.depth > 1024)
        fail("%s: threads per threadgroup %lux%lux%lu", what, group.width, group.height,
             group.depth);
    const int *params = state->pipeline->function->params;
    for (int i = 1; i <= params[0]; i++) {
        int index = params[i];
        if (index >= 0 && !state->buffers[index] && !state->bytes[index])
            fail("%s: kernel %s's argument at buffer(%d) is not bound", what,
                 state->pipeline->function->name, index);
    }
    /* The command takes the bindings as they are now; later set* calls change only the
     * encoder's state for the next dispatch (as in Metal). */
    command *c = calloc(1, sizeof *c);
    c->kind = CMD_DISPATCH;
    c->pipeline = retain(state->pipeline);
    for (int i = 0; i < MAX_BINDINGS; i++) {
        c->buffers[i] = retain(state->buffers[i]);
        c->offsets[i] = state->offsets[i];
        if (state->bytes[i]) {
            c->bytes[i] = malloc(state->lengths[i]);
            memcpy(c->bytes[i], state->bytes[i], state->lengths[i]);
            c->lengths[i] = state->lengths[i];
        }
    }
    c->grid[0] = grid.width;
    c->grid[1] = grid.height;
    c->grid[2] = grid.depth;
    add_command(self->cb, c);
}

static void Compute_dispatchThreads(mtlencoder *self, SEL s, MTLSize grid, MTLSize group) {
    (void)s;
    encode_dispatch(self, grid, group, "dispatchThreads:threadsPerThreadgroup:");
}

static void Compute_dispatchThreadgroups(mtlencoder *self, SEL s, MTLSize groups,
                                         MTLSize group) {
    (void)s;
    MTLSize grid = {groups.width * group.width, groups.height * group.height,
                    groups.depth * group.depth};
    encode_dispatch(self, grid, group, "dispatchThreadgroups:threadsPerThreadgroup:");
}

static void Encoder_endEncoding(mtlencoder *self, SEL s) {
    (void)s;
    open_encoder(self, "endEncoding");
    self->ended = 1;
    self->cb->encoder = NULL;
}

static void mtlencoder_dealloc(object *o) {
    mtlencoder *e = (mtlencoder *)o;
    if (!e->ended) fail("an encoder was deallocated without endEncoding");
    if (e->dispatch) free_command(e->dispatch);
    release(e->cb);
}

static void Blit_copy(mtlencoder *self, SEL s, mtlbuffer *src, unsigned long src_offset,
                      mtlbuffer *dst, unsigned long dst_offset, unsigned long size) {
    (void)s;
    const char *what = "copyFromBuffer:sourceOffset:toBuffer:destinationOffset:size:";
    open_encoder(self, what);
    expect(src, &MTLBuffer_class, what);
    expect(dst, &MTLBuffer_class, what);
    if (src_offset > src->length || size > src->length - src_offset)
        fail("%s: source range %lu+%lu out of a buffer of %lu bytes", what, src_offset, size,
             src->length);
    if (dst_offset > dst->length || size > dst->length - dst_offset)
        fail("%s: destination range %lu+%lu out of a buffer of %lu bytes", what, dst_offset,
             size, dst->length);
    command *c = calloc(1, sizeof *c);
    c->kind = CMD_COPY;
    c->src = retain(src);
    c->dst = retain(dst);
    c->src_offset = src_offset;
    c->dst_offset = dst_offset;
    c->size = size;
    add_command(self->cb, c);
}

/* ------------------------------------------------------------- the GPU thread ------ */

typedef struct { mtlcmdbuf *cb; } completion;

static _Atomic long handlers_run, handlers_on_committer;

static void run_handlers(void *p) {
    mtlcmdbuf *cb = p;
    for (handler *h = cb->handlers; h; h = h->next) {
        atomic_fetch_add(&handlers_run, 1);
        if (pthread_equal(pthread_self(), cb->committer))
            atomic_fetch_add(&handlers_on_committer, 1);
        h->block(cb);
    }
    mtlqueue *q = cb->queue;
    pthread_mutex_lock(&q->lock);
    q->outstanding--;
    pthread_cond_broadcast(&q->cond);
    pthread_mutex_unlock(&q->lock);
    release(cb);  /* the queue's reference, taken at commit */
}

static const char *execute(mtlcmdbuf *cb) {
    const char *fault = NULL;
    for (command *c = cb->commands; c; c = c->next) {
        switch (c->kind) {
        case CMD_WAIT:
            pthread_mutex_lock(&c->event->lock);
            while (c->event->value < c->value)
                pthread_cond_wait(&c->event->cond, &c->event->lock);
            pthread_mutex_unlock(&c->event->lock);
            break;
        case CMD_SIGNAL:
            event_set(c->event, c->value);
            break;
        case CMD_DISPATCH: {
            if (fault) break;
            void *bindings[MAX_BINDINGS];
            for (int i = 0; i < MAX_BINDINGS; i++)
                bindings[i] = c->buffers[i]
                                  ? ((mtlbuffer *)c->buffers[i])->contents + c->offsets[i]
                                  : c->bytes[i];
            unsigned gid[3];
            for (gid[2] = 0; gid[2] < c->grid[2] && !fault; gid[2]++)
                for (gid[1] = 0; gid[1] < c->grid[1] && !fault; gid[1]++)
                    for (gid[0] = 0; gid[0] < c->grid[0]; gid[0]++)
                        if (c->pipeline->function->fn(bindings, gid)) {
                            fault = c->pipeline->function->name;
                            break;
                        }
            break;
        }
        case CMD_COPY:
            if (!fault)
                memmove(c->dst->contents + c->dst_offset, c->src->contents + c->src_offset,
                        c->size);
            break;
        }
    }
    return fault;
}

static void *gpu_main(void *p) {
    mtlqueue *q = p;
    mtldevice *device = (mtldevice *)q->device;
    for (;;) {
        pthread_mutex_lock(&q->lock);
        while (!q->head) {
            if (q->obj.refs == 1) {  /* only this thread's reference is left */
                q->thread_started = 0;
                pthread_mutex_unlock(&q->lock);
                release(q);
                return NULL;
            }
            struct timespec until;
            clock_gettime(CLOCK_REALTIME, &until);
            until.tv_nsec += 20 * 1000 * 1000;
            if (until.tv_nsec >= 1000000000) until.tv_sec++, until.tv_nsec -= 1000000000;
            pthread_cond_timedwait(&q->cond, &q->lock, &until);
        }
        mtlcmdbuf *cb = q->head;
        q->head = cb->next;
        if (!q->head) q->tail = NULL;
        pthread_mutex_unlock(&q->lock);

        cb->status = STATUS_SCHEDULED;
        cb->start = now_seconds();
        const char *fault = execute(cb);
        cb->end = now_seconds();
        if (fault) {
            char text[256];
            snprintf(text, sizeof text,
                     "Command buffer execution failed: kernel %s faulted (simulated)", fault);
            cb->error = make_error(text);
        }
        pthread_mutex_lock(&cb->lock);
        cb->status = fault ? STATUS_ERROR : STATUS_COMPLETED;
        pthread_cond_broadcast(&cb->cond);
        pthread_mutex_unlock(&cb->lock);
        dispatch_async_f(device->completions, cb, run_handlers);
    }
}

static void mtlqueue_dealloc(object *o) { release(((mtlqueue *)o)->device); }

/* ------------------------------------------------------------------ MTLDevice ------ */

static mtldevice *the_device;
static pthread_mutex_t device_lock = PTHREAD_MUTEX_INITIALIZER;

static dqueue *make_dqueue(const char *label) {
    dqueue *q = new_object(&OS_dispatch_queue_class);
    pthread_mutex_init(&q->lock, NULL);
    pthread_cond_init(&q->cond, NULL);
    snprintf(q->label, sizeof q->label, "%s", label ? label : "");
    return q;
}

void *MTLCreateSystemDefaultDevice(void) {
    pthread_mutex_lock(&device_lock);
    if (!the_device) {
        the_device = new_object(&MTLDevice_class);
        the_device->completions = make_dqueue("com.Metal.CompletionQueueDispatch");
        the_device->name = make_string("Simulated Metal (asyncmetal tests)");
        retain(the_device);  /* the system's own reference: the device is never freed */
    }
    retain(the_device);  /* the Create rule: the caller owns one reference */
    pthread_mutex_unlock(&device_lock);
    return the_device;
}

static void *Device_newCommandQueue(mtldevice *self, SEL s, unsigned long max) {
    (void)s;
    if (max == 0 || max > 1u << 20) fail("newCommandQueueWithMaxCommandBufferCount: %lu", max);
    mtlqueue *q = new_object(&MTLCommandQueue_class);
    pthread_mutex_init(&q->lock, NULL);
    pthread_cond_init(&q->cond, NULL);
    q->device = retain(self);
    q->max_buffers = max;
    return q;
}

static mtlbuffer *make_buffer(unsigned long length, unsigned long options, const char *what) {
    if (options != 0) fail("%s: options %#lx (the simulation has shared storage only)", what,
                           options);
    if (length == 0) fail("%s: length 0", what);
    size_t page = (size_t)getpagesize();
    void *memory = NULL;
    if (posix_memalign(&memory, page, (length + page - 1) / page * page)) return NULL;
    memset(memory, 0, length);
    mtlbuffer *b = new_object(&MTLBuffer_class);
    b->contents = memory;
    b->length = length;
    b->owned = 1;
    return b;
}

static void *Device_newBuffer(mtldevice *self, SEL s, unsigned long length,
                              unsigned long options) {
    (void)self, (void)s;
    return make_buffer(length, options, "newBufferWithLength:options:");
}

static void *Device_newBufferWithBytes(mtldevice *self, SEL s, const void *bytes,
                                       unsigned long length, unsigned long options) {
    (void)self, (void)s;
    mtlbuffer *b = make_buffer(length, options, "newBufferWithBytes:length:options:");
    if (b) memcpy(b->contents, bytes, length);
    return b;
}

static void *Device_newBufferNoCopy(mtldevice *self, SEL s, void *pointer, unsigned long length,
                                    unsigned long options, void *deallocator) {
    (void)self, (void)s;
    const char *what = "newBufferWithBytesNoCopy:length:options:deallocator:";
    if (options != 0) fail("%s: options %#lx", what, options);
    if (deallocator) fail("%s: the simulation takes no deallocator block", what);
    unsigned long page = (unsigned long)getpagesize();
    /* Metal refuses memory that is not whole pages (it returns nil). */
    if (!pointer || (uintptr_t)pointer % page || length == 0 || length % page) return NULL;
    mtlbuffer *b = new_object(&MTLBuffer_class);
    b->contents = pointer;
    b->length = length;
    return b;
}

static void *Device_newSharedEvent(mtldevice *self, SEL s) {
    (void)self, (void)s;
    mtlevent *e = new_object(&MTLSharedEvent_class);
    pthread_mutex_init(&e->lock, NULL);
    pthread_cond_init(&e->cond, NULL);
    return e;
}

static void *set_error(void **error, const char *text) {
    if (error) *error = autorelease(make_error(text));
    return NULL;
}

static void *Device_newLibraryWithData(mtldevice *self, SEL s, ddata *data, void **error) {
    (void)self, (void)s;
    expect(data, &OS_dispatch_data_class, "newLibraryWithData:error:");
    if (data->size < 8 || memcmp(data->bytes, "MTLB", 4) ||
        memcmp((char *)data->bytes + data->size - 4, "ENDT", 4))
        return set_error(error, "Invalid library file");
    /* A file of its own per library: dlopen returns the library already loaded under
     * the same path (a reused /proc/self/fd/N would name an earlier one). */
    char path[] = "/tmp/asyncmetal-sim-library-XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0) return set_error(error, strerror(errno));
    const char *p = (char *)data->bytes + 4;
    size_t left = data->size - 8;
    while (left) {
        ssize_t n = write(fd, p, left);
        if (n <= 0) {
            close(fd);
            unlink(path);
            return set_error(error, "cannot write the library");
        }
        p += n, left -= (size_t)n;
    }
    close(fd);
    void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    unlink(path);
    if (!handle) return set_error(error, dlerror());
    mtllibrary *lib = new_object(&MTLLibrary_class);
    lib->handle = handle;  /* never dlclosed: a zombie function may still point into it */
    return lib;
}

static void *Device_newPipeline(mtldevice *self, SEL s, mtlfunction *function, void **error) {
    (void)self, (void)s;
    (void)error;
    expect(function, &MTLFunction_class, "newComputePipelineStateWithFunction:error:");
    mtlpipeline *p = new_object(&MTLComputePipelineState_class);
    p->function = retain(function);
    return p;
}

static void *Device_name(mtldevice *self, SEL s) {
    (void)s;
    return self->name;  /* a property: owned by the device */
}

static uint64_t Device_recommendedMaxWorkingSetSize(mtldevice *self, SEL s) {
    (void)self, (void)s;
    const char *text = getenv("ASYNCMETAL_SIM_MEMORY");
    return text ? strtoull(text, NULL, 0) : 1ull << 30;
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

/* ------------------------------------------------------------ class tables ------ */

static const method NSString_meta_methods[] = {
    M("stringWithUTF8String:", NSString_stringWithUTF8String), {0, 0}};
static const method NSString_methods[] = {M("UTF8String", NSString_UTF8String), {0, 0}};
static const method NSError_methods[] = {
    M("localizedDescription", NSError_localizedDescription), {0, 0}};
static const method MTLDevice_methods[] = {
    M("newCommandQueueWithMaxCommandBufferCount:", Device_newCommandQueue),
    M("newBufferWithLength:options:", Device_newBuffer),
    M("newBufferWithBytes:length:options:", Device_newBufferWithBytes),
    M("newBufferWithBytesNoCopy:length:options:deallocator:", Device_newBufferNoCopy),
    M("newSharedEvent", Device_newSharedEvent),
    M("newLibraryWithData:error:", Device_newLibraryWithData),
    M("newComputePipelineStateWithFunction:error:", Device_newPipeline),
    M("name", Device_name),
    M("recommendedMaxWorkingSetSize", Device_recommendedMaxWorkingSetSize),
    {0, 0}};
static const method MTLCommandQueue_methods[] = {
    M("commandBuffer", MTLCommandQueue_commandBuffer), {0, 0}};
static const method MTLCommandBuffer_methods[] = {
    M("computeCommandEncoder", MTLCommandBuffer_computeCommandEncoder),
    M("blitCommandEncoder", MTLCommandBuffer_blitCommandEncoder),
    M("encodeWaitForEvent:value:", MTLCommandBuffer_encodeWait),
    M("encodeSignalEvent:value:", MTLCommandBuffer_encodeSignal),
    M("addCompletedHandler:", MTLCommandBuffer_addCompletedHandler),
    M("commit", MTLCommandBuffer_commit),
    M("waitUntilCompleted", MTLCommandBuffer_waitUntilCompleted),
    M("status", MTLCommandBuffer_status),
    M("error", MTLCommandBuffer_error),
    M("GPUStartTime", MTLCommandBuffer_GPUStartTime),
    M("GPUEndTime", MTLCommandBuffer_GPUEndTime),
    {0, 0}};
static const method MTLComputeCommandEncoder_methods[] = {
    M("setComputePipelineState:", Compute_setPipeline),
    M("setBuffer:offset:atIndex:", Compute_setBuffer),
    M("setBytes:length:atIndex:", Compute_setBytes),
    M("dispatchThreads:threadsPerThreadgroup:", Compute_dispatchThreads),
    M("dispatchThreadgroups:threadsPerThreadgroup:", Compute_dispatchThreadgroups),
    M("endEncoding", Encoder_endEncoding),
    {0, 0}};
static const method MTLBlitCommandEncoder_methods[] = {
    M("copyFromBuffer:sourceOffset:toBuffer:destinationOffset:size:", Blit_copy),
    M("endEncoding", Encoder_endEncoding),
    {0, 0}};
static const method MTLBuffer_methods[] = {
    M("contents", MTLBuffer_contents), M("length", MTLBuffer_length), {0, 0}};
static const method MTLSharedEvent_methods[] = {
    M("signaledValue", MTLSharedEvent_signaledValue),
    M("setSignaledValue:", MTLSharedEvent_setSignaledValue),
    M("notifyListener:atValue:block:", MTLSharedEvent_notify),
    {0, 0}};
static const method MTLSharedEventListener_meta_methods[] = {
    M("alloc", MTLSharedEventListener_alloc), {0, 0}};
static const method MTLSharedEventListener_methods[] = {
    M("initWithDispatchQueue:", MTLSharedEventListener_init), {0, 0}};
static const method MTLLibrary_methods[] = {
    M("newFunctionWithName:", MTLLibrary_newFunctionWithName), {0, 0}};
static const method MTLComputePipelineState_methods[] = {
    M("maxTotalThreadsPerThreadgroup", MTLPipeline_maxThreads), {0, 0}};
static const method no_methods[] = {{0, 0}};

#define CLASS(cls, super, meta_methods, methods, type, dealloc)                           \
    sim_class cls##_meta = {{NULL, MAGIC_LIVE, 1, 1}, #cls, &NSObject_class, meta_methods, \
                            0, NULL, 0};                                                  \
    sim_class cls##_class = {{&cls##_meta, MAGIC_LIVE, 1, 1}, #cls, super, methods,       \
                             sizeof(type), dealloc, 0};

CLASS(NSObject, NULL, no_methods, NSObject_methods, object, NULL)
CLASS(NSString, &NSObject_class, NSString_meta_methods, NSString_methods, nsstring,
      nsstring_dealloc)
CLASS(NSError, &NSObject_class, no_methods, NSError_methods, nserror, nserror_dealloc)
CLASS(MTLDevice, &NSObject_class, no_methods, MTLDevice_methods, mtldevice, NULL)
CLASS(MTLCommandQueue, &NSObject_class, no_methods, MTLCommandQueue_methods, mtlqueue,
      mtlqueue_dealloc)
CLASS(MTLCommandBuffer, &NSObject_class, no_methods, MTLCommandBuffer_methods, mtlcmdbuf,
      mtlcmdbuf_dealloc)
CLASS(MTLComputeCommandEncoder, &NSObject_class, no_methods, MTLComputeCommandEncoder_methods,
      mtlencoder, mtlencoder_dealloc)
CLASS(MTLBlitCommandEncoder, &NSObject_class, no_methods, MTLBlitCommandEncoder_methods,
      mtlencoder, mtlencoder_dealloc)
CLASS(MTLBuffer, &NSObject_class, no_methods, MTLBuffer_methods, mtlbuffer, mtlbuffer_dealloc)
CLASS(MTLSharedEvent, &NSObject_class, no_methods, MTLSharedEvent_methods, mtlevent,
      mtlevent_dealloc)
CLASS(MTLSharedEventListener, &NSObject_class, MTLSharedEventListener_meta_methods,
      MTLSharedEventListener_methods, mtllistener, mtllistener_dealloc)
CLASS(MTLLibrary, &NSObject_class, no_methods, MTLLibrary_methods, mtllibrary, NULL)
CLASS(MTLFunction, &NSObject_class, no_methods, no_methods, mtlfunction, mtlfunction_dealloc)
CLASS(MTLComputePipelineState, &NSObject_class, no_methods, MTLComputePipelineState_methods,
      mtlpipeline, mtlpipeline_dealloc)
CLASS(OS_dispatch_queue, &NSObject_class, no_methods, no_methods, dqueue, NULL)
CLASS(OS_dispatch_data, &NSObject_class, no_methods, no_methods, ddata, ddata_dealloc)

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

IMP sim_lookup(object *receiver, SEL sel) {
    if (!receiver) return sim_nil;  /* a message to nil returns 0 / 0.0 */
    check_live(receiver, sel);
    for (const sim_class *c = receiver->isa; c; c = c->super)
        for (const method *m = c->methods; m->name; m++)
            if (strcmp(m->name, sel) == 0) return m->imp;
    fail("%c[%s %s]: unrecognized selector sent to %s %p", receiver->is_class ? '+' : '-',
         class_name(receiver), sel, receiver->is_class ? "class" : "instance",
         (void *)receiver);
}

/* Save the argument registers (integer, vector, and %al, the vector-register count of a
 * variadic call), look the method up, restore them and tail-jump: the method sees its
 * arguments and stack exactly as objc_msgSend's caller set them. */
__asm__(
    ".text\n"
    ".globl objc_msgSend\n"
    ".type objc_msgSend, @function\n"
    "objc_msgSend:\n"
    "    push %rbp\n"
    "    mov %rsp, %rbp\n"
    "    sub $0xd0, %rsp\n"
    "    mov %rdi, 0x00(%rsp)\n"
    "    mov %rsi, 0x08(%rsp)\n"
    "    mov %rdx, 0x10(%rsp)\n"
    "    mov %rcx, 0x18(%rsp)\n"
    "    mov %r8, 0x20(%rsp)\n"
    "    mov %r9, 0x28(%rsp)\n"
    "    mov %rax, 0x30(%rsp)\n"
    "    movdqa %xmm0, 0x40(%rsp)\n"
    "    movdqa %xmm1, 0x50(%rsp)\n"
    "    movdqa %xmm2, 0x60(%rsp)\n"
    "    movdqa %xmm3, 0x70(%rsp)\n"
    "    movdqa %xmm4, 0x80(%rsp)\n"
    "    movdqa %xmm5, 0x90(%rsp)\n"
    "    movdqa %xmm6, 0xa0(%rsp)\n"
    "    movdqa %xmm7, 0xb0(%rsp)\n"
    "    call sim_lookup\n"
    "    mov %rax, %r11\n"
    "    mov 0x00(%rsp), %rdi\n"
    "    mov 0x08(%rsp), %rsi\n"
    "    mov 0x10(%rsp), %rdx\n"
    "    mov 0x18(%rsp), %rcx\n"
    "    mov 0x20(%rsp), %r8\n"
    "    mov 0x28(%rsp), %r9\n"
    "    mov 0x30(%rsp), %rax\n"
    "    movdqa 0x40(%rsp), %xmm0\n"
    "    movdqa 0x50(%rsp), %xmm1\n"
    "    movdqa 0x60(%rsp), %xmm2\n"
    "    movdqa 0x70(%rsp), %xmm3\n"
    "    movdqa 0x80(%rsp), %xmm4\n"
    "    movdqa 0x90(%rsp), %xmm5\n"
    "    movdqa 0xa0(%rsp), %xmm6\n"
    "    movdqa 0xb0(%rsp), %xmm7\n"
    "    leave\n"
    "    jmp *%r11\n"
    ".size objc_msgSend, .-objc_msgSend\n"
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

/* The compiler service is in compiler.c. */

/* Completed handlers run so far, and how many of them on the thread that committed. */
long asyncmetal_sim_handlers(int on_committer) {
    return on_committer ? (long)handlers_on_committer : (long)handlers_run;
}
