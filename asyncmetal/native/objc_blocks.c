/* Objective-C blocks whose invoke functions never take the GIL (the Metal backend's
 * completed handlers and shared-event listeners; am_block's layout is in amrt.h). They
 * only record their argument and raise a timeline, which wakes the waiting loops
 * through their pipes.
 */
#include "amrt.h"

/* The count of calls is the last thing written: once it is seen, the block may be freed
 * (release_ran), so nothing reads the block after it. */

#define MTL_COMMAND_BUFFER_STATUS_ERROR 5

/* Blocks that ran whose owner waits for that (their notify set): what they kept can go. */
static pthread_mutex_t ran_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t ran_cv;  /* timed (am_cond_init), as the runtime loads */
static uint64_t notified_ran;

__attribute__((constructor)) static void ran_cv_init(void) { am_cond_init(&ran_cv); }

/* b has run: its count of calls goes up, the last thing read or written of it. */
static void block_ran(am_block *b) {
    int notify = b->notify;
    atomic_fetch_add(&b->calls, 1);  /* b (and maybe its timelines) may go now */
    if (notify) {
        pthread_mutex_lock(&ran_mu);
        notified_ran++;
        pthread_cond_broadcast(&ran_cv);
        pthread_mutex_unlock(&ran_mu);
    }
}

/* Wait until a block whose notify is set has run since the count `seen` (or for at most
 * timeout_ns); returns the count. */
uint64_t am_blocks_wait(uint64_t seen, int64_t timeout_ns) {
    struct timespec until;
    deadline_after(&until, timeout_ns);
    pthread_mutex_lock(&ran_mu);
    int r = 0;
    while (notified_ran == seen && r != ETIMEDOUT)
        r = am_cond_timedwait(&ran_cv, &ran_mu, &until);
    uint64_t now = notified_ran;
    pthread_mutex_unlock(&ran_mu);
    return now;
}

/* Whether g's timeline reached its value or failed at or before it. */
static int gate_settled(const am_gate *g) {
    am_timeline *t = g->timeline;
    if (atomic_load(&t->value) >= g->value) return 1;
    pthread_mutex_lock(&t->mu);
    int failed = timeline_failed_for(t, g->value);
    pthread_mutex_unlock(&t->mu);
    return failed;
}

static int gates_settled(const am_block *b) {
    for (int i = 0; i < b->ngates; i++)
        if (!gate_settled(&b->gates[i])) return 0;
    return 1;
}

/* The first gate of b whose value failed, or NULL. */
static const am_gate *gate_failed(const am_block *b) {
    for (int i = 0; i < b->ngates; i++) {
        am_timeline *t = b->gates[i].timeline;
        pthread_mutex_lock(&t->mu);
        int failed = timeline_failed_for(t, b->gates[i].value);
        pthread_mutex_unlock(&t->mu);
        if (failed) return &b->gates[i];
    }
    return NULL;
}

/* Under t->mu: whether the Metal queue of t, failed, settles with the handler of
 * command `value` (the last noted) run, marked so (see settle_failed). */
static int settle_marked(am_timeline *t, uint64_t value) {
    /* (a command buffer after the first that ran behind a failed wait reads no failure
     * of its own in block_finish, with neither a gate that failed nor a signal) */
    int failed = atomic_load(&t->failed_command) || t->waited_failed;
    int settle = failed && t->event && t->submitted != UINT64_MAX && value >= t->submitted;
    if (settle) t->submitted = UINT64_MAX;
    return settle;
}

/* Settle t, marked by settle_marked: its event (retained by t, see am_metal_own), then
 * its timeline -- whoever sees the timeline settled (a task its raise wakes) sees the
 * event settled too, and the GPU's waits on it ended or ending. */
static void settle_event(am_timeline *t) {
    ((void (*)(void *, void *, uint64_t))t->event_send)(t->event, t->event_selector,
                                                        UINT64_MAX);
    am_timeline_signal(t, UINT64_MAX);
}

/* A Metal queue that failed (a command buffer of it, or a device wait for a value never
 * produced) settles once the handler of its last submitted command ran -- `value`'s, in
 * order, so every command buffer it committed has completed -- as a cpu queue does
 * (host_queues.c, passed_all): its own timeline, failed from its first failed command
 * on, goes to UINT64_MAX, and its event with it (the GPU's waits on it end, and their
 * queues fail from them on), so no wait for a value no command of it produces is left
 * waiting. The look and the mark are under t->mu, as am_metal_submitting's note of a
 * command: one noted before the look is past `value` (no settle yet), and one noted
 * after the mark is never committed. The last handler run is noted there too: a note
 * taken back settles from it (am_metal_unsubmitting). */
static void settle_failed(am_timeline *t, uint64_t value) {
    pthread_mutex_lock(&t->mu);
    if (value > t->finished) t->finished = value;
    int settle = settle_marked(t, value);
    pthread_mutex_unlock(&t->mu);
    if (settle) settle_event(t);
}

/* A command of the Metal queue whose own timeline is t failed (recorded on t already):
 * its thread's wait held behind a later command, if any, is woken to look at that now
 * (am_metal_host_wait), not after its nap. The held timeline is referenced while it is
 * woken, outside t->mu: no timeline's mu is taken under another's. */
static void wake_held(am_timeline *t) {
    pthread_mutex_lock(&t->mu);
    atomic_fetch_add(&t->held_wakes, 1);
    am_timeline *held = t->held_on;
    if (held) atomic_fetch_add(&held->refs, 1);
    pthread_mutex_unlock(&t->mu);
    if (!held) return;  /* (one that starts later sees the count moved: its `seen`) */
    pthread_mutex_lock(&held->mu);
    pthread_cond_broadcast(&held->cv);
    pthread_mutex_unlock(&held->mu);
    timeline_unref(held);
}

/* Raise b's timeline, and the one its command buffer signalled (or fail that: a signal
 * its queue's failure, or a wait for a failed value, kept from being produced). */
static void block_finish(am_block *b, uint64_t failed, int held) {
    am_timeline *t = b->timeline;
    const am_gate *g = b->ngates ? gate_failed(b) : NULL;
    int error = 0;
    uint64_t value = 0, waited_failed = 0;
    am_timeline *cause = NULL;
    if (g) am_timeline_failure(g->timeline, &error, &value, &cause);
    if (g || b->then) {
        pthread_mutex_lock(&t->mu);
        if (g && !t->waited_failed) {  /* (the queue's handlers run in order) */
            t->waited_failed = b->value;
            t->waited_error = error;
            t->waited_value = value;
            t->waited_cause = cause;
        }
        waited_failed = t->waited_failed;
        error = t->waited_error;
        value = t->waited_value;
        cause = t->waited_cause;
        pthread_mutex_unlock(&t->mu);
    }
    int own_failed = failed && b->value >= failed;
    int wait_failed = !own_failed && waited_failed && b->value >= waited_failed;
    /* A signal that ran raises its timeline before the queue's own records the command
     * done: a task that awaited the command (woken by its queue's timeline) sees the
     * value. */
    if (b->then && !own_failed && !wait_failed) am_timeline_signal(b->then, b->then_value);
    /* Failed, or behind a wait that failed, the command fails its queue's timeline from
     * there on as it raises it: a wait on that timeline (another kind's queue's, a
     * host's) sees the failure, as a wait on a failed cpu command's value does. A signal
     * it carried fails after that, so that its failure's cause (the queue's timeline)
     * already tells why. */
    if (own_failed)
        timeline_signal_failed(t, b->value, failed, AM_COMMAND_FAILED, failed, t);
    else if (wait_failed)
        timeline_signal_failed(t, b->value, waited_failed, error, value, cause);
    else
        am_timeline_signal(t, b->value);
    if (own_failed || wait_failed) wake_held(t);
    if (b->then && own_failed)
        am_timeline_fail_after(b->then, b->then_after, b->then_value, AM_COMMAND_FAILED,
                               failed, t);
    else if (b->then && wait_failed)
        am_timeline_fail_after(b->then, b->then_after, b->then_value, error, value, cause);
    settle_failed(t, b->value);
    if (held) atomic_fetch_sub(&t->held_raises, 1);
    block_ran(b);
}

/* Completed blocks held until their gates settled, oldest first, and the thread that
 * lets them go: each queue's in order (a block waits behind every earlier one of its
 * timeline), those of different queues as their gates settle. */
typedef struct held_block {
    am_block *b;
    uint64_t failed;
    struct held_block *next;
} held_block;

AM_HIDDEN _Atomic int am_settling;
static pthread_mutex_t held_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t held_cv = PTHREAD_COND_INITIALIZER;
static held_block *held_head;
static unsigned settler_forks = (unsigned)-1;  /* am_forks when it started (a child: none) */

void am_settle_wake(void) {
    pthread_mutex_lock(&held_mu);
    pthread_cond_broadcast(&held_cv);
    pthread_mutex_unlock(&held_mu);
}

/* (Under held_mu.) The first held block that can go, taken off the list, or NULL. */
static held_block *take_settled(void) {
    for (held_block **p = &held_head; *p; p = &(*p)->next) {
        int first = 1;
        for (held_block *e = held_head; e != *p; e = e->next)
            if (e->b->timeline == (*p)->b->timeline) { first = 0; break; }
        if (first && gates_settled((*p)->b)) {
            held_block *h = *p;
            *p = h->next;
            return h;
        }
    }
    return NULL;
}

static void *settler(void *arg) {
    (void)arg;
    /* The process's from its first held block on, not a device's: named so that a
     * count of the threads a device leaves behind can tell it. */
    am_name_thread("asyncmetal-held");
    pthread_mutex_lock(&held_mu);
    for (;;) {
        held_block *h = take_settled();
        if (!h) {
            pthread_cond_wait(&held_cv, &held_mu);
            continue;
        }
        atomic_fetch_sub(&am_settling, 1);
        pthread_mutex_unlock(&held_mu);
        block_finish(h->b, h->failed, 1);
        free(h);
        pthread_mutex_lock(&held_mu);
    }
    return NULL;
}

/* Hold b (its command buffer completed) until its gates settled and its queue's earlier
 * held blocks went. Returns 0 if that cannot be arranged (then the caller goes on). */
static int hold_block(am_block *b, uint64_t failed) {
    held_block *h = malloc(sizeof *h);
    if (!h) return 0;
    *h = (held_block){b, failed, NULL};
    pthread_mutex_lock(&held_mu);
    if (settler_forks != am_forks) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int started = pthread_create(&th, &attr, settler, NULL) == 0;
        pthread_attr_destroy(&attr);
        if (!started) {
            pthread_mutex_unlock(&held_mu);
            free(h);
            return 0;
        }
        settler_forks = am_forks;
    }
    atomic_fetch_add(&b->timeline->held_raises, 1);
    held_block **p = &held_head;
    while (*p) p = &(*p)->next;
    *p = h;
    atomic_fetch_add(&am_settling, 1);
    pthread_cond_broadcast(&held_cv);
    pthread_mutex_unlock(&held_mu);
    return 1;
}

/* "v16@?0@8": void (^)(id<MTLCommandBuffer>) */
void am_block_completed(am_block *b, void *arg) {
    b->arg = arg;
    if (b->status_send) {
        long status = ((long (*)(void *, void *))b->status_send)(arg, b->status_selector);
        /* (lowered from a later command whose refused commit failed the queue first,
         * am_metal_unsubmitting: this one ran before it) */
        uint64_t first = atomic_load(&b->timeline->failed_command);
        while (status == MTL_COMMAND_BUFFER_STATUS_ERROR && (!first || b->value < first) &&
               !atomic_compare_exchange_weak(&b->timeline->failed_command, &first, b->value)) {
        }
    }
    uint64_t failed = atomic_load(&b->timeline->failed_command);
    if (b->copy_nbytes) memmove(b->copy_dst, b->copy_src, b->copy_nbytes);
    /* The queue's handlers are called in order: only the settler lowers held_raises. */
    if ((atomic_load(&b->timeline->held_raises) || !gates_settled(b)) && hold_block(b, failed))
        return;
    block_finish(b, failed, 0);
}

/* "v24@?0@8Q16": void (^)(id<MTLSharedEvent>, uint64_t) */
void am_block_reached(am_block *b, void *event, uint64_t value) {
    b->arg = event;
    am_timeline_signal(b->timeline, value);
    block_ran(b);
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
        b->notify = 0;
        b->copy_dst = NULL;
        b->copy_src = NULL;
        b->copy_nbytes = 0;
        b->then = NULL;
        b->then_value = 0;
        b->then_after = 0;
        b->status_send = NULL;
        b->status_selector = NULL;
        b->gates = NULL;
        b->ngates = 0;
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

/* ---- a wait held on a Metal queue's own thread --------------------------------------
 *
 * A Metal queue's wait that nothing committed yet would satisfy is held on the queue's
 * own thread, with what is submitted after it: a wait for a host queue's timeline (cpu
 * or npy, which the GPU cannot wait on) until it got there or failed for it; a wait for
 * a Metal timeline also until a command buffer that signals it that far was committed
 * (am_signal_committed: the GPU waits for the rest). Nothing behind it is committed
 * before, so a discarding close drops it all (and it never runs). *stop, set by
 * am_host_wait_stop (the queue discards, or is abandoned), ends the wait early. */

/* Whether nothing holds a wait for `target` of t on the host any more (under t->mu):
 * t got there or failed for it, or (`committed`: a Metal timeline) a command buffer that
 * signals it so was committed. A Metal queue's own timeline (`committed`
 * AM_HOST_WAIT_OWN) failed for it is not enough while it is not closed: its queue
 * commits every value (a discard's last buffer takes it past those it dropped), and the
 * GPU would wait for one that it still holds, or has not marked yet, on the host. */
static int host_wait_ready(am_timeline *t, uint64_t target, int committed) {
    return atomic_load(&t->value) >= target ||
           ((committed != AM_HOST_WAIT_OWN || t->closed) && timeline_failed_for(t, target)) ||
           (committed && atomic_load(&t->handed) >= target);
}

/* Wait until a wait for `target` of t is ready (host_wait_ready), or *stop is set (stop:
 * NULL, never), for at most timeout_ns (0: only look): 1 if it is ready, else 0. */
int am_host_wait(am_timeline *t, uint64_t target, int committed, int *stop,
                 int64_t timeout_ns) {
    struct timespec until;
    deadline_after(&until, timeout_ns);
    pthread_mutex_lock(&t->mu);
    int r = timeout_ns > 0 ? 0 : ETIMEDOUT;
    while (!host_wait_ready(t, target, committed) && !(stop && *stop) && r != ETIMEDOUT)
        r = am_cond_timedwait(&t->cv, &t->mu, &until);
    int ready = host_wait_ready(t, target, committed);
    pthread_mutex_unlock(&t->mu);
    return ready;
}

/* am_host_wait, on the own thread of the Metal queue whose own timeline is `own`, for a
 * wait held behind a command of it: it also ends (0) once a command of the queue failed
 * since the count `seen` of such failures (wake_held) -- at once if one did already --
 * and leaves the count now in *seen, so that the caller, having looked whether the
 * queue failed before its wait, waits again only for a failure it has not looked at. */
int am_metal_host_wait(am_timeline *own, uint64_t *seen, am_timeline *t, uint64_t target,
                       int committed, int *stop, int64_t timeout_ns) {
    struct timespec until;
    deadline_after(&until, timeout_ns);
    pthread_mutex_lock(&own->mu);
    own->held_on = t;
    pthread_mutex_unlock(&own->mu);
    uint64_t from = *seen;
    pthread_mutex_lock(&t->mu);
    int r = timeout_ns > 0 ? 0 : ETIMEDOUT;
    while (!host_wait_ready(t, target, committed) && !(stop && *stop) &&
           atomic_load(&own->held_wakes) == from && r != ETIMEDOUT)
        r = am_cond_timedwait(&t->cv, &t->mu, &until);
    int ready = host_wait_ready(t, target, committed);
    pthread_mutex_unlock(&t->mu);
    pthread_mutex_lock(&own->mu);
    own->held_on = NULL;
    *seen = atomic_load(&own->held_wakes);
    pthread_mutex_unlock(&own->mu);
    return ready;
}

/* Set *stop, and wake a thread in am_host_wait on t. */
void am_host_wait_stop(am_timeline *t, int *stop) {
    pthread_mutex_lock(&t->mu);
    *stop = 1;
    pthread_cond_broadcast(&t->cv);
    pthread_mutex_unlock(&t->mu);
}

/* The highest value a committed command buffer signals Metal timeline t to (0: none). */
uint64_t am_signal_committed_to(am_timeline *t) { return atomic_load(&t->handed); }

/* A command buffer that signals Metal timeline t to v was committed: a wait for up to v
 * held on a queue's thread goes to the GPU (t->handed, as a stream's write handed to the
 * driver is for a cuda timeline). */
void am_signal_committed(am_timeline *t, uint64_t v) {
    if (atomic_load(&t->handed) >= v) return;
    pthread_mutex_lock(&t->mu);
    if (atomic_load(&t->handed) < v) {
        atomic_store(&t->handed, v);
        pthread_cond_broadcast(&t->cv);
    }
    pthread_mutex_unlock(&t->mu);
}

/* t is a Metal queue's own timeline, of MTLSharedEvent `event`, which `send` (objc_msgSend)
 * with `selector` (setSignaledValue:) sets: it settles with its queue (settle_failed).
 * The event is retained (`retain`) until t is freed (am_metal_disown, with `release`):
 * a handler held until its gates settle may settle t after the queue's own reference of
 * the event went. */
void am_metal_own(am_timeline *t, void *event, void *send, void *selector, void *retain,
                  void *release) {
    ((void *(*)(void *, void *))send)(event, retain);
    am_metal_disown(t);
    pthread_mutex_lock(&t->mu);
    t->event = event;
    t->event_send = send;
    t->event_selector = selector;
    t->event_release = release;
    pthread_mutex_unlock(&t->mu);
}

/* Release the event t retained (am_metal_own), if any: t is being freed (timeline_unref:
 * nothing settles it any more). */
void am_metal_disown(am_timeline *t) {
    pthread_mutex_lock(&t->mu);
    void *event = t->event, *release = t->event_release;
    t->event = NULL;
    pthread_mutex_unlock(&t->mu);
    if (event) ((void (*)(void *, void *))t->event_send)(event, release);
}

/* Command `value` of the Metal queue whose own timeline is t is being submitted: 1, and
 * the queue settles only once a handler of it or a later one ran (settle_failed) -- or
 * 0 if the queue settled already: the command is not committed (the timeline is past
 * it; it fails by what failed the queue), and a timeline it signals (`then`: to
 * then_value, or NULL) fails with that failure, as a signal of a failed command buffer
 * does (block_finish). */
int am_metal_submitting(am_timeline *t, uint64_t value, am_timeline *then,
                        uint64_t then_value) {
    pthread_mutex_lock(&t->mu);
    int settled = t->submitted == UINT64_MAX;
    if (!settled && value > t->submitted) t->submitted = value;
    int error = t->fail_error;
    uint64_t fail_value = t->fail_value;
    am_timeline *cause = t->fail_cause;
    pthread_mutex_unlock(&t->mu);
    if (settled && then) am_timeline_fail(then, then_value, error, fail_value, cause);
    return !settled;
}

/* Command `value`, noted by am_metal_submitting, was refused before its commit (no
 * handler of it will run): returns whether its note was taken back -- to `to`, the
 * caller's highest value below it that a handler passes (every value refused before it
 * that none passes is skipped: one whose value was kept, `fail`, and one whose note a
 * later one kept then) -- or kept, a later note made (the caller then skips `value` as
 * that one is taken back). So t->submitted, until the queue settles, is always a value
 * that a handler of it or of a later command passes (or 0), and `finished` reaches it
 * once every command buffer committed completed: a failed queue settles then, whatever
 * was refused (MetalQueue._unnote). Either way
 * under t->mu, as every note: one made meanwhile is never lowered. A failed queue whose
 * handlers ran through `to` settles now, as its last one would have. `fail`: the
 * command's value is still to be reached, so the queue fails from it on, as from a
 * command buffer that failed (failed_command, unless an earlier one failed: one found
 * later lowers it, am_block_completed) -- its timeline is failed from there, and it
 * settles as a failed queue does. */
int am_metal_unsubmitting(am_timeline *t, uint64_t value, uint64_t to, int fail) {
    if (fail) {
        uint64_t failed = atomic_load(&t->failed_command);
        while ((!failed || value < failed) &&
               !atomic_compare_exchange_weak(&t->failed_command, &failed, value)) {
        }
        am_timeline_fail_from(t, value, AM_COMMAND_FAILED, value, t);
    }
    pthread_mutex_lock(&t->mu);
    int taken = t->submitted == value, settle = 0;
    if (taken) {
        t->submitted = to;
        settle = t->finished >= to && settle_marked(t, t->finished);
    }
    pthread_mutex_unlock(&t->mu);
    if (settle) settle_event(t);
    return taken;
}

/* Objects a Metal queue's close holds or lets go of with no Python code between (where a
 * KeyboardInterrupt could land, and the close run again: MetalQueue._close): each of
 * objs[0..n) that is not nil is sent `selector` (retain) through `send` (objc_msgSend)
 * and put in into[i], which then says exactly what was retained. */
void am_metal_retain_into(void *const *objs, void **into, size_t n, void *send,
                          void *selector) {
    for (size_t i = 0; i < n; i++) {
        if (!objs[i]) continue;
        ((void *(*)(void *, void *))send)(objs[i], selector);
        into[i] = objs[i];
    }
}

/* Each of objs[0..n) that is not nil is taken (its slot cleared) and sent `selector`
 * (release) through `send`: called again, nothing is released twice. */
void am_metal_release_each(void **objs, size_t n, void *send, void *selector) {
    for (size_t i = 0; i < n; i++) {
        void *obj = objs[i];
        objs[i] = NULL;
        if (obj) ((void (*)(void *, void *))send)(obj, selector);
    }
}
