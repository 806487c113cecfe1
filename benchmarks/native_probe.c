/* Times driver calls and asyncmetal's native submission from C, without Python or ctypes
 * in the way (built and called by cuda_submit_probe.py). Every function returns the
 * nanoseconds per iteration of n iterations, or a negative CUresult. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

typedef int (*launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                         unsigned, void *, void **, void **);
typedef int (*record_fn)(void *, void *);
typedef int (*query_fn)(void *);
typedef int (*ctx_get_fn)(void **);
typedef int (*sync_fn)(void *);
typedef int (*am_launch_fn)(void *, void *, const unsigned *, void **, int, uint64_t);

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

double probe_ctx_get(void *ctx_get, long n) {
    void *ctx;
    int64_t t = now_ns();
    for (long i = 0; i < n; i++) ((ctx_get_fn)ctx_get)(&ctx);
    return (double)(now_ns() - t) / n;
}

/* launch (+ event record when record != NULL) n times on stream, then synchronize. */
double probe_launch(void *launch, void *record, void *event, void *sync, void *fn, void *stream,
                    long n) {
    int64_t t = now_ns();
    for (long i = 0; i < n; i++) {
        int r = ((launch_fn)launch)(fn, 1, 1, 1, 1, 1, 1, 0, stream, NULL, NULL);
        if (!r && record) r = ((record_fn)record)(event, stream);
        if (r) return -r;
    }
    double per = (double)(now_ns() - t) / n;
    ((sync_fn)sync)(stream);
    return per;
}

/* asyncmetal's native submission, n times, values from first. */
double probe_am_launch(void *am_launch, void *q, void *fn, const unsigned *dims, uint64_t first,
                       long n) {
    int64_t t = now_ns();
    for (long i = 0; i < n; i++) {
        int r = ((am_launch_fn)am_launch)(q, fn, dims, NULL, 0, first + (uint64_t)i);
        if (r) return -r;
    }
    return (double)(now_ns() - t) / n;
}

/* A second thread querying an event every gap_ns (as a completion thread polls) while
 * this one launches: the cost of sharing the driver's locks. */
typedef struct {
    void *query, *event, *ctx_set, *ctx;
    long gap_ns;
    atomic_int stop;
    long queries;
    void **events;                 /* with events: query the one last recorded */
    atomic_long *last;
    long nevents;
} poller;

static void *poll_run(void *arg) {
    poller *p = arg;
    ((int (*)(void *))p->ctx_set)(p->ctx);
    int64_t next = now_ns();
    while (!atomic_load(&p->stop)) {
        int64_t t = now_ns();
        if (t >= next) {
            void *event = p->event;
            if (p->events) {
                long last = atomic_load(p->last);
                if (last < 0) goto skip;
                event = p->events[last % p->nevents];
            }
            ((query_fn)p->query)(event);
            p->queries++;
            next = t + p->gap_ns;
        }
    skip:
        sched_yield();
    }
    return NULL;
}

double probe_launch_polled(void *launch, void *record, void *event, void *sync, void *query,
                           void *poll_event, void *ctx_set, void *ctx, long gap_ns, void *fn,
                           void *stream, long n) {
    poller p = {query, poll_event, ctx_set, ctx, gap_ns, 0, 0, NULL, NULL, 0};
    pthread_t thread;
    if (pthread_create(&thread, NULL, poll_run, &p)) return -1;
    double per = probe_launch(launch, record, event, sync, fn, stream, n);
    atomic_store(&p.stop, 1);
    pthread_join(thread, NULL);
    return per;
}

/* launch + record, each command with the next of nevents events (as asyncmetal's queue
 * recycles them), with a thread querying the event last recorded every gap_ns when
 * gap_ns > 0 (as its completion thread does). */
double probe_launch_rotating(void *launch, void *record, void **events, long nevents,
                             void *sync, void *query, void *ctx_set, void *ctx, long gap_ns,
                             void *fn, void *stream, long n) {
    atomic_long last = -1;
    poller p = {query, NULL, ctx_set, ctx, gap_ns, 0, 0, events, &last, nevents};
    pthread_t thread;
    if (gap_ns > 0 && pthread_create(&thread, NULL, poll_run, &p)) return -1;
    int64_t t = now_ns();
    int r = 0;
    for (long i = 0; i < n && !r; i++) {
        r = ((launch_fn)launch)(fn, 1, 1, 1, 1, 1, 1, 0, stream, NULL, NULL);
        if (!r) r = ((record_fn)record)(events[i % nevents], stream);
        atomic_store(&last, i);
    }
    double per = (double)(now_ns() - t) / n;
    if (gap_ns > 0) {
        atomic_store(&p.stop, 1);
        pthread_join(thread, NULL);
    }
    ((sync_fn)sync)(stream);
    return r ? -r : per;
}

/* One device copy of nbytes, waited for with cuStreamSynchronize (gap_ns < 0) or by
 * querying an event recorded behind it every gap_ns from this thread (as a completion
 * thread polls). Returns the nanoseconds from the copy call to the wait's end; *submit
 * gets the copy call's own nanoseconds. */
typedef int (*copy_fn)(uint64_t, uint64_t, size_t, void *);
double probe_copy(void *copy, void *record, void *event, void *sync, void *query, void *stream,
                  uint64_t dst, uint64_t src, size_t nbytes, long gap_ns, double *submit) {
    int64_t t = now_ns();
    int r = ((copy_fn)copy)(dst, src, nbytes, stream);
    *submit = (double)(now_ns() - t);
    if (r) return -r;
    if (gap_ns < 0) {
        r = ((sync_fn)sync)(stream);
    } else {
        if ((r = ((record_fn)record)(event, stream))) return -r;
        int64_t next = 0;
        for (;;) {
            int64_t s = now_ns();
            if (s >= next) {
                if ((r = ((query_fn)query)(event)) != 600) break;
                next = s + gap_ns;
            }
            sched_yield();
        }
    }
    return r ? -r : (double)(now_ns() - t);
}

/* The same through asyncmetal's native queue: am_cuq_copy, then the queue's timeline
 * read until its completion thread confirmed value. */
typedef int (*am_copy_fn)(void *, uint64_t, uint64_t, void *, size_t, uint64_t, long);
typedef int (*am_spin_fn)(void *, uint64_t, long);
double probe_am_copy(void *am_copy, void *am_spin, void *q, void *timeline, uint64_t dst,
                     uint64_t src, size_t nbytes, uint64_t value, long spin_ns,
                     double *submit) {
    int64_t t = now_ns();
    int r = ((am_copy_fn)am_copy)(q, dst, src, NULL, nbytes, value, spin_ns);
    *submit = (double)(now_ns() - t);
    if (r) return -r;
    while (!((am_spin_fn)am_spin)(timeline, value, 1000000)) {}
    return (double)(now_ns() - t);
}
