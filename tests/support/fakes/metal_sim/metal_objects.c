/* The simulated Metal's device, buffers, shared events (and their listeners),
 * libraries, functions and pipeline states (sim.h lists the files). */
#include "sim.h"

/* ----------------------------------------------------------------- MTLBuffer ------ */

static void mtlbuffer_dealloc(object *o) {
    mtlbuffer *b = (mtlbuffer *)o;
    if (b->owned) free(b->contents);
}

static void *MTLBuffer_contents(mtlbuffer *self, SEL s) { (void)s; return self->contents; }
static unsigned long MTLBuffer_length(mtlbuffer *self, SEL s) { (void)s; return self->length; }

/* ----------------------------------------------------------- MTLSharedEvent ------ */

static void mtllistener_dealloc(object *o) { release(((mtllistener *)o)->queue); }

static void run_notification(void *p) {
    fired *f = p;
    f->n->block(f->event, f->value);
    Block_release(f->n->block);
    release(f->n->listener);
    release(f->event);
    free(f->n);
    free(f);
}

void check_block_signature(const void *block, const char *want, const char *what) {
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
void event_set(mtlevent *e, uint64_t value) {
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
    snprintf(symbol, sizeof symbol, "__asyncmetal_sim_sizes_%s", name->text);
    const int *(*sizes)(void) = (const int *(*)(void))dlsym(self->handle, symbol);
    if (!fn || !params || !sizes) return NULL;
    mtlfunction *f = new_object(&MTLFunction_class);
    f->library = retain(self);
    f->fn = fn;
    f->params = params;
    f->sizes = sizes();
    snprintf(f->name, sizeof f->name, "%s", name->text);
    return f;
}

static unsigned long MTLPipeline_maxThreads(object *self, SEL s) {
    (void)self, (void)s;
    return 1024;
}
/* ------------------------------------------------------------------ MTLDevice ------ */

static mtldevice *the_device;
static pthread_mutex_t device_lock = PTHREAD_MUTEX_INITIALIZER;

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

/* MTLDevice.maxBufferLength: $ASYNCMETAL_SIM_MAX_BUFFER, default 1 GiB. */
static unsigned long max_buffer_length(void) {
    const char *text = getenv("ASYNCMETAL_SIM_MAX_BUFFER");
    return text ? strtoul(text, NULL, 0) : 1ul << 30;
}

static unsigned long Device_maxBufferLength(mtldevice *self, SEL s) {
    (void)self, (void)s;
    return max_buffer_length();
}

static mtlbuffer *make_buffer(unsigned long length, unsigned long options, const char *what) {
    if (options != 0) fail("%s: options %#lx (the simulation has shared storage only)", what,
                           options);
    if (length == 0) fail("%s: length 0", what);
    if (length > max_buffer_length()) return NULL;  /* as Metal: nil above maxBufferLength */
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
    /* Metal refuses memory that is not whole pages, and lengths above maxBufferLength
     * (it returns nil). */
    if (!pointer || (uintptr_t)pointer % page || length == 0 || length % page) return NULL;
    if (length > max_buffer_length()) return NULL;
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

/* MTLDevice.maxThreadsPerThreadgroup: the most threads of a threadgroup in each
 * dimension (1024 x 1024 x 64), besides the most in all (a pipeline's
 * maxTotalThreadsPerThreadgroup). An MTLSize: returned in memory on x86-64, so sent with
 * objc_msgSend_stret (objc_runtime.c). */
MTLSize max_threads_per_threadgroup(void) { return (MTLSize){1024, 1024, 64}; }

static MTLSize Device_maxThreadsPerThreadgroup(mtldevice *self, SEL s) {
    (void)self, (void)s;
    return max_threads_per_threadgroup();
}

/* ---------------------------------------------------------------- classes ------ */

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
    M("maxBufferLength", Device_maxBufferLength),
    M("maxThreadsPerThreadgroup", Device_maxThreadsPerThreadgroup),
    {0, 0}};
CLASS(MTLDevice, &NSObject_class, no_methods, MTLDevice_methods, mtldevice, NULL)
static const method MTLBuffer_methods[] = {
    M("contents", MTLBuffer_contents), M("length", MTLBuffer_length), {0, 0}};
CLASS(MTLBuffer, &NSObject_class, no_methods, MTLBuffer_methods, mtlbuffer, mtlbuffer_dealloc)
static const method MTLSharedEvent_methods[] = {
    M("signaledValue", MTLSharedEvent_signaledValue),
    M("setSignaledValue:", MTLSharedEvent_setSignaledValue),
    M("notifyListener:atValue:block:", MTLSharedEvent_notify),
    {0, 0}};
CLASS(MTLSharedEvent, &NSObject_class, no_methods, MTLSharedEvent_methods, mtlevent,
      mtlevent_dealloc)
static const method MTLSharedEventListener_meta_methods[] = {
    M("alloc", MTLSharedEventListener_alloc), {0, 0}};
static const method MTLSharedEventListener_methods[] = {
    M("initWithDispatchQueue:", MTLSharedEventListener_init), {0, 0}};
CLASS(MTLSharedEventListener, &NSObject_class, MTLSharedEventListener_meta_methods,
      MTLSharedEventListener_methods, mtllistener, mtllistener_dealloc)
static const method MTLLibrary_methods[] = {
    M("newFunctionWithName:", MTLLibrary_newFunctionWithName), {0, 0}};
CLASS(MTLLibrary, &NSObject_class, no_methods, MTLLibrary_methods, mtllibrary, NULL)
CLASS(MTLFunction, &NSObject_class, no_methods, no_methods, mtlfunction, mtlfunction_dealloc)
static const method MTLComputePipelineState_methods[] = {
    M("maxTotalThreadsPerThreadgroup", MTLPipeline_maxThreads), {0, 0}};
CLASS(MTLComputePipelineState, &NSObject_class, no_methods, MTLComputePipelineState_methods,
      mtlpipeline, mtlpipeline_dealloc)
