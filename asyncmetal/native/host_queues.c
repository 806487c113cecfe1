/* The cpu device's queues: one thread each, running its commands in order (kernel
 * calls, memmoves, fills, timeline signals and waits, parts of shared copies) and signalling
 * its own timeline after each. The threads never take the GIL.
 */
#include "amrt.h"

#ifdef __linux__
#include <fcntl.h>
#include <stdio.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

typedef void (*am_kernel)(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                          int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                          int64_t, int64_t);

/* A kernel with floating-point parameters (float, double, _Float16), whose arguments
 * the C calling convention passes in two sequences: integers and pointers in the
 * general registers, floats in the vector registers, each in parameter order, and
 * those past a sequence's registers on the stack, in parameter order, one 8-byte slot
 * each (x86-64 System V: 6 general, 8 vector registers; AArch64 as Linux runs it: 8
 * and 8). So the kernel is called through a type with every register of both kinds
 * and then stack slots enough for all arguments: each argument goes where its kind
 * would put it, the rest are ignored. A float passes in a register's low bytes (the
 * double handed over carries its bits there), and on the stack in the slot's low
 * bytes, as each convention reads it. */
#if defined(__aarch64__)
#define AM_INT_REGS 8
#else
#define AM_INT_REGS 6
#endif
#define AM_FLOAT_REGS 8
#define AM_I8(p) int64_t p##0, int64_t p##1, int64_t p##2, int64_t p##3, int64_t p##4, \
    int64_t p##5, int64_t p##6, int64_t p##7
#define AM_D8 double, double, double, double, double, double, double, double

#if AM_INT_REGS == 8
typedef void (*am_mixed_kernel)(AM_I8(r), AM_D8, AM_I8(s), AM_I8(t));
#else
typedef void (*am_mixed_kernel)(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, AM_D8,
                                AM_I8(s), AM_I8(t));
#endif

static void call_mixed(const am_cmd *c) {
    int64_t regs[AM_INT_REGS] = {0}, stack[AM_MAX_ARGS] = {0};
    double vregs[AM_FLOAT_REGS] = {0};
    int ni = 0, nf = 0, ns = 0;
    for (int i = 0; i < c->nargs; i++) {
        if (c->floats >> i & 1) {
            if (nf < AM_FLOAT_REGS) memcpy(&vregs[nf++], &c->args[i], sizeof(double));
            else stack[ns++] = c->args[i];
        } else if (ni < AM_INT_REGS) {
            regs[ni++] = c->args[i];
        } else {
            stack[ns++] = c->args[i];
        }
    }
    am_mixed_kernel fn = (am_mixed_kernel)c->fn;
    const int64_t *r = regs, *s = stack;
    const double *v = vregs;
#if AM_INT_REGS == 8
    fn(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7],
#else
    fn(r[0], r[1], r[2], r[3], r[4], r[5],
#endif
       v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], s[0], s[1], s[2], s[3], s[4], s[5],
       s[6], s[7], s[8], s[9], s[10], s[11], s[12], s[13], s[14], s[15]);
}

/* The memory of a queue's command segments. The native test harness builds with
 * AM_TEST_HOST_ALLOC, defining these two, to count it. */
#ifdef AM_TEST_HOST_ALLOC
AM_HIDDEN void *am_test_host_alloc(size_t size);
AM_HIDDEN void am_test_host_free(void *p);
#define seg_alloc am_test_host_alloc
#define seg_free am_test_host_free
#else
#define seg_alloc malloc
#define seg_free free
#endif

/* The timeline command c refers to (a signal's, a wait's, a copy part's `after`; NULL:
 * none). The queue holds a reference of it from the push until the command has passed
 * (or was dropped unrun at the queue's close), so that its owner letting go meanwhile
 * (Python's keep-alive, or a finalizer run in another order) never frees a timeline
 * this thread still waits on, signals or reads: freed under a waiter, destroying its
 * condition would wait for that waiter for good. */
static am_timeline *cmd_timeline(const am_cmd *c) {
    if (c->kind == CMD_SIGNAL || c->kind == CMD_WAIT) return c->timeline;
    if (c->kind == CMD_COPY_PART) return c->after;
    return NULL;
}

static int take(am_queue *q, am_cmd *out) {
    /* A short spin first: a command submitted right behind the last one then starts
     * without a sleep/wake round trip. Bounded by spin_ns after each command. */
    if (q->spin_ns > 0 && atomic_load(&q->pending) == 0) {
        int64_t deadline = now_ns() + q->spin_ns;
        while (atomic_load(&q->pending) == 0 && now_ns() < deadline) sched_yield();
    }
    pthread_mutex_lock(&q->mu);
    while (q->count == 0 && !q->stop) {
        q->sleeping = 1;
        pthread_cond_wait(&q->cv, &q->mu);
        q->sleeping = 0;
    }
    if (q->stop == 2 || (q->count == 0 && q->stop)) {
        pthread_mutex_unlock(&q->mu);
        return 0;
    }
    *out = q->first->cmds[q->head++];
    q->count--;
    am_cmdseg *drained = NULL;
    if (q->count == 0) {  /* (then first is last) written from its start again */
        q->head = q->tail = 0;
    } else if (q->head == AM_SEG_CMDS) {  /* the rest are in the next segments */
        drained = q->first;
        q->first = drained->next;
        q->head = 0;
        if (!q->spare) {
            q->spare = drained;
            drained = NULL;
        }
    }
    atomic_fetch_sub(&q->pending, 1);
    pthread_mutex_unlock(&q->mu);
    if (drained) seg_free(drained);
    return 1;
}

/* Queue q's commands from `value` on fail (each does nothing, a signal among them fails
 * its timeline): a wait of theirs ended on a failed timeline, or they were discarded.
 * The queue's own timeline fails from `value` on too, before it gets there (a wait on it
 * that gets there sees the failure, both under its mu); it rises as the commands pass,
 * and settles once the thread has passed every one it was given (passed_all). On the
 * queue's thread. */
static void poison(am_queue *q, uint64_t value, int error, uint64_t cause_value,
                   am_timeline *cause) {
    pthread_mutex_lock(&q->mu);
    if (!q->poisoned || value < q->poisoned) {
        q->poisoned = value;
        q->cause_error = error;
        q->cause_value = cause_value;
        q->cause = cause;
    }
    pthread_mutex_unlock(&q->mu);
    am_timeline_fail_from(q->own, value, error, cause_value, cause);
}

/* Whether q's thread has passed every command it was given (the one it passes now
 * aside). A failed queue (poisoned) then settles, as a cuda queue does (cuda_completion.c,
 * cuq_settle): its own timeline, failed from its first failed command on (poison, before
 * that command passed), goes to UINT64_MAX in the last command's stead, so every wait on
 * it for a value no command of it produces ends, failed -- a host task's (which then
 * raises), a queue's device wait (whose queue then fails from it on) -- rather than wait
 * for a command nobody submits. A command pushed after the look (under q->mu, as the
 * push) is one the timeline failed from before it was submitted: passed without running,
 * its completion reads that failure, never success. On the queue's thread. */
static int passed_all(am_queue *q) {
    pthread_mutex_lock(&q->mu);
    int passed = q->count == 0;
    pthread_mutex_unlock(&q->mu);
    return passed;
}

/* am_queue_close(abandon) sets stop under q->mu, then reads waiting_on and broadcasts
 * t's condition under t->mu, q->mu still held (am_queue_discard sets discard the same
 * way: wake_waiting). So stop and discard are read under t->mu right before each sleep:
 * either the broadcast comes after this thread sleeps (it wakes it), or the store came
 * before this thread took t->mu (it sees it). Read only before taking t->mu, a broadcast
 * landing in between would find nobody asleep and be lost. Returns 0 if abandoned. If t
 * failed instead of reaching target, or the queue was told to discard meanwhile, the
 * wait's command (`value`) and every later one fail (poison), with t's failure behind
 * them or as discarded. */
static int wait_timeline(am_queue *q, am_timeline *t, uint64_t target, uint64_t value) {
    pthread_mutex_lock(&q->mu);
    q->waiting_on = t;
    pthread_mutex_unlock(&q->mu);
    int abandon = 0, discarded = 0;
    pthread_mutex_lock(&t->mu);
    while (atomic_load(&t->value) < target && !timeline_failed_for(t, target)) {
        if ((abandon = __atomic_load_n(&q->stop, __ATOMIC_SEQ_CST) == 2)) break;
        if ((discarded = __atomic_load_n(&q->discard, __ATOMIC_SEQ_CST))) break;
        pthread_cond_wait(&t->cv, &t->mu);
    }
    int failed = !abandon && !discarded && timeline_failed_for(t, target);
    int error = t->fail_error;
    uint64_t cause_value = t->fail_value;
    am_timeline *cause = t->fail_cause ? t->fail_cause : t;
    pthread_mutex_unlock(&t->mu);
    pthread_mutex_lock(&q->mu);
    q->waiting_on = NULL;
    pthread_mutex_unlock(&q->mu);
    if (failed) poison(q, value, error, cause_value, cause);
    if (discarded) poison(q, value, AM_DISCARDED, value, q->own);
    return !abandon;
}

/* Wait until a device wrote t's word up to target: the word is in pinned memory,
 * written by a stream behind the work it follows, and nothing wakes a thread when it
 * changes. So it is polled, by one waiting thread at a time: a spin of up to 20 us, then
 * naps of a 32nd of the time waited so far (10 us to 4 ms: a value seen at most ~3 %
 * late; ~250 wake-ups a second once the wait is long). The others sleep on t's
 * condition; the poller publishes each new value it sees (t->seen) and wakes them, and
 * hands polling over when its own target is reached. Checks for abandon between naps and
 * at every wake (am_queue_close broadcasts t's condition through q->waiting_on). */
static int wait_word(am_queue *q, am_timeline *t, uint64_t target) {
    pthread_mutex_lock(&q->mu);
    q->waiting_on = t;
    pthread_mutex_unlock(&q->mu);
    int ok = 1;
    pthread_mutex_lock(&t->mu);
    while (ok && t->seen < target && atomic_load(t->word) < target) {
        if (__atomic_load_n(&q->stop, __ATOMIC_SEQ_CST) == 2) { ok = 0; break; }
        if (t->polling) { pthread_cond_wait(&t->cv, &t->mu); continue; }
        t->polling = 1;
        pthread_mutex_unlock(&t->mu);
        int64_t start = now_ns();
        uint64_t seen = 0;
        for (;;) {
            uint64_t w = 0;
            for (int i = 0; i < 64; i++) {
                w = atomic_load_explicit(t->word, memory_order_acquire);
                if (w >= target) break;
                cpu_relax();
            }
            if (w > seen) {  /* publish progress: a sleeper may need less than target */
                seen = w;
                pthread_mutex_lock(&t->mu);
                if (w > t->seen) t->seen = w;
                pthread_cond_broadcast(&t->cv);
                pthread_mutex_unlock(&t->mu);
            }
            if (w >= target) break;
            if (__atomic_load_n(&q->stop, __ATOMIC_SEQ_CST) == 2) { ok = 0; break; }
            long waited = (long)(now_ns() - start), nap = waited / 32;
            if (waited < 20000) sched_yield();
            else nap_ns(nap < 10000 ? 10000 : nap > 4000000 ? 4000000 : nap);
        }
        pthread_mutex_lock(&t->mu);
        t->polling = 0;  /* another waiter (a later target) takes over */
        pthread_cond_broadcast(&t->cv);
    }
    pthread_mutex_unlock(&t->mu);
    pthread_mutex_lock(&q->mu);
    q->waiting_on = NULL;
    pthread_mutex_unlock(&q->mu);
    return ok;
}

/* Claim parts of a chunk's use one at a time and copy them, until every part is taken:
 * queues that got there first (woke first, finished their last part first) copy more,
 * so a thread that is late (descheduled, slow to wake) delays the chunk by one part at
 * most, not by a whole share. A use's parts are numbered from `first` on the chunk's
 * claim counter; uses run one after another (each waits, through the stream, for the
 * last one's ready word), so a command that finds the counter past its use's parts
 * has nothing left to do. `empty`: the chunk holds nothing to copy (the mark it waited
 * for is of a command that never ran: its timeline failed for it, am_cuq_mark): the
 * parts are taken and counted, and nothing is copied. */
static void copy_parts(const am_cmd *c, int empty) {
    uint64_t end = c->first + (c->nbytes + c->part - 1) / c->part;
    uint64_t i = atomic_load_explicit(c->claimed, memory_order_relaxed);
    while (i >= c->first && i < end) {
        if (!atomic_compare_exchange_weak_explicit(c->claimed, &i, i + 1, memory_order_relaxed,
                                                   memory_order_relaxed))
            continue;  /* i now holds the counter's value: try the next part */
        size_t offset = (size_t)(i - c->first) * c->part;
        size_t n = c->nbytes - offset < c->part ? c->nbytes - offset : c->part;
        if (!empty) memmove((char *)c->dst + offset, (const char *)c->src + offset, n);
        if (atomic_fetch_add_explicit(c->count, 1, memory_order_acq_rel) + 1 == c->count_target)
            raise_word(c->ready, c->ready_value);
        i = atomic_load_explicit(c->claimed, memory_order_relaxed);
    }
}

/* nbytes (a multiple of size) of dst, each size bytes the pattern's low ones: the first
 * copy, then copies of what is filled, doubling. */
static void fill(char *dst, size_t nbytes, uint32_t pattern, int size) {
    if (size == 1) {
        memset(dst, (int)(pattern & 0xff), nbytes);
        return;
    }
    uint16_t half = (uint16_t)pattern;
    memcpy(dst, size == 2 ? (const void *)&half : (const void *)&pattern, (size_t)size);
    for (size_t done = (size_t)size; done < nbytes;) {
        size_t n = nbytes - done < done ? nbytes - done : done;
        memcpy(dst + done, dst, n);
        done += n;
    }
}

/* Kernels, copies and fills running on the cpu device's queue threads now, in the
 * whole process: a loop that polls rather than sleeps takes a core, which they need
 * once they are as many as the process's cores (am_host_running; the bridge asks). */
static atomic_int host_running;

int am_host_running(void) { return atomic_load_explicit(&host_running, memory_order_relaxed); }

/* Whether the queue threads lately waited for a core: other threads or processes held
 * the cores they run on -- a loop's own thread among them, polling, which as a higher
 * priority (their nice value) leaves a queue thread on its core a sliver of the time.
 * Each thread reads how long it waited on a run queue (Linux: its schedstat), every
 * STARVE_WINDOW_NS at most, after a command: more than three quarters of that time,
 * twice in a row, it starved (once may be another thread's moment on its core, or its
 * own yields while it waits for a command, with other threads ready there).
 * From then until starved_until loops poll no more (am_host_starved; the bridge asks)
 * and so hand their core to the queue threads whenever they have nothing to do. If the
 * threads starve again soon after, the next hold is twice as long (up to
 * STARVE_HOLD_MAX_NS): where other processes hold the cores, a loop that tries to poll
 * again costs the queues a little more rarely each time. */
#define STARVE_WINDOW_NS 5000000
#define STARVE_HOLD_NS 20000000
#define STARVE_HOLD_MAX_NS 1000000000
static _Atomic int64_t starved_until, starved_hold = STARVE_HOLD_NS;

int am_host_starved(void) {
    int64_t until = atomic_load_explicit(&starved_until, memory_order_relaxed);
    return until && now_ns() < until;
}

/* (Threads race here: the hold is a hint, any of their writes will do.) */
static void count_starved(int64_t now) {
    int64_t until = atomic_load(&starved_until), hold = atomic_load(&starved_hold);
    if (now < until) return;  /* held already */
    /* starved again within as long after the last hold as it lasted: hold twice as long */
    if (until && now < until + hold)
        hold = hold * 2 < STARVE_HOLD_MAX_NS ? hold * 2 : STARVE_HOLD_MAX_NS;
    else
        hold = STARVE_HOLD_NS;
    atomic_store(&starved_hold, hold);
    atomic_store(&starved_until, now + hold);
}

/* A queue thread's watch on its own waits for a core. Its schedstat is opened for each
 * read, every STARVE_WINDOW_NS at most (some 4 us more than a read of a file kept
 * open): kept open, each live queue would hold one of the process's descriptors, and a
 * thousand queues would take a thousand from its limit (often 1024). */
typedef struct {
    char path[64];       /* its schedstat, or "": not known here */
    int64_t at, waited;  /* when last read, and the total then */
    int waits;           /* the windows in a row that it mostly waited */
} starve_watch;

static int64_t run_queue_ns(const char *path) {
#ifdef __linux__
    char buf[96];
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;  /* (out of descriptors for now: this window goes untold) */
    ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
    close(fd);
    long long run, waited;
    if (n <= 0) return -1;
    buf[n] = 0;
    return sscanf(buf, "%lld %lld", &run, &waited) == 2 ? (int64_t)waited : -1;
#else
    (void)path;
    return -1;
#endif
}

static void starve_watch_open(starve_watch *w) {
    w->path[0] = 0;
    w->waits = 0;
    w->at = now_ns();
#ifdef __linux__
    /* /proc/thread-self names the calling thread (the queue thread, which alone reads
     * it) as /proc's own PID namespace numbers it. Its id from gettid is of the
     * thread's namespace: where /proc is an outer namespace's (a PID namespace made
     * without mounting its own), no task of this process has that number there. (Linux
     * before 3.17 has no thread-self.) */
    snprintf(w->path, sizeof w->path, "/proc/thread-self/schedstat");
    if ((w->waited = run_queue_ns(w->path)) >= 0) return;
    snprintf(w->path, sizeof w->path, "/proc/self/task/%ld/schedstat",
             (long)syscall(SYS_gettid));
    if ((w->waited = run_queue_ns(w->path)) < 0) w->path[0] = 0;
#endif
}

static void starve_watch_look(starve_watch *w) {
    if (!w->path[0]) return;
    int64_t now = now_ns();
    if (now - w->at < STARVE_WINDOW_NS) return;
    int64_t waited = run_queue_ns(w->path);
    if (waited < 0) return;
    w->waits = (waited - w->waited) * 4 > (now - w->at) * 3 ? w->waits + 1 : 0;
    if (w->waits >= 2) count_starved(now);
    w->at = now;
    w->waited = waited;
}

/* A forked child runs none of them: the parent's queue threads do not exist there. */
static void host_running_forked(void) {
    atomic_store(&host_running, 0);
    atomic_store(&starved_until, 0);
    atomic_store(&starved_hold, STARVE_HOLD_NS);
}

__attribute__((constructor)) static void host_running_register_fork_handler(void) {
    pthread_atfork(NULL, NULL, host_running_forked);
}

/* Whether the mark `target` of t that a copy part waited for is of a command that never
 * ran (t failed for it). */
static int mark_failed(am_timeline *t, uint64_t target) {
    pthread_mutex_lock(&t->mu);
    int failed = timeline_failed_for(t, target);
    pthread_mutex_unlock(&t->mu);
    return failed;
}

static void *run_commands(am_queue *q, starve_watch *starve);

static void *run(void *arg) {
    am_name_thread("asyncmetal-host");  /* a host queue's: its kernels run here */
    starve_watch starve;
    starve_watch_open(&starve);
    return run_commands(arg, &starve);
}

static void *run_commands(am_queue *q, starve_watch *starve) {
    am_cmd c;
    int settled = 0;  /* q's own timeline at UINT64_MAX (passed_all) */
    /* The last command passed, failed, if a wait: the timeline and value it waited for
     * (else NULL), which a failed signal of that timeline right behind it is ordered
     * after (am_timeline_fail_after). Only a failed queue looks. */
    am_timeline *order = NULL;
    uint64_t order_target = 0;
#ifdef __linux__
    /* Kernels run here, on the host's cores, which the event loops need too: at a nice
     * value above the loop's this thread yields to a loop thread that wakes (a lower
     * weight for the scheduler), so a machine with fewer cores than busy queues starves
     * the kernels, not the loops. (Linux: a thread's nice value is its own. One below
     * the process's needs privileges: refused, the thread keeps the process's.) */
    if (q->nice >= 0) setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), q->nice);
#endif
    while (take(q, &c)) {
        /* A failed command does nothing (nothing runs on what was never produced), but
         * fails the timeline it signals, and raises the queue's own as any command does
         * (its objects are let go of once past). A shared copy's part runs all the
         * same: a stream waits for its chunk's ready word (the cuda staging queues'
         * commands, which wait on no timeline). */
        /* Discarded (am_queue_discard): this command and every later one never run. */
        if (__atomic_load_n(&q->discard, __ATOMIC_SEQ_CST) && c.kind != CMD_COPY_PART &&
            (!q->poisoned || c.value < q->poisoned))  /* (written by this thread only) */
            poison(q, c.value, AM_DISCARDED, c.value, q->own);
        int failed = q->poisoned && c.value >= q->poisoned && c.kind != CMD_COPY_PART;
        /* The row's value goes last, so a reader can tell a torn row; a command that
         * never runs leaves it at 0: it has no times. */
        if (c.record) {
            __atomic_store_n(&c.record[2], 0, __ATOMIC_RELEASE);
            if (!failed) c.record[0] = now_ns();
        }
        /* A failed signal right behind a wait on its timeline: the wait by which
         * Queue.signal orders it after another queue's lower signal of it, not run yet
         * (a wait a signal comes right behind is for a value a signal submitted before
         * gets to: Queue.signal refuses one that would wait for itself). The timeline
         * still gets that value first: it fails only once it got there, as a cuda
         * queue's signal held behind such a wait fails (cuda_submit.c,
         * cuq_wait_behind_skip) -- a value a healthy queue signals is never reported
         * failed. (A discarded signal names itself.) */
        if (failed && c.kind == CMD_SIGNAL)
            am_timeline_fail_after(c.timeline, order == c.timeline ? order_target : 0,
                                   c.target, q->cause_error,
                                   q->cause_error == AM_DISCARDED ? c.value : q->cause_value,
                                   q->cause);
        int busy = !failed && (c.kind == CMD_CALL || c.kind == CMD_COPY || c.kind == CMD_FILL);
        if (busy) atomic_fetch_add_explicit(&host_running, 1, memory_order_relaxed);
        if (!failed) switch (c.kind) {
        case CMD_CALL:
            if (c.floats) {
                call_mixed(&c);
                break;
            }
            ((am_kernel)c.fn)(c.args[0], c.args[1], c.args[2], c.args[3], c.args[4], c.args[5],
                              c.args[6], c.args[7], c.args[8], c.args[9], c.args[10],
                              c.args[11], c.args[12], c.args[13], c.args[14], c.args[15]);
            break;
        case CMD_COPY:
            memmove(c.dst, c.src, c.nbytes);
            break;
        case CMD_FILL:
            fill(c.dst, c.nbytes, c.pattern, c.pattern_size);
            break;
        case CMD_SIGNAL:
            am_timeline_signal(c.timeline, c.target);
            break;
        case CMD_WAIT:
            if (!wait_timeline(q, c.timeline, c.target, c.value)) {
                timeline_unref(c.timeline);  /* (abandoned: the push's reference) */
                return NULL;
            }
            break;
        case CMD_COPY_PART:  /* parts of a chunk; the last one done marks it ready */
            if (c.after && !wait_word(q, c.after, c.target)) {
                timeline_unref(c.after);
                return NULL;
            }
            copy_parts(&c, c.after && mark_failed(c.after, c.target));
            break;
        }
        am_timeline *held = cmd_timeline(&c);
        if (held) timeline_unref(held);  /* past it: the push's reference */
        if (busy) atomic_fetch_sub_explicit(&host_running, 1, memory_order_relaxed);
        if (busy) starve_watch_look(starve);
        if (c.record && !failed) {
            c.record[1] = now_ns();
            __atomic_store_n(&c.record[2], (int64_t)c.value, __ATOMIC_RELEASE);
        }
        /* (poisoned: written by this thread only) */
        if (q->poisoned) {
            if (!settled) settled = passed_all(q);
            order = c.kind == CMD_WAIT ? c.timeline : NULL;  /* (compared only) */
            order_target = c.target;
        }
        am_timeline_signal(q->own, settled ? UINT64_MAX : c.value);
    }
    return NULL;
}

am_queue *am_queue_new(am_timeline *own, long spin_ns, int nice) {
    am_queue *q = calloc(1, sizeof *q);
    if (!q) return NULL;
    q->first = q->last = seg_alloc(sizeof(am_cmdseg));
    if (q->first) q->first->next = NULL;
    q->own = own;  /* (referenced below, once the queue is made: until its close) */
    q->spin_ns = spin_ns;
    q->nice = nice;
    q->forks = am_forks;
    pthread_mutex_init(&q->mu, NULL);
    pthread_cond_init(&q->cv, NULL);
    atomic_fetch_add(&own->refs, 1);  /* (the thread raises it after every command) */
    if (!q->first || pthread_create(&q->thread, NULL, run, q) != 0) {
        if (q->first) seg_free(q->first);
        timeline_unref(own);
        free(q);
        return NULL;
    }
    return q;
}

/* On the caller's thread (an event loop's): a bounded time whatever the number queued,
 * at most one segment's allocation. */
static int push(am_queue *q, const am_cmd *c) {
    am_timeline *held = cmd_timeline(c);
    if (held) atomic_fetch_add(&held->refs, 1);  /* (cmd_timeline: until it passed) */
    pthread_mutex_lock(&q->mu);
    if (q->tail == AM_SEG_CMDS) {
        am_cmdseg *s = q->spare;
        if (s) {
            q->spare = NULL;
        } else if (!(s = seg_alloc(sizeof *s))) {
            pthread_mutex_unlock(&q->mu);
            if (held) timeline_unref(held);
            return -1;
        }
        s->next = NULL;
        q->last->next = s;
        q->last = s;
        q->tail = 0;
    }
    q->last->cmds[q->tail++] = *c;
    q->count++;
    atomic_fetch_add(&q->pending, 1);
    if (q->sleeping) pthread_cond_signal(&q->cv);
    pthread_mutex_unlock(&q->mu);
    return 0;
}

int am_queue_call(am_queue *q, void *fn, int nargs, const int64_t *args, uint32_t floats,
                  int64_t *record, uint64_t value) {
    am_cmd c = {.kind = CMD_CALL, .fn = fn, .nargs = nargs, .floats = floats, .record = record,
                .value = value};
    if (nargs < 0 || nargs > AM_MAX_ARGS) return -2;
    memcpy(c.args, args, (size_t)nargs * sizeof(int64_t));
    return push(q, &c);
}

int am_queue_copy(am_queue *q, void *dst, const void *src, size_t nbytes, int64_t *record,
                  uint64_t value) {
    am_cmd c = {.kind = CMD_COPY, .dst = dst, .src = src, .nbytes = nbytes, .record = record,
                .value = value};
    return push(q, &c);
}

int am_queue_fill(am_queue *q, void *dst, size_t nbytes, uint32_t pattern, int pattern_size,
                  int64_t *record, uint64_t value) {
    if (pattern_size != 1 && pattern_size != 2 && pattern_size != 4) return -2;
    if (nbytes % (size_t)pattern_size) return -2;
    am_cmd c = {.kind = CMD_FILL, .dst = dst, .nbytes = nbytes, .pattern = pattern,
                .pattern_size = pattern_size, .record = record, .value = value};
    return push(q, &c);
}

int am_queue_signal(am_queue *q, am_timeline *t, uint64_t target, uint64_t value) {
    am_cmd c = {.kind = CMD_SIGNAL, .timeline = t, .target = target, .value = value};
    return push(q, &c);
}

int am_queue_wait(am_queue *q, am_timeline *t, uint64_t target, uint64_t value) {
    am_cmd c = {.kind = CMD_WAIT, .timeline = t, .target = target, .value = value};
    return push(q, &c);
}

/* A chunk's use's host copy, shared by queues (each that shares it gets this command):
 * once `after`'s device word (a stream writes it; no wait if NULL) reaches after_value,
 * claim `part`-byte parts of the nbytes on *claimed -- this use's are numbered first,
 * first+1, ... -- copy each and count it in *count; the part that brings the count to
 * count_target raises *ready to ready_value (a word a stream waits on): every byte is
 * in. Both counters run on over a chunk's uses, never reset, so a use may be submitted
 * before the last one's parts ran: its parts run only after them (they wait, through
 * the stream, on the ready word those parts raise). */
int am_queue_copy_part(am_queue *q, void *dst, const void *src, size_t nbytes, size_t part,
                       am_timeline *after, uint64_t after_value, void *claimed, uint64_t first,
                       void *count, uint64_t count_target, void *ready, uint64_t ready_value,
                       int64_t *record, uint64_t value) {
    if (part == 0) return -2;
    am_cmd c = {.kind = CMD_COPY_PART, .dst = dst, .src = src, .nbytes = nbytes, .part = part,
                .after = after, .target = after_value, .claimed = claimed, .first = first,
                .count = count, .count_target = count_target, .ready = ready,
                .ready_value = ready_value, .record = record, .value = value};
    return push(q, &c);
}

/* The first of q's commands that failed (0: none), and the failure behind it. */
uint64_t am_queue_failure(am_queue *q, int *error, uint64_t *value, am_timeline **cause) {
    pthread_mutex_lock(&q->mu);
    uint64_t failed = q->poisoned;
    *error = q->cause_error;
    *value = q->cause_value;
    *cause = q->cause;
    pthread_mutex_unlock(&q->mu);
    return failed;
}

/* Wake q's thread from the wait it is in, if any, to look at stop and discard again.
 * Under q->mu: the thread clears waiting_on under it once its wait ended, and only then
 * passes the wait's command, whose objects keep the timeline waited on alive -- let go
 * of past it, the timeline may be freed at once (on another thread) while this still
 * broadcasts its condition. (Lock order: q->mu, then t->mu; the thread never takes q->mu
 * with a timeline's mu held.) */
static void wake_waiting(am_queue *q) {
    am_timeline *t = q->waiting_on;
    if (t) {
        pthread_mutex_lock(&t->mu);
        pthread_cond_broadcast(&t->cv);
        pthread_mutex_unlock(&t->mu);
    }
}

/* Drop q's commands that have not started: each that the thread takes from now on fails
 * without running (a signal among them fails its timeline), as does a device wait it is
 * in (it ends); a command running now finishes. The queue's own timeline still rises
 * through them (quickly: nothing runs), failed from the first one dropped, with
 * AM_DISCARDED as the cause, and settles past them (passed_all). Every later command
 * fails too: the queue is closed next. */
void am_queue_discard(am_queue *q) {
    if (q->forks != am_forks) return;  /* (a parent's queue, in a forked child) */
    pthread_mutex_lock(&q->mu);
    __atomic_store_n(&q->discard, 1, __ATOMIC_SEQ_CST);
    wake_waiting(q);
    pthread_mutex_unlock(&q->mu);
}

/* Stop the thread and free the queue. abandon=0: after everything queued has run;
 * abandon=1: now, leaving a pending device-side wait (interpreter exit). Blocks. In a
 * forked child, a queue of the parent is left as it is. */
void am_queue_close(am_queue *q, int abandon) {
    if (q->forks != am_forks) return;  /* in a child, the parent's: no thread to join */
    pthread_mutex_lock(&q->mu);
    __atomic_store_n(&q->stop, abandon ? 2 : 1, __ATOMIC_SEQ_CST);
    pthread_cond_signal(&q->cv);
    if (abandon) wake_waiting(q);
    pthread_mutex_unlock(&q->mu);
    pthread_join(q->thread, NULL);
    pthread_mutex_destroy(&q->mu);
    pthread_cond_destroy(&q->cv);
    /* (Abandoned: some still queued, never to run; their pushes' references go.) */
    am_cmdseg *s = q->first;
    for (size_t i = q->head, left = q->count; left; left--, i++) {
        if (i == AM_SEG_CMDS) {
            s = s->next;
            i = 0;
        }
        am_timeline *held = cmd_timeline(&s->cmds[i]);
        if (held) timeline_unref(held);
    }
    for (am_cmdseg *next; (s = q->first); q->first = next) {
        next = s->next;
        seg_free(s);
    }
    if (q->spare) seg_free(q->spare);
    timeline_unref(q->own);  /* (am_queue_new's) */
    free(q);
}
