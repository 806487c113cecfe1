/* A CUDA queue's completion thread (cuda_stream.h says how a queue works): it confirms
 * each command by its event, raises the queue's timeline, hands held operations to the
 * driver as commands are confirmed, and settles the queue when a command fails. Also
 * where a queue is made (cuda_stream.c releases its memory).
 */
#include "cuda_stream.h"

#ifdef __linux__
#include <sys/prctl.h>
#endif

/* A held operation the driver refused: that command and every one after it will never
 * run. The queue fails from that command's value on (earlier ones are still confirmed
 * by their events); what is still held is taken off the queue and returned, for the
 * caller to drop with cuq_drop_refused once mu is released. Under mu. */
static am_cuop *cuq_refused(am_cuq *q, uint64_t value, int r) {
    if (!q->error) { q->error = r; q->error_value = value; }
    am_cuop *dropped = q->held;
    q->held = q->held_tail = NULL;
    q->nheld = 0;
    return dropped;
}

/* Drop operations a refused command left held (or a discard, or a failure, took off):
 * the timelines their signals would have raised fail with it -- each only once it got
 * the value of a signal of it that may still run and comes first in its order
 * (am_timeline_fail_after): another queue's that the dropped wait right before the
 * signal was for (Queue.signal orders a queue's signal after another queue's pending
 * one so; held, it goes with the signal), or one handed to the driver, in flight. A
 * value a queue that did not fail signals is never reported failed. Not under mu. */
void cuq_drop_refused(am_cuq *q, am_cuop *op, int error, uint64_t value) {
    am_timeline *order = NULL;  /* the last wait dropped, on a timeline: its command's */
    uint64_t order_target = 0, order_value = 0;
    while (op) {
        am_cuop *next = op->next;
        if (cuop_signals(op)) {
            am_timeline *t = op->extra;
            uint64_t after = t == order && op->value == order_value + 1 ? order_target : 0;
            uint64_t handed = atomic_load(&t->handed);
            if (handed > after && handed < op->extra_value) after = handed;
            am_timeline_fail_after(t, after, op->extra_value, error, value, q->timeline);
        }
        if (op->kind == CUOP_WAIT && op->extra) {
            order = op->extra;  /* (compared only: the signal's operation holds its own) */
            order_target = op->target;
            order_value = op->value;
        }
        cuop_free(op);
        op = next;
    }
}

/* The held device wait first in q (deferred, its kick on kick_on) was dropped: its kick
 * goes too, unless it is due (then it clears q->deferred itself). Not under mu; the
 * caller holds a reference of q, and one of kick_on (cuq_kick_ref), let go of here. */
void cuq_unkick(am_cuq *q, am_timeline *kick_on) {
    int taken = timeline_undefer(kick_on, &q->kick, 1);
    if (taken) timeline_unref(kick_on);  /* the kick's (never the last: the caller's) */
    timeline_unref(kick_on);
    if (!taken) return;
    pthread_mutex_lock(&q->mu);
    q->deferred = 0;
    if (q->sleeping && cuq_can_drain(q)) pthread_cond_signal(&q->cv);
    pthread_mutex_unlock(&q->mu);
    cuq_unref(q);  /* (never the last: the caller's) */
}

/* Take off what q holds on the host from its first command with no operation handed to
 * the driver yet (returned, for cuq_drop_refused once mu is let go of), and the kick of
 * the held device wait first among it, if any: *kick_on, referenced for cuq_unkick (else
 * NULL). A command part of which the driver has stays held, to be handed over. Under
 * mu. */
static am_cuop *cuq_take_unhanded(am_cuq *q, am_timeline **kick_on) {
    am_cuop **p = &q->held, *last = NULL;
    while (*p && (*p)->value <= q->handed_value) {
        last = *p;
        p = &(*p)->next;
    }
    am_cuop *taken = *p;
    *kick_on = taken && q->deferred && taken == q->held ? cuq_kick_ref(q) : NULL;
    if (!taken) return NULL;
    *p = NULL;
    q->held_tail = last;
    for (am_cuop *op = taken; op; op = op->next) q->nheld--;
    return taken;
}

/* A thread handing q's operations over put a device wait back held, first (cuq_drain,
 * cuq_submit_then), with q failed: a failed command's confirmation (cuq_run) came while
 * the wait was out of q->held, and dropped none of it. It goes now, with what is held
 * behind it and its kick, as that confirmation drops them; then a close to finish,
 * waiting for what is held, goes on. An abandoning close drops them itself. Not under
 * mu; the caller holds a reference of q. */
void cuq_drop_failed(am_cuq *q) {
    am_timeline *kick_on = NULL;
    pthread_mutex_lock(&q->mu);
    am_cuop *dropped = q->stop != 2 ? cuq_take_unhanded(q, &kick_on) : NULL;
    int error = q->error;
    uint64_t error_value = q->error_value;
    pthread_mutex_unlock(&q->mu);
    if (kick_on) cuq_unkick(q, kick_on);
    cuq_drop_refused(q, dropped, error, error_value);
    pthread_mutex_lock(&q->mu);
    if (q->sleeping) pthread_cond_signal(&q->cv);
    pthread_mutex_unlock(&q->mu);
}

/* Drop what q holds on the host (past its bound on commands in flight, or behind a device
 * wait held) from its first command with no operation handed to the driver yet: those
 * commands fail with AM_DISCARDED (q's error, from that value on), a signal among them
 * fails its timeline (cuq_drop_refused), and q settles once what the driver has is
 * confirmed (cuq_run), now if nothing is -- as for a held command the driver refused.
 * What the driver has runs; a command part of which was handed over stays held and is
 * handed over as before. The queue is sealed: nothing is submitted to it any more. Not
 * under mu; never waits for the driver. In a forked child, a queue of the parent is left
 * as it is (amrt.h, am_forks). */
void am_cuq_discard(am_cuq *q) {
    if (q->forks != am_forks) return;  /* (its mu may be held for good: a parent's thread's) */
    pthread_mutex_lock(&q->mu);
    if (q->stop) {  /* closing: its close settles what is left */
        pthread_mutex_unlock(&q->mu);
        return;
    }
    /* A thread handing a held device wait over now (driving) may find it must wait, and
     * put it back held: this discard takes its command for handed over (handed_value),
     * so that thread discards again then (cuq_drain, cuq_submit_then). */
    q->discarded = 1;
    am_timeline *kick_on;  /* the held wait's kick goes too */
    am_cuop *dropped = cuq_take_unhanded(q, &kick_on);
    if (!dropped) {
        pthread_mutex_unlock(&q->mu);
        return;
    }
    uint64_t first = dropped->value;
    if (!q->error || first < q->error_value) {
        q->error = AM_DISCARDED;
        q->error_value = first;
    }
    int settle = !q->count && !q->held && !q->driving && !q->unfenced;
    pthread_mutex_unlock(&q->mu);
    /* The kick is taken off unlocked. If it came due meanwhile, cuq_kicked runs instead
     * (timeline_undefer and kicks_due decide which under the timeline's lock; either
     * ends the kick's reference of q, once), and finds nothing to hand over; with
     * nothing held and q's error set, no thread registers the kick again (submissions
     * are refused; cuq_drain and cuq_hand_over find nothing). */
    cuq_test_hook(CU_HOOK_DISCARD_UNLOCKED, q);
    if (kick_on) cuq_unkick(q, kick_on);
    cuq_drop_refused(q, dropped, AM_DISCARDED, first);
    if (settle) cuq_settle(q);
}

/* The first value of q that failed (a command refused or faulted), or that ran after a
 * device wait for a value its queue never produced (poisoned): 0 if none. Under mu. */
uint64_t cuq_failed_at(const am_cuq *q) {
    uint64_t at = q->error ? q->error_value : 0;
    return q->poisoned && (!at || q->poisoned < at) ? q->poisoned : at;
}

/* The failure behind that: q's own, or the one its waits came to. Under mu. */
void cuq_cause(const am_cuq *q, int *error, uint64_t *value, am_timeline **cause) {
    int own = q->error && q->error != CU_WAITED_FAILED && q->error != CU_HELD_FAILED &&
              (!q->poisoned || q->error_value <= q->poisoned);
    *error = own ? q->error : q->cause_error;
    *value = own ? q->error_value : q->cause_value;
    *cause = own ? q->timeline : q->cause;
}

/* cuq_cause, taking mu; with `failed`, also q's first failed value (cuq_failed_at) read
 * in the same hold. */
void cuq_cause_now(am_cuq *q, uint64_t *failed, int *error, uint64_t *value,
                   am_timeline **cause) {
    pthread_mutex_lock(&q->mu);
    if (failed) *failed = cuq_failed_at(q);
    cuq_cause(q, error, value, cause);
    pthread_mutex_unlock(&q->mu);
}

/* The last value of t, below `target`, that it is sure to get (cuq_fail_signal_now):
 * what it reached, what a signal of q's in flight before command `before` raises it to
 * (confirmed first, in q's order), or what another queue's signal handed over raises it
 * to. Those of q's from `before` on, and from a device wait found failed (poisoned) on,
 * are known to fail (passed, or failing once confirmed): not counted, nor t->handed when
 * it is one of them. Under q->mu. */
static uint64_t cuq_sure(const am_cuq *q, am_timeline *t, uint64_t before, uint64_t target) {
    uint64_t sure = atomic_load(&t->value), handed = atomic_load(&t->handed);
    int failing = 0;
    if (q->poisoned && q->poisoned < before) before = q->poisoned;
    for (size_t i = 0; i < q->count; i++) {
        const am_cuentry *e = &q->ring[(q->head + i) % q->cap];
        if (!e->signals || e->extra != t) continue;
        if (e->value < before && e->extra_value > sure) sure = e->extra_value;
        if (e->value >= before && e->extra_value >= handed) failing = 1;
    }
    if (!failing && handed > sure && handed < target) sure = handed;
    return sure;
}

/* Queue q's commands from `from` on ran (or will run) after a device wait for a value
 * that was never produced: each fails once confirmed, and q settles once its stream is
 * past all it was given (cuq_run). Those of its commands after `from`, and after the
 * last one with an operation handed to the driver, are not handed over any more: they
 * pass (q->skipped), as behind a failed wait held on the host. So do the commands of
 * queues that wait on q's values from there on, at once: a wait on an event of q's
 * would otherwise let them run and be confirmed before q settles. Not under any
 * queue's mu. */
void cuq_poison(am_cuq *q, uint64_t from, int error, uint64_t value, am_timeline *cause) {
    pthread_mutex_lock(&q->mu);
    /* Closed (or abandoned): it confirms nothing any more, its waiters went with its close
     * (cuq_abandon_waiters), and its timeline may be freed -- its owner lets go of it once
     * the close returned, while a queue it waited for still has its wait recorded. */
    if (q->stop == 2 || (q->poisoned && q->poisoned <= from)) {
        pthread_mutex_unlock(&q->mu);
        return;
    }
    /* (A command being handed over on another thread now, not in handed_value yet, runs:
     * it passed its check already. After `from`, so the queue's error still says its
     * commands from `from` on ran: CU_WAITED_FAILED.) */
    uint64_t skip = (from > q->handed_value ? from : q->handed_value) + 1;
    if (!q->skipped || skip < q->skipped) __atomic_store_n(&q->skipped, skip, __ATOMIC_RELAXED);
    q->poisoned = from;
    q->cause_error = error;
    q->cause_value = value;
    q->cause = cause;
    /* Its signals in flight from there on fail once confirmed: their timelines fail now
     * (before their word writes land), so that a wait for those values handed over from
     * now on is not made (cuq_skip_failed), as for a signal passed. (t->mu under q->mu:
     * the timeline is kept while its signal is in flight, and nothing takes a cuda
     * queue's mu under a timeline's.) A command confirmed already through a waiter ran. */
    uint64_t seen = atomic_load(&q->timeline->value);
    for (size_t j = 0; j < q->count; j++) {
        const am_cuentry *e = &q->ring[(q->head + j) % q->cap];
        if (!e->signals || e->value < from || (seen != UINT64_MAX && e->value <= seen)) continue;
        uint64_t sure = cuq_sure(q, e->extra, e->value, e->extra_value);
        if (sure < e->extra_value) am_timeline_fail_from(e->extra, sure + 1, error, value, cause);
    }
    /* A record whose driver call is being made (pending) is marked as it is counted,
     * with no memory needed: its submitting thread passes the failure on if the wait was
     * made (cuq_wait_made), and keeps no record of it otherwise -- unmarked, a made wait
     * would be failed only once q settles. */
    size_t n = 0, i = 0;
    for (am_cuwaiter *w = q->waiters; w; w = w->next)
        if (w->target >= from && w->pending) w->failed = 1;
        else n += w->target >= from;
    am_cuwaiter *hit = n ? cuq_alloc(n * sizeof *hit) : NULL;  /* none: they fail at q's settling */
    for (am_cuwaiter *w = q->waiters; hit && w; w = w->next)
        if (w->target >= from && !w->pending) {
            hit[i++] = *w;
            atomic_fetch_add(&w->q->refs, 1);
        }
    /* A device wait it holds on the host (behind the commands handed over: past the
     * skip) is looked at again, as its kick would: most such waits are not held any
     * more (cuda_submit.c, cuq_wait_behind_skip), and held, one for a value nothing
     * produces would keep q from settling. */
    am_timeline *kick_on = q->deferred ? cuq_kick_ref(q) : NULL;
    pthread_mutex_unlock(&q->mu);
    if (kick_on) cuq_unkick(q, kick_on);
    for (size_t j = 0; j < i; j++) {
        cuq_poison(hit[j].q, hit[j].command, error, value, cause);
        cuq_unref(hit[j].q);
    }
    free(hit);
}

/* What q's timeline reached that was produced, under q->mu: its value, but below the
 * first failed one -- q's thread raises it through the failed commands it confirms
 * before q settles (cuq_run), failing it first (cuq_fail_timeline). UINT64_MAX once q
 * settled. (t->mu under q->mu: see cuq_poison.) */
static uint64_t cuq_produced(am_cuq *q) {
    am_timeline *t = q->timeline;
    uint64_t seen = atomic_load(&t->value);
    if (seen == UINT64_MAX) return seen;
    pthread_mutex_lock(&t->mu);
    if (t->failed_from && seen >= t->failed_from) seen = t->failed_from - 1;
    pthread_mutex_unlock(&t->mu);
    return seen;
}

/* Under other->mu: record a device wait of q (part of its command `command`) for value
 * `target` of other, forgetting those other has confirmed since. Returns 1 if other has
 * failed at or before `target` already (nothing recorded): then the caller, with
 * other->mu released, fails q from `command` on (cuda_submit.c, cuq_skip_from). */
int cuq_waited(am_cuq *q, am_cuq *other, uint64_t target, uint64_t command) {
    uint64_t failed = cuq_failed_at(other);
    if (failed && target >= failed) return 1;
    uint64_t confirmed = cuq_produced(other);
    for (am_cuwaiter **p = &other->waiters; *p;) {
        am_cuwaiter *w = *p;
        if (w->target <= confirmed && confirmed != UINT64_MAX) {
            *p = w->next;
            /* The last reference of w->q where it closed and its owner let go of it
             * (its records with other queues outlive it): freed here, under other->mu,
             * it takes its own mu and those of queues freed with it (cuq_free: waiters
             * dropped with `first` 0 take no other queue's mu) -- never other's, which
             * the caller references -- and none of those can be held elsewhere. */
            cuq_unref(w->q);
            free(w);
        } else {
            p = &w->next;
        }
    }
    am_cuwaiter *w = malloc(sizeof *w);
    if (!w) return 0;  /* not recorded: a failure of other would not reach this wait */
    *w = (am_cuwaiter){other->waiters, q, target, command, 1, 0};
    atomic_fetch_add(&q->refs, 1);
    other->waiters = w;
    return 0;
}

/* The driver call of q's device wait recorded with other (cuq_waited, pending) returned:
 * `made`, the driver took it. A failure of other at or before `target` that reached the
 * record meanwhile (its poison, settling or close: they pass a pending record by, marking
 * it failed) fails q from `command` on now if the wait was made, as it would have then;
 * refused, nothing of it runs, and its number goes to q's next command, which that
 * failure must not fail: the record goes, and nothing else holds it. A made wait's
 * record stays for a later failure, unless passed on here. Not under any queue's mu
 * (other's, then q's, are taken here). */
void cuq_wait_made(am_cuq *q, am_cuq *other, uint64_t target, uint64_t command, int made) {
    am_cuwaiter *gone = NULL;
    int failed = 0, error = 0;
    uint64_t value = 0;
    am_timeline *cause = NULL;
    pthread_mutex_lock(&other->mu);
    for (am_cuwaiter **p = &other->waiters; *p; p = &(*p)->next) {
        am_cuwaiter *w = *p;
        if (w->q == q && w->target == target && w->command == command && w->pending) {
            w->pending = 0;
            failed = w->failed;
            if (!made || failed) {
                *p = w->next;
                gone = w;
            }
            break;
        }
    }
    if (made && failed) cuq_cause(other, &error, &value, &cause);
    pthread_mutex_unlock(&other->mu);
    if (made && failed) cuq_poison(q, command, error, value, cause);
    if (!gone) return;
    cuq_unref(q);  /* (never the last reference: q is submitting) */
    free(gone);
}

/* Record with q that its command `command` waits on the device for value `target` of
 * `other` (handed to the driver, or about to be: before the command's end is), for its
 * thread to check before confirming that command (cuq_check_waiting). With no memory
 * for the record, nothing is checked: other's thread alone fails q, through its waiters,
 * once it confirms what failed. Not under any queue's mu. */
void cuq_waiting(am_cuq *q, am_cuq *other, uint64_t target, uint64_t command) {
    am_cuwaiter *w = malloc(sizeof *w);
    if (!w) return;
    atomic_fetch_add(&other->refs, 1);  /* (cuq_drop_waiting) */
    pthread_mutex_lock(&q->mu);
    *w = (am_cuwaiter){q->waiting, other, target, command};
    q->waiting = w;
    atomic_fetch_add(&q->nwaiting, 1);
    pthread_mutex_unlock(&q->mu);
}

/* Free a list of waiting records taken off their queue, letting go of the queues they
 * reference. Not under any queue's mu: the last reference frees that queue (cuq_free),
 * which takes its own mu to forget its waiters -- with `first` 0 none of their queues'
 * (cuq_drop_waiters) -- and lets go of the queues its records reference (waiting on it,
 * or waited on), each one freed so taking only its own mu in turn. */
void cuq_drop_waiting(am_cuwaiter *w) {
    while (w) {
        am_cuwaiter *next = w->next;
        cuq_unref(w->q);
        free(w);
        w = next;
    }
}

/* A look through the queues a queue waited on (cuq_check_waited_on), for one command's
 * confirmation: the queues looked through, each up to the value looked for (a second
 * look at one, to that value or below, finds nothing new), how many of their own waits
 * on further queues may still be followed, and how many of their records of such waits
 * may still be read -- past either (or beyond CU_CHAIN_SEEN queues, unmarked), a further
 * wait is checked once its own queue's thread confirms it, as before any look. So one
 * confirmation costs at most CU_CHAIN_READS records read and CU_CHAIN_WAITS looks,
 * however many waits the queues have in flight. */
#define CU_CHAIN_SEEN 32
#define CU_CHAIN_WAITS 64
#define CU_CHAIN_READS 1024
typedef struct {
    struct {
        const am_cuq *q;
        uint64_t target;
    } seen[CU_CHAIN_SEEN];
    size_t nseen;
    size_t left, reads;
} am_cuchain;

/* Whether other was looked through up to `target` already in this look (then not again);
 * else marked so. */
static int chain_seen(am_cuchain *c, const am_cuq *other, uint64_t target) {
    for (size_t i = 0; i < c->nseen; i++) {
        if (c->seen[i].q != other) continue;
        if (c->seen[i].target >= target) return 1;
        c->seen[i].target = target;
        return 0;
    }
    if (c->nseen < CU_CHAIN_SEEN) {
        c->seen[c->nseen].q = other;
        c->seen[c->nseen++].target = target;
    }
    return 0;
}

/* Under other->mu: copies of other's own waits on further queues made by its commands up
 * to `target` (each referencing its queue), as many as c lets; *n: how many. */
static am_cuwaiter *chain_deeper(am_cuchain *c, const am_cuq *other, uint64_t target,
                                 size_t *n) {
    *n = 0;
    if (!other->waiting || !c->left || !c->reads || chain_seen(c, other, target)) return NULL;
    am_cuwaiter *deeper = malloc(c->left * sizeof *deeper);
    for (const am_cuwaiter *w = other->waiting; deeper && w && *n < c->left && c->reads;
         w = w->next, c->reads--)
        if (w->command <= target) {
            deeper[(*n)++] = *w;
            atomic_fetch_add(&w->q->refs, 1);  /* (other's record keeps it until here) */
        }
    c->left -= *n;
    if (!*n) {
        free(deeper);
        return NULL;
    }
    return deeper;
}

/* Before q's thread confirms command `command`, which waited on the device for value
 * `target` of `other`: if other has, at or below `target`, a device wait on a timeline
 * no queue owns that it has not confirmed yet (a `waited` entry), for a value that
 * timeline has failed for already, other's thread will fail other from that wait on
 * once it confirms it (cuq_confirm_wait). That is done here now, on its behalf
 * (cuq_poison is done once: other's own confirmation later changes nothing), which
 * fails q from `command` on through other's waiters -- the value q waited for will
 * never be produced, whichever thread sees its event first. So is each device wait of
 * other's own on a further queue, made at or below `target` and not yet confirmed by
 * other's thread: checked the same way, on other's behalf, through any chain of such
 * waits (as far as c lets: am_cuchain). And if other is failing from `target` or before
 * already (poisoned: maybe by its own thread, which is still on its way to q through
 * other's waiters; failed with an error of its own, which it settles with; or closed,
 * abandoning what it had not confirmed), q fails from `command` on now too. So q does
 * not confirm the command as a success, nor raise other's timeline for it. A failure
 * recorded only after this look is the other thread's to pass on, as before. Not under
 * any queue's mu (other's, then t's, are taken here). */
static void cuq_check_waited_on(am_cuq *q, am_cuq *other, uint64_t target, uint64_t command,
                                am_cuchain *c) {
    int found = 0, error = 0;
    uint64_t from = 0, value = 0;
    am_timeline *cause = NULL;
    am_cuwaiter *deeper = NULL;
    size_t ndeeper = 0;
    pthread_mutex_lock(&other->mu);
    /* Closed: its entries may be gone and its timeline freed; its close marked where it
     * fails from (cuq_mark_failed: past what it confirmed), read below. */
    int closed = other->stop == 2;
    uint64_t seen = closed ? 0 : cuq_produced(other);
    if (!closed && seen != UINT64_MAX && seen >= target) {  /* confirmed: it was produced */
        pthread_mutex_unlock(&other->mu);
        return;
    }
    for (size_t i = 0; !closed && i < other->count && !found; i++) {
        const am_cuentry *e = &other->ring[(other->head + i) % other->cap];
        if (e->value > target) break;  /* (the ring is in command order) */
        if (!e->waited || !e->extra) continue;
        /* (t->mu under other->mu, as cuq_poison does; the entry's reference keeps t
         * while it is in the ring) */
        am_timeline *t = e->extra;
        pthread_mutex_lock(&t->mu);
        if (timeline_failed_for(t, e->extra_value)) {
            found = 1;
            from = e->value;
            error = t->fail_error;
            value = t->fail_value;
            cause = t->fail_cause;
        }
        pthread_mutex_unlock(&t->mu);
    }
    if (!closed) deeper = chain_deeper(c, other, target, &ndeeper);
    pthread_mutex_unlock(&other->mu);
    if (found) cuq_poison(other, from, error, value, cause);
    for (size_t i = 0; i < ndeeper; i++) {
        cuq_check_waited_on(other, deeper[i].q, deeper[i].target, deeper[i].command, c);
        cuq_unref(deeper[i].q);
    }
    free(deeper);
    pthread_mutex_lock(&other->mu);
    /* (Closed: its timeline is not read, and it confirms nothing any more.) */
    uint64_t failed = cuq_failed_at(other);
    seen = other->stop == 2 ? 0 : cuq_produced(other);
    int failing = failed && target >= failed && (seen == UINT64_MAX || seen < target);
    if (failing) cuq_cause(other, &error, &value, &cause);
    pthread_mutex_unlock(&other->mu);
    if (failing) cuq_poison(q, command, error, value, cause);
}

/* q's thread is about to confirm command `value` (its event says done): the records of
 * q's waits on other queues' values made by the commands up to it go, each checked first
 * (cuq_check_waited_on). They stay on q's list until checked: another queue's look at q
 * meanwhile (its own confirmation of a wait on q) follows them too (chain_deeper) --
 * taken off first, that look would find nothing of q's to follow, and pass, confirming
 * q's value through q's timeline before this check fails q. This thread alone takes
 * records off q's list (and cuq_stop, on it too; submitters push at its head): those
 * below the head read under mu stay, unchanged, for the walk without mu. Not under mu. */
static void cuq_check_waiting(am_cuq *q, uint64_t value) {
    if (!atomic_load(&q->nwaiting)) return;
    pthread_mutex_lock(&q->mu);
    am_cuwaiter *first = q->waiting;
    pthread_mutex_unlock(&q->mu);
    am_cuchain chain = {.nseen = 0, .left = CU_CHAIN_WAITS, .reads = CU_CHAIN_READS};
    int checked = 0;
    for (am_cuwaiter *w = first; w; w = w->next) {
        if (w->command > value) continue;
        if (!checked++) cuq_test_hook(CU_HOOK_WAITING_TAKEN, q);  /* (about to check) */
        cuq_check_waited_on(q, w->q, w->target, w->command, &chain);
    }
    if (!checked) return;
    am_cuwaiter *taken = NULL;
    pthread_mutex_lock(&q->mu);
    for (am_cuwaiter **p = &q->waiting; *p;) {
        am_cuwaiter *w = *p;
        if (w->command <= value) {
            *p = w->next;
            w->next = taken;
            taken = w;
            atomic_fetch_sub(&q->nwaiting, 1);
        } else {
            p = &w->next;
        }
    }
    pthread_mutex_unlock(&q->mu);
    cuq_drop_waiting(taken);
}

/* q's commands from `first` on (0: none) never run: abandoned by am_cuq_close (`error`
 * AM_ABANDONED), or never given to it before it closed (AM_CLOSED). It fails from there,
 * for the device waits on those values made from now on (stream_wait_queue). Under mu,
 * with stop 2. */
void cuq_mark_failed(am_cuq *q, uint64_t first, int error) {
    if (!first || (q->poisoned && q->poisoned <= first)) return;
    q->poisoned = first;
    q->cause_error = error;
    q->cause_value = first;
    q->cause = q->timeline;
}

/* Under q->mu: q's waiter records, taken off -- but those whose driver call is still
 * being made (pending) are left with q, marked failed if q's failure from `first` on
 * (0: none) reaches them: their submitting thread passes it on, and takes them off
 * (cuq_wait_made; it references q until then, so none is left at q's free). */
static am_cuwaiter *cuq_take_waiters(am_cuq *q, uint64_t first) {
    am_cuwaiter *taken = NULL, **kept = &q->waiters;
    for (am_cuwaiter *w = q->waiters, *next; w; w = next) {
        next = w->next;
        if (w->pending) {
            w->failed |= first && w->target >= first;
            *kept = w;
            kept = &w->next;
        } else {
            w->next = taken;
            taken = w;
        }
    }
    *kept = NULL;
    return taken;
}

/* Abandoned: the device waits on those commands made before fail their queues' commands from
 * that wait on (cuq_poison) -- those whose stream goes on once the abandoned command ran
 * anyway (a close raises the words it waited on) ran on data never produced -- unless
 * that wait's command was confirmed already: the command it waited for ran. And q
 * forgets its waiters (all it does with `first` 0), but those pending (cuq_take_waiters).
 * Not under mu. */
void cuq_abandon_waiters(am_cuq *q, uint64_t first) {
    pthread_mutex_lock(&q->mu);
    am_cuwaiter *w = cuq_take_waiters(q, first);
    pthread_mutex_unlock(&q->mu);
    while (w) {
        am_cuwaiter *next = w->next;
        if (first && w->target >= first) {
            /* (w->q's timeline only while w->q is open: a closed one's may be freed) */
            pthread_mutex_lock(&w->q->mu);
            int open = w->q->stop != 2;  /* (closing to finish: its closer holds it) */
            uint64_t confirmed = open ? atomic_load(&w->q->timeline->value) : UINT64_MAX;
            pthread_mutex_unlock(&w->q->mu);
            if (confirmed < w->command)
                cuq_poison(w->q, w->command, AM_ABANDONED, first, q->timeline);
        }
        cuq_unref(w->q);
        free(w);
        w = next;
    }
}

/* The queue failed and settled (its timeline at UINT64_MAX): the stream will never write
 * the word for the failed values, so release other queues' device waits on them (they
 * would block forever: a refused held command is no sticky error that fails their
 * streams too) -- after failing the commands of those that waited for a failed value
 * (cuq_poison), which then run on data that was never produced. After the timeline, so
 * that a releasing queue's confirmation raises nothing. Not under mu. */
static void cuq_release_waiters(am_cuq *q) {
    int error;
    uint64_t value;
    am_timeline *cause;
    pthread_mutex_lock(&q->mu);
    uint64_t failed = cuq_failed_at(q);
    cuq_cause(q, &error, &value, &cause);
    am_cuwaiter *w = cuq_take_waiters(q, failed);
    pthread_mutex_unlock(&q->mu);
    while (w) {
        am_cuwaiter *next = w->next;
        if (failed && w->target >= failed) cuq_poison(w->q, w->command, error, value, cause);
        cuq_unref(w->q);
        free(w);
        w = next;
    }
    raise_word(q->word, AM_WORD_RELEASED);
    timeline_kick(q->timeline);  /* waits held for it: they go to the driver (and pass) */
    host_signalled();
}

/* A failed queue about to settle: its timeline fails from its first failed value (past
 * what it confirmed), with the failure behind it (cuq_cause), before it goes to
 * UINT64_MAX. A wait on it by a queue of another kind -- a cpu or npy queue's thread
 * (host_queues.c), which reads the timeline's failure, not q's -- then fails its
 * queue's commands from that wait on, as a cuda queue's wait does (cuq_poison), rather
 * than let them run on data never produced. (A cuda queue's own completions read q's
 * error, not this.) Not under mu. */
static void cuq_fail_timeline(am_cuq *q) {
    int error;
    uint64_t failed, value;
    am_timeline *cause;
    cuq_cause_now(q, &failed, &error, &value, &cause);
    if (!failed) return;
    uint64_t reached = atomic_load(&q->timeline->value);
    if (reached == UINT64_MAX) return;  /* settled already */
    if (failed <= reached) failed = reached + 1;  /* (confirmed through a waiter: it ran) */
    am_timeline_fail_from(q->timeline, failed, error, value, cause);
}

/* q failing behind a failed wait (poisoned), with nothing in flight, holds the rest of
 * its commands on the host behind a device wait held for what it waits for -- a wait
 * that orders a later signal of a shared timeline after another queue's lower one
 * (cuda_submit.c, cuq_wait_behind_skip), which may come only once the program saw this
 * failure (a gate it raises then). Each held command is past the skip, so can only fail:
 * q's timeline fails from its first failed value and rises through them now, as for
 * the failed commands confirmed (cuq_run) -- their awaits raise at once, as a host
 * queue's do. What they hold stays held, and is handed over, and confirmed, failed, as
 * the hold ends (q->failed_through: confirmations at or below it fail although the
 * timeline got there): a signal among them fails its timeline only then, after the
 * lower value, which the timeline still gets first. Looked at wherever that state may
 * come last: a held wait put back (cuq_drain, cuq_submit_then), a failed command
 * confirmed (cuq_run, through cuq_drain). Its stream is not past them until this
 * thread confirmed them (the hold may end with the lower signal handed over behind a
 * device wait that never ends): a close asks am_cuq_reached (cuda_submit.c) where it
 * is instead of reading the timeline, and abandons q where what it waits for never
 * runs. Nothing to
 * take mu for on a queue that never failed so (q->skipped: set with q->poisoned, read
 * without mu as the hand-overs do) -- every drain looks. Not under mu. */
void cuq_report_held(am_cuq *q) {
    if (!__atomic_load_n(&q->skipped, __ATOMIC_RELAXED)) return;
    pthread_mutex_lock(&q->mu);
    uint64_t skipped = __atomic_load_n(&q->skipped, __ATOMIC_RELAXED);
    uint64_t through = q->held_tail ? q->held_tail->value : 0;
    int report = q->poisoned && q->deferred && !q->count && q->held && q->stop != 2 &&
                 skipped && q->held->value >= skipped && through > q->failed_through;
    if (report) q->failed_through = through;
    pthread_mutex_unlock(&q->mu);
    if (!report) return;
    cuq_fail_timeline(q);
    am_timeline_poke(q->timeline, through);
}

/* A failed queue with nothing left in flight or held settles: its timeline (failed from
 * its first failed value) and word at UINT64_MAX, other queues' waits on it released.
 * Not under mu. */
void cuq_settle(am_cuq *q) {
    cuq_fail_timeline(q);
    am_timeline_poke(q->timeline, UINT64_MAX);
    cuq_release_waiters(q);
}

/* Whether cuq_drain hands over the first held operation (under mu): while the stream has
 * room; `through` a value, while that command is not handed over yet, room or not. */
static int cuq_drains(const am_cuq *q, uint64_t through) {
    if (!through) return cuq_can_drain(q);
    return q->held && !q->driving && !q->deferred && q->stop != 2 && q->submitted < through;
}

/* Hand held operations to the driver while the stream has room (through 0), or up to
 * command `through`; `most` operations at most (0: no limit). Runs on the completion
 * thread, or on another between cuq_enter and cuq_leave: the context is current. A
 * device wait that must not reach the driver yet goes back, first, and stops it
 * (q->deferred). */
void cuq_drain(am_cuq *q, uint64_t through, int most) {
    int ops = 0;
    am_cuop *dropped = NULL;
    int refused = 0;
    uint64_t refused_value = 0;
    pthread_mutex_lock(&q->mu);
    while (cuq_drains(q, through) && (!most || ops++ < most)) {
        am_cuop *op = q->held;
        q->held = op->next;
        if (!q->held) q->held_tail = NULL;
        q->nheld--;
        q->driving = 1;
        uint64_t handed = q->handed_value;
        q->handed_value = op->value;
        pthread_mutex_unlock(&q->mu);
        cuq_test_hook(CU_HOOK_DRAIN_HANDING, q);
        int r = cuq_run_op(q, op);
        if (r == CU_DEFERRED) {
            pthread_mutex_lock(&q->mu);
            q->handed_value = handed;  /* (not handed over after all) */
            cuq_undrive(q);
            op->next = NULL;
            cuq_hold_first(q, op);
            if (q->discarded || q->error) {  /* discarded or failed meanwhile: it goes */
                int discarded = q->discarded;
                pthread_mutex_unlock(&q->mu);
                if (discarded) am_cuq_discard(q); else cuq_drop_failed(q);
                pthread_mutex_lock(&q->mu);
            }
            continue;
        }
        /* Refused: what this command handed over before may still run; the queue settles
         * only once the stream is past it (an event behind it, waited for, that fails).
         * A signal's end refused (its event record): the timeline it was to raise fails
         * too, or its waiters would wait for good -- with the fence, once the stream is
         * past the signal's word write (handed over before), which would otherwise land
         * on the failed timeline's word; a fence refused too is tried again, the signal
         * kept for it (q->unfenced, cuq_unfence, cuq_refence); refused for good
         * (cu_fence_final: sticky, or the context or the stream gone), now, as those
         * dropped below. */
        int signals = cuop_signals(op), fenced = 0, unfenced = 0, kept = 0;
        if (r && __atomic_load_n(&q->stop, __ATOMIC_SEQ_CST) != 2) {
            /* (not once abandoned: the stream may be destroyed; the call reported stays
             * the refused one, not the fence's) */
            int call = __atomic_load_n(&q->failed_call, __ATOMIC_RELAXED);
            pthread_mutex_lock(&q->mu);  /* failed before the fence's confirmation can come */
            if (!q->error) { q->error = r; q->error_value = op->value; }
            pthread_mutex_unlock(&q->mu);
            if (signals) cuq_fail_signal_now(q, op, r, op->value, q->timeline);
            int f = cuq_finish(q, op->value, signals ? op->extra : NULL,
                               signals ? op->extra_value : 0, 0, CU_FINISH_FENCE);
            fenced = !f;
            unfenced = f && !cu_fence_final(f);
            __atomic_store_n(&q->failed_call, call, __ATOMIC_RELAXED);
        }
        pthread_mutex_lock(&q->mu);
        cuq_undrive(q);
        if (unfenced) kept = cuq_unfence(q, op->value, signals ? op : NULL) && signals;
        if (r) {
            dropped = cuq_refused(q, op->value, r);
            refused = r;
            refused_value = op->value;
            if (signals && !fenced && !kept && q->stop != 2) {
                op->next = dropped;
                dropped = op;
                op = NULL;
            }
        }
        if (op) cuop_free(op);
    }
    /* Refused with nothing left in flight: settle the waiters now (they find the error).
     * Not once abandoned: the closer may have returned (this thread orphaned) and the
     * caller freed the timeline. Nor while another thread hands operations over: a
     * command refused in part has failed q before its fence is handed over (cuq_submit_then),
     * and that thread, or the fence's confirmation, settles q. */
    int settle = q->error && !q->count && !q->held && !q->unfenced && !q->driving &&
                 q->stop != 2;
    if (q->unfenced && q->sleeping) pthread_cond_signal(&q->cv);  /* its thread tries again */
    pthread_mutex_unlock(&q->mu);
    cuq_drop_refused(q, dropped, refused, refused_value);
    if (settle) cuq_settle(q);
    cuq_report_held(q);
}

/* The fence behind a refused command part of which the driver has (cuda_submit.c,
 * cuq_submit_then; cuq_drain) was refused too, or none was recorded for lack of host
 * memory (cuq_no_memory): nothing shows the stream past that part,
 * which may still run (a kernel writing a buffer), so q does not settle -- its commands
 * are not reported failed, nor their buffers handed back -- until a fence is recorded
 * behind it and confirmed. This thread, with nothing else in flight, records it again
 * after a nap (1 ms, doubling up to CU_NAP_CHUNK_NS): once the driver takes it, the
 * queue settles at its confirmation, as for a fence recorded at once. A refusal no try
 * cures (cu_fence_final) settles q now, and fails the signal kept for the fence: sticky,
 * or the context gone, nothing of the context runs any more; a stream its owner
 * destroyed runs on what the driver has of it, but no fence can show when that is
 * done. With nothing in flight, the ring has room for the fence: recording it needs no
 * host memory (were it short anyway, -1 is tried again as a refusal is). Abandoned
 * (am_cuq_close), q stops trying. `nap`: this thread's, kept across tries. Not under
 * mu. */
static void cuq_refence(am_cuq *q, long *nap) {
    pthread_mutex_lock(&q->mu);
    struct timespec until;
    deadline_after(&until, *nap);
    if (q->stop != 2) am_cond_timedwait(&q->cv, &q->mu, &until);
    uint64_t value = q->unfenced, extra_value = q->unfenced_extra_value;
    am_timeline *extra = q->unfenced_extra;  /* the refused command's signal, if any */
    int go = value && !q->count && !q->driving && q->stop != 2;
    if (go) q->driving = 1;  /* an abandon's close waits for the fence's driver calls */
    pthread_mutex_unlock(&q->mu);
    if (!go) return;
    int call = __atomic_load_n(&q->failed_call, __ATOMIC_RELAXED);
    /* With the signal: its confirmation fails that timeline (cuq_run), as a fence
     * recorded at once does. */
    int r = cuq_finish(q, value, extra, extra_value, 0, CU_FINISH_FENCE);
    __atomic_store_n(&q->failed_call, call, __ATOMIC_RELAXED);  /* the refused one */
    pthread_mutex_lock(&q->mu);
    cuq_undrive(q);
    int settle = 0, fail_signal = 0, error = 0, cleared = 0;
    uint64_t failed_value = 0;
    am_timeline *cause = NULL;
    if (!r || cu_fence_final(r)) {
        if (q->unfenced_extra == extra) {  /* (else one kept meanwhile: a fence carries it) */
            q->unfenced = 0;
            q->unfenced_extra = NULL;
            cleared = extra != NULL;
        }
        settle = r && !q->count && !q->held && q->stop != 2;
        fail_signal = r && extra && q->stop != 2;  /* (no fence: it fails now) */
        cuq_cause(q, &error, &failed_value, &cause);
        *nap = 1000000;
    } else if (*nap < CU_NAP_CHUNK_NS) {
        *nap *= 2;
    }
    pthread_mutex_unlock(&q->mu);
    if (fail_signal) am_timeline_fail(extra, extra_value, error, failed_value, cause);
    if (cleared) timeline_unref(extra);  /* (cuq_unfence's: a fence recorded holds its own) */
    if (settle) cuq_settle(q);
}

/* Command `value` of q, part of which the driver has, got no fence behind it (refused,
 * not sticky, or no host memory for it): q settles only once one is recorded and
 * confirmed (q->unfenced, cuq_refence). Its signal `signal` (its end, if it raises a
 * timeline, else NULL) is kept for that fence: the signal's word write reached the
 * driver before, and may still land, so its timeline fails only at the fence's
 * confirmation, once the stream is past the write (cuq_run) -- failed at once, a wait
 * released by the failure could see the word lowered by the write after (a store), and
 * the word's memory could be let go with the write on its way. The timeline is marked
 * failed before (cuq_fail_signal_now): a wait handed over from then on is not made.
 * Abandoned first (am_cuq_close), q leaves it as it leaves its signals in flight.
 * Returns whether the signal is kept (0 with none, or another command's kept: one
 * refused command at most gets here, as a failed queue takes nothing more, but were
 * there two, the caller fails this one's timeline at once, as before). Under mu. */
int cuq_unfence(am_cuq *q, uint64_t value, const am_cuop *signal) {
    if (!q->unfenced || value < q->unfenced) q->unfenced = value;
    if (!signal || q->unfenced_extra) return 0;
    /* Kept until the fence is recorded, or the signal fails without one (cuq_refence,
     * cuq_no_context, cuq_stop): the queue may settle meanwhile -- a command before it
     * fails once confirmed -- and Python then lets go of the timeline. */
    atomic_fetch_add(&signal->extra->refs, 1);
    q->unfenced_extra = signal->extra;
    q->unfenced_extra_value = signal->extra_value;
    return 1;
}

/* A device wait of q on the word of a timeline no queue owns, done on the stream: it is
 * confirmed once the timeline's value got there too -- its signal confirmed, or a host
 * signal -- and fails q's commands from there on if the timeline failed instead (the
 * word was raised for a value never produced). Not under mu. */
static void cuq_confirm_wait(am_cuq *q, const am_cuentry *e) {
    am_timeline *t = e->extra;
    pthread_mutex_lock(&t->mu);
    while (atomic_load(&t->value) < e->extra_value && !timeline_failed_for(t, e->extra_value) &&
           __atomic_load_n(&q->stop, __ATOMIC_SEQ_CST) != 2) {
        struct timespec until;
        deadline_after(&until, CU_NAP_CHUNK_NS);  /* an abandon is seen */
        am_cond_timedwait(&t->cv, &t->mu, &until);
    }
    uint64_t failed = t->failed_from, value = t->fail_value;
    int error = t->fail_error;
    am_timeline *cause = t->fail_cause;
    pthread_mutex_unlock(&t->mu);
    if (failed && e->extra_value >= failed) cuq_poison(q, e->value, error, value, cause);
}

/* q's signal `op` (a command's end that raises a timeline) is known to fail before it
 * is handed over: its command was passed behind a failed wait (cuda_submit.c, cuq_run_op)
 * or refused by the driver (cuq_drain). Its timeline fails now, with the failure behind
 * it -- before the hand-over releases the device waits held for the signal, which then
 * find the timeline failed and run nothing behind them (cuq_skip_failed) -- from the
 * value after the last one it is sure to get: what it reached, what a signal of q's in
 * flight before this one raises it to, which is confirmed first, in q's order (unless
 * it is known to fail: passed, or after a device wait found failed), or what another
 * queue's signal handed over before this one raises it to (a queue's signal after
 * another queue's pending one waits for it first, and so comes to its hand-over only
 * once that one was handed over: t->handed). One of those that fails lowers that
 * (am_timeline_fail). The signal's confirmation then settles it (cuq_fail_signal). Not
 * under mu. */
void cuq_fail_signal_now(am_cuq *q, const am_cuop *op, int error, uint64_t value,
                         am_timeline *cause) {
    pthread_mutex_lock(&q->mu);
    cuq_fail_signal_held(q, op, error, value, cause);
    pthread_mutex_unlock(&q->mu);
}

/* cuq_fail_signal_now, under q->mu (t->mu under it: see cuq_poison). */
void cuq_fail_signal_held(am_cuq *q, const am_cuop *op, int error, uint64_t value,
                          am_timeline *cause) {
    uint64_t before = q->skipped && q->skipped < op->value ? q->skipped : op->value;
    uint64_t sure = cuq_sure(q, op->extra, before, op->extra_value);
    if (sure < op->extra_value) am_timeline_fail_from(op->extra, sure + 1, error, value, cause);
}

/* The failure a failed command of q passes on to the timeline it signals. Under mu. */
static void cuq_fail_signal(am_cuq *q, const am_cuentry *e) {
    int error;
    uint64_t value;
    am_timeline *cause;
    cuq_cause(q, &error, &value, &cause);
    pthread_mutex_unlock(&q->mu);
    am_timeline_fail(e->extra, e->extra_value, error, value, cause);
    pthread_mutex_lock(&q->mu);
}

/* Wake the loops awaiting e (its queue's timeline, a timeline it signals) ahead of its
 * end, asking them to stay awake until `until`. Not once abandoned (the closer may have
 * returned and the caller freed the timelines): the caller checks stop. */
static void cuq_near(am_cuq *q, const am_cuentry *e, int64_t until) {
    am_timeline_near(q->timeline, e->value, until);
    if (e->extra && !e->waited) am_timeline_near(e->extra, e->extra_value, until);
}

/* The completion thread could not make q's context current (cuCtxSetCurrent refused
 * it, `r`): it can neither ask the driver about q's events -- the queries would fail,
 * or be asked of another context -- nor hand held operations over. So q fails, with
 * that refusal (its failed call: cuCtxSetCurrent), from the first command it did not
 * confirm: those handed to the driver fail unconfirmed, as they come (a submission may
 * be under way), what is held is dropped, each signal among them failing its timeline,
 * and q settles, taking nothing more; a close ends as for any failed queue. (What the
 * driver has of those commands may still run, unseen: a context the driver will not
 * make current is destroyed or lost, and runs nothing, as after a sticky error.)
 * Returns under mu once q is stopping (am_cuq_close). */
static void cuq_no_context(am_cuq *q, int r) {
    pthread_mutex_lock(&q->mu);
    uint64_t first = q->count ? q->ring[q->head].value : q->submitted + 1;
    uint64_t seen = atomic_load(&q->timeline->value);  /* confirmed through waiters */
    if (seen != UINT64_MAX && first <= seen) first = seen + 1;
    if (!q->error || first < q->error_value) {
        q->error = r;
        q->error_value = first;
        cuq_fail(q, CU_CTX_SET, r);
    }
    int settled = 0;
    while (q->stop != 2) {
        am_cuop *dropped = NULL;
        int unkick = 0, failed = 0, error;
        uint64_t value;
        am_timeline *kick_on = NULL, *cause, *extra;
        uint64_t extra_value;
        if (q->held && !q->driving) {  /* (a thread handing some over: once it is done) */
            unkick = q->deferred;  /* a held wait's kick goes too (as am_cuq_discard's) */
            kick_on = unkick ? cuq_kick_ref(q) : NULL;
            dropped = cuq_refused(q, first, r);
        }
        while (q->count) {
            am_cuentry e = q->ring[q->head];
            q->head = (q->head + 1) % q->cap;
            q->count--;
            atomic_fetch_sub(&q->pending, 1);
            cuq_recycle(q, e.event, e.blocking);
            if (e.signals) cuq_fail_signal(q, &e);  /* (releases mu meanwhile) */
            if (e.extra) timeline_unref(e.extra);
            failed = 1;
        }
        extra = q->unfenced_extra;  /* (taken in the hold that clears it) */
        extra_value = q->unfenced_extra_value;
        q->unfenced = 0;  /* (no fence can be recorded: its signal fails now) */
        q->unfenced_extra = NULL;
        cuq_cause(q, &error, &value, &cause);
        int settle = (!settled || failed || dropped || extra) && !q->driving && q->stop != 2;
        pthread_mutex_unlock(&q->mu);
        if (unkick) cuq_unkick(q, kick_on);
        cuq_drop_refused(q, dropped, error, value);
        if (extra) {
            am_timeline_fail(extra, extra_value, error, value, cause);
            timeline_unref(extra);  /* (cuq_unfence's) */
        }
        if (settle) {
            cuq_settle(q);
            settled = 1;
        }
        pthread_mutex_lock(&q->mu);
        if (q->stop == 1 && !q->count && !q->held && !q->driving && !q->unfenced_extra &&
            settled)
            break;
        if (q->count || (q->held && !q->driving) || (!settled && !q->driving) ||
            q->unfenced_extra)
            continue;
        /* Woken by a command handed over (cuq_finish), a close, or a thread done handing
         * operations over while closing (cuq_undrive); what such a thread put back held
         * otherwise is seen within a nap. */
        struct timespec until;
        deadline_after(&until, CU_NAP_CHUNK_NS);
        q->sleeping = 1;
        am_cond_timedwait(&q->cv, &q->mu, &until);
        q->sleeping = 0;
    }
}

/* The completion thread stops, under mu. An abandoned queue's closer may have given up
 * waiting for this thread (it was blocked on an event that never completes): then it
 * frees the queue. Once events lent to a stream's wait are given back, and another
 * thread handing operations over (a kick's) is done with its driver calls, no thread
 * uses the queue's events or its stream any more; abandoned, one it put back held
 * (deferred) after the closer dropped them goes too. */
static void *cuq_stop(am_cuq *q) {
    while (q->lends || q->driving) pthread_cond_wait(&q->cv, &q->mu);
    cuq_drop_held(q);
    cuq_destroy_events(q);
    /* (abandoned with a signal kept for a fence: left as its signals in flight are) */
    if (q->unfenced_extra) timeline_unref(q->unfenced_extra);
    q->unfenced_extra = NULL;
    /* Its waits on other queues' values are checked no more (nothing is confirmed). */
    am_cuwaiter *waiting = q->waiting;
    q->waiting = NULL;
    atomic_store(&q->nwaiting, 0);
    q->exited = 1;
    int orphan = q->orphan;
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&q->mu);
    cuq_drop_waiting(waiting);  /* (before the orphan's last reference of q goes) */
    if (orphan) cuq_unref(q);
    return NULL;
}

/* Whether a device wait on t's word for `target` can be released by a host signal only
 * now: the word below it, and no device write of it handed over (t->handed). */
static int host_only(am_timeline *t, uint64_t target) {
    return atomic_load(t->word) < target && atomic_load(&t->handed) < target;
}

static void *cuq_run(void *arg) {
    am_cuq *q = arg;
    am_name_thread("asyncmetal-cuda");  /* a cuda queue's completion thread */
    cuq_test_hook(CU_HOOK_RUN_START, q);
    int set = ((int (*)(void *))cu_funcs[CU_CTX_SET])(q->ctx);
    if (set) {
        cuq_no_context(q, set);
        return cuq_stop(q);
    }
#ifdef PR_SET_TIMERSLACK
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);  /* naps end on time: 1 us, not 50 */
#endif
    int (*query)(void *) = (int (*)(void *))cu_funcs[CU_EVENT_QUERY];
    int (*sync)(void *) = (int (*)(void *))cu_funcs[CU_EVENT_SYNC];
    long fence_nap = 1000000;  /* before recording a refused fence again (cuq_refence) */
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
        /* (Stopping, with work held behind a deferred wait: that wait's kick, or an
         * abandon, comes first; with a command another thread hands over now -- a kick's,
         * cuq_hand_over -- that one.) */
        while (q->count == 0 && !cuq_can_drain(q) && !q->unfenced &&
               (!q->stop || (q->stop == 1 && (q->held || q->driving)))) {
            q->sleeping = 1;  /* submissions signal the condition only then */
            pthread_cond_wait(&q->cv, &q->mu);
            q->sleeping = 0;
        }
        if (q->stop == 2 ||
            (q->stop && q->count == 0 && !q->held && !q->driving && !q->unfenced))
            break;
        if (q->count == 0 && q->unfenced && !q->driving) {
            pthread_mutex_unlock(&q->mu);
            cuq_refence(q, &fence_nap);
            continue;
        }
        if (q->count == 0) {
            pthread_mutex_unlock(&q->mu);
            cuq_drain(q, 0, 0);
            continue;
        }
        am_cuentry e = q->ring[q->head];
        /* Napped until its expected end, and never seen unfinished after: how long it
         * ran is known only to be at most what it seems (it may have ended long before
         * this thread looked), which must not raise the estimate (or the naps would
         * end later and later). */
        int napped = 0, running = 0, coarse = 0;
        int64_t seen_at = 0;  /* the last time the event said unfinished */
        int64_t near_at = 0, near_until = 0;  /* when to wake its loops ahead (0: not), until */
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
            int64_t t = now_ns();
            /* A timed command expected to run a while longer: nap until shortly before
             * it should be done, then poll through its expected end (a little past it),
             * so that neither an interrupt nor a nap's wake-up comes after it. The naps
             * are an eighth of the expected run at most, with a look at the event after
             * each: a command far shorter than the ones before it is seen within an
             * eighth of their run, and teaches the estimate so. */
            int64_t est = e.timed ? q->est_ns : 0;  /* (this thread writes both) */
            int64_t start = e.pushed_ns > q->last_done_ns ? e.pushed_ns : q->last_done_ns;
            r = CU_ERROR_NOT_READY;
            if (est) {
                /* Woken this long before the expected end: a margin, a 128th of the run
                 * (its jitter), and how late this thread's naps end (a VM's timers). */
                int64_t lead = CU_NAP_LEAD_NS + est / 128 + q->nap_late_ns;
                int64_t due = start + est, wake = due - lead;
                int64_t most = est / 8 > CU_NAP_MIN_NS ? est / 8 : CU_NAP_MIN_NS;
                if (most > CU_NAP_CHUNK_NS) most = CU_NAP_CHUNK_NS;
                while (wake - t > CU_NAP_MIN_NS - CU_NAP_LEAD_NS &&
                       !__atomic_load_n(&q->stop, __ATOMIC_SEQ_CST)) {
                    atomic_fetch_add(&q->queries, 1);
                    if ((r = query(e.event)) != CU_ERROR_NOT_READY) {
                        coarse = napped;  /* it ended during the last nap, when exactly unknown */
                        break;
                    }
                    seen_at = t;
                    int64_t nap = wake - t < most ? wake - t : most;
                    if (kick_nap((long)nap, kicks)) break;  /* a host signal: poll now */
                    napped = 1;
                    int64_t after = now_ns(), late = after - (t + nap);
                    late = late < 0 ? 0 : late > CU_MAX_NAP_LATE_NS ? CU_MAX_NAP_LATE_NS : late;
                    q->nap_late_ns += (late - q->nap_late_ns) / 4;
                    t = after;
                }
                t = now_ns();
                int64_t late = est / 16 < CU_LATE_POLL_NS ? est / 16 : CU_LATE_POLL_NS;
                if (due + late - t > spin) spin = (long)(due + late - t);
                if (napped && r == CU_ERROR_NOT_READY && est >= CU_NEAR_MIN_NS) {
                    /* Napped through a long one: the loops awaiting it have likely slept
                     * as long. Woken shortly before its end (below, while polling), they
                     * are awake when it ends. */
                    near_at = due - CU_NEAR_LEAD_NS;
                    near_until = due + late;
                }
            }
            int64_t deadline = r == CU_ERROR_NOT_READY ? t + spin : t;
            /* Work a kick released (a host signal just let a held wait go): polled for
             * a while, as a wait a host signal releases on the device is. */
            int64_t kicked_until = atomic_load(&q->poll_until);
            if (r == CU_ERROR_NOT_READY && kicked_until > deadline) deadline = kicked_until;
            int64_t last = t - CU_POLL_GAP_NS;
            while (t < deadline) {
                int64_t since = t - last;
                if (since >= CU_POLL_GAP_NS ||
                    (since >= CU_POLL_QUIET_NS && !atomic_load(&q->shared) &&
                     atomic_load(&q->submitting) == 0)) {
                    atomic_fetch_add(&q->queries, 1);
                    if ((r = query(e.event)) != CU_ERROR_NOT_READY) break;
                    running = 1;
                    seen_at = last = t;
                    if (near_at && t >= near_at) {
                        near_at = 0;
                        if (!__atomic_load_n(&q->stop, __ATOMIC_SEQ_CST)) cuq_near(q, &e, near_until);
                    }
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
                        nap = nap < 20000 ? 20000 : nap > CU_NAP_MAX_NS ? CU_NAP_MAX_NS : nap;
                        /* A device wait only a host signal can release now: nothing to
                         * look for until a kick (counted first, then checked: a hand-over
                         * or a host queue's raise of the word after the check kicks). One
                         * a device write handed over already releases is no napper of t:
                         * counted, each later hand-over of a signal of t (a pipeline's)
                         * would kick every napping thread of the process, to poll. */
                        am_timeline *t = e.waited && e.extra && e.extra->word &&
                                         host_only(e.extra, e.extra_value) ? e.extra : NULL;
                        if (t) {
                            atomic_fetch_add(&t->nappers, 1);
                            if (host_only(t, e.extra_value)) {
                                nap = CU_NAP_MAX_NS;
                            } else {
                                atomic_fetch_sub(&t->nappers, 1);
                                t = NULL;
                            }
                        }
                        int kicked = kick_nap(nap, kicks);
                        /* (a kick that left it so: another timeline's signal, not a
                         * reason to poll this one) */
                        int held = t && host_only(t, e.extra_value);
                        if (t) atomic_fetch_sub(&t->nappers, 1);
                        if (kicked) {
                            kicks = atomic_load(&kick_gen);
                            atomic_fetch_add(&q->kicked, 1);
                        }
                        /* Released: kicked, or -- a napper whose nap ended as the word
                         * rose, before the kick of what raised it (a queue's signal
                         * kicks after its driver calls) -- seen here. The device is
                         * past the wait within microseconds: poll, as after a kick,
                         * rather than nap on the long schedule. */
                        if ((kicked || t) && !held) {
                            polling_until = now_ns() + CU_KICK_POLL_NS;
                            cuq_test_hook(CU_HOOK_NAP_RELEASED, q);
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
        if (!r) cuq_check_waiting(q, e.value);
        if (!r && e.waited) cuq_confirm_wait(q, &e);
        pthread_mutex_lock(&q->mu);
        if (q->count == 0 || q->stop == 2) {  /* abandoned (am_cuq_close) meanwhile */
            if (q->stop == 2) break;
            pthread_mutex_unlock(&q->mu);
            continue;
        }
        q->head = (q->head + 1) % q->cap;
        q->count--;
        if (!r) {  /* learn the run time: from the later of its hand-over and the last end */
            int64_t done = now_ns();
            int64_t start = e.pushed_ns > q->last_done_ns ? e.pushed_ns : q->last_done_ns;
            if (e.timed) {
                /* Seen done only by a look after a nap: it ran at least until seen_at,
                 * maybe a nap less than it seems. The estimate falls to that lower
                 * bound (the next command is then polled for from earlier, and its end
                 * seen exactly); rising, from an end seen while polling, is slow. */
                int64_t run = (coarse ? (seen_at > start ? seen_at : start) : done) - start;
                if (!q->est_ns || run < q->est_ns) q->est_ns = run > 0 ? run : 1;
                else if (running && !coarse) q->est_ns += (run - q->est_ns) / 8;
            }
            q->last_done_ns = done;
        }
        atomic_fetch_sub(&q->pending, 1);
        /* Confirmed already, by a queue of this context that waited for it on the device
         * and succeeded after it: an error seen now (a sticky one) came after. */
        uint64_t seen = atomic_load(&q->timeline->value);
        if (r && seen != UINT64_MAX && e.value <= seen) r = 0;
        if (e.fence && !r) r = q->error ? q->error : -2;  /* the refused command fails */
        uint64_t failed_from = e.value;
        if (!r && q->poisoned && e.value >= q->poisoned &&
            (e.value > seen || e.value <= q->failed_through)) {
            /* It ran after a wait for a value never produced (or, behind a failed wait
             * held on the host, passed without running): it fails, and the queue
             * settles once its stream is past everything it was given. Its failure is
             * reported now, as a host queue's is: the timeline fails from the first
             * failed value (cuq_fail_timeline, which am_cuq_error reports before q's
             * error is set), then rises to this one -- the stream is past it, and what
             * follows may wait for what only the program does once it saw this fail
             * (a later signal ordered after another queue's, held behind a gate). */
            if (q->count || q->held) {
                cuq_recycle(q, e.event, e.blocking);
                if (e.signals) cuq_fail_signal(q, &e);
                if (e.extra) timeline_unref(e.extra);
                pthread_mutex_unlock(&q->mu);
                cuq_fail_timeline(q);
                am_timeline_poke(q->timeline, e.value);
                cuq_drain(q, 0, 0);  /* (and cuq_report_held) */
                continue;
            }
            r = q->skipped && q->skipped <= q->poisoned ? CU_HELD_FAILED : CU_WAITED_FAILED;
            failed_from = q->poisoned;
        }
        if (r && (!q->error || failed_from < q->error_value)) {
            q->error = r;
            q->error_value = failed_from;
        }
        cuq_recycle(q, e.event, e.blocking);
        if (r && e.signals) cuq_fail_signal(q, &e);
        /* A failed command settles every later one; else, once a refused held command
         * has nothing left in flight before it, the same (not while another thread hands
         * operations over: see cuq_drain). What q holds of those later commands is
         * handed over below, and refused (a failed command's error is sticky) -- but
         * behind a device wait held for what it waits for, it would stay held until
         * that came, maybe never, its signals' waiters and a close to finish waiting
         * meanwhile: then it goes now, with the wait's kick, as a refused command's
         * does (a signal among it fails its timeline); a wait another thread hands over
         * now goes as that thread puts it back held (cuq_drop_failed). */
        am_timeline *kick_on = NULL;
        am_cuop *dropped = r && q->deferred ? cuq_take_unhanded(q, &kick_on) : NULL;
        int error = q->error;
        uint64_t error_value = q->error_value;
        int settle = r || (q->error && !q->count && !q->held && !q->unfenced && !q->driving);
        pthread_mutex_unlock(&q->mu);
        if (kick_on) cuq_unkick(q, kick_on);
        cuq_drop_refused(q, dropped, error, error_value);
        cuq_test_hook(CU_HOOK_CONFIRMED, q);
        if (e.extra && !r && !e.waited) am_timeline_poke(e.extra, e.extra_value);
        if (e.signals && !r) timeline_keep_released(e.extra);  /* its write landed */
        if (e.extra) timeline_unref(e.extra);  /* (done with it: confirmed, or failed) */
        if (settle) cuq_fail_timeline(q);
        am_timeline_poke(q->timeline, settle ? UINT64_MAX : e.value);
        if (settle) cuq_release_waiters(q);
        cuq_drain(q, 0, 0);
    }
    return cuq_stop(q);  /* (under mu) */
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
    q->forks = am_forks;
    q->ctx = ctx;
    q->stream = stream;
    q->timeline = timeline;
    q->word = timeline->word;
    q->spin_ns = spin_ns;
    q->max_inflight = (size_t)max_inflight;
    atomic_store(&q->refs, 1);
    pthread_mutex_init(&q->mu, NULL);
    am_cond_init(&q->cv);
    am_cond_init(&q->hand_cv);
    if (!q->ring || !q->events[0] || !q->events[1] ||
        pthread_create(&q->thread, NULL, cuq_run, q) != 0) {
        free(q->ring); free(q->events[0]); free(q->events[1]); free(q);
        return NULL;
    }
    /* The queue keeps its timeline until its memory goes (cuq_free): its thread, orphaned
     * by an abandoning close that gave up on it, may still raise it after the close
     * returned and the owner let go; and the queues that waited for it, or hold a wait
     * for it, reference the queue after it closed. */
    atomic_fetch_add(&timeline->refs, 1);
    return q;
}
