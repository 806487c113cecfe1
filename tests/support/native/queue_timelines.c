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
 * A timeline the test looks at after its owner let go is held by a reference of the
 * test's own. An alarm ends a hang. Prints "ok waited ok signalled ok own ok dropped"
 * or exits non-zero with a message.
 */
#include "amrt.h"
#include <signal.h>
#include <stdio.h>
#include <unistd.h>

static void die(const char *what) { fprintf(stderr, "FAIL %s\n", what); exit(1); }

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
    return 0;
}
