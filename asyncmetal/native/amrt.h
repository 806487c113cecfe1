/* asyncmetal's native runtime: the declarations its files share.
 *
 * The runtime is one shared object built from these files (asyncmetal/_native.py lists
 * them; the wheel's build and the first-use build compile the same list):
 *   timelines.c         timelines, notifiers (a loop's pipe), watches, the spin-wait
 *   host_queues.c       the cpu device's queue threads (kernel calls, copies, waits)
 *   cuda_driver.c       the CUDA driver function table and the kicks of a host signal
 *   cuda_stream.c       a CUDA queue's event pool, references and held operations
 *   cuda_submit.c       a CUDA queue's submissions: driver calls or held operations
 *   cuda_completion.c   a CUDA queue's completion thread, which confirms commands
 *   objc_blocks.c       Objective-C blocks for Metal whose invokes never take the GIL
 *   py_module.c, py_launch.c: the CPython extension module (only where Python.h is)
 *
 * Nothing here takes the GIL. Functions marked AM_HIDDEN are shared between the files
 * but not exported from the shared object; every other function declared here is called
 * from Python through ctypes (asyncmetal/_native.py, _SIGNATURES) or by the harnesses
 * of tests/native.
 */
#ifndef ASYNCMETAL_AMRT_H
#define ASYNCMETAL_AMRT_H

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#define AM_HIDDEN __attribute__((visibility("hidden")))

/* The calling thread's name as tools show it (top -H, gdb, py-spy, /proc/<pid>/task/
 * <tid>/comm): at most 15 characters. Each thread the runtime starts names itself, so
 * that what a process spends on a device's threads can be told apart. */
static inline void am_name_thread(const char *name) {
#ifdef __APPLE__
    pthread_setname_np(name);
#elif defined(__linux__)
    prctl(PR_SET_NAME, name, 0, 0, 0);
#else
    (void)name;
#endif
}
#define AM_MAX_ARGS 16

/* Forks this process went through: a forked child adds one (am_after_fork, registered
 * with pthread_atfork when the runtime loads). Timelines and queues record the count
 * they were made under; in a child, those of the parent are the parent's: their threads
 * do not exist here, and their mutexes and conditions may have been held or waited on
 * by those threads at the fork, forever so in the child's copy. So the functions that
 * release them (am_queue_close, am_timeline_free, am_watch_free) leave them alone --
 * a leak of the parent's memory in the child, never a hang -- and asyncmetal refuses
 * every other use of them in the child. */
extern AM_HIDDEN unsigned am_forks;

/* ---- timelines.c: a loop's notifier, a watch of a timeline, the timeline ---------- */

typedef struct am_notifier {
    atomic_int pending;
    int fd;
    _Atomic int64_t awake_until;    /* a now_ns() time: the loop reads its timelines until */
    /* Signallers that took it to write its pipe once their timeline's mu is let go of:
     * am_forks in the high 32 bits, their count in the low (a count left by a parent's
     * thread at a fork is never lowered in the child: a count of another fork is none). */
    _Atomic uint64_t writing;
} am_notifier;

struct am_timeline;

/* A device wait held on the host until what satisfies it was handed to a device or the
 * host raised the word (timeline_defer), or a failure held until the value got there
 * (am_timeline_fail_after): `fn` runs once, on the thread that got there. */
typedef struct am_kick {
    struct am_kick *next;
    uint64_t target;
    void (*fn)(struct am_kick *);
    int on_value;                   /* due once the timeline's value got there (or it
                                       failed for it), not its word or a write handed
                                       over (am_timeline_fail_after) */
} am_kick;

typedef struct am_watch {
    _Atomic uint64_t next;          /* smallest value its loop waits for */
    am_notifier *notifier;
    struct am_timeline *timeline;
    struct am_watch *link;
} am_watch;

typedef struct am_timeline {
    _Atomic uint64_t value;         /* first member: Python reads it in place */
    _Atomic uint64_t *word;         /* a copy a device waits on (pinned memory), or NULL */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    am_watch *watches;
    int polling;                    /* a queue thread polls the word (wait_word), under mu */
    uint64_t seen;                  /* the word's highest value it saw, under mu */
    unsigned forks;                 /* am_forks when made: another value, the parent's */
    /* When the command that raises the value to due_value is expected to be done (a
     * now_ns() time): a queue that predicts its commands' run times publishes the last
     * one submitted; a hint for waiters about to wait (am_timeline_due). */
    _Atomic uint64_t due_value;
    _Atomic int64_t due_ns;
    /* A command that signals it failed (am_timeline_fail): it settled at
     * UINT64_MAX, failed from this value on (0: not failed), and the failure behind it
     * (a queue's timeline, its error and failed value). Under mu. */
    uint64_t failed_from;
    int fail_error;
    uint64_t fail_value;
    struct am_timeline *fail_cause;
    /* The highest value a device write of the word was handed to a driver for (a queue's
     * own timeline: its commands; another: a queue's signal), and the device waits held
     * until that or the word gets to theirs (under mu; has_kicks: any, read unlocked). A
     * Metal timeline (no word, no kicks): the highest value a committed command buffer
     * signals it to, which waits held on a Metal queue's thread look for (written under
     * mu: am_signal_committed). */
    _Atomic uint64_t handed;
    /* The highest value a cuda queue's signal of it was submitted for (am_cuq_finish):
     * what a wait behind a failed wait may still be ordered after (cuq_wait_behind_skip). */
    _Atomic uint64_t promised;
    am_kick *kicks;
    atomic_int has_kicks;
    atomic_int signalled_by;        /* AM_BY_HOST: a host signal raised it; AM_BY_DEVICE:
                                       a queue's signal of it was submitted */
    /* cuda completion threads napping on a device wait for it that only a host signal
     * can release now (the word below the target, nothing handed over for it): a hand-over
     * or a host raise of the word kicks them (timeline_handed, timeline_raise). */
    atomic_int nappers;
    /* Its owner's (am_timeline_free lets go of it) and one per cuda command in a queue's
     * ring that points at it (cuq_finish): a device wait on it, which the completion
     * thread confirms on it; a signal of it, which that thread raises it for; or a wait
     * for another queue, whose timeline that thread raises -- each of which may come
     * after a queue that waited for the command raised its queue's timeline past it, and
     * the owner (Python, whose keep-alive let go then) let go. Also one per operation a
     * cuda queue holds on the host that points at it (cuq_copy_op), per kick of a held
     * device wait registered on it (cuq_defer), and while a queue keeps a refused signal
     * of it for the fence behind that command (cuq_unfence): a failed queue settles, its
     * timeline past those commands, while they are still held or unfenced. A cuda
     * queue's own timeline: one of that queue too, until its memory goes (am_cuq_new).
     * Freed at none. */
    atomic_int refs;
    /* A Metal queue's own timeline: the value of its first command buffer that failed
     * (0: none), set by that buffer's completion handler (am_block_completed) -- or of
     * its command whose commit was refused, its value never to be produced otherwise
     * (am_metal_unsubmitting). */
    _Atomic uint64_t failed_command;
    /* A Metal queue's own timeline: its command buffers that completed and whose rise is
     * held until what they waited for settled (objc_blocks.c); later ones queue behind. */
    _Atomic uint64_t held_raises;
    /* A Metal queue's own timeline: its first command buffer that ran after a device wait
     * for a value that failed (0: none), and that failure (error, value, cause): a signal
     * of that buffer or a later one fails its timeline the same way. Under mu. */
    uint64_t waited_failed;
    int waited_error;
    uint64_t waited_value;
    struct am_timeline *waited_cause;
    /* Its device (or queue) closed it (am_timeline_close): nothing raises it any more.
     * Under mu. */
    int closed;
    /* A Metal queue's own timeline: the last value submitted to its queue (UINT64_MAX:
     * the queue failed and settled, block_finish), the last whose completion handler
     * ran (settle_failed), and what takes its MTLSharedEvent there with it: the event,
     * retained (a handler held past the queue's last reference of it still sets it), and
     * objc_msgSend, `setSignaledValue:` and `release` (am_metal_own; no event: not a
     * queue's own; released with t, timeline_unref). Under mu. */
    uint64_t submitted;
    uint64_t finished;
    /* A Metal queue's own timeline: the timeline its own thread holds a wait on now
     * behind a command of it (am_metal_host_wait; NULL: none), and a count of the
     * failures of its commands (block_finish), each of which wakes that wait: the queue
     * may have failed before the wait's command, which then is not made. Under mu (the
     * count also read unlocked, by the waiting thread under the held timeline's mu). */
    struct am_timeline *held_on;
    _Atomic uint64_t held_wakes;
    void *event;
    void *event_send;
    void *event_selector;
    void *event_release;
} am_timeline;

enum { AM_BY_HOST = 1, AM_BY_DEVICE = 2 };

/* ---- host_queues.c: a cpu queue's commands, and the queue ------------------------ */

enum { CMD_CALL = 1, CMD_COPY, CMD_SIGNAL, CMD_WAIT, CMD_COPY_PART, CMD_FILL };

typedef struct {
    int kind;
    int nargs;
    void *fn;
    int64_t args[AM_MAX_ARGS];
    uint32_t floats;                /* CMD_CALL: bit i set: args[i] is a float's bits */
    am_timeline *timeline;
    uint64_t target;
    void *dst;
    const void *src;
    size_t nbytes;
    int64_t *record;                /* start_ns, end_ns, value: a row of a ring */
    uint64_t value;                 /* the queue's own timeline value after it */
    am_timeline *after;             /* CMD_COPY_PART: whose word to wait for first, or NULL */
    size_t part;                    /* ... bytes per part (the last may be shorter) */
    _Atomic uint64_t *claimed;      /* ... parts taken, shared by the queues that copy */
    uint64_t first;                 /* ... the claim number of this use's first part */
    _Atomic uint64_t *count;        /* ... parts of its chunk copied, over all its uses */
    uint64_t count_target;          /* ... the count once every part of this use is in */
    _Atomic uint64_t *ready;        /* ... the word that part raises to ready_value */
    uint64_t ready_value;
    uint32_t pattern;               /* CMD_FILL: dst's nbytes hold this, repeated (host */
    int pattern_size;               /* ... order, its low 1, 2 or 4 bytes) */
} am_cmd;

/* A queue holds its commands in segments of AM_SEG_CMDS, linked oldest first: a push
 * appends to the last one, or to a new one (one small allocation, whatever the number
 * queued: nothing queued is ever moved); the thread takes from the first one, and lets
 * go of it once it is drained, keeping one spare for the next push that needs one. So a
 * backlog's memory goes back once it drained, but for the spare. */
enum { AM_SEG_CMDS = 64 };

typedef struct am_cmdseg {
    struct am_cmdseg *next;
    am_cmd cmds[AM_SEG_CMDS];
} am_cmdseg;

typedef struct am_queue {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    am_cmdseg *first, *last;        /* the thread takes first's cmds[head], a push writes */
    size_t head, tail, count;       /* ... last's cmds[tail]; count over all of them */
    am_cmdseg *spare;               /* a drained segment kept for reuse, or NULL */
    atomic_size_t pending;          /* commands submitted and not yet taken */
    int stop;                       /* 1: finish what is queued, 2: abandon now */
    int discard;                    /* am_queue_discard: commands not started never run */
    int sleeping;
    long spin_ns;
    int nice;                       /* the thread's nice value on Linux (< 0: inherited) */
    am_timeline *own;
    am_timeline *waiting_on;
    unsigned forks;                 /* am_forks when made */
    /* Its commands from this value on fail (0: none): a wait of theirs ended on a
     * timeline that failed instead of reaching its value. The failure behind it (as
     * am_timeline's fail_*). Written by the queue's thread under mu. */
    uint64_t poisoned;
    int cause_error;
    uint64_t cause_value;
    struct am_timeline *cause;
} am_queue;

/* ---- helpers of every file ------------------------------------------------------ */

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Timed waits: a condition a thread waits on with a deadline is made by am_cond_init and
 * waited on by am_cond_timedwait, until a deadline of deadline_after -- all three on
 * CLOCK_MONOTONIC, so that a step of the wall clock (NTP, settimeofday) neither stretches
 * nor cuts a nap. macOS has no pthread_condattr_setclock: there the wait is made relative
 * to the monotonic now (pthread_cond_timedwait_relative_np). */
static inline void am_cond_init(pthread_cond_t *cv) {
#ifdef __APPLE__
    pthread_cond_init(cv, NULL);
#else
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(cv, &attr);
    pthread_condattr_destroy(&attr);
#endif
}

/* A wait of ns <= 0 ends now: its negative remainder would make the deadline's
 * nanoseconds negative, which pthread_cond_timedwait refuses (EINVAL) rather than time
 * out, and a caller that waits until ETIMEDOUT would wait again at once, for good. One
 * of over AM_WAIT_NS_MOST (~31 years) waits that long: the seconds stay far from
 * time_t's end, and macOS's time left, in nanoseconds, from int64_t's. */
#define AM_WAIT_NS_MOST 1000000000000000000LL
static inline void deadline_after(struct timespec *ts, int64_t ns) {
    clock_gettime(CLOCK_MONOTONIC, ts);
    if (ns <= 0) return;
    if (ns > AM_WAIT_NS_MOST) ns = AM_WAIT_NS_MOST;
    ts->tv_sec += (time_t)(ns / 1000000000);
    ts->tv_nsec += (long)(ns % 1000000000);
    if (ts->tv_nsec >= 1000000000L) { ts->tv_sec++; ts->tv_nsec -= 1000000000L; }
}

/* pthread_cond_timedwait's results: ETIMEDOUT once `until` passed. */
static inline int am_cond_timedwait(pthread_cond_t *cv, pthread_mutex_t *mu,
                                    const struct timespec *until) {
#ifdef __APPLE__
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    int64_t left = (int64_t)(until->tv_sec - now.tv_sec) * 1000000000 +
                   (until->tv_nsec - now.tv_nsec);
    if (left <= 0) return ETIMEDOUT;
    struct timespec rel = {left / 1000000000, left % 1000000000};
    return pthread_cond_timedwait_relative_np(cv, mu, &rel);
#else
    return pthread_cond_timedwait(cv, mu, until);
#endif
}

static inline void nap_ns(long ns) {
    struct timespec ts = {ns / 1000000000L, ns % 1000000000L};
    nanosleep(&ts, NULL);
}

/* What a timeline's device word is raised to for good (a failed or closed timeline, a
 * settled queue's) to end every device wait on it: a CUDA stream's 64-bit wait compares
 * cyclically, (int64_t)(word - target) >= 0, which UINT64_MAX (-1) passes for no target
 * from 0 to 2**63 - 1, and this passes for all of them. */
#define AM_WORD_RELEASED ((uint64_t)INT64_MAX)

static inline void raise_word(_Atomic uint64_t *word, uint64_t v) {
    uint64_t old = atomic_load(word);
    while (old < v && !atomic_compare_exchange_weak(word, &old, v)) {}
}

#if defined(__x86_64__) || defined(__i386__)
#define cpu_relax() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield")
#else
#define cpu_relax() ((void)0)
#endif

/* ---- the functions: timelines.c ------------------------------------------------- */
am_notifier *am_notifier_new(int fd);
void am_notifier_free(am_notifier *n);
int64_t am_notifier_reset(am_notifier *n);
am_watch *am_watch_new(am_timeline *t, am_notifier *n);
void am_watch_free(am_watch *w);
int am_watch_arm(am_watch *w, uint64_t next);
am_timeline *am_timeline_new(void);
void am_timeline_set_word(am_timeline *t, uint64_t *word);
void am_timeline_free(am_timeline *t);
int am_timeline_refs(am_timeline *t);
uint64_t am_timeline_value(am_timeline *t);
void am_timeline_poke(am_timeline *t, uint64_t v);
void am_timeline_near(am_timeline *t, uint64_t v, int64_t until_ns);
void am_timeline_signal(am_timeline *t, uint64_t v);
void am_timeline_signal_here(am_timeline *t, uint64_t v, am_notifier *here);
int am_timeline_spin(am_timeline *t, uint64_t v, long max_ns);
int64_t am_timeline_due(am_timeline *t, uint64_t v);
/* A timeline's failure: a command that signals it was abandoned (its device closed while
 * it waited for a value nobody signalled), or failed (cuda errors, CU_WAITED_FAILED). */
#define AM_ABANDONED (-4)
#define AM_CLOSED (-5)  /* its device closed before it reached the value */
#define AM_COMMAND_FAILED (-6)  /* a Metal command buffer of its queue failed */
#define AM_DISCARDED (-7)  /* dropped before it started: its queue was closed with discard */
void am_timeline_fail(am_timeline *t, uint64_t target, int error, uint64_t value,
                      am_timeline *cause);
void am_timeline_fail_after(am_timeline *t, uint64_t after, uint64_t target, int error,
                            uint64_t value, am_timeline *cause);
void am_timeline_fail_from(am_timeline *t, uint64_t from, int error, uint64_t value,
                           am_timeline *cause);
uint64_t am_timeline_failure(am_timeline *t, int *error, uint64_t *value, am_timeline **cause);
void am_timeline_close(am_timeline *t, uint64_t pending);
AM_HIDDEN int timeline_failed_for(const am_timeline *t, uint64_t target);
AM_HIDDEN void timeline_keep_released(am_timeline *t);
AM_HIDDEN void timeline_signal_failed(am_timeline *t, uint64_t v, uint64_t from, int error,
                                      uint64_t value, am_timeline *cause);
size_t am_timeline_failed_offset(void);
/* cuda_driver.c: wakes the cuda completion threads napping on a command, if any */
AM_HIDDEN void host_signalled(void);
AM_HIDDEN void timeline_set_due(am_timeline *t, uint64_t v, int64_t due_ns);
AM_HIDDEN void timeline_handed(am_timeline *t, uint64_t v);
AM_HIDDEN int timeline_defer(am_timeline *t, uint64_t target, am_kick *k);
AM_HIDDEN int timeline_undefer(am_timeline *t, am_kick *k, int take);
AM_HIDDEN void timeline_kick(am_timeline *t);
AM_HIDDEN void timeline_unref(am_timeline *t);
const char *am_build_digest(void);

/* ---- host_queues.c --------------------------------------------------------------- */
am_queue *am_queue_new(am_timeline *own, long spin_ns, int nice);
int am_queue_call(am_queue *q, void *fn, int nargs, const int64_t *args, uint32_t floats,
                  int64_t *record, uint64_t value);
int am_queue_copy(am_queue *q, void *dst, const void *src, size_t nbytes, int64_t *record,
                  uint64_t value);
int am_queue_signal(am_queue *q, am_timeline *t, uint64_t target, uint64_t value);
int am_queue_wait(am_queue *q, am_timeline *t, uint64_t target, uint64_t value);
int am_queue_copy_part(am_queue *q, void *dst, const void *src, size_t nbytes, size_t part,
                       am_timeline *after, uint64_t after_value, void *claimed, uint64_t first,
                       void *count, uint64_t count_target, void *ready, uint64_t ready_value,
                       int64_t *record, uint64_t value);
int am_queue_fill(am_queue *q, void *dst, size_t nbytes, uint32_t pattern, int pattern_size,
                  int64_t *record, uint64_t value);
void am_queue_close(am_queue *q, int abandon);
int am_host_running(void);
int am_host_starved(void);
void am_queue_discard(am_queue *q);
uint64_t am_queue_failure(am_queue *q, int *error, uint64_t *value, am_timeline **cause);

/* ---- cuda_driver.c, cuda_stream.c, cuda_submit.c, cuda_completion.c (cuda_stream.h) */
typedef struct am_cuq am_cuq;
const char *am_cuda_name(int i);
void am_cuda_set(int i, void *fn);
void am_timeline_host_signal(am_timeline *t, uint64_t v, am_notifier *here);
am_cuq *am_cuq_new(void *ctx, void *stream, am_timeline *timeline, long spin_ns,
                   long max_inflight);
int am_cuq_finish(am_cuq *q, uint64_t value, am_timeline *extra, uint64_t extra_value,
                  long spin_ns, int flags);
int am_cuq_wait_queue(am_cuq *q, am_cuq *other, uint64_t value, uint64_t command);
int am_cuq_launch(am_cuq *q, void *function, const unsigned *dims, void **params, int nparams,
                  uint64_t value);
int am_cuq_copy(am_cuq *q, uint64_t dst, uint64_t src, void *src_ctx, size_t nbytes,
                uint64_t value, long spin_ns);
int am_cuq_fill(am_cuq *q, uint64_t dst, uint32_t pattern, int size, size_t nbytes,
                uint64_t value, long spin_ns);
int am_cuq_memcpy(am_cuq *q, int to_device, uint64_t dst, uint64_t src, size_t nbytes,
                  uint64_t value);
int am_cuq_write(am_cuq *q, void *word, uint64_t target, uint64_t value);
int am_cuq_mark(am_cuq *q, am_timeline *t, uint64_t target, uint64_t value);
int am_cuq_wait(am_cuq *q, void *word, uint64_t target, uint64_t value);
int am_cuq_wait_timeline(am_cuq *q, am_timeline *t, uint64_t target, uint64_t value);
int am_cuq_hand_over(am_cuq *q, uint64_t value);
int am_cuq_failed_call(am_cuq *q);
void am_cuq_stats(am_cuq *q, uint64_t *out);
void am_cuq_set_shared(am_cuq *q);
int am_cuq_error(am_cuq *q, uint64_t *value);
uint64_t am_cuq_reached(am_cuq *q);
void *am_cuq_cause(am_cuq *q, int *error, uint64_t *value);
void am_cuq_close(am_cuq *q, int abandon);
void am_cuq_discard(am_cuq *q);
int am_cuq_wait_foreign(am_cuq *owner, void *ctx, void *stream, uint64_t target, int *call);
/* am_cuq_wait_stream(_end): a stream of another context than ctx (nothing submitted). */
#define AM_OTHER_CONTEXT (-9)
int am_cuq_wait_stream(am_cuq *q, void *ctx, void *stream, uint64_t value, int *call);
int am_cuq_wait_stream_end(am_cuq *q, void *ctx, void *stream, uint64_t value, long spin_ns,
                           int flags, int *call);

/* Whether q has failed: its error (am_cuq's first member, cuda_stream.h), read without its
 * lock, as Python reads it in place. A submitter reads it before its call: a command
 * refused after part of it reached the driver fails the queue from it on, and only a
 * queue that had not failed before can have failed from that command. */
static inline int am_cuq_failed_now(const am_cuq *q) {
    return __atomic_load_n((const int *)(const void *)q, __ATOMIC_RELAXED);
}

/* A runtime call makes a queue's context current on the calling thread and the one it
 * found current again; where the driver refuses that restore, the call still does what
 * it does, and the calling thread gets a note of it (cuda_driver.c, cu_restore): the
 * caller warns, naming the context left unrestored. am_cu_unrestored is the thread's note
 * (its CUresult, 0: none), read in place by the extension right after its call;
 * am_cuda_unrestored takes it (the context to restore, the one current instead, whether
 * that one is unknown: the driver would not say), and am_cuda_unrestored_notes is the
 * number of threads holding one, which the Python paths read in place after theirs. */
extern AM_HIDDEN _Thread_local int am_cu_unrestored;
int am_cuda_unrestored(void **before, void **now, int *now_unknown);
const int *am_cuda_unrestored_notes(void);

/* ---- objc_blocks.c: Objective-C blocks whose invoke functions never take the GIL -----
 * Metal keeps and later calls the blocks given to addCompletedHandler: and
 * notifyListener:atValue:block:. asyncmetal builds them as global blocks (their memory is
 * asyncmetal's, released once they ran) whose invoke functions are these: they only record
 * the argument and raise a timeline, which wakes the waiting loops through their pipes.
 * Layout: the Block ABI's literal, then asyncmetal's own fields. */
typedef struct am_block {
    void *isa;
    int flags;
    int reserved;
    void *invoke;
    void *descriptor;
    am_timeline *timeline;          /* raised when the block runs */
    uint64_t value;                 /* to this value (completion handlers) */
    void *arg;                      /* what the block was called with (the command buffer) */
    _Atomic int calls;
    int notify;                     /* once run, wake am_blocks_wait (something waits for it) */
    void *copy_dst;                 /* a memmove to do first (a copy out to host memory */
    const void *copy_src;           /* that the GPU could not write in place), or none */
    size_t copy_nbytes;
    am_timeline *then;              /* raised after `timeline` (a timeline the command */
    uint64_t then_value;            /* buffer signalled), or none */
    /* Where set: objc_msgSend and the `status` selector, to ask the command buffer the
     * block is called with whether it failed (then `then` fails rather than rises, as
     * for every later command of the queue: see am_timeline.failed_command). */
    void *status_send;
    void *status_selector;
    /* The values of other timelines the command buffer waited for (its device waits):
     * the GPU went on once their events got there, maybe before the completion handler
     * of the command that signals one has said whether it failed. The block raises its
     * timeline only once each of them reached its value or failed (then the queue reports
     * the command as failed). Where set, `ngates` of them. */
    const struct am_gate *gates;
    int ngates;
    int reserved3;
    /* A value of `then` below then_value that another queue's signal gives it first
     * (0: none): a failed signal fails it only once it got there (am_timeline_fail_after;
     * MetalQueue._order). */
    uint64_t then_after;
} am_block;

typedef struct am_gate {
    am_timeline *timeline;
    uint64_t value;
} am_gate;

/* Items are held for a gate (am_block.gates): a timeline that rises, fails or closes
 * wakes the thread that lets them go (am_settle_wake). */
extern AM_HIDDEN _Atomic int am_settling;
AM_HIDDEN void am_settle_wake(void);

void am_block_completed(am_block *b, void *arg);
void am_block_reached(am_block *b, void *event, uint64_t value);
#define AM_HOST_WAIT_OWN 2  /* am_host_wait's `committed` for a Metal queue's own timeline */
int am_host_wait(am_timeline *t, uint64_t target, int committed, int *stop,
                 int64_t timeout_ns);
int am_metal_host_wait(am_timeline *own, uint64_t *seen, am_timeline *t, uint64_t target,
                       int committed, int *stop, int64_t timeout_ns);
void am_host_wait_stop(am_timeline *t, int *stop);
void am_signal_committed(am_timeline *t, uint64_t v);
uint64_t am_signal_committed_to(am_timeline *t);
void am_metal_own(am_timeline *t, void *event, void *send, void *selector, void *retain,
                  void *release);
void am_metal_disown(am_timeline *t);
void am_metal_retain_into(void *const *objs, void **into, size_t n, void *send,
                          void *selector);
void am_metal_release_each(void **objs, size_t n, void *send, void *selector);
int am_metal_unsubmitting(am_timeline *t, uint64_t value, uint64_t to, int fail);
int am_metal_submitting(am_timeline *t, uint64_t value, am_timeline *then,
                        uint64_t then_value);
am_block *am_block_new(void *isa, int reached, am_timeline *timeline, uint64_t value);
void am_block_free(am_block *b);
uint64_t am_blocks_wait(uint64_t seen, int64_t timeout_ns);

#endif
