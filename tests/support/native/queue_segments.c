/* A cpu queue's command segments under concurrent pushes, closes and drains at the
 * segment's edges (tests/reliability/test_native.py builds and runs it, plain and under
 * ThreadSanitizer and AddressSanitizer, with AM_TEST_HOST_ALLOC: the runtime allocates
 * and frees a queue's command segments through the two functions below, which count
 * them).
 *
 *   queue_segments ITERATIONS
 *
 * Checks, each printing "ok <name>" or exiting non-zero with a message:
 *   edges     backlogs of 1, 63, 64, 65, 127, 128, 129 and 192 calls held by a wait that
 *             stops the queue's thread after 0, 62, 63, 64 or 65 commands (its take is
 *             then at or around a segment's end while the pushes go on): once released
 *             the calls run in the order pushed, and once they ran the queue holds its
 *             first segment and one spare at most; then the same sizes pushed to a
 *             running queue, each once the one before drained (the queue emptied at and
 *             around a segment's end, then written again)
 *   pushers   four threads pushing calls at once to one running queue (its thread taking
 *             them meanwhile, spinning or asleep): every call runs once, each thread's in
 *             its order, and a close that finishes returns once all ran
 *   closing   a close landing as a backlog another thread pushed (1 to 320 calls) is
 *             run: with abandon, the close returns and frees every segment
 *             (however many are queued, and the spare); without, every command pushed
 *             before it ran
 *   discard   a discard landing in a backlog pushed across segments: no call runs after
 *             it, the queue's timeline still reaches the last value, and the close frees
 *             every segment
 * Every check ends with no command memory left allocated. A watchdog ends the run with
 * the check it is stuck in, if one takes over 20 s.
 */
#include "amrt.h"
#include <stdio.h>

static void die(const char *what) { fprintf(stderr, "FAIL %s\n", what); exit(1); }

/* Each block carries its size in front of it. */
enum { HEADER = 16 };
static atomic_size_t live;

void *am_test_host_alloc(size_t size) {
    char *p = malloc(size + HEADER);
    if (!p) return NULL;
    memcpy(p, &size, sizeof size);
    atomic_fetch_add(&live, size);
    return p + HEADER;
}

void am_test_host_free(void *block) {
    char *p = (char *)block - HEADER;
    size_t size;
    memcpy(&size, p, sizeof size);
    atomic_fetch_sub(&live, size);
    free(p);
}

static atomic_long progress;
static const char *_Atomic phase = "start";

static void *watchdog(void *arg) {
    (void)arg;
    long last = -1;
    int64_t since = now_ns();
    for (;;) {
        nap_ns(100000000);
        long now = atomic_load(&progress);
        if (now != last) { last = now; since = now_ns(); continue; }
        if (now_ns() - since > 20000000000LL) {
            fprintf(stderr, "FAIL hang: %s stuck at step %ld\n", atomic_load(&phase), now);
            fflush(stderr);
            _exit(3);
        }
    }
    return NULL;
}

/* Wait up to 30 s for t to reach v. */
static int reached(am_timeline *t, uint64_t v) {
    int64_t deadline = now_ns() + 30000000000LL;
    while (!am_timeline_spin(t, v, 2000)) {
        if (now_ns() > deadline) return 0;
        sched_yield();
    }
    return 1;
}

/* The calls' own record of their order, per pushing thread: each call gets its thread
 * and its number there, one past that thread's last one. Run on the queue's thread
 * only; read by the others once the queue's timeline (or its close) says they ran. */
enum { PUSHERS = 4 };
static int64_t next_call[PUSHERS];
static atomic_long calls_run;
static atomic_int out_of_order;

static void numbered(int64_t pusher, int64_t i) {
    if (i != next_call[pusher]) atomic_store(&out_of_order, 1);
    next_call[pusher] = i + 1;
    atomic_fetch_add(&calls_run, 1);
}

static void reset_calls(void) {
    memset(next_call, 0, sizeof next_call);
    atomic_store(&calls_run, 0);
    atomic_store(&out_of_order, 0);
}

static int push_call(am_queue *q, int64_t pusher, int64_t i, uint64_t value) {
    int64_t args[AM_MAX_ARGS] = {pusher, i};
    return am_queue_call(q, (void *)numbered, 2, args, 0, NULL, value);
}

/* What a queue's command memory may be once nothing is queued: its first segment and
 * one spare. */
static size_t idle_most(void) { return 2 * sizeof(am_cmdseg); }

static void check_edges(void) {
    atomic_store(&phase, "edges");
    static const long sizes[] = {1, 63, 64, 65, 127, 128, 129, 192};
    static const long stops[] = {0, 62, 63, 64, 65};
    enum { NSIZES = sizeof sizes / sizeof *sizes, NSTOPS = sizeof stops / sizeof *stops };
    for (int spin = 0; spin < 2; spin++) {
        am_timeline *own = am_timeline_new();
        am_queue *q = own ? am_queue_new(own, spin ? 50000 : 0, 19) : NULL;
        if (!q) die("edges: out of memory");
        uint64_t done = 0;
        for (int s = 0; s < NSTOPS; s++) {
            for (int k = 0; k < NSIZES; k++) {
                /* stops[s] calls run first, then a wait holds the thread: its next take
                 * is at stops[s] in the segments; sizes[k] more are pushed behind it */
                reset_calls();
                am_timeline *gate = am_timeline_new();
                if (!gate) die("edges: out of memory");
                long n = stops[s] + sizes[k];
                for (long i = 0; i < stops[s]; i++)
                    if (push_call(q, 0, i, ++done)) die("edges: push");
                if (am_queue_wait(q, gate, 1, ++done)) die("edges: push");
                if (!reached(own, done - 1)) die("edges: the calls before the wait never ran");
                for (long i = stops[s]; i < n; i++)
                    if (push_call(q, 0, i, ++done)) die("edges: push");
                am_timeline_signal(gate, 1);
                if (!reached(own, done)) die("edges: a held backlog never ran");
                if (atomic_load(&out_of_order) || next_call[0] != n)
                    die("edges: a held backlog ran out of order");
                if (atomic_load(&live) > idle_most())
                    die("edges: the queue kept more than a spare segment once drained");
                am_timeline_free(gate);
                atomic_fetch_add(&progress, 1);
            }
        }
        /* Drained to empty, then written again, at and around a segment's end. */
        for (int round = 0; round < 3; round++) {
            for (int k = 0; k < NSIZES; k++) {
                reset_calls();
                for (long i = 0; i < sizes[k]; i++)
                    if (push_call(q, 0, i, ++done)) die("edges: push");
                if (!reached(own, done)) die("edges: a refill never ran");
                if (atomic_load(&out_of_order) || next_call[0] != sizes[k])
                    die("edges: a refill ran out of order");
                atomic_fetch_add(&progress, 1);
            }
        }
        am_queue_close(q, 0);
        am_timeline_free(own);
        if (atomic_load(&live) != 0) die("edges: close left command memory allocated");
    }
    puts("ok edges");
}

typedef struct {
    am_queue *q;
    int64_t pusher;
    long n;
    atomic_int *go;
} pusher_arg;

static void *pusher(void *arg) {
    pusher_arg *p = arg;
    while (!atomic_load(p->go)) sched_yield();
    for (long i = 0; i < p->n; i++) {
        /* value 0: the pushers' order among each other is not the queue's order */
        if (push_call(p->q, p->pusher, i, 0)) die("pushers: push");
        if (i % 97 == p->pusher) sched_yield();  /* let the queue's thread drain some */
    }
    return NULL;
}

static void check_pushers(long n) {
    atomic_store(&phase, "pushers");
    for (long round = 0; round < n; round++) {
        am_timeline *own = am_timeline_new();
        am_queue *q = own ? am_queue_new(own, round % 2 ? 50000 : 0, 19) : NULL;
        if (!q) die("pushers: out of memory");
        reset_calls();
        atomic_int go = 0;
        pusher_arg args[PUSHERS];
        pthread_t threads[PUSHERS];
        long each = 64 * (1 + round % 5) + round % 3 - 1;  /* 63 .. 321: at the edges */
        for (int i = 0; i < PUSHERS; i++) {
            args[i] = (pusher_arg){q, i, each, &go};
            pthread_create(&threads[i], NULL, pusher, &args[i]);
        }
        atomic_store(&go, 1);
        for (int i = 0; i < PUSHERS; i++) pthread_join(threads[i], NULL);
        am_queue_close(q, 0);
        if (atomic_load(&calls_run) != PUSHERS * each) die("pushers: a call was lost");
        if (atomic_load(&out_of_order)) die("pushers: a thread's calls ran out of order");
        for (int i = 0; i < PUSHERS; i++)
            if (next_call[i] != each) die("pushers: a thread's calls did not all run");
        am_timeline_free(own);
        if (atomic_load(&live) != 0) die("pushers: close left command memory allocated");
        atomic_fetch_add(&progress, 1);
    }
    puts("ok pushers");
}

typedef struct {
    am_queue *q;
    long n;
    atomic_long pushed;
    atomic_int *go;
} backlog_arg;

/* Push n calls as fast as it can, counting them; the close is the other thread's. */
static void *push_backlog(void *arg) {
    backlog_arg *b = arg;
    while (!atomic_load(b->go)) sched_yield();
    for (long i = 0; i < b->n; i++) {
        if (push_call(b->q, 0, i, (uint64_t)i + 1)) die("closing: push");
        atomic_fetch_add(&b->pushed, 1);
    }
    return NULL;
}

static void check_closing(long n) {
    atomic_store(&phase, "closing");
    for (long round = 0; round < n; round++) {
        int abandon = round % 2;
        am_timeline *own = am_timeline_new();
        am_queue *q = own ? am_queue_new(own, round % 4 < 2 ? 0 : 50000, 19) : NULL;
        if (!q) die("closing: out of memory");
        reset_calls();
        atomic_int go = 0;
        /* 1 to 320 calls: the close lands at varied points of their run, once the
         * pushing thread is done (a close is never concurrent with a push: Python
         * seals the device under its submission lock before it closes a queue). */
        backlog_arg b = {q, 1 + (round * 37) % 320, 0, &go};
        pthread_t th;
        pthread_create(&th, NULL, push_backlog, &b);
        atomic_store(&go, 1);
        pthread_join(th, NULL);
        long pushed = atomic_load(&b.pushed);
        am_queue_close(q, abandon);
        long ran = atomic_load(&calls_run);
        if (atomic_load(&out_of_order)) die("closing: calls ran out of order");
        if (!abandon && ran != pushed) die("closing: a close that finishes lost calls");
        if (ran > pushed) die("closing: more calls ran than were pushed");
        if ((long)am_timeline_value(own) != ran) die("closing: the timeline is not at the last call run");
        am_timeline_free(own);
        if (atomic_load(&live) != 0) die("closing: close left command memory allocated");
        atomic_fetch_add(&progress, 1);
    }
    puts("ok closing");
}

static void check_discard(long n) {
    atomic_store(&phase, "discard");
    for (long round = 0; round < n; round++) {
        am_timeline *own = am_timeline_new();
        am_queue *q = own ? am_queue_new(own, round % 2 ? 50000 : 0, 19) : NULL;
        if (!q) die("discard: out of memory");
        reset_calls();
        long total = 64 * (1 + round % 4) + round % 3 - 1;
        long at = (round * 31) % total;
        for (long i = 0; i < total; i++) {
            if (i == at) am_queue_discard(q);
            if (push_call(q, 0, i, (uint64_t)i + 1)) die("discard: push");
        }
        long ran_before = atomic_load(&calls_run);
        if (!reached(own, (uint64_t)total)) die("discard: the queue's timeline stopped short");
        am_queue_close(q, 0);
        if (atomic_load(&calls_run) > at || ran_before > at)
            die("discard: a call pushed after the discard ran");
        if (atomic_load(&out_of_order)) die("discard: calls ran out of order");
        am_timeline_free(own);
        if (atomic_load(&live) != 0) die("discard: close left command memory allocated");
        atomic_fetch_add(&progress, 1);
    }
    puts("ok discard");
}

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 200;
    pthread_t dog;
    pthread_create(&dog, NULL, watchdog, NULL);
    pthread_detach(dog);
    check_edges();
    check_pushers(n);
    check_closing(n);
    check_discard(n);
    return 0;
}
