/* asyncmetal's native runtime for the cpu device (and the fd wake-ups of any backend).
 *
 * Queue threads live here, not in Python: they never take the GIL. A queue runs its
 * commands in order (kernel calls, memmoves, timeline signals and waits) and signals its
 * own timeline after each. When a timeline reaches the value a loop waits for, the loop's
 * notifier gets one byte on its pipe -- only if none is pending -- so one wake-up of the
 * loop serves every completion since its last drain.
 *
 * Built by asyncmetal at first use with the system C compiler: cc -O2 -shared -fPIC -pthread
 */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define AM_MAX_ARGS 16

typedef struct am_notifier {
    atomic_int pending;
    int fd;
} am_notifier;

struct am_timeline;

typedef struct am_watch {
    _Atomic uint64_t next;          /* smallest value its loop waits for */
    am_notifier *notifier;
    struct am_timeline *timeline;
    struct am_watch *link;
} am_watch;

typedef struct am_timeline {
    _Atomic uint64_t value;         /* first member: Python reads it in place */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    am_watch *watches;
} am_timeline;

enum { CMD_CALL = 1, CMD_COPY, CMD_SIGNAL, CMD_WAIT };

typedef struct {
    int kind;
    int nargs;
    void *fn;
    int64_t args[AM_MAX_ARGS];
    am_timeline *timeline;
    uint64_t target;
    void *dst;
    const void *src;
    size_t nbytes;
    int64_t *record;                /* start_ns, end_ns, value: a row of a ring */
    uint64_t value;                 /* the queue's own timeline value after it */
} am_cmd;

typedef struct am_queue {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    am_cmd *ring;
    size_t cap, head, count;
    atomic_size_t pending;          /* commands submitted and not yet taken */
    int stop;                       /* 1: finish what is queued, 2: abandon now */
    int sleeping;
    long spin_ns;
    am_timeline *own;
    am_timeline *waiting_on;
} am_queue;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* ---- notifiers and watches ------------------------------------------------------- */

am_notifier *am_notifier_new(int fd) {
    am_notifier *n = calloc(1, sizeof *n);
    if (n) n->fd = fd;
    return n;
}

void am_notifier_free(am_notifier *n) { free(n); }

static void notify(am_notifier *n) {
    if (!atomic_exchange(&n->pending, 1)) {
        char one = 1;
        ssize_t r;
        do { r = write(n->fd, &one, 1); } while (r < 0 && errno == EINTR);
    }
}

/* Called by the loop after emptying its pipe and before reading the values: any later
 * advance writes again. */
void am_notifier_reset(am_notifier *n) { atomic_store(&n->pending, 0); }

am_watch *am_watch_new(am_timeline *t, am_notifier *n) {
    am_watch *w = calloc(1, sizeof *w);
    if (!w) return NULL;
    atomic_store(&w->next, UINT64_MAX);
    w->notifier = n;
    w->timeline = t;
    pthread_mutex_lock(&t->mu);
    w->link = t->watches;
    t->watches = w;
    pthread_mutex_unlock(&t->mu);
    return w;
}

void am_watch_free(am_watch *w) {
    am_timeline *t = w->timeline;
    pthread_mutex_lock(&t->mu);
    for (am_watch **p = &t->watches; *p; p = &(*p)->link) {
        if (*p == w) { *p = w->link; break; }
    }
    pthread_mutex_unlock(&t->mu);
    free(w);
}

/* Publish the smallest awaited value; returns 1 if it is already reached. The seq_cst
 * store-then-load pairs with am_timeline_signal's store-then-load: no wake-up is lost. */
int am_watch_arm(am_watch *w, uint64_t next) {
    atomic_store(&w->next, next);
    return atomic_load(&w->timeline->value) >= next;
}

/* ---- timelines ------------------------------------------------------------------- */

static void timeline_init(am_timeline *t) {
    memset(t, 0, sizeof *t);
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->cv, NULL);
}

am_timeline *am_timeline_new(void) {
    am_timeline *t = malloc(sizeof *t);
    if (t) timeline_init(t);
    return t;
}

/* A timeline placed in caller-owned memory (e.g. pinned host memory a GPU can wait
 * on: its value is the first 8 bytes). The caller frees the memory after fini. */
size_t am_timeline_size(void) { return sizeof(am_timeline); }
am_timeline *am_timeline_init_at(void *memory) {
    timeline_init(memory);
    return memory;
}
void am_timeline_fini(am_timeline *t) {
    pthread_mutex_destroy(&t->mu);
    pthread_cond_destroy(&t->cv);
}

void am_timeline_free(am_timeline *t) {
    am_timeline_fini(t);
    free(t);
}

uint64_t am_timeline_value(am_timeline *t) { return atomic_load(&t->value); }

/* For a timeline whose value a device writes in place (a GPU's stream memory op): raise
 * it to at least v and wake whoever waits up to the value now held. */
void am_timeline_poke(am_timeline *t, uint64_t v) {
    pthread_mutex_lock(&t->mu);
    if (v > atomic_load(&t->value)) atomic_store(&t->value, v);
    v = atomic_load(&t->value);
    pthread_cond_broadcast(&t->cv);
    for (am_watch *w = t->watches; w; w = w->link)
        if (v >= atomic_load(&w->next)) notify(w->notifier);
    pthread_mutex_unlock(&t->mu);
}

void am_timeline_signal(am_timeline *t, uint64_t v) {
    pthread_mutex_lock(&t->mu);
    if (v > atomic_load(&t->value)) {
        atomic_store(&t->value, v);
        pthread_cond_broadcast(&t->cv);
        for (am_watch *w = t->watches; w; w = w->link)
            if (v >= atomic_load(&w->next)) notify(w->notifier);
    }
    pthread_mutex_unlock(&t->mu);
}

/* ---- queues ---------------------------------------------------------------------- */

typedef void (*am_kernel)(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                          int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                          int64_t, int64_t);

static int take(am_queue *q, am_cmd *out) {
    /* A short spin first: a command submitted right behind the last one then starts
     * without a sleep/wake round trip. Bounded by spin_ns after each command. */
    if (q->spin_ns > 0 && atomic_load(&q->pending) == 0) {
        int64_t deadline = now_ns() + q->spin_ns;
        while (atomic_load(&q->pending) == 0 && now_ns() < deadline) sched_yield();
    }
    pthread_mutex_lock(&q->mu);
    while (q->count == 0 && !q->stop) {
        q->sleeping = 1;
        pthread_cond_wait(&q->cv, &q->mu);
        q->sleeping = 0;
    }
    if (q->stop == 2 || (q->count == 0 && q->stop)) {
        pthread_mutex_unlock(&q->mu);
        return 0;
    }
    *out = q->ring[q->head];
    q->head = (q->head + 1) % q->cap;
    q->count--;
    atomic_fetch_sub(&q->pending, 1);
    pthread_mutex_unlock(&q->mu);
    return 1;
}

static int wait_timeline(am_queue *q, am_timeline *t, uint64_t target) {
    pthread_mutex_lock(&q->mu);
    q->waiting_on = t;
    int abandon = q->stop == 2;
    pthread_mutex_unlock(&q->mu);
    pthread_mutex_lock(&t->mu);
    while (!abandon && atomic_load(&t->value) < target) {
        pthread_cond_wait(&t->cv, &t->mu);
        abandon = __atomic_load_n(&q->stop, __ATOMIC_SEQ_CST) == 2;
    }
    pthread_mutex_unlock(&t->mu);
    pthread_mutex_lock(&q->mu);
    q->waiting_on = NULL;
    pthread_mutex_unlock(&q->mu);
    return !abandon;
}

static void *run(void *arg) {
    am_queue *q = arg;
    am_cmd c;
    while (take(q, &c)) {
        if (c.record) {  /* the row's value goes last, so a reader can tell a torn row */
            __atomic_store_n(&c.record[2], 0, __ATOMIC_RELEASE);
            c.record[0] = now_ns();
        }
        switch (c.kind) {
        case CMD_CALL:
            ((am_kernel)c.fn)(c.args[0], c.args[1], c.args[2], c.args[3], c.args[4], c.args[5],
                              c.args[6], c.args[7], c.args[8], c.args[9], c.args[10],
                              c.args[11], c.args[12], c.args[13], c.args[14], c.args[15]);
            break;
        case CMD_COPY:
            memmove(c.dst, c.src, c.nbytes);
            break;
        case CMD_SIGNAL:
            am_timeline_signal(c.timeline, c.target);
            break;
        case CMD_WAIT:
            if (!wait_timeline(q, c.timeline, c.target)) return NULL;
            break;
        }
        if (c.record) {
            c.record[1] = now_ns();
            __atomic_store_n(&c.record[2], (int64_t)c.value, __ATOMIC_RELEASE);
        }
        am_timeline_signal(q->own, c.value);
    }
    return NULL;
}

am_queue *am_queue_new(am_timeline *own, long spin_ns) {
    am_queue *q = calloc(1, sizeof *q);
    if (!q) return NULL;
    q->cap = 64;
    q->ring = calloc(q->cap, sizeof(am_cmd));
    q->own = own;
    q->spin_ns = spin_ns;
    pthread_mutex_init(&q->mu, NULL);
    pthread_cond_init(&q->cv, NULL);
    if (!q->ring || pthread_create(&q->thread, NULL, run, q) != 0) {
        free(q->ring);
        free(q);
        return NULL;
    }
    return q;
}

static int push(am_queue *q, const am_cmd *c) {
    pthread_mutex_lock(&q->mu);
    if (q->count == q->cap) {
        am_cmd *ring = malloc(2 * q->cap * sizeof(am_cmd));
        if (!ring) { pthread_mutex_unlock(&q->mu); return -1; }
        for (size_t i = 0; i < q->count; i++) ring[i] = q->ring[(q->head + i) % q->cap];
        free(q->ring);
        q->ring = ring;
        q->head = 0;
        q->cap *= 2;
    }
    q->ring[(q->head + q->count) % q->cap] = *c;
    q->count++;
    atomic_fetch_add(&q->pending, 1);
    if (q->sleeping) pthread_cond_signal(&q->cv);
    pthread_mutex_unlock(&q->mu);
    return 0;
}

int am_queue_call(am_queue *q, void *fn, int nargs, const int64_t *args, int64_t *record,
                  uint64_t value) {
    am_cmd c = {.kind = CMD_CALL, .fn = fn, .nargs = nargs, .record = record, .value = value};
    if (nargs < 0 || nargs > AM_MAX_ARGS) return -2;
    memcpy(c.args, args, (size_t)nargs * sizeof(int64_t));
    return push(q, &c);
}

int am_queue_copy(am_queue *q, void *dst, const void *src, size_t nbytes, int64_t *record,
                  uint64_t value) {
    am_cmd c = {.kind = CMD_COPY, .dst = dst, .src = src, .nbytes = nbytes, .record = record,
                .value = value};
    return push(q, &c);
}

int am_queue_signal(am_queue *q, am_timeline *t, uint64_t target, uint64_t value) {
    am_cmd c = {.kind = CMD_SIGNAL, .timeline = t, .target = target, .value = value};
    return push(q, &c);
}

int am_queue_wait(am_queue *q, am_timeline *t, uint64_t target, uint64_t value) {
    am_cmd c = {.kind = CMD_WAIT, .timeline = t, .target = target, .value = value};
    return push(q, &c);
}

/* Stop the thread and free the queue. abandon=0: after everything queued has run;
 * abandon=1: now, leaving a pending device-side wait (interpreter exit). Blocks. */
void am_queue_close(am_queue *q, int abandon) {
    pthread_mutex_lock(&q->mu);
    __atomic_store_n(&q->stop, abandon ? 2 : 1, __ATOMIC_SEQ_CST);
    pthread_cond_signal(&q->cv);
    am_timeline *t = q->waiting_on;
    pthread_mutex_unlock(&q->mu);
    if (t && abandon) {
        pthread_mutex_lock(&t->mu);
        pthread_cond_broadcast(&t->cv);
        pthread_mutex_unlock(&t->mu);
    }
    pthread_join(q->thread, NULL);
    pthread_mutex_destroy(&q->mu);
    pthread_cond_destroy(&q->cv);
    free(q->ring);
    free(q);
}

/* ---- CUDA completion --------------------------------------------------------------
 * One thread per CUDA stream waits, in order, on the blocking-sync events recorded after
 * its commands, then raises the stream's mirror timeline (and the timeline a signal
 * command raised), which wakes the loops through their pipes. It never takes the GIL and
 * calls nothing but cuCtxSetCurrent and cuEventSynchronize, looked up in libcuda. */
#include <dlfcn.h>

typedef int (*cu_ctx_fn)(void *);
typedef int (*cu_event_fn)(void *);

typedef struct {
    void *event;
    uint64_t value;
    am_timeline *extra;             /* a timeline this command signals, or NULL */
    uint64_t extra_value;
    long spin_ns;                   /* how long to poll before blocking on the event */
} am_cuentry;

typedef struct am_cuwaiter {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    am_cuentry *ring;
    size_t cap, head, count;
    void **done;                    /* waited-on events, for the submitter to reuse */
    size_t done_cap, done_count;
    int stop;
    void *ctx;
    am_timeline *mirror;
    cu_ctx_fn set_ctx;
    cu_event_fn sync;
    _Atomic uint64_t *word;         /* the stream's timeline value, written by the GPU */
    long spin_ns;
    int error;                      /* the first CUDA error: sticky */
    uint64_t error_value;           /* the value of the command that saw it */
} am_cuwaiter;

static void *cuwait_run(void *arg) {
    am_cuwaiter *w = arg;
    w->set_ctx(w->ctx);
    for (;;) {
        pthread_mutex_lock(&w->mu);
        while (w->count == 0 && !w->stop) pthread_cond_wait(&w->cv, &w->mu);
        if (w->count == 0) { pthread_mutex_unlock(&w->mu); return NULL; }
        am_cuentry e = w->ring[w->head];
        pthread_mutex_unlock(&w->mu);
        /* A short spin on the value the GPU writes before blocking on the event: a
         * completion that is about to happen is seen within a microsecond instead of
         * after an interrupt and a thread wake-up. Bounded by spin_ns per command. */
        if (w->word && !w->error) {
            int64_t deadline = now_ns() + (e.spin_ns > w->spin_ns ? e.spin_ns : w->spin_ns);
            while (atomic_load(w->word) < e.value && now_ns() < deadline) sched_yield();
        }
        int r = w->error ? w->error : w->sync(e.event);
        pthread_mutex_lock(&w->mu);
        w->head = (w->head + 1) % w->cap;
        w->count--;
        if (r && !w->error) { w->error = r; w->error_value = e.value; }
        if (w->done_count < w->done_cap) w->done[w->done_count++] = e.event;
        pthread_mutex_unlock(&w->mu);
        if (e.extra && !r) am_timeline_poke(e.extra, e.extra_value);
        am_timeline_poke(w->mirror, r ? UINT64_MAX : e.value);
    }
}

am_cuwaiter *am_cuwaiter_new(void *ctx, am_timeline *mirror, long spin_ns) {
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!cuda) return NULL;
    am_cuwaiter *w = calloc(1, sizeof *w);
    if (!w) return NULL;
    w->set_ctx = (cu_ctx_fn)dlsym(cuda, "cuCtxSetCurrent");
    w->sync = (cu_event_fn)dlsym(cuda, "cuEventSynchronize");
    w->cap = 256;
    w->ring = calloc(w->cap, sizeof *w->ring);
    w->done_cap = 4096;
    w->done = calloc(w->done_cap, sizeof(void *));
    w->ctx = ctx;
    w->mirror = mirror;
    w->word = &mirror->value;
    w->spin_ns = spin_ns;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    if (!w->set_ctx || !w->sync || !w->ring || !w->done ||
        pthread_create(&w->thread, NULL, cuwait_run, w) != 0) {
        free(w->ring); free(w->done); free(w);
        return NULL;
    }
    return w;
}

int am_cuwaiter_push(am_cuwaiter *w, void *event, uint64_t value, am_timeline *extra,
                     uint64_t extra_value, long spin_ns) {
    pthread_mutex_lock(&w->mu);
    if (w->count == w->cap) {
        am_cuentry *ring = malloc(2 * w->cap * sizeof *ring);
        if (!ring) { pthread_mutex_unlock(&w->mu); return -1; }
        for (size_t i = 0; i < w->count; i++) ring[i] = w->ring[(w->head + i) % w->cap];
        free(w->ring);
        w->ring = ring; w->head = 0; w->cap *= 2;
    }
    am_cuentry e = {event, value, extra, extra_value, spin_ns};
    w->ring[(w->head + w->count) % w->cap] = e;
    w->count++;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
    return 0;
}

/* Move up to max finished events into out; returns how many. */
int am_cuwaiter_reclaim(am_cuwaiter *w, void **out, int max) {
    pthread_mutex_lock(&w->mu);
    int n = 0;
    while (n < max && w->done_count) out[n++] = w->done[--w->done_count];
    pthread_mutex_unlock(&w->mu);
    return n;
}

int am_cuwaiter_error(am_cuwaiter *w, uint64_t *value) {
    pthread_mutex_lock(&w->mu);
    int e = w->error;
    *value = w->error_value;
    pthread_mutex_unlock(&w->mu);
    return e;
}

/* After everything pushed was waited on (or at once if abandon): stop and free. */
void am_cuwaiter_close(am_cuwaiter *w, int abandon) {
    pthread_mutex_lock(&w->mu);
    w->stop = 1;
    if (abandon) w->count = 0;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->thread, NULL);
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
    free(w->ring); free(w->done); free(w);
}

/* ---- Objective-C blocks whose invoke functions never take the GIL ---------------------
 * Metal keeps and later calls the blocks given to addCompletedHandler: and
 * notifyListener:atValue:block:. asyncmetal builds them as global blocks (their memory is
 * asyncmetal's, released once they ran) whose invoke functions are these: they only record
 * the argument and raise a timeline, which wakes the waiting loops through their pipes.
 * Layout: the Block ABI's literal, then asyncmetal's own fields. */
typedef struct am_block {
    void *isa;
    int flags;
    int reserved;
    void *invoke;
    void *descriptor;
    am_timeline *timeline;          /* raised when the block runs */
    uint64_t value;                 /* to this value (completion handlers) */
    void *arg;                      /* what the block was called with (the command buffer) */
    _Atomic int calls;
    int reserved2;
    void *copy_dst;                 /* a memmove to do first (a copy out to host memory */
    const void *copy_src;           /* that the GPU could not write in place), or none */
    size_t copy_nbytes;
} am_block;

/* "v16@?0@8": void (^)(id<MTLCommandBuffer>) */
void am_block_completed(am_block *b, void *arg) {
    b->arg = arg;
    if (b->copy_nbytes) memmove(b->copy_dst, b->copy_src, b->copy_nbytes);
    atomic_fetch_add(&b->calls, 1);
    am_timeline_signal(b->timeline, b->value);
}

/* "v24@?0@8Q16": void (^)(id<MTLSharedEvent>, uint64_t) */
void am_block_reached(am_block *b, void *event, uint64_t value) {
    b->arg = event;
    atomic_fetch_add(&b->calls, 1);
    am_timeline_signal(b->timeline, value);
}

/* Blocks live in C memory, with static descriptors: a block still kept by Metal when the
 * interpreter exits is never freed under it. */
typedef struct { unsigned long reserved, size; const char *signature; } am_block_descriptor;
static am_block_descriptor completed_descriptor = {0, sizeof(am_block), "v16@?0@8"};
static am_block_descriptor reached_descriptor = {0, sizeof(am_block), "v24@?0@8Q16"};

am_block *am_block_new(void *isa, int reached, am_timeline *timeline, uint64_t value) {
    am_block *b = calloc(1, sizeof *b);
    if (!b) return NULL;
    b->isa = isa;
    b->flags = (1 << 28) | (1 << 30);  /* BLOCK_IS_GLOBAL | BLOCK_HAS_SIGNATURE */
    b->invoke = reached ? (void *)am_block_reached : (void *)am_block_completed;
    b->descriptor = reached ? &reached_descriptor : &completed_descriptor;
    b->timeline = timeline;
    b->value = value;
    return b;
}

void am_block_free(am_block *b) { free(b); }
