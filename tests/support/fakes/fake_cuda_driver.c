/* A simulated CUDA driver for the harness fake_cuda.c (fake_cuda_driver.h says what it
 * models): streams are threads running their operations in order.
 */
#include "fake_cuda_driver.h"
#include <string.h>

void die(const char *what) { fprintf(stderr, "FAIL %s\n", what); exit(1); }

atomic_long events_made, events_destroyed;
atomic_long event_queries;  /* cuEventQuery calls (the runtime's) */
atomic_long deep_limit;       /* >0: a launch blocks while its stream has more ops */
atomic_long blocked_launches; /* launches that had to block for that */
atomic_int release_syncs;     /* 1: blocked syncs give up (NOT_READY) */
void *refuse_fn;              /* a launch of this function is refused */
const unsigned fake_launch_limits[7] = {1024, 1024, 1024, 64, 2147483647, 65535, 65535};
atomic_long oversized_launches;  /* launches refused for their sizes */
uint64_t refuse_word;         /* a word write to it is refused */
atomic_int fault_code;  /* the context's sticky error once a kernel faulted */
void *_Atomic held;     /* an event whose queries report it unfinished (a slow thread) */
fake_stream *_Atomic hold_records_on;  /* the next event recorded on it is made `held` */
atomic_long wait_event_ns;  /* >0: cuStreamWaitEvent takes this long (a slow driver) */
atomic_int waits_in_driver;
fake_stream *_Atomic refuse_records;  /* the next event record on this stream is refused, */
atomic_int refuse_more;               /* ... and then this many more there, */
atomic_int refuse_code;               /* ... the first (records_refused 0) with this CUresult
                                         (0: CUDA_ERROR_INVALID_VALUE), */
atomic_int refuse_more_code;          /* ... those after it with this one (0: the same) */
atomic_int records_refused;           /* event records refused (a check sets it back to 0) */
atomic_int refuse_allocs;   /* >0: the runtime's next that many cuq_alloc fail */
void *_Atomic refuse_ctx;   /* a cuCtxSetCurrent of this context is refused */
atomic_long record_ns;      /* >0: cuEventRecord takes this long (a slow driver) */
atomic_int records_in_driver;
fake_stream *_Atomic record_gate_on;  /* a record on it stays in the driver until cleared */
fake_stream *_Atomic wait_gate_on;    /* a wait on an event on it: the same */

/* Fault injection for a sweep: the driver calls (those below that submit or make an
 * event) of a thread marked with fake_count_calls -- the one submitting -- are counted,
 * or those of every thread while count_all is set (a window where one thread makes
 * them: a completion thread handing held commands over), and the one numbered fail_at
 * fails with fail_code; ILLEGAL_ADDRESS faults the context as a kernel's fault does
 * (every later call fails with it). */
atomic_long counted_calls, fail_at;
atomic_int fail_code, count_all;
/* The kinds of the calls counted: a bit for each FAKE_CALL_* (which calls a sweep failed
 * in turn: their number depends on timing), and the kind of each of the first 256, as
 * 'A' + FAKE_CALL_* (which call a failing number was). In the order of simulated_copies.py's
 * FAKE_CALLS. */
enum { FAKE_CALL_LAUNCH, FAKE_CALL_RECORD, FAKE_CALL_CREATE, FAKE_CALL_WRITE, FAKE_CALL_FILL,
       FAKE_CALL_COPY, FAKE_CALL_COPY_PEER, FAKE_CALL_HTOD, FAKE_CALL_DTOH, FAKE_CALL_WAIT,
       FAKE_CALL_WAIT_EVENT };
atomic_uint counted_kinds;
atomic_char counted_order[256];
static _Thread_local int counting;
static void driver_changed(void);  /* (waiters woken: see "waiting" below) */
void fake_count_calls(int on) { counting = on; }
static int injected(int kind) {
    if (!counting && !atomic_load(&count_all)) return 0;
    atomic_fetch_or(&counted_kinds, 1u << kind);
    long n = atomic_fetch_add(&counted_calls, 1) + 1;
    if (n <= 256) atomic_store(&counted_order[n - 1], (char)('A' + kind));
    if (n != atomic_load(&fail_at)) return 0;
    int code = atomic_load(&fail_code);
    if (code == ILLEGAL_ADDRESS) {
        atomic_store(&fault_code, code);
        driver_changed();
    }
    return code;
}

/* The runtime's allocations of held operations and of its completion ring (the harness
 * builds it with AM_TEST_ALLOC): out of memory on demand. */
void *am_test_alloc(size_t size) {
    int left = atomic_load(&refuse_allocs);
    while (left > 0 && !atomic_compare_exchange_weak(&refuse_allocs, &left, left - 1)) {}
    return left > 0 ? NULL : malloc(size);
}

/* The runtime's test hooks (the harness builds it with AM_TEST_HOOKS): the check's
 * interleaving, run where the runtime calls it. */
void (*_Atomic test_hook)(int where, am_cuq *q);

void am_test_hook(int where, am_cuq *q) {
    void (*hook)(int, am_cuq *) = atomic_load(&test_hook);
    if (hook) hook(where, q);
}

/* ---- waiting ------------------------------------------------------------------------
 * A thread of the driver that waits for a condition -- a stream's thread inside a wait
 * operation, cuEventSynchronize, cuCtxSynchronize -- sleeps, as a GPU's waits take no
 * CPU: a waiter spinning on a 2-core machine would take a core from the threads it waits
 * for. What the driver changes itself (a word written or an event's record run by a
 * stream, a stream that ran out of work or entered a wait, a fault, a stream stopped)
 * ticks `changes` and wakes the waiters at once (driver_changed). What changes from
 * outside cannot wake them -- the host's store to a mapped word, a check's to `held` or
 * release_syncs --, so a waiter also looks again on its own: after a few yields, then
 * after naps growing to its most, WAIT_NAP_MOST_NS where the host's stores end the wait
 * (a wait for a word: the most such a store waits to be seen), WAIT_NAP_DRIVER_NS where
 * only the driver's own changes do, but for a check's.
 * (A stream's thread waiting for work, and a launch for its stream's queue to shorten,
 * wait on the stream's own condition instead: fake_stream.moved.) */
#define WAIT_SPINS 8
#define WAIT_NAP_LEAST_NS 2000
#define WAIT_NAP_MOST_NS 200000
#define WAIT_NAP_DRIVER_NS 2000000

static pthread_mutex_t changed_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t changed_cv;  /* (with changed_mu; made once: changed_init) */
static pthread_once_t changed_once = PTHREAD_ONCE_INIT;
static atomic_long changes;        /* ticked by every change of the driver's own */
static atomic_int sleepers;        /* waiters that may be asleep on changed_cv */

static void changed_init(void) { am_cond_init(&changed_cv); }

static void driver_changed(void) {
    atomic_fetch_add(&changes, 1);  /* (then sleepers: a waiter counted before it looks
                                       at changes sees this tick, or is woken) */
    if (atomic_load(&sleepers)) {
        pthread_mutex_lock(&changed_mu);
        pthread_cond_broadcast(&changed_cv);
        pthread_mutex_unlock(&changed_mu);
    }
}

typedef struct {
    long most;  /* its longest nap (0: WAIT_NAP_MOST_NS) */
    long seen;  /* `changes` when the waiter last looked at its condition */
    long nap;   /* its last nap */
    int spins;  /* yields so far */
} waiter;

/* Before each look at the condition. */
static void wait_look(waiter *w) { w->seen = atomic_load(&changes); }

/* After a look that found the condition unmet: until the driver changed something since
 * that look, or a nap passed. */
static void wait_more(waiter *w) {
    if (w->spins < WAIT_SPINS) {
        w->spins++;
        sched_yield();
        return;
    }
    long most = w->most ? w->most : WAIT_NAP_MOST_NS;
    w->nap = w->nap ? w->nap * 2 : WAIT_NAP_LEAST_NS;
    if (w->nap > most) w->nap = most;
    pthread_once(&changed_once, changed_init);
    struct timespec until;
    deadline_after(&until, w->nap);
    atomic_fetch_add(&sleepers, 1);
    pthread_mutex_lock(&changed_mu);
    if (atomic_load(&changes) == w->seen) am_cond_timedwait(&changed_cv, &changed_mu, &until);
    pthread_mutex_unlock(&changed_mu);
    atomic_fetch_sub(&sleepers, 1);
}

static int refers_to_event(const op *o) { return o->kind == OP_RECORD || o->kind == OP_WAIT_EVENT; }

static void event_unref(fake_event *ev) {
    if (atomic_fetch_sub(&ev->refs, 1) == 1) free(ev);
}

/* ---- copies -------------------------------------------------------------------------
 * Device memory is host memory (fake_mem_alloc), so a device pointer is an address and a
 * copy is a memcpy, which its stream runs in order with its other operations. Each copy
 * from its call until its stream is past it is in `copies`: memory that one touches is
 * known (fake_copy_busy), and freeing device memory or unregistering host memory while
 * one does is the runtime's error, counted (freed_busy, unregistered_busy; the memory is
 * then left alone). Host memory is pinned by registering it (cuMemHostRegister,
 * cuMemHostAlloc). As the driver's, a copy from pageable memory reads its source at the
 * call (staged by the driver: it may change once the call returned), and one into
 * pageable memory returns only once it ran -- it would block the calling thread (a loop
 * among them), which the runtime must never have it do: that fails the check. With
 * copy_ns set, a copy takes that long, and its source must not change meanwhile (the DMA
 * engine reads it throughout): one that did is counted (torn_copies). With hold_after set,
 * the copies the streams begin after that many (copies_started) are held until it is
 * cleared or raised, their sources checked meanwhile as well. */
atomic_long copy_ns, copies_started, torn_copies, freed_busy, unregistered_busy, hold_after;

#define FAKE_COPIES 8192
typedef struct {
    uintptr_t dst, src;
    size_t nbytes;
    int used, staged;  /* staged: src is the driver's copy of a pageable source */
} fake_copy;
static fake_copy copies[FAKE_COPIES];
#define FAKE_REGISTERED 1024
static struct { uintptr_t address; size_t nbytes; } registered[FAKE_REGISTERED];
static pthread_mutex_t copies_mu = PTHREAD_MUTEX_INITIALIZER;  /* both tables */

static int overlaps(uintptr_t a, size_t an, uintptr_t b, size_t bn) {
    return a < b + bn && b < a + an;
}

int fake_copy_busy(uintptr_t address, size_t nbytes) {
    int busy = 0;
    pthread_mutex_lock(&copies_mu);
    for (int i = 0; i < FAKE_COPIES && !busy; i++)
        busy = copies[i].used && (overlaps(address, nbytes, copies[i].dst, copies[i].nbytes) ||
                                  overlaps(address, nbytes, copies[i].src, copies[i].nbytes));
    pthread_mutex_unlock(&copies_mu);
    return busy;
}

static int is_registered(uintptr_t address, size_t nbytes) {
    int found = 0;
    pthread_mutex_lock(&copies_mu);
    for (int i = 0; i < FAKE_REGISTERED && !found; i++)
        found = registered[i].nbytes && registered[i].address <= address &&
                address + nbytes <= registered[i].address + registered[i].nbytes;
    pthread_mutex_unlock(&copies_mu);
    return found;
}

void fake_host_register(uintptr_t address, size_t nbytes) {
    pthread_mutex_lock(&copies_mu);
    int i = 0;
    while (i < FAKE_REGISTERED && registered[i].nbytes) i++;
    if (i == FAKE_REGISTERED) die("fake host registrations full");
    registered[i].address = address;
    registered[i].nbytes = nbytes;
    pthread_mutex_unlock(&copies_mu);
}

void fake_host_unregister(uintptr_t address) {
    size_t nbytes = 0;
    pthread_mutex_lock(&copies_mu);
    for (int i = 0; i < FAKE_REGISTERED; i++)
        if (registered[i].nbytes && registered[i].address == address) {
            nbytes = registered[i].nbytes;
            registered[i].nbytes = 0;
        }
    pthread_mutex_unlock(&copies_mu);
    if (nbytes && fake_copy_busy(address, nbytes)) atomic_fetch_add(&unregistered_busy, 1);
}

#define MEM_HEADER 256  /* before each allocation: its size (the alignment kept) */

void *fake_mem_alloc(size_t nbytes) {
    size_t rounded = (nbytes + MEM_HEADER - 1) / MEM_HEADER * MEM_HEADER;
    char *p = aligned_alloc(MEM_HEADER, MEM_HEADER + rounded);
    if (!p) return NULL;
    *(size_t *)p = nbytes;
    return p + MEM_HEADER;
}

void fake_mem_free(void *p) {
    if (!p) return;
    char *base = (char *)p - MEM_HEADER;
    if (fake_copy_busy((uintptr_t)p, *(size_t *)base)) {
        atomic_fetch_add(&freed_busy, 1);  /* a stream may still write it: left alone */
        return;
    }
    free(base);
}

static int64_t copy_new(uintptr_t dst, uintptr_t src, size_t nbytes, int staged) {
    pthread_mutex_lock(&copies_mu);
    int i = 0;
    while (i < FAKE_COPIES && copies[i].used) i++;
    if (i == FAKE_COPIES) die("fake copies full");
    copies[i] = (fake_copy){dst, src, nbytes, 1, staged};
    pthread_mutex_unlock(&copies_mu);
    return i;
}

static void copy_end(int64_t slot) {
    pthread_mutex_lock(&copies_mu);
    if (copies[slot].staged) free((void *)copies[slot].src);
    copies[slot].used = 0;
    pthread_mutex_unlock(&copies_mu);
}

static void copy_run(fake_stream *s, int64_t slot) {
    pthread_mutex_lock(&copies_mu);
    fake_copy c = copies[slot];
    pthread_mutex_unlock(&copies_mu);
    long started = atomic_fetch_add(&copies_started, 1) + 1;
    long slow = atomic_load(&copy_ns);
    void *before = NULL;
    if (slow > 0) {
        before = malloc(c.nbytes ? c.nbytes : 1);
        if (!before) die("malloc");
        memcpy(before, (void *)c.src, c.nbytes);
    }
    for (long h; (h = atomic_load(&hold_after)) && started > h;) {  /* held: a long copy */
        if (atomic_load(&s->stop) == 2 || atomic_load(&fault_code)) break;
        nap_ns(50000);
    }
    if (before) {
        nap_ns(slow);
        if (memcmp(before, (void *)c.src, c.nbytes)) atomic_fetch_add(&torn_copies, 1);
        free(before);
    }
    memcpy((void *)c.dst, (void *)c.src, c.nbytes);
}

/* An operation that leaves its stream, run or not. */
static void op_done(const op *o) {
    if (refers_to_event(o)) event_unref(o->p);
    if (o->kind == OP_COPY) copy_end(o->a);
}

void enqueue(fake_stream *s, op o) {
    if (atomic_load(&s->released)) die("a driver call on a stream after its queue was closed");
    if (s->hw) s = s->hw;  /* behind whatever any stream of its hardware queue handed over */
    if (refers_to_event(&o)) atomic_fetch_add(&((fake_event *)o.p)->refs, 1);
    pthread_mutex_lock(&s->mu);
    if (s->tail - s->head == s->cap) die("fake stream full");
    s->ops[s->tail++ % s->cap] = o;
    pthread_cond_broadcast(&s->moved);
    pthread_mutex_unlock(&s->mu);
}

/* Whether a wait operation is still to be met: a word's (as the driver's 64-bit GEQ, a
 * cyclic comparison), or an event's record (0: never recorded, met). */
static int wait_unmet(const op *o) {
    if (o->kind == OP_WAIT)
        return (int64_t)(atomic_load((_Atomic uint64_t *)o->p) - (uint64_t)o->a) < 0;
    return o->a && !atomic_load(&((fake_event *)o->p)->ended[o->a % FAKE_RECORDS]);
}

/* A stream's thread is inside a wait operation from before its first look at it until
 * after its last (cleared before the operation leaves the stream: its event lives
 * while this is set). */
static void waiting_set(fake_stream *s, int on) {
    pthread_mutex_lock(&s->mu);
    s->waiting = on;
    pthread_mutex_unlock(&s->mu);
}

static void *stream_run(void *arg) {
    fake_stream *s = arg;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        int have = s->head < s->tail;
        op o = have ? s->ops[s->head % s->cap] : (op){0};
        pthread_mutex_unlock(&s->mu);
        if (!have) {  /* asleep until enqueue or a stop wakes it */
            pthread_mutex_lock(&s->mu);
            while (s->head == s->tail && !atomic_load(&s->stop))
                pthread_cond_wait(&s->moved, &s->mu);
            int stopped = s->head == s->tail;
            pthread_mutex_unlock(&s->mu);
            if (stopped) return NULL;
            continue;
        }
        if (atomic_load(&fault_code) && o.kind != OP_RECORD) {
            /* after a fault the context runs nothing (records stay pending) */
        } else if (o.kind == OP_KERNEL) {
            kernel *k = o.p;
            int64_t end = now_ns() + o.a;
            if (o.a >= 50000) nap_ns((long)o.a);  /* a long kernel leaves the CPU */
            while (now_ns() < end) {}
            if (k && k->fault) {
                atomic_store(&fault_code, ILLEGAL_ADDRESS);
                driver_changed();
            } else {
                if (k && k->check && atomic_load(&k->check->ran) < k->at_least)
                    die("a stream ran a command before the value it waited for");
                s->log[atomic_load(&s->ran) % (1 << 16)] = o.arg;
                atomic_fetch_add(&s->ran, 1);
            }
        } else if (o.kind == OP_RECORD) {
            if (!atomic_load(&fault_code))
                atomic_store(&((fake_event *)o.p)->ended[o.a % FAKE_RECORDS], 1);
            driver_changed();
        } else if (o.kind == OP_WRITE) {
            atomic_store((_Atomic uint64_t *)o.p, (uint64_t)o.a);
            driver_changed();
        } else if (o.kind == OP_WAIT || o.kind == OP_WAIT_EVENT) {
            waiting_set(s, 1);
            driver_changed();  /* (a context's synchronize may count it as run out now) */
            waiter w = {.most = o.kind == OP_WAIT ? 0 : WAIT_NAP_DRIVER_NS};  /* (records end it) */
            for (wait_look(&w); wait_unmet(&o); wait_look(&w)) {
                if (atomic_load(&s->stop) == 2) return NULL;
                if (atomic_load(&fault_code)) break;  /* the context runs nothing more */
                wait_more(&w);
            }
            waiting_set(s, 0);
        } else if (o.kind == OP_FILL) {  /* cuMemsetD8/D16/D32Async: items of 1, 2, 4 bytes */
            int size = (int)(o.arg >> 32);
            uint32_t pattern = (uint32_t)o.arg;
            for (int64_t i = 0; i < o.a; i++) {
                char *at = (char *)o.p + i * size;
                if (size == 1) *(uint8_t *)at = (uint8_t)pattern;
                else if (size == 2) *(uint16_t *)at = (uint16_t)pattern;
                else *(uint32_t *)at = pattern;
            }
        } else if (o.kind == OP_COPY) {
            copy_run(s, o.a);
        }
        op_done(&o);
        pthread_mutex_lock(&s->mu);
        int out = ++s->head == s->tail;
        pthread_cond_broadcast(&s->moved);  /* (a launch waiting for the queue to shorten) */
        pthread_mutex_unlock(&s->mu);
        if (out) driver_changed();  /* (a context's synchronize waits for that) */
    }
}

/* The current context, per thread as the driver's (none at first). */
static _Thread_local void *current_ctx;

/* Every stream stream_new made and stream_free has not freed, destroyed ones too: what a
 * context's synchronize waits for. */
static pthread_mutex_t live_mu = PTHREAD_MUTEX_INITIALIZER;
static fake_stream *live;

fake_stream *stream_new(void) {
    fake_stream *s = calloc(1, sizeof *s);
    s->cap = 1 << 20;
    s->ops = calloc(s->cap, sizeof(op));
    s->ctx = current_ctx;  /* (cuStreamCreate makes it in the calling thread's context) */
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->moved, NULL);
    pthread_create(&s->thread, NULL, stream_run, s);
    pthread_mutex_lock(&live_mu);
    s->next_live = live;
    live = s;
    pthread_mutex_unlock(&live_mu);
    return s;
}

/* The default streams, made at their first use and never freed (as the driver's live as
 * long as their context): each context's legacy stream (thread NULL: handles 0 and 1),
 * and each thread's per-thread stream of each context (handle 2). The driver's legacy
 * stream also waits for, and holds up, the context's blocking streams; the streams here
 * are all taken as non-blocking (the backend's are: CU_STREAM_NON_BLOCKING), so every
 * default stream runs as a stream of its own. */
typedef struct default_stream {
    void *ctx;
    const void *thread;  /* the thread's: its per-thread stream; NULL: the legacy one */
    fake_stream *s;
    struct default_stream *next;
} default_stream;
static pthread_mutex_t defaults_mu = PTHREAD_MUTEX_INITIALIZER;
static default_stream *defaults;
static _Thread_local char thread_mark;  /* (its address tells the thread apart) */

fake_stream *fake_stream_of(void *handle) {
    if ((uintptr_t)handle > 2) return handle;
    void *ctx = current_ctx;
    if (!ctx) return NULL;
    const void *thread = (uintptr_t)handle == 2 ? &thread_mark : NULL;
    pthread_mutex_lock(&defaults_mu);
    default_stream *d = defaults;
    while (d && (d->ctx != ctx || d->thread != thread)) d = d->next;
    if (!d) {
        d = calloc(1, sizeof *d);
        if (!d) die("calloc");
        *d = (default_stream){ctx, thread, stream_new(), defaults};  /* (made in ctx) */
        defaults = d;
    }
    pthread_mutex_unlock(&defaults_mu);
    return d->s;
}

/* kernels run so far */
long stream_ran(void *handle) { return atomic_load(&fake_stream_of(handle)->ran); }

/* Its thread stops once it ran what it has (1), or where it is (2: abandoned). */
static void stream_stop(fake_stream *s, int how) {
    pthread_mutex_lock(&s->mu);
    atomic_store(&s->stop, how);
    pthread_cond_broadcast(&s->moved);
    pthread_mutex_unlock(&s->mu);
    driver_changed();  /* (its thread may be inside a wait operation) */
}

fake_stream *stream_sharing(fake_stream *hw) {
    fake_stream *s = calloc(1, sizeof *s);
    s->hw = hw;
    return s;
}

void stream_free(fake_stream *s, int abandon) {
    if ((uintptr_t)s <= 2) die("a default stream freed (the driver's own)");
    if (s->hw) {  /* its operations are hw's */
        free(s);
        return;
    }
    pthread_mutex_lock(&live_mu);
    for (fake_stream **at = &live; *at; at = &(*at)->next_live)
        if (*at == s) {
            *at = s->next_live;
            break;
        }
    pthread_mutex_unlock(&live_mu);
    stream_stop(s, abandon ? 2 : 1);
    pthread_join(s->thread, NULL);
    for (size_t i = s->head; i < s->tail; i++)  /* abandoned: operations never run */
        op_done(&s->ops[i % s->cap]);
    free(s->ops);
    pthread_cond_destroy(&s->moved);
    free(s);
}

/* Streams destroyed with work left, as the driver's cuStreamDestroy leaves them: it
 * returns at once, and the stream's work goes on (a device wait behind a word nobody
 * raises, for good) until the context is released (streams_release). */
static pthread_mutex_t destroyed_mu = PTHREAD_MUTEX_INITIALIZER;
static fake_stream *destroyed[1024];
static int ndestroyed;

void stream_destroy(fake_stream *s) {
    if ((uintptr_t)s <= 2) die("cuStreamDestroy of a default stream (the driver's own)");
    if (s->hw) {
        free(s);
        return;
    }
    pthread_mutex_lock(&s->mu);
    int idle = s->head == s->tail;
    pthread_mutex_unlock(&s->mu);
    if (idle) {
        stream_free(s, 0);
        return;
    }
    stream_stop(s, 1);  /* it runs what it has, then stops */
    pthread_mutex_lock(&destroyed_mu);
    if (ndestroyed == 1024) die("too many streams destroyed with work left");
    destroyed[ndestroyed++] = s;
    pthread_mutex_unlock(&destroyed_mu);
}

/* The context was released: what the streams destroyed with work left still had never
 * runs (one process-wide list: the contexts of simulated GPUs are not told apart). */
void streams_release(void) {
    pthread_mutex_lock(&destroyed_mu);
    int n = ndestroyed;
    fake_stream *left[1024];
    memcpy(left, destroyed, sizeof(fake_stream *) * (size_t)n);
    ndestroyed = 0;
    pthread_mutex_unlock(&destroyed_mu);
    for (int i = 0; i < n; i++) stream_free(left[i], 1);
}

/* Whether stream s ran out of what it can run: nothing left, abandoned (it stops where it
 * is), or inside a wait that is not met -- as looked at here, not as its thread last saw
 * it: a word raised just before the look is met, and the work behind the wait is still
 * to run. (Under live_mu: s is not freed meanwhile.) */
static int stream_ran_out(fake_stream *s) {
    if (atomic_load(&s->stop) == 2) return 1;
    pthread_mutex_lock(&s->mu);
    int out = s->head == s->tail || (s->waiting && wait_unmet(&s->ops[s->head % s->cap]));
    pthread_mutex_unlock(&s->mu);
    return out;
}

/* As cuCtxSynchronize: returns once every stream of context `ctx` (made with it current;
 * destroyed ones, which run on, too) ran out of what it can run, looked at all at once;
 * at once with the context's sticky error once a kernel faulted. A stream inside a wait
 * nothing has met yet counts as run out, where the driver's call would go on waiting
 * for whatever meets it later (a host signal, another device's close, after this one's):
 * a close whose stream waits so returns here. 30 s at most: a stream that runs on for
 * good fails the check rather than hang. */
int fake_ctx_synchronize(void *ctx) {
    int64_t deadline = now_ns() + 30000000000LL;
    for (waiter w = {.most = WAIT_NAP_DRIVER_NS};; wait_more(&w)) {  /* (its streams end it) */
        wait_look(&w);
        int code = atomic_load(&fault_code);
        if (code) return code;
        int out = 1;
        pthread_mutex_lock(&live_mu);
        for (fake_stream *s = live; s && out; s = s->next_live)
            if (s->ctx == ctx) out = stream_ran_out(s);
        pthread_mutex_unlock(&live_mu);
        if (out) return 0;
        if (now_ns() > deadline) die("cuCtxSynchronize: a stream of the context ran for 30 s");
    }
}

/* ---- the driver functions the runtime calls (its signatures) ------------------------ */
/* A call on `stream` stays in the driver while *gate is that stream (a check clears it
 * once it has done what must happen meanwhile), 10 s at most: a caller the runtime
 * wrongly waits for inside that call still fails its check rather than hang. */
static void gate_in_driver(fake_stream *_Atomic *gate, void *stream) {
    int64_t deadline = now_ns() + 10000000000LL;
    while (atomic_load(gate) == stream && now_ns() < deadline) nap_ns(100000);
}

static int f_launch(void *fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                    unsigned bz, unsigned shared, void *stream, void **params, void **extra) {
    (void)shared; (void)extra;
    int inject = injected(FAKE_CALL_LAUNCH);
    if (inject) return inject;
    if (atomic_load(&fault_code)) return atomic_load(&fault_code);
    if (fn && fn == refuse_fn) return 1;  /* CUDA_ERROR_INVALID_VALUE */
    const unsigned *most = fake_launch_limits, size[6] = {gx, gy, gz, bx, by, bz};
    const kernel *spec = fn;
    int oversized = 0;
    for (int i = 0; i < 3; i++)
        oversized |= !size[i] || !size[3 + i] || size[i] > most[4 + i] ||
                     size[3 + i] > most[1 + i];
    unsigned long threads = (unsigned long)bx * by * bz;
    if (oversized || threads > most[0] ||
        (spec && spec->max_threads && threads > spec->max_threads)) {
        atomic_fetch_add(&oversized_launches, 1);
        return 1;  /* CUDA_ERROR_INVALID_VALUE */
    }
    fake_stream *st = fake_stream_of(stream);
    if (!st) return INVALID_CONTEXT;
    long limit = atomic_load(&deep_limit);
    if (limit > 0) {  /* blocks until its stream's queue is short enough (or stopped) */
        pthread_mutex_lock(&st->mu);
        if (st->tail - st->head > (size_t)limit) atomic_fetch_add(&blocked_launches, 1);
        while (st->tail - st->head > (size_t)limit && !atomic_load(&st->stop))
            pthread_cond_wait(&st->moved, &st->mu);
        pthread_mutex_unlock(&st->mu);
    }
    kernel *k = fn;
    int64_t arg = params ? *(int64_t *)params[0] : 0;
    int64_t duration = k && k->duration_ns ? k->duration_ns : 200 + (arg * 7919) % 3000;
    enqueue(st, (op){OP_KERNEL, duration, k, arg});
    return 0;
}
static int f_record(void *e, void *stream) {
    int inject = injected(FAKE_CALL_RECORD);
    if (inject) return inject;
    if (atomic_load(&fault_code)) return atomic_load(&fault_code);
    if (!(stream = fake_stream_of(stream))) return INVALID_CONTEXT;
    fake_stream *refused = stream;  /* the next record there (refuse_code) */
    if (atomic_load(&refuse_records) == refused) {
        if (atomic_fetch_sub(&refuse_more, 1) <= 0) {
            atomic_store(&refuse_more, 0);
            atomic_compare_exchange_strong(&refuse_records, &refused, NULL);
        }
        int first = atomic_fetch_add(&records_refused, 1) == 0;
        int code = atomic_load(&refuse_code), more = atomic_load(&refuse_more_code);
        if (!first && more) code = more;
        return code ? code : 1;
    }
    fake_event *ev = e;
    long slow = atomic_load(&record_ns);
    if (slow > 0 || atomic_load(&record_gate_on) == stream) {
        atomic_fetch_add(&records_in_driver, 1);
        if (slow > 0) nap_ns(slow);
        gate_in_driver(&record_gate_on, stream);
        atomic_fetch_sub(&records_in_driver, 1);
    }
    int64_t gen = atomic_load(&ev->recorded) + 1;  /* (one thread records an event) */
    atomic_store(&ev->ended[gen % FAKE_RECORDS], 0);  /* before a query can look at it */
    atomic_store(&ev->recorded, gen);
    fake_stream *holding = stream;  /* (before the stream can end it: never seen ended) */
    if (atomic_compare_exchange_strong(&hold_records_on, &holding, NULL)) atomic_store(&held, ev);
    enqueue(stream, (op){OP_RECORD, gen, ev, 0});
    return 0;
}
static int f_look(void *e) {
    fake_event *ev = e;
    if (e == atomic_load(&held)) return NOT_READY;
    if (atomic_load(&fault_code)) return atomic_load(&fault_code);
    int64_t latest = atomic_load(&ev->recorded);
    return !latest || atomic_load(&ev->ended[latest % FAKE_RECORDS]) ? 0 : NOT_READY;
}
static int f_query(void *e) {
    atomic_fetch_add(&event_queries, 1);
    return f_look(e);
}
static int f_sync(void *e) {
    int r;
    if (!(((fake_event *)e)->flags & 0x1)) die("blocked on an event made without BLOCKING_SYNC");
    waiter w = {.most = WAIT_NAP_DRIVER_NS};  /* (a record ends it, or a check's store) */
    for (wait_look(&w); (r = f_look(e)) == NOT_READY && !atomic_load(&release_syncs);
         wait_look(&w))
        wait_more(&w);
    return r;
}
static int f_create(void **e, unsigned flags) {
    int inject = injected(FAKE_CALL_CREATE);
    if (inject) return inject;
    *e = calloc(1, sizeof(fake_event));
    ((fake_event *)*e)->flags = flags;
    atomic_store(&((fake_event *)*e)->refs, 1);
    atomic_fetch_add(&events_made, 1);
    return 0;
}
static int f_destroy(void *e) {
    if (atomic_load(&((fake_event *)e)->waited))
        die("an event was destroyed while a stream's wait on it was in the driver");
    event_unref(e);
    atomic_fetch_add(&events_destroyed, 1);
    return 0;
}
static int f_write(void *stream, void *word, uint64_t value, unsigned flags) {
    (void)flags;
    int inject = injected(FAKE_CALL_WRITE);
    if (inject) return inject;
    if (atomic_load(&fault_code)) return atomic_load(&fault_code);
    if (word == &refuse_word) return 1;  /* CUDA_ERROR_INVALID_VALUE */
    if (!(stream = fake_stream_of(stream))) return INVALID_CONTEXT;
    enqueue(stream, (op){OP_WRITE, (int64_t)value, word, 0});
    return 0;
}
static int fill(void *stream, uint64_t dst, uint32_t pattern, int size, size_t items) {
    int inject = injected(FAKE_CALL_FILL);
    if (inject) return inject;
    if (atomic_load(&fault_code)) return atomic_load(&fault_code);
    if (dst % (uint64_t)size) return 1;  /* CUDA_ERROR_INVALID_VALUE: misaligned */
    if (!(stream = fake_stream_of(stream))) return INVALID_CONTEXT;
    enqueue(stream, (op){OP_FILL, (int64_t)items, (void *)(uintptr_t)dst,
                         (int64_t)pattern | (int64_t)size << 32});
    return 0;
}
static int f_memset8(uint64_t dst, unsigned char uc, size_t n, void *stream) {
    return fill(stream, dst, uc, 1, n);
}
static int f_memset16(uint64_t dst, unsigned short us, size_t n, void *stream) {
    return fill(stream, dst, us, 2, n);
}
static int f_memset32(uint64_t dst, unsigned int ui, size_t n, void *stream) {
    return fill(stream, dst, ui, 4, n);
}
static int copy_call(void *stream, uintptr_t dst, uintptr_t src, size_t nbytes, int staged,
                     int kind) {
    int inject = injected(kind);
    if (inject) return inject;
    if (atomic_load(&fault_code)) return atomic_load(&fault_code);
    if (!(stream = fake_stream_of(stream))) return INVALID_CONTEXT;
    if (staged) {  /* from pageable memory: read now, into the driver's own */
        void *copy = malloc(nbytes ? nbytes : 1);
        if (!copy) die("malloc");
        memcpy(copy, (void *)src, nbytes);
        src = (uintptr_t)copy;
    }
    enqueue(stream, (op){OP_COPY, copy_new(dst, src, nbytes, staged), NULL, 0});
    return 0;
}
static int f_copy(uint64_t dst, uint64_t src, size_t nbytes, void *stream) {
    return copy_call(stream, dst, src, nbytes, 0, FAKE_CALL_COPY);
}
static int f_copy_peer(uint64_t dst, void *dst_ctx, uint64_t src, void *src_ctx, size_t nbytes,
                       void *stream) {
    if (!dst_ctx || !src_ctx) die("a peer copy without its contexts");
    return copy_call(stream, dst, src, nbytes, 0, FAKE_CALL_COPY_PEER);
}
static int f_htod(uint64_t dst, const void *src, size_t nbytes, void *stream) {
    return copy_call(stream, dst, (uintptr_t)src, nbytes, !is_registered((uintptr_t)src, nbytes),
                     FAKE_CALL_HTOD);
}
static int f_dtoh(void *dst, uint64_t src, size_t nbytes, void *stream) {
    if (!is_registered((uintptr_t)dst, nbytes))
        die("a device-to-host copy into pageable memory (it blocks the calling thread)");
    return copy_call(stream, (uintptr_t)dst, src, nbytes, 0, FAKE_CALL_DTOH);
}
static int f_wait(void *stream, void *word, uint64_t value, unsigned flags) {
    (void)flags;
    int inject = injected(FAKE_CALL_WAIT);
    if (inject) return inject;
    if (atomic_load(&fault_code)) return atomic_load(&fault_code);
    if (!(stream = fake_stream_of(stream))) return INVALID_CONTEXT;
    enqueue(stream, (op){OP_WAIT, (int64_t)value, word, 0});
    return 0;
}
static int f_wait_event(void *stream, void *e, unsigned flags) {
    (void)flags;
    int inject = injected(FAKE_CALL_WAIT_EVENT);
    if (inject) return inject;
    if (!(stream = fake_stream_of(stream))) return INVALID_CONTEXT;
    fake_event *ev = e;
    int64_t recorded = atomic_load(&ev->recorded);
    long slow = atomic_load(&wait_event_ns);
    if (slow > 0 || atomic_load(&wait_gate_on) == stream) {
        /* the record it waits for is the one current when it was called */
        atomic_fetch_add(&ev->waited, 1);
        atomic_fetch_add(&waits_in_driver, 1);
        if (slow > 0) nap_ns(slow);
        gate_in_driver(&wait_gate_on, stream);
        if (atomic_load(&ev->recorded) != recorded)
            die("an event was recorded again while a stream's wait on it was in the driver");
        atomic_fetch_sub(&ev->waited, 1);
        atomic_fetch_sub(&waits_in_driver, 1);
    }
    enqueue(stream, (op){OP_WAIT_EVENT, recorded, ev, 0});
    return 0;
}
static int f_ctx_set(void *ctx) {
    if (ctx && ctx == atomic_load(&refuse_ctx)) return 1;  /* CUDA_ERROR_INVALID_VALUE */
    current_ctx = ctx;
    return 0;
}
static int f_ctx_get(void **ctx) { *ctx = current_ctx; return 0; }
/* The context every stream belongs to (the checks' queues are of context 1). */
void *_Atomic stream_context = (void *)1;
/* Non-NULL: every stream is of this green context (CUDA 12.5's cuStreamGetCtx_v2 gives it
 * in the third pointer, and the device's primary context in the second). */
void *_Atomic stream_green = NULL;
atomic_int stream_context_error; /* non-zero: cuStreamGetCtx fails with it */
static int f_stream_get_ctx(void *stream, void **ctx, void **green) {  /* (as CUDA 12.5's) */
    int error = atomic_load(&stream_context_error);
    if (error) return error;
    if ((uintptr_t)stream <= 2) {  /* a default stream: of the current context */
        if (!current_ctx) return INVALID_CONTEXT;
        *ctx = current_ctx;
        *green = NULL;
        return 0;
    }
    *ctx = atomic_load(&stream_context);
    *green = atomic_load(&stream_green);
    return 0;
}
void fake_ctx_set_current(void *ctx) { current_ctx = ctx; }
void *fake_ctx_current(void) { return current_ctx; }
static int f_unused(void) { die("a driver call the queues should not make"); return 1; }

long max_inflight = 1 << 20;  /* the queues' bound (most checks: none) */

fake_queue queue_on(fake_stream *s, long bound) {
    fake_queue f;
    f.s = s;
    f.t = am_timeline_new();
    f.word = calloc(1, sizeof(uint64_t));
    am_timeline_set_word(f.t, f.word);
    f.q = am_cuq_new((void *)1, f.s, f.t, 30000, bound);
    if (!f.q) die("am_cuq_new");
    return f;
}

fake_queue queue_new(void) { return queue_on(stream_new(), max_inflight); }

fake_queue queue_bounded(long bound) {  /* at most `bound` commands in flight */
    long saved = max_inflight;
    max_inflight = bound;
    fake_queue f = queue_new();
    max_inflight = saved;
    return f;
}

void queue_free(fake_queue f, int abandon) {
    am_cuq_close(f.q, abandon);
    stream_free(f.s, abandon);
    am_timeline_free(f.t);
    free(f.word);
}

const unsigned dims[7] = {1, 1, 1, 1, 1, 1, 0};

int launch(fake_queue f, kernel *k, int64_t arg, uint64_t value) {
    void *params[1] = {&arg};
    return am_cuq_launch(f.q, k, dims, params, 1, value);
}

/* Point the runtime's driver table at the simulated driver. */
void fake_driver_install(void) {
    for (int i = 0; i < CU_NFUNCS; i++) am_cuda_set(i, (void *)f_unused);
    am_cuda_set(CU_LAUNCH, (void *)f_launch);
    am_cuda_set(CU_WRITE64, (void *)f_write);
    am_cuda_set(CU_WAIT64, (void *)f_wait);
    am_cuda_set(CU_EVENT_CREATE, (void *)f_create);
    am_cuda_set(CU_EVENT_RECORD, (void *)f_record);
    am_cuda_set(CU_EVENT_QUERY, (void *)f_query);
    am_cuda_set(CU_EVENT_SYNC, (void *)f_sync);
    am_cuda_set(CU_EVENT_DESTROY, (void *)f_destroy);
    am_cuda_set(CU_CTX_SET, (void *)f_ctx_set);
    am_cuda_set(CU_WAIT_EVENT, (void *)f_wait_event);
    am_cuda_set(CU_CTX_GET, (void *)f_ctx_get);
    am_cuda_set(CU_COPY, (void *)f_copy);
    am_cuda_set(CU_COPY_PEER, (void *)f_copy_peer);
    am_cuda_set(CU_COPY_HTOD, (void *)f_htod);
    am_cuda_set(CU_COPY_DTOH, (void *)f_dtoh);
    am_cuda_set(CU_MEMSET8, (void *)f_memset8);
    am_cuda_set(CU_MEMSET16, (void *)f_memset16);
    am_cuda_set(CU_MEMSET32, (void *)f_memset32);
    am_cuda_set(CU_STREAM_GET_CTX, (void *)f_stream_get_ctx);
}
