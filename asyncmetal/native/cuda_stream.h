/* A CUDA queue's internals, shared by cuda_driver.c (the driver function table, the
 * kicks), cuda_submit.c (submissions) and cuda_completion.c (the completion thread).
 *
 * A CUDA queue submits through cuda_submit.c, one native call per driver operation (a
 * launch, a copy, a word written or waited for) and one per command's end (an event record and its
 * hand-over to the queue's completion thread). The driver functions come from
 * cuGetProcAddress (asyncmetal asks cuda-bindings for them once).
 *
 * Measured on an H200 VM: cuLaunchKernel ~5 us, cuStreamWriteValue64 ~2.4 us, an event
 * record ~0.8 us. A wait for another queue's value waits on that command's event
 * (cuStreamWaitEvent, across devices too), never on a word the stream would write later.
 *
 * A device wait is handed to the driver only once what satisfies it was: the command it
 * waits for, the signal that writes the word it waits on, or a host signal. Streams
 * beyond the device's hardware queues (CUDA_DEVICE_MAX_CONNECTIONS, 8 by default) share
 * one, in the order their work was handed over, and a wait there holds up every stream
 * behind it: a wait handed over before the work that satisfies it can wait forever (on
 * the H200, with one hardware queue, every such wait did). So until then the wait, and
 * everything behind it, is held here (deferred: a kick on the timeline, timelines.c,
 * resumes it); another library's stream, which cannot be held, has the commands up to
 * the one it waits for handed over at once (cuq_hand_over), then waits on its event.
 *
 * Commands in flight are bounded (max_inflight, the commands handed to the driver and
 * not yet confirmed). Past the bound, operations are held here, in order, and the
 * completion thread hands them to the driver as earlier commands are confirmed: no loop
 * round trip, and the submitting thread never makes a driver call that can block. On
 * the H200, cuLaunchKernel blocks for about a kernel's length once ~56 commands with
 * blocking-sync events are queued on a stream (plain events: not up to 1024), which is
 * what a deep queue of long kernels otherwise does to an event loop.
 *
 * The completion thread reports a command done only once its event says so: a kernel
 * that faulted can let later stream work land before the fault is reported, and the
 * event is what reports it. It raises the queue's timeline (the host-side value loops
 * read and wait on), and the timeline a signal command raised. It polls the event for a
 * moment (a completion about to happen is seen with no interrupt), then naps or blocks
 * on it. Launches and markers are timed: the queue keeps an estimate of how long one
 * runs once the command before it is done (quick to fall, slow to rise), publishes the
 * expected end of the last one submitted on its timeline (am_timeline_due, for a task
 * deciding whether to park), and the thread naps until shortly before that end, then
 * polls through it. A host signal of a device timeline wakes napping completion threads at once
 * (a device wait it releases is seen in microseconds, not at the end of a nap). It never
 * takes the GIL, and calls only cuCtxSetCurrent, cuEventQuery, cuEventSynchronize,
 * cuEventDestroy and, for held operations, the submission calls. */
#ifndef ASYNCMETAL_CUDA_STREAM_H
#define ASYNCMETAL_CUDA_STREAM_H

#include "amrt.h"

enum { CU_LAUNCH, CU_WRITE64, CU_WAIT64, CU_EVENT_CREATE, CU_EVENT_RECORD, CU_EVENT_QUERY,
       CU_EVENT_SYNC, CU_EVENT_DESTROY, CU_CTX_SET, CU_WAIT_EVENT, CU_CTX_GET, CU_COPY,
       CU_COPY_PEER, CU_COPY_HTOD, CU_COPY_DTOH, CU_MEMSET8, CU_MEMSET16, CU_MEMSET32,
       CU_STREAM_GET_CTX, CU_NFUNCS };
extern AM_HIDDEN void *cu_funcs[CU_NFUNCS];
/* cuCtxSetCurrent(before), making the caller's context current again after a runtime
 * call; a refusal is noted for the calling thread (amrt.h, am_cu_unrestored). */
AM_HIDDEN void cu_restore(void *before);
#define CU_ERROR_NOT_READY 600
#define CU_POLL_GAP_NS 10000     /* at most this long between queries, ... */
#define CU_POLL_QUIET_NS 500     /* ... or this long while no thread submits to the queue */
#define CU_KICK_POLL_NS 500000   /* after a host signal, poll this long before napping */
#define CU_KICK_OPS 8            /* a kick's thread hands over this many held operations */
#define CU_NAP_MIN_NS 60000      /* a command expected to run this much longer: nap first */
#define CU_NAP_LEAD_NS 30000     /* ... waking this long (and a 128th of its run) before */
#define CU_NAP_CHUNK_NS 20000000 /* ... in naps of at most this (an abandon is seen) */
#define CU_NAP_MAX_NS 1000000    /* a command that runs long: naps at most this long */
#define CU_LATE_POLL_NS 200000   /* poll past the expected end at most this long */
#define CU_NEAR_MIN_NS 1000000   /* one expected to run this long wakes its loops ahead, */
#define CU_NEAR_LEAD_NS 250000   /* ... at most this long before its expected end */
#define CU_MAX_NAP_LATE_NS 200000 /* a nap's lateness is allowed for up to this */
#define CU_MAX_PARAMS 64
#define CU_FINISH_LONG 1         /* am_cuq_finish flags: a command known to run long */
#define CU_FINISH_PLAIN 2        /* ... a device wait: a plain event, so a kick is seen */
#define CU_FINISH_FENCE 4        /* internal: behind what a refused command handed over */
#define CU_FINISH_WAITED 8       /* a device wait on `extra`'s word for extra_value (a
                                    timeline no queue owns): confirmed once the timeline
                                    reached it, failed if it failed instead */

/* cuda_driver.c: a host signal of a device timeline bumps the kick generation and wakes
 * completion threads napping on a command (kick_nap: 1 if kicked after `seen`). */
extern AM_HIDDEN atomic_uint kick_gen;
AM_HIDDEN int kick_nap(long ns, unsigned seen);

typedef struct {
    void *event;
    uint64_t value;
    am_timeline *extra;             /* a timeline this command signals, or NULL */
    uint64_t extra_value;
    long spin_ns;                   /* how long to poll before blocking on the event */
    int blocking;                   /* its event wakes a thread blocked on it (interrupt) */
    int fence;                      /* behind a refused command's handed-over operations:
                                       waited for, then fails */
    int timed;                      /* its run time teaches the queue's estimate */
    int64_t pushed_ns;              /* when it was handed over (now_ns) */
    int waited;                     /* CU_FINISH_WAITED: extra is waited on, not raised */
    int signals;                    /* a signal command: extra is the timeline it signals
                                       (else a wait's, raised once it is confirmed) */
} am_cuentry;

struct am_cuq;

/* A driver operation held on the host until the stream has room for it. */
enum { CUOP_LAUNCH, CUOP_COPY, CUOP_HTOD, CUOP_DTOH, CUOP_WRITE, CUOP_WAIT, CUOP_WAIT_QUEUE,
       CUOP_WAIT_EVENT, CUOP_FINISH, CUOP_FILL };
typedef struct am_cuop {
    int kind;
    int flags;                      /* CUOP_FINISH: CU_FINISH_*; CUOP_FILL: the pattern's
                                       size, 1, 2 or 4 bytes */
    uint64_t value;                 /* the command it belongs to */
    struct am_cuop *next;
    void *fn;                       /* CUOP_LAUNCH */
    unsigned dims[7];
    int nparams;
    uint64_t dst, src;              /* copies: device or host addresses */
    void *src_ctx;                  /* CUOP_COPY between devices: the source's context */
    size_t nbytes;                  /* (CUOP_FILL: dst's bytes filled) */
    void *word;                     /* CUOP_WRITE, CUOP_WAIT: a device word (CUOP_WAIT with
                                       `extra`: that timeline's, deferred until it can be
                                       satisfied; CUOP_WRITE with `extra`: a mark of that
                                       timeline's, am_cuq_mark); CUOP_WAIT_EVENT:
                                       an event another library's stream recorded, owned
                                       by the operation (destroyed once waited for, or
                                       when the operation is dropped) */
    uint64_t target;                /* ... its value; CUOP_WAIT_QUEUE: other's value;
                                       CUOP_FILL: the pattern */
    struct am_cuq *other;           /* CUOP_WAIT_QUEUE: the queue waited for (referenced) */
    am_timeline *extra;             /* CUOP_FINISH; CUOP_WAIT, CUOP_WRITE: the word's */
    uint64_t extra_value;
    long spin_ns;
    int64_t params[];               /* CUOP_LAUNCH: nparams 64-bit parameter slots */
} am_cuop;

struct am_cuq {
    int error;                      /* first member: the first CUDA error (sticky); */
    int failed_call;                /* which call failed at submission */
    uint64_t error_value;           /* the value of the command that saw it */
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    am_cuentry *ring;
    size_t cap, head, count;
    void **events[2];               /* finished events for reuse: plain, blocking-sync */
    size_t events_cap, events_count[2];
    atomic_size_t pending;          /* entries pushed and not yet confirmed */
    atomic_int submitting;          /* threads inside a submission (driver calls) now */
    int stop;                       /* 1: finish everything, then stop; 2: abandon now */
    int exited, orphan;             /* the thread returned; it frees the queue itself */
    unsigned forks;                 /* am_forks when made: another value, the parent's (in
                                       a forked child, which has none of its threads) */
    atomic_int refs;                /* the owner's, and one per held wait on this queue */
    void *ctx;
    void *stream;
    am_timeline *timeline;          /* the queue's timeline: its value is verified */
    _Atomic uint64_t *word;         /* its device word, written by the stream on demand */
    uint64_t submitted;             /* the last value handed to the completion thread */
    long spin_ns;
    int sleeping;                   /* the completion thread waits on cv */
    size_t max_inflight;            /* entries handed to the driver at most; then held */
    am_cuop *held, *held_tail;      /* operations held on the host, in order */
    size_t nheld;
    int deferred;                   /* the first held one is a device wait that must not
                                       reach the driver yet: `kick` is registered */
    am_kick kick;                   /* ... on the timeline it waits for (one ref of q,
                                       and one of that timeline) */
    am_timeline *kick_on;           /* ... that timeline (set with deferred, under mu) */
    _Atomic int64_t poll_until;     /* a kicked wait's work: polled for until then */
    int driving;                    /* a thread is making driver calls for this queue */
    int discarded;                  /* am_cuq_discard ran: a device wait that a thread
                                       handing it over puts back held goes too (under mu) */
    uint64_t handed_value;          /* the command of the last operation handed to the
                                       driver, or being handed now (under mu) */
    uint64_t unfenced;              /* a refused command part of which the driver has, whose
                                       fence the driver refused too, or that ran out of
                                       host memory (0: none): the queue settles only once
                                       a fence is recorded behind it or the driver refuses
                                       one for good (cuda_completion.c, cuq_refence;
                                       under mu) */
    am_timeline *unfenced_extra;    /* ... a signal that command makes (or NULL): its word
                                       write may still land, so its timeline fails only
                                       with the fence (cuq_unfence, which references
                                       it; under mu) */
    uint64_t unfenced_extra_value;
    int handing;                    /* threads in cuq_hand_over waiting on hand_cv for
                                       that to end, or for a due kick to run */
    pthread_cond_t hand_cv;
    _Atomic(void *) spare[2];       /* an event for the next command, taken without the lock */
    atomic_int blocking;            /* commands get blocking-sync events (they run long) */
    int quick;                      /* blocking events confirmed while polling, in a row */
    /* Run-time prediction (written by the completion thread under mu): how long a timed command runs once the one before
     * it is done (quick to fall, slow to rise), when the last command was confirmed, and
     * when the last one handed over is expected done (0: not known). */
    int64_t est_ns, last_done_ns, last_due_ns;
    int64_t nap_late_ns;            /* how late naps end here (the completion thread's) */
    atomic_int shared;              /* other libraries submit to the stream too (adopted):
                                       queries come at most every CU_POLL_GAP_NS */
    atomic_ulong queries, syncs, naps, events_made, held_total, kicked;  /* statistics */
    /* Failing with another queue (cuda_completion.c, cuq_poison): the device waits of
     * other queues on this one, and from which command on this one ran after a wait for
     * a value its queue never produced (0: none), with that queue's failure (the first
     * one, through any chain of waits). */
    struct am_cuwaiter *waiters;
    uint64_t poisoned;
    /* This queue's own device waits on other queues' values, handed to the driver and
     * not yet confirmed (each record's q: the queue waited for, referenced; under mu;
     * nwaiting: how many, read without the lock). Its thread, before confirming the
     * command of such a wait, checks what the other queue will fail at when its own
     * thread confirms an earlier device wait (cuda_completion.c, cuq_check_waiting): a
     * wait confirmed here first would otherwise pass, and confirm the other queue's
     * value, although the value it waited for is known never to be produced. */
    struct am_cuwaiter *waiting;
    atomic_int nwaiting;
    /* From which command on the data operations (launches, copies, fills) and signals'
     * word writes are not handed to the driver -- they pass, with only their events
     * recorded, and fail once confirmed (poisoned) -- because a wait of that command,
     * held on the host until what it waits for reached the driver, found it failed
     * before the wait was made: a host queue's timeline, another queue's command, a
     * timeline whose signal failed or was passed so (0: none). Written by the thread
     * handing the wait over, under mu; read by those handing operations over (one at a
     * time). */
    uint64_t skipped;
    /* The last command whose device wait on a timeline's word, behind such a wait, was
     * not made (cuda_submit.c, cuq_wait_word): its end is then not confirmed as a wait's
     * (cuq_run_op). By the thread handing operations over (one at a time). */
    uint64_t unmade_wait;
    /* Failing behind a failed wait, with nothing in flight and the rest held on the host
     * behind a device wait held for what it waits for (a signal ordered after another
     * queue's lower one): the last of those held commands, each of which can only fail,
     * that its timeline was raised through, failed, before it was handed over (0: none;
     * cuda_completion.c, cuq_report_held). Under mu. */
    uint64_t failed_through;
    int cause_error;
    uint64_t cause_value;
    am_timeline *cause;
    /* Events of this queue's ring lent to a stream's wait (cuda_submit.c,
     * stream_wait_queue), which makes its driver call without this queue's lock: none is
     * recycled or destroyed while lent. */
    struct am_culend *lends;
};
_Static_assert(offsetof(struct am_cuq, error) == 0, "am_cuq_failed_now reads error first");

/* An event of a queue lent, under its mu, to a thread that makes a stream wait on it
 * (on that thread's stack). Confirmed meanwhile, the event is left to the borrower to
 * recycle (recycle: 1 + its kind), as it gives it back. */
typedef struct am_culend {
    struct am_culend *next;
    void *event;
    int recycle;
} am_culend;

/* A device wait of queue q (part of its command `command`) for value `target` of the
 * queue holding this record, which references q. (In a queue's `waiting`, the other way
 * round: the holder's wait, of its command `command`, for value `target` of q.) */
typedef struct am_cuwaiter {
    struct am_cuwaiter *next;
    struct am_cuq *q;
    uint64_t target, command;
    /* With the queue waited for: `pending` while the wait's driver call is made (not
     * known made), `failed` once that queue's failure reached it meanwhile -- passed on
     * by the submitting thread only if the driver took the wait (cuq_wait_made). */
    int pending, failed;
} am_cuwaiter;

#define CU_WAITED_FAILED (-3)  /* a queue's error: it waited for a failed command's value */
#define CU_DEFERRED (-4)       /* cuq_run_op: a device wait that must be held (q->deferred) */
#define CU_HELD_FAILED (-8)    /* a queue's error: a wait of it held on the host found
                                  what it waits for failed before it was made (q->skipped):
                                  the commands from that wait on were never handed over */

/* Whether the completion thread has held operations it may hand over now (under mu). */
static inline int cuq_can_drain(const am_cuq *q) {
    return q->held && !q->driving && !q->deferred && q->count < q->max_inflight &&
           q->stop != 2;
}

/* q->kick_on, referenced for the caller (timeline_unref, or cuq_unkick). Under mu, while
 * q is deferred -- its kick's reference holds it, and may go as soon as mu is let go of
 * (cuq_kicked) -- or while the caller holds it otherwise (the wait it deferred). */
static inline am_timeline *cuq_kick_ref(am_cuq *q) {
    atomic_fetch_add(&q->kick_on->refs, 1);
    return q->kick_on;
}

/* A thread is done handing q's operations over (under mu): a completion thread waiting
 * for that to stop (am_cuq_close: cuq_run) goes on. */
static inline void cuq_undrive(am_cuq *q) {
    q->driving = 0;
    if (q->stop) pthread_cond_broadcast(&q->cv);
    if (q->handing) pthread_cond_broadcast(&q->hand_cv);
}

/* A command's end that raises a timeline (its signal), as the operation held for it. */
static inline int cuop_signals(const am_cuop *op) {
    return op->kind == CUOP_FINISH && op->extra &&
           !(op->flags & (CU_FINISH_PLAIN | CU_FINISH_WAITED));
}

/* Memory for operations held on the host, for the completion ring and for a failure's
 * list of the made waits it fails (cuda_completion.c, cuq_poison). The native test
 * harness builds with AM_TEST_ALLOC, its simulated driver defining am_test_alloc, to make
 * these allocations fail on demand. */
#ifdef AM_TEST_ALLOC
AM_HIDDEN void *am_test_alloc(size_t size);
#define cuq_alloc am_test_alloc
#else
#define cuq_alloc malloc
#endif

/* Points between two steps of a queue where the native test harness (built with
 * AM_TEST_HOOKS, its simulated driver defining am_test_hook) runs what another thread
 * could do there, to check that interleaving every time. Nothing otherwise. */
enum { CU_HOOK_DISCARD_UNLOCKED, CU_HOOK_DRAIN_HANDING, CU_HOOK_SUBMIT_HANDING,
       CU_HOOK_RUN_START, CU_HOOK_CONFIRMED, CU_HOOK_NAP_RELEASED, CU_HOOK_ABANDONING,
       CU_HOOK_WAITING_TAKEN };
#ifdef AM_TEST_HOOKS
AM_HIDDEN void am_test_hook(int where, am_cuq *q);
#define cuq_test_hook am_test_hook
#else
#define cuq_test_hook(where, q) ((void)0)
#endif

/* Whether CUresult r is process-fatal (sticky): every later call of the process fails
 * with it, and nothing of its contexts runs any more (asyncmetal/backends/cuda/_driver.py,
 * LOST: illegal address, launch failed, illegal instruction, misaligned address, hardware
 * stack error, invalid address space, invalid PC, assert, launch timeout, uncorrectable
 * ECC). */
static inline int cu_sticky(int r) {
    /* One case a line, each naming its CUresult as _driver.py does: a test compares the
     * two lists (tests/backends/cuda/test_sticky_errors.py). */
    switch (r) {
    case 700: /* CUDA_ERROR_ILLEGAL_ADDRESS */
    case 719: /* CUDA_ERROR_LAUNCH_FAILED */
    case 715: /* CUDA_ERROR_ILLEGAL_INSTRUCTION */
    case 716: /* CUDA_ERROR_MISALIGNED_ADDRESS */
    case 714: /* CUDA_ERROR_HARDWARE_STACK_ERROR */
    case 717: /* CUDA_ERROR_INVALID_ADDRESS_SPACE */
    case 718: /* CUDA_ERROR_INVALID_PC */
    case 710: /* CUDA_ERROR_ASSERT */
    case 702: /* CUDA_ERROR_LAUNCH_TIMEOUT */
    case 214: /* CUDA_ERROR_ECC_UNCORRECTABLE */
        return 1;
    default:
        return 0;
    }
}

/* Whether CUresult r, refusing a fence (the event recorded behind a command the driver
 * refused in part: cuda_submit.c, cuq_submit_then; cuda_completion.c, cuq_drain,
 * cuq_refence), ends the wait for that part: sticky, or the context itself gone (the
 * driver deinitialized or not initialized, the context destroyed or invalid) -- nothing
 * of it runs any more, so nothing is left to write the command's buffers. An invalid
 * value or handle (an adopted stream its owner destroyed) is not: the work the stream
 * already had still runs, and only a fence behind it says when it is done (a buffer
 * handed back before would be written by it), so it is tried again as any other
 * refusal is -- out of memory for a new event, or host memory for the ring (-1). */
static inline int cu_fence_final(int r) {
    if (cu_sticky(r)) return 1;
    switch (r) {
    case 3:   /* CUDA_ERROR_NOT_INITIALIZED */
    case 4:   /* CUDA_ERROR_DEINITIALIZED */
    case 201: /* CUDA_ERROR_INVALID_CONTEXT */
    case 709: /* CUDA_ERROR_CONTEXT_IS_DESTROYED */
        return 1;
    default:
        return 0;
    }
}

static inline int cuq_fail(am_cuq *q, int call, int r) {
    __atomic_store_n(&q->failed_call, call, __ATOMIC_RELAXED);
    return r;
}

/* cuda_stream.c */
AM_HIDDEN void cuq_recycle(am_cuq *q, void *event, int blocking);  /* under q->mu */
AM_HIDDEN void cuq_give_back(am_cuq *q, am_culend *lend);          /* under q->mu */
AM_HIDDEN void cuq_unref(am_cuq *q);
AM_HIDDEN void cuop_free(am_cuop *op);
AM_HIDDEN void cuq_drop_held(am_cuq *q);                           /* under q->mu */
AM_HIDDEN void cuq_destroy_events(am_cuq *q);                      /* under q->mu */
AM_HIDDEN void cuq_drop_waiters(am_cuq *q);

/* cuda_completion.c */
AM_HIDDEN void cuq_drain(am_cuq *q, uint64_t through, int most);
AM_HIDDEN void cuq_settle(am_cuq *q);
AM_HIDDEN void cuq_drop_refused(am_cuq *q, am_cuop *op, int error, uint64_t value);
AM_HIDDEN void cuq_unkick(am_cuq *q, am_timeline *kick_on);
AM_HIDDEN void cuq_drop_failed(am_cuq *q);
AM_HIDDEN void cuq_report_held(am_cuq *q);
AM_HIDDEN int cuq_waited(am_cuq *q, am_cuq *other, uint64_t target, uint64_t command);
AM_HIDDEN void cuq_waiting(am_cuq *q, am_cuq *other, uint64_t target, uint64_t command);
AM_HIDDEN void cuq_wait_made(am_cuq *q, am_cuq *other, uint64_t target, uint64_t command,
                              int made);
AM_HIDDEN void cuq_drop_waiting(am_cuwaiter *w);
AM_HIDDEN void cuq_mark_failed(am_cuq *q, uint64_t first, int error);
AM_HIDDEN void cuq_abandon_waiters(am_cuq *q, uint64_t first);
AM_HIDDEN uint64_t cuq_failed_at(const am_cuq *q);
AM_HIDDEN void cuq_cause(const am_cuq *q, int *error, uint64_t *value,
                         am_timeline **cause);                     /* under q->mu */
AM_HIDDEN void cuq_cause_now(am_cuq *q, uint64_t *failed, int *error, uint64_t *value,
                             am_timeline **cause);                 /* takes q->mu */
AM_HIDDEN void cuq_poison(am_cuq *q, uint64_t from, int error, uint64_t value,
                          am_timeline *cause);
AM_HIDDEN void cuq_fail_signal_now(am_cuq *q, const am_cuop *op, int error, uint64_t value,
                                   am_timeline *cause);
AM_HIDDEN void cuq_fail_signal_held(am_cuq *q, const am_cuop *op, int error, uint64_t value,
                                    am_timeline *cause);           /* under q->mu */
AM_HIDDEN int cuq_unfence(am_cuq *q, uint64_t value, const am_cuop *signal); /* under q->mu */

/* cuda_submit.c */
AM_HIDDEN int cuq_run_op(am_cuq *q, const am_cuop *op);
AM_HIDDEN int cuq_finish(am_cuq *q, uint64_t value, am_timeline *extra, uint64_t extra_value,
                         long spin_ns, int flags);
AM_HIDDEN int cuq_submit(am_cuq *q, const am_cuop *op, size_t size);
AM_HIDDEN int cuq_submit_then(am_cuq *q, const am_cuop *op, size_t size, const am_cuop *then);
AM_HIDDEN void cuq_hold_first(am_cuq *q, am_cuop *op);            /* under q->mu */

#endif
