/* Timelines, notifiers and watches: how a native thread wakes an event loop.
 *
 * A timeline is a 64-bit value that only grows. When it reaches the value a loop waits
 * for, the loop's notifier gets one byte on its pipe -- only if none is pending -- so one
 * wake-up of the loop serves every completion since its last drain. No GIL is taken, and
 * no pipe is written under a timeline's mu (see wakeups).
 */
#include "amrt.h"

AM_HIDDEN unsigned am_forks;

static void am_after_fork(void) { am_forks++; }

__attribute__((constructor)) static void am_register_fork_handler(void) {
    pthread_atfork(NULL, NULL, am_after_fork);
}

/* ---- notifiers and watches ------------------------------------------------------- */

am_notifier *am_notifier_new(int fd) {
    am_notifier *n = calloc(1, sizeof *n);
    if (n) n->fd = fd;
    return n;
}

#define WRITERS 0xffffffffull  /* writing's count of signallers (amrt.h) */

/* Its watches are unlinked (am_watch_free, under their timelines' mu): no signaller takes
 * it any more. One that took it before writes its pipe after letting go of that mu: the
 * free waits for that write, so the pipe, which the loop closes after this, outlives it
 * (one byte to a non-blocking pipe). */
void am_notifier_free(am_notifier *n) {
    for (;;) {
        uint64_t writing = atomic_load(&n->writing);
        if (writing >> 32 != am_forks || !(writing & WRITERS)) break;
        sched_yield();
    }
    free(n);
}

static void notifier_write(am_notifier *n) {
    char one = 1;
    ssize_t r;
    do { r = write(n->fd, &one, 1); } while (r < 0 && errno == EINTR);
}

/* The loops a signaller wakes, written once the timeline's mu is let go of: a write,
 * even to a non-blocking pipe, is a system call, and under mu it would hold every other
 * signaller and waiter of the timeline for it (for as long as it blocks, were a pipe
 * blocking). Each notifier's byte is claimed under mu (its pending flag: no other
 * signaller writes one meanwhile) and written later, which loses no wake-up: the loop
 * clears the flag only after emptying its pipe, and reads the values after that, so a
 * value raised before the claim is either seen by its drain or followed by the byte. A
 * notifier claimed is held (writing) until written: see am_notifier_free. */
#define WAKE_INLINE 8
typedef struct wakeups {
    am_notifier **n;
    int count, cap;
    am_notifier *inline_n[WAKE_INLINE];
} wakeups;

static void wakeups_init(wakeups *wk) {
    wk->n = wk->inline_n;
    wk->count = 0;
    wk->cap = WAKE_INLINE;
}

static void notifier_hold(am_notifier *n) {
    uint64_t old = atomic_load(&n->writing), now = (uint64_t)am_forks << 32;
    for (;;) {
        /* (a count of another fork's is none here: its writers are a parent's threads) */
        uint64_t next = (old & ~WRITERS) == now ? old + 1 : now | 1;
        if (atomic_compare_exchange_weak(&n->writing, &old, next)) return;
    }
}

/* Wake n's loop once mu is let go of (wake), unless a byte is on its way (under mu). */
static void notify(wakeups *wk, am_notifier *n) {
    if (atomic_exchange(&n->pending, 1)) return;
    if (wk->count == wk->cap) {
        int cap = wk->cap * 2;
        am_notifier **more = malloc((size_t)cap * sizeof *more);
        if (!more) {  /* (no memory for the list: written here, under mu) */
            notifier_write(n);
            return;
        }
        memcpy(more, wk->n, (size_t)wk->count * sizeof *more);
        if (wk->n != wk->inline_n) free(wk->n);
        wk->n = more;
        wk->cap = cap;
    }
    notifier_hold(n);
    wk->n[wk->count++] = n;
}

/* Write the notifiers notify() took (mu let go of). */
static void wake(wakeups *wk) {
    for (int i = 0; i < wk->count; i++) {
        notifier_write(wk->n[i]);
        atomic_fetch_sub(&wk->n[i]->writing, 1);
    }
    if (wk->n != wk->inline_n) free(wk->n);
}

/* Called by the loop after emptying its pipe and before reading the values: any later
 * advance writes again. Returns until when (a now_ns() time) the loop was asked to read
 * its timelines in every iteration (am_timeline_near; 0: not asked), and forgets it. */
int64_t am_notifier_reset(am_notifier *n) {
    atomic_store(&n->pending, 0);
    return atomic_exchange(&n->awake_until, 0);
}

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
    t->refs = 1;
    pthread_mutex_init(&t->mu, NULL);
    am_cond_init(&t->cv);
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

/* ---- device waits held until they can be satisfied --------------------------------
 *
 * A device waits on a word (cuStreamWaitValue64) only once the write that satisfies it
 * was handed to a driver, or the host raised the word: streams beyond the device's
 * hardware queues share one, and a wait there holds up every stream behind it, which a
 * write handed over later would be. Until then the wait is held on the host, with a
 * kick registered here; it runs once the value handed over or the word got there. */

static uint64_t timeline_reached_for_devices(am_timeline *t) {
    uint64_t word = t->word ? atomic_load(t->word) : 0, handed = atomic_load(&t->handed);
    return word > handed ? word : handed;
}

/* Whether a device wait for `target` of t can go on (under mu). A timeline with no device
 * word (a host queue's, cpu or npy: its thread raises it once a command ran) is never
 * waited for on a device: a wait is held on the host until the value got there, or t
 * failed for it (a host queue's values before the first failed one were all reached:
 * its thread runs its commands in order) -- and is then done, the work behind it handed
 * to the driver only after what it waited for (cuq_wait_word). A wait on a device word
 * goes on once the word or a write handed over got there -- or once t failed for it:
 * then it is not made (cuq_skip_failed), and the word, released by the failure, may be
 * lowered again by a signal's word write landing after it (a store), which a queue whose
 * thread cannot confirm that write (cuda_completion.c, cuq_no_context) never raises
 * again. */
static int kick_due(am_timeline *t, const am_kick *k) {
    if (timeline_failed_for(t, k->target)) return 1;
    if (!t->word || k->on_value) return atomic_load(&t->value) >= k->target;
    return timeline_reached_for_devices(t) >= k->target;
}

/* The kicks due now, taken off the list (under mu): run them once mu is released. */
static am_kick *kicks_due(am_timeline *t) {
    if (!t->kicks) return NULL;
    am_kick *due = NULL, **p = &t->kicks;
    while (*p) {
        am_kick *k = *p;
        if (kick_due(t, k)) {
            *p = k->next;
            k->next = due;
            due = k;
        } else {
            p = &k->next;
        }
    }
    atomic_store(&t->has_kicks, t->kicks != NULL);
    return due;
}

static void run_kicks(am_kick *k) {
    while (k) {
        am_kick *next = k->next;
        k->fn(k);
        k = next;
    }
}

/* A device write of v into the word was handed to a driver (or, a queue's own timeline,
 * its command v). The seq_cst store-then-load pairs with timeline_defer's. */
void timeline_handed(am_timeline *t, uint64_t v) {
    uint64_t old = atomic_load(&t->handed);
    while (old < v && !atomic_compare_exchange_weak(&t->handed, &old, v)) {}
    if (atomic_load(&t->nappers)) host_signalled();  /* a device write of it is coming */
    if (!atomic_load(&t->has_kicks)) return;
    pthread_mutex_lock(&t->mu);
    am_kick *due = kicks_due(t);
    pthread_mutex_unlock(&t->mu);
    run_kicks(due);
}

/* Register k for `target`: 1 if registered (k->fn runs once it is due), 0 if a device may
 * wait for it now. */
int timeline_defer(am_timeline *t, uint64_t target, am_kick *k) {
    pthread_mutex_lock(&t->mu);
    k->target = target;
    k->next = t->kicks;
    t->kicks = k;
    atomic_store(&t->has_kicks, 1);
    int ready = kick_due(t, k);
    if (ready) {
        t->kicks = k->next;
        atomic_store(&t->has_kicks, t->kicks != NULL);
    }
    pthread_mutex_unlock(&t->mu);
    return !ready;
}

/* Whether k is registered on t still (not due yet: its fn has not run, nor will run
 * before something gets t there); `take`: taken off if so, and then it never runs. */
int timeline_undefer(am_timeline *t, am_kick *k, int take) {
    pthread_mutex_lock(&t->mu);
    am_kick **p = &t->kicks;
    while (*p && *p != k) p = &(*p)->next;
    int registered = *p != NULL;
    if (registered && take) {
        *p = k->next;
        atomic_store(&t->has_kicks, t->kicks != NULL);
    }
    pthread_mutex_unlock(&t->mu);
    return registered;
}

/* The word was raised outside the functions here (a failed queue's, to UINT64_MAX). */
void timeline_kick(am_timeline *t) {
    pthread_mutex_lock(&t->mu);
    am_kick *due = kicks_due(t);
    pthread_mutex_unlock(&t->mu);
    run_kicks(due);
}

static void timeline_fail(am_timeline *t, uint64_t after, uint64_t target, int error,
                          uint64_t value, am_timeline *cause);

/* A command that signals t (to `target`) failed, or will never run (its device closed
 * while it waited for a value nobody signalled: AM_ABANDONED): unless t got there
 * already, it settles -- its value and its word at UINT64_MAX, as a failed queue's own
 * timeline -- failed from the value after the last it reached, with the failure behind
 * it (an error, the failed value, a queue's own timeline). So every wait on it ends: a
 * host task's, which then raises; a cpu queue's and a stream's, whose queue then fails
 * its commands from that wait on (host_queues.c, cuda_completion.c). Not under any
 * queue's mu. */
void am_timeline_fail(am_timeline *t, uint64_t target, int error, uint64_t value,
                      am_timeline *cause) {
    timeline_fail(t, 0, target, error, value, cause);
}

/* am_timeline_fail; `after` (0: none) a value below target that t gets first, failed
 * instead if t failed for it (then that failure stands) or closed (the close's failure
 * stands, t not raised: am_timeline_close), looked at in the same hold of mu. */
static void timeline_fail(am_timeline *t, uint64_t after, uint64_t target, int error,
                          uint64_t value, am_timeline *cause) {
    pthread_mutex_lock(&t->mu);
    uint64_t reached = atomic_load(&t->value);
    if (reached >= target || (after && (t->closed || timeline_failed_for(t, after)))) {
        pthread_mutex_unlock(&t->mu);
        timeline_keep_released(t);  /* (failed already: a later write may have landed) */
        return;
    }
    /* (failed already from a later value, marked before it settles -- a signal passed
     * behind a failed wait, cuda_submit.c, cuq_skip_signal -- the earlier one stands) */
    if (!t->failed_from || reached + 1 < t->failed_from) {
        t->failed_from = reached + 1;
        t->fail_error = error;
        t->fail_value = value;
        t->fail_cause = cause;
    }
    pthread_mutex_unlock(&t->mu);
    if (t->word) raise_word(t->word, AM_WORD_RELEASED);
    am_timeline_poke(t, UINT64_MAX);
    host_signalled();  /* cuda completion threads napping on a wait it releases */
}

/* A failure of t waiting for its value to get to `after` (am_timeline_fail_after): the
 * kick is the record, first. */
typedef struct {
    am_kick kick;
    am_timeline *t, *cause;
    uint64_t target, value;
    int error;
} fail_after;

static void fail_after_due(am_kick *k) {
    fail_after *f = (fail_after *)k;
    timeline_fail(f->t, k->target, f->target, f->error, f->value, f->cause);
    timeline_unref(f->t);  /* the kick's (never the last: whoever got t there holds one) */
    free(f);
}

/* A signal of t to `target` that never runs (its queue failed, or dropped it), ordered
 * after a signal of t to `after`, lower, that may still run: the failed queue's wait
 * for that one right before it (Queue.signal orders a queue's signal of a timeline
 * after another queue's pending one so), or one handed to a driver. Signals of a
 * timeline take effect in submission order, so t still gets `after` first: it fails
 * (am_timeline_fail) from the value after the one it reached only once its value got
 * there -- that signal ran, and, a device's, was confirmed -- and not at all if it
 * failed for `after` instead, or closed (that signal failed, or a close abandoned it:
 * that failure stands). At once if t got there already, or with no memory to wait
 * (then from the value after what it reached, which may be below `after`). The wait is
 * a kick on t's value (on_value: a device word raised, or a write handed over, is not
 * the value confirmed), holding a reference of t until it runs: a close of t runs it
 * (timeline_kick). Not under any queue's mu. */
void am_timeline_fail_after(am_timeline *t, uint64_t after, uint64_t target, int error,
                            uint64_t value, am_timeline *cause) {
    fail_after *f = after < target && atomic_load(&t->value) < after ? malloc(sizeof *f) : NULL;
    if (!f) {
        timeline_fail(t, 0, target, error, value, cause);
        return;
    }
    *f = (fail_after){.kick = {.fn = fail_after_due, .on_value = 1}, .t = t, .cause = cause,
                      .target = target, .value = value, .error = error};
    atomic_fetch_add(&t->refs, 1);
    if (!timeline_defer(t, after, &f->kick)) fail_after_due(&f->kick);
}

/* t's values from `from` on will be reached without being produced (a cpu queue's
 * failed commands, which its thread passes without running them; a Metal queue's
 * dropped by a discarding close, which an empty command buffer takes t past; a cuda
 * queue's signals known to fail before they are confirmed): unless it failed already
 * from there or before, t fails from there, with the failure behind it, without rising
 * or settling -- a mark from a later value is lowered while t has not reached `from`
 * (a signal counted as sure by the later mark, cuda_completion.c, cuq_sure, turned out
 * to fail). A wait that gets there sees the failure (both under t's mu). */
void am_timeline_fail_from(am_timeline *t, uint64_t from, int error, uint64_t value,
                           am_timeline *cause) {
    pthread_mutex_lock(&t->mu);
    if (!t->failed_from || (from < t->failed_from && from > atomic_load(&t->value))) {
        t->failed_from = from;
        t->fail_error = error;
        t->fail_value = value;
        t->fail_cause = cause;
    }
    pthread_mutex_unlock(&t->mu);
}

/* t's device closed: nothing will raise it any more. Unless it failed already, it
 * fails from the value after the one it reached (AM_CLOSED, its own cause), without
 * rising: a wait for more ends -- a cpu queue's, which then fails its commands from the
 * wait on (host_queues.c) -- and its word goes to UINT64_MAX, ending device waits on it
 * (a stream's: whose queue does the same, cuda_completion.c). A device timeline's
 * failure marked from a later value before it settled (a signal passed behind a failed
 * wait, after a signal in flight that was to get it there: cuq_fail_signal_now) is
 * lowered so too: that signal never comes now. `pending`: what a queue of another
 * device has a signal of it submitted to and not run yet -- waits up to there go on,
 * ended by that signal or its failure (a timeline without a device word only: a
 * stream's wait on the word cannot be held for it). Not under any queue's mu. */
void am_timeline_close(am_timeline *t, uint64_t pending) {
    pthread_mutex_lock(&t->mu);
    uint64_t reached = atomic_load(&t->value);
    if (!t->word && reached != UINT64_MAX && pending > reached) reached = pending;
    if (!t->failed_from ||
        (t->word && reached != UINT64_MAX && reached + 1 < t->failed_from)) {
        if (reached == UINT64_MAX) {
            pthread_mutex_unlock(&t->mu);
            return;
        }
        t->failed_from = reached + 1;
        t->fail_error = AM_CLOSED;
        t->fail_value = reached + 1;
        t->fail_cause = t;
    }
    t->closed = 1;
    pthread_cond_broadcast(&t->cv);
    pthread_mutex_unlock(&t->mu);
    if (t->word) raise_word(t->word, AM_WORD_RELEASED);
    timeline_kick(t);  /* waits held on the host for it: they go on (and fail) */
    host_signalled();
    if (atomic_load(&am_settling)) am_settle_wake();
}

/* A failed or closed timeline's word, which a stream's store (a signal's word write,
 * cuStreamWriteValue64: a store, not a max) may have lowered again after it was
 * released: released again, and the waits held for it go on. Not under t->mu. */
void timeline_keep_released(am_timeline *t) {
    pthread_mutex_lock(&t->mu);
    int failed = t->failed_from != 0;
    pthread_mutex_unlock(&t->mu);
    if (!failed || !t->word || atomic_load(t->word) == AM_WORD_RELEASED) return;
    raise_word(t->word, AM_WORD_RELEASED);
    timeline_kick(t);
    host_signalled();
}

/* Whether a wait on t for target ends without target: t failed at or before it. Under
 * t->mu. */
int timeline_failed_for(const am_timeline *t, uint64_t target) {
    return t->failed_from && target >= t->failed_from;
}

/* Where failed_from lies in an am_timeline: Python reads it in place (a queue's own
 * timeline, on every await of a command's completion; written before the value gets
 * there, under mu, so read after the value it is current). */
size_t am_timeline_failed_offset(void) { return offsetof(am_timeline, failed_from); }

/* The first value of t that failed (0: none), and the failure behind it. */
uint64_t am_timeline_failure(am_timeline *t, int *error, uint64_t *value, am_timeline **cause) {
    pthread_mutex_lock(&t->mu);
    uint64_t failed = t->failed_from;
    *error = t->fail_error;
    *value = t->fail_value;
    *cause = t->fail_cause;
    pthread_mutex_unlock(&t->mu);
    return failed;
}

void am_timeline_free(am_timeline *t) {
    /* In a child, the parent's: destroying a condition waits for its waiters, which
     * here are threads that no longer exist. */
    if (t->forks != am_forks) return;
    timeline_unref(t);
}

/* How many references of t are held (see refs): 1 once only its owner's is left. Its
 * owner asks before letting go: the device word it gave t (a pinned slot) goes to
 * another timeline only once nothing of the runtime can still write it. */
int am_timeline_refs(am_timeline *t) { return atomic_load(&t->refs); }

/* Let go of a reference of t (see refs): the last one frees it. */
void timeline_unref(am_timeline *t) {
    if (atomic_fetch_sub(&t->refs, 1) != 1) return;
    am_metal_disown(t);  /* (a Metal queue's own: its event, retained) */
    /* (t->kicks: none -- a kick registered holds a reference of t, cuda_submit.c) */
    pthread_mutex_destroy(&t->mu);
    pthread_cond_destroy(&t->cv);
    free(t);
}

uint64_t am_timeline_value(am_timeline *t) { return atomic_load(&t->value); }

/* Raise the value to at least v and wake whoever waits up to the value now held, leaving
 * the device word alone (a device wrote it: a completion thread confirms that here). */
void am_timeline_poke(am_timeline *t, uint64_t v) {
    wakeups wk;
    wakeups_init(&wk);
    pthread_mutex_lock(&t->mu);
    if (v > atomic_load(&t->value)) atomic_store(&t->value, v);
    v = atomic_load(&t->value);
    pthread_cond_broadcast(&t->cv);
    for (am_watch *w = t->watches; w; w = w->link)
        if (v >= atomic_load(&w->next)) notify(&wk, w->notifier);
    am_kick *due = kicks_due(t);
    pthread_mutex_unlock(&t->mu);
    wake(&wk);
    run_kicks(due);
    if (atomic_load(&am_settling)) am_settle_wake();
}

/* The work raising t to v is about to end (a completion thread that napped through most
 * of a long command, now polling for its end): wake the loops waiting for up to v, and
 * ask them to read t in every iteration until until_ns rather than sleep. A sleeping
 * loop takes tens of microseconds to wake, more after a long sleep: woken now, it is
 * awake when the value comes. */
void am_timeline_near(am_timeline *t, uint64_t v, int64_t until_ns) {
    wakeups wk;
    wakeups_init(&wk);
    pthread_mutex_lock(&t->mu);
    uint64_t value = atomic_load(&t->value);
    if (value < v) {
        for (am_watch *w = t->watches; w; w = w->link) {
            uint64_t next = atomic_load(&w->next);
            if (next > v || next <= value) continue;  /* (reached: notified already) */
            am_notifier *n = w->notifier;
            int64_t old = atomic_load(&n->awake_until);
            while (old < until_ns && !atomic_compare_exchange_weak(&n->awake_until, &old, until_ns)) {}
            notify(&wk, n);
        }
    }
    pthread_mutex_unlock(&t->mu);
    wake(&wk);
}

static void timeline_raise(am_timeline *t, uint64_t v, uint64_t from, int error,
                           uint64_t value, am_timeline *cause, am_notifier *here);

void am_timeline_signal(am_timeline *t, uint64_t v) {
    timeline_raise(t, v, 0, 0, 0, NULL, NULL);
}

/* am_timeline_signal(t, v) from the thread running the loop of notifier `here`, which
 * wakes that loop's waiters on t itself as the signal returns (Watch.wake_now): no byte
 * to its own pipe -- a system call here, then an event the loop handles, both before
 * the tasks woken run. Other loops' notifiers are written as usual. */
void am_timeline_signal_here(am_timeline *t, uint64_t v, am_notifier *here) {
    timeline_raise(t, v, 0, 0, 0, NULL, here);
}

/* am_timeline_signal(t, v), t failing from `from` on (unless it failed already from
 * there or before) under the same hold of its mu: a wait that sees the failure
 * sees v reached too (a Metal queue's command that failed, or ran behind a wait for a
 * value never produced, raises its own timeline so: objc_blocks.c, block_finish). */
void timeline_signal_failed(am_timeline *t, uint64_t v, uint64_t from, int error,
                            uint64_t value, am_timeline *cause) {
    timeline_raise(t, v, from, error, value, cause, NULL);
}

static void timeline_raise(am_timeline *t, uint64_t v, uint64_t from, int error,
                           uint64_t value, am_timeline *cause, am_notifier *here) {
    wakeups wk;
    wakeups_init(&wk);
    atomic_fetch_or(&t->signalled_by, AM_BY_HOST);
    pthread_mutex_lock(&t->mu);
    /* (failed already from a later value -- a Metal queue's commands dropped by a
     * discarding close, marked before its earlier ones completed -- the earlier one
     * stands: nothing has seen a value from it on reached yet) */
    if (from && (!t->failed_from || from < t->failed_from)) {
        t->failed_from = from;
        t->fail_error = error;
        t->fail_value = value;
        t->fail_cause = cause;
        pthread_cond_broadcast(&t->cv);  /* (a wait for more than v ends failed) */
    }
    if (t->word) raise_word(t->word, v);  /* devices waiting on it go first */
    if (v > atomic_load(&t->value)) {
        atomic_store(&t->value, v);
        pthread_cond_broadcast(&t->cv);
        for (am_watch *w = t->watches; w; w = w->link)
            if (v >= atomic_load(&w->next) && w->notifier != here) notify(&wk, w->notifier);
    }
    am_kick *due = kicks_due(t);
    pthread_mutex_unlock(&t->mu);
    /* (a host queue's signal of a word a stream waits on; am_timeline_host_signal kicks
     * every napping thread itself) */
    if (t->word && atomic_load(&t->nappers)) host_signalled();
    wake(&wk);
    run_kicks(due);
    if (atomic_load(&am_settling)) am_settle_wake();
}

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

/* Publish that the command raising t to v is expected done at due_ns (0: not known).
 * One publisher at a time (the queue owning t, under its lock). */
void timeline_set_due(am_timeline *t, uint64_t v, int64_t due_ns) {
    atomic_store(&t->due_value, 0);
    atomic_store(&t->due_ns, due_ns);
    atomic_store(&t->due_value, v);
}

/* When the command raising t to v is expected to be done (a now_ns() time), if its
 * queue published that v is the last one submitted; else 0. A hint: no lock. */
int64_t am_timeline_due(am_timeline *t, uint64_t v) {
    if (atomic_load(&t->due_value) != v) return 0;
    int64_t due = atomic_load(&t->due_ns);
    return atomic_load(&t->due_value) == v ? due : 0;
}

/* The digest of the sources this library was built from (asyncmetal/_native_build.py):
 * a packaged runtime is loaded only if it matches the sources installed beside it. */
#ifndef AM_BUILD_DIGEST
#define AM_BUILD_DIGEST "unknown"
#endif
const char *am_build_digest(void) { return AM_BUILD_DIGEST; }
