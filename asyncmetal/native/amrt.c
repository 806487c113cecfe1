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

/* Forks this process went through: a forked child adds one (am_after_fork, registered
 * with pthread_atfork when the runtime loads). Timelines and queues record the count
 * they were made under; in a child, those of the parent are the parent's: their threads
 * do not exist here, and their mutexes and conditions may have been held or waited on
 * by those threads at the fork, forever so in the child's copy. So the functions that
 * release them (am_queue_close, am_timeline_free, am_watch_free) leave them alone --
 * a leak of the parent's memory in the child, never a hang -- and asyncmetal refuses
 * every other use of them in the child. */
static unsigned am_forks;

static void am_after_fork(void) { am_forks++; }

__attribute__((constructor)) static void am_register_fork_handler(void) {
    pthread_atfork(NULL, NULL, am_after_fork);
}

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
    _Atomic uint64_t *word;         /* a copy a device waits on (pinned memory), or NULL */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    am_watch *watches;
    int polling;                    /* a queue thread polls the word (wait_word), under mu */
    uint64_t seen;                  /* the word's highest value it saw, under mu */
    unsigned forks;                 /* am_forks when made: another value, the parent's */
} am_timeline;

enum { CMD_CALL = 1, CMD_COPY, CMD_SIGNAL, CMD_WAIT, CMD_COPY_PART };

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
    am_timeline *after;             /* CMD_COPY_PART: whose word to wait for first, or NULL */
    size_t part;                    /* ... bytes per part (the last may be shorter) */
    _Atomic uint64_t *claimed;      /* ... parts taken, shared by the queues that copy */
    uint64_t first;                 /* ... the claim number of this use's first part */
    _Atomic uint64_t *count;        /* ... parts of its chunk copied, over all its uses */
    uint64_t count_target;          /* ... the count once every part of this use is in */
    _Atomic uint64_t *ready;        /* ... the word that part raises to ready_value */
    uint64_t ready_value;
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
    unsigned forks;                 /* am_forks when made */
} am_queue;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void nap_ns(long ns) {
    struct timespec ts = {ns / 1000000000L, ns % 1000000000L};
    nanosleep(&ts, NULL);
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
    if (t->forks != am_forks) return NULL;  /* the parent's timeline */
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
    if (t->forks != am_forks) return;  /* in a child: t->mu may be held for ever */
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
    t->forks = am_forks;
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->cv, NULL);
}

am_timeline *am_timeline_new(void) {
    am_timeline *t = malloc(sizeof *t);
    if (t) timeline_init(t);
    return t;
}

/* A device-visible word (pinned host memory a GPU's streams wait on) that host signals
 * of this timeline also raise. A device raises the word itself; the timeline's value --
 * what the host reports as reached -- is raised only once the device's work before the
 * write is confirmed to have succeeded (am_timeline_poke by a completion thread). */
void am_timeline_set_word(am_timeline *t, uint64_t *word) {
    t->word = (_Atomic uint64_t *)word;
}

void am_timeline_free(am_timeline *t) {
    /* In a child, the parent's: destroying a condition waits for its waiters, which
     * here are threads that no longer exist. */
    if (t->forks != am_forks) return;
    pthread_mutex_destroy(&t->mu);
    pthread_cond_destroy(&t->cv);
    free(t);
}

uint64_t am_timeline_value(am_timeline *t) { return atomic_load(&t->value); }

/* Raise the value to at least v and wake whoever waits up to the value now held, leaving
 * the device word alone (a device wrote it: a completion thread confirms that here). */
void am_timeline_poke(am_timeline *t, uint64_t v) {
    pthread_mutex_lock(&t->mu);
    if (v > atomic_load(&t->value)) atomic_store(&t->value, v);
    v = atomic_load(&t->value);
    pthread_cond_broadcast(&t->cv);
    for (am_watch *w = t->watches; w; w = w->link)
        if (v >= atomic_load(&w->next)) notify(w->notifier);
    pthread_mutex_unlock(&t->mu);
}

static void raise_word(_Atomic uint64_t *word, uint64_t v) {
    uint64_t old = atomic_load(word);
    while (old < v && !atomic_compare_exchange_weak(word, &old, v)) {}
}

void am_timeline_signal(am_timeline *t, uint64_t v) {
    pthread_mutex_lock(&t->mu);
    if (t->word) raise_word(t->word, v);  /* devices waiting on it go first */
    if (v > atomic_load(&t->value)) {
        atomic_store(&t->value, v);
        pthread_cond_broadcast(&t->cv);
        for (am_watch *w = t->watches; w; w = w->link)
            if (v >= atomic_load(&w->next)) notify(w->notifier);
    }
    pthread_mutex_unlock(&t->mu);
}

#if defined(__x86_64__) || defined(__i386__)
#define cpu_relax() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield")
#else
#define cpu_relax() ((void)0)
#endif

/* Read t until it reaches v, for at most max_ns: 1 if it did. For a waiter whose value is
 * about to be reached, between two yields to its event loop (called without the GIL). */
int am_timeline_spin(am_timeline *t, uint64_t v, long max_ns) {
    int64_t deadline = now_ns() + max_ns;
    for (;;) {
        for (int i = 0; i < 64; i++) {
            if (atomic_load_explicit(&t->value, memory_order_acquire) >= v) return 1;
            cpu_relax();
        }
        if (now_ns() >= deadline) return atomic_load(&t->value) >= v;
    }
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

/* am_queue_close(abandon) sets stop under q->mu, then reads waiting_on and broadcasts
 * t's condition under t->mu. So stop is read under t->mu right before each sleep: either
 * the close's broadcast comes after this thread sleeps (it wakes it), or its store to
 * stop came before this thread took t->mu (it sees it). Read only before taking t->mu,
 * a broadcast landing in between would find nobody asleep and be lost. */
static int wait_timeline(am_queue *q, am_timeline *t, uint64_t target) {
    pthread_mutex_lock(&q->mu);
    q->waiting_on = t;
    pthread_mutex_unlock(&q->mu);
    int abandon = 0;
    pthread_mutex_lock(&t->mu);
    while (atomic_load(&t->value) < target) {
        if ((abandon = __atomic_load_n(&q->stop, __ATOMIC_SEQ_CST) == 2)) break;
        pthread_cond_wait(&t->cv, &t->mu);
    }
    pthread_mutex_unlock(&t->mu);
    pthread_mutex_lock(&q->mu);
    q->waiting_on = NULL;
    pthread_mutex_unlock(&q->mu);
    return !abandon;
}

/* Wait until a device wrote t's word up to target: the word is in pinned memory,
 * written by a stream behind the work it follows, and nothing wakes a thread when it
 * changes. So it is polled, by one waiting thread at a time: a spin of up to 20 us, then
 * naps of a 32nd of the time waited so far (10 us to 4 ms: a value seen at most ~3 %
 * late; ~250 wake-ups a second once the wait is long). The others sleep on t's
 * condition; the poller publishes each new value it sees (t->seen) and wakes them, and
 * hands polling over when its own target is reached. Checks for abandon between naps and
 * at every wake (am_queue_close broadcasts t's condition through q->waiting_on). */
static int wait_word(am_queue *q, am_timeline *t, uint64_t target) {
    pthread_mutex_lock(&q->mu);
    q->waiting_on = t;
    pthread_mutex_unlock(&q->mu);
    int ok = 1;
    pthread_mutex_lock(&t->mu);
    while (ok && t->seen < target && atomic_load(t->word) < target) {
        if (__atomic_load_n(&q->stop, __ATOMIC_SEQ_CST) == 2) { ok = 0; break; }
        if (t->polling) { pthread_cond_wait(&t->cv, &t->mu); continue; }
        t->polling = 1;
        pthread_mutex_unlock(&t->mu);
        int64_t start = now_ns();
        uint64_t seen = 0;
        for (;;) {
            uint64_t w = 0;
            for (int i = 0; i < 64; i++) {
                w = atomic_load_explicit(t->word, memory_order_acquire);
                if (w >= target) break;
                cpu_relax();
            }
            if (w > seen) {  /* publish progress: a sleeper may need less than target */
                seen = w;
                pthread_mutex_lock(&t->mu);
                if (w > t->seen) t->seen = w;
                pthread_cond_broadcast(&t->cv);
                pthread_mutex_unlock(&t->mu);
            }
            if (w >= target) break;
            if (__atomic_load_n(&q->stop, __ATOMIC_SEQ_CST) == 2) { ok = 0; break; }
            long waited = (long)(now_ns() - start), nap = waited / 32;
            if (waited < 20000) sched_yield();
            else nap_ns(nap < 10000 ? 10000 : nap > 4000000 ? 4000000 : nap);
        }
        pthread_mutex_lock(&t->mu);
        t->polling = 0;  /* another waiter (a later target) takes over */
        pthread_cond_broadcast(&t->cv);
    }
    pthread_mutex_unlock(&t->mu);
    pthread_mutex_lock(&q->mu);
    q->waiting_on = NULL;
    pthread_mutex_unlock(&q->mu);
    return ok;
}

/* Claim parts of a chunk's use one at a time and copy them, until every part is taken:
 * queues that got there first (woke first, finished their last part first) copy more,
 * so a thread that is late (descheduled, slow to wake) delays the chunk by one part at
 * most, not by a whole share. A use's parts are numbered from `first` on the chunk's
 * claim counter; uses run one after another (each waits, through the stream, for the
 * last one's ready word), so a command that finds the counter past its use's parts
 * has nothing left to do. */
static void copy_parts(const am_cmd *c) {
    uint64_t end = c->first + (c->nbytes + c->part - 1) / c->part;
    uint64_t i = atomic_load_explicit(c->claimed, memory_order_relaxed);
    while (i >= c->first && i < end) {
        if (!atomic_compare_exchange_weak_explicit(c->claimed, &i, i + 1, memory_order_relaxed,
                                                   memory_order_relaxed))
            continue;  /* i now holds the counter's value: try the next part */
        size_t offset = (size_t)(i - c->first) * c->part;
        size_t n = c->nbytes - offset < c->part ? c->nbytes - offset : c->part;
        memmove((char *)c->dst + offset, (const char *)c->src + offset, n);
        if (atomic_fetch_add_explicit(c->count, 1, memory_order_acq_rel) + 1 == c->count_target)
            raise_word(c->ready, c->ready_value);
        i = atomic_load_explicit(c->claimed, memory_order_relaxed);
    }
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
        case CMD_COPY_PART:  /* parts of a chunk; the last one done marks it ready */
            if (c.after && !wait_word(q, c.after, c.target)) return NULL;
            copy_parts(&c);
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
    q->forks = am_forks;
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

/* A chunk's use's host copy, shared by queues (each that shares it gets this command):
 * once `after`'s device word (a stream writes it; no wait if NULL) reaches after_value,
 * claim `part`-byte parts of the nbytes on *claimed -- this use's are numbered first,
 * first+1, ... -- copy each and count it in *count; the part that brings the count to
 * count_target raises *ready to ready_value (a word a stream waits on): every byte is
 * in. Both counters run on over a chunk's uses, never reset, so a use may be submitted
 * before the last one's parts ran: its parts run only after them (they wait, through
 * the stream, on the ready word those parts raise). */
int am_queue_copy_part(am_queue *q, void *dst, const void *src, size_t nbytes, size_t part,
                       am_timeline *after, uint64_t after_value, void *claimed, uint64_t first,
                       void *count, uint64_t count_target, void *ready, uint64_t ready_value,
                       int64_t *record, uint64_t value) {
    if (part == 0) return -2;
    am_cmd c = {.kind = CMD_COPY_PART, .dst = dst, .src = src, .nbytes = nbytes, .part = part,
                .after = after, .target = after_value, .claimed = claimed, .first = first,
                .count = count, .count_target = count_target, .ready = ready,
                .ready_value = ready_value, .record = record, .value = value};
    return push(q, &c);
}

/* Stop the thread and free the queue. abandon=0: after everything queued has run;
 * abandon=1: now, leaving a pending device-side wait (interpreter exit). Blocks. In a
 * forked child, a queue of the parent is left as it is. */
void am_queue_close(am_queue *q, int abandon) {
    if (q->forks != am_forks) return;  /* in a child, the parent's: no thread to join */
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

/* ---- CUDA streams -----------------------------------------------------------------
 * A CUDA queue submits here, one native call per driver operation (a launch, a copy, a
 * word written or waited for) and one per command's end (an event record and its
 * hand-over to the queue's completion thread). The driver functions come from
 * cuGetProcAddress (asyncmetal asks cuda-bindings for them once).
 *
 * Measured on an H200 VM: cuLaunchKernel ~5 us, cuStreamWriteValue64 ~2.4 us, an event
 * record ~0.8 us. So the queue's device word (which streams wait on with
 * cuStreamWaitValue64) is written only for values some device wait asked for before
 * they were submitted; a wait for a value already submitted waits on that command's
 * event instead (cuStreamWaitEvent, across devices too).
 *
 * Commands in flight are bounded (max_inflight, the commands handed to the driver and
 * not yet confirmed). Past the bound, operations are held here, in order, and the
 * completion thread hands them to the driver as earlier commands are confirmed: no loop
 * round trip, and the submitting thread never makes a driver call that can block. On
 * the H200, cuLaunchKernel blocks for about a kernel's length once ~56 commands with
 * blocking-sync events are queued on a stream (plain events: not up to 1024), which is
 * what a deep queue of long kernels otherwise does to an event loop.
 *
 * The completion thread reports a command done only once its event says so: a kernel
 * that faulted can let later stream work land before the fault is reported, and the
 * event is what reports it. It raises the queue's timeline (the host-side value loops
 * read and wait on), and the timeline a signal command raised. It polls the event for a
 * moment (a completion about to happen is seen with no interrupt), then naps or blocks
 * on it. A host signal of a device timeline wakes napping completion threads at once
 * (a device wait it releases is seen in microseconds, not at the end of a nap). It never
 * takes the GIL, and calls only cuCtxSetCurrent, cuEventQuery, cuEventSynchronize,
 * cuEventDestroy and, for held operations, the submission calls. */
enum { CU_LAUNCH, CU_WRITE64, CU_WAIT64, CU_EVENT_CREATE, CU_EVENT_RECORD, CU_EVENT_QUERY,
       CU_EVENT_SYNC, CU_EVENT_DESTROY, CU_CTX_SET, CU_WAIT_EVENT, CU_CTX_GET, CU_COPY,
       CU_COPY_PEER, CU_COPY_HTOD, CU_COPY_DTOH, CU_NFUNCS };
static void *cu_funcs[CU_NFUNCS];
static const char *cu_names[CU_NFUNCS] = {
    "cuLaunchKernel", "cuStreamWriteValue64", "cuStreamWaitValue64", "cuEventCreate",
    "cuEventRecord", "cuEventQuery", "cuEventSynchronize", "cuEventDestroy", "cuCtxSetCurrent",
    "cuStreamWaitEvent", "cuCtxGetCurrent", "cuMemcpyDtoDAsync", "cuMemcpyPeerAsync",
    "cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync"};
#define CU_ERROR_NOT_READY 600
#define CU_POLL_GAP_NS 10000     /* at most this long between queries, ... */
#define CU_POLL_QUIET_NS 500     /* ... or this long while no thread submits to the queue */
#define CU_KICK_POLL_NS 500000   /* after a host signal, poll this long before napping */
#define CU_MAX_PARAMS 64
#define CU_FINISH_LONG 1         /* am_cuq_finish flags: a command known to run long */
#define CU_FINISH_PLAIN 2        /* ... a device wait: a plain event, so a kick is seen */
#define CU_FINISH_FENCE 4        /* internal: behind what a refused command handed over */

const char *am_cuda_name(int i) { return i >= 0 && i < CU_NFUNCS ? cu_names[i] : "?"; }
void am_cuda_set(int i, void *fn) { if (i >= 0 && i < CU_NFUNCS) cu_funcs[i] = fn; }

/* Kicks: a host signal of a device timeline bumps the generation; completion threads
 * napping on a command wake at once and poll again (the device sees the word within
 * microseconds). A thread notes the generation when it starts waiting on a command, so
 * a kick between then and its nap is not lost. */
static pthread_mutex_t kick_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t kick_cv = PTHREAD_COND_INITIALIZER;
static atomic_uint kick_gen;
static atomic_int kick_sleepers;

static void host_signalled(void) {
    atomic_fetch_add(&kick_gen, 1);
    if (atomic_load(&kick_sleepers)) {
        pthread_mutex_lock(&kick_mu);
        pthread_cond_broadcast(&kick_cv);
        pthread_mutex_unlock(&kick_mu);
    }
}

/* A host signal of a device timeline (Timeline.signal): the word first, then the kick. */
void am_timeline_host_signal(am_timeline *t, uint64_t v) {
    am_timeline_signal(t, v);
    host_signalled();
}

static void deadline_after(struct timespec *ts, long ns) {
    clock_gettime(CLOCK_REALTIME, ts);
    ts->tv_sec += ns / 1000000000L;
    ts->tv_nsec += ns % 1000000000L;
    if (ts->tv_nsec >= 1000000000L) { ts->tv_sec++; ts->tv_nsec -= 1000000000L; }
}

/* Nap up to ns, or until a kick after generation `seen`: 1 if kicked. */
static int kick_nap(long ns, unsigned seen) {
    struct timespec until;
    deadline_after(&until, ns);
    pthread_mutex_lock(&kick_mu);
    atomic_fetch_add(&kick_sleepers, 1);
    int r = 0;
    while (atomic_load(&kick_gen) == seen && r != ETIMEDOUT)
        r = pthread_cond_timedwait(&kick_cv, &kick_mu, &until);
    atomic_fetch_sub(&kick_sleepers, 1);
    int kicked = atomic_load(&kick_gen) != seen;
    pthread_mutex_unlock(&kick_mu);
    return kicked;
}

typedef struct {
    void *event;
    uint64_t value;
    am_timeline *extra;             /* a timeline this command signals, or NULL */
    uint64_t extra_value;
    long spin_ns;                   /* how long to poll before blocking on the event */
    int blocking;                   /* its event wakes a thread blocked on it (interrupt) */
    int fence;                      /* behind a refused command's handed-over operations:
                                       waited for, then fails */
} am_cuentry;

struct am_cuq;

/* A driver operation held on the host until the stream has room for it. */
enum { CUOP_LAUNCH, CUOP_COPY, CUOP_HTOD, CUOP_DTOH, CUOP_WRITE, CUOP_WAIT, CUOP_WAIT_QUEUE, CUOP_FINISH };
typedef struct am_cuop {
    int kind;
    int flags;                      /* CUOP_FINISH: CU_FINISH_* */
    uint64_t value;                 /* the command it belongs to */
    struct am_cuop *next;
    void *fn;                       /* CUOP_LAUNCH */
    unsigned dims[7];
    int nparams;
    uint64_t dst, src;              /* copies: device or host addresses */
    void *src_ctx;                  /* CUOP_COPY between devices: the source's context */
    size_t nbytes;
    void *word;                     /* CUOP_WRITE, CUOP_WAIT: a device word */
    uint64_t target;                /* ... its value; CUOP_WAIT_QUEUE: other's value */
    struct am_cuq *other;           /* CUOP_WAIT_QUEUE: the queue waited for (referenced) */
    am_timeline *extra;             /* CUOP_FINISH */
    uint64_t extra_value;
    long spin_ns;
    int64_t params[];               /* CUOP_LAUNCH: nparams 64-bit parameter slots */
} am_cuop;

typedef struct am_cuq {
    int error;                      /* first member: the first CUDA error (sticky); */
    int failed_call;                /* which call failed at submission */
    uint64_t error_value;           /* the value of the command that saw it */
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    am_cuentry *ring;
    size_t cap, head, count;
    void **events[2];               /* finished events for reuse: plain, blocking-sync */
    size_t events_cap, events_count[2];
    atomic_size_t pending;          /* entries pushed and not yet confirmed */
    atomic_int submitting;          /* threads inside a submission (driver calls) now */
    int stop;                       /* 1: finish everything, then stop; 2: abandon now */
    int exited, orphan;             /* the thread returned; it frees the queue itself */
    atomic_int refs;                /* the owner's, and one per held wait on this queue */
    void *ctx;
    void *stream;
    am_timeline *timeline;          /* the queue's timeline: its value is verified */
    _Atomic uint64_t *word;         /* its device word, written by the stream on demand */
    uint64_t submitted;             /* the last value handed to the completion thread */
    uint64_t wanted;                /* write the word for values up to this one */
    long spin_ns;
    int sleeping;                   /* the completion thread waits on cv */
    size_t max_inflight;            /* entries handed to the driver at most; then held */
    am_cuop *held, *held_tail;      /* operations held on the host, in order */
    size_t nheld;
    int driving;                    /* a thread is making driver calls for this queue */
    _Atomic(void *) spare[2];       /* an event for the next command, taken without the lock */
    atomic_int blocking;            /* commands get blocking-sync events (they run long) */
    int quick;                      /* blocking events confirmed while polling, in a row */
    atomic_ulong queries, syncs, naps, events_made, held_total, kicked;  /* statistics */
} am_cuq;

static void cuq_recycle(am_cuq *q, void *event, int blocking) {  /* under q->mu */
    if (q->events_count[blocking] < q->events_cap)
        q->events[blocking][q->events_count[blocking]++] = event;
    else
        ((int (*)(void *))cu_funcs[CU_EVENT_DESTROY])(event);
}

static void cuq_free(am_cuq *q) {
    pthread_mutex_destroy(&q->mu);
    pthread_cond_destroy(&q->cv);
    free(q->ring); free(q->events[0]); free(q->events[1]); free(q);
}

static void cuq_unref(am_cuq *q) {
    if (atomic_fetch_sub(&q->refs, 1) == 1) cuq_free(q);
}

static void cuop_free(am_cuop *op) {
    if (op->other) cuq_unref(op->other);
    free(op);
}

/* Whether the completion thread has held operations it may hand over now (under mu). */
static int cuq_can_drain(const am_cuq *q) {
    return q->held && !q->driving && q->count < q->max_inflight && q->stop != 2;
}

static int cuq_fail(am_cuq *q, int call, int r) {
    __atomic_store_n(&q->failed_call, call, __ATOMIC_RELAXED);
    return r;
}

static int cuq_run_op(am_cuq *q, const am_cuop *op);
static int cuq_finish(am_cuq *q, uint64_t value, am_timeline *extra, uint64_t extra_value,
                      long spin_ns, int flags);

static void cuq_drop_held(am_cuq *q) {  /* under mu */
    while (q->held) {
        am_cuop *op = q->held;
        q->held = op->next;
        q->nheld--;
        cuop_free(op);
    }
    q->held_tail = NULL;
}

/* A held operation the driver refused: that command and every one after it will never
 * run. The queue fails from that command's value on (earlier ones are still confirmed
 * by their events); what is still held is dropped. Under mu. */
static void cuq_refused(am_cuq *q, uint64_t value, int r) {
    if (!q->error) { q->error = r; q->error_value = value; }
    cuq_drop_held(q);
}

/* The queue failed and settled (its timeline at UINT64_MAX): the stream will never write
 * the word for the failed values, so release other queues' device waits on them (they
 * would block forever: a refused held command is no sticky error that fails their
 * streams too). After the timeline, so that a releasing queue's confirmation raises
 * nothing. Not under mu. */
static void cuq_release_waiters(am_cuq *q) {
    raise_word(q->word, UINT64_MAX);
    host_signalled();
}

/* Hand held operations to the driver while the stream has room. Runs on the completion
 * thread (the context is current there). */
static void cuq_drain(am_cuq *q) {
    pthread_mutex_lock(&q->mu);
    while (cuq_can_drain(q)) {
        am_cuop *op = q->held;
        q->held = op->next;
        if (!q->held) q->held_tail = NULL;
        q->nheld--;
        q->driving = 1;
        pthread_mutex_unlock(&q->mu);
        int r = cuq_run_op(q, op);
        /* Refused: what this command handed over before may still run; the queue settles
         * only once the stream is past it (an event behind it, waited for, that fails). */
        if (r && __atomic_load_n(&q->stop, __ATOMIC_SEQ_CST) != 2) {
            /* (not once abandoned: the stream may be destroyed; the call reported stays
             * the refused one, not the fence's) */
            int call = __atomic_load_n(&q->failed_call, __ATOMIC_RELAXED);
            cuq_finish(q, op->value, NULL, 0, 0, CU_FINISH_FENCE);
            __atomic_store_n(&q->failed_call, call, __ATOMIC_RELAXED);
        }
        pthread_mutex_lock(&q->mu);
        q->driving = 0;
        if (r) cuq_refused(q, op->value, r);
        cuop_free(op);
    }
    /* Refused with nothing left in flight: settle the waiters now (they find the error).
     * Not once abandoned: the closer may have returned (this thread orphaned) and the
     * caller freed the timeline. */
    if (q->error && !q->count && !q->held && q->stop != 2) {
        pthread_mutex_unlock(&q->mu);
        am_timeline_poke(q->timeline, UINT64_MAX);
        cuq_release_waiters(q);
        return;
    }
    pthread_mutex_unlock(&q->mu);
}

static void *cuq_run(void *arg) {
    am_cuq *q = arg;
    ((int (*)(void *))cu_funcs[CU_CTX_SET])(q->ctx);
    int (*query)(void *) = (int (*)(void *))cu_funcs[CU_EVENT_QUERY];
    int (*sync)(void *) = (int (*)(void *))cu_funcs[CU_EVENT_SYNC];
    for (;;) {
        /* Stay awake a moment for the next command: a thread woken from a condition
         * variable takes tens of microseconds to run again, which an awaited launch
         * right behind the last one would otherwise pay every time. */
        if (atomic_load(&q->pending) == 0) {
            int64_t deadline = now_ns() + q->spin_ns;
            while (atomic_load(&q->pending) == 0 && now_ns() < deadline &&
                   !__atomic_load_n(&q->stop, __ATOMIC_SEQ_CST))
                sched_yield();
        }
        pthread_mutex_lock(&q->mu);
        while (q->count == 0 && !cuq_can_drain(q) && !q->stop) {
            q->sleeping = 1;  /* submissions signal the condition only then */
            pthread_cond_wait(&q->cv, &q->mu);
            q->sleeping = 0;
        }
        if (q->stop == 2 || (q->stop && q->count == 0 && !q->held)) break;
        if (q->count == 0) {
            pthread_mutex_unlock(&q->mu);
            cuq_drain(q);
            continue;
        }
        am_cuentry e = q->ring[q->head];
        int failed = q->error && e.value >= q->error_value && !e.fence ? q->error : 0;
        pthread_mutex_unlock(&q->mu);
        int r = failed;
        if (!failed) {
            /* A query takes the driver's locks: back-to-back queries slowed the
             * submitting thread's launches ~4x on the H200 (42 us instead of ~10), one
             * every 2 us still by ~1.7 us a launch. So queries wait for a moment when
             * no thread is submitting to this queue (then come every CU_POLL_QUIET_NS),
             * but for no longer than CU_POLL_GAP_NS. */
            unsigned kicks = atomic_load(&kick_gen);
            long spin = e.spin_ns > q->spin_ns ? e.spin_ns : q->spin_ns;
            int64_t t = now_ns(), deadline = t + spin, last = t - CU_POLL_GAP_NS;
            r = CU_ERROR_NOT_READY;
            while (t < deadline) {
                int64_t since = t - last;
                if (since >= CU_POLL_GAP_NS ||
                    (since >= CU_POLL_QUIET_NS && atomic_load(&q->submitting) == 0)) {
                    atomic_fetch_add(&q->queries, 1);
                    if ((r = query(e.event)) != CU_ERROR_NOT_READY) break;
                    last = t;
                }
                sched_yield();
                t = now_ns();
            }
            if (r == CU_ERROR_NOT_READY) {  /* a last look: this thread may have been off
                                               the CPU through its whole window */
                atomic_fetch_add(&q->queries, 1);
                r = query(e.event);
            }
            if (r == CU_ERROR_NOT_READY) {
                /* A command that runs long. Blocking-sync events cost every command an
                 * interrupt, which on some of the H200 VMs made each launch + record
                 * take 30-50 us instead of ~5: so commands get plain events, polled,
                 * until one outlasts its polling window; it is waited for with naps of
                 * a 32nd of the time waited so far (20 us to 1 ms: seen at most ~3 %
                 * late -- an eighth made 1 GiB peer copies ~10 % slower than the raw
                 * copy -- with ~150 wake-ups for a 100 ms kernel), cut short by a host
                 * signal, and the commands after it get blocking-sync events, which this
                 * thread then sleeps on, until 16 in a row are confirmed while polling.
                 * Device waits always get plain events: a host signal releases them. */
                q->quick = 0;
                if (e.blocking) {
                    atomic_fetch_add(&q->syncs, 1);
                    r = sync(e.event);
                } else {
                    atomic_store(&q->blocking, 1);
                    atomic_fetch_add(&q->naps, 1);
                    int64_t since = now_ns() - spin;  /* about when polling began */
                    int64_t polling_until = 0;
                    while ((r = query(e.event)) == CU_ERROR_NOT_READY) {
                        if (__atomic_load_n(&q->stop, __ATOMIC_SEQ_CST) == 2) break;
                        int64_t at = now_ns();
                        if (at < polling_until) { sched_yield(); continue; }
                        long nap = (long)((at - since) / 32);
                        if (kick_nap(nap < 20000 ? 20000 : nap > 1000000 ? 1000000 : nap,
                                     kicks)) {
                            kicks = atomic_load(&kick_gen);
                            polling_until = now_ns() + CU_KICK_POLL_NS;
                            atomic_fetch_add(&q->kicked, 1);
                        }
                    }
                    if (r == CU_ERROR_NOT_READY) {  /* abandoned while napping */
                        pthread_mutex_lock(&q->mu);
                        break;
                    }
                }
            } else if (e.blocking && ++q->quick >= 16) {
                atomic_store(&q->blocking, 0);
                q->quick = 0;
            }
        }
        pthread_mutex_lock(&q->mu);
        if (q->count == 0 || q->stop == 2) {  /* abandoned (am_cuq_close) meanwhile */
            if (q->stop == 2) break;
            pthread_mutex_unlock(&q->mu);
            continue;
        }
        q->head = (q->head + 1) % q->cap;
        q->count--;
        atomic_fetch_sub(&q->pending, 1);
        /* Confirmed already, by a queue of this context that waited for it on the device
         * and succeeded after it: an error seen now (a sticky one) came after. */
        uint64_t seen = atomic_load(&q->timeline->value);
        if (r && seen != UINT64_MAX && e.value <= seen) r = 0;
        if (e.fence && !r) r = q->error ? q->error : -2;  /* the refused command fails */
        if (r && (!q->error || e.value < q->error_value)) {
            q->error = r;
            q->error_value = e.value;
        }
        cuq_recycle(q, e.event, e.blocking);
        /* A failed command settles every later one; else, once a refused held command
         * has nothing left in flight before it, the same. */
        int settle = r || (q->error && !q->count && !q->held);
        pthread_mutex_unlock(&q->mu);
        if (e.extra && !r) am_timeline_poke(e.extra, e.extra_value);
        am_timeline_poke(q->timeline, settle ? UINT64_MAX : e.value);
        if (settle) cuq_release_waiters(q);
        cuq_drain(q);
    }
    /* Stopping, under mu. An abandoned queue's closer may have given up waiting for this
     * thread (it was blocked on an event that never completes): then it frees the queue. */
    q->exited = 1;
    int orphan = q->orphan;
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&q->mu);
    if (orphan) cuq_unref(q);
    return NULL;
}

am_cuq *am_cuq_new(void *ctx, void *stream, am_timeline *timeline, long spin_ns,
                   long max_inflight) {
    for (int i = 0; i < CU_NFUNCS; i++) if (!cu_funcs[i]) return NULL;
    if (!timeline->word || max_inflight < 1) return NULL;
    am_cuq *q = calloc(1, sizeof *q);
    if (!q) return NULL;
    q->cap = 256;
    q->ring = calloc(q->cap, sizeof *q->ring);
    q->events_cap = 4096;
    q->events[0] = calloc(q->events_cap, sizeof(void *));
    q->events[1] = calloc(q->events_cap, sizeof(void *));
    q->ctx = ctx;
    q->stream = stream;
    q->timeline = timeline;
    q->word = timeline->word;
    q->spin_ns = spin_ns;
    q->max_inflight = (size_t)max_inflight;
    atomic_store(&q->refs, 1);
    pthread_mutex_init(&q->mu, NULL);
    pthread_cond_init(&q->cv, NULL);
    if (!q->ring || !q->events[0] || !q->events[1] ||
        pthread_create(&q->thread, NULL, cuq_run, q) != 0) {
        free(q->ring); free(q->events[0]); free(q->events[1]); free(q);
        return NULL;
    }
    return q;
}

/* Every submission (driver calls on the queue's stream) runs between cuq_enter and
 * cuq_leave: meanwhile the completion thread holds its queries back, since a query takes
 * the driver's locks. cuq_enter makes the queue's context current on the calling thread
 * if it is not: the current context is per thread, shared by every device and library
 * on it (a thread-local read, no more, when it already is). Events are created in, and
 * recorded from, it. */
static int cuq_enter(am_cuq *q) {
    atomic_fetch_add(&q->submitting, 1);
    void *current = NULL;
    ((int (*)(void **))cu_funcs[CU_CTX_GET])(&current);
    if (current == q->ctx) return 0;
    int r = ((int (*)(void *))cu_funcs[CU_CTX_SET])(q->ctx);
    return r ? cuq_fail(q, CU_CTX_SET, r) : 0;
}

static int cuq_leave(am_cuq *q, int r) {  /* after cuq_enter, whatever it returned */
    atomic_fetch_sub(&q->submitting, 1);
    return r;
}

/* Record an event behind the command, hand it to the completion thread and, if a device
 * wait asked for this value before it was submitted, have the stream write it into the
 * queue's device word. One pass under the lock: the hand-over, the word decision (so a
 * waiter on another queue either finds the command's event or has its value written)
 * and the event for the next command. Returns a CUresult (-1: out of memory). */
static int cuq_finish(am_cuq *q, uint64_t value, am_timeline *extra, uint64_t extra_value,
                      long spin_ns, int flags) {
    /* Which kind of event the command gets: blocking-sync for one known to run long,
     * plain for a device wait (so that a host signal's kick is seen). */
    int fence = (flags & CU_FINISH_FENCE) != 0;
    int r, k = !(flags & (CU_FINISH_PLAIN | CU_FINISH_FENCE)) &&
               ((flags & CU_FINISH_LONG) || atomic_load(&q->blocking));
    void *event = atomic_exchange(&q->spare[k], NULL);
    if (!event) {
        pthread_mutex_lock(&q->mu);
        if (q->events_count[k]) event = q->events[k][--q->events_count[k]];
        pthread_mutex_unlock(&q->mu);
    }
    if (!event) {  /* CU_EVENT_DISABLE_TIMING, | CU_EVENT_BLOCKING_SYNC for k = 1 */
        r = ((int (*)(void **, unsigned))cu_funcs[CU_EVENT_CREATE])(&event, k ? 0x1 | 0x2 : 0x2);
        if (r) return cuq_fail(q, CU_EVENT_CREATE, r);
        atomic_fetch_add(&q->events_made, 1);
    }
    r = ((int (*)(void *, void *))cu_funcs[CU_EVENT_RECORD])(event, q->stream);
    if (r) {
        ((int (*)(void *))cu_funcs[CU_EVENT_DESTROY])(event);
        return cuq_fail(q, CU_EVENT_RECORD, r);
    }
    pthread_mutex_lock(&q->mu);
    if (q->count == q->cap) {
        am_cuentry *ring = malloc(2 * q->cap * sizeof *ring);
        if (!ring) {
            cuq_recycle(q, event, k);  /* recorded, never handed over: reusable */
            pthread_mutex_unlock(&q->mu);
            return -1;
        }
        for (size_t i = 0; i < q->count; i++) ring[i] = q->ring[(q->head + i) % q->cap];
        free(q->ring);
        q->ring = ring; q->head = 0; q->cap *= 2;
    }
    am_cuentry e = {event, value, extra, extra_value, spin_ns, k, fence};
    q->ring[(q->head + q->count) % q->cap] = e;
    q->count++;
    int write = !fence && value <= q->wanted;
    if (!fence && value > q->submitted) q->submitted = value;
    void *spare = NULL;
    if (q->events_count[k] && !atomic_load(&q->spare[k]))
        spare = q->events[k][--q->events_count[k]];
    atomic_fetch_add(&q->pending, 1);
    if (q->sleeping) pthread_cond_signal(&q->cv);
    pthread_mutex_unlock(&q->mu);
    if (spare) {
        void *none = NULL;
        if (!atomic_compare_exchange_strong(&q->spare[k], &none, spare)) {
            pthread_mutex_lock(&q->mu);
            cuq_recycle(q, spare, k);
            pthread_mutex_unlock(&q->mu);
        }
    }
    if (write) {
        r = ((int (*)(void *, void *, uint64_t, unsigned))cu_funcs[CU_WRITE64])(
            q->stream, (void *)q->word, value, 0);
        if (r) {  /* handed over already: the queue fails from this command on */
            pthread_mutex_lock(&q->mu);
            if (!q->error) { q->error = r; q->error_value = value; }
            pthread_mutex_unlock(&q->mu);
            return cuq_fail(q, CU_WRITE64, r);
        }
    }
    return 0;
}

static int cuq_wait_word(am_cuq *q, void *word, uint64_t value) {
    int r = ((int (*)(void *, void *, uint64_t, unsigned))cu_funcs[CU_WAIT64])(
        q->stream, word, value, 0x0 /* CU_STREAM_WAIT_VALUE_GEQ */);
    return r ? cuq_fail(q, CU_WAIT64, r) : 0;
}

/* Make stream q wait until queue `other` reaches `value`: on the event of the first
 * command at or after it if that was submitted and is not yet confirmed, on other's
 * device word if it was not submitted yet (other then writes its word up to it), and
 * not at all if it is confirmed. Under other's lock: its completion thread cannot
 * recycle the event meanwhile. Decided when the operation reaches the driver, so a held
 * wait looks at other as it is then. */
static int cuq_wait_queue(am_cuq *q, am_cuq *other, uint64_t value) {
    int r = 0;
    pthread_mutex_lock(&other->mu);
    if (value > other->submitted) {
        if (value > other->wanted) other->wanted = value;
        pthread_mutex_unlock(&other->mu);
        return cuq_wait_word(q, (void *)other->word, value);
    }
    for (size_t i = 0; i < other->count; i++) {
        am_cuentry *e = &other->ring[(other->head + i) % other->cap];
        if (e->value >= value) {
            r = ((int (*)(void *, void *, unsigned))cu_funcs[CU_WAIT_EVENT])(
                q->stream, e->event, 0);
            break;
        }
    }
    pthread_mutex_unlock(&other->mu);
    return r ? cuq_fail(q, CU_WAIT_EVENT, r) : 0;
}

/* One operation's driver calls (the context is current on the calling thread). */
static int cuq_run_op(am_cuq *q, const am_cuop *op) {
    int r;
    switch (op->kind) {
    case CUOP_LAUNCH: {
        void *params[CU_MAX_PARAMS];
        for (int i = 0; i < op->nparams; i++) params[i] = (void *)&op->params[i];
        r = ((int (*)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                      unsigned, void *, void **, void **))cu_funcs[CU_LAUNCH])(
            op->fn, op->dims[0], op->dims[1], op->dims[2], op->dims[3], op->dims[4],
            op->dims[5], op->dims[6], q->stream, params, NULL);
        return r ? cuq_fail(q, CU_LAUNCH, r) : 0;
    }
    case CUOP_COPY:
        if (op->src_ctx) {
            r = ((int (*)(uint64_t, void *, uint64_t, void *, size_t, void *))
                     cu_funcs[CU_COPY_PEER])(op->dst, q->ctx, op->src, op->src_ctx, op->nbytes,
                                             q->stream);
            return r ? cuq_fail(q, CU_COPY_PEER, r) : 0;
        }
        r = ((int (*)(uint64_t, uint64_t, size_t, void *))cu_funcs[CU_COPY])(
            op->dst, op->src, op->nbytes, q->stream);
        return r ? cuq_fail(q, CU_COPY, r) : 0;
    case CUOP_HTOD:
        r = ((int (*)(uint64_t, const void *, size_t, void *))cu_funcs[CU_COPY_HTOD])(
            op->dst, (const void *)(uintptr_t)op->src, op->nbytes, q->stream);
        return r ? cuq_fail(q, CU_COPY_HTOD, r) : 0;
    case CUOP_DTOH:
        r = ((int (*)(void *, uint64_t, size_t, void *))cu_funcs[CU_COPY_DTOH])(
            (void *)(uintptr_t)op->dst, op->src, op->nbytes, q->stream);
        return r ? cuq_fail(q, CU_COPY_DTOH, r) : 0;
    case CUOP_WRITE:
        r = ((int (*)(void *, void *, uint64_t, unsigned))cu_funcs[CU_WRITE64])(
            q->stream, op->word, op->target, 0);
        return r ? cuq_fail(q, CU_WRITE64, r) : 0;
    case CUOP_WAIT:
        return cuq_wait_word(q, op->word, op->target);
    case CUOP_WAIT_QUEUE:
        return cuq_wait_queue(q, op->other, op->target);
    case CUOP_FINISH:
        return cuq_finish(q, op->value, op->extra, op->extra_value, op->spin_ns, op->flags);
    }
    return -2;
}

/* Hand an operation to the driver now, or hold it (copied) behind what is held already
 * or while the stream has max_inflight commands unconfirmed. 0 once submitted or held; a
 * CUresult if the driver refused it now (nothing held: the caller takes its value back);
 * the queue's error once a command of it failed (nothing more is accepted); -1: out of
 * memory. */
static int cuq_submit(am_cuq *q, const am_cuop *op, size_t size) {
    pthread_mutex_lock(&q->mu);
    if (q->error) {
        int e = q->error;
        pthread_mutex_unlock(&q->mu);
        return e;
    }
    if (q->held || q->driving || q->count >= q->max_inflight) {
        am_cuop *copy = malloc(size);
        if (!copy) { pthread_mutex_unlock(&q->mu); return -1; }
        memcpy(copy, op, size);
        copy->next = NULL;
        if (copy->other) atomic_fetch_add(&copy->other->refs, 1);
        if (q->held_tail) q->held_tail->next = copy; else q->held = copy;
        q->held_tail = copy;
        q->nheld++;
        atomic_fetch_add(&q->held_total, 1);
        if (q->sleeping && cuq_can_drain(q)) pthread_cond_signal(&q->cv);
        pthread_mutex_unlock(&q->mu);
        return 0;
    }
    q->driving = 1;
    pthread_mutex_unlock(&q->mu);
    int r = cuq_enter(q);
    if (!r) r = cuq_run_op(q, op);
    cuq_leave(q, r);
    pthread_mutex_lock(&q->mu);
    q->driving = 0;
    if (q->sleeping && cuq_can_drain(q)) pthread_cond_signal(&q->cv);
    pthread_mutex_unlock(&q->mu);
    return r;
}

/* flags: CU_FINISH_LONG (a blocking-sync event at once), CU_FINISH_PLAIN (a device
 * wait's: a plain event). spin_ns: how long the command is expected to take at most. */
int am_cuq_finish(am_cuq *q, uint64_t value, am_timeline *extra, uint64_t extra_value,
                  long spin_ns, int flags) {
    am_cuop op = {.kind = CUOP_FINISH, .flags = flags, .value = value, .extra = extra,
                  .extra_value = extra_value, .spin_ns = spin_ns};
    return cuq_submit(q, &op, sizeof op);
}

int am_cuq_wait_queue(am_cuq *q, am_cuq *other, uint64_t value, uint64_t command) {
    am_cuop op = {.kind = CUOP_WAIT_QUEUE, .value = command, .other = other, .target = value};
    return cuq_submit(q, &op, sizeof op);
}

/* dims: grid x, y, z, block x, y, z, dynamic shared memory bytes; params: nparams
 * pointers to 64-bit slots (copied). Then its event, as am_cuq_finish. */
int am_cuq_launch(am_cuq *q, void *function, const unsigned *dims, void **params, int nparams,
                  uint64_t value) {
    if (nparams < 0 || nparams > CU_MAX_PARAMS) return -2;
    int64_t buf[(sizeof(am_cuop) + sizeof(int64_t) - 1) / sizeof(int64_t) + CU_MAX_PARAMS];
    am_cuop *op = (am_cuop *)buf;
    memset(op, 0, sizeof *op);
    op->kind = CUOP_LAUNCH;
    op->value = value;
    op->fn = function;
    op->nparams = nparams;
    memcpy(op->dims, dims, sizeof op->dims);
    for (int i = 0; i < nparams; i++) memcpy(&op->params[i], params[i], sizeof(int64_t));
    int r = cuq_submit(q, op, sizeof(am_cuop) + (size_t)nparams * sizeof(int64_t));
    return r ? r : am_cuq_finish(q, value, NULL, 0, 0, 0);
}

/* A device copy, then its event: on one device (src_ctx NULL) or from the device of
 * src_ctx to the queue's. spin_ns: how long the copy is expected to take at most
 * (the completion thread polls that long rather than block on its event). */
int am_cuq_copy(am_cuq *q, uint64_t dst, uint64_t src, void *src_ctx, size_t nbytes,
                uint64_t value, long spin_ns) {
    am_cuop op = {.kind = CUOP_COPY, .value = value, .dst = dst, .src = src, .src_ctx = src_ctx,
                  .nbytes = nbytes};
    int r = cuq_submit(q, &op, sizeof op);
    return r ? r : am_cuq_finish(q, value, NULL, 0, spin_ns, 0);
}

/* Host memory (pinned, or at most a few pages of pageable) to and from device memory, as
 * a part of command `value`. */
int am_cuq_memcpy(am_cuq *q, int to_device, uint64_t dst, uint64_t src, size_t nbytes,
                  uint64_t value) {
    am_cuop op = {.kind = to_device ? CUOP_HTOD : CUOP_DTOH, .value = value, .dst = dst,
                  .src = src, .nbytes = nbytes};
    return cuq_submit(q, &op, sizeof op);
}

/* Stream memory operations on a device word (another timeline's, or a host thread's),
 * as a part of command `value`. */
int am_cuq_write(am_cuq *q, void *word, uint64_t target, uint64_t value) {
    am_cuop op = {.kind = CUOP_WRITE, .value = value, .word = word, .target = target};
    return cuq_submit(q, &op, sizeof op);
}

int am_cuq_wait(am_cuq *q, void *word, uint64_t target, uint64_t value) {
    am_cuop op = {.kind = CUOP_WAIT, .value = value, .word = word, .target = target};
    return cuq_submit(q, &op, sizeof op);
}

int am_cuq_failed_call(am_cuq *q) { return __atomic_load_n(&q->failed_call, __ATOMIC_RELAXED); }

/* How the completion thread has worked so far: event queries, blocking waits on a
 * blocking-sync event, waits with naps on a plain one (after polling found them
 * unfinished), events created, whether commands now get blocking-sync events, operations
 * held on the host so far, held now, and naps cut short by a host signal. */
void am_cuq_stats(am_cuq *q, uint64_t *out) {
    out[0] = atomic_load(&q->queries);
    out[1] = atomic_load(&q->syncs);
    out[2] = atomic_load(&q->naps);
    out[3] = atomic_load(&q->events_made);
    out[4] = (uint64_t)atomic_load(&q->blocking);
    out[5] = atomic_load(&q->held_total);
    pthread_mutex_lock(&q->mu);
    out[6] = q->nheld;
    pthread_mutex_unlock(&q->mu);
    out[7] = atomic_load(&q->kicked);
}

int am_cuq_error(am_cuq *q, uint64_t *value) {
    pthread_mutex_lock(&q->mu);
    int e = q->error;
    *value = q->error_value;
    pthread_mutex_unlock(&q->mu);
    return e;
}

/* Stop the completion thread and release the queue; the stream is the caller's.
 * abandon=0: after everything held was handed over and every command confirmed (or the
 * queue failed). abandon=1: now, dropping what is held. A thread blocked on an event that
 * will never complete (behind a device wait nothing signals) is not waited for beyond
 * ~200 ms: it frees the queue itself if it ever returns. Blocks. */
void am_cuq_close(am_cuq *q, int abandon) {
    pthread_mutex_lock(&q->mu);
    __atomic_store_n(&q->stop, abandon ? 2 : 1, __ATOMIC_SEQ_CST);  /* read unlocked too */
    if (abandon) {
        cuq_drop_held(q);
        q->count = 0;
    }
    pthread_cond_signal(&q->cv);
    if (abandon) {
        pthread_mutex_unlock(&q->mu);
        host_signalled();  /* wake it if it naps */
        pthread_mutex_lock(&q->mu);
        struct timespec until;
        deadline_after(&until, 200000000L);
        int r = 0;
        while (!q->exited && r != ETIMEDOUT) r = pthread_cond_timedwait(&q->cv, &q->mu, &until);
        if (!q->exited) {
            q->orphan = 1;  /* its thread frees it: q may be gone once mu is released */
            pthread_detach(q->thread);
            pthread_mutex_unlock(&q->mu);
            return;
        }
    }
    pthread_mutex_unlock(&q->mu);
    pthread_join(q->thread, NULL);
    if (!abandon) {
        for (int k = 0; k < 2; k++) {
            for (size_t i = 0; i < q->events_count[k]; i++)
                ((int (*)(void *))cu_funcs[CU_EVENT_DESTROY])(q->events[k][i]);
            void *spare = atomic_load(&q->spare[k]);
            if (spare) ((int (*)(void *))cu_funcs[CU_EVENT_DESTROY])(spare);
        }
    }
    cuq_unref(q);
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
    am_timeline *then;              /* raised after `timeline` (a timeline the command */
    uint64_t then_value;            /* buffer signalled), or none */
} am_block;

/* The count of calls is the last thing written: once it is seen, the block may be freed
 * (release_ran), so nothing reads the block after it. */

/* "v16@?0@8": void (^)(id<MTLCommandBuffer>) */
void am_block_completed(am_block *b, void *arg) {
    b->arg = arg;
    if (b->copy_nbytes) memmove(b->copy_dst, b->copy_src, b->copy_nbytes);
    am_timeline_signal(b->timeline, b->value);
    if (b->then) am_timeline_signal(b->then, b->then_value);
    atomic_fetch_add(&b->calls, 1);
}

/* "v24@?0@8Q16": void (^)(id<MTLSharedEvent>, uint64_t) */
void am_block_reached(am_block *b, void *event, uint64_t value) {
    b->arg = event;
    am_timeline_signal(b->timeline, value);
    atomic_fetch_add(&b->calls, 1);
}

/* Blocks live in C memory, with static descriptors: a block still kept by Metal when the
 * interpreter exits is never freed under it. */
typedef struct { unsigned long reserved, size; const char *signature; } am_block_descriptor;
static am_block_descriptor completed_descriptor = {0, sizeof(am_block), "v16@?0@8"};
static am_block_descriptor reached_descriptor = {0, sizeof(am_block), "v24@?0@8Q16"};

/* A block that ran is not returned to malloc but kept for the next one: Metal may still
 * hold its copy of it (Block_copy of a global block is the block itself) and
 * Block_release it later -- which reads its flags, and for a block that is not global
 * writes them. Memory that stays a global block makes that late release harmless;
 * memory handed back to malloc and reused (as anything) would be corrupted. */
static pthread_mutex_t spare_blocks_mu = PTHREAD_MUTEX_INITIALIZER;
static am_block *spare_blocks;

am_block *am_block_new(void *isa, int reached, am_timeline *timeline, uint64_t value) {
    pthread_mutex_lock(&spare_blocks_mu);
    am_block *b = spare_blocks;
    if (b) spare_blocks = b->copy_dst;
    pthread_mutex_unlock(&spare_blocks_mu);
    if (b) {
        /* Still a global block while it is cleared: its flags are rewritten unchanged. */
        b->timeline = NULL;
        b->value = 0;
        b->arg = NULL;
        atomic_store(&b->calls, 0);
        b->reserved2 = 0;
        b->copy_dst = NULL;
        b->copy_src = NULL;
        b->copy_nbytes = 0;
        b->then = NULL;
        b->then_value = 0;
    } else {
        b = calloc(1, sizeof *b);
    }
    if (!b) return NULL;
    b->isa = isa;
    b->flags = (1 << 28) | (1 << 30);  /* BLOCK_IS_GLOBAL | BLOCK_HAS_SIGNATURE */
    b->invoke = reached ? (void *)am_block_reached : (void *)am_block_completed;
    b->descriptor = reached ? &reached_descriptor : &completed_descriptor;
    b->timeline = timeline;
    b->value = value;
    return b;
}

void am_block_free(am_block *b) {
    pthread_mutex_lock(&spare_blocks_mu);
    b->copy_dst = spare_blocks;
    spare_blocks = b;
    pthread_mutex_unlock(&spare_blocks_mu);
}
