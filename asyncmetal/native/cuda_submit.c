/* A CUDA queue's submissions (cuda_stream.h says how a queue works): each operation goes
 * to the driver at once, or is held on the host, in order, while the stream has
 * max_inflight commands unconfirmed; a command ends with an event handed to the
 * completion thread. Also the queue's statistics, its error and its close.
 */
#include "cuda_stream.h"

/* Every submission (driver calls on the queue's stream) runs between cuq_enter and
 * cuq_leave: meanwhile the completion thread holds its queries back, since a query takes
 * the driver's locks. cuq_enter makes the queue's context current on the calling thread
 * if it is not (a thread-local read, no more, when it already is), and cuq_leave makes
 * the one it found current again: the current context is per thread, shared by every
 * device and library on it, and theirs must be as they left it (a restore the driver
 * refuses is noted for the caller to warn of: cu_restore). Events are created in, and
 * recorded from, it. */
static int cuq_enter(am_cuq *q, void **before) {
    atomic_fetch_add(&q->submitting, 1);
    void *current = NULL;
    ((int (*)(void **))cu_funcs[CU_CTX_GET])(&current);
    *before = current;
    if (current == q->ctx) return 0;
    int r = ((int (*)(void *))cu_funcs[CU_CTX_SET])(q->ctx);
    return r ? cuq_fail(q, CU_CTX_SET, r) : 0;
}

/* After cuq_enter, whatever it returned. */
static int cuq_leave(am_cuq *q, int r, void *before) {
    if (before != q->ctx) cu_restore(before);
    atomic_fetch_sub(&q->submitting, 1);
    return r;
}

/* One of q's finished events of kind k (0: plain, 1: blocking-sync) to record again:
 * the spare, taken without the lock, else one from the pool; NULL if there is none. */
static void *cuq_spare_event(am_cuq *q, int k) {
    void *event = atomic_exchange(&q->spare[k], NULL);
    if (!event) {
        pthread_mutex_lock(&q->mu);
        if (q->events_count[k]) event = q->events[k][--q->events_count[k]];
        pthread_mutex_unlock(&q->mu);
    }
    return event;
}

/* Make `event` (of kind k, unused now) q's spare, taken without the lock, or else put it
 * in the pool. Not under mu. */
static void cuq_put_spare(am_cuq *q, void *event, int k) {
    void *none = NULL;
    if (!atomic_compare_exchange_strong(&q->spare[k], &none, event)) {
        pthread_mutex_lock(&q->mu);
        cuq_recycle(q, event, k);
        pthread_mutex_unlock(&q->mu);
    }
}

/* Record an event behind the command and hand it to the completion thread: one pass
 * under the lock, with the event for the next command. Then the device waits held until
 * this command (or the signal it makes) was handed over go on (timeline_handed).
 * Returns a CUresult (-1: out of memory). */
int cuq_finish(am_cuq *q, uint64_t value, am_timeline *extra, uint64_t extra_value,
                      long spin_ns, int flags) {
    /* Which kind of event the command gets: blocking-sync for one known to run long,
     * plain for a device wait (so that a host signal's kick is seen). */
    int fence = (flags & CU_FINISH_FENCE) != 0;
    int r, k = !(flags & (CU_FINISH_PLAIN | CU_FINISH_FENCE)) &&
               ((flags & CU_FINISH_LONG) || atomic_load(&q->blocking));
    void *event = cuq_spare_event(q, k);
    if (!event) {  /* CU_EVENT_DISABLE_TIMING, | CU_EVENT_BLOCKING_SYNC for k = 1 */
        r = ((int (*)(void **, unsigned))cu_funcs[CU_EVENT_CREATE])(&event, k ? 0x1 | 0x2 : 0x2);
        if (r) return cuq_fail(q, CU_EVENT_CREATE, r);
        atomic_fetch_add(&q->events_made, 1);
    }
    r = ((int (*)(void *, void *))cu_funcs[CU_EVENT_RECORD])(event, q->stream);
    if (r) {
        ((int (*)(void *))cu_funcs[CU_EVENT_DESTROY])(event);
        return cuq_fail(q, CU_EVENT_RECORD, r);
    }
    pthread_mutex_lock(&q->mu);
    if (q->count == q->cap) {
        am_cuentry *ring = cuq_alloc(2 * q->cap * sizeof *ring);
        if (!ring) {
            cuq_recycle(q, event, k);  /* recorded, never handed over: reusable */
            pthread_mutex_unlock(&q->mu);
            return -1;
        }
        for (size_t i = 0; i < q->count; i++) ring[i] = q->ring[(q->head + i) % q->cap];
        free(q->ring);
        q->ring = ring; q->head = 0; q->cap *= 2;
    }
    /* A command of unknown length -- a launch, a marker -- is timed: the queue predicts
     * when it will be done from how long such commands ran, behind the one before it,
     * and publishes that on its timeline for a task about to await it. */
    int timed = !fence && !spin_ns && !(flags & (CU_FINISH_LONG | CU_FINISH_PLAIN));
    int64_t now = now_ns(), from = q->count ? q->last_due_ns : now;
    int64_t due = timed && q->est_ns && from ? (from > now ? from : now) + q->est_ns : 0;
    q->last_due_ns = due;
    if (!fence) timeline_set_due(q->timeline, value, due);
    int waited = (flags & CU_FINISH_WAITED) != 0;
    int signals = extra && !(flags & (CU_FINISH_PLAIN | CU_FINISH_WAITED));
    am_cuentry e = {event, value, extra, extra_value, spin_ns, k, fence, timed, now, waited,
                    signals};
    q->ring[(q->head + q->count) % q->cap] = e;
    q->count++;
    if (extra) atomic_fetch_add(&extra->refs, 1);  /* (timeline_unref: its end) */
    if (!fence && value > q->submitted) q->submitted = value;
    void *spare = NULL;
    if (q->events_count[k] && !atomic_load(&q->spare[k]))
        spare = q->events[k][--q->events_count[k]];
    atomic_fetch_add(&q->pending, 1);
    if (q->sleeping) pthread_cond_signal(&q->cv);
    pthread_mutex_unlock(&q->mu);
    if (spare) cuq_put_spare(q, spare, k);
    if (!fence) timeline_handed(q->timeline, value);
    if (signals) timeline_handed(extra, extra_value);  /* its word write went before */
    return 0;
}

/* A thread handing over what a kick released (below): the kicks its hand-overs cause
 * wake those queues' completion threads instead. */
static _Thread_local int kick_driving;

/* What satisfies q's held wait reached a driver or the word: the thread that got it there
 * (a host signal's caller, or one handing another queue's signal over) hands the wait and
 * the first few operations behind it over itself -- the device starts on them at once,
 * not a thread wake-up later -- and the completion thread, woken by them, does the rest.
 * The thread then polls for a while rather than block on their events. */
static void cuq_kicked(am_kick *k) {
    am_cuq *q = (am_cuq *)(void *)((char *)k - offsetof(am_cuq, kick));
    atomic_store(&q->poll_until, now_ns() + CU_KICK_POLL_NS);
    pthread_mutex_lock(&q->mu);
    /* The timeline of the registration this run is of: q->kick_on is set only as the
     * kick is registered, never while it is registered or due (cuq_defer). */
    am_timeline *kick_on = q->kick_on;
    q->deferred = 0;
    if (q->handing) pthread_cond_broadcast(&q->hand_cv);
    int here = !kick_driving && cuq_can_drain(q);
    if (!here && q->sleeping && cuq_can_drain(q)) pthread_cond_signal(&q->cv);
    pthread_mutex_unlock(&q->mu);
    if (here) {
        void *before;
        kick_driving = 1;
        if (!cuq_enter(q, &before)) cuq_drain(q, 0, CU_KICK_OPS);
        cuq_leave(q, 0, before);
        kick_driving = 0;
        pthread_mutex_lock(&q->mu);
        if (q->sleeping && cuq_can_drain(q)) pthread_cond_signal(&q->cv);
        pthread_mutex_unlock(&q->mu);
    }
    /* The kick's reference (cuq_defer): whoever ran the kick made t due, holding it, and
     * touches it no more after its kicks. */
    timeline_unref(kick_on);
    cuq_unref(q);
}

/* Whether q's device wait for `target` of t must be held (q->deferred, and a kick
 * registered that resumes it) rather than handed to the driver now. By the thread
 * handing q's operations over (q->driving). */
static int cuq_defer(am_cuq *q, am_timeline *t, uint64_t target) {
    pthread_mutex_lock(&q->mu);
    if (q->deferred) {
        /* The kick of a wait held before -- dropped since, its kick found due by then
         * (cuq_unkick could not take it off) -- has not run yet: a thread that took it
         * off its timeline runs it behind other kicks. It cannot be registered again
         * before it ran (it is on that thread's list of kicks due, through k->next), and
         * that run lets go of its own timeline's reference (q->kick_on, left as it is).
         * This wait is held meanwhile; that run clears q->deferred, and the wait is
         * handed over again (cuq_kicked drains q or wakes its thread; a thread driving q
         * then finds it can drain: cuq_drain, cuq_submit_then), and registers the kick
         * then if it must still be held. (q->deferred is set only while the kick is
         * registered or due: every thread that drops a held wait takes its kick off.) */
        pthread_mutex_unlock(&q->mu);
        return 1;
    }
    q->deferred = 1;  /* before the kick can run: it clears this */
    q->kick_on = t;
    pthread_mutex_unlock(&q->mu);
    atomic_fetch_add(&q->refs, 1);
    /* The kick keeps t while registered, until it runs or is taken off (cuq_kicked,
     * cuq_unkick): what kept t for the wait (its held operation, Python's keep-alive)
     * may let go first -- a failed queue settles past the wait, and an abandoning close
     * drops the operation, before the kick is taken off. */
    atomic_fetch_add(&t->refs, 1);
    q->kick.fn = cuq_kicked;
    if (timeline_defer(t, target, &q->kick)) return 1;
    pthread_mutex_lock(&q->mu);
    q->deferred = 0;
    pthread_mutex_unlock(&q->mu);
    atomic_fetch_sub(&t->refs, 1);  /* (never the last: the caller's) */
    atomic_fetch_sub(&q->refs, 1);  /* (never the last: the caller's) */
    return 0;
}

/* From command `from` on, q's data operations are not handed to the driver (q->skipped;
 * cuq_run_op passes them, and the word writes of its signals): what they would have
 * written stays as it was. Their events are still recorded, in order: each is confirmed,
 * and fails, the queue from there on (CU_HELD_FAILED), with the failure behind it
 * (`error`, `value`, `cause`: that of what the wait at `from` waited for). */
static void cuq_skip_from(am_cuq *q, uint64_t from, int error, uint64_t value,
                          am_timeline *cause) {
    /* Failed from here now (as its confirmation would), with that failure: the marks of
     * the commands passed carry it (cuq_run_op). */
    cuq_poison(q, from, error, value, cause);
    pthread_mutex_lock(&q->mu);
    if (!q->skipped || from < q->skipped) __atomic_store_n(&q->skipped, from, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&q->mu);
}

/* Whether q's command `value` comes after a wait that failed before it reached the
 * driver (cuq_skip_from): the command runs nothing and fails with the queue. */
static int cuq_behind_skip(am_cuq *q, uint64_t value) {
    uint64_t skipped = __atomic_load_n(&q->skipped, __ATOMIC_RELAXED);
    return skipped && value >= skipped;
}

/* Whether a device wait for `target` of t of a command behind a failed wait
 * (cuq_behind_skip) is still held and made: only where it may order the command's later
 * signals of t, which fail, after another queue's signal of a lower value submitted
 * before (a queue's signal of a timeline after another queue's pending one waits for it
 * first): that one is then handed over, runs and is confirmed before t fails and
 * settles from the value after it (cuda_completion.c, cuq_sure, cuq_confirm_wait). Any
 * other is neither held nor made, nor confirmed as a wait (q->unmade_wait: decided once,
 * as it is handed over) -- q's timeline goes on through it, failed, as a host queue's
 * does behind a failed wait -- rather than leave q unsettled behind a value nothing may
 * produce: a host timeline's, a queue's own, or one no queue's signal was submitted
 * for. */
static int cuq_wait_behind_skip(am_timeline *t, uint64_t target) {
    return t->word && atomic_load(&t->promised) >= target;
}

/* q's wait `op` on t, held on the host until it could go on, goes on now: if t failed at
 * or before what it waited for, nothing from the wait's command on runs (cuq_skip_from)
 * -- as a host queue's commands behind a failed wait never run -- and 1 is returned:
 * the wait is not made either. t is a host queue's timeline (cpu, npy), which failed,
 * or a timeline with a device word that failed before the wait reached the driver: its
 * signal was passed behind such a wait or refused (cuq_fail_signal_now), or failed on
 * the device and was confirmed failed. A failure known only once the wait was handed to
 * the driver cannot hold back what was handed over behind it: that runs, and fails
 * once confirmed (cuq_confirm_wait). */
static int cuq_skip_failed(am_cuq *q, am_timeline *t, const am_cuop *op) {
    pthread_mutex_lock(&t->mu);
    int failed = timeline_failed_for(t, op->target), error = t->fail_error;
    uint64_t value = t->fail_value;
    am_timeline *cause = t->fail_cause ? t->fail_cause : t;
    pthread_mutex_unlock(&t->mu);
    if (failed) cuq_skip_from(q, op->value, error, value, cause);
    return failed;
}

/* A device wait on a word: raised by the host (`extra` NULL: a staging chunk's), or a
 * timeline's, held until a signal of it was handed over (or it was raised), and then not
 * made at all if the word got there already. A timeline only host signals raised so far
 * is waited for on the device at once: the device then polls its word through the
 * wait, and starts on the work behind it within microseconds of the signal (handing
 * that work over after the signal adds ~100 us on the H200 once it idled a while). */
static int cuq_wait_word(am_cuq *q, const am_cuop *op) {
    am_timeline *t = op->extra;
    if (t && cuq_behind_skip(q, op->value) && !cuq_wait_behind_skip(t, op->target)) {
        q->unmade_wait = op->value;
        return 0;
    }
    /* A timeline with no device word (a host queue's: cpu, npy) is only ever held on the
     * host, until its value got there -- and then nothing is left for the stream to wait
     * on -- or it failed: then nothing from this command on runs (cuq_skip_failed), and
     * the wait's confirmation fails the queue from there (cuq_confirm_wait). */
    if (t && !t->word) {
        if (cuq_defer(q, t, op->target)) return CU_DEFERRED;
        cuq_skip_failed(q, t, op);
        return 0;
    }
    int host_only = t && atomic_load(&t->signalled_by) == AM_BY_HOST;
    if (t && !host_only && cuq_defer(q, t, op->target)) return CU_DEFERRED;
    /* t failed for it by now (a signal of it passed, or failed): the word may be raised
     * for a value never produced, and the work behind the wait is not handed over. */
    if (t && cuq_skip_failed(q, t, op)) return 0;
    if (t && atomic_load((_Atomic uint64_t *)op->word) >= op->target) return 0;
    int r = ((int (*)(void *, void *, uint64_t, unsigned))cu_funcs[CU_WAIT64])(
        q->stream, op->word, op->target, 0x0 /* CU_STREAM_WAIT_VALUE_GEQ */);
    return r ? cuq_fail(q, CU_WAIT64, r) : 0;
}

/* Make `stream` wait until queue `other` reaches `value`: on the event of the first
 * command at or after it if that was submitted and is not yet confirmed, not at all if
 * it is confirmed (or other was abandoned). Not submitted yet: a queue q holds its wait
 * until it is (CU_DEFERRED); another library's stream (q NULL) had it handed over first
 * (cuq_hand_over), so only a wait that is held (CU_DEFERRED) or a failed other is left
 * -- whose device word the host raises, which the stream then waits on. Decided under other's lock, and the event lent
 * (am_culend): the driver call, which can block (a deep stream, the driver's own
 * locks), is made without the lock -- other's completion thread and submitters never
 * wait behind it -- while other's completion thread cannot recycle (re-record) or
 * destroy the event. The wait of a queue q (its command `command`) is recorded with
 * other, so that other's failure before `value` fails that command too; if other failed
 * before `value` already, it is not made, and q's work from that command on never
 * reaches the driver (cuq_skip_from). A foreign stream's (q NULL) is not recorded.
 * Returns a CUresult; *call: the driver call made. */
static int stream_wait_queue(void *stream, am_cuq *other, uint64_t value, am_cuq *q,
                             uint64_t command, int *call) {
    int r = 0;
    /* (Behind a failed wait: a queue's own timeline orders none of q's signals.) */
    if (q && cuq_behind_skip(q, command)) return 0;
    if (q && cuq_defer(q, other->timeline, value)) return CU_DEFERRED;
    pthread_mutex_lock(&other->mu);
    int abandoned = other->stop == 2;
    /* A wait of q on a command an abandoned (or closed) queue never confirms fails q
     * from there (cuq_mark_failed); else it is recorded, unless other failed before. */
    uint64_t from = abandoned ? cuq_failed_at(other) : 0;
    int failed = q && (abandoned ? from && value >= from : cuq_waited(q, other, value, command));
    if (failed) {
        /* Known failed before this wait reached the driver: it is not made, and nothing
         * of q's from it on runs (cuq_skip_from), with other's failure behind it. */
        int error;
        uint64_t failed_value;
        am_timeline *cause;
        cuq_cause(other, &error, &failed_value, &cause);
        pthread_mutex_unlock(&other->mu);
        cuq_skip_from(q, command, error, failed_value, cause);
        return 0;
    }
    if (value > other->submitted &&
        (abandoned || (!q && !other->error && atomic_load(other->word) < value))) {
        pthread_mutex_unlock(&other->mu);
        return abandoned ? 0 : CU_DEFERRED;
    }
    /* A queue's wait, recorded with other: recorded with q too, for q's thread to check
     * other before confirming the command (cuq_waiting), once other's lock is let go
     * (never a queue's mu under another's) and the driver took the wait, before the
     * command's end is handed over. Until the driver call returned, other's record is
     * pending: a failure of other passes it by, and it is passed on here only if the
     * wait was made (cuq_wait_made). One the driver refused goes from other's records,
     * and is never recorded with q: its command is taken back, and its number goes to
     * q's next command, which a failure of other must not fail. */
    int waiting = q && !abandoned;
    if (value > other->submitted) {
        pthread_mutex_unlock(&other->mu);
        *call = CU_WAIT64;
        r = ((int (*)(void *, void *, uint64_t, unsigned))cu_funcs[CU_WAIT64])(
            stream, (void *)other->word, value, 0x0 /* CU_STREAM_WAIT_VALUE_GEQ */);
        if (waiting) cuq_wait_made(q, other, value, command, !r);
        if (waiting && !r) cuq_waiting(q, other, value, command);
        return r;
    }
    *call = CU_WAIT_EVENT;
    am_culend lend = {NULL, NULL, 0};
    /* (Abandoned, other has nothing in flight: its events are its thread's to destroy.) */
    size_t inflight = other->stop == 2 ? 0 : other->count;
    for (size_t i = 0; i < inflight; i++) {
        am_cuentry *e = &other->ring[(other->head + i) % other->cap];
        if (e->value >= value) {
            lend = (am_culend){other->lends, e->event, 0};
            other->lends = &lend;
            break;
        }
    }
    pthread_mutex_unlock(&other->mu);
    if (lend.event) {
        r = ((int (*)(void *, void *, unsigned))cu_funcs[CU_WAIT_EVENT])(stream, lend.event, 0);
        pthread_mutex_lock(&other->mu);
        cuq_give_back(other, &lend);
        pthread_mutex_unlock(&other->mu);
    }
    if (waiting) cuq_wait_made(q, other, value, command, !r);
    if (waiting && !r) cuq_waiting(q, other, value, command);
    return r;
}

/* Stream q waits for queue `other` as above. Decided when the operation reaches the
 * driver, so a held wait looks at other as it is then. */
static int cuq_wait_queue(am_cuq *q, am_cuq *other, uint64_t value, uint64_t command) {
    int call, r = stream_wait_queue(q->stream, other, value, q, command, &call);
    return r ? cuq_fail(q, call, r) : 0;
}

/* One operation's driver calls (the context is current on the calling thread). */
int cuq_run_op(am_cuq *q, const am_cuop *op) {
    int r;
    /* A data operation of a command behind a failed wait held on the host (cuq_skip_failed)
     * passes; the order's own (waits, word writes, events) are made. */
    uint64_t skipped = __atomic_load_n(&q->skipped, __ATOMIC_RELAXED);
    int data = op->kind == CUOP_LAUNCH || op->kind == CUOP_COPY || op->kind == CUOP_HTOD ||
               op->kind == CUOP_DTOH || op->kind == CUOP_FILL;
    if (data && skipped && op->value >= skipped) return 0;
    /* A signal's word write (its command passed: its timeline fails, cuq_fail_signal_now) */
    if (op->kind == CUOP_WRITE && !op->extra && skipped && op->value >= skipped) return 0;
    if (op->kind == CUOP_WRITE && op->extra && skipped && op->value >= skipped) {
        /* A staging chunk's mark: the host threads that wait for it then copy nothing
         * (the chunk holds what the stream never wrote), but count the chunk's parts, so
         * that the stream's wait for them ends (host_queues.c, copy_parts). */
        int error;
        uint64_t value;
        am_timeline *cause;
        cuq_cause_now(q, NULL, &error, &value, &cause);
        am_timeline_fail_from(op->extra, op->target, error, value, cause);
    }
    switch (op->kind) {
    case CUOP_LAUNCH: {
        void *params[CU_MAX_PARAMS];
        for (int i = 0; i < op->nparams; i++) params[i] = (void *)&op->params[i];
        r = ((int (*)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                      unsigned, void *, void **, void **))cu_funcs[CU_LAUNCH])(
            op->fn, op->dims[0], op->dims[1], op->dims[2], op->dims[3], op->dims[4],
            op->dims[5], op->dims[6], q->stream, params, NULL);
        return r ? cuq_fail(q, CU_LAUNCH, r) : 0;
    }
    case CUOP_COPY:
        if (op->src_ctx) {
            r = ((int (*)(uint64_t, void *, uint64_t, void *, size_t, void *))
                     cu_funcs[CU_COPY_PEER])(op->dst, q->ctx, op->src, op->src_ctx, op->nbytes,
                                             q->stream);
            return r ? cuq_fail(q, CU_COPY_PEER, r) : 0;
        }
        r = ((int (*)(uint64_t, uint64_t, size_t, void *))cu_funcs[CU_COPY])(
            op->dst, op->src, op->nbytes, q->stream);
        return r ? cuq_fail(q, CU_COPY, r) : 0;
    case CUOP_HTOD:
        r = ((int (*)(uint64_t, const void *, size_t, void *))cu_funcs[CU_COPY_HTOD])(
            op->dst, (const void *)(uintptr_t)op->src, op->nbytes, q->stream);
        return r ? cuq_fail(q, CU_COPY_HTOD, r) : 0;
    case CUOP_DTOH:
        r = ((int (*)(void *, uint64_t, size_t, void *))cu_funcs[CU_COPY_DTOH])(
            (void *)(uintptr_t)op->dst, op->src, op->nbytes, q->stream);
        return r ? cuq_fail(q, CU_COPY_DTOH, r) : 0;
    case CUOP_FILL: {  /* cuMemsetD8/D16/D32Async: a count of 1, 2 or 4-byte items */
        int call = op->flags == 1 ? CU_MEMSET8 : op->flags == 2 ? CU_MEMSET16 : CU_MEMSET32;
        size_t count = op->nbytes / (size_t)op->flags;
        if (op->flags == 1)
            r = ((int (*)(uint64_t, unsigned char, size_t, void *))cu_funcs[call])(
                op->dst, (unsigned char)op->target, count, q->stream);
        else if (op->flags == 2)
            r = ((int (*)(uint64_t, unsigned short, size_t, void *))cu_funcs[call])(
                op->dst, (unsigned short)op->target, count, q->stream);
        else
            r = ((int (*)(uint64_t, unsigned int, size_t, void *))cu_funcs[call])(
                op->dst, (unsigned int)op->target, count, q->stream);
        return r ? cuq_fail(q, call, r) : 0;
    }
    case CUOP_WRITE:
        r = ((int (*)(void *, void *, uint64_t, unsigned))cu_funcs[CU_WRITE64])(
            q->stream, op->word, op->target, 0);
        return r ? cuq_fail(q, CU_WRITE64, r) : 0;
    case CUOP_WAIT:
        return cuq_wait_word(q, op);
    case CUOP_WAIT_QUEUE:
        return cuq_wait_queue(q, op->other, op->target, op->value);
    case CUOP_WAIT_EVENT: {
        /* Waited for (or refused), the event goes back to the queue's plain ones: the
         * wait keeps the state it captured, and the event may be recorded again. The
         * operation no longer owns it. */
        void *event = op->word;
        r = ((int (*)(void *, void *, unsigned))cu_funcs[CU_WAIT_EVENT])(q->stream, event, 0);
        ((am_cuop *)op)->word = NULL;
        cuq_put_spare(q, event, 0);
        return r ? cuq_fail(q, CU_WAIT_EVENT, r) : 0;
    }
    case CUOP_FINISH:
        if (skipped && op->value >= skipped && cuop_signals(op)) {
            /* A signal passed, not run: its word write was not made (above); its
             * timeline fails before its hand-over releases the waits held for it. */
            int error;
            uint64_t value;
            am_timeline *cause;
            cuq_cause_now(q, NULL, &error, &value, &cause);
            cuq_fail_signal_now(q, op, error, value, cause);
        }
        /* (A wait not made is not confirmed as one: nothing may produce its value.) */
        return cuq_finish(q, op->value, op->extra, op->extra_value, op->spin_ns,
                          q->unmade_wait == op->value ? op->flags & ~CU_FINISH_WAITED
                                                      : op->flags);
    }
    return -2;
}

/* A copy of `op` (`size` bytes) to hold, linked to one of `then`, if any; NULL if out of
 * memory. */
static am_cuop *cuq_copy_op(const am_cuop *op, size_t size, const am_cuop *then) {
    am_cuop *copy = cuq_alloc(size), *end = then ? cuq_alloc(sizeof *end) : NULL;
    if (!copy || (then && !end)) {
        free(copy);
        free(end);
        return NULL;
    }
    memcpy(copy, op, size);
    copy->next = end;
    /* A held operation keeps the timeline it points at until it is dropped (cuop_free):
     * what kept it for the caller (Python's keep-alive) lets go once the queue's
     * timeline passed the command, which a failed queue's settling does while its later
     * commands are still held. A wait for another queue keeps that queue, which keeps
     * its timeline (am_cuq_new): the wait looks at it as it is handed over
     * (stream_wait_queue), maybe after that queue closed and its owner let go. */
    if (copy->other) atomic_fetch_add(&copy->other->refs, 1);
    if (copy->extra) atomic_fetch_add(&copy->extra->refs, 1);
    if (end) {
        *end = *then;
        end->next = NULL;
        if (end->extra) atomic_fetch_add(&end->extra->refs, 1);
    }
    return copy;
}

/* Out of memory for an operation of command `value` of q (`op`; `then`, the command's
 * end behind it, if any): what q still holds of that command is dropped, with the kick of
 * a device wait of it held (own_kick: `op`'s own, not held). If no part of the command
 * reached the driver, that is all: the caller takes its value back, as for a command the
 * driver refused at once, and q goes on. Else its event can no longer follow what did:
 * q fails from that command on, as for a held command the driver refused, and settles
 * only once the stream is past that part, which may still run (a kernel writing a
 * buffer): a fence behind it, recorded by the completion thread (q->unfenced,
 * cuq_refence) -- not here, where the memory its ring may need to grow for it is
 * missing; that thread records it with nothing else in flight, so the ring has room. A
 * signal that is the command's end fails its timeline with that fence (its word write
 * reached the driver: cuq_unfence), marked failed at once. Returns -1. Not under mu. */
static int cuq_no_memory(am_cuq *q, uint64_t value, const am_cuop *op, const am_cuop *then,
                         int own_kick) {
    am_cuop *mine = NULL, **p = &q->held, *last = NULL;
    pthread_mutex_lock(&q->mu);
    /* Only while q->deferred: the kick is registered or due then, and its reference
     * holds q->kick_on -- which, for a wait held behind a due kick of an earlier one
     * (cuq_defer), is that one's timeline, not op's; once it ran, nothing is left to
     * take off. */
    int unkick = q->deferred && (own_kick || (q->held && q->held->value == value));
    am_timeline *kick_on = unkick ? cuq_kick_ref(q) : NULL;
    while (*p) {
        am_cuop *held = *p;
        if (held->value == value) {
            *p = held->next;
            q->nheld--;
            held->next = mine;
            mine = held;
        } else {
            last = held;
            p = &held->next;
        }
    }
    q->held_tail = last;
    int part = q->handed_value == value && q->stop != 2;
    if (part && !q->error) {
        q->error = -1;
        q->error_value = value;
    }
    const am_cuop *signal = then && cuop_signals(then) ? then : cuop_signals(op) ? op : NULL;
    /* Marked failed before the fence can be recorded, whose hand-over releases the waits
     * held for the signal (they then find it failed: cuq_skip_failed). */
    if (part && signal) cuq_fail_signal_held(q, signal, -1, value, q->timeline);
    int kept = part && cuq_unfence(q, value, signal);
    if (part && q->sleeping) pthread_cond_signal(&q->cv);  /* its thread records the fence */
    pthread_mutex_unlock(&q->mu);
    if (unkick) cuq_unkick(q, kick_on);
    if (part && signal && !kept)
        am_timeline_fail(signal->extra, signal->extra_value, -1, value, q->timeline);
    while (mine) {
        am_cuop *next = mine->next;
        if (part && cuop_signals(mine))
            am_timeline_fail(mine->extra, mine->extra_value, -1, value, q->timeline);
        cuop_free(mine);
        mine = next;
    }
    return -1;
}

/* Hand an operation to the driver now, or hold it (copied) behind what is held already
 * or while the stream has max_inflight commands unconfirmed; with `then` (a command's
 * CUOP_FINISH), that one too, right behind it in the same pass (both handed over, or both
 * held). 0 once submitted or held; a CUresult if the driver refused it now (nothing held:
 * the caller takes its value back); the queue's error once a command of it failed
 * (nothing more is accepted); -1: out of memory. */
int cuq_submit_then(am_cuq *q, const am_cuop *op, size_t size, const am_cuop *then) {
    pthread_mutex_lock(&q->mu);
    if (q->error) {
        int e = q->error;
        pthread_mutex_unlock(&q->mu);
        return e;
    }
    if (q->held || q->driving || q->count >= q->max_inflight) {
        am_cuop *copy = cuq_copy_op(op, size, then);
        if (!copy) {
            pthread_mutex_unlock(&q->mu);
            return cuq_no_memory(q, op->value, op, then, 0);
        }
        am_cuop *end = copy->next;
        if (q->held_tail) q->held_tail->next = copy; else q->held = copy;
        q->held_tail = end ? end : copy;
        q->nheld += end ? 2 : 1;
        atomic_fetch_add(&q->held_total, end ? 2 : 1);
        if (q->sleeping && cuq_can_drain(q)) pthread_cond_signal(&q->cv);
        /* A command ended behind held commands reported failed: it can only fail too. */
        int report = q->failed_through && (end ? end : copy)->kind == CUOP_FINISH;
        pthread_mutex_unlock(&q->mu);
        if (report) cuq_report_held(q);
        return 0;
    }
    q->driving = 1;
    pthread_mutex_unlock(&q->mu);
    void *before;
    int r = cuq_enter(q, &before);
    cuq_test_hook(CU_HOOK_SUBMIT_HANDING, q);
    if (!r) r = cuq_run_op(q, op);
    int ran = !r, deferred = r == CU_DEFERRED;
    am_cuop *held = NULL;
    if (deferred) {  /* held after all, first (before what came meanwhile) */
        r = 0;
        held = cuq_copy_op(op, size, then);
        if (!held) r = -1;
    } else if (!r && then) {
        r = cuq_run_op(q, then);
    }
    /* Refused by the driver after part of the command reached it (an earlier operation
     * of it -- a staged copy's earlier chunks -- or `op`, its end refused): that part
     * runs, so the command cannot be taken back as never run. q fails from it on, as
     * for a held command refused (cuq_drain), and settles only once the stream is past
     * that part: a fence behind it. A fence the driver refuses too is tried again by
     * the completion thread (q->unfenced, cuq_refence) -- the queue does not settle
     * meanwhile: a buffer the part writes must not be handed back while it may still
     * run, nor a timeline its signal raises failed while its word write may still land
     * (cuq_unfence) -- unless no try can cure the refusal (cu_fence_final: sticky, or
     * the context or the stream gone): then nothing is left to wait for, and the queue
     * settles now. (handed_value: only the driving thread writes it.) */
    int part = r > 0 && (ran || q->handed_value == op->value) &&
               __atomic_load_n(&q->stop, __ATOMIC_SEQ_CST) != 2;
    const am_cuop *refused = ran ? then : op;
    int signals = part && cuop_signals(refused), fenced = 0, unfenced = 0, kept = 0;
    if (part) {
        int call = __atomic_load_n(&q->failed_call, __ATOMIC_RELAXED);
        /* Failed before the fence is handed over: its confirmation, which may come at
         * once, fails the command (not "no error") and settles the queue. */
        pthread_mutex_lock(&q->mu);
        if (!q->error) { q->error = r; q->error_value = op->value; }
        pthread_mutex_unlock(&q->mu);
        if (signals) cuq_fail_signal_now(q, refused, r, op->value, q->timeline);
        int f = cuq_finish(q, op->value, signals ? refused->extra : NULL,
                           signals ? refused->extra_value : 0, 0, CU_FINISH_FENCE);
        fenced = !f;
        unfenced = f && !cu_fence_final(f);
        __atomic_store_n(&q->failed_call, call, __ATOMIC_RELAXED);  /* the refused one */
    }
    cuq_leave(q, r, before);
    pthread_mutex_lock(&q->mu);
    if (ran) q->handed_value = op->value;
    cuq_undrive(q);
    am_cuop *dropped = NULL;
    if (part) {
        /* (what other threads submitted meanwhile was held behind it: it never runs) */
        if (!q->error) { q->error = r; q->error_value = op->value; }
        if (unfenced) kept = cuq_unfence(q, op->value, signals ? refused : NULL) && signals;
        dropped = q->held;
        q->held = q->held_tail = NULL;
        q->nheld = 0;
    }
    if (held) {
        cuq_hold_first(q, held);
        atomic_fetch_add(&q->held_total, then ? 2 : 1);
    }
    int discard = held && q->discarded;  /* discarded meanwhile: the wait held goes too */
    int failed = held && !discard && q->error;  /* failed meanwhile: the same (cuq_drop_failed) */
    int settle = part && !q->count && !q->held && !q->unfenced && q->stop != 2;
    if (q->sleeping && (cuq_can_drain(q) || q->unfenced)) pthread_cond_signal(&q->cv);
    pthread_mutex_unlock(&q->mu);
    if (discard) am_cuq_discard(q);
    if (failed) cuq_drop_failed(q);
    if (held) cuq_report_held(q);
    if (part) {
        if (signals && !fenced && !kept)  /* (kept: it fails with the fence) */
            am_timeline_fail(refused->extra, refused->extra_value, r, op->value, q->timeline);
        cuq_drop_refused(q, dropped, r, op->value);
        if (settle) cuq_settle(q);
    }
    return r == -1 ? cuq_no_memory(q, op->value, op, then, deferred) : r;
}

/* Put `op` and those it links to before the held operations. Under mu. */
void cuq_hold_first(am_cuq *q, am_cuop *op) {
    am_cuop *last = op;
    size_t n = 1;
    for (; last->next; last = last->next) n++;
    last->next = q->held;
    if (!q->held) q->held_tail = last;
    q->held = op;
    q->nheld += n;
}

int cuq_submit(am_cuq *q, const am_cuop *op, size_t size) {
    return cuq_submit_then(q, op, size, NULL);
}

/* flags: CU_FINISH_LONG (a blocking-sync event at once), CU_FINISH_PLAIN (a device
 * wait's: a plain event). spin_ns: how long the command is expected to take at most. */
int am_cuq_finish(am_cuq *q, uint64_t value, am_timeline *extra, uint64_t extra_value,
                  long spin_ns, int flags) {
    int signals = extra && !(flags & (CU_FINISH_PLAIN | CU_FINISH_WAITED));
    if (signals) atomic_fetch_or(&extra->signalled_by, AM_BY_DEVICE);  /* a signal of extra */
    am_cuop op = {.kind = CUOP_FINISH, .flags = flags, .value = value, .extra = extra,
                  .extra_value = extra_value, .spin_ns = spin_ns};
    int r = cuq_submit(q, &op, sizeof op);
    /* Promised only once submitted (handed over or held): a signal refused (its queue
     * failed or discarded, the driver refusing it with nothing of it handed over) never
     * runs, and a wait behind a failed wait held for it would keep its queue from
     * settling (cuq_wait_behind_skip). One refused after part of its command reached
     * the driver fails its timeline instead. A wait ordered after this signal is
     * submitted once this returned (Queue.signal). */
    if (signals && !r) raise_word(&extra->promised, extra_value);  /* (an atomic max) */
    return r;
}

int am_cuq_wait_queue(am_cuq *q, am_cuq *other, uint64_t value, uint64_t command) {
    am_cuop op = {.kind = CUOP_WAIT_QUEUE, .value = command, .other = other, .target = value};
    return cuq_submit(q, &op, sizeof op);
}

/* dims: grid x, y, z, block x, y, z, dynamic shared memory bytes; params: nparams
 * pointers to 64-bit slots (copied). Then its event, as am_cuq_finish, in the same pass. */
int am_cuq_launch(am_cuq *q, void *function, const unsigned *dims, void **params, int nparams,
                  uint64_t value) {
    if (nparams < 0 || nparams > CU_MAX_PARAMS) return -2;
    int64_t buf[(sizeof(am_cuop) + sizeof(int64_t) - 1) / sizeof(int64_t) + CU_MAX_PARAMS];
    am_cuop *op = (am_cuop *)buf;
    memset(op, 0, sizeof *op);
    op->kind = CUOP_LAUNCH;
    op->value = value;
    op->fn = function;
    op->nparams = nparams;
    memcpy(op->dims, dims, sizeof op->dims);
    for (int i = 0; i < nparams; i++) memcpy(&op->params[i], params[i], sizeof(int64_t));
    am_cuop end = {.kind = CUOP_FINISH, .value = value};
    return cuq_submit_then(q, op, sizeof(am_cuop) + (size_t)nparams * sizeof(int64_t), &end);
}

/* A device copy, then its event: on one device (src_ctx NULL) or from the device of
 * src_ctx to the queue's. spin_ns: how long the copy is expected to take at most
 * (the completion thread polls that long rather than block on its event). */
int am_cuq_copy(am_cuq *q, uint64_t dst, uint64_t src, void *src_ctx, size_t nbytes,
                uint64_t value, long spin_ns) {
    am_cuop op = {.kind = CUOP_COPY, .value = value, .dst = dst, .src = src, .src_ctx = src_ctx,
                  .nbytes = nbytes};
    am_cuop end = {.kind = CUOP_FINISH, .value = value, .spin_ns = spin_ns};
    return cuq_submit_then(q, &op, sizeof op, &end);
}

/* nbytes of device memory at dst filled with `pattern` (its low `size` bytes, 1, 2 or 4,
 * repeated; nbytes a multiple of size, dst aligned to it), then its event, as am_cuq_copy. */
int am_cuq_fill(am_cuq *q, uint64_t dst, uint32_t pattern, int size, size_t nbytes,
                uint64_t value, long spin_ns) {
    if ((size != 1 && size != 2 && size != 4) || nbytes % (size_t)size || dst % (uint64_t)size)
        return -2;
    am_cuop op = {.kind = CUOP_FILL, .flags = size, .value = value, .dst = dst,
                  .nbytes = nbytes, .target = pattern};
    am_cuop end = {.kind = CUOP_FINISH, .value = value, .spin_ns = spin_ns};
    return cuq_submit_then(q, &op, sizeof op, &end);
}

/* Host memory (pinned, or at most a few pages of pageable) to and from device memory, as
 * a part of command `value`. */
int am_cuq_memcpy(am_cuq *q, int to_device, uint64_t dst, uint64_t src, size_t nbytes,
                  uint64_t value) {
    am_cuop op = {.kind = to_device ? CUOP_HTOD : CUOP_DTOH, .value = value, .dst = dst,
                  .src = src, .nbytes = nbytes};
    return cuq_submit(q, &op, sizeof op);
}

/* Stream memory operations on a device word (another timeline's, or a host thread's),
 * as a part of command `value`. */
int am_cuq_write(am_cuq *q, void *word, uint64_t target, uint64_t value) {
    am_cuop op = {.kind = CUOP_WRITE, .value = value, .word = word, .target = target};
    return cuq_submit(q, &op, sizeof op);
}

/* A mark of t (a staging ring's: host threads copy a chunk once the stream wrote it):
 * t's word written with `target`, as am_cuq_write, as a part of command `value`. Of a
 * command passed without running (behind a failed wait held on the host), t fails from
 * `target` first: what waits for the mark then knows the chunk holds nothing new. */
int am_cuq_mark(am_cuq *q, am_timeline *t, uint64_t target, uint64_t value) {
    am_cuop op = {.kind = CUOP_WRITE, .value = value, .word = (void *)t->word, .target = target,
                  .extra = t};
    return cuq_submit(q, &op, sizeof op);
}

int am_cuq_wait(am_cuq *q, void *word, uint64_t target, uint64_t value) {
    am_cuop op = {.kind = CUOP_WAIT, .value = value, .word = word, .target = target};
    return cuq_submit(q, &op, sizeof op);
}

/* A device wait on timeline t's word, held on the host until a signal of t that gets
 * there was handed to a driver, or the host raised the word (cuq_wait_word); on a
 * timeline with no word (a host queue's), held until its value got there. */
int am_cuq_wait_timeline(am_cuq *q, am_timeline *t, uint64_t target, uint64_t value) {
    am_cuop op = {.kind = CUOP_WAIT, .value = value, .word = (void *)t->word, .target = target,
                  .extra = t};
    return cuq_submit(q, &op, sizeof op);
}

int am_cuq_failed_call(am_cuq *q) { return __atomic_load_n(&q->failed_call, __ATOMIC_RELAXED); }

/* How the completion thread has worked so far: event queries, blocking waits on a
 * blocking-sync event, waits with naps on a plain one (after polling found them
 * unfinished), events created, whether commands now get blocking-sync events, operations
 * held on the host so far, held now, and naps cut short by a host signal. */
/* Other libraries submit to this queue's stream too (an adopted one): its completion
 * thread's queries, which take the driver's locks, come at most every CU_POLL_GAP_NS
 * (it cannot see when they submit). Before the first command. */
void am_cuq_set_shared(am_cuq *q) { atomic_store(&q->shared, 1); }

void am_cuq_stats(am_cuq *q, uint64_t *out) {
    out[0] = atomic_load(&q->queries);
    out[1] = atomic_load(&q->syncs);
    out[2] = atomic_load(&q->naps);
    out[3] = atomic_load(&q->events_made);
    out[4] = (uint64_t)atomic_load(&q->blocking);
    out[5] = atomic_load(&q->held_total);
    pthread_mutex_lock(&q->mu);
    out[6] = q->nheld;
    pthread_mutex_unlock(&q->mu);
    out[7] = atomic_load(&q->kicked);
}

/* For a queue whose error is CU_WAITED_FAILED or CU_HELD_FAILED: the failure it waited for -- that
 * queue's error and failed value, and its timeline (returned; maybe freed since, an
 * address to compare only). */
void *am_cuq_cause(am_cuq *q, int *error, uint64_t *value) {
    pthread_mutex_lock(&q->mu);
    void *cause = q->cause;
    *error = q->cause_error;
    *value = q->cause_value;
    pthread_mutex_unlock(&q->mu);
    return cause;
}

/* q's error, and the command it fails from (*value). A queue failing behind a device wait
 * found failed (poisoned) sets its error only as it settles, once its stream is past all
 * it was given; its thread reports the failed commands it confirmed before that (their
 * values reached, its timeline failed from the first: cuda_completion.c, cuq_run), and
 * this is their error meanwhile -- the one settling sets. Not q's own (its first member,
 * 0 until then): only that says a refused command had a part reach the driver, and is
 * kept (CUDAQueue._kept) -- a wait refused with nothing of it handed over, failed so by
 * the queue it waited for settling meanwhile (cuq_release_waiters), is not. */
int am_cuq_error(am_cuq *q, uint64_t *value) {
    pthread_mutex_lock(&q->mu);
    int e = q->error;
    *value = q->error_value;
    if (!e && q->poisoned) {
        e = q->skipped && q->skipped <= q->poisoned ? CU_HELD_FAILED : CU_WAITED_FAILED;
        *value = q->poisoned;
    }
    pthread_mutex_unlock(&q->mu);
    return e;
}

/* How far q's stream really got, where its timeline says more: once commands it held
 * on the host behind a device wait were reported failed (cuda_completion.c,
 * cuq_report_held: the timeline raised through them, q->failed_through), the value
 * before the first of them its completion thread has not confirmed yet -- held still,
 * being handed over, or in flight -- else UINT64_MAX (as far as the timeline says). A
 * device's close counts from there (CUDAQueue.reached): counted from the timeline, the
 * queue would look finished, and its close (not abandoning) wait for those commands for
 * good where they never run. The hold ending is not enough: what it held is handed over
 * behind a wait for another queue's lower signal, which the stream may block on for
 * good (that signal handed over behind a device wait that never ends). */
uint64_t am_cuq_reached(am_cuq *q) {
    pthread_mutex_lock(&q->mu);
    uint64_t first = UINT64_MAX;  /* the first command not confirmed */
    if (q->failed_through) {
        if (q->count) first = q->ring[q->head].value;  /* (in order: the ring first) */
        else if (q->driving && q->handed_value) first = q->handed_value;
        else if (q->held) first = q->held->value;
    }
    uint64_t reached = first <= q->failed_through ? first - 1 : UINT64_MAX;
    pthread_mutex_unlock(&q->mu);
    return reached;
}

/* Stop the completion thread and release the queue; the stream is the caller's.
 * abandon=0: after everything held was handed over and every command confirmed (or the
 * queue failed). abandon=1: now, dropping what is held, once another thread handing
 * operations over (a kick's) is out of the driver. A thread blocked on an event that
 * will never complete (behind a device wait nothing signals) is not waited for beyond
 * ~200 ms: it frees the queue itself if it ever returns. The thread destroys the queue's
 * events as it stops (then, for one that never returns, never). Blocks. In a forked
 * child, a queue of the parent is left as it is (amrt.h, am_forks): its thread is not
 * there to join, and its mu may be held for good. */
void am_cuq_close(am_cuq *q, int abandon) {
    if (q->forks != am_forks) return;
    pthread_mutex_lock(&q->mu);
    __atomic_store_n(&q->stop, abandon ? 2 : 1, __ATOMIC_SEQ_CST);  /* read unlocked too */
    /* The first command never confirmed now: its thread confirms none once stopped. */
    uint64_t first = q->count ? q->ring[q->head].value : q->submitted + 1;
    uint64_t seen = atomic_load(&q->timeline->value);  /* confirmed through waiters */
    if (seen != UINT64_MAX && first <= seen) first = seen + 1;
    if (abandon) {
        cuq_mark_failed(q, first, AM_ABANDONED);
        cuq_drop_held(q);
        /* A failed queue's word is waited on (another library's stream, for a value past
         * what it handed over): its thread settles nothing now, so released here. */
        raise_word(q->word, AM_WORD_RELEASED);
    }  /* what is in flight, its thread releases as it stops */
    pthread_cond_signal(&q->cv);
    if (abandon) {
        pthread_mutex_unlock(&q->mu);
        host_signalled();  /* wake it if it naps */
        cuq_test_hook(CU_HOOK_ABANDONING, q);
        cuq_abandon_waiters(q, first);  /* it settles nothing now: their waits fail */
        /* What it held never comes: other queues' waits held for it go on, and wait for
         * nothing (stream_wait_queue), as waits for its commands in flight do. */
        timeline_handed(q->timeline, UINT64_MAX);
        pthread_mutex_lock(&q->mu);
        struct timespec until;
        deadline_after(&until, 200000000L);
        int r = 0;
        while (!q->exited) {
            /* Another thread's driver call on the stream (a kick's hand-over) returns,
             * however long it takes on a busy machine: the caller may destroy the
             * stream once this returns. Only a thread blocked on an event is given up. */
            if (q->driving) pthread_cond_wait(&q->cv, &q->mu);  /* (cuq_undrive wakes) */
            else if (r == ETIMEDOUT) break;
            else r = am_cond_timedwait(&q->cv, &q->mu, &until);
        }
        if (!q->exited) {
            q->orphan = 1;  /* its thread frees it: q may be gone once mu is released */
            pthread_detach(q->thread);
            /* No thread hands q's operations over any more here either (none does now,
             * and none starts once stop is 2: cuq_can_drain, cuq_hand_over, cuq_refence),
             * so a wait still held has its kick taken off as below: else the kick keeps
             * its references of q and of the timeline for good. The closer's reference
             * is the thread's now (cuq_stop): cuq_unkick is given one of its own. */
            am_timeline *kick_on = q->deferred ? cuq_kick_ref(q) : NULL;
            if (kick_on) atomic_fetch_add(&q->refs, 1);
            pthread_mutex_unlock(&q->mu);
            if (kick_on) {
                cuq_unkick(q, kick_on);
                cuq_unref(q);
            }
            return;
        }
    }
    /* No thread hands q's operations over any more (its thread waited for that): a wait
     * still held has its kick taken off the timeline (and its references of q and of
     * the timeline go), which may be freed once this returns. */
    am_timeline *kick_on = abandon && q->deferred ? cuq_kick_ref(q) : NULL;
    pthread_mutex_unlock(&q->mu);
    if (kick_on) cuq_unkick(q, kick_on);
    pthread_join(q->thread, NULL);
    if (!abandon) {
        /* Everything it was given ran: what it never was given never comes. Waits held
         * for those values go on, and fail their queues from there (stream_wait_queue). */
        pthread_mutex_lock(&q->mu);
        __atomic_store_n(&q->stop, 2, __ATOMIC_SEQ_CST);
        cuq_mark_failed(q, q->submitted + 1, AM_CLOSED);
        pthread_mutex_unlock(&q->mu);
        timeline_handed(q->timeline, UINT64_MAX);
    }
    cuq_drop_waiters(q);  /* (waiters reference their queues: two waiting on each other) */
    cuq_unref(q);
}

/* The stream of q waits, as a part of command `value` and in the queue's order (behind
 * what is held on the host), for what another library submitted to `stream` (of `ctx`)
 * until now: an event recorded there now, in ctx (made current for that, the calling
 * thread's context kept); with `then` (the command's CUOP_FINISH), that one right
 * behind it in the same pass. Nothing is watched or adopted for that stream. Returns a
 * CUresult (-1: out of memory; AM_OTHER_CONTEXT: `stream` is not of ctx, whose events it
 * cannot record -- asked of the driver here, where it costs one call, not a Python
 * round of the bindings'); *call: the driver call that failed. */
static int cuq_wait_stream(am_cuq *q, void *ctx, void *stream, uint64_t value,
                           const am_cuop *then, int *call) {
    void *before = NULL, *event = NULL, *owner = NULL, *green = NULL;
    int r;
    if ((uintptr_t)stream > 1) {  /* (0 and 1, the legacy stream: ctx's own once current) */
        /* The driver's version of CUDA 12.5 on takes a third pointer (the stream's green
         * context, if any); the one before ignores it. A green context's stream is
         * refused too: that version gives the device's primary context for it (the
         * one before, cuCtxFromGreenCtx's context of its own, refused as another),
         * and ctx's events are not recorded on another context's stream. */
        r = ((int (*)(void *, void **, void **))cu_funcs[CU_STREAM_GET_CTX])(stream, &owner,
                                                                             &green);
        if (r) {
            *call = CU_STREAM_GET_CTX;
            return r;
        }
        if (owner != ctx || green) return AM_OTHER_CONTEXT;
    }
    ((int (*)(void **))cu_funcs[CU_CTX_GET])(&before);
    r = before == ctx ? 0 : ((int (*)(void *))cu_funcs[CU_CTX_SET])(ctx);
    if (r) {
        *call = CU_CTX_SET;
        return r;
    }
    /* A plain event of the queue's own (the same kind, no timing), given back to its
     * pool once the stream waits on it: a wait recorded there captures the event's
     * state at that call, so the event may be recorded again behind it. */
    event = cuq_spare_event(q, 0);
    r = 0;
    if (!event) {
        r = ((int (*)(void **, unsigned))cu_funcs[CU_EVENT_CREATE])(&event, 0x2);
        if (!r) atomic_fetch_add(&q->events_made, 1);
    }
    *call = CU_EVENT_CREATE;
    if (!r) {
        r = ((int (*)(void *, void *))cu_funcs[CU_EVENT_RECORD])(event, stream);
        *call = CU_EVENT_RECORD;
        if (r) ((int (*)(void *))cu_funcs[CU_EVENT_DESTROY])(event);
    }
    if (before != ctx) cu_restore(before);
    if (r) return r;
    am_cuop op = {.kind = CUOP_WAIT_EVENT, .value = value, .word = event};
    r = cuq_submit_then(q, &op, sizeof op, then);
    *call = CU_WAIT_EVENT;
    /* 0: waited for (the event let go of) or held (the held copy owns it); else refused
     * before either, unless the refusal was the wait's own (or its end's, after it). */
    if (r && op.word) ((int (*)(void *))cu_funcs[CU_EVENT_DESTROY])(op.word);
    return r;
}

int am_cuq_wait_stream(am_cuq *q, void *ctx, void *stream, uint64_t value, int *call) {
    return cuq_wait_stream(q, ctx, stream, value, NULL, call);
}

/* am_cuq_wait_stream and the command's end (as am_cuq_finish with no extra timeline) in
 * one call: a command of its own, done once that stream's work until now is. */
int am_cuq_wait_stream_end(am_cuq *q, void *ctx, void *stream, uint64_t value, long spin_ns,
                           int flags, int *call) {
    am_cuop end = {.kind = CUOP_FINISH, .flags = flags, .value = value, .spin_ns = spin_ns};
    return cuq_wait_stream(q, ctx, stream, value, &end, call);
}

/* Hand q's operations up to command `value` to the driver now, on the calling thread and
 * past the bound on commands in flight: for a stream that is about to wait on its event
 * and cannot be held. A held wait of q on another queue has that queue's operations up
 * to what it waits for handed over first, the same way. Returns 0 once `value` was
 * handed over (or q failed, or was abandoned); CU_DEFERRED if a wait before it waits for
 * what no one handed over yet (a timeline only a later signal raises); a CUresult if the
 * context could not be made current. The caller's context is kept. */
/* Wait, in cuq_hand_over, until another thread stopped handing q's operations over or a
 * due kick cleared q->deferred (under mu; they broadcast hand_cv). A bounded wait: what
 * it waits for is re-read after it either way. */
static void cuq_wait_handing(am_cuq *q) {
    struct timespec until;
    deadline_after(&until, CU_NAP_CHUNK_NS);
    q->handing++;
    am_cond_timedwait(&q->hand_cv, &q->mu, &until);
    q->handing--;
}

static int cuq_hand_over(am_cuq *q, uint64_t value, int depth) {
    void *before;
    int r = cuq_enter(q, &before);
    if (r) return cuq_leave(q, r, before);
    pthread_mutex_lock(&q->mu);
    while (q->submitted < value && q->stop != 2 && !q->error) {
        if (q->driving) {  /* another thread hands some over now (its driver calls may
                              block, a deep stream's): until it is done */
            cuq_wait_handing(q);
            continue;
        }
        if (!q->held) break;  /* (nothing up to it submitted at all) */
        if (q->deferred) {
            am_cuop *first = q->held;
            am_timeline *t = cuq_kick_ref(q);  /* (its kick may run meanwhile, letting go) */
            am_cuq *other = first->kind == CUOP_WAIT_QUEUE && depth < 8 ? first->other : NULL;
            uint64_t target = first->target;
            if (other) atomic_fetch_add(&other->refs, 1);
            pthread_mutex_unlock(&q->mu);
            if (other) {
                r = cuq_hand_over(other, target, depth + 1);  /* its hand-over kicks q */
                cuq_unref(other);
            }
            /* q's kick still registered: nothing got its wait there (a timeline only a later
             * signal raises; other abandoned, or failed and not settled yet). Else the kick
             * is due, and runs -- maybe on another thread, behind other kicks' driver calls
             * -- which clears q->deferred: waited for. */
            int waiting = !r && timeline_undefer(t, &q->kick, 0);
            timeline_unref(t);
            pthread_mutex_lock(&q->mu);
            if (waiting && q->deferred && q->held == first) r = CU_DEFERRED;
            if (r) break;
            if (q->deferred) cuq_wait_handing(q);  /* its kick, due, clears it */
            continue;
        }
        pthread_mutex_unlock(&q->mu);
        cuq_drain(q, value, 0);
        pthread_mutex_lock(&q->mu);
    }
    pthread_mutex_unlock(&q->mu);
    return cuq_leave(q, r, before);
}

/* Hand q's operations up to command `value` to the driver now (cuq_hand_over): before
 * another library uses q's stream, or a stream that waits on q's events. */
int am_cuq_hand_over(am_cuq *q, uint64_t value) { return cuq_hand_over(q, value, 0); }

/* Make another library's stream (a DLPack consumer's) wait until queue `owner` reaches
 * `target`, as a queue's wait on another queue does, but for a stream that is no queue
 * of asyncmetal's: nothing is numbered, held or confirmed for it, so no completion
 * thread watches it. What owner still holds up to `target` is handed over first (a
 * stream cannot be held), then the stream waits on its event. Submitted now, with `ctx`
 * current (the stream's context: for CU_STREAM_LEGACY, which one it is), and the
 * caller's context current again after. Returns a CUresult, or CU_DEFERRED (nothing
 * done) if `target` waits for what no one handed over yet; *call: the driver call the
 * CUresult came from. */
int am_cuq_wait_foreign(am_cuq *owner, void *ctx, void *stream, uint64_t target, int *call) {
    void *before = NULL;
    ((int (*)(void **))cu_funcs[CU_CTX_GET])(&before);
    int r = before == ctx ? 0 : ((int (*)(void *))cu_funcs[CU_CTX_SET])(ctx);
    if (r) {
        *call = CU_CTX_SET;
        return r;
    }
    r = cuq_hand_over(owner, target, 0);
    *call = CU_CTX_SET;
    if (!r) r = stream_wait_queue(stream, owner, target, NULL, 0, call);
    if (before != ctx) cu_restore(before);
    return r;
}
