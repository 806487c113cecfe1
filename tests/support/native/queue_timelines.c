/* A cpu queue's references of the timelines its commands use (tests/reliability/
 * test_native.py builds and runs it, plain and under ThreadSanitizer and
 * AddressSanitizer). Each timeline's owner lets go of it (am_timeline_free, as Python's
 * finalizer does) while the queue still has a use for it:
 *   - waited: the queue's thread waits on it. Letting go returns at once (freed under
 *     the waiter, destroying its condition would wait for that waiter for good), and
 *     the queue, closed abandoning the wait, lets go of it last;
 *   - signalled: a signal of it is queued behind a wait. The signal runs on it, not on
 *     freed memory, and then lets go of it;
 *   - own: the queue's own timeline, which its thread raises after every command, let go
 *     of while commands run: the close lets go of it last;
 *   - dropped: commands that never run (the close abandons them, across segments) let
 *     go of what they held.
 * Then each reference is let go of once, whatever path its command took:
 *   - edges: the close's walk over commands dropped unrun, with the thread's take at,
 *     past or inside a segment's end (the drained segment its spare) and 0 to 256
 *     commands queued behind;
 *   - word: copy parts waiting on a timeline's device word (the cuda staging queues'),
 *     one run and many abandoned by the close;
 *   - discarded: signals and waits failed by a discard, never run;
 *   - refused: pushes refused for want of a segment's memory.
 * A timeline the test looks at after its owner let go is held by a reference of the
 * test's own. An alarm ends a hang. Prints "ok <name>" for each, in that order, or
 * exits non-zero with a message.
 */
#include "amrt.h"
#include <signal.h>
#include <stdio.h>
#include <unistd.h>

static void die(const char *what) { fprintf(stderr, "FAIL %s\n", what); exit(1); }

/* (Built with AM_TEST_HOST_ALLOC: a queue's command segments come from these, which
 * refuse while `refuse` is set.) */
static atomic_int refuse;

void *am_test_host_alloc(size_t size) { return atomic_load(&refuse) ? NULL : malloc(size); }

void am_test_host_free(void *block) { free(block); }

static am_timeline *made(void) {
    am_timeline *t = am_timeline_new();
    if (!t) die("out of memory");
    return t;
}

static am_queue *opened(am_timeline *own) {
    am_queue *q = am_queue_new(own, 0, 19);
    if (!q) die("out of memory");
    return q;
}

/* Wait up to 60 s (a sanitized build is slower) for t to reach v. */
static void reached(am_timeline *t, uint64_t v, const char *what) {
    int64_t deadline = now_ns() + 60000000000LL;
    while (!am_timeline_spin(t, v, 2000)) {
        if (now_ns() > deadline) die(what);
        sched_yield();
    }
}

/* Wait until q's thread is inside its wait on t. */
static void inside_wait(am_queue *q, am_timeline *t) {
    int64_t deadline = now_ns() + 60000000000LL;
    for (;;) {
        pthread_mutex_lock(&q->mu);
        int in = q->waiting_on == t;
        pthread_mutex_unlock(&q->mu);
        if (in) return;
        if (now_ns() > deadline) die("the queue never waited");
        sched_yield();
    }
}

static void waited(void) {
    am_timeline *own = made(), *gate = made();
    am_queue *q = opened(own);
    if (am_queue_wait(q, gate, 1, 1)) die("push of the wait");
    inside_wait(q, gate);
    am_timeline_free(gate);  /* its owner lets go: the queue's reference holds it */
    if (am_timeline_refs(gate) != 1) die("the waiting queue holds no reference of the gate");
    am_queue_close(q, 1);  /* abandons the wait, and lets go of the gate: freed */
    if (am_timeline_refs(own) != 1) die("the closed queue still holds its own timeline");
    am_timeline_free(own);
}

static void signalled(void) {
    am_timeline *own = made(), *gate = made(), *target = made();
    am_queue *q = opened(own);
    if (am_queue_wait(q, gate, 1, 1) || am_queue_signal(q, target, 5, 2)) die("push");
    atomic_fetch_add(&target->refs, 1);  /* the test's own, to look at it after */
    am_timeline_free(target);  /* its owner lets go before the signal ran */
    am_timeline_signal(gate, 1);
    reached(own, 2, "the signal never ran");
    if (am_timeline_value(target) != 5) die("the signal did not raise its timeline");
    if (am_timeline_refs(target) != 1) die("the signal kept its reference after it ran");
    timeline_unref(target);
    am_queue_close(q, 0);
    am_timeline_free(gate);
    am_timeline_free(own);
}

static void noop(void) {}

static void own_raised(void) {
    am_timeline *own = made(), *gate = made();
    am_queue *q = opened(own);
    if (am_queue_wait(q, gate, 1, 1)) die("push of the wait");
    for (uint64_t v = 2; v <= 200; v++) {
        int64_t args[AM_MAX_ARGS] = {0};
        if (am_queue_call(q, (void *)noop, 0, args, 0, NULL, v)) die("push of a call");
    }
    atomic_fetch_add(&own->refs, 1);
    am_timeline_free(own);  /* its owner lets go while the calls are to run */
    am_timeline_signal(gate, 1);
    reached(own, 200, "the calls never ran");
    am_queue_close(q, 0);
    if (am_timeline_refs(own) != 1) die("the closed queue still holds its own timeline");
    timeline_unref(own);
    am_timeline_free(gate);
}

static void dropped(void) {
    am_timeline *own = made(), *gate = made(), *target = made();
    am_queue *q = opened(own);
    if (am_queue_wait(q, gate, 1, 1)) die("push of the wait");
    uint64_t v = 1;
    for (int i = 0; i < 3 * AM_SEG_CMDS; i++)  /* (queued over several segments) */
        if (am_queue_signal(q, target, (uint64_t)i + 1, ++v) ||
            am_queue_wait(q, target, (uint64_t)i + 1, ++v))
            die("push");
    if (am_timeline_refs(target) != 1 + 6 * AM_SEG_CMDS) die("a queued command holds no reference");
    inside_wait(q, gate);
    am_queue_close(q, 1);  /* none of them runs */
    if (am_timeline_refs(target) != 1) die("commands dropped unrun kept their references");
    if (am_timeline_value(target) != 0) die("a command dropped unrun ran");
    am_timeline_free(target);
    am_timeline_free(gate);
    am_timeline_free(own);
}

/* A queue whose thread waits on gate with `before` calls run ahead of the wait and
 * `after` signals and waits of target queued behind it, closed abandoning them: its take
 * left the command it is in at `before` -- at a segment's end, past it (the drained
 * segment its spare), or inside one -- and the close's walk over those queued lets go
 * of each one's reference, no more. */
static void dropped_at(int before, int after) {
    am_timeline *own = made(), *gate = made(), *target = made();
    am_queue *q = opened(own);
    int64_t args[AM_MAX_ARGS] = {0};
    uint64_t v = 0;
    for (int i = 0; i < before; i++)
        if (am_queue_call(q, (void *)noop, 0, args, 0, NULL, ++v)) die("push of a call");
    if (am_queue_wait(q, gate, 1, ++v)) die("push of the wait");
    for (int i = 0; i < after; i++)
        if (i % 2 ? am_queue_wait(q, target, 1, ++v) : am_queue_signal(q, target, 1, ++v))
            die("push");
    inside_wait(q, gate);
    if (am_timeline_refs(target) != 1 + after) die("a queued command holds no reference");
    if (am_timeline_refs(gate) != 2) die("the wait holds no reference of the gate");
    am_queue_close(q, 1);
    if (am_timeline_refs(target) != 1) die("the close's walk missed or doubled a reference");
    if (am_timeline_refs(gate) != 1) die("the abandoned wait kept its reference");
    if (am_timeline_refs(own) != 1) die("the closed queue still holds its own timeline");
    if (am_timeline_value(target) != 0) die("a command dropped unrun ran");
    am_timeline_free(target);
    am_timeline_free(gate);
    am_timeline_free(own);
}

static void edges(void) {
    static const int befores[] = {0, 1, 62, 63, 64, 65, 100, 127, 128, 129, 200};
    static const int afters[] = {0, 1, 2, 62, 63, 64, 65, 127, 128, 129, 256};
    for (size_t b = 0; b < sizeof befores / sizeof *befores; b++)
        for (size_t a = 0; a < sizeof afters / sizeof *afters; a++)
            dropped_at(befores[b], afters[a]);
}

/* Copy parts waiting on a timeline's device word (the cuda staging queues'): one whose
 * word got there runs and lets go of it; one whose wait the close abandons lets go of
 * it too, as do the parts queued behind it. */
static void word(void) {
    am_timeline *own = made(), *after = made();
    static uint64_t w;
    am_timeline_set_word(after, &w);
    am_queue *q = opened(own);
    static char src[64], dst[64];
    static _Atomic uint64_t claimed, count, ready;
    memset(src, 7, sizeof src);
    if (am_queue_copy_part(q, dst, src, 64, 16, after, 1, &claimed, 0, &count, 4, &ready, 1,
                           NULL, 1))
        die("push of a part");
    __atomic_store_n(&w, 1, __ATOMIC_RELEASE);  /* (a stream writes it) */
    reached(own, 1, "the part never ran");
    if (atomic_load(&ready) != 1 || dst[63] != 7) die("the part did not copy");
    if (am_timeline_refs(after) != 1) die("the part kept its reference after it ran");
    for (uint64_t v = 2; v < 2 + 3 * AM_SEG_CMDS; v++)
        if (am_queue_copy_part(q, dst, src, 64, 16, after, 2, &claimed, 4, &count, 8, &ready, 2,
                               NULL, v))
            die("push of a part");
    inside_wait(q, after);
    if (am_timeline_refs(after) != 1 + 3 * AM_SEG_CMDS) die("a part holds no reference");
    am_queue_close(q, 1);  /* abandons the part's wait on the word, and those behind it */
    if (am_timeline_refs(after) != 1) die("abandoned parts kept their references");
    if (am_timeline_refs(own) != 1) die("the closed queue still holds its own timeline");
    am_timeline_free(after);
    am_timeline_free(own);
}

/* A discard landing while the thread waits on gate, with signals and waits of target
 * queued behind it: each fails without running and lets go of its reference. */
static void discarded(void) {
    am_timeline *own = made(), *gate = made(), *target = made();
    am_queue *q = opened(own);
    uint64_t v = 0;
    if (am_queue_wait(q, gate, 1, ++v)) die("push of the wait");
    for (int i = 0; i < 2 * AM_SEG_CMDS + 3; i++)
        if (i % 2 ? am_queue_wait(q, target, 1000, ++v) : am_queue_signal(q, target, 1, ++v))
            die("push");
    inside_wait(q, gate);
    am_queue_discard(q);
    reached(own, v, "the discarded commands never passed");
    if (am_timeline_refs(target) != 1) die("a discarded command kept its reference");
    if (am_timeline_refs(gate) != 1) die("the discarded wait kept its reference");
    int error;
    uint64_t value;
    am_timeline *cause;
    if (!am_timeline_failure(target, &error, &value, &cause)) die("a discarded signal ran");
    am_queue_close(q, 0);
    if (am_timeline_refs(own) != 1) die("the closed queue still holds its own timeline");
    am_timeline_free(target);
    am_timeline_free(gate);
    am_timeline_free(own);
}

/* A push refused for want of memory for a segment lets go of the reference it took. */
static void refused(void) {
    am_timeline *own = made(), *gate = made(), *target = made();
    am_queue *q = opened(own);
    uint64_t v = 0;
    if (am_queue_wait(q, gate, 1, ++v)) die("push of the wait");
    while (v < AM_SEG_CMDS) {  /* (the first segment full) */
        v++;
        if (am_queue_signal(q, target, v, v)) die("push");
    }
    inside_wait(q, gate);
    atomic_store(&refuse, 1);
    if (am_queue_signal(q, target, 1000, v + 1) != -1) die("a push without memory was taken");
    if (am_queue_wait(q, target, 1000, v + 1) != -1) die("a push without memory was taken");
    static _Atomic uint64_t claimed, count, ready;
    if (am_queue_copy_part(q, NULL, NULL, 0, 1, target, 1, &claimed, 0, &count, 1, &ready, 1,
                           NULL, v + 1) != -1)
        die("a push without memory was taken");
    atomic_store(&refuse, 0);
    if (am_timeline_refs(target) != AM_SEG_CMDS) die("a refused push kept its reference");
    am_timeline_signal(gate, 1);
    reached(own, v, "the commands never ran");
    am_queue_close(q, 0);
    if (am_timeline_refs(target) != 1) die("a command kept its reference after it ran");
    if (am_timeline_refs(own) != 1) die("the closed queue still holds its own timeline");
    am_timeline_free(target);
    am_timeline_free(gate);
    am_timeline_free(own);
}

int main(void) {
    alarm(120);  /* a hang (a condition destroyed under its waiter) ends here */
    waited();
    printf("ok waited\n");
    signalled();
    printf("ok signalled\n");
    own_raised();
    printf("ok own\n");
    dropped();
    printf("ok dropped\n");
    edges();
    printf("ok edges\n");
    word();
    printf("ok word\n");
    discarded();
    printf("ok discarded\n");
    refused();
    printf("ok refused\n");
    return 0;
}
