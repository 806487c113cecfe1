/* A cpu queue's command memory under a backlog (tests/reliability/test_native.py builds
 * and runs it, plain and under ThreadSanitizer and AddressSanitizer, with
 * AM_TEST_HOST_ALLOC: the runtime allocates and frees a queue's command memory through
 * the two functions below, which count it).
 *
 *   queue_backlog COMMANDS
 *
 * A queue held by a wait on a timeline nobody has signalled yet is given COMMANDS kernel
 * calls, each pushed on this thread as an event loop would:
 *   - no push allocates more than one segment of commands (a push that grew one array
 *     of them, copying what is queued, allocates more each time the backlog doubles);
 *   - once the wait is released, the calls run in the order pushed (across segments);
 *   - once they ran, the queue holds what it held before the backlog, and one spare
 *     segment at most.
 * Twice (the second backlog reuses what the first left); then a third backlog is closed
 * with abandon, before it ran, and the close frees every segment.
 * Prints "ok backlog" or exits non-zero with a message.
 */
#include "amrt.h"
#include <stdio.h>

static void die(const char *what) { fprintf(stderr, "FAIL %s\n", what); exit(1); }

/* Each block carries its size in front of it. */
enum { HEADER = 16 };
static atomic_size_t live, largest;

void *am_test_host_alloc(size_t size) {
    char *p = malloc(size + HEADER);
    if (!p) return NULL;
    memcpy(p, &size, sizeof size);
    atomic_fetch_add(&live, size);
    size_t was = atomic_load(&largest);
    while (size > was && !atomic_compare_exchange_weak(&largest, &was, size)) {}
    return p + HEADER;
}

void am_test_host_free(void *block) {
    char *p = (char *)block - HEADER;
    size_t size;
    memcpy(&size, p, sizeof size);
    atomic_fetch_sub(&live, size);
    free(p);
}

/* The calls' own check of their order: each gets its number, one past the last one's. */
static int64_t next_call;
static atomic_int out_of_order;

static void numbered(int64_t i) {
    if (i != next_call) atomic_store(&out_of_order, 1);
    next_call = i + 1;
}

/* Wait up to 60 s (a sanitized build runs the calls ~10x slower) for t to reach v. */
static int reached(am_timeline *t, uint64_t v) {
    int64_t deadline = now_ns() + 60000000000LL;
    while (!am_timeline_spin(t, v, 2000)) {
        if (now_ns() > deadline) return 0;
        sched_yield();
    }
    return 1;
}

/* A backlog of n calls behind a wait on a new timeline, pushed from value `done` on;
 * released (and run) if `release`. Returns the queue's last value. */
static uint64_t backlog(am_queue *q, am_timeline *own, long n, uint64_t done, int release) {
    am_timeline *gate = am_timeline_new();
    if (!gate) die("out of memory");
    if (am_queue_wait(q, gate, 1, ++done)) die("push of the wait");
    next_call = 0;
    atomic_store(&largest, 0);
    for (long i = 0; i < n; i++) {
        int64_t args[AM_MAX_ARGS] = {i};
        if (am_queue_call(q, (void *)numbered, 1, args, 0, NULL, ++done)) die("push of a call");
    }
    size_t most = atomic_load(&largest);
    if (most > sizeof(am_cmdseg)) {
        fprintf(stderr, "a push allocated %zu bytes behind %ld queued commands; a segment "
                "is %zu\n", most, n, sizeof(am_cmdseg));
        die("a push allocated more than a segment");
    }
    if (!release) {
        am_queue_close(q, 1);  /* abandoned: the wait and the calls never run */
        am_timeline_free(gate);
        return done;
    }
    am_timeline_signal(gate, 1);
    if (!reached(own, done)) die("the backlog did not run");
    if (atomic_load(&out_of_order) || next_call != n) die("the calls ran out of order");
    am_timeline_free(gate);  /* (the queue passed its wait) */
    return done;
}

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 100000;
    am_timeline *own = am_timeline_new();
    am_queue *q = own ? am_queue_new(own, 0, 19) : NULL;
    if (!q) die("out of memory");
    size_t before = atomic_load(&live);
    if (before == 0) die("the queue's command memory is not counted");
    uint64_t done = 0;
    for (int round = 0; round < 2; round++) {
        done = backlog(q, own, n, done, 1);
        size_t after = atomic_load(&live);
        if (after > before + sizeof(am_cmdseg)) {
            fprintf(stderr, "the queue held %zu bytes before a backlog of %ld commands, %zu "
                    "once it ran; a segment is %zu\n", before, n, after, sizeof(am_cmdseg));
            die("the queue kept a backlog's memory");
        }
    }
    backlog(q, own, n, done, 0);
    if (atomic_load(&live) != 0) die("close left command memory allocated");
    am_timeline_free(own);
    printf("ok backlog\n");
    return 0;
}
