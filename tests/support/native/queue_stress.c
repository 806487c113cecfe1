/* Stress of the cpu queues of asyncmetal's native runtime: the handshakes
 * between a queue thread and the threads that close it, signal its timelines and watch
 * them (tests/reliability/test_native.py builds and runs it, also under ThreadSanitizer
 * and AddressSanitizer).
 *
 *   queue_stress ITERATIONS [fork]
 *
 * Checks, each printing "ok <name>" or exiting non-zero with a message:
 *   abandon   open a queue, make it wait on a timeline nobody signals, close it with
 *             abandon: the close returns and the wait never passes (a broadcast lost
 *             between the queue thread's look at `stop` and its sleep hangs here)
 *   word      the same for a wait on a device word (the polled wait of CMD_COPY_PART)
 *   finish    close without abandon while another thread signals what the queue waits
 *             for: everything queued runs, then the close returns
 *   watch     a watch armed on a timeline a queue signals: every value reached wakes
 *             the notifier's pipe; none is missed
 *   notify    a signaller writes the loops' pipes after letting go of the timeline's mu:
 *             blocked writing a full (blocking) pipe, it holds none of the timeline's
 *             other users, and a notifier freed meanwhile waits for that write; and a
 *             notifier freed, and its pipe closed, as another thread signals its
 *             timeline (AddressSanitizer)
 *   parts     queues sharing a chunk's copy in parts, after a device word another
 *             thread raises: the chunk is ready only once every byte is in
 *   blocks    a block invoke function raising a timeline from another thread
 *   calls     kernels of 16 parameters mixing integers, pointers, floats, doubles and
 *             _Float16 (past the general and the vector registers, onto the stack) called
 *             by the queue thread with random bits: each parameter gets its slot's own
 *             low bytes
 *   discard   am_queue_discard racing the queue thread's way into a device wait, a
 *             thread pushing commands and a close: the wait ends (a broadcast lost
 *             between the thread's look at `discard` and its sleep hangs here), the
 *             close returns with the queue's timeline settled (UINT64_MAX: it passed
 *             every command, the pushes racing its look at what is left), failed as
 *             discarded from the wait on; a signal dropped fails its timeline. And a discard while the
 *             wait it would end is released by another thread, which then frees the
 *             timeline once the queue's own passed the wait (as the Python side lets go
 *             of a command's objects): the discard must not touch it (AddressSanitizer)
 *   settle    a queue whose wait ends on a failed timeline while another thread pushes
 *             signals behind it: once its thread has passed them all, its own timeline
 *             settles at UINT64_MAX, failed from the wait on; every signal pushed --
 *             before the settle, racing its look at what is left, or after it -- fails
 *             its timeline (none is signalled as if it ran)
 *   deadlines a timed wait's deadline (deadline_after) for negative, zero and huge
 *             waits is a valid time (nanoseconds 0 to 999,999,999), the present or
 *             later; a wait for a block with a negative timeout returns at once (one
 *             whose deadline had negative nanoseconds was refused, EINVAL, and waited
 *             again at once, for good)
 *   fork      (only with "fork") a child forked while a queue waits frees the parent's
 *             queue, timeline and watch without hanging, and runs a queue of its own
 *
 * A watchdog ends the run with the iteration it is stuck in, if one takes over 10 s.
 */
#include "amrt.h"
#include <fcntl.h>
#include <stdio.h>
#include <sys/wait.h>

#if defined(__SANITIZE_THREAD__)
#define SANITIZE_THREAD 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define SANITIZE_THREAD 1
#endif
#endif
#ifndef SANITIZE_THREAD
#define SANITIZE_THREAD 0
#endif

static void die(const char *what) { fprintf(stderr, "FAIL %s\n", what); exit(1); }

static atomic_long progress;           /* iterations done, over all checks */
static const char *_Atomic phase = "start";

static void *watchdog(void *arg) {
    (void)arg;
    long last = -1;
    int64_t since = now_ns();
    for (;;) {
        nap_ns(100000000);
        long now = atomic_load(&progress);
        if (now != last) { last = now; since = now_ns(); continue; }
        if (now_ns() - since > 10000000000LL) {
            fprintf(stderr, "FAIL hang: %s stuck at iteration %ld\n", atomic_load(&phase), now);
            fflush(stderr);
            _exit(3);
        }
    }
    return NULL;
}

/* Wait up to 5 s for t to reach v, yielding the CPU between short spins (the machine
 * may have fewer cores than there are threads here). */
static int reached(am_timeline *t, uint64_t v) {
    int64_t deadline = now_ns() + 5000000000LL;
    while (!am_timeline_spin(t, v, 2000)) {
        if (now_ns() > deadline) return 0;
        sched_yield();
    }
    return 1;
}

/* A short, varied delay: the close lands before, during and after the queue thread's
 * take of the command and its entry into the wait. */
static void jitter(long i) {
    switch (i % 4) {
    case 0: break;
    case 1: sched_yield(); break;
    case 2: { int64_t end = now_ns() + (i * 7919) % 20000; while (now_ns() < end) {} } break;
    case 3: nap_ns(1000 + (i * 104729) % 50000); break;
    }
}

static void check_abandon(long n) {
    atomic_store(&phase, "abandon");
    for (long i = 0; i < n; i++) {
        am_timeline *own = am_timeline_new(), *t = am_timeline_new();
        int warm = i % 4 != 0;
        am_queue *q = am_queue_new(own, warm ? 50000 : 0, 19);
        if (!own || !t || !q) die("abandon: out of memory");
        uint64_t ran = 0;
        if (warm) {  /* the thread is up and spinning for its next command: the wait is
                         taken within a microsecond or two of its push */
            char a[8] = "", b[8];
            if (am_queue_copy(q, b, a, sizeof a, NULL, 1)) die("abandon: push");
            if (!reached(own, 1)) die("abandon: a copy never ran");
            ran = 1;
        }
        if (am_queue_wait(q, t, 1, ran + 1)) die("abandon: push");
        if (warm) {
            /* Close as the queue thread enters its wait: it has just published
             * waiting_on, and is between its look at stop and its sleep. (Read without
             * q->mu, as only a harness may: not in the ThreadSanitizer build.) */
#if !SANITIZE_THREAD
            int64_t deadline = now_ns() + 1000000;
            while (!__atomic_load_n(&q->waiting_on, __ATOMIC_ACQUIRE) && now_ns() < deadline) {}
            for (volatile long k = (i / 4) % 16; k > 0; k--) {}
#else
            int64_t end = now_ns() + (i / 4 * 7919) % 3000;
            while (now_ns() < end) {}
#endif
        } else {
            jitter(i / 4);
        }
        am_queue_close(q, 1);
        if (am_timeline_value(own) != ran) die("abandon: a wait nobody signalled passed");
        am_timeline_free(t);
        am_timeline_free(own);
        atomic_fetch_add(&progress, 1);
    }
    puts("ok abandon");
}

static void check_word(long n) {
    atomic_store(&phase, "word");
    _Atomic uint64_t word = 0, claimed = 0, count = 0, ready = 0;
    char src[64] = "abc", dst[64];
    for (long i = 0; i < n; i++) {
        am_timeline *own = am_timeline_new(), *t = am_timeline_new();
        am_timeline_set_word(t, (uint64_t *)&word);
        am_queue *q = am_queue_new(own, 0, 19);
        if (!own || !t || !q) die("word: out of memory");
        if (am_queue_copy_part(q, dst, src, sizeof src, 16, t, 1, (void *)&claimed, 0,
                               (void *)&count, 4, (void *)&ready, 1, NULL, 1))
            die("word: push");
        jitter(i);
        am_queue_close(q, 1);
        if (am_timeline_value(own) != 0 || atomic_load(&count) != 0)
            die("word: a copy ran before its word was written");
        am_timeline_free(t);
        am_timeline_free(own);
        atomic_fetch_add(&progress, 1);
    }
    puts("ok word");
}

typedef struct { am_timeline *t; uint64_t value; long delay; } signal_arg;

static void *signal_later(void *arg) {
    signal_arg *s = arg;
    jitter(s->delay);
    am_timeline_signal(s->t, s->value);
    return NULL;
}

static void check_finish(long n) {
    atomic_store(&phase, "finish");
    for (long i = 0; i < n; i++) {
        am_timeline *own = am_timeline_new(), *t = am_timeline_new();
        am_queue *q = am_queue_new(own, i % 2 ? 50000 : 0, 19);
        if (!own || !t || !q) die("finish: out of memory");
        char a[32] = "x", b[32];
        if (am_queue_wait(q, t, 1, 1) || am_queue_copy(q, b, a, sizeof a, NULL, 2) ||
            am_queue_signal(q, t, 2, 3))
            die("finish: push");
        signal_arg s = {t, 1, i};
        pthread_t th;
        pthread_create(&th, NULL, signal_later, &s);
        am_queue_close(q, 0);
        pthread_join(th, NULL);
        if (am_timeline_value(own) != 3 || am_timeline_value(t) != 2 || b[0] != 'x')
            die("finish: a queued command did not run before the close returned");
        am_timeline_free(t);
        am_timeline_free(own);
        atomic_fetch_add(&progress, 1);
    }
    puts("ok finish");
}

typedef struct { am_queue *q; long n; } push_arg;

static void *push_copies(void *arg) {  /* another thread's submissions, values 3.. */
    push_arg *p = arg;
    static char a[8] = "x", b[8];
    for (long v = 3; v < 3 + p->n; v++)
        if (am_queue_copy(p->q, b, a, sizeof a, NULL, (uint64_t)v)) die("discard: push");
    return NULL;
}

typedef struct { am_timeline *t, *own; uint64_t passed; long delay; } release_arg;

static void *release_and_free(void *arg) {  /* signal t; once the wait passed, free t */
    release_arg *r = arg;
    jitter(r->delay);
    am_timeline_signal(r->t, 1);
    if (!reached(r->own, r->passed)) die("discard: a released wait never passed");
    am_timeline_free(r->t);
    return NULL;
}

static void check_discard(long n) {
    atomic_store(&phase, "discard");
    for (long i = 0; i < n; i++) {
        am_timeline *own = am_timeline_new(), *t = am_timeline_new(), *t2 = am_timeline_new();
        am_queue *q = am_queue_new(own, i % 2 ? 50000 : 0, 19);
        if (!own || !t || !t2 || !q) die("discard: out of memory");
        /* 1: a wait nobody signals, 2: a signal of t2; 3..: another thread's copies */
        if (am_queue_wait(q, t, 1, 1) || am_queue_signal(q, t2, 1, 2)) die("discard: push");
        push_arg p = {q, 64};
        pthread_t th;
        pthread_create(&th, NULL, push_copies, &p);
        jitter(i);
        am_queue_discard(q);
        pthread_join(th, NULL);
        am_queue_close(q, 0);
        int error = 0;
        uint64_t value = 0;
        am_timeline *cause = NULL;
        if (am_timeline_value(own) != UINT64_MAX) die("discard: the queue's timeline unsettled");
        if (am_timeline_failure(own, &error, &value, &cause) != 1 || error != AM_DISCARDED)
            die("discard: the queue's timeline not failed from the wait, as discarded");
        if (am_timeline_failure(t2, &error, &value, &cause) != 1 || error != AM_DISCARDED)
            die("discard: a dropped signal did not fail its timeline");
        am_timeline_free(t);
        am_timeline_free(t2);
        am_timeline_free(own);
        atomic_fetch_add(&progress, 1);
    }
    for (long i = 0; i < n; i++) {
        am_timeline *own = am_timeline_new(), *t = am_timeline_new();
        am_queue *q = am_queue_new(own, i % 2 ? 50000 : 0, 19);
        if (!own || !t || !q) die("discard: out of memory");
        if (am_queue_wait(q, t, 1, 1)) die("discard: push");
#if !SANITIZE_THREAD
        int64_t deadline = now_ns() + 1000000;  /* (read without q->mu: see abandon) */
        while (!__atomic_load_n(&q->waiting_on, __ATOMIC_ACQUIRE) && now_ns() < deadline) {}
#endif
        release_arg r = {t, own, 1, i / 2};
        pthread_t th;
        pthread_create(&th, NULL, release_and_free, &r);
        jitter(i / 3);
        am_queue_discard(q);
        pthread_join(th, NULL);
        am_queue_close(q, 0);
        am_timeline_free(own);
        atomic_fetch_add(&progress, 1);
    }
    puts("ok discard");
}

#define SETTLE_SIGNALS 16

typedef struct { am_queue *q; am_timeline **signalled; } signals_arg;

static void *push_signals(void *arg) {  /* another thread's submissions, values 2.. */
    signals_arg *p = arg;
    for (int k = 0; k < SETTLE_SIGNALS; k++)
        if (am_queue_signal(p->q, p->signalled[k], 1, (uint64_t)k + 2)) die("settle: push");
    return NULL;
}

/* Whether t failed from 1 on, with the failure behind it a queue's (`own`). */
static int failed_by(am_timeline *t, am_timeline *own) {
    int error = 0;
    uint64_t value = 0;
    am_timeline *cause = NULL;
    return am_timeline_failure(t, &error, &value, &cause) == 1 && cause == own;
}

static void check_settle(long n) {
    atomic_store(&phase, "settle");
    for (long i = 0; i < n; i++) {
        am_timeline *own = am_timeline_new(), *t = am_timeline_new(), *late = am_timeline_new();
        am_timeline *signalled[SETTLE_SIGNALS];
        for (int k = 0; k < SETTLE_SIGNALS; k++)
            if (!(signalled[k] = am_timeline_new())) die("settle: out of memory");
        am_queue *q = am_queue_new(own, i % 2 ? 50000 : 0, 19);
        if (!own || !t || !late || !q) die("settle: out of memory");
        if (am_queue_wait(q, t, 1, 1)) die("settle: push");
        signals_arg p = {q, signalled};
        pthread_t th;
        pthread_create(&th, NULL, push_signals, &p);
        jitter(i);
        am_timeline_fail(t, 1, AM_CLOSED, 1, t);  /* the wait ends failed: q fails from 1 */
        pthread_join(th, NULL);
        if (!reached(own, UINT64_MAX)) die("settle: the failed queue's timeline never settled");
        if (!failed_by(own, t)) die("settle: the queue's timeline not failed from the wait");
        for (int k = 0; k < SETTLE_SIGNALS; k++)
            if (!reached(signalled[k], UINT64_MAX) || !failed_by(signalled[k], t))
                die("settle: a signal behind the failed wait did not fail its timeline");
        if (am_queue_signal(q, late, 1, SETTLE_SIGNALS + 2)) die("settle: push");
        if (!reached(late, UINT64_MAX) || !failed_by(late, t))
            die("settle: a signal pushed after the settle did not fail its timeline");
        am_queue_close(q, 0);
        for (int k = 0; k < SETTLE_SIGNALS; k++) am_timeline_free(signalled[k]);
        am_timeline_free(late);
        am_timeline_free(t);
        am_timeline_free(own);
        atomic_fetch_add(&progress, 1);
    }
    puts("ok settle");
}

static void check_watch(long n) {
    atomic_store(&phase, "watch");
    int fds[2];
    if (pipe(fds)) die("watch: pipe");
    fcntl(fds[0], F_SETFL, O_NONBLOCK);
    am_notifier *notifier = am_notifier_new(fds[1]);
    am_timeline *own = am_timeline_new();
    am_watch *w = am_watch_new(own, notifier);
    am_queue *q = am_queue_new(own, 0, 19);
    char a[8] = "", b[8];
    for (long i = 1; i <= n; i++) {
        if (am_queue_copy(q, b, a, sizeof a, NULL, (uint64_t)i)) die("watch: push");
        /* The loop's side: arm for i, sleep on the pipe unless reached; then drain,
         * reset, and read the value -- the order _bridge.py uses. */
        while (!am_watch_arm(w, (uint64_t)i)) {
            char buf[64];
            fd_set set;
            FD_ZERO(&set);
            FD_SET(fds[0], &set);
            struct timeval tv = {5, 0};
            if (select(fds[0] + 1, &set, NULL, NULL, &tv) != 1) die("watch: a wake-up was lost");
            while (read(fds[0], buf, sizeof buf) > 0) {}
            am_notifier_reset(notifier);
        }
        atomic_fetch_add(&progress, 1);
    }
    am_queue_close(q, 0);
    am_watch_free(w);
    am_notifier_free(notifier);
    am_timeline_free(own);
    close(fds[0]);
    close(fds[1]);
    puts("ok watch");
}

static void *signal_to_one(void *arg) {
    am_timeline_signal(arg, 1);
    return NULL;
}

static atomic_int failure_read;

static void *read_failure(void *arg) {
    int error;
    uint64_t value;
    am_timeline *cause;
    am_timeline_failure(arg, &error, &value, &cause);  /* (under the timeline's mu) */
    atomic_store(&failure_read, 1);
    return NULL;
}

typedef struct { am_watch *w; am_notifier *n; atomic_int drained, freed; } free_arg;

static void *free_notifier(void *arg) {  /* the bridge's close, on another thread */
    free_arg *a = arg;
    am_watch_free(a->w);
    am_notifier_free(a->n);
    if (!atomic_load(&a->drained)) die("notify: a notifier was freed as a signaller wrote it");
    atomic_store(&a->freed, 1);
    return NULL;
}

typedef struct { am_timeline *t; atomic_long signals; } resignal_arg;

static void *signal_on(void *arg) {
    resignal_arg *a = arg;
    for (uint64_t v = 1; v <= 2000; v++) {
        am_timeline_signal(a->t, v);
        atomic_fetch_add(&a->signals, 1);
    }
    return NULL;
}

static void check_notify(long n) {
    atomic_store(&phase, "notify");
    for (long i = 0; i < 3; i++) {
        int fds[2];
        if (pipe(fds)) die("notify: pipe");
        char fill[4096] = {0};
        fcntl(fds[1], F_SETFL, O_NONBLOCK);
        while (write(fds[1], fill, sizeof fill) > 0) {}
        while (write(fds[1], fill, 1) > 0) {}
        fcntl(fds[1], F_SETFL, 0);  /* full, and a write waits for room */
        am_timeline *t = am_timeline_new();
        am_notifier *notifier = am_notifier_new(fds[1]);
        am_watch *w = am_watch_new(t, notifier);
        if (am_watch_arm(w, 1)) die("notify: reached already");
        pthread_t signaller, reader;
        atomic_store(&failure_read, 0);
        pthread_create(&signaller, NULL, signal_to_one, t);
        while (am_timeline_value(t) < 1) sched_yield();  /* (raised before the write) */
        pthread_create(&reader, NULL, read_failure, t);
        int64_t deadline = now_ns() + 5000000000LL;
        while (!atomic_load(&failure_read)) {
            if (now_ns() > deadline)
                die("notify: a signaller writing a full pipe held the timeline's mu");
            nap_ns(100000);
        }
        /* Freed as the signaller is still blocked writing: the free waits for the
         * write (given a moment to get there; it passes trivially if it has not). */
        free_arg f = {.w = w, .n = notifier};
        pthread_t freer;
        pthread_create(&freer, NULL, free_notifier, &f);
        nap_ns(20000000);
        if (atomic_load(&f.freed)) die("notify: a notifier was freed as a signaller wrote it");
        atomic_store(&f.drained, 1);
        fcntl(fds[0], F_SETFL, O_NONBLOCK);
        while (read(fds[0], fill, sizeof fill) > 0) {}  /* room: the write goes on */
        pthread_join(signaller, NULL);
        pthread_join(reader, NULL);
        pthread_join(freer, NULL);
        am_timeline_free(t);
        close(fds[0]);
        close(fds[1]);
        atomic_fetch_add(&progress, 1);
    }
    for (long i = 0; i < n; i++) {
        int fds[2];
        if (pipe(fds)) die("notify: pipe");
        fcntl(fds[0], F_SETFL, O_NONBLOCK);
        fcntl(fds[1], F_SETFL, O_NONBLOCK);
        resignal_arg a = {.t = am_timeline_new()};
        am_notifier *notifier = am_notifier_new(fds[1]);
        am_watch *w = am_watch_new(a.t, notifier);
        am_watch_arm(w, 1);
        pthread_t signaller;
        pthread_create(&signaller, NULL, signal_on, &a);
        jitter(i);
        for (long k = 0; k < (i % 8) * 10; k++) {  /* the loop's drains: a write each */
            am_notifier_reset(notifier);
            sched_yield();
        }
        /* The bridge's close: the watch, then the notifier, then the pipe. */
        am_watch_free(w);
        am_notifier_free(notifier);
        close(fds[0]);
        close(fds[1]);
        pthread_join(signaller, NULL);
        am_timeline_free(a.t);
        atomic_fetch_add(&progress, 1);
    }
    puts("ok notify");
}

typedef struct { _Atomic uint64_t *word; uint64_t value; long delay; } raise_arg;

static void *raise_later(void *arg) {  /* a stream writing a device word */
    raise_arg *r = arg;
    jitter(r->delay);
    atomic_store(r->word, r->value);
    return NULL;
}

/* Three queues share each chunk's copy (CMD_COPY_PART, the cuda staging path): all wait
 * for a device word another thread raises (one polls it, the others sleep and are
 * handed the polling), then claim parts until every one is copied; the last raises the
 * ready word, by which time every byte must be in. */
static void check_parts(long n) {
    atomic_store(&phase, "parts");
    enum { QUEUES = 3, NBYTES = 1 << 14, PART = 1 << 10 };
    static _Atomic uint64_t word, claimed, count, ready;
    static unsigned char src[NBYTES], dst[NBYTES];
    am_timeline *t = am_timeline_new(), *own[QUEUES];
    am_timeline_set_word(t, (uint64_t *)&word);
    am_queue *q[QUEUES];
    for (int k = 0; k < QUEUES; k++) {
        own[k] = am_timeline_new();
        q[k] = am_queue_new(own[k], k ? 0 : 50000, 19);
    }
    for (long i = 1; i <= n; i++) {
        for (int b = 0; b < NBYTES; b++) src[b] = (unsigned char)(i * 31 + b);
        uint64_t parts = NBYTES / PART, first = (uint64_t)(i - 1) * parts;
        for (int k = 0; k < QUEUES; k++)
            if (am_queue_copy_part(q[k], dst, src, NBYTES, PART, t, (uint64_t)i,
                                   (void *)&claimed, first, (void *)&count, first + parts,
                                   (void *)&ready, (uint64_t)i, NULL, (uint64_t)i))
                die("parts: push");
        raise_arg r = {&word, (uint64_t)i, i};
        pthread_t th;
        pthread_create(&th, NULL, raise_later, &r);
        int64_t deadline = now_ns() + 5000000000LL;
        while (atomic_load(&ready) < (uint64_t)i) {
            if (now_ns() > deadline) die("parts: the chunk never became ready");
            sched_yield();
        }
        if (memcmp(dst, src, NBYTES)) die("parts: ready before every byte was in");
        for (int k = 0; k < QUEUES; k++)
            if (!reached(own[k], (uint64_t)i)) die("parts: a queue never finished its share");
        pthread_join(th, NULL);
        atomic_fetch_add(&progress, 1);
    }
    for (int k = 0; k < QUEUES; k++) {
        am_queue_close(q[k], 0);
        am_timeline_free(own[k]);
    }
    am_timeline_free(t);
    puts("ok parts");
}

static void *invoke_later(void *arg) {
    am_block *b = arg;
    am_block_completed(b, (void *)b);
    return NULL;
}

static void check_blocks(long n) {
    atomic_store(&phase, "blocks");
    am_timeline *t = am_timeline_new();
    char from[16] = "block", to[16];
    for (long i = 1; i <= n; i++) {
        am_block *b = am_block_new(NULL, 0, t, (uint64_t)i);
        b->copy_dst = to;
        b->copy_src = from;
        b->copy_nbytes = sizeof from;
        pthread_t th;
        pthread_create(&th, NULL, invoke_later, b);
        if (!reached(t, (uint64_t)i)) die("blocks: never ran");
        if (strcmp(to, "block")) die("blocks: its copy is not in when its value is");
        pthread_join(th, NULL);
        if (b->arg != b || atomic_load(&b->calls) != 1) die("blocks: not called once");
        am_block_free(b);
        atomic_fetch_add(&progress, 1);
    }
    am_timeline_free(t);
    puts("ok blocks");
}

/* A child forked while the parent's queue thread sleeps on a timeline's condition (and
 * may hold its mutex): the parent's objects are left alone in the child, whose own work
 * runs. */
static void check_fork(long n) {
    atomic_store(&phase, "fork");
    for (long i = 0; i < n; i++) {
        int fds[2];
        if (pipe(fds)) die("fork: pipe");
        am_notifier *notifier = am_notifier_new(fds[1]);
        am_timeline *own = am_timeline_new(), *t = am_timeline_new();
        am_watch *w = am_watch_new(t, notifier);
        am_queue *q = am_queue_new(own, 0, 19);
        if (am_queue_wait(q, t, 1, 1)) die("fork: push");
        jitter(i);
        pid_t pid = fork();
        if (pid < 0) die("fork: fork");
        if (pid == 0) {
            am_queue_close(q, 1);  /* its thread is the parent's: left alone */
            am_watch_free(w);
            am_timeline_free(t);
            am_timeline_free(own);
            am_timeline *mine = am_timeline_new();
            am_queue *q2 = am_queue_new(mine, 0, 19);
            char a[8] = "child", b[8];
            if (am_queue_copy(q2, b, a, sizeof a, NULL, 1)) _exit(4);
            am_queue_close(q2, 0);
            _exit(am_timeline_value(mine) == 1 && !strcmp(b, "child") ? 0 : 5);
        }
        int status = 0;
        int64_t deadline = now_ns() + 10000000000LL;
        while (waitpid(pid, &status, WNOHANG) == 0) {
            if (now_ns() > deadline) {
                kill(pid, SIGKILL);
                waitpid(pid, &status, 0);
                die("fork: the child hung on the parent's queue, timeline or watch");
            }
            nap_ns(200000);
        }
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) die("fork: the child failed");
        am_timeline_signal(t, 1);
        am_queue_close(q, 0);
        if (am_timeline_value(own) != 1) die("fork: the parent's queue did not go on");
        am_watch_free(w);
        am_notifier_free(notifier);
        am_timeline_free(t);
        am_timeline_free(own);
        close(fds[0]);
        close(fds[1]);
        atomic_fetch_add(&progress, 1);
    }
    puts("ok fork");
}

/* ---- calls: the runtime's calling convention for mixed parameter types ----------- */

static int64_t got[16];  /* each parameter's bytes, as the kernel received them */
#define GOT(i, x) memcpy(&got[i], &(x), sizeof(x))
#ifdef __FLT16_MAX__
typedef _Float16 h16;
#else
typedef float h16;  /* a compiler without _Float16 here: a float in the same register */
#endif

/* float int double pointer, four times: 8 vector and 8 general arguments */
static void k_alternate(float a0, int b0, double c0, void *d0, float a1, int b1, double c1,
                        void *d1, float a2, int b2, double c2, void *d2, float a3, int b3,
                        double c3, void *d3) {
    GOT(0, a0); GOT(1, b0); GOT(2, c0); GOT(3, d0); GOT(4, a1); GOT(5, b1); GOT(6, c1);
    GOT(7, d1); GOT(8, a2); GOT(9, b2); GOT(10, c2); GOT(11, d2); GOT(12, a3); GOT(13, b3);
    GOT(14, c3); GOT(15, d3);
}
static void k_doubles(double a0, double a1, double a2, double a3, double a4, double a5,
                      double a6, double a7, double a8, double a9, double a10, double a11,
                      double a12, double a13, double a14, double a15) {
    GOT(0, a0); GOT(1, a1); GOT(2, a2); GOT(3, a3); GOT(4, a4); GOT(5, a5); GOT(6, a6);
    GOT(7, a7); GOT(8, a8); GOT(9, a9); GOT(10, a10); GOT(11, a11); GOT(12, a12);
    GOT(13, a13); GOT(14, a14); GOT(15, a15);
}
/* 9 floats then an int, a float past the registers, then ints: stack order mixed */
static void k_floats_first(float a0, float a1, float a2, float a3, float a4, float a5,
                           float a6, float a7, float a8, long long b0, float a9, long long b1,
                           long long b2, long long b3, long long b4, long long b5) {
    GOT(0, a0); GOT(1, a1); GOT(2, a2); GOT(3, a3); GOT(4, a4); GOT(5, a5); GOT(6, a6);
    GOT(7, a7); GOT(8, a8); GOT(9, b0); GOT(10, a9); GOT(11, b1); GOT(12, b2); GOT(13, b3);
    GOT(14, b4); GOT(15, b5);
}
/* 7 integers (the 7th past x86-64's registers) then 9 halves (the 9th past the vector
 * registers), shorts and chars among them */
static void k_ints_first(long long b0, short b1, int b2, signed char b3, long long b4,
                         unsigned short b5, long long b6, h16 a0, h16 a1, h16 a2, h16 a3,
                         h16 a4, h16 a5, h16 a6, h16 a7, h16 a8) {
    GOT(0, b0); GOT(1, b1); GOT(2, b2); GOT(3, b3); GOT(4, b4); GOT(5, b5); GOT(6, b6);
    GOT(7, a0); GOT(8, a1); GOT(9, a2); GOT(10, a3); GOT(11, a4); GOT(12, a5); GOT(13, a6);
    GOT(14, a7); GOT(15, a8);
}

static const struct {
    void *fn;
    const char *types;  /* each parameter: i int, q long long, h short, c char, p pointer,
                           f float, d double, e _Float16 */
} CALLS[] = {
    {(void *)k_alternate, "fidpfidpfidpfidp"},
    {(void *)k_doubles, "dddddddddddddddd"},
    {(void *)k_floats_first, "fffffffffqfqqqqq"},
    {(void *)k_ints_first, "qhicqhqeeeeeeeee"},
};

static size_t type_size(char type) {
    switch (type) {
    case 'c': return 1;
    case 'h': case 'e': return 2;
    case 'i': case 'f': return 4;
    default: return 8;
    }
}

static void check_calls(long n) {
    atomic_store(&phase, "calls");
    am_timeline *own = am_timeline_new();
    am_queue *q = am_queue_new(own, 0, 19);
    if (!own || !q) die("calls: out of memory");
    uint64_t bits = 0x9E3779B97F4A7C15ULL, done = 0;
    for (long i = 0; i < n; i++) {
        for (size_t k = 0; k < sizeof CALLS / sizeof CALLS[0]; k++) {
            int64_t args[16];
            uint32_t floats = 0;
            for (int j = 0; j < 16; j++) {
                bits ^= bits << 13; bits ^= bits >> 7; bits ^= bits << 17;  /* xorshift */
                args[j] = (int64_t)bits;
                if (strchr("fde", CALLS[k].types[j])) floats |= 1u << j;
            }
            memset(got, 0, sizeof got);
            if (am_queue_call(q, CALLS[k].fn, 16, args, floats, NULL, ++done)) die("calls: push");
            if (!reached(own, done)) die("calls: the call did not run");
            for (int j = 0; j < 16; j++) {
                if (memcmp(&got[j], &args[j], type_size(CALLS[k].types[j]))) {
                    fprintf(stderr, "signature %s: parameter %d got %016llx, passed %016llx\n",
                            CALLS[k].types, j, (unsigned long long)got[j],
                            (unsigned long long)args[j]);
                    die("calls: a parameter got other bits than its slot's");
                }
            }
        }
        atomic_fetch_add(&progress, 1);
    }
    am_queue_close(q, 0);
    am_timeline_free(own);
    puts("ok calls");
}

static void check_deadlines(void) {
    atomic_store(&phase, "deadlines");
    static const int64_t waits[] = {INT64_MIN, -1000000001LL, -999999999LL, -1, 0, 1,
                                    999999999LL, 1000000000LL, INT64_MAX};
    for (int round = 0; round < 100; round++) {
        for (size_t i = 0; i < sizeof waits / sizeof *waits; i++) {
            struct timespec now, until;
            clock_gettime(CLOCK_MONOTONIC, &now);
            deadline_after(&until, waits[i]);
            if (until.tv_nsec < 0 || until.tv_nsec >= 1000000000L)
                die("deadlines: a deadline's nanoseconds out of range");
            if (until.tv_sec < now.tv_sec ||
                (until.tv_sec == now.tv_sec && until.tv_nsec < now.tv_nsec))
                die("deadlines: a deadline before the present");
            if (waits[i] > 1000000000LL && until.tv_sec < now.tv_sec + 1)
                die("deadlines: a long wait's deadline wrapped");
        }
        /* Nothing runs a block here: each returns once its time is up, at once. */
        int64_t start = now_ns();
        uint64_t seen = am_blocks_wait(0, 0);
        if (am_blocks_wait(seen, -999999999LL) != seen || am_blocks_wait(seen, -1) != seen)
            die("deadlines: a block ran");
        if (now_ns() - start > 2000000000LL) die("deadlines: a negative wait for a block waited");
        atomic_fetch_add(&progress, 1);
    }
    puts("ok deadlines");
}

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 5000;
    pthread_t dog;
    pthread_create(&dog, NULL, watchdog, NULL);
    pthread_detach(dog);
    check_abandon(n);
    check_word(n / 4);
    check_finish(n / 4);
    check_discard(n / 4);
    check_settle(n / 20);
    check_watch(n);
    check_notify(n / 20);
    check_parts(n / 10);
    check_blocks(n / 10);
    check_calls(n / 10);
    check_deadlines();
    if (argc > 2 && !strcmp(argv[2], "fork")) check_fork(n / 50 + 1);
    return 0;
}
