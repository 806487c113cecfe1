/* What both sides of a CUDA queue (cuda_submit.c and cuda_completion.c) release: the
 * pool of events to reuse, the queue's memory once its last reference goes, and the
 * operations held on the host. cuda_stream.h says how a queue works.
 */
#include "cuda_stream.h"

void cuq_recycle(am_cuq *q, void *event, int blocking) {  /* under q->mu */
    for (am_culend *lend = q->lends; lend; lend = lend->next)
        if (lend->event == event) {  /* lent: its borrower recycles it when done */
            lend->recycle = 1 + blocking;
            return;
        }
    if (q->events_count[blocking] < q->events_cap)
        q->events[blocking][q->events_count[blocking]++] = event;
    else
        ((int (*)(void *))cu_funcs[CU_EVENT_DESTROY])(event);
}

/* A lent event given back: recycled now if it was confirmed meanwhile (passed on to
 * another borrower of it, if any); the last one given back wakes a completion thread
 * that waits to destroy the queue's events (cuq_run, as it stops). */
void cuq_give_back(am_cuq *q, am_culend *lend) {  /* under q->mu */
    am_culend **p = &q->lends;
    while (*p != lend) p = &(*p)->next;
    *p = lend->next;
    if (lend->recycle) cuq_recycle(q, lend->event, lend->recycle - 1);
    if (!q->lends) pthread_cond_broadcast(&q->cv);
}

/* Hand every event of the queue back to the driver: those still in its ring (a stream
 * may not have reached them: the driver releases such an event once it has), the pooled
 * ones and the spares. Only by the completion thread as it stops, under mu: the one
 * thread that may still query or block on an event of the ring (abandoned, it may do so
 * after the closer returned). */
void cuq_destroy_events(am_cuq *q) {
    int (*destroy)(void *) = (int (*)(void *))cu_funcs[CU_EVENT_DESTROY];
    for (size_t i = 0; i < q->count; i++) {
        const am_cuentry *e = &q->ring[(q->head + i) % q->cap];
        destroy(e->event);
        if (e->extra) timeline_unref(e->extra);
    }
    q->count = 0;
    for (int k = 0; k < 2; k++) {
        for (size_t i = 0; i < q->events_count[k]; i++) destroy(q->events[k][i]);
        q->events_count[k] = 0;
        void *spare = atomic_exchange(&q->spare[k], NULL);
        if (spare) destroy(spare);
    }
}

/* Forget the device waits of other queues on this one (it will fail no more). */
void cuq_drop_waiters(am_cuq *q) { cuq_abandon_waiters(q, 0); }

static void cuq_free(am_cuq *q) {
    cuq_drop_waiters(q);
    cuq_drop_waiting(q->waiting);  /* (none left: its thread dropped them as it stopped) */
    timeline_unref(q->timeline);  /* (am_cuq_new) */
    pthread_mutex_destroy(&q->mu);
    pthread_cond_destroy(&q->cv);
    pthread_cond_destroy(&q->hand_cv);
    free(q->ring); free(q->events[0]); free(q->events[1]); free(q);
}

void cuq_unref(am_cuq *q) {
    if (atomic_fetch_sub(&q->refs, 1) == 1) cuq_free(q);
}

void cuop_free(am_cuop *op) {
    if (op->other) cuq_unref(op->other);
    if (op->extra) timeline_unref(op->extra);  /* (cuq_copy_op) */
    if (op->kind == CUOP_WAIT_EVENT && op->word)  /* never waited for */
        ((int (*)(void *))cu_funcs[CU_EVENT_DESTROY])(op->word);
    free(op);
}

void cuq_drop_held(am_cuq *q) {  /* under mu */
    while (q->held) {
        am_cuop *op = q->held;
        q->held = op->next;
        q->nheld--;
        cuop_free(op);
    }
    q->held_tail = NULL;
}
