/* The simulated Metal's command queues and command buffers, and the "GPU" thread of
 * each queue that runs its committed command buffers in order (sim.h lists the files). */
#include "sim.h"

/* ------------------------------------------------------------ command buffers ------ */

/* Before Metal's last Block_release of a block it kept: the block must still be the block
 * it copied (memory its owner freed, or reused, would be corrupted by the release). */
static void check_block_intact(const void *block, void *isa, int flags, const char *what) {
    const struct { void *isa; int flags; } *b = block;
    if (b->isa != isa || b->flags != flags)
        fail("%s: the block at %p was freed or overwritten while Metal still held it "
             "(isa %p flags %#x, were %p %#x)", what, block, b->isa, b->flags, isa, flags);
}

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

void free_command(command *c) {
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
    if (cb->status == STATUS_NOT_ENQUEUED) {
        /* Never committed: it no longer counts against the queue's limit. */
        mtlqueue *q = cb->queue;
        pthread_mutex_lock(&q->lock);
        q->outstanding--;
        pthread_cond_broadcast(&q->cond);
        pthread_mutex_unlock(&q->lock);
    }
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

void add_command(mtlcmdbuf *cb, command *c) {
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
/* ------------------------------------------------------------- the GPU thread ------ */

static _Atomic long handlers_run, handlers_on_committer, handlers_returned, buffers_let_go;

/* (test query) Completed handlers run so far (0), how many of them on the thread that
 * committed (1), how many of them returned (2), and command buffers whose handlers all
 * ran and that the queue let go of since (3). */
long asyncmetal_sim_handlers(int which) {
    return which == 3   ? (long)buffers_let_go
           : which == 2 ? (long)handlers_returned
           : which == 1 ? (long)handlers_on_committer
                        : (long)handlers_run;
}

static void run_handlers(void *p) {
    mtlcmdbuf *cb = p;
    for (handler *h = cb->handlers; h; h = h->next) {
        atomic_fetch_add(&handlers_run, 1);
        if (pthread_equal(pthread_self(), cb->committer))
            atomic_fetch_add(&handlers_on_committer, 1);
        h->block(cb);
        atomic_fetch_add(&handlers_returned, 1);
    }
    mtlqueue *q = cb->queue;
    pthread_mutex_lock(&q->lock);
    q->outstanding--;
    pthread_cond_broadcast(&q->cond);
    pthread_mutex_unlock(&q->lock);
    release(cb);  /* the queue's reference, taken at commit */
    atomic_fetch_add(&buffers_let_go, 1);
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
        case CMD_FILL:
            if (!fault) memset(c->dst->contents + c->dst_offset, c->fill_value, c->size);
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
        pthread_mutex_lock(&q->lock);
        if (q->hold_handlers || q->held_head) {  /* (test hook) kept back, in order */
            cb->next = NULL;
            if (q->held_tail) q->held_tail->next = cb; else q->held_head = cb;
            q->held_tail = cb;
            cb = NULL;
        }
        pthread_mutex_unlock(&q->lock);
        if (cb) dispatch_async_f(device->completions, cb, run_handlers);
    }
}

/* (test query) Hold back the completed handlers of `queue`'s command buffers (hold 1): the
 * queue's GPU thread goes on running its command buffers (their signals included), and
 * their handlers are called, in order, once released (hold 0). As Metal may call one
 * queue's handlers long after another's that completed later. */
void asyncmetal_sim_hold_handlers(mtlqueue *queue, int hold) {
    expect(queue, &MTLCommandQueue_class, "asyncmetal_sim_hold_handlers");
    mtldevice *device = (mtldevice *)queue->device;
    pthread_mutex_lock(&queue->lock);
    queue->hold_handlers = hold;
    mtlcmdbuf *held = hold ? NULL : queue->held_head;
    if (!hold) queue->held_head = queue->held_tail = NULL;
    pthread_mutex_unlock(&queue->lock);
    while (held) {
        mtlcmdbuf *next = held->next;
        dispatch_async_f(device->completions, held, run_handlers);
        held = next;
    }
}

static void mtlqueue_dealloc(object *o) { release(((mtlqueue *)o)->device); }

/* ---------------------------------------------------------------- classes ------ */

static const method MTLCommandQueue_methods[] = {
    M("commandBuffer", MTLCommandQueue_commandBuffer), {0, 0}};
CLASS(MTLCommandQueue, &NSObject_class, no_methods, MTLCommandQueue_methods, mtlqueue,
      mtlqueue_dealloc)
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
CLASS(MTLCommandBuffer, &NSObject_class, no_methods, MTLCommandBuffer_methods, mtlcmdbuf,
      mtlcmdbuf_dealloc)
