/* What both sides of a CUDA queue (cuda_submit.c and cuda_completion.c) release: the
 * pool of events to reuse, the queue's memory once its last reference goes, and the
 * operations held on the host. cuda_stream.h says how a queue works.
 */
#include "cuda_stream.h"

void cuq_recycle(am_cuq *q, void *event, int blocking) {  /* under q->mu */
    if (q->events_count[blocking] < q->events_cap)
        q->events[blocking][q->events_count[blocking]++] = event;
    else
        ((int (*)(void *))cu_funcs[CU_EVENT_DESTROY])(event);
}

static void cuq_free(am_cuq *q) {
    pthread_mutex_destroy(&q->mu);
    pthread_cond_destroy(&q->cv);
    free(q->ring); free(q->events[0]); free(q->events[1]); free(q);
}

void cuq_unref(am_cuq *q) {
    if (atomic_fetch_sub(&q->refs, 1) == 1) cuq_free(q);
}

void cuop_free(am_cuop *op) {
    if (op->other) cuq_unref(op->other);
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
