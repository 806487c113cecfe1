/* The cuda queues of asyncmetal's native runtime against a simulated driver, so
 * that their completion logic runs on machines without a GPU (tests/backends/cuda/test_cuda_runtime.py).
 *
 * The simulated driver is tests/support/fakes/fake_cuda_driver.c.
 *
 * Checks, each printing "ok <name>" or exiting non-zero with a message:
 *   order     a queue's timeline never reports a command its stream has not run
 *   cross     waits of one queue on another's values, submitted from two threads before
 *             and after those values exist: none deadlocks, each runs after its value
 *   fault     a faulting kernel fails its completion and every later one, never reports
 *             them as done, and the queue reports the first failed value
 *   faultheld a queue whose command faulted while it held a device wait on the host (for
 *             what nothing handed over yet), a signal and a kernel behind it: what it
 *             held fails with the fault (the signal's timeline settles, failed, naming
 *             the faulted command) and a close to finish returns, neither waiting for
 *             that wait's kick
 *   faulthanding as faultheld, the wait reaching the hand-over as the command faults: the
 *             wait, put back held then, goes with the fault, and a close to finish returns
 *   long      events are plain until a command runs long, then blocking-sync (and blocked
 *             on, never a plain one) until commands are quick again; a command finished
 *             as long-running gets a blocking-sync event at once and changes nothing
 *   events    every event the queues made is destroyed by am_cuq_close
 *   causal    a wait on another queue's value, once confirmed, confirms that value there
 *             (before that queue's own thread saw it), which a later sticky error no
 *             longer fails
 *   bound     with a driver whose launches block once a stream is deep (as the H200's do
 *             with blocking-sync events), a bounded queue never makes a blocking call:
 *             commands past the bound are held and submitted by the completion thread,
 *             in order
 *   refused   a held command the driver refuses when it is handed over fails from its
 *             value on; the commands before it still complete as they run, never early
 *   discard   a queue told to discard drops what it holds on the host (its commands
 *             past the bound in flight) and fails from the first of them: those in
 *             flight run and complete, never early, then the queue settles; a dropped
 *             signal's timeline fails, naming the discard, and a queue that waited for
 *             it on the device fails from that wait on
 *   partial   a held command refused after part of it was handed over settles its queue
 *             only once the stream is past that part (its kernel ran)
 *   hostwait  a host queue (a cpu or npy queue's thread) waits on a cuda queue's
 *             timeline: for a value of a held command the driver refused, or of a
 *             kernel that faulted, it fails its commands from that wait on (none runs),
 *             naming the failed command -- the settled timeline carries the failure --
 *             while a wait for a value confirmed before it passes
 *   hostheld  a queue's device wait on a host queue's timeline (no device word: a cpu
 *             or npy queue's) is held on the host until that queue's thread raised it,
 *             and the work behind it is handed over only then; a wait on one whose
 *             device closes instead fails the queue from that wait on, naming the close,
 *             and the kernel behind it never launches
 *   hostfailed a queue's device wait on a host queue's timeline that fails instead (a
 *             cpu queue's command behind a failed wait of its own), held when it fails
 *             or submitted after: the commands from that wait on never reach the
 *             stream -- no kernel launches, no fill writes, as a cpu queue's never run
 *             -- and fail, the queue from the wait's value on (CU_HELD_FAILED), naming
 *             the failure the host timeline carries; a signal among them fails its
 *             timeline with it; a staging chunk's mark among them has the host thread
 *             waiting for it copy nothing out of the chunk (which the stream never
 *             wrote) and still mark the chunk ready, where a mark of a command that
 *             runs has it copied
 *   skipsignal a signal of a timeline no queue owns whose command follows a failed wait
 *             on a host queue's timeline (passed, not run) writes nothing, and fails
 *             its timeline before its hand-over releases another queue's wait held for
 *             it: that queue's commands from the wait on never reach the stream (no
 *             fill writes, no kernel launches) and fail (CU_HELD_FAILED), naming the
 *             host timeline's failure; a wait for the value of a signal of that queue
 *             in flight before it still succeeds
 *   twosignals a signal passed behind a failed wait, submitted after another queue's
 *             signal of the same timeline to a lower value that is in flight (handed
 *             over, not confirmed): the timeline fails from the value after that one,
 *             and a queue's wait for the lower value, handed over once the failure is
 *             marked, is made, and the work behind it runs and succeeds
 *   poisonsignal a signal passed behind a device wait found failed (its queue poisoned),
 *             behind a signal of the same timeline of that queue in flight after that
 *             wait (known to fail): the timeline fails from that one's value, so a
 *             queue's wait for it, handed over then, is not made, and nothing behind it
 *             runs (CU_HELD_FAILED, naming the failure)
 *   poisonflight a queue that learns its device wait was for a value never produced
 *             fails the timelines its signals handed over after that wait (in flight)
 *             are to raise, from their values: a queue's wait for one of those, handed
 *             over then, is not made, and nothing behind it runs (CU_HELD_FAILED)
 *   poisonlater the same, for a signal another queue's passed signal counted as sure
 *             (its timeline marked failed from a later value already): the mark is
 *             lowered to that signal's value
 *   refusedpart a command the driver refuses at once after part of it reached the driver
 *             (a staged copy's later chunk after its earlier ones: here a word write
 *             after a kernel of the same command; or a launch whose event record is
 *             refused) fails its queue from that command on, with the driver's error,
 *             rather than be taken back as never run while that part runs: the queue
 *             takes no more commands, and settles only once the stream is past that part
 *   release   a queue's device wait on a value of a queue that failed that way (held
 *             on the host until that command reached the driver, which refused it)
 *             ends rather than blocking for good, without being made: the commands
 *             from that wait on never reach the stream (no kernel launches) and fail
 *             (CU_HELD_FAILED), and so do those of a queue that waited for them, each
 *             naming the command that failed
 *   failedqueue a queue's command that failed on the device (it ran after a device wait
 *             on a timeline whose signal failed, and was confirmed failed): a wait of
 *             another queue for its value, submitted once that is known, is not made,
 *             and the commands behind it never reach the stream (no kernel launches)
 *             and fail (CU_HELD_FAILED), naming the failure it came to
 *   poisonheld a queue's device wait, on the device already, for a value of a queue that
 *             then fails: its commands handed over behind the wait run (they cannot be
 *             recalled) and fail, and those it still held on the host (past its bound)
 *             never reach the stream, and fail too
 *   poisondeferred a queue's device waits held on the host (for a timeline's value no
 *             signal handed over gets to, for another queue's value past all it was
 *             given) behind its device wait, on the device already, for a value that
 *             then fails: once it learns of the failure they are neither held nor made
 *             (nothing may produce those values), and the queue settles, failing from
 *             that wait on
 *   promisedlater a wait behind a failed wait, not made as it was handed over (nothing
 *             promised its value), is not confirmed as a wait once a signal of that
 *             value, which never runs, is submitted before the queue's thread gets to
 *             it: the queue settles, failing from the failed wait
 *   refusedpromise the same, the later wait for a value of a timeline whose only signal
 *             was refused (its queue discarded before): a refused signal was never
 *             submitted, so it orders nothing, and the queue settles
 *   signal    a signal of a timeline no queue owns, by a queue that waited for a refused
 *             command's value (or held behind a refused command of its own), fails:
 *             the timeline settles (value at UINT64_MAX, word released), so no wait on it
 *             blocks for good, and a queue that waited on it on the device fails from
 *             that wait on, naming the refused command; a wait released by a signal
 *             that succeeded (a queue's, or the host's) succeeds
 *   signalrecord a held signal of a timeline no queue owns whose event record the driver
 *             refuses when it is handed over fails: the timeline settles, so neither a
 *             host wait on it nor a queue's device wait held for it is left waiting,
 *             and that queue fails from its wait on, naming the refused command, its
 *             kernel behind the wait never launched
 *   nomemory  out of memory to hold an operation: what its command holds goes with it
 *             (a held wait's kick too) and the queue goes on, the value given back;
 *             out of memory once part of a command reached the driver (a signal whose
 *             end finds the ring full): the queue fails from that command on, the
 *             signal's timeline settles once its word write landed (not before, nor
 *             lowered by it after), and the queue settles once what came before ran
 *   unfencedsignal a signal whose end (its event record) the driver refuses once its
 *             word write reached the driver, and the fence behind it too, for lack of
 *             memory (taken on a later try): its timeline fails only once the stream
 *             is past that write, which then cannot lower the released word, naming
 *             the refused command
 *   stickyfence the same with a sticky refusal (the context faulted), the fence's
 *             too: the queue and the signal's timeline settle at once
 *   nocontext a queue whose completion thread the driver refuses to make its context
 *             current: the commands handed over and held before fail, naming
 *             cuCtxSetCurrent (a signal held fails its timeline), the queue settles
 *             and takes nothing more, and a close (to finish, abandoned) ends
 *   refencekept a signal kept for a fence (its word write reached the driver) while the
 *             completion thread records that fence again, slowly: once the fence is
 *             confirmed, the signal's timeline fails (it is not forgotten)
 *   wallclock the wall clock read 30 s ahead of the one the kernel keeps (as if
 *             stepped back just after each read): a kick's nap, a host wait on a
 *             timeline, a wait for a block to run, and a refused fence's nap before
 *             it is recorded again (cuq_refence) all end on time, not 30 s late
 *   refenceabandon the same, closed with abandon while the fence is in the driver: the
 *             close returns only once the fence's driver calls are done, so the
 *             signal's timeline may be let go then
 *   nocontextkept a signal kept for a fence while the completion thread of a queue that
 *             could not make its context current fails another signal's timeline:
 *             that signal's timeline fails too
 *   nocontextlowered the signal in flight of a queue whose completion thread could not
 *             make its context current, its word write landing after its timeline failed
 *             (lowering the released word): a queue's device wait for more of that
 *             timeline, held until then, goes on, is not made, and fails its queue from
 *             the wait on, naming the failure, the kernel behind it never launched
 *   fencegone a command part of which the driver has (a kernel, a signal's word write)
 *             whose end and fence the driver refuses with an error after which nothing
 *             of the context runs (the context destroyed or invalid, the driver
 *             deinitialized or not initialized): at once, at the hand-over of the
 *             held command, or on a later try after refusals for lack of memory, the
 *             queue and the signal's timeline settle, failed with that error and
 *             naming the refused command, and a close to finish returns
 *   kick      a host signal of a timeline a stream waits on cuts the completion
 *             thread's nap short
 *   hostnap   a stream's wait on a timeline only the host signalled naps until a kick
 *             (1 ms at a time) -- on after another timeline's host signal, not polled
 *             -- and a host signal, a queue's signal handed over and a host queue's
 *             raise of the word each kick it
 *   handkick  a stream's wait for a signal another queue handed over already (its
 *             word write behind a gate) is no host-only wait: further signals of that
 *             timeline handed over while its thread naps kick no thread
 *   abandon   closing with abandon returns while the completion thread naps on, or is
 *             blocked on, a command behind a wait nobody signals (a blocked one frees the
 *             queue itself once it returns)
 *   context   a submission leaves the calling thread's current context as it found it
 *             (none, or another library's), though it made the queue's current
 *   predict   a queue learns how long its launches run: it publishes when the last one
 *             should be done, and its completion thread naps until just before that
 *             and confirms them by polling (no blocking wait, no nap after the end);
 *             far shorter ones after them are seen soon, not a long nap later
 *   near      a loop waiting for a long command's value is woken ahead of its end and
 *             asked to stay awake until shortly after it (not by the end itself), also
 *             when a host signal cut the completion thread's nap short long before the
 *             end (not asked to stay awake from then on); a loop waiting for a later
 *             value is not
 *   released  every event any queue made was destroyed once its completion thread
 *             stopped, abandoned ones' included (those in flight, pooled and spare)
 *   foreign   another library's stream waits for a queue's value without becoming a
 *             queue: for a value still held on the host, the queue's commands up to it
 *             are handed over at once (past its bound) and the stream waits on its
 *             event; on an event for one submitted, not at all for one confirmed; its
 *             kernels run only after the value; the context is kept
 *   unlocked  a stream's wait on a queue's event that is slow in the driver holds up
 *             neither submissions to that queue nor its confirmations, and the event
 *             is neither recorded again (reused) nor destroyed until the call returned
 *   waitstream a queue waits for another library's stream without adopting it: the
 *             work submitted there until then (an event recorded now), in the queue's
 *             order -- behind what it holds on the host -- and its commands after the
 *             wait run only once that work ran; the caller's context is kept; the event
 *             is one of the queue's own, recorded again once waited for (waits one
 *             after another make no new events), and destroyed when the held wait is
 *             abandoned
 *   orphaned  a queue's wait held for another queue's command, which that queue held on
 *             the host when it was closed with abandon, goes on (it never comes)
 *             without being made, and the queue fails from that wait on, naming the
 *             abandon, its kernel behind the wait never launched
 *   abandonwait a queue closed with abandon while its command waits for a timeline
 *             nobody signals: commands of queues that waited on the device for its
 *             abandoned commands fail once run (the close raised that timeline's word,
 *             so they ran behind commands that waited for nothing), naming the abandon,
 *             and so do those that waited for them; a wait for one of its commands
 *             confirmed before succeeds
 *   closedwait a queue's device wait for a value another queue was never given before it
 *             closed ends (held on the host until then, it is not made), and the
 *             commands from that wait on fail without running, naming the close
 *   uafwaiter a queue abandoned after a queue that waited for it closed (its timeline
 *             freed): nothing of the closed queue's is read
 *   confirmedfirst a queue abandoned when its command was confirmed through another
 *             queue's wait but not by its own thread: a wait for that command succeeds
 *   kickmiss  a queue abandoned while a kick's thread hands its command over (neither
 *             held nor in flight): a wait for that command fails
 *   idleabandon an idle queue abandoned: a wait for a value it was never given fails
 *             (what follows it never runs)
 *   forked    a forked child's discard and close of a queue of its parent (whose lock a
 *             thread of the parent held at the fork) return at once, touching nothing;
 *             the parent's queue goes on
 *   shared    streams sharing one hardware queue (a wait there holds up every stream
 *             behind it): a queue's wait for another queue's command still held on the
 *             host, a wait on a timeline before the signal that raises it was
 *             submitted, and another library's stream waiting for a held command all
 *             end, and a wait a host signal releases is held until that signal: no
 *             stream waits for work handed over behind it; a wait on a timeline only
 *             the host has signalled goes to the device at once
 *   handover  another library's stream waits for a command held behind a queue's wait
 *             whose kick is under way on another thread (which still hands another
 *             queue's kicked work over, slowly): the wait is made once the kick ran,
 *             not refused as waiting for what nothing handed over, and waiting for
 *             the kick keeps no core busy
 *   handsignal another library's stream waits for a command held behind a queue's wait
 *             on a timeline whose signal another queue holds on the host: refused
 *             until that queue's commands up to the signal are handed over, then made,
 *             on the command's event
 *   closing   a queue closed while another thread (a host signal's kick) hands its held
 *             operations over: closed to finish, it returns only once the command being
 *             handed over was confirmed; abandoned, it returns only once that thread's
 *             driver call on the stream returned (the stream may be destroyed then),
 *             however long that call takes,
 *             and leaves no kick on a timeline nothing signalled (which may be freed)
 *   closekick a wait held on the host for a timeline whose device closes goes on, and fails
 *             (what follows it never runs)
 *   closeearly a timeline marked failed ahead of what it reached (a passed signal, behind
 *             one of its queue's in flight) whose device closes once that queue was
 *             abandoned: a host queue's wait for a value below the mark ends, failed,
 *             naming the close
 *   lowered   a signal's word write landing after the timeline was released (a store,
 *             not a max) does not leave a device wait it released waiting
 *   foreignabandon another library's stream waiting on the word of a failed queue that
 *             is abandoned before it settled gets to its end
 *   stress    queues on one shared hardware queue, bounded, submitted to from two
 *             threads: waits on each other's commands (held or not), on a timeline a
 *             queue signals and on one the host signals, while a third thread has
 *             other libraries' streams wait for their commands (refused only behind a
 *             wait on a timeline); every wait ends, nothing fails
 *   discardkick a discard drops a queue's held wait while that wait's kick comes due
 *             (run by a host signal between the discard's unlock and its taking the
 *             kick off, at the runtime's test hook): the kick's reference of the queue
 *             ends once, the queue settles, failed from the wait, and is freed
 *   discardstress rounds of a bounded queue given kernels, signals and waits held until
 *             another queue's signal, the host's signal or another queue's command
 *             reached the driver (or for a value nothing signals), discarded while its
 *             completion thread, that queue's (running kicks), the host's thread
 *             (running kicks), a queue waiting on its values and another library's
 *             stream waiting for them (handing its work over) all work on it, then
 *             closed (to finish, or abandoned): it settles; the commands before the
 *             first dropped one ran, in order, the others never did; a dropped
 *             signal's timeline fails, naming the discard; the waits for dropped values
 *             fail their queue from there, the others succeed; nothing stays held
 */
#define _GNU_SOURCE  /* RTLD_NEXT */
#include "fake_cuda_driver.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

static void reach(am_timeline *t, uint64_t value, const char *what);
static void close_within(am_cuq *q, long ns, const char *what);

/* Rounds of a stress check (waitraceclose, chainclose): a fifth under a sanitizer, where
 * each round's queue threads start and stop many times slower (the whole binary has one
 * minute in the GPU machine's test run). */
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
#define STRESS_ROUNDS(n) ((n) / 5)
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer) || __has_feature(address_sanitizer)
#define STRESS_ROUNDS(n) ((n) / 5)
#endif
#endif
#ifndef STRESS_ROUNDS
#define STRESS_ROUNDS(n) (n)
#endif

/* ---- waiting ------------------------------------------------------------------------
 * A check waiting for what the runtime's threads or the simulated driver's streams do
 * sleeps, as the driver's own waits do (fake_cuda_driver.c, "waiting"): a check spinning
 * on a 2-core machine takes a core from the threads it waits for, and under
 * ThreadSanitizer every look is many times dearer. A wait for a timeline's value (reach)
 * sleeps on the timeline's condition, which every raise of its value broadcasts under its
 * mu (timelines.c), looking again on its own at least every LOOK_NAP_MOST_NS; any other
 * wait -- an atomic the driver, a hook or the runtime sets, a queue's counts, a failure
 * mark -- looks again after a few yields, then after naps doubling from
 * LOOK_NAP_LEAST_NS to LOOK_NAP_MOST_NS (look_again): it sees what it waits for that
 * much later at most, which no check times. A loop that checks a timeline at each look
 * as it rises (order, fault, refused, discard: nothing confirmed before it ran) looks
 * so too: fewer looks, each still checked. (Loops that nap already -- the long
 * commands' waits, a check's own timing -- are left as they are, and a few yield on
 * purpose for a moment: a stress thread before the first value it may use, a loop's
 * pipe's writer about to finish.) */
#define LOOK_SPINS 8
#define LOOK_NAP_LEAST_NS 2000
#define LOOK_NAP_MOST_NS 200000

/* After the `*backoff`th look (from 0) found what it waits for not there yet. */
static void look_again(int64_t *backoff) {
    int64_t n = (*backoff)++;
    if (n < LOOK_SPINS) {
        sched_yield();
        return;
    }
    n -= LOOK_SPINS;
    nap_ns(n >= 7 ? LOOK_NAP_MOST_NS : LOOK_NAP_LEAST_NS << n);  /* (2000 << 7 > most) */
}

static void check_order(void) {
    fake_queue f = queue_new();
    const uint64_t n = 20000;
    for (uint64_t v = 1; v <= n; v++) {
        if (launch(f, NULL, (int64_t)v, v)) die("order: launch failed");
        uint64_t reached = am_timeline_value(f.t);
        if ((long)reached > atomic_load(&f.s->ran)) die("order: confirmed before it ran");
    }
    for (int64_t look = 0; am_timeline_value(f.t) < n; look_again(&look)) {
        uint64_t reached = am_timeline_value(f.t);
        if ((long)reached > atomic_load(&f.s->ran)) die("order: confirmed before it ran");
    }
    for (uint64_t i = 0; i < n; i++)  /* n < the log's length */
        if (f.s->log[i] != (int64_t)i + 1) die("order: the stream ran commands out of order");
    queue_free(f, 0);
    puts("ok order");
}

/* Fills of each pattern size, on a queue bounded to 2 commands in flight (so most are
 * held, then handed over by its completion thread), behind kernels of a few us: each in
 * stream order -- a later fill over an earlier one's range wins -- confirmed only once
 * it ran, and the bytes around each range untouched. Refused: a size that is not 1, 2
 * or 4, a length or an address that is not a multiple of it (nothing submitted). */
static void check_fill(void) {
    fake_queue f = queue_bounded(2);
    static uint8_t memory[4096 + 8];
    uint8_t *base = memory + (8 - (uintptr_t)memory % 8) % 8;  /* 8-byte aligned */
    memset(base, 0xEE, 4096);
    static kernel slow = {0, 20000, NULL, 0};
    uint64_t value = 0;
    for (int round = 0; round < 64; round++) {
        int size = 1 << (round % 3);
        uint64_t at = (uint64_t)(uintptr_t)base + 64 * (uint64_t)(round % 32) + 8;
        uint32_t pattern = 0x01020304u * (uint32_t)(round + 1);
        if (launch(f, &slow, round, ++value)) die("fill: launch failed");
        if (am_cuq_fill(f.q, at, pattern, size, 48, ++value, 0)) die("fill: refused");
    }
    int64_t deadline = now_ns() + 10000000000LL;
    for (int64_t look = 0; am_timeline_value(f.t) < value; look_again(&look))
        if (now_ns() > deadline) die("fill: the fills were never confirmed");
    for (int slot = 0; slot < 32; slot++) {  /* the later round of the two on each slot */
        int round = slot + 32, size = 1 << (round % 3);
        uint32_t pattern = 0x01020304u * (uint32_t)(round + 1);
        const uint8_t *at = base + 64 * slot;
        for (int i = 0; i < 8; i++)
            if (at[i] != 0xEE) die("fill: a byte before a fill's range was written");
        for (int i = 0; i < 48; i += size) {  /* each item: the pattern's low bytes */
            uint32_t item = 0;
            uint16_t half;
            if (size == 1) item = at[8 + i];
            else if (size == 2) memcpy(&half, at + 8 + i, 2), item = half;
            else memcpy(&item, at + 8 + i, 4);
            if (item != (size == 4 ? pattern : pattern & ((1u << (8 * size)) - 1)))
                die("fill: a range does not hold its last fill's pattern");
        }
        for (int i = 56; i < 64; i++)
            if (at[i] != 0xEE) die("fill: a byte after a fill's range was written");
    }
    uint64_t aligned = (uint64_t)(uintptr_t)base;
    if (am_cuq_fill(f.q, aligned, 0, 3, 48, value + 1, 0) != -2 ||
        am_cuq_fill(f.q, aligned, 0, 4, 6, value + 1, 0) != -2 ||
        am_cuq_fill(f.q, aligned + 2, 0, 4, 8, value + 1, 0) != -2)
        die("fill: a bad fill was not refused");
    queue_free(f, 0);
    puts("ok fill");
}

typedef struct { fake_queue a; uint64_t n; } producer;

static void *produce(void *arg) {
    producer *p = arg;
    for (uint64_t v = 1; v <= p->n; v++) {
        if (launch(p->a, NULL, (int64_t)v, v)) die("cross: launch on a failed");
        if (v % 64 == 0) sched_yield();
    }
    return NULL;
}

static void check_cross(void) {
    fake_queue a = queue_new(), b = queue_new();
    producer p = {a, 4000};
    pthread_t thread;
    pthread_create(&thread, NULL, produce, &p);
    static kernel checks[4000];
    uint64_t value = 0;
    for (uint64_t k = 7; k <= p.n; k += 7) {  /* some before a submits them, some after */
        if (am_cuq_wait_queue(b.q, a.q, k, value + 1)) die("cross: wait failed");
        checks[value] = (kernel){0, 0, a.s, (long)k};
        value++;
        if (launch(b, &checks[value - 1], (int64_t)k, value)) die("cross: launch on b failed");
    }
    int64_t deadline = now_ns() + 20000000000LL;
    for (int64_t look = 0; am_timeline_value(b.t) < value; look_again(&look))
        if (now_ns() > deadline) die("cross: b never finished (a wait on a's word hangs)");
    pthread_join(thread, NULL);
    reach(a.t, p.n, "cross: a never finished");
    queue_free(a, 0);
    queue_free(b, 0);
    puts("ok cross");
}

/* Command `value` of f: a kernel that faults, behind a device wait for *gate, which the
 * caller raises once this returned: its event record is submitted before the fault hits
 * (else the stream's thread may fault first -- at once, or while the submitting thread
 * is off the CPU -- and refuse the record). */
static int faulting_launch(fake_queue f, uint64_t *gate, uint64_t value) {
    static kernel faulty = {1, 2000000, NULL, 0};
    return am_cuq_wait(f.q, gate, 1, value) || launch(f, &faulty, 0, value);
}

static void check_fault(void) {
    fake_queue f = queue_new();
    uint64_t v = 0, *gate = calloc(1, sizeof(uint64_t));
    for (int i = 0; i < 50; i++)
        if (launch(f, NULL, i, ++v)) die("fault: launch before the fault failed");
    uint64_t first = v + 1;
    if (faulting_launch(f, gate, ++v)) die("fault: the faulting launch was refused at once");
    atomic_store((_Atomic uint64_t *)gate, 1);
    int r = 0;
    for (int i = 0; i < 50 && !r; i++) r = launch(f, NULL, i, ++v);  /* refused once it hit */
    for (int64_t look = 0; am_timeline_value(f.t) != UINT64_MAX; look_again(&look)) {
        uint64_t reached = am_timeline_value(f.t);
        if (reached >= first && reached != UINT64_MAX) die("fault: a failed command was done");
    }
    uint64_t at = 0;
    int code = am_cuq_error(f.q, &at);
    if (code != ILLEGAL_ADDRESS) die("fault: the queue does not report the fault");
    if (at < first - 50 || at > first) die("fault: the first failed value is wrong");
    if (launch(f, NULL, 0, ++v) != ILLEGAL_ADDRESS) die("fault: a later launch succeeded");
    queue_free(f, 1);
    free(gate);
    atomic_store(&fault_code, 0);
    puts("ok fault");
}

/* A slow completion thread (causal, confirmedfirst, the *freed checks): q's thread sees
 * its first command's event unfinished until `held` is cleared (let_held_go). For a
 * command behind a slow kernel, or not yet handed over; one that may already have ended
 * is held with hold_next. */
static void hold_head(fake_queue q) {
    pthread_mutex_lock(&q.q->mu);
    atomic_store(&held, q.q->ring[q.q->head].event);
    pthread_mutex_unlock(&q.q->mu);
}

/* The same, armed before q's next command is submitted: the next event recorded on q's
 * stream is held from its record on (its thread never sees it end before let_held_go). */
static void hold_next(fake_queue q) {
    atomic_store(&hold_records_on, q.s);
}

/* hold_next's command was recorded, and is the one held. */
static void check_held(fake_queue q, const char *what) {
    pthread_mutex_lock(&q.q->mu);
    int head = atomic_load(&held) == q.q->ring[q.q->head].event;
    pthread_mutex_unlock(&q.q->mu);
    if (atomic_load(&hold_records_on) || !head) die(what);
}

/* A queue's wait on another queue's value, finished with that timeline as its extra (as
 * CUDAQueue.wait does on one device), confirms the value there too, even while the other
 * queue's own completion thread has not seen its event (held here); and when that thread
 * then sees the context's sticky error (a fault after the command ran), the command it
 * already had confirmed does not fail. */
static void check_causal(void) {
    fake_queue a = queue_new(), b = queue_new();
    static kernel slow = {0, 20000000, NULL, 0};  /* 20 ms */
    hold_next(a);
    if (launch(a, &slow, 0, 1)) die("causal: launch on a failed");
    check_held(a, "causal: (setup) a's launch is not the command held");
    if (am_cuq_wait_queue(b.q, a.q, 1, 1) || am_cuq_finish(b.q, 1, a.t, 1, 0, 0))
        die("causal: the wait on b failed");
    int64_t deadline = now_ns() + 10000000000LL;
    for (int64_t look = 0; am_timeline_value(b.t) < 1; look_again(&look))
        if (now_ns() > deadline) die("causal: b's wait never finished");
    if (am_timeline_value(a.t) != 1) die("causal: b's wait done, a's value it waited for not");
    atomic_store(&fault_code, ILLEGAL_ADDRESS);
    atomic_store(&held, NULL);
    for (int64_t look = 0; atomic_load(&a.q->pending); look_again(&look))
        if (now_ns() > deadline) die("causal: a's thread never saw its event");
    uint64_t at = 0;
    if (am_cuq_error(a.q, &at) || am_timeline_value(a.t) != 1)
        die("causal: a command confirmed through another queue failed afterwards");
    queue_free(a, 1);
    queue_free(b, 1);
    atomic_store(&fault_code, 0);
    puts("ok causal");
}

/* Commands get plain events (no interrupt each) until one outlasts the polling window:
 * that one is waited for with naps, the next ones get blocking-sync events (and are
 * blocked on), until 16 in a row finish while polled. */
/* Quick commands until the queue gives plain events again (16 in a row confirmed while
 * polling; on a busy machine with few cores a poll window is missed now and then). */
static uint64_t until_plain(fake_queue f, uint64_t v, uint64_t *stats) {
    for (int i = 0; i < 1000; i++) {
        launch(f, NULL, i, ++v);
        while (am_timeline_value(f.t) < v) nap_ns(20000);
        am_cuq_stats(f.q, stats);
        if (!stats[4]) return v;
    }
    die("long: quick commands kept blocking-sync events");
    return v;
}

static void check_long(void) {
    fake_queue f = queue_new();
    static kernel slow = {0, 50000000, NULL, 0};  /* 50 ms */
    uint64_t v = 0, before[8], stats[8];
    am_cuq_stats(f.q, stats);
    if (stats[4]) die("long: a new queue starts with blocking-sync events");
    for (int attempt = 1;; attempt++) {
        v = until_plain(f, v, before);
        launch(f, &slow, 0, ++v);
        while (am_timeline_value(f.t) < v) nap_ns(100000);
        am_cuq_stats(f.q, stats);
        if (stats[2] == before[2] + 1 && stats[1] == before[1] && stats[4] == 1) break;
        /* Seen done while polling, as if quick: a busy machine kept the completion
         * thread off a core for the whole 50 ms. Again, a few times at most. */
        if (attempt < 4 && stats[2] == before[2] && stats[1] == before[1] && !stats[4])
            continue;
        die("long: a long command on a plain event was not napped on, or changed nothing");
    }
    launch(f, &slow, 0, ++v);
    while (am_timeline_value(f.t) < v) nap_ns(100000);
    am_cuq_stats(f.q, stats);
    if (stats[1] != before[1] + 1 || stats[2] != before[2] + 1)
        die("long: the next long command was not blocked on");
    v = until_plain(f, v, before);
    /* A command known to run long (a large staged copy) gets a blocking-sync event from
     * the start, is blocked on (f_sync dies on a plain one), and leaves later commands'
     * events plain. */
    enqueue(f.s, (op){OP_KERNEL, 50000000, NULL, 0});
    if (am_cuq_finish(f.q, ++v, NULL, 0, 0, 1)) die("long: am_cuq_finish failed");
    while (am_timeline_value(f.t) < v) nap_ns(100000);
    am_cuq_stats(f.q, stats);
    if (stats[1] != before[1] + 1 || stats[2] != before[2] || stats[4])
        die("long: a command finished as long-running was not blocked on, or changed the mode");
    queue_free(f, 0);
    puts("ok long");
}

/* 300 launches of 200 us kernels behind a stream that blocks a launch once it holds more
 * than 8 operations (a launch and a record each): unbounded, launches block; bounded at
 * 4 commands, none does, the rest are held and submitted in order. */
static long bound_run(long bound, uint64_t *held) {
    fake_queue f = queue_bounded(bound);
    static kernel k200 = {0, 200000, NULL, 0};
    atomic_store(&blocked_launches, 0);
    atomic_store(&deep_limit, 8);
    const uint64_t n = 300;
    for (uint64_t v = 1; v <= n; v++)
        if (launch(f, &k200, (int64_t)v, v)) die("bound: launch failed");
    int64_t deadline = now_ns() + 30000000000LL;
    for (int64_t look = 0; am_timeline_value(f.t) < n; look_again(&look))
        if (now_ns() > deadline) die("bound: held commands never ran");
    atomic_store(&deep_limit, 0);
    for (uint64_t i = 0; i < n; i++)
        if (f.s->log[i] != (int64_t)i + 1) die("bound: held commands ran out of order");
    uint64_t stats[8];
    am_cuq_stats(f.q, stats);
    *held = stats[5];
    if (stats[6]) die("bound: operations still held once everything ran");
    queue_free(f, 0);
    return atomic_load(&blocked_launches);
}

static void check_bound(void) {
    uint64_t held;
    if (bound_run(1 << 20, &held) == 0 || held)
        die("bound: the simulated driver never blocked an unbounded queue's launch");
    if (bound_run(4, &held) != 0) die("bound: a bounded queue made a blocking launch");
    if (held < 250) die("bound: commands past the bound were not held");
    puts("ok bound");
}

/* q waits for timeline t's `target` (its command `value`), as a queue's wait on it is
 * submitted (am_cuq_wait_timeline, then the command's end) */
static int wait_held(fake_queue q, am_timeline *t, uint64_t target, uint64_t value) {
    return am_cuq_wait_timeline(q.q, t, target, value) ||
           am_cuq_finish(q.q, value, t, target, 0, CU_FINISH_PLAIN | CU_FINISH_WAITED);
}

/* Command `value` of f: a device wait for *gate (which the check raises once it has
 * submitted what must be held behind it), then a kernel. */
static int gated_launch(fake_queue f, uint64_t *gate, uint64_t value) {
    return am_cuq_wait(f.q, gate, 1, value) || launch(f, NULL, (int64_t)value, value);
}

static void check_refused(void) {
    fake_queue f = queue_bounded(2);
    static kernel refused = {0, 0, NULL, 0};
    refuse_fn = &refused;
    uint64_t v = 0, *gate = calloc(1, sizeof(uint64_t));  /* (gated_launch) */
    if (gated_launch(f, gate, ++v)) die("refused: the gated launch failed");
    for (int i = 0; i < 4; i++)
        if (launch(f, NULL, 2 + i, ++v)) die("refused: a held launch failed at once");
    uint64_t bad = ++v;
    if (launch(f, &refused, 0, bad)) die("refused: a held launch was refused at once");
    for (int i = 0; i < 4; i++)
        if (launch(f, NULL, 9 + i, ++v)) die("refused: a launch after it failed at once");
    atomic_store((_Atomic uint64_t *)gate, 1);
    int64_t deadline = now_ns() + 10000000000LL;
    uint64_t reached;
    for (int64_t look = 0; (reached = am_timeline_value(f.t)) != UINT64_MAX; look_again(&look)) {
        if ((long)(reached < bad ? reached : bad - 1) > atomic_load(&f.s->ran))
            die("refused: a command was reported done before it ran");
        if (now_ns() > deadline) die("refused: the queue never settled");
    }
    if (atomic_load(&f.s->ran) != (long)(bad - 1)) die("refused: a command before it never ran");
    uint64_t at = 0;
    if (am_cuq_error(f.q, &at) != 1 || at != bad) die("refused: wrong error or first value");
    if (launch(f, NULL, 0, ++v) != 1) die("refused: the failed queue took another command");
    refuse_fn = NULL;
    queue_free(f, 1);
    free(gate);
    puts("ok refused");
}

/* A host queue whose first command waits on t for `target`, its second copies a word
 * into *dst: run once its own timeline got past both. Returns the host queue's first
 * failed value (0: none), with the failure behind it. */
static uint64_t host_wait(am_timeline *t, uint64_t target, int64_t *dst, int *error,
                          uint64_t *value, am_timeline **cause, const char *what) {
    static const int64_t one = 1;
    am_timeline *own = am_timeline_new();
    am_queue *h = own ? am_queue_new(own, 0, 0) : NULL;
    if (!h || am_queue_wait(h, t, target, 1) || am_queue_copy(h, dst, &one, sizeof one, NULL, 2))
        die(what);
    int64_t deadline = now_ns() + 10000000000LL;
    for (int64_t look = 0; am_timeline_value(own) < 2; look_again(&look))
        if (now_ns() > deadline) die("hostwait: a host queue's wait on a cuda queue never ended");
    uint64_t failed = am_queue_failure(h, error, value, cause);
    am_queue_close(h, 0);
    am_timeline_free(own);
    return failed;
}

static void check_hostwait(void) {
    /* A held command refused (f: bounded, behind a gate): a host wait for the command
     * before it passes, one for it fails, naming it. */
    fake_queue f = queue_bounded(2);
    static kernel refused = {0, 0, NULL, 0};
    refuse_fn = &refused;
    uint64_t v = 0, *gate = calloc(1, sizeof(uint64_t));
    if (gated_launch(f, gate, ++v)) die("hostwait: the gated launch failed");
    for (int i = 0; i < 3; i++)
        if (launch(f, NULL, 2 + i, ++v)) die("hostwait: a held launch failed at once");
    uint64_t bad = ++v;
    if (launch(f, &refused, 0, bad)) die("hostwait: a held launch was refused at once");
    atomic_store((_Atomic uint64_t *)gate, 1);
    int64_t deadline = now_ns() + 10000000000LL;
    for (int64_t look = 0; am_timeline_value(f.t) != UINT64_MAX; look_again(&look))
        if (now_ns() > deadline) die("hostwait: the refused queue never settled");
    int error = 0;
    uint64_t value = 0;
    am_timeline *cause = NULL;
    int64_t before = 0, after = 0;
    if (host_wait(f.t, bad - 1, &before, &error, &value, &cause, "hostwait: host queue") ||
        before != 1)
        die("hostwait: a host wait for a value confirmed before the refused one failed");
    if (host_wait(f.t, bad, &after, &error, &value, &cause, "hostwait: host queue") != 1 ||
        after != 0)
        die("hostwait: a host wait for a refused command's value passed (its command ran)");
    if (error != 1 || value != bad || cause != f.t)
        die("hostwait: a host wait for a refused command's value does not name it");
    refuse_fn = NULL;
    queue_free(f, 1);
    /* A kernel that faults (its queue's first command): a host wait for it fails. */
    fake_queue g = queue_new();
    atomic_store((_Atomic uint64_t *)gate, 0);
    if (faulting_launch(g, gate, 1)) die("hostwait: the faulting launch was refused at once");
    atomic_store((_Atomic uint64_t *)gate, 1);
    int64_t faulted = 0;
    if (host_wait(g.t, 1, &faulted, &error, &value, &cause, "hostwait: host queue") != 1 ||
        faulted != 0)
        die("hostwait: a host wait for a faulted kernel's value passed (its command ran)");
    if (error != ILLEGAL_ADDRESS || value != 1 || cause != g.t)
        die("hostwait: a host wait for a faulted kernel's value does not name it");
    queue_free(g, 1);
    free(gate);
    atomic_store(&fault_code, 0);
    puts("ok hostwait");
}

static void check_hostheld(void) {
    fake_queue f = queue_new();
    /* h: a host queue's own timeline, raised by its thread: command 1 waits for the
     * gate, command 2 copies a word. f waits for h's 2, then runs a kernel. */
    am_timeline *gate = am_timeline_new(), *h = am_timeline_new();
    am_queue *hq = am_queue_new(h, 0, 0);
    static const int64_t one = 1;
    int64_t copied = 0;
    if (!hq || am_queue_wait(hq, gate, 1, 1) || am_queue_copy(hq, &copied, &one, 8, NULL, 2))
        die("hostheld: the host queue");
    if (wait_held(f, h, 2, 1) || launch(f, NULL, 1, 2))
        die("hostheld: a wait on a host queue's timeline failed at once");
    nap_ns(50000000);  /* 50 ms */
    if (atomic_load(&f.s->ran) || am_timeline_value(f.t) >= 1)
        die("hostheld: a kernel after a wait on a host queue's timeline ran before it got there");
    am_timeline_signal(gate, 1);
    int64_t deadline = now_ns() + 10000000000LL;
    for (int64_t look = 0; am_timeline_value(f.t) < 2; look_again(&look))
        if (now_ns() > deadline) die("hostheld: a wait on a host queue's timeline never ended");
    uint64_t at = 0;
    if (am_timeline_value(f.t) != 2 || atomic_load(&f.s->ran) != 1 || am_cuq_error(f.q, &at) ||
        copied != 1)
        die("hostheld: a wait on a host queue's timeline did not succeed once it got there");
    am_queue_close(hq, 0);
    /* h2: a host timeline whose device closes before it gets to what f waits for. */
    am_timeline *h2 = am_timeline_new();
    if (wait_held(f, h2, 1, 3) || launch(f, NULL, 3, 4))
        die("hostheld: a wait on a host timeline failed at once");
    nap_ns(20000000);  /* 20 ms */
    am_timeline_close(h2, 0);
    for (int64_t look = 0; am_timeline_value(f.t) < 4; look_again(&look))
        if (now_ns() > deadline) die("hostheld: a wait on a closed host timeline never ended");
    int error = 0;
    uint64_t value = 0;
    if (am_timeline_value(f.t) != UINT64_MAX || am_cuq_error(f.q, &at) != CU_HELD_FAILED ||
        at != 3 || am_cuq_cause(f.q, &error, &value) != h2 || error != AM_CLOSED)
        die("hostheld: a wait on a closed host timeline did not fail its queue from there");
    if (atomic_load(&f.s->ran) != 1)
        die("hostheld: a kernel after a wait on a closed host timeline ran");
    queue_free(f, 0);
    am_timeline_free(gate);
    am_timeline_free(h);
    am_timeline_free(h2);
    puts("ok hostheld");
}

/* Behind f's wait on h (a host queue's timeline) for 1, as command 1: a kernel (2), a
 * fill of `memory` (3), a signal of `sig` to 1 (4). Command 1 first waits for a word
 * raised only once all are submitted: f, failed from 1, would settle (and take nothing
 * more) once its stream is past all it was given. */
static void behind_host_wait(fake_queue f, am_timeline *h, uint32_t *memory, size_t nbytes,
                             am_timeline *sig) {
    static uint64_t gate;
    atomic_store((_Atomic uint64_t *)&gate, 0);
    if (am_cuq_wait(f.q, &gate, 1, 1) || wait_held(f, h, 1, 1) ||
        launch(f, NULL, 1, 2) ||
        am_cuq_fill(f.q, (uint64_t)(uintptr_t)memory, 0xABABABABu, 4, nbytes, 3, 0) ||
        am_cuq_write(f.q, (void *)sig->word, 1, 4) || am_cuq_finish(f.q, 4, sig, 1, 0, 0))
        die("hostfailed: a command behind a wait on a host queue's timeline failed at once");
    atomic_store((_Atomic uint64_t *)&gate, 1);
}

/* f settled failed from its wait (1) on, having run nothing behind it, naming the
 * failure of `cause`'s command 7 (ILLEGAL_ADDRESS) -- and so does sig. */
static void held_failed(fake_queue f, const uint32_t *memory, size_t n, am_timeline *sig,
                        am_timeline *cause, const char *what) {
    int64_t deadline = now_ns() + 10000000000LL;
    for (int64_t look = 0; am_timeline_value(f.t) != UINT64_MAX; look_again(&look))
        if (now_ns() > deadline) die(what);
    if (atomic_load(&f.s->ran)) die("hostfailed: a kernel behind a failed host wait launched");
    for (size_t i = 0; i < n; i++)
        if (memory[i]) die("hostfailed: a fill behind a failed host wait wrote its memory");
    uint64_t at = 0, value = 0;
    int error = 0;
    if (am_cuq_error(f.q, &at) != CU_HELD_FAILED || at != 1)
        die("hostfailed: the queue does not fail from its wait on a failed host timeline");
    if (am_cuq_cause(f.q, &error, &value) != cause || error != ILLEGAL_ADDRESS || value != 7)
        die("hostfailed: the queue does not name the failure its wait came to");
    am_timeline *by = NULL;
    if (am_timeline_failure(sig, &error, &value, &by) != 1 || by != cause ||
        error != ILLEGAL_ADDRESS || value != 7)
        die("hostfailed: a signal behind a failed host wait does not fail its timeline so");
    if (launch(f, NULL, 5, 5) != CU_HELD_FAILED)
        die("hostfailed: the settled queue took another command");
}

/* A staging copy's host part behind mark 1 of `marks`, which queue f writes as its
 * command `value` (am_cuq_mark), and then *gate raised to 1 (if given: f's stream waits
 * for it, so that f does not settle before the mark is submitted): 64 bytes of `chunk`
 * to `dst`, in parts of 16. Returns once the host thread is done, with the chunk's
 * ready word. */
static uint64_t staged_part(fake_queue f, uint64_t value, uint8_t *dst, const uint8_t *chunk,
                            uint64_t *gate) {
    uint64_t word = 0, ready = 0;
    _Atomic uint64_t claimed = 0, count = 0;
    am_timeline *marks = am_timeline_new(), *own = am_timeline_new();
    am_timeline_set_word(marks, &word);
    am_queue *copier = own ? am_queue_new(own, 0, 0) : NULL;
    if (!copier || am_queue_copy_part(copier, dst, chunk, 64, 16, marks, 1, (void *)&claimed, 0,
                                      (void *)&count, 4, &ready, 1, NULL, 1))
        die("hostfailed: the staging copier");
    if (am_cuq_mark(f.q, marks, 1, value) || am_cuq_finish(f.q, value, NULL, 0, 0, 0))
        die("hostfailed: a mark failed at once");
    if (gate) atomic_store((_Atomic uint64_t *)gate, 1);
    int64_t deadline = now_ns() + 10000000000LL;
    for (int64_t look = 0; am_timeline_value(own) < 1; look_again(&look))
        if (now_ns() > deadline) die("hostfailed: a staging copy's host part never ran");
    am_queue_close(copier, 0);
    am_timeline_free(own);
    /* (its stream is past the mark's word) */
    for (int64_t look = 0; am_timeline_value(f.t) < value; look_again(&look))
        if (now_ns() > deadline) die("hostfailed: a mark was never confirmed or failed");
    am_timeline_free(marks);
    return __atomic_load_n(&ready, __ATOMIC_SEQ_CST);
}

static void check_hostfailed(void) {
    /* h: a host queue's own timeline; its command 1 waits for gate, which fails (command
     * 7 of `cause`'s queue faulted): it fails, and h fails from 1 with that failure. */
    am_timeline *gate = am_timeline_new(), *h = am_timeline_new(), *cause = am_timeline_new();
    am_queue *hq = am_queue_new(h, 0, 0);
    if (!hq || am_queue_wait(hq, gate, 1, 1)) die("hostfailed: the host queue");
    static uint32_t memory[16], later[16];
    uint64_t sig_word = 0, sig2_word = 0;
    am_timeline *sig = am_timeline_new(), *sig2 = am_timeline_new();
    am_timeline_set_word(sig, &sig_word);
    am_timeline_set_word(sig2, &sig2_word);
    /* Held: f's wait is held on the host when h fails. */
    fake_queue f = queue_new();
    behind_host_wait(f, h, memory, sizeof memory, sig);
    nap_ns(20000000);  /* 20 ms */
    if (atomic_load(&f.s->ran)) die("hostfailed: a kernel ran before the host wait ended");
    am_timeline_fail(gate, 1, ILLEGAL_ADDRESS, 7, cause);
    held_failed(f, memory, 16, sig, cause,
                "hostfailed: a held wait on a failed host timeline never ended");
    /* Submitted once h has failed: the same. */
    int64_t deadline = now_ns() + 10000000000LL;
    for (int64_t look = 0; am_timeline_value(h) < 1; look_again(&look))
        if (now_ns() > deadline) die("hostfailed: the host queue never passed its failed wait");
    fake_queue g = queue_new();
    behind_host_wait(g, h, later, sizeof later, sig2);
    held_failed(g, later, 16, sig2, cause,
                "hostfailed: a wait on a failed host timeline never ended");
    /* A staging chunk's mark behind such a wait: nothing copied out of the chunk; of a
     * queue that runs its commands, the chunk copied. */
    static uint8_t chunk[64], out[64], ran_out[64];
    memset(chunk, 0xEE, sizeof chunk);
    fake_queue e = queue_new(), p = queue_new();
    uint64_t *gate_word = calloc(1, sizeof(uint64_t));
    if (am_cuq_wait(e.q, gate_word, 1, 1) || am_cuq_finish(e.q, 1, NULL, 0, 0, 0) ||
        wait_held(e, h, 1, 2))
        die("hostfailed: a wait on a failed host timeline failed at once");
    if (staged_part(e, 3, out, chunk, gate_word) != 1)
        die("hostfailed: a chunk behind a failed host wait was never marked ready");
    for (size_t i = 0; i < sizeof out; i++)
        if (out[i]) die("hostfailed: a staging copy behind a failed host wait copied its chunk");
    if (staged_part(p, 1, ran_out, chunk, NULL) != 1 || memcmp(ran_out, chunk, sizeof chunk))
        die("hostfailed: a staging copy behind a mark that ran did not copy its chunk");
    queue_free(e, 0);
    queue_free(p, 0);
    free(gate_word);
    am_queue_close(hq, 0);
    queue_free(f, 0);
    queue_free(g, 0);
    am_timeline_free(gate);
    am_timeline_free(h);
    am_timeline_free(cause);
    am_timeline_free(sig);
    am_timeline_free(sig2);
    puts("ok hostfailed");
}

/* A launch of k (its parameter: `value`) as a part of command `value`, with no end:
 * what a command hands the driver before its later parts. */
static int kernel_part(fake_queue f, kernel *k, uint64_t value) {
    int64_t buf[(sizeof(am_cuop) + 7) / 8 + 1];
    am_cuop *op = (am_cuop *)buf;
    memset(op, 0, sizeof *op);
    op->kind = CUOP_LAUNCH;
    op->value = value;
    op->fn = k;
    op->nparams = 1;
    memcpy(op->dims, dims, sizeof op->dims);
    op->params[0] = (int64_t)value;
    return cuq_submit(f.q, op, sizeof(am_cuop) + 8);
}

static void check_partial(void) {
    fake_queue f = queue_bounded(1);
    static kernel k2 = {0, 80000000, NULL, 0};
    uint64_t *gate = calloc(1, sizeof(uint64_t));
    if (gated_launch(f, gate, 1)) die("partial: launch 1 failed");
    /* command 2: a launch (held, handed over later), a word write the driver refuses */
    if (kernel_part(f, &k2, 2)) die("partial: the held launch failed");
    if (am_cuq_write(f.q, &refuse_word, 1, 2) || am_cuq_finish(f.q, 2, NULL, 0, 0, 0))
        die("partial: a held operation was refused at once");
    atomic_store((_Atomic uint64_t *)gate, 1);
    int64_t deadline = now_ns() + 10000000000LL;
    for (int64_t look = 0; am_timeline_value(f.t) != UINT64_MAX; look_again(&look))
        if (now_ns() > deadline) die("partial: the queue never settled");
    if (atomic_load(&f.s->ran) != 2) die("partial: settled while its launch still ran");
    queue_free(f, 0);
    free(gate);
    puts("ok partial");
}

static void check_refusedpart(void) {
    static kernel slow = {0, 50000000, NULL, 0};
    for (int variant = 0; variant < 2; variant++) {
        fake_queue f = queue_new();
        if (launch(f, NULL, 1, 1)) die("refusedpart: launch 1 failed");
        reach(f.t, 1, "refusedpart: launch 1 never ran");
        int r;
        if (variant == 0) {  /* command 2: a slow kernel, then a word write refused */
            if (kernel_part(f, &slow, 2)) die("refusedpart: the kernel failed");
            r = am_cuq_write(f.q, &refuse_word, 1, 2);
        } else {  /* command 2: a slow kernel whose event record is refused */
            atomic_store(&refuse_records, f.s);
            r = launch(f, &slow, 2, 2);
        }
        if (r != 1) die("refusedpart: the refusal was not reported");
        uint64_t at = 0;
        if (am_cuq_error(f.q, &at) != 1 || at != 2)
            die("refusedpart: a command part of which reached the driver did not fail its queue");
        if (launch(f, NULL, 3, 2) != 1) die("refusedpart: the failed queue took another command");
        reach(f.t, UINT64_MAX, "refusedpart: the failed queue never settled");
        if (atomic_load(&f.s->ran) != 2)
            die("refusedpart: settled before the part that reached the driver ran");
        queue_free(f, 0);
    }
    puts("ok refusedpart");
}

static void check_release(void) {
    fake_queue a = queue_bounded(1);
    fake_queue b = queue_new();
    /* a's first command waits for a gate, raised once everything below was submitted
     * (a slow kernel's run was too short for that on a loaded machine: c was made after
     * b had failed, and c's launch then failed at once) */
    static kernel refused = {0, 0, NULL, 0};
    refuse_fn = &refused;
    uint64_t *gate = calloc(1, sizeof(uint64_t));
    if (gated_launch(a, gate, 1) || launch(a, &refused, 2, 2)) die("release: a failed at once");
    if (am_cuq_wait_queue(b.q, a.q, 2, 1) || am_cuq_finish(b.q, 1, NULL, 0, 0, CU_FINISH_PLAIN))
        die("release: b's wait failed");
    if (launch(b, NULL, 1, 2)) die("release: b's launch failed");
    /* c waits on b's event for b's command 2, which ran on data a never produced */
    fake_queue c = queue_new();
    if (am_cuq_wait_queue(c.q, b.q, 2, 1) || am_cuq_finish(c.q, 1, NULL, 0, 0, CU_FINISH_PLAIN))
        die("release: c's wait failed");
    if (launch(c, NULL, 1, 2)) die("release: c's launch failed");
    atomic_store((_Atomic uint64_t *)gate, 1);
    int64_t deadline = now_ns() + 10000000000LL;
    for (int64_t look = 0;
         am_timeline_value(b.t) < 2 || am_timeline_value(c.t) < 2;
         look_again(&look))
        if (now_ns() > deadline) die("release: a wait on a failed queue's value never ended");
    uint64_t at = 0;
    if (am_cuq_error(a.q, &at) != 1 || at != 2) die("release: a's failure is wrong");
    /* b's wait went on once a's command 2 was refused, and neither it nor b's launch
     * reached the stream: they fail; so do c's, which waited for b's launch; each names
     * a's refused command */
    if (am_timeline_value(b.t) != UINT64_MAX || atomic_load(&b.s->ran))
        die("release: b's commands after the wait did not fail without running");
    if (am_timeline_value(c.t) != UINT64_MAX || atomic_load(&c.s->ran))
        die("release: c's commands did not fail without running");
    fake_queue waiting[2] = {b, c};
    for (int i = 0; i < 2; i++) {
        int error = 0;
        uint64_t value = 0;
        if (am_cuq_error(waiting[i].q, &at) != CU_HELD_FAILED || at != 1)
            die("release: a waiting queue's failure is wrong");
        if (am_cuq_cause(waiting[i].q, &error, &value) != a.t || error != 1 || value != 2)
            die("release: a waiting queue does not name the command that failed");
    }
    refuse_fn = NULL;
    queue_free(a, 0);
    queue_free(b, 0);
    queue_free(c, 0);
    free(gate);
    puts("ok release");
}

typedef struct { am_timeline *t; uint64_t *word; } free_timeline;

static free_timeline free_timeline_new(void) {
    free_timeline f = {am_timeline_new(), calloc(1, sizeof(uint64_t))};
    am_timeline_set_word(f.t, f.word);
    return f;
}

static void free_timeline_free(free_timeline f) {
    am_timeline_free(f.t);
    free(f.word);
}

/* What queue_free does for a queue closed (abandoned) by the check itself. */
static void abandoned_free(fake_queue f) {
    stream_free(f.s, 1);
    am_timeline_free(f.t);
    free(f.word);
}

/* q waits on the device for f's value `target` (its command `value`) */
static int wait_free(fake_queue q, free_timeline f, uint64_t target, uint64_t value) {
    return am_cuq_wait(q.q, f.word, target, value) ||
           am_cuq_finish(q.q, value, f.t, target, 0, CU_FINISH_PLAIN | CU_FINISH_WAITED);
}

/* q signals f to `target` (its command `value`) */
static int signal_free(fake_queue q, free_timeline f, uint64_t target, uint64_t value) {
    return am_cuq_write(q.q, f.word, target, value) ||
           am_cuq_finish(q.q, value, f.t, target, 0, 0);
}

/* The end of check_faultheld and check_faulthanding: f, faulted while it held a device
 * wait for u, holds nothing now (else `held` fails the check), a close to finish returns
 * within 3 s (else `close`), and no kernel of f ran (else `ran`). f, its fault, u and
 * gate go. */
static void faulted_end(fake_queue f, free_timeline u, uint64_t *gate, const char *held,
                        const char *close, const char *ran) {
    uint64_t stats[8];
    am_cuq_stats(f.q, stats);
    if (stats[6]) die(held);
    close_within(f.q, 3000000000L, close);
    if (atomic_load(&f.s->ran)) die(ran);
    stream_free(f.s, 0);  /* (queue_free's, the queue closed above) */
    am_timeline_free(f.t);
    free(f.word);
    atomic_store(&fault_code, 0);
    free_timeline_free(u);
    free(gate);
}

/* A queue whose command faulted (a sticky error: nothing of its context runs any more)
 * while it held on the host a device wait for what nothing handed over yet, and a
 * signal and a kernel behind it: what it held fails with the fault -- the signal's
 * timeline settles, failed, naming the faulted command, so its waiters are not left
 * waiting -- and a close to finish returns, rather than either waiting for the held
 * wait's kick (for good here: nothing signals its timeline). Checked: fails without the
 * fix (the held operations stayed held, to be handed over once the kick came). */
static void check_faultheld(void) {
    fake_queue f = queue_new();
    free_timeline u = free_timeline_new(), v = free_timeline_new();
    uint64_t *gate = calloc(1, sizeof(uint64_t)), value = 0, stats[8];
    int error = 0;
    am_timeline *cause = NULL;
    /* command 1 faults once the gate is raised; command 2 waits for u's 1 (held: nothing
     * signalled u), command 3 signals v to 1, command 4 launches */
    if (faulting_launch(f, gate, 1) || wait_held(f, u.t, 1, 2) || signal_free(f, v, 1, 3) ||
        launch(f, NULL, 4, 4))
        die("faultheld: a submission failed before the fault");
    am_cuq_stats(f.q, stats);
    if (stats[6] != 6) die("faultheld: (setup) the wait for u and what follows were not held");
    atomic_store((_Atomic uint64_t *)gate, 1);
    reach(f.t, UINT64_MAX, "faultheld: the queue never settled");
    int64_t deadline = now_ns() + 3000000000LL;
    for (int64_t look = 0; am_timeline_value(v.t) != UINT64_MAX; look_again(&look))
        if (now_ns() > deadline)
            die("faultheld: a signal held behind a device wait of a faulted queue left its "
                "timeline's waiters waiting");
    if (am_timeline_failure(v.t, &error, &value, &cause) != 1 || error != ILLEGAL_ADDRESS ||
        value != 1 || cause != f.t)
        die("faultheld: the held signal's timeline did not fail, naming the faulted command");
    faulted_end(f, u, gate, "faultheld: operations of the failed commands stayed held",
                "faultheld: a close to finish of the faulted queue waited for its held "
                "wait's kick",
                "faultheld: a kernel of the faulted queue ran");
    free_timeline_free(v);
    puts("ok faultheld");
}

/* The hook's part of check_faulthanding: the fault hits, and its confirmation settles
 * the queue, while a thread hands the queue's device wait over -- past the hook (at
 * faulthanding_where), before the driver call that finds it must be held. */
static _Atomic(uint64_t *) faulthanding_gate;
static am_cuq *_Atomic faulthanding_q;
static _Atomic int faulthanding_where;

static void fault_while_handing(int where, am_cuq *q) {
    am_cuq *expected = q;
    if (where != atomic_load(&faulthanding_where) ||
        !atomic_compare_exchange_strong(&faulthanding_q, &expected, NULL))
        return;
    atomic_store((_Atomic uint64_t *)atomic_load(&faulthanding_gate), 1);
    int64_t deadline = now_ns() + 10000000000LL;
    for (int64_t look = 0; am_timeline_value(q->timeline) != UINT64_MAX; look_again(&look))
        if (now_ns() > deadline) die("faulthanding: the faulted queue never settled");
}

/* check_faulthanding's case: the wait submitted and handed over at once (`submitted`),
 * or held past the queue's bound and handed over by am_cuq_hand_over. */
static void faulthanding_case(int submitted) {
    fake_queue f = submitted ? queue_new() : queue_bounded(1);
    free_timeline u = free_timeline_new();
    uint64_t *gate = calloc(1, sizeof(uint64_t));
    if (faulting_launch(f, gate, 1)) die("faulthanding: the faulting launch was refused");
    atomic_store(&faulthanding_gate, gate);
    atomic_store(&faulthanding_where, submitted ? CU_HOOK_SUBMIT_HANDING : CU_HOOK_DRAIN_HANDING);
    if (!submitted && wait_held(f, u.t, 1, 2)) die("faulthanding: the wait was refused");
    atomic_store(&faulthanding_q, f.q);
    atomic_store(&test_hook, fault_while_handing);
    if (submitted) {
        if (am_cuq_wait_timeline(f.q, u.t, 1, 2)) die("faulthanding: the wait was refused");
        am_cuq_finish(f.q, 2, u.t, 1, 0, CU_FINISH_PLAIN | CU_FINISH_WAITED);  /* (refused) */
    } else {
        am_cuq_hand_over(f.q, 2);
    }
    atomic_store(&test_hook, NULL);
    if (atomic_load(&faulthanding_q)) die("faulthanding: (setup) the hook did not run");
    faulted_end(f, u, gate,
                "faulthanding: a device wait put back held as its queue faulted stayed held",
                "faulthanding: a close to finish of the faulted queue waited for the kick "
                "of a wait held as it faulted",
                "faulthanding: a kernel of the faulted queue ran");
}

/* As check_faultheld, but the queue's device wait for what nothing hands over (u's 1)
 * reaches the hand-over as its command faults -- submitted then, or held past the
 * queue's bound and handed over for another library's stream: the fault's confirmation
 * settles the queue meanwhile, and the thread handing it over finds the wait must be
 * held and puts it back. It goes with the fault all the same (and its kick), and a
 * close to finish returns, rather than waiting for that kick. Checked: fails without
 * the fix (the wait stayed held, and the close waited for good). */
static void check_faulthanding(void) {
    faulthanding_case(1);
    faulthanding_case(0);
    puts("ok faulthanding");
}

static void check_signal(void) {
    /* a's, a2's and g's first commands wait for a gate, raised once everything below was
     * submitted: what waits for the refused commands is submitted before they are
     * handed over and refused (as in check_release) */
    static kernel refused = {0, 0, NULL, 0};
    refuse_fn = &refused;
    uint64_t *gate = calloc(1, sizeof(uint64_t));
    /* b waits for a's refused command 2, then signals t; c waits for t on the device.
     * a2 signals t2 behind its own refused command; d waits for t2. */
    fake_queue a = queue_bounded(1), b = queue_new(), c = queue_new();
    fake_queue a2 = queue_bounded(1), d = queue_new();
    free_timeline t = free_timeline_new(), t2 = free_timeline_new();
    if (gated_launch(a, gate, 1) || launch(a, &refused, 2, 2)) die("signal: a failed at once");
    if (am_cuq_wait_queue(b.q, a.q, 2, 1) || am_cuq_finish(b.q, 1, NULL, 0, 0, CU_FINISH_PLAIN) ||
        signal_free(b, t, 5, 2))
        die("signal: b failed at once");
    if (wait_free(c, t, 5, 1) || launch(c, NULL, 1, 2)) die("signal: c failed at once");
    if (gated_launch(a2, gate, 1) || launch(a2, &refused, 2, 2) || signal_free(a2, t2, 3, 3))
        die("signal: a2 failed at once");
    if (wait_free(d, t2, 3, 1) || launch(d, NULL, 1, 2)) die("signal: d failed at once");
    /* e waits for a value of t3 that the host signals, f for one a queue signals */
    fake_queue e = queue_new(), f = queue_new(), g = queue_new();
    free_timeline t3 = free_timeline_new(), t4 = free_timeline_new();
    if (wait_free(e, t3, 2, 1) || launch(e, NULL, 1, 2)) die("signal: e failed at once");
    if (wait_free(f, t4, 7, 1) || launch(f, NULL, 1, 2)) die("signal: f failed at once");
    if (gated_launch(g, gate, 1) || signal_free(g, t4, 7, 2)) die("signal: g failed at once");
    am_timeline_host_signal(t3.t, 2, NULL);
    atomic_store((_Atomic uint64_t *)gate, 1);
    fake_queue settled[7] = {b, c, a2, d, e, f, g};
    am_timeline *timelines[4] = {t.t, t2.t, t3.t, t4.t};
    int64_t deadline = now_ns() + 10000000000LL;
    for (int i = 0; i < 7; i++)
        for (int64_t look = 0; am_timeline_value(settled[i].t) < 2; look_again(&look))
            if (now_ns() > deadline) die("signal: a queue's wait on a failed signal never ended");
    for (int i = 0; i < 2; i++) {
        if (am_timeline_value(timelines[i]) != UINT64_MAX || *(i ? t2.word : t.word) != AM_WORD_RELEASED)
            die("signal: a timeline whose signal failed did not settle");
    }
    if (am_timeline_value(t3.t) != 2 || am_timeline_value(t4.t) != 7)
        die("signal: a timeline signalled by the host or a queue did not get its value");
    fake_queue waited[2] = {c, d};
    am_timeline *refusers[2] = {a.t, a2.t};
    for (int i = 0; i < 2; i++) {
        int error = 0;
        uint64_t at = 0, value = 0;
        if (am_timeline_value(waited[i].t) != UINT64_MAX ||
            am_cuq_error(waited[i].q, &at) != CU_WAITED_FAILED || at != 1)
            die("signal: a queue that waited on a failed signal did not fail from the wait");
        if (am_cuq_cause(waited[i].q, &error, &value) != refusers[i] || error != 1 || value != 2)
            die("signal: a queue that waited on a failed signal does not name the refused command");
    }
    uint64_t at = 0;
    if (am_cuq_error(b.q, &at) != CU_HELD_FAILED || am_cuq_error(a2.q, &at) != 1)
        die("signal: a failed signal's own queue did not fail");
    for (int i = 4; i < 7; i++)
        if (am_timeline_value(settled[i].t) != 2 || am_cuq_error(settled[i].q, &at))
            die("signal: a wait released by a signal that succeeded failed");
    refuse_fn = NULL;
    fake_queue all[8] = {a, b, c, a2, d, e, f, g};
    for (int i = 0; i < 8; i++) queue_free(all[i], 0);
    free_timeline frees[4] = {t, t2, t3, t4};
    for (int i = 0; i < 4; i++) {
        am_timeline_free(frees[i].t);
        free(frees[i].word);
    }
    free(gate);
    puts("ok signal");
}

static void check_discard(void) {
    /* f: two commands in flight (the first behind a gate), four held, then a held signal
     * of t; w waits on the device for that signal. */
    fake_queue f = queue_bounded(2), w = queue_new();
    free_timeline t = free_timeline_new();
    uint64_t v = 0, *gate = calloc(1, sizeof(uint64_t));
    if (gated_launch(f, gate, ++v)) die("discard: the gated launch failed");
    for (int i = 0; i < 5; i++)
        if (launch(f, NULL, 2 + i, ++v)) die("discard: a launch failed at once");
    uint64_t sig = ++v;
    if (signal_free(f, t, 1, sig)) die("discard: the held signal failed at once");
    if (wait_free(w, t, 1, 1) || launch(w, NULL, 1, 2)) die("discard: w failed at once");
    am_cuq_discard(f.q);
    am_cuq_discard(f.q);  /* (again: nothing more) */
    atomic_store((_Atomic uint64_t *)gate, 1);
    int64_t deadline = now_ns() + 10000000000LL;
    uint64_t reached;
    for (int64_t look = 0; (reached = am_timeline_value(f.t)) != UINT64_MAX; look_again(&look)) {
        if ((long)reached > atomic_load(&f.s->ran))
            die("discard: a command was reported done before it ran");
        if (now_ns() > deadline) die("discard: the queue never settled");
    }
    if (atomic_load(&f.s->ran) != 2) die("discard: a held command ran, or one in flight not");
    uint64_t at = 0;
    if (am_cuq_error(f.q, &at) != AM_DISCARDED || at != 3)
        die("discard: wrong error or first value");
    int error = 0;
    uint64_t value = 0;
    am_timeline *cause = NULL;
    if (am_timeline_value(t.t) != UINT64_MAX || *t.word != AM_WORD_RELEASED ||
        !am_timeline_failure(t.t, &error, &value, &cause) || error != AM_DISCARDED ||
        value != 3 || cause != f.t)
        die("discard: the dropped signal's timeline did not fail, naming the discard");
    for (int64_t look = 0; am_timeline_value(w.t) < 2; look_again(&look))
        if (now_ns() > deadline) die("discard: a wait for the dropped signal never ended");
    if (am_timeline_value(w.t) != UINT64_MAX || am_cuq_error(w.q, &at) != CU_WAITED_FAILED ||
        at != 1 || am_cuq_cause(w.q, &error, &value) != f.t || error != AM_DISCARDED)
        die("discard: a queue that waited for the dropped signal did not fail from its wait");
    queue_free(f, 0);
    queue_free(w, 0);
    free_timeline_free(t);
    free(gate);
    puts("ok discard");
}

static void check_kick(void) {
    fake_queue f = queue_new();
    am_timeline *gate = am_timeline_new();
    uint64_t *word = calloc(1, sizeof(uint64_t));
    am_timeline_set_word(gate, word);
    uint64_t stats[8], before[8];
    am_cuq_stats(f.q, before);
    if (am_cuq_wait(f.q, word, 1, 1) || am_cuq_finish(f.q, 1, NULL, 0, 0, CU_FINISH_PLAIN))
        die("kick: the wait failed");
    if (launch(f, NULL, 1, 2)) die("kick: the launch failed");
    nap_ns(100000000);  /* 100 ms: the thread naps on the wait, 1 ms at a time */
    am_timeline_host_signal(gate, 1, NULL);
    int64_t deadline = now_ns() + 10000000000LL;
    for (int64_t look = 0; am_timeline_value(f.t) < 2; look_again(&look))
        if (now_ns() > deadline) die("kick: the wait never finished");
    am_cuq_stats(f.q, stats);
    if (stats[2] == before[2]) die("kick: the completion thread did not nap on the wait");
    if (stats[7] == before[7]) die("kick: the host signal did not cut the nap short");
    queue_free(f, 0);
    am_timeline_free(gate);
    free(word);
    puts("ok kick");
}

/* Until f's completion thread naps on its command: its naps counter past `start`'s
 * (am_cuq_stats), read into `after`; else, after 10 s, die(what). */
static void until_napping(fake_queue f, const uint64_t *start, uint64_t *after,
                          const char *what) {
    int64_t deadline = now_ns() + 10000000000LL;
    do {
        if (now_ns() > deadline) die(what);
        nap_ns(1000000);
        am_cuq_stats(f.q, after);
    } while (after[2] == start[2]);
}

/* Until some thread queries an event again (a napping thread's look, where it alone
 * queries one); else, after 10 s, die(what). */
static void until_looked(const char *what) {
    long looks = atomic_load(&event_queries);
    int64_t deadline = now_ns() + 10000000000LL;
    while (atomic_load(&event_queries) == looks) {
        if (now_ns() > deadline) die(what);
        nap_ns(20000);
    }
}

/* The looks (event queries) over a nap of ns on this thread, and how long that nap took
 * in ms, at least ns (*ms; a loaded machine stretches it, and the looks with it). */
static long looks_over(long ns, long *ms) {
    long looks = atomic_load(&event_queries);
    int64_t from = now_ns();
    nap_ns(ns);
    looks = atomic_load(&event_queries) - looks;
    *ms = (long)((now_ns() - from + 999999) / 1000000);
    return looks;
}

/* A queue's device wait on a timeline only the host has signalled, which nothing was
 * handed over to raise: its thread naps until a kick, 1 ms at a time -- not on the
 * schedule of a command that runs long (naps of 20 us growing to 1 ms: ~100 looks in
 * the first 20 ms) -- and is kicked by whatever raises the word then: a host signal, a
 * queue's signal of the timeline handed over, a host queue's raise of it. */
static void check_hostnap(void) {
    const char *how[] = {"a host signal", "a queue's signal handed over", "a host queue's raise"};
    free_timeline other = free_timeline_new();
    uint64_t others = 0;
    /* A release the thread sees on its own -- a nap of it ending after the word rose,
     * before the kick -- is not counted, nor is the thread a napper to kick then. So each
     * release comes mid-nap, a while after the thread looked at its event (not a fixed
     * time after the kick above: its naps run from that kick, and a pause of whole naps
     * lands the release where one ends), and a queue's word write waits behind a gate on
     * its stream until the kick was counted (a stream with a core of its own writes the
     * word at once, and the rest of the hand-over, driver calls and all, may outlast a
     * nap under a sanitizer). Each release is tried up to three times (a thread kept off
     * the CPU through the nap), and must kick once. */
    for (int i = 0, attempt = 0; i < 3; attempt++) {
        fake_queue f = queue_new(), g = queue_new();
        free_timeline t = free_timeline_new();
        uint64_t *gate = calloc(1, sizeof(uint64_t));
        am_timeline_host_signal(t.t, 1, NULL);  /* only the host signalled it: on the device */
        uint64_t start[8], after[8], end[8];
        am_cuq_stats(f.q, start);
        if (wait_held(f, t.t, 2, 1) || launch(f, NULL, 0, 2)) die("hostnap: the wait failed");
        /* Its polling is over: it naps (a thread late to start on the wait, on a loaded
         * machine, polls into the 20 ms below -- tens of looks -- after a fixed pause). */
        until_napping(f, start, after, "hostnap: the thread never napped on the wait");
        nap_ns(1000000);
        /* Its naps of 1 ms: a look a millisecond, counted against how long the window
         * took (20 ms, or longer where this thread was kept off the CPU past its end). */
        long ms = 0, looks = looks_over(20000000, &ms);
        if (looks > ms + 10) {
            fprintf(stderr, "hostnap: %ld looks in %ld ms\n", looks, ms);
            die("hostnap: a wait only the host can release was looked at on the long schedule");
        }
        /* Another timeline's host signal kicks it too: it naps on rather than poll. */
        am_timeline_host_signal(other.t, ++others, NULL);
        looks = looks_over(5000000, &ms);
        if (looks > ms + 25) {
            fprintf(stderr, "hostnap: %ld looks in %ld ms\n", looks, ms);
            die("hostnap: another timeline's host signal had the wait polled for");
        }
        am_cuq_stats(f.q, after);
        /* It looks (f's thread alone queries an event now), then naps 1 ms. */
        until_looked("hostnap: the napping thread never looked again");
        nap_ns(300000);
        if (i == 0) {
            am_timeline_host_signal(t.t, 2, NULL);
        } else if (i == 1) {
            if (am_cuq_wait(g.q, gate, 1, 1) || am_cuq_write(g.q, t.word, 2, 1) ||
                am_cuq_finish(g.q, 1, t.t, 2, 0, 0))
                die("hostnap: the signal failed");
        } else {
            am_timeline_signal(t.t, 2);
        }
        /* Counted once the thread runs again, however late (kick_nap looks for a kick
         * when it wakes, timed out or not); with none, the thread sees the release itself
         * within a nap, or naps on behind the closed gate, and never counts one. */
        int64_t deadline = now_ns() + 100000000LL;
        do {
            nap_ns(100000);
            am_cuq_stats(f.q, end);
        } while (end[7] == after[7] && now_ns() < deadline);
        atomic_store((_Atomic uint64_t *)gate, 1);
        reach(f.t, 2, "hostnap: the wait never ended");
        queue_free(g, 0);
        queue_free(f, 0);
        free_timeline_free(t);
        free(gate);
        if (end[7] != after[7]) {
            i++, attempt = -1;
        } else if (attempt == 2) {
            fprintf(stderr, "hostnap: %s\n", how[i]);
            die("hostnap: what released the wait did not kick its napping thread");
        }
    }
    free_timeline_free(other);
    puts("ok hostnap");
}

/* A napping thread's device wait, only the host able to release it, whose word rises
 * while it naps and is seen as the nap ends, before any kick: the device's write of a
 * queue's signal handed over lands before that hand-over's kick, which comes after its
 * driver calls. The thread polls then, as a kicked one does -- the device is past the
 * wait within microseconds -- rather than nap on the long schedule (a millisecond,
 * after a long wait). Here the word rises 300 us into a nap (the thread's look found),
 * no kick comes, and the command's end stays behind a gate: the thread must turn to
 * polling (CU_HOOK_NAP_RELEASED) at a nap's end. (Tried three times: a thread kept off
 * the CPU between its look and its nap sees the word before napping, and naps on the
 * schedule of a command that runs long.) */
static am_cuq *_Atomic selfseen_q;
static atomic_long selfseen_released;

static void selfseen_hook(int where, am_cuq *q) {
    if (where == CU_HOOK_NAP_RELEASED && q == atomic_load(&selfseen_q))
        atomic_fetch_add(&selfseen_released, 1);
}

static void check_selfseen(void) {
    atomic_store(&test_hook, selfseen_hook);
    for (int attempt = 0;; attempt++) {
        fake_queue f = queue_new();
        free_timeline t = free_timeline_new();
        uint64_t *gate = calloc(1, sizeof(uint64_t));
        am_timeline_host_signal(t.t, 1, NULL);  /* only the host signalled it: on the device */
        uint64_t start[8], after[8];
        am_cuq_stats(f.q, start);
        atomic_store(&selfseen_released, 0);
        atomic_store(&selfseen_q, f.q);
        if (am_cuq_wait_timeline(f.q, t.t, 2, 1) || am_cuq_wait(f.q, gate, 1, 1) ||
            am_cuq_finish(f.q, 1, t.t, 2, 0, CU_FINISH_PLAIN | CU_FINISH_WAITED))
            die("selfseen: the wait failed");
        until_napping(f, start, after, "selfseen: the thread never napped on the wait");
        nap_ns(40000000);  /* waited long: a nap of the long schedule is its longest */
        if (atomic_load(&selfseen_released)) die("selfseen: (setup) released before the write");
        until_looked("selfseen: the napping thread never looked");
        nap_ns(300000);
        atomic_store((_Atomic uint64_t *)t.word, 2);  /* the device's write: no kick */
        int64_t deadline = now_ns() + 2000000000LL;  /* (a thousand naps) */
        while (!atomic_load(&selfseen_released) && now_ns() < deadline) nap_ns(100000);
        long released = atomic_load(&selfseen_released);
        atomic_store((_Atomic uint64_t *)gate, 1);
        am_timeline_host_signal(t.t, 2, NULL);  /* (the value, which the wait confirms) */
        reach(f.t, 1, "selfseen: the wait never ended");
        atomic_store(&selfseen_q, NULL);
        queue_free(f, 0);
        free_timeline_free(t);
        free(gate);
        if (released) break;
        if (attempt == 2) die("selfseen: a thread that saw its wait released napped on");
    }
    atomic_store(&test_hook, NULL);
    puts("ok selfseen");
}

/* A queue's device wait for a value that a signal of another queue handed over already
 * gets its timeline to (its word write behind a gate): nothing a host does releases it
 * sooner, so its thread naps on the long schedule and is no napper of the timeline --
 * the later signals of that timeline handed over meanwhile (a pipeline's) kick no
 * thread. (A kick wakes every napping completion thread of the process, to poll its
 * event back to back for CU_KICK_POLL_NS, and one napping through a timed command to
 * poll until its expected end.) */
static void check_handkick(void) {
    fake_queue f = queue_new(), g = queue_new();
    free_timeline t = free_timeline_new();
    uint64_t *gate = calloc(1, sizeof(uint64_t)), start[8], before[8], after[8];
    am_cuq_stats(f.q, start);
    if (gated_launch(g, gate, 1) || signal_free(g, t, 1, 2)) die("handkick: g failed at once");
    if (wait_held(f, t.t, 1, 1) || launch(f, NULL, 0, 2)) die("handkick: the wait failed");
    int64_t deadline = now_ns() + 10000000000LL;
    do {  /* its polling is over: it naps */
        if (now_ns() > deadline) die("handkick: the thread never napped on the wait");
        nap_ns(1000000);
        am_cuq_stats(f.q, before);
    } while (before[2] == start[2]);
    nap_ns(2000000);
    am_cuq_stats(f.q, before);
    long looks = atomic_load(&event_queries);
    for (uint64_t v = 2; v <= 11; v++) {  /* signals of t behind g's gate, handed over */
        if (signal_free(g, t, v, v + 1)) die("handkick: a signal failed at once");
        nap_ns(3000000);
    }
    am_cuq_stats(f.q, after);
    looks = atomic_load(&event_queries) - looks;
    if (am_timeline_value(f.t) >= 1) die("handkick: the wait ended before its gate opened");
    if (after[7] != before[7]) {
        fprintf(stderr, "handkick: %d kicks, %ld looks in 30 ms\n",
                (int)(after[7] - before[7]), looks);
        die("handkick: a signal handed over kicked a thread napping on a wait it does not release");
    }
    atomic_store((_Atomic uint64_t *)gate, 1);
    reach(f.t, 2, "handkick: the wait never ended");
    queue_free(g, 0);
    queue_free(f, 0);
    free_timeline_free(t);
    free(gate);
    puts("ok handkick");
}

static void check_abandon(void) {
    uint64_t *word = calloc(1, sizeof(uint64_t));  /* nobody ever signals it */
    for (int blocking = 0; blocking < 2; blocking++) {
        fake_queue f = queue_new();
        if (am_cuq_wait(f.q, word, 1, 1) ||
            am_cuq_finish(f.q, 1, NULL, 0, 0, blocking ? CU_FINISH_LONG : CU_FINISH_PLAIN))
            die("abandon: the wait failed");
        if (launch(f, NULL, 1, 2)) die("abandon: the launch failed");
        nap_ns(50000000);  /* it naps, or blocks, on the wait */
        int64_t start = now_ns();
        am_cuq_close(f.q, 1);
        if (now_ns() - start > 2000000000LL) die("abandon: close waited for the thread");
        stream_free(f.s, 1);
        am_timeline_free(f.t);
        free(f.word);
    }
    atomic_store(&release_syncs, 1);  /* the blocked thread returns, frees its queue */
    nap_ns(50000000);
    free(word);
    puts("ok abandon");
}

static void check_context(void) {
    fake_queue f = queue_new();  /* its context: (void *)1 */
    void *theirs[] = {NULL, (void *)0x77, (void *)1};
    uint64_t v = 0;
    for (int i = 0; i < 3; i++) {
        fake_ctx_set_current(theirs[i]);
        if (launch(f, NULL, 0, ++v)) die("context: a launch failed");
        if (fake_ctx_current() != theirs[i])
            die("context: a submission left another context current on the calling thread");
    }
    queue_free(f, 0);
    puts("ok context");
}

/* Eight long commands one after another, so the queue learns how long they run;
 * *longest (if given) rises to the longest any took from its launch's call to being seen
 * confirmed here, which no run time the queue measures exceeds. */
static uint64_t learn_long(fake_queue f, kernel *k, uint64_t v, int64_t *longest) {
    for (int i = 0; i < 8; i++) {
        int64_t t = now_ns();
        launch(f, k, 0, ++v);
        while (am_timeline_value(f.t) < v) nap_ns(200000);
        if (longest && now_ns() - t > *longest) *longest = now_ns() - t;
    }
    return v;
}

static void check_predict(void) {
    fake_queue f = queue_new();
    static kernel k5 = {0, 5000000, NULL, 0};  /* 5 ms: the fake stream naps through it */
    uint64_t v = 0, before[8], stats[8];
    /* The due time is the launch's (at most its call's end) plus the queue's estimate,
     * which is at most the longest run it measured: no longer than any launch here took
     * to be seen confirmed (a busy machine stretches those; the bound follows). Below
     * 2 ms, or commands waited for rather than polled at their end, happen where a
     * thread was kept off a core (a nap seen ended late teaches a shorter run, a kernel
     * napping late outruns its prediction): measured again, a few times at most. */
    int64_t longest = 0;
    for (int attempt = 1;; attempt++) {
        v = learn_long(f, &k5, v, &longest);
        am_cuq_stats(f.q, before);
        int64_t early = 0, short_due = 0;
        for (int i = 0; i < 30; i++) {
            int64_t t = now_ns();
            if (launch(f, &k5, 0, ++v)) die("predict: a launch failed");
            int64_t called = now_ns(), due = 0;
            for (int64_t look = 0; !(due = am_timeline_due(f.t, v)) && am_timeline_value(f.t) < v;
                 look_again(&look)) {}
            due -= t;
            if (due > longest + (called - t)) {
                fprintf(stderr, "due in %lld ns, v %llu, value %llu, longest run %lld ns\n",
                        (long long)due, (unsigned long long)v,
                        (unsigned long long)am_timeline_value(f.t), (long long)longest);
                die("predict: the due time is later than any run of the command took");
            }
            short_due += due < 2000000;
            if (am_timeline_due(f.t, v + 1)) die("predict: a due time for an unsubmitted value");
            while (am_timeline_value(f.t) < v) nap_ns(50000);
            if (now_ns() - t < 4900000) early++;
            if (now_ns() - t > longest) longest = now_ns() - t;
        }
        if (early) die("predict: a command was confirmed before it ran");
        am_cuq_stats(f.q, stats);
        /* Blocking or napping waits happen only where a kernel outran its prediction: a
         * few at most. */
        uint64_t waits = stats[1] - before[1] + stats[2] - before[2];
        if (!short_due && waits <= 15) break;
        if (attempt == 4)
            die(short_due ? "predict: the due time is not about 5 ms"
                          : "predict: commands were waited for rather than polled at their end");
    }
    /* Far shorter commands after those: seen within an eighth of the old estimate at
     * first, and the estimate falls (seen only after a 5 ms nap each, they would keep it
     * at ~5 ms): the next one is expected done well within 2 ms. What the queue expects,
     * not how long the commands took, which a busy machine's scheduler stretches. */
    static kernel k02 = {0, 200000, NULL, 0};  /* 0.2 ms */
    for (int attempt = 1;; attempt++) {
        for (int i = 0; i < 20; i++) {
            if (launch(f, &k02, 0, ++v)) die("predict: a launch failed");
            reach(f.t, v, "predict: a short command never ran");
        }
        int64_t t = now_ns();
        if (launch(f, &k02, 0, ++v)) die("predict: a launch failed");
        int64_t due = am_timeline_due(f.t, v);
        reach(f.t, v, "predict: a short command never ran");
        if (due && due - t < 2000000) break;
        /* A command stretched past 2 ms each time by a busy machine: learn the long
         * commands again and measure again, a few times at most. */
        if (attempt == 4) die("predict: short commands after long ones were seen late");
        v = learn_long(f, &k5, v, NULL);
    }
    queue_free(f, 0);
    puts("ok predict");
}

/* A loop (its pipe, notifier and watch) waiting for long commands' values. */
typedef struct {
    int fds[2];
    am_notifier *n;
    am_watch *w;
} fake_loop;

/* Awaits command v of f, running k: returns whether the loop was woken ahead of its end
 * (asked to stay awake until shortly after it, never for long); `kick_at_ns` > 0: a
 * host signal of an unrelated timeline that long after the launch, which cuts the
 * completion thread's nap short. */
static int near_one(fake_queue f, fake_loop *l, kernel *k, uint64_t v, int64_t kick_at_ns) {
    if (am_watch_arm(l->w, v)) die("near: reached before it was launched");
    if (launch(f, k, 0, v)) die("near: a launch failed");
    int64_t due = 0;  /* the queue's prediction, as the completion thread's */
    for (int64_t look = 0; !(due = am_timeline_due(f.t, v)) && am_timeline_value(f.t) < v;
         look_again(&look)) {}
    if (kick_at_ns) {
        nap_ns((long)kick_at_ns);
        am_timeline *other = am_timeline_new();
        am_timeline_host_signal(other, 1, NULL);  /* (kicks every napping completion thread) */
        am_timeline_free(other);
    }
    char byte;
    while (read(l->fds[0], &byte, 1) != 1) nap_ns(2000);
    /* The first byte: the completion thread's, ahead of the end -- or, on a machine too
     * busy for its nap to end in time, the end itself (and then nothing is asked). */
    int64_t until = am_notifier_reset(l->n), at = now_ns();
    if (until && (until - at > CU_NEAR_LEAD_NS + CU_LATE_POLL_NS + 1000000 ||
                  (due && until < due - 1000000))) {
        fprintf(stderr, "until - now %lld ns, until - due %lld ns\n", (long long)(until - at),
                (long long)(until - due));
        die("near: the loop is asked to stay awake not to the expected end, or for long");
    }
    while (am_timeline_value(f.t) < v) nap_ns(50000);
    /* The end's byte, if any: taken to be written under mu (after it, the notifier
     * counts it as on its way), and written once no writer of it is counted -- a byte
     * still on its way would otherwise be the next command's first, taken for that
     * command's end, and the next command's wake-up ahead of its end for its end's. */
    pthread_mutex_lock(&f.t->mu);
    pthread_mutex_unlock(&f.t->mu);
    while (atomic_load(&l->n->writing) & 0xffffffffull) sched_yield();
    while (read(l->fds[0], &byte, 1) == 1) {}
    if (am_notifier_reset(l->n)) die("near: asked to stay awake by the end itself");
    am_watch_arm(l->w, UINT64_MAX);  /* waiting for nothing */
    return until != 0;
}

static void check_near(void) {
    fake_queue f = queue_new();
    static kernel k5 = {0, 5000000, NULL, 0}, k20 = {0, 20000000, NULL, 0};
    fake_loop l;
    if (pipe(l.fds) || fcntl(l.fds[0], F_SETFL, O_NONBLOCK)) die("near: pipe");
    l.n = am_notifier_new(l.fds[1]);
    l.w = am_watch_new(f.t, l.n);
    uint64_t v = 0;
    /* Woken ahead in most of ten (a busy machine's thread may nap past an end), in one
     * of several attempts (a loaded machine spoils a few in a row). */
    for (int attempt = 1, ahead = 0; ahead < 5; attempt++) {
        if (attempt == 9) die("near: long commands' loops were not woken ahead of their ends");
        v = learn_long(f, &k5, v, NULL);
        ahead = 0;
        for (int i = 0; i < 10; i++) ahead += near_one(f, &l, &k5, ++v, 0);
    }
    /* A host signal cutting the nap short of a 20 ms command 5 ms in: the loop is still
     * woken shortly before its end at the earliest, not asked to stay awake till then. */
    v = learn_long(f, &k20, v, NULL);
    for (int i = 0; i < 3; i++) near_one(f, &l, &k20, ++v, 5000000);
    /* Nothing near a value beyond the one waited for. */
    am_watch_arm(l.w, v + 2);
    if (launch(f, &k5, 0, ++v)) die("near: a launch failed");
    while (am_timeline_value(f.t) < v) nap_ns(50000);
    char byte;
    if (read(l.fds[0], &byte, 1) == 1 || am_notifier_reset(l.n))
        die("near: a loop woken for work before the value it waits for");
    am_watch_free(l.w);
    am_notifier_free(l.n);
    close(l.fds[0]);
    close(l.fds[1]);
    queue_free(f, 0);
    puts("ok near");
}

/* Whether q failed from its command 1 on with `code` (CU_HELD_FAILED: a wait held on
 * the host found the value failed; CU_WAITED_FAILED: a wait on the device was for a value
 * never produced), naming the failure behind it: ILLEGAL_ADDRESS at value 7 of `cause`,
 * as the checks below fail their timelines. */
static int fails_from_first(fake_queue q, int code, am_timeline *cause) {
    uint64_t at = 0, value = 0;
    int error = 0;
    return am_cuq_error(q.q, &at) == code && at == 1 &&
           am_cuq_cause(q.q, &error, &value) == (void *)cause && error == ILLEGAL_ADDRESS &&
           value == 7;
}

/* Wait up to 10 s for a timeline to reach a value (else die(what)), asleep on its
 * condition (see "waiting" above). */
static void reach(am_timeline *t, uint64_t value, const char *what) {
    if (am_timeline_value(t) >= value) return;
    int64_t deadline = now_ns() + 10000000000LL;
    pthread_mutex_lock(&t->mu);
    for (int64_t left; am_timeline_value(t) < value;) {
        if ((left = deadline - now_ns()) <= 0) die(what);
        struct timespec until;
        deadline_after(&until, left < LOOK_NAP_MOST_NS ? left : LOOK_NAP_MOST_NS);
        am_cond_timedwait(&t->cv, &t->mu, &until);
    }
    pthread_mutex_unlock(&t->mu);
}

static void check_skipsignal(void) {
    /* h: a host queue's own timeline, failed from 1 once gate fails (command 7 of
     * `cause`'s queue faulted), as in check_hostfailed. */
    am_timeline *gate = am_timeline_new(), *h = am_timeline_new(), *cause = am_timeline_new();
    am_queue *hq = am_queue_new(h, 0, 0);
    if (!hq || am_queue_wait(hq, gate, 1, 1)) die("skipsignal: the host queue");
    /* a: command 1 signals t to 1 behind a gate (in flight until it is raised); command
     * 2 waits for h; command 3 signals t to 2. b waits for t's 2, then fills `memory`
     * and launches; c waits for t's 1, then launches. */
    static uint32_t memory[16];
    fake_queue a = queue_new(), b = queue_new(), c = queue_new();
    free_timeline t = free_timeline_new();
    uint64_t *a_gate = calloc(1, sizeof(uint64_t));
    if (am_cuq_wait(a.q, a_gate, 1, 1) || signal_free(a, t, 1, 1) ||
        wait_held(a, h, 1, 2) ||
        signal_free(a, t, 2, 3))
        die("skipsignal: a failed at once");
    if (wait_held(b, t.t, 2, 1) ||
        am_cuq_fill(b.q, (uint64_t)(uintptr_t)memory, 0xABABABABu, 4, sizeof memory, 2, 0) ||
        launch(b, NULL, 1, 3))
        die("skipsignal: b failed at once");
    if (wait_held(c, t.t, 1, 1) ||
        launch(c, NULL, 1, 2))
        die("skipsignal: c failed at once");
    am_timeline_fail(gate, 1, ILLEGAL_ADDRESS, 7, cause);
    /* a's wait on h goes on, failed: a's signal of t to 2 is handed over, passed, and b's
     * wait with it -- while a's signal of t to 1 is still behind its gate, then raised */
    nap_ns(20000000);  /* 20 ms */
    atomic_store((_Atomic uint64_t *)a_gate, 1);
    reach(b.t, UINT64_MAX, "skipsignal: b's wait for a passed signal never ended");
    if (atomic_load(&b.s->ran)) die("skipsignal: a kernel behind a passed signal launched");
    for (size_t i = 0; i < 16; i++)
        if (memory[i]) die("skipsignal: a fill behind a passed signal wrote its memory");
    uint64_t at = 0, value = 0;
    int error = 0;
    if (!fails_from_first(b, CU_HELD_FAILED, cause))
        die("skipsignal: b does not fail from its wait, naming the host timeline's failure");
    reach(a.t, UINT64_MAX, "skipsignal: a never settled");
    reach(c.t, 2, "skipsignal: c's wait for a's signal in flight never ended");
    if (am_cuq_error(c.q, &at) || am_timeline_value(c.t) != 2 || atomic_load(&c.s->ran) != 1)
        die("skipsignal: a wait for a signal in flight before the passed one failed");
    am_timeline *by = NULL;
    if (am_cuq_error(a.q, &at) != CU_HELD_FAILED || at != 2 ||
        am_timeline_failure(t.t, &error, &value, &by) != 2 || by != cause ||
        error != ILLEGAL_ADDRESS || value != 7 || am_timeline_value(t.t) != UINT64_MAX)
        die("skipsignal: the passed signal's timeline does not fail from its value so");
    am_queue_close(hq, 0);
    fake_queue all[3] = {a, b, c};
    for (int i = 0; i < 3; i++) queue_free(all[i], 0);
    free_timeline_free(t);
    free(a_gate);
    am_timeline_free(gate);
    am_timeline_free(h);
    am_timeline_free(cause);
    puts("ok skipsignal");
}

static void check_twosignals(void) {
    /* h: a host queue's own timeline, failed from 1 once hgate fails (command 7 of
     * `cause`'s queue faulted). p: command 1 signals t to 1 behind p_gate (in flight,
     * handed over, until it is raised). q, as a queue's signal after another queue's
     * pending one is submitted: command 1 waits for h; command 2 waits for t's 1 (p's
     * signal, handed over: made on the device); command 3 waits for q_gate, then
     * signals t to 2 -- passed behind the failed wait. */
    am_timeline *hgate = am_timeline_new(), *h = am_timeline_new(), *cause = am_timeline_new();
    am_queue *hq = am_queue_new(h, 0, 0);
    if (!hq || am_queue_wait(hq, hgate, 1, 1)) die("twosignals: the host queue");
    fake_queue p = queue_new(), q = queue_new(), r = queue_new();
    free_timeline t = free_timeline_new();
    uint64_t *gates = calloc(2, sizeof(uint64_t)), *p_gate = gates, *q_gate = gates + 1;
    if (am_cuq_wait(p.q, p_gate, 1, 1) || signal_free(p, t, 1, 1)) die("twosignals: p failed at once");
    if (wait_held(q, h, 1, 1) ||
        wait_held(q, t.t, 1, 2) ||
        am_cuq_wait(q.q, q_gate, 1, 3) || signal_free(q, t, 2, 3))
        die("twosignals: q failed at once");
    am_timeline_fail(hgate, 1, ILLEGAL_ADDRESS, 7, cause);
    /* q's signal of t to 2 is passed: t fails from 2 -- p's signal in flight reaches 1 */
    int error = 0;
    uint64_t at = 0, value = 0;
    am_timeline *by = NULL;
    int64_t deadline = now_ns() + 10000000000LL;
    for (int64_t look = 0; !am_timeline_failure(t.t, &error, &value, &by); look_again(&look))
        if (now_ns() > deadline) die("twosignals: q's passed signal did not fail its timeline");
    /* r waits for t's 1, then launches: p's signal gets t there */
    if (wait_held(r, t.t, 1, 1) ||
        launch(r, NULL, 1, 2))
        die("twosignals: r failed at once");
    atomic_store((_Atomic uint64_t *)p_gate, 1);
    reach(p.t, 1, "twosignals: p's signal never ran");
    reach(r.t, 2, "twosignals: r's wait for p's signal never ended");
    if (am_cuq_error(r.q, &at) || am_timeline_value(r.t) != 2 || atomic_load(&r.s->ran) != 1)
        die("twosignals: a wait for another queue's signal in flight before a passed one failed");
    atomic_store((_Atomic uint64_t *)q_gate, 1);
    reach(q.t, UINT64_MAX, "twosignals: q never settled");
    reach(t.t, UINT64_MAX, "twosignals: t never settled");
    if (am_cuq_error(q.q, &at) != CU_HELD_FAILED || at != 1 ||
        am_timeline_failure(t.t, &error, &value, &by) != 2 || by != cause ||
        error != ILLEGAL_ADDRESS || value != 7)
        die("twosignals: the passed signal's timeline does not fail from its value so");
    am_queue_close(hq, 0);
    fake_queue all[3] = {p, q, r};
    for (int i = 0; i < 3; i++) queue_free(all[i], 0);
    free_timeline_free(t);
    free(gates);
    am_timeline_free(hgate);
    am_timeline_free(h);
    am_timeline_free(cause);
    puts("ok twosignals");
}

static void fail_in(const char *check, const char *what) {
    char message[256];
    snprintf(message, sizeof message, "%s: %s", check, what);
    die(message);
}

/* r waits for t's 1, which q's command 3 (failing) was to produce, then launches, its
 * stream held by a gate until all of r is submitted (r, failed from its command 1,
 * settles only once past it), as is q's command 2 by q_gate (raised with it: r's wait
 * is submitted before q's command 3 ran): nothing of r runs, r fails from its wait and
 * t from 1, both naming `cause` (ILLEGAL_ADDRESS, 7). Frees q, r and q_gate. */
static void held_behind_failed_signal(const char *check, fake_queue q, fake_queue r,
                                      free_timeline t, am_timeline *cause, uint64_t *q_gate) {
    int error = 0;
    uint64_t value = 0;
    am_timeline *by = NULL;
    uint64_t *r_gate = calloc(1, sizeof(uint64_t));
    if (am_cuq_wait(r.q, r_gate, 1, 1) || wait_held(r, t.t, 1, 1) ||
        launch(r, NULL, 1, 2))
        fail_in(check, "r failed at once");
    atomic_store((_Atomic uint64_t *)r_gate, 1);
    atomic_store((_Atomic uint64_t *)q_gate, 1);
    int64_t deadline = now_ns() + 10000000000LL;
    for (int64_t look = 0;
         am_timeline_value(q.t) < UINT64_MAX || am_timeline_value(r.t) < UINT64_MAX;
         look_again(&look))
        if (now_ns() > deadline) fail_in(check, "q or r never settled");
    if (atomic_load(&r.s->ran))
        fail_in(check, "a kernel behind a wait for a signal known to fail launched");
    if (!fails_from_first(r, CU_HELD_FAILED, cause))
        fail_in(check, "r does not fail from its wait, naming t0's failure");
    if (am_timeline_failure(t.t, &error, &value, &by) != 1 || by != cause)
        fail_in(check, "t does not fail from 1, naming t0's failure");
    queue_free(q, 0);
    queue_free(r, 0);
    free(r_gate);
    free(q_gate);
}

static void check_poisonsignal(void) {
    /* q, bounded to 3 in flight: command 1 waits on the device for t0; command 2 waits
     * for a gate (held_behind_failed_signal raises it), then launches; command 3
     * signals t to 1 (all three handed over); command 4 signals t to 2 (held on the
     * host). t0 fails: q's commands from 1 on fail once confirmed -- command 3's signal
     * among them -- and command 4's signal is passed. */
    fake_queue q = queue_bounded(3), r = queue_new();
    free_timeline t0 = free_timeline_new(), t = free_timeline_new();
    am_timeline *cause = am_timeline_new();
    uint64_t *gate = calloc(1, sizeof(uint64_t));
    if (wait_free(q, t0, 1, 1) || gated_launch(q, gate, 2) || signal_free(q, t, 1, 3) ||
        signal_free(q, t, 2, 4))
        die("poisonsignal: q failed at once");
    am_timeline_fail(t0.t, 1, ILLEGAL_ADDRESS, 7, cause);
    int error = 0;
    uint64_t value = 0;
    am_timeline *by = NULL;
    int64_t deadline = now_ns() + 10000000000LL;
    for (int64_t look = 0; !am_timeline_failure(t.t, &error, &value, &by); look_again(&look))
        if (now_ns() > deadline) die("poisonsignal: q's passed signal did not fail its timeline");
    /* (command 2 waits for its gate: command 3's signal, known to fail, is not
     * confirmed yet) */
    if (am_timeline_value(t.t)) die("poisonsignal: t settled before command 3 ran");
    held_behind_failed_signal("poisonsignal", q, r, t, cause, gate);
    free_timeline_free(t0);
    free_timeline_free(t);
    am_timeline_free(cause);
    puts("ok poisonsignal");
}

static void check_poisonflight(void) {
    /* q: command 1 waits on the device for t0; command 2 waits for a gate
     * (held_behind_failed_signal raises it), then launches; command 3 signals t to 1
     * (all handed over). t0 fails: q's commands from 1 on fail once confirmed, command
     * 3's signal among them, which is known once command 1 is confirmed. */
    fake_queue q = queue_new(), r = queue_new();
    free_timeline t0 = free_timeline_new(), t = free_timeline_new();
    am_timeline *cause = am_timeline_new();
    uint64_t *gate = calloc(1, sizeof(uint64_t));
    if (wait_free(q, t0, 1, 1) || gated_launch(q, gate, 2) || signal_free(q, t, 1, 3))
        die("poisonflight: q failed at once");
    am_timeline_fail(t0.t, 1, ILLEGAL_ADDRESS, 7, cause);
    int error = 0;
    uint64_t value = 0;
    int64_t deadline = now_ns() + 10000000000LL;
    /* q learned of it: poisoned */
    for (int64_t look = 0; !am_cuq_cause(q.q, &error, &value); look_again(&look))
        if (now_ns() > deadline) die("poisonflight: q never learned its wait failed");
    if (am_timeline_value(t.t)) die("poisonflight: t settled before command 3 ran");
    held_behind_failed_signal("poisonflight", q, r, t, cause, gate);
    free_timeline_free(t0);
    free_timeline_free(t);
    am_timeline_free(cause);
    puts("ok poisonflight");
}

static void check_poisonlater(void) {
    /* p: command 1 waits on the device for t0; command 2 waits for a gate (raised once r
     * below was submitted), then launches; command 3 signals t to 1 (all handed over).
     * h: a host queue's timeline, failed from 1 once hgate fails. q: command 1 waits
     * for h; command 2 waits for t's 1 (p's signal, handed over: made on the device);
     * command 3 signals t to 2 -- passed once h fails, while p's signal still counts as
     * sure: t fails from 2. Then t0 fails: p learns that its signal of t to 1 fails, and
     * t fails from 1. */
    am_timeline *hgate = am_timeline_new(), *h = am_timeline_new(), *cause = am_timeline_new();
    am_queue *hq = am_queue_new(h, 0, 0);
    if (!hq || am_queue_wait(hq, hgate, 1, 1)) die("poisonlater: the host queue");
    fake_queue p = queue_new(), q = queue_new(), r = queue_new();
    free_timeline t0 = free_timeline_new(), t = free_timeline_new();
    uint64_t *p_gate = calloc(1, sizeof(uint64_t));
    if (wait_free(p, t0, 1, 1) || gated_launch(p, p_gate, 2) || signal_free(p, t, 1, 3))
        die("poisonlater: p failed at once");
    if (wait_held(q, h, 1, 1) ||
        wait_held(q, t.t, 1, 2) ||
        signal_free(q, t, 2, 3))
        die("poisonlater: q failed at once");
    am_timeline_fail(hgate, 1, ILLEGAL_ADDRESS, 5, cause);
    int error = 0;
    uint64_t value = 0;
    am_timeline *by = NULL;
    int64_t deadline = now_ns() + 10000000000LL;
    for (int64_t look = 0; am_timeline_failure(t.t, &error, &value, &by) != 2; look_again(&look))
        if (now_ns() > deadline) die("poisonlater: q's passed signal did not fail t from 2");
    am_timeline_fail(t0.t, 1, ILLEGAL_ADDRESS, 7, cause);
    /* p learned of it: poisoned */
    for (int64_t look = 0; !am_cuq_cause(p.q, &error, &value); look_again(&look))
        if (now_ns() > deadline) die("poisonlater: p never learned its wait failed");
    if (am_timeline_value(t.t)) die("poisonlater: t settled before p's command 3 ran");
    /* r waits for t's 1, which p's command 3 (failing) was to produce, then launches */
    uint64_t *r_gate = calloc(1, sizeof(uint64_t));  /* (r, failed from its command 1,
                                                        settles only once past it) */
    if (am_cuq_wait(r.q, r_gate, 1, 1) || wait_held(r, t.t, 1, 1) ||
        launch(r, NULL, 1, 2))
        die("poisonlater: r failed at once");
    atomic_store((_Atomic uint64_t *)r_gate, 1);
    atomic_store((_Atomic uint64_t *)p_gate, 1);
    reach(p.t, UINT64_MAX, "poisonlater: p never settled");
    reach(q.t, UINT64_MAX, "poisonlater: q never settled");
    reach(r.t, UINT64_MAX, "poisonlater: r never settled");
    if (atomic_load(&r.s->ran))
        die("poisonlater: a kernel behind a wait for a signal known to fail launched");
    if (!fails_from_first(r, CU_HELD_FAILED, cause))
        die("poisonlater: r does not fail from its wait, naming t0's failure");
    if (am_timeline_failure(t.t, &error, &value, &by) != 1 || by != cause || value != 7)
        die("poisonlater: t does not fail from 1, naming t0's failure");
    am_queue_close(hq, 0);
    fake_queue all[3] = {p, q, r};
    for (int i = 0; i < 3; i++) queue_free(all[i], 0);
    free_timeline_free(t0);
    free_timeline_free(t);
    am_timeline_free(hgate);
    am_timeline_free(h);
    am_timeline_free(cause);
    free(r_gate);
    free(p_gate);
    puts("ok poisonlater");
}

static void check_failedqueue(void) {
    /* a: command 1 waits on the device for t, which fails (command 7 of `cause`'s
     * queue faulted); command 2 launches behind it: both run, and fail once confirmed */
    fake_queue a = queue_new(), b = queue_new();
    free_timeline t = free_timeline_new();
    am_timeline *cause = am_timeline_new();
    if (wait_free(a, t, 1, 1) || launch(a, NULL, 1, 2)) die("failedqueue: a failed at once");
    am_timeline_fail(t.t, 1, ILLEGAL_ADDRESS, 7, cause);
    reach(a.t, UINT64_MAX, "failedqueue: a never settled");
    uint64_t at = 0;
    if (am_cuq_error(a.q, &at) != CU_WAITED_FAILED || at != 1)
        die("failedqueue: a did not fail from its wait");
    /* b waits for a's failed command 2, then launches; its stream first waits for a
     * gate, raised once all is submitted (b, failed from its command 1, would settle and
     * take nothing more once its stream is past all it was given) */
    uint64_t *gate = calloc(1, sizeof(uint64_t));
    if (am_cuq_wait(b.q, gate, 1, 1) || am_cuq_wait_queue(b.q, a.q, 2, 1) ||
        am_cuq_finish(b.q, 1, NULL, 0, 0, CU_FINISH_PLAIN) || launch(b, NULL, 1, 2))
        die("failedqueue: b failed at once");
    atomic_store((_Atomic uint64_t *)gate, 1);
    reach(b.t, UINT64_MAX, "failedqueue: b never settled");
    if (atomic_load(&b.s->ran)) die("failedqueue: a kernel behind a wait for a failed command ran");
    if (!fails_from_first(b, CU_HELD_FAILED, cause))
        die("failedqueue: b did not fail from its wait, naming the failure it came to");
    queue_free(a, 0);
    queue_free(b, 0);
    free(gate);
    free_timeline_free(t);
    am_timeline_free(cause);
    puts("ok failedqueue");
}

static void check_poisonheld(void) {
    /* a: command 1 waits on the device for t, which fails; command 2, behind it, waits
     * for a gate raised once a's thread learned of the failure (b's wait ends only
     * then), then launches. b, bounded to 1 in flight: command 1 waits on the device for
     * a's 2; commands 2 and 3, launches, are held on the host. */
    fake_queue a = queue_new(), b = queue_bounded(1);
    free_timeline t = free_timeline_new();
    am_timeline *cause = am_timeline_new();
    uint64_t *gate = calloc(1, sizeof(uint64_t)), value = 0;
    int error = 0;
    if (wait_free(a, t, 1, 1) || gated_launch(a, gate, 2)) die("poisonheld: a failed at once");
    if (am_cuq_wait_queue(b.q, a.q, 2, 1) || am_cuq_finish(b.q, 1, NULL, 0, 0, CU_FINISH_PLAIN) ||
        launch(b, NULL, 1, 2) || launch(b, NULL, 2, 3))
        die("poisonheld: b failed at once");
    uint64_t stats[8];
    am_cuq_stats(b.q, stats);
    if (stats[6] != 4) die("poisonheld: b's launches were not held on the host");
    am_timeline_fail(t.t, 1, ILLEGAL_ADDRESS, 7, cause);
    int64_t deadline = now_ns() + 10000000000LL;
    /* a learned of it: poisoned */
    for (int64_t look = 0; !am_cuq_cause(a.q, &error, &value); look_again(&look))
        if (now_ns() > deadline) die("poisonheld: a never learned its wait failed");
    atomic_store((_Atomic uint64_t *)gate, 1);
    reach(a.t, UINT64_MAX, "poisonheld: a never settled");
    reach(b.t, UINT64_MAX, "poisonheld: b never settled");
    if (atomic_load(&a.s->ran) != 1) die("poisonheld: a's kernel handed over did not run");
    if (atomic_load(&b.s->ran)) die("poisonheld: a kernel held behind a failed wait ran");
    if (!fails_from_first(b, CU_WAITED_FAILED, cause))
        die("poisonheld: b did not fail from its wait, naming the failure it came to");
    queue_free(a, 0);
    queue_free(b, 0);
    free_timeline_free(t);
    am_timeline_free(cause);
    free(gate);
    puts("ok poisonheld");
}

/* The end of check_poisondeferred and check_refusedpromise: t (a's command 1 waits for
 * it on the device) fails; a settles, failing from that wait, naming the failure. The
 * queues, t, u and the cause go. */
static void settles_failed(const char *name, fake_queue a, fake_queue b, free_timeline t,
                           free_timeline u, am_timeline *cause) {
    char what[96];
    am_timeline_fail(t.t, 1, ILLEGAL_ADDRESS, 7, cause);
    snprintf(what, sizeof what, "%s: a never settled", name);
    reach(a.t, UINT64_MAX, what);
    snprintf(what, sizeof what, "%s: a did not fail from its wait, naming its failure", name);
    if (!fails_from_first(a, CU_WAITED_FAILED, cause)) die(what);
    queue_free(a, 0);
    queue_free(b, 0);
    free_timeline_free(t);
    free_timeline_free(u);
    am_timeline_free(cause);
    printf("ok %s\n", name);
}

static void check_poisondeferred(void) {
    /* a: command 1 waits on the device for t, which fails; command 2 waits for u's 5
     * (nothing signals u), command 3 for b's 100 (b was given nothing): both held on
     * the host before t fails. */
    fake_queue a = queue_new(), b = queue_new();
    free_timeline t = free_timeline_new(), u = free_timeline_new();
    am_timeline *cause = am_timeline_new();
    if (wait_free(a, t, 1, 1) || wait_held(a, u.t, 5, 2) || am_cuq_wait_queue(a.q, b.q, 100, 3) ||
        am_cuq_finish(a.q, 3, NULL, 0, 0, CU_FINISH_PLAIN))
        die("poisondeferred: a failed at once");
    uint64_t stats[8];
    am_cuq_stats(a.q, stats);
    if (!stats[6]) die("poisondeferred: a's waits were not held on the host");
    settles_failed("poisondeferred", a, b, t, u, cause);
}

static void check_refusedpromise(void) {
    /* b, discarded (a held wait dropped), refuses its signal of u to 5; a: command 1
     * waits on the device for t, which fails; command 2 waits for u's 5, held on the
     * host. */
    fake_queue a = queue_new(), b = queue_new();
    free_timeline t = free_timeline_new(), u = free_timeline_new(), never = free_timeline_new();
    am_timeline *cause = am_timeline_new();
    if (wait_held(b, never.t, 1, 1)) die("refusedpromise: b failed at once");
    am_cuq_discard(b.q);
    if (!am_cuq_finish(b.q, 2, u.t, 5, 0, 0)) die("refusedpromise: b's signal was taken");
    if (wait_free(a, t, 1, 1) || wait_held(a, u.t, 5, 2) ||
        am_cuq_finish(a.q, 3, NULL, 0, 0, CU_FINISH_PLAIN))
        die("refusedpromise: a failed at once");
    settles_failed("refusedpromise", a, b, t, u, cause);
    free_timeline_free(never);
}

static void check_promisedlater(void) {
    /* a: command 1 waits on the device for a gate; command 2 waits for t, failed
     * already (found so as it is handed over: a passes from there on); command 3 waits
     * for u's 5, which no signal submitted promises (not made). Then b, held behind a
     * wait nothing signals, is given a signal of u to 5 -- after a handed command 3
     * over, before a's thread confirms it: that wait stays one not made. */
    fake_queue a = queue_new(), b = queue_new();
    free_timeline t = free_timeline_new(), u = free_timeline_new(), never = free_timeline_new();
    am_timeline *cause = am_timeline_new();
    uint64_t *gate = calloc(1, sizeof(uint64_t)), at = 0, stats[8];
    am_timeline_fail(t.t, 1, ILLEGAL_ADDRESS, 7, cause);
    if (am_cuq_wait(a.q, gate, 1, 1) || am_cuq_finish(a.q, 1, NULL, 0, 0, CU_FINISH_PLAIN) ||
        wait_held(a, t.t, 1, 2) || wait_held(a, u.t, 5, 3))
        die("promisedlater: a failed at once");
    am_cuq_stats(a.q, stats);
    if (stats[6]) die("promisedlater: (setup) a holds its waits on the host");
    if (wait_held(b, never.t, 1, 1) || am_cuq_finish(b.q, 2, u.t, 5, 0, 0))
        die("promisedlater: b failed at once");
    atomic_store((_Atomic uint64_t *)gate, 1);
    reach(a.t, UINT64_MAX, "promisedlater: a never settled");
    int error = 0;
    uint64_t value = 0;
    if (am_cuq_error(a.q, &at) != CU_HELD_FAILED || at != 2 ||
        am_cuq_cause(a.q, &error, &value) != (void *)cause)
        die("promisedlater: a did not fail from its command 2, naming t's failure");
    queue_free(a, 0);
    queue_free(b, 1);
    free_timeline_free(t);
    free_timeline_free(u);
    free_timeline_free(never);
    am_timeline_free(cause);
    free(gate);
    puts("ok promisedlater");
}

static void check_foreign(void) {
    /* b's stream plays the consumer's: waits go onto it directly, and a kernel behind
     * them checks, as it runs, how far the waited-for queue's stream got. */
    /* Blocked syncs block here (the commands after a long gate get blocking-sync
     * events); check_abandon's orphan, if it is still blocked, returns at the end. */
    int released = atomic_exchange(&release_syncs, 0);
    fake_queue a = queue_bounded(4), c = queue_new(), b = queue_new();
    uint64_t *gates = calloc(2, sizeof(uint64_t));
    static kernel quick = {0, 0, NULL, 0}, after_a = {0, 0, NULL, 59},
                  after_c = {0, 0, NULL, 4};
    after_a.check = a.s, after_c.check = c.s;
    /* a: a wait nobody has signalled, then 64 kernels: all but a few held on the host.
     * c: the same, unbounded: every kernel submitted, none run. */
    fake_queue both[2] = {a, c};
    for (int i = 0; i < 2; i++) {
        if (am_cuq_wait(both[i].q, &gates[i], 1, 1) ||
            am_cuq_finish(both[i].q, 1, NULL, 0, 0, CU_FINISH_PLAIN))
            die("foreign: a gate failed");
        for (uint64_t v = 2; v <= 65; v++)
            if (launch(both[i], &quick, (int64_t)v, v)) die("foreign: a launch failed");
    }
    uint64_t stats[8];
    am_cuq_stats(a.q, stats);
    if (stats[6] < 50) die("foreign: the bounded queue held nothing on the host");
    fake_ctx_set_current((void *)0x77);  /* another library's context */
    int call = -1;
    if (am_cuq_wait_foreign(a.q, (void *)1, b.s, 60, &call) || call != CU_WAIT_EVENT)
        die("foreign: a value held on the host was not handed over and waited for on its event");
    am_cuq_stats(a.q, stats);
    if (stats[6] > 10) die("foreign: what the queue held up to the value stayed held");
    if (am_cuq_wait_foreign(c.q, (void *)1, b.s, 5, &call) || call != CU_WAIT_EVENT)
        die("foreign: a submitted value was not waited for on its event");
    if (fake_ctx_current() != (void *)0x77) die("foreign: the caller's context was not kept");
    if (launch(b, &after_a, 1, 1) || launch(b, &after_c, 2, 2)) die("foreign: b's launch");
    nap_ns(20000000);
    if (am_timeline_value(b.t) || atomic_load(&b.s->ran))
        die("foreign: the consumer's stream ran before the values it waits for");
    atomic_store((_Atomic uint64_t *)&gates[0], 1);  /* a runs, hands over what it held */
    atomic_store((_Atomic uint64_t *)&gates[1], 1);
    reach(b.t, 2, "foreign: the consumer's stream never got past its waits");
    reach(a.t, 65, "foreign: a never finished");
    size_t tail = b.s->tail;
    if (am_cuq_wait_foreign(a.q, (void *)1, b.s, 30, &call))
        die("foreign: a wait for a confirmed value failed");
    if (b.s->tail != tail) die("foreign: a confirmed value was waited for");
    queue_free(a, 0);
    queue_free(c, 0);
    queue_free(b, 0);
    free(gates);
    atomic_store(&release_syncs, released);
    puts("ok foreign");
}

typedef struct { fake_queue owner; fake_stream *stream; uint64_t target; int r, call; } waiter;

static void *wait_in_driver(void *arg) {
    waiter *w = arg;
    w->r = am_cuq_wait_foreign(w->owner.q, (void *)1, w->stream, w->target, &w->call);
    return NULL;
}

static void check_unlocked(void) {
    fake_queue a = queue_new(), b = queue_new();
    static kernel slow = {0, 40000000, NULL, 0}, after_a = {0, 0, NULL, 1};
    after_a.check = a.s;
    if (launch(a, &slow, 1, 1)) die("unlocked: a's launch failed");
    /* b's wait on a's command 1 stays in the driver until the checks below are done (10 s
     * at most: a submission or confirmation that waited for it finds it gone) */
    atomic_store(&wait_gate_on, b.s);
    waiter w = {a, b.s, 1, -1, -1};
    pthread_t thread;
    pthread_create(&thread, NULL, wait_in_driver, &w);
    for (int64_t look = 0; !atomic_load(&waits_in_driver); look_again(&look)) {}
    for (uint64_t v = 2; v <= 20; v++)
        if (launch(a, NULL, (int64_t)v, v)) die("unlocked: a launch failed");
    if (!atomic_load(&waits_in_driver))
        die("unlocked: a submission waited for another stream's wait in the driver");
    reach(a.t, 20, "unlocked: a's commands were never confirmed");
    /* more commands, all in flight at once behind a gate, with plain events as command
     * 1's: they take every event of the pool, but not the one lent */
    _Atomic uint64_t *gate = calloc(1, sizeof *gate);
    for (uint64_t v = 21; v <= 60; v++)
        if (am_cuq_wait(a.q, (void *)gate, 1, v) ||
            am_cuq_finish(a.q, v, NULL, 0, 0, CU_FINISH_PLAIN))
            die("unlocked: a wait failed");
    atomic_store(gate, 1);
    reach(a.t, 60, "unlocked: a's commands were never confirmed");
    if (!atomic_load(&waits_in_driver))
        die("unlocked: confirmations waited for another stream's wait in the driver");
    atomic_store(&wait_gate_on, NULL);
    pthread_join(thread, NULL);
    if (w.r || w.call != CU_WAIT_EVENT) die("unlocked: the wait was not made on the event");
    if (launch(b, &after_a, 1, 1)) die("unlocked: b's launch failed");
    reach(b.t, 1, "unlocked: b never got past its wait");
    queue_free(a, 0);
    queue_free(b, 0);
    free((void *)gate);
    puts("ok unlocked");
}

static void check_waitstream(void) {
    /* b plays another library's stream: a wait nobody has signalled yet, then a kernel.
     * a: its own gate, then 20 kernels, most held on the host; then its wait for what
     * was submitted to b so far (held too), then a kernel that checks b's ran. */
    /* Blocked syncs block here (a's commands behind its gate get blocking-sync events);
     * check_abandon's orphan, if it is still blocked, returns at the end. */
    int released = atomic_exchange(&release_syncs, 0);
    static uint64_t gates[6];
    static kernel quick = {0, 0, NULL, 0}, after_b = {0, 0, NULL, 1};
    fake_queue a = queue_bounded(4), b = queue_new(), c = queue_new(), d = queue_bounded(2);
    after_b.check = b.s;
    if (am_cuq_wait(b.q, &gates[0], 1, 1) || am_cuq_finish(b.q, 1, NULL, 0, 0, CU_FINISH_PLAIN))
        die("waitstream: b's gate failed");
    if (launch(b, &quick, 1, 2)) die("waitstream: b's launch failed");
    if (am_cuq_wait(a.q, &gates[1], 1, 1) || am_cuq_finish(a.q, 1, NULL, 0, 0, CU_FINISH_PLAIN))
        die("waitstream: a's gate failed");
    for (uint64_t v = 2; v <= 21; v++)
        if (launch(a, &quick, (int64_t)v, v)) die("waitstream: a launch failed");
    long made = atomic_load(&events_made);
    fake_ctx_set_current((void *)0x77);  /* another library's context */
    int call = -1;
    if (am_cuq_wait_stream_end(a.q, (void *)1, b.s, 22, 0, 0, &call))
        die("waitstream: the wait was refused");
    if (fake_ctx_current() != (void *)0x77) die("waitstream: the caller's context was not kept");
    if (atomic_load(&events_made) > made + 1) die("waitstream: more than one event made");
    if (launch(a, &after_b, 23, 23)) die("waitstream: a's launch after the wait failed");
    atomic_store((_Atomic uint64_t *)&gates[1], 1);  /* a runs up to its wait */
    reach(a.t, 21, "waitstream: a never ran what came before its wait");
    nap_ns(20000000);
    if (am_timeline_value(a.t) > 21) die("waitstream: a got past its wait before b's work ran");
    atomic_store((_Atomic uint64_t *)&gates[0], 1);  /* b's work runs: a goes on */
    reach(a.t, 23, "waitstream: a never got past its wait");
    /* Nothing held: the wait goes to the driver at once. */
    if (am_cuq_wait_stream_end(c.q, (void *)1, b.s, 1, 500000, 0, &call))
        die("waitstream: a direct wait was refused");
    reach(c.t, 1, "waitstream: a direct wait never ended");
    /* Waits one after another: each event, waited on, goes back to c's own and is
     * recorded again, not made anew every time. */
    made = atomic_load(&events_made);
    for (uint64_t v = 2; v <= 11; v++) {
        if (am_cuq_wait_stream_end(c.q, (void *)1, b.s, v, 0, 0, &call))
            die("waitstream: a wait after another was refused");
        reach(c.t, v, "waitstream: a wait after another never ended");
    }
    if (atomic_load(&events_made) > made + 2) die("waitstream: an event made for every wait");
    /* Two waits in one command, on two streams: the event the first waited on goes back
     * to c's own and is recorded again at once on the second stream, which is idle; the
     * first wait still waits for what g's stream had when it was made. */
    fake_queue g = queue_new();
    static kernel after_g = {0, 0, NULL, 1};
    after_g.check = g.s;
    if (am_cuq_wait(g.q, &gates[3], 1, 1) || am_cuq_finish(g.q, 1, NULL, 0, 0, CU_FINISH_PLAIN) ||
        launch(g, &quick, 1, 2))
        die("waitstream: g's gate failed");
    if (am_cuq_wait_stream(c.q, (void *)1, g.s, 12, &call) ||
        am_cuq_wait_stream(c.q, (void *)1, b.s, 12, &call) || am_cuq_finish(c.q, 12, NULL, 0, 0, 0))
        die("waitstream: two waits in one command were refused");
    if (launch(c, &after_g, 13, 13)) die("waitstream: c's launch after two waits failed");
    nap_ns(20000000);
    if (am_timeline_value(c.t) >= 12) die("waitstream: a wait ended by its event's later record");
    atomic_store((_Atomic uint64_t *)&gates[3], 1);
    reach(c.t, 13, "waitstream: two waits in one command never ended");
    queue_free(g, 0);
    /* Waits held on the host, in batches behind a gate: handed over together, their
     * events go back to h's own, and the next batch's waits take them from there. */
    fake_queue h = queue_bounded(2);
    uint64_t v = 1;
    for (int batch = 0; batch < 2; batch++) {
        if (am_cuq_wait(h.q, &gates[4 + batch], 1, v) ||
            am_cuq_finish(h.q, v, NULL, 0, 0, CU_FINISH_PLAIN))
            die("waitstream: h's gate failed");
        made = atomic_load(&events_made);
        for (int i = 0; i < 40; i++) {
            v++;
            if (am_cuq_wait_stream_end(h.q, (void *)1, b.s, v, 0, 0, &call))
                die("waitstream: a held wait was refused");
        }
        atomic_store((_Atomic uint64_t *)&gates[4 + batch], 1);
        reach(h.t, v, "waitstream: held waits never ended");
        v++;
    }
    if (atomic_load(&events_made) > made + 10)
        die("waitstream: held waits made events while their queue had them spare");
    queue_free(h, 0);
    /* Held behind a gate nobody opens, then abandoned: its event goes with it. */
    if (am_cuq_wait(d.q, &gates[2], 1, 1) || am_cuq_finish(d.q, 1, NULL, 0, 0, CU_FINISH_PLAIN))
        die("waitstream: d's gate failed");
    for (uint64_t v = 2; v <= 4; v++)
        if (launch(d, &quick, (int64_t)v, v)) die("waitstream: a launch on d failed");
    if (am_cuq_wait_stream(d.q, (void *)1, b.s, 5, &call)) die("waitstream: d's wait was refused");
    queue_free(d, 1);
    /* The command's end refused after its wait was handed over (its event record on e's
     * stream): the wait reached the driver, so e fails from that command on (as for any
     * command refused in part: refusedpart) and settles, and the wait's event, given
     * back to e's own as it was waited on, is destroyed once only (main's count of
     * events at the end). */
    fake_queue e = queue_new();
    atomic_store(&refuse_records, e.s);
    if (!am_cuq_wait_stream_end(e.q, (void *)1, b.s, 1, 0, 0, &call))
        die("waitstream: a wait whose end was refused succeeded");
    if (atomic_load(&refuse_records)) die("waitstream: the end's record was never made");
    uint64_t failed_at = 0;
    if (am_cuq_error(e.q, &failed_at) != 1 || failed_at != 1)
        die("waitstream: a queue whose wait ran but whose end was refused did not fail from it");
    reach(e.t, UINT64_MAX, "waitstream: a queue failed by a refused end never settled");
    queue_free(e, 0);
    queue_free(a, 0);
    queue_free(c, 0);
    queue_free(b, 0);
    fake_ctx_set_current(NULL);
    atomic_store(&release_syncs, released);
    puts("ok waitstream");
}

/* w waits for `on`'s command `target` (w's command `value`), which confirms it there. */
static int wait_queue(fake_queue w, fake_queue on, uint64_t target, uint64_t value) {
    return am_cuq_wait_queue(w.q, on.q, target, value) ||
           am_cuq_finish(w.q, value, on.t, target, 0, CU_FINISH_PLAIN);
}

/* hold_head's thread sees its event now; returns once q has nothing pending. */
static void let_held_go(fake_queue q, const char *what) {
    atomic_store(&held, NULL);
    int64_t deadline = now_ns() + 10000000000LL;
    for (int64_t look = 0; atomic_load(&q.q->pending); look_again(&look))
        if (now_ns() > deadline) die(what);
}

/* A queue's device wait on a timeline no queue owns, confirmed first through another
 * queue that waited for it (which raises the first queue's timeline past it, before the
 * first queue's own thread looked): the waited timeline may then be freed -- what kept
 * it (the queue's keep-alive, Python's) lets go once the queue's timeline passed the
 * wait -- while that thread has yet to confirm the wait on it. */
static void check_waitedfreed(void) {
    fake_queue a = queue_new(), b = queue_new();
    free_timeline t = free_timeline_new();
    am_timeline_host_signal(t.t, 1, NULL);  /* only the host signalled it: on the device */
    if (wait_held(a, t.t, 2, 1)) die("waitedfreed: a's wait");
    hold_head(a);
    if (wait_queue(b, a, 1, 1)) die("waitedfreed: b's wait");
    am_timeline_host_signal(t.t, 2, NULL);
    reach(a.t, 1, "waitedfreed: a's wait never confirmed through b");
    am_timeline_free(t.t);  /* what Python does once a's timeline passed the wait */
    let_held_go(a, "waitedfreed: a's thread never saw its wait");
    queue_free(b, 0);
    queue_free(a, 0);
    free(t.word);
    puts("ok waitedfreed");
}

/* A queue's device wait on another queue's command, confirmed by its own thread before
 * the other queue's thread confirmed a device wait of its own, before that command, on
 * a timeline no queue owns -- which had failed by then (recorded before the word was
 * raised to release the device waits): the wait for a value never produced fails the
 * waiting queue from there, with the failure it came to, as when the other queue's
 * thread confirms its wait first (poisonheld), rather than pass as a success and raise
 * the other queue's timeline past its failed wait. a: command 1 waits on the device for
 * t (its event held: a's thread sees it unfinished), command 2 launches; b: command 1
 * waits for a's 2, command 2 launches. */
/* b's command 1 waited on the device for a's value `target`, which a never produces (an
 * earlier wait of a's is known failed); b's command 2 is a launch. Once b's thread saw
 * both end -- and raised b's timeline for them: to 2 had they passed, to UINT64_MAX as it
 * settled failed (after its count of pending commands fell to 0) -- a's timeline was not
 * raised to `target` through b's wait, and b failed from its wait on, naming the failure. */
static void wait_failed_first(const char *check, fake_queue a, fake_queue b, uint64_t target,
                              am_timeline *cause) {
    char what[160];
    snprintf(what, sizeof what, "%s: b's thread never saw its commands end", check);
    reach(b.t, 2, what);
    snprintf(what, sizeof what,
             "%s: b's wait raised a's timeline past a wait for a value never produced", check);
    if (am_timeline_value(a.t) >= target) die(what);
    snprintf(what, sizeof what,
             "%s: b's wait for a value never produced was confirmed as a success", check);
    if (am_timeline_value(b.t) != UINT64_MAX || !fails_from_first(b, CU_WAITED_FAILED, cause))
        die(what);
}

static void check_waitrace(void) {
    fake_queue a = queue_new(), b = queue_new();
    free_timeline t = free_timeline_new();
    am_timeline *cause = am_timeline_new();
    hold_next(a);
    if (wait_free(a, t, 1, 1) || launch(a, NULL, 1, 2)) die("waitrace: a failed at once");
    check_held(a, "waitrace: (setup) a's wait is not the command held");
    if (wait_queue(b, a, 2, 1) || launch(b, NULL, 1, 2)) die("waitrace: b failed at once");
    am_timeline_fail(t.t, 1, ILLEGAL_ADDRESS, 7, cause);
    wait_failed_first("waitrace", a, b, 2, cause);
    let_held_go(a, "waitrace: a's thread never saw its wait");
    reach(a.t, UINT64_MAX, "waitrace: a never settled");
    if (!fails_from_first(a, CU_WAITED_FAILED, cause))
        die("waitrace: a did not fail from its wait, naming the failure");
    queue_free(a, 0);
    queue_free(b, 0);
    free_timeline_free(t);
    am_timeline_free(cause);
    puts("ok waitrace");
}

/* A check's hook holding a queue's thread: until the check lets it go (10 s at most). */
static void held_until(atomic_int *go) {
    int64_t deadline = now_ns() + 10000000000LL;
    for (int64_t look = 0; !atomic_load(go) && now_ns() < deadline; look_again(&look)) {}
}

/* Until a check's hook was reached (10 s at most: else `what`). */
static void hook_reached(atomic_int *in, const char *what) {
    for (int64_t deadline = now_ns() + 10000000000LL, look = 0; !atomic_load(in); look_again(&look))
        if (now_ns() > deadline) die(what);
}

/* A chain check's end: its hook off, its three queues, free timeline and cause freed. */
static void chain_free(fake_queue a, fake_queue b, fake_queue c, free_timeline t,
                       am_timeline *cause) {
    atomic_store(&test_hook, NULL);
    queue_free(a, 0);
    queue_free(b, 0);
    queue_free(c, 0);
    free_timeline_free(t);
    am_timeline_free(cause);
}

/* waitrace one level further: b's wait on a's command 3, behind a's wait (command 2) on
 * c's command 2, behind c's device wait (command 1) on a free timeline t that failed.
 * c's thread is held (it has not confirmed its failed wait), a's thread is stopped after
 * its command 1 (a hook), b's thread confirms first: b's check of a finds no `waited`
 * entry of a's (a's wait is on a queue) and a not poisoned, so b's wait passes and
 * raises a's timeline past a wait for a value never produced -- unless b's look follows
 * a's own waits (cuq_check_waited_on). */
static fake_queue waitrace2_a;
static atomic_int waitrace2_in, waitrace2_go;
static void waitrace2_hook(int where, am_cuq *q) {
    if (where != CU_HOOK_CONFIRMED || q != waitrace2_a.q || atomic_exchange(&waitrace2_in, 1))
        return;
    held_until(&waitrace2_go);
}

static void check_waitrace2(void) {
    fake_queue a = queue_new(), b = queue_new(), c = queue_new();
    free_timeline t = free_timeline_new();
    am_timeline *cause = am_timeline_new();
    waitrace2_a = a;
    atomic_store(&waitrace2_in, 0);
    atomic_store(&waitrace2_go, 0);
    atomic_store(&test_hook, waitrace2_hook);
    if (launch(a, NULL, 1, 1)) die("waitrace2: a's launch");
    hook_reached(&waitrace2_in, "waitrace2: (setup) a's thread never confirmed its first");
    hold_next(c);
    if (wait_free(c, t, 1, 1) || launch(c, NULL, 1, 2)) die("waitrace2: c failed at once");
    check_held(c, "waitrace2: (setup) c's wait is not the command held");
    if (wait_queue(a, c, 2, 2) || launch(a, NULL, 1, 3)) die("waitrace2: a failed at once");
    if (wait_queue(b, a, 3, 1) || launch(b, NULL, 1, 2)) die("waitrace2: b failed at once");
    am_timeline_fail(t.t, 1, ILLEGAL_ADDRESS, 7, cause);
    wait_failed_first("waitrace2", a, b, 3, cause);
    atomic_store(&waitrace2_go, 1);
    let_held_go(c, "waitrace2: c's thread never saw its wait");
    reach(a.t, UINT64_MAX, "waitrace2: a never settled");
    chain_free(a, b, c, t, cause);
    puts("ok waitrace2");
}

/* A queue waited on is abandoned (closed at once) before its thread confirmed a command
 * that runs on the device only then (its stream let go: here a gate raised), so b's
 * device wait on it passes, and b's thread may see b's commands end before the closer
 * fails a's waiters (cuq_abandon_waiters, which leaves a command confirmed already).
 * b's look at a (closed, stop 2) must fail b then too, from its wait on (AM_ABANDONED at
 * a's first command), as the closer would have: the closer is held at that point (a
 * hook) until b's thread raised b's timeline for its commands. */
static fake_queue abandonrace_a, abandonrace_b;
static uint64_t *abandonrace_gate;
static void abandonrace_hook(int where, am_cuq *q) {
    if (where != CU_HOOK_ABANDONING || q != abandonrace_a.q) return;
    atomic_store((_Atomic uint64_t *)abandonrace_gate, 1);
    reach(abandonrace_b.t, 2, "abandonrace: b's thread never saw its commands end");
}

static void check_abandonrace(void) {
    fake_queue a = queue_new(), b = queue_new();
    uint64_t *gate = calloc(1, sizeof(uint64_t));  /* raised once a is abandoned */
    abandonrace_gate = gate;
    abandonrace_a = a;
    abandonrace_b = b;
    if (gated_launch(a, gate, 1)) die("abandonrace: a failed at once");
    if (wait_queue(b, a, 1, 1) || launch(b, NULL, 1, 2)) die("abandonrace: b failed at once");
    atomic_store(&test_hook, abandonrace_hook);
    am_cuq_close(a.q, 1);
    atomic_store(&test_hook, NULL);
    uint64_t at = 0, value = 0;
    int error = 0;
    if (am_timeline_value(b.t) != UINT64_MAX || am_cuq_error(b.q, &at) != CU_WAITED_FAILED ||
        at != 1)
        die("abandonrace: b's wait on a's abandoned command was confirmed as a success");
    if (am_cuq_cause(b.q, &error, &value) != (void *)a.t || error != AM_ABANDONED || value != 1)
        die("abandonrace: b's failure does not name a's abandoned command");
    stream_free(a.s, 1);
    am_timeline_free(a.t);
    free(a.word);
    queue_free(b, 0);
    free(gate);
    puts("ok abandonrace");
}

/* waitrace2 with a's own thread on its way to its check: c's device wait (command 1) on a
 * free timeline t failed (c's thread held: not confirmed), a's command 1 waits on c's
 * command 2, and a's thread, having seen it end, took its record of that wait off a's
 * list to check it and is held there (the runtime's hook, CU_HOOK_WAITING_TAKEN). b's
 * command 1, a wait on a's command 2 behind a gate raised at the hook, is confirmed by
 * b's thread meanwhile: its look at a must still follow a's wait on c, which a's thread
 * has not checked yet -- else it finds nothing of a's to follow and a not poisoned, and
 * b's wait passes, raising a's timeline past a's wait on c's failed value (a's own check,
 * after, comes too late: its commands are confirmed through that raise). */
static fake_queue waittaken_a;
static uint64_t *waittaken_gate;
static atomic_int waittaken_in, waittaken_go;
static void waittaken_hook(int where, am_cuq *q) {
    if (where != CU_HOOK_WAITING_TAKEN || q != waittaken_a.q || atomic_exchange(&waittaken_in, 1))
        return;
    atomic_store((_Atomic uint64_t *)waittaken_gate, 1);  /* b's wait goes on the device */
    held_until(&waittaken_go);
}

static void check_waittaken(void) {
    fake_queue a = queue_new(), b = queue_new(), c = queue_new();
    free_timeline t = free_timeline_new();
    am_timeline *cause = am_timeline_new();
    uint64_t *gate = calloc(1, sizeof(uint64_t));
    waittaken_a = a;
    waittaken_gate = gate;
    atomic_store(&waittaken_in, 0);
    atomic_store(&waittaken_go, 0);
    hold_next(c);
    if (wait_free(c, t, 1, 1) || launch(c, NULL, 1, 2)) die("waittaken: c failed at once");
    check_held(c, "waittaken: (setup) c's wait is not the command held");
    if (wait_queue(a, c, 2, 1) || launch(a, NULL, 1, 2)) die("waittaken: a failed at once");
    if (am_cuq_wait(b.q, gate, 1, 1) || wait_queue(b, a, 2, 1) || launch(b, NULL, 1, 2))
        die("waittaken: b failed at once");
    atomic_store(&test_hook, waittaken_hook);
    am_timeline_fail(t.t, 1, ILLEGAL_ADDRESS, 7, cause);
    hook_reached(&waittaken_in, "waittaken: (setup) a's thread never checked its wait on c");
    reach(b.t, 2, "waittaken: b's thread never saw its commands end");
    int raised = am_timeline_value(a.t) >= 2;
    int passed = am_timeline_value(b.t) != UINT64_MAX ||
                 !fails_from_first(b, CU_WAITED_FAILED, cause);
    atomic_store(&waittaken_go, 1);
    if (raised) die("waittaken: b's wait raised a's timeline past a's wait on c's failed value");
    if (passed) die("waittaken: b's wait for a value never produced was confirmed as a success");
    let_held_go(c, "waittaken: c's thread never saw its wait");
    reach(a.t, UINT64_MAX, "waittaken: a never settled");
    if (!fails_from_first(a, CU_WAITED_FAILED, cause))
        die("waittaken: a did not fail from its wait on c, naming the failure");
    chain_free(a, b, c, t, cause);
    free(gate);
    puts("ok waittaken");
}

/* A failure of a (its device wait on x's command 1, x abandoned) reaches b's wait on a's
 * command 2 while b's driver call for it is being made -- b's record with a pending --
 * and finds no memory for the list of the made waits it fails at once (c's: cuq_poison).
 * b's record is marked failed all the same, so b fails from that wait as the driver
 * takes it (cuq_wait_made), not only once a settles -- which a cannot before the check
 * raises its gate. */
static fake_queue poisonoom_b, poisonoom_a;
static int poisonoom_r = -1;

static void *poisonoom_wait(void *arg) {
    (void)arg;
    poisonoom_r = am_cuq_wait_queue(poisonoom_b.q, poisonoom_a.q, 2, 1);
    return NULL;
}

static void check_poisonoom(void) {
    fake_queue x = queue_new(), a = queue_new(), b = queue_new(), c = queue_new();
    uint64_t *gates = calloc(2, sizeof(uint64_t)), *gate = gates, *x_gate = gates + 1;
    if (gated_launch(x, x_gate, 1)) die("poisonoom: x's launch failed");
    if (wait_queue(a, x, 1, 1) || gated_launch(a, gate, 2)) die("poisonoom: a failed at once");
    if (wait_queue(c, a, 2, 1)) die("poisonoom: c's wait failed");
    poisonoom_a = a;
    poisonoom_b = b;
    atomic_store(&wait_gate_on, b.s);  /* b's wait on a's event stays in the driver */
    pthread_t thread;
    pthread_create(&thread, NULL, poisonoom_wait, NULL);
    for (int64_t look = 0; !atomic_load(&waits_in_driver); look_again(&look)) {}
    atomic_store(&refuse_allocs, 1);
    am_cuq_close(x.q, 1);  /* a fails from its wait (cuq_abandon_waiters, cuq_poison) */
    if (atomic_exchange(&refuse_allocs, 0))
        die("poisonoom: (setup) a's failure asked for no memory");
    atomic_store(&wait_gate_on, NULL);
    pthread_join(thread, NULL);
    if (poisonoom_r) die("poisonoom: b's wait was refused");
    pthread_mutex_lock(&b.q->mu);
    int failed = b.q->poisoned == 1;
    pthread_mutex_unlock(&b.q->mu);
    if (!failed) die("poisonoom: b's wait, made after a failed, did not fail b at once");
    if (am_cuq_finish(b.q, 1, a.t, 2, 0, CU_FINISH_PLAIN)) die("poisonoom: b's end failed");
    atomic_store((_Atomic uint64_t *)x_gate, 1);
    atomic_store((_Atomic uint64_t *)gate, 1);
    reach(a.t, UINT64_MAX, "poisonoom: a never settled");
    reach(b.t, UINT64_MAX, "poisonoom: b never settled");
    reach(c.t, UINT64_MAX, "poisonoom: c never settled");
    queue_free(a, 0);
    queue_free(b, 0);
    queue_free(c, 0);
    abandoned_free(x);
    free(gates);
    puts("ok poisonoom");
}

/* Once b's thread saw both its commands (a wait, then a launch) end: whether its wait
 * passed as a success (b not settled failed). */
static int wait_passed(fake_queue b, const char *what) {
    reach(b.t, 2, what);
    uint64_t at = 0;
    return am_timeline_value(b.t) != UINT64_MAX || !am_cuq_error(b.q, &at);
}

/* A stress check's verdict: no round's wait passed. */
static void no_wait_passed(int passed, int rounds, const char *what) {
    if (!passed) return;
    fprintf(stderr, "b's wait passed as a success in %d of %d rounds\n", passed, rounds);
    die(what);
}

/* waitrace while a, the queue waited for, is abandoned (closed) at once, over many
 * rounds: b's thread checks a (its record's reference keeps a) as a's close frees what
 * it can (for the sanitizers), and b's wait never passes as a success -- whether b's
 * look finds a's failed wait, or a closed (stop 2) before the closer failed a's waiters
 * (abandonrace). */
static void check_waitraceclose(void) {
    int passed = 0, rounds = STRESS_ROUNDS(300);
    for (int i = 0; i < rounds; i++) {
        fake_queue a = queue_new(), b = queue_new();
        free_timeline t = free_timeline_new();
        am_timeline *cause = am_timeline_new();
        if (wait_free(a, t, 1, 1) || launch(a, NULL, 1, 2)) die("waitraceclose: a failed at once");
        if (wait_queue(b, a, 2, 1) || launch(b, NULL, 1, 2)) die("waitraceclose: b failed at once");
        am_timeline_fail(t.t, 1, ILLEGAL_ADDRESS, 7, cause);
        if (i & 1) sched_yield();
        am_cuq_close(a.q, 1);
        passed += wait_passed(b, "waitraceclose: b's thread never saw its commands end");
        abandoned_free(a);
        queue_free(b, 0);
        free_timeline_free(t);
        am_timeline_free(cause);
    }
    no_wait_passed(passed, rounds,
                   "waitraceclose: b's wait on a's failed and abandoned command passed");
    puts("ok waitraceclose");
}

/* waitrace2's chain (b waits on a's command 2, behind a's wait on c's command 2, behind c's
 * device wait on a free timeline t that fails) over many rounds, with the queues
 * closed as the threads look through it: c abandoned at once (every round), a abandoned
 * too (every other round), while b's thread follows a's wait on c and a's thread checks
 * it (for the sanitizers: the references the looks take, c's entries and timeline as c
 * closes). b's wait for a value never produced never passes as a success. */
static void check_chainclose(void) {
    int passed = 0, rounds = STRESS_ROUNDS(200);
    for (int i = 0; i < rounds; i++) {
        fake_queue a = queue_new(), b = queue_new(), c = queue_new();
        free_timeline t = free_timeline_new();
        am_timeline *cause = am_timeline_new();
        if (wait_free(c, t, 1, 1) || launch(c, NULL, 1, 2)) die("chainclose: c failed at once");
        if (wait_queue(a, c, 2, 1) || launch(a, NULL, 1, 2)) die("chainclose: a failed at once");
        if (wait_queue(b, a, 2, 1) || launch(b, NULL, 1, 2)) die("chainclose: b failed at once");
        am_timeline_fail(t.t, 1, ILLEGAL_ADDRESS, 7, cause);
        if (i & 2) sched_yield();
        am_cuq_close(c.q, 1);
        if (i & 1) am_cuq_close(a.q, 1);
        passed += wait_passed(b, "chainclose: b's thread never saw its commands end");
        if (i & 1) abandoned_free(a);
        else queue_free(a, 0);
        abandoned_free(c);
        queue_free(b, 0);
        free_timeline_free(t);
        am_timeline_free(cause);
    }
    no_wait_passed(passed, rounds,
                   "chainclose: b's wait behind c's failed and abandoned command passed");
    puts("ok chainclose");
}

/* The same for a timeline a queue's command signals: another queue that waited for the
 * command confirms it first and raises the first queue's timeline past it, after which
 * Python lets go of the signalled timeline (the queue's keep-alive held it until then)
 * and frees it -- while the first queue's thread has yet to raise it (am_timeline_poke,
 * timeline_keep_released) once it sees the command's event. */
static void check_signalfreed(void) {
    fake_queue a = queue_new(), b = queue_new();
    free_timeline s = free_timeline_new();
    hold_next(a);
    if (am_cuq_write(a.q, s.word, 1, 1) || am_cuq_finish(a.q, 1, s.t, 1, 0, 0))
        die("signalfreed: a's signal");
    check_held(a, "signalfreed: (setup) a's signal is not the command held");
    if (wait_queue(b, a, 1, 1)) die("signalfreed: b's wait");
    reach(a.t, 1, "signalfreed: a's signal never confirmed through b");
    am_timeline_free(s.t);  /* what Python does once a's timeline passed the signal */
    let_held_go(a, "signalfreed: a's thread never saw its signal");
    queue_free(b, 0);
    queue_free(a, 0);
    free(s.word);
    puts("ok signalfreed");
}

/* And for another queue's own timeline, which a wait for that queue raises once confirmed
 * (a's, by b's wait for it): a third queue that waited for b's wait confirms it first and
 * raises b's timeline past it, after which Python lets go of a's timeline (b's keep-alive
 * held it), and a, its work done, closes and frees it -- while b's thread has yet to raise
 * it once it sees the wait's event. */
static void check_confirmfreed(void) {
    fake_queue a = queue_new(), b = queue_new(), c = queue_new();
    if (am_cuq_finish(a.q, 1, NULL, 0, 0, 0)) die("confirmfreed: a's command");
    hold_next(b);
    if (wait_queue(b, a, 1, 1)) die("confirmfreed: b's wait");
    check_held(b, "confirmfreed: (setup) b's wait is not the command held");
    if (wait_queue(c, b, 1, 1)) die("confirmfreed: c's wait");
    reach(b.t, 1, "confirmfreed: b's wait never confirmed through c");
    reach(a.t, 1, "confirmfreed: a's command never confirmed");
    am_cuq_close(a.q, 0);  /* what Python does once b's timeline passed its wait */
    stream_free(a.s, 0);
    am_timeline_free(a.t);
    let_held_go(b, "confirmfreed: b's thread never saw its wait");
    queue_free(c, 0);
    queue_free(b, 0);
    free(a.word);
    puts("ok confirmfreed");
}

/* Commands held on the host (past the bound, or behind a device wait held) behind one
 * that fails once confirmed: the queue settles, its timeline at UINT64_MAX, while they
 * are still held -- and Python, whose keep-alive held what they point at until the
 * queue's timeline passed them, lets go: here the timeline a held signal raises, freed
 * as the completion thread takes the signal's first operation to hand it over (the
 * runtime's hook). The driver refuses it (the context faulted), and the signal's timeline
 * fails with it (cuq_drop_refused): no use after free (ASan). */
static void refusals_off(void);

static am_timeline *_Atomic freed_at_hook;
static am_cuq *freed_at_hook_q;

static void free_at_drain(int where, am_cuq *q) {
    if (where != CU_HOOK_DRAIN_HANDING || q != freed_at_hook_q) return;
    if (am_timeline_value(q->timeline) != UINT64_MAX) return;
    am_timeline *t = atomic_exchange(&freed_at_hook, NULL);
    if (t) am_timeline_free(t);  /* what Python does once q's timeline passed the signal */
}

/* `name`'s check: f's command 1 fails once confirmed (a fault), settling f while what
 * follows it is still held; as the completion thread drains the held operations, the
 * hook frees `freed` (Python letting go of it); the check waits until nothing is held
 * and the hook ran, then frees f. */
static void fail_freeing_at_drain(fake_queue f, am_timeline *freed, const char *name) {
    char settled[96], handed[96];
    snprintf(settled, sizeof settled, "%s: the failed queue never settled", name);
    snprintf(handed, sizeof handed, "%s: the held operation was never handed over", name);
    uint64_t stats[8];
    freed_at_hook_q = f.q;
    atomic_store(&freed_at_hook, freed);
    atomic_store(&test_hook, free_at_drain);
    atomic_store(&fault_code, ILLEGAL_ADDRESS);  /* command 1 fails once confirmed */
    reach(f.t, UINT64_MAX, settled);
    int64_t deadline = now_ns() + 10000000000LL;
    for (int64_t look = 0;; look_again(&look)) {
        am_cuq_stats(f.q, stats);
        if (!stats[6] && !atomic_load(&freed_at_hook)) break;
        if (now_ns() > deadline) die(handed);
    }
    atomic_store(&test_hook, NULL);
    queue_free(f, 0);
    atomic_store(&fault_code, 0);
}

static void check_heldfreed(void) {
    /* 200 ms: not confirmed before the check has set up what follows it (also under
     * ThreadSanitizer on a loaded machine) */
    static kernel slow = {0, 200000000, NULL, 0};
    fake_queue f = queue_bounded(1);
    free_timeline s = free_timeline_new();
    if (launch(f, &slow, 1, 1)) die("heldfreed: launch 1 failed");
    if (signal_free(f, s, 1, 2)) die("heldfreed: the held signal failed at once");
    uint64_t stats[8];
    am_cuq_stats(f.q, stats);
    if (stats[6] != 2) die("heldfreed: (setup) the signal was not held");
    fail_freeing_at_drain(f, s.t, "heldfreed");
    free(s.word);
    puts("ok heldfreed");
}

/* The same for a held device wait for another queue's value (across devices: its
 * command's end raises nothing): the other queue, its work done, closed, and Python let
 * go of its timeline -- the waiting queue's keep-alive held it until that queue settled
 * -- as the completion thread takes the wait to hand it over, which looks at the other
 * queue's timeline (stream_wait_queue): no use after free (ASan). */
static void check_waitqueuefreed(void) {
    /* 200 ms: not confirmed before the check has set up what follows it (also under
     * ThreadSanitizer on a loaded machine) */
    static kernel slow = {0, 200000000, NULL, 0};
    fake_queue a = queue_new(), f = queue_bounded(1);
    if (launch(a, NULL, 1, 1)) die("waitqueuefreed: a's launch failed");
    reach(a.t, 1, "waitqueuefreed: a's launch never ran");
    if (launch(f, &slow, 1, 1)) die("waitqueuefreed: launch 1 failed");
    if (am_cuq_wait_queue(f.q, a.q, 1, 2) || am_cuq_finish(f.q, 2, NULL, 0, 0, CU_FINISH_PLAIN))
        die("waitqueuefreed: the held wait failed at once");
    uint64_t stats[8];
    am_cuq_stats(f.q, stats);
    if (stats[6] != 2) die("waitqueuefreed: (setup) the wait was not held");
    am_cuq_close(a.q, 0);
    stream_free(a.s, 0);
    fail_freeing_at_drain(f, a.t, "waitqueuefreed");
    free(a.word);
    puts("ok waitqueuefreed");
}

/* A queue's device wait for another queue's value across devices (its command's end
 * raises nothing), confirmed by the waiting queue -- the other stream ran past the value
 * -- before the other queue's own thread saw that command fail (a fault reported at its
 * event's query). The waiting queue, its work done, closes, and Python frees its
 * timeline; the other queue then settles, failing the waits recorded on its failed
 * values from there on (cuq_release_waiters, cuq_poison), the closed queue's among them:
 * no use after free (ASan). */
static void check_poisonclosed(void) {
    static kernel slow = {0, 200000000, NULL, 0};  /* 200 ms: not seen done before held */
    fake_queue a = queue_new(), b = queue_new();
    if (launch(a, &slow, 1, 1)) die("poisonclosed: a's launch failed");
    hold_head(a);
    if (am_cuq_wait_queue(b.q, a.q, 1, 1) || am_cuq_finish(b.q, 1, NULL, 0, 0, CU_FINISH_PLAIN))
        die("poisonclosed: b's wait failed at once");
    reach(b.t, 1, "poisonclosed: b's wait never confirmed");
    am_cuq_close(b.q, 0);  /* b's work is done: Python closes it, and frees its timeline */
    stream_free(b.s, 0);
    am_timeline_free(b.t);
    atomic_store(&fault_code, ILLEGAL_ADDRESS);  /* a's command fails once its thread looks */
    atomic_store(&held, NULL);
    reach(a.t, UINT64_MAX, "poisonclosed: a never settled");
    queue_free(a, 0);
    atomic_store(&fault_code, 0);
    free(b.word);
    puts("ok poisonclosed");
}

/* An abandoning close gives up on a completion thread that has not returned within
 * ~200 ms (one blocked on an event that never completes), which then frees the queue
 * itself: here one held up right after it confirmed a command, before it raises the
 * queue's timeline for it (the runtime's hook) -- as a thread off the CPU there on a
 * loaded machine is. The close returns and Python frees the queue's timeline; the thread
 * then raises it: no use after free (ASan). */
static fake_queue orphan_q;
static atomic_int orphan_hooked;

static void *orphan_closer(void *arg) {
    (void)arg;
    am_cuq_close(orphan_q.q, 1);
    am_timeline_free(orphan_q.t);  /* what Python does once the close returned */
    return NULL;
}

static void close_at_confirmed(int where, am_cuq *q) {
    if (where != CU_HOOK_CONFIRMED || q != orphan_q.q || atomic_exchange(&orphan_hooked, 1))
        return;
    pthread_t closer;
    if (pthread_create(&closer, NULL, orphan_closer, NULL)) die("orphanpoke: pthread_create");
    pthread_join(closer, NULL);  /* (the close gave up on this thread) */
}

static void check_orphanpoke(void) {
    long left = atomic_load(&events_made) - atomic_load(&events_destroyed);
    orphan_q = queue_new();
    atomic_store(&orphan_hooked, 0);
    atomic_store(&test_hook, close_at_confirmed);
    if (launch(orphan_q, NULL, 1, 1)) die("orphanpoke: launch failed");
    /* The orphaned thread destroys its queue's events as it stops. */
    int64_t deadline = now_ns() + 10000000000LL;
    for (int64_t look = 0; !atomic_load(&orphan_hooked) ||
                           atomic_load(&events_made) - atomic_load(&events_destroyed) != left;
         look_again(&look))
        if (now_ns() > deadline) die("orphanpoke: the orphaned thread never stopped");
    nap_ns(10000000);  /* (its last steps after that: the queue's memory) */
    atomic_store(&test_hook, NULL);
    stream_free(orphan_q.s, 1);
    free(orphan_q.word);
    puts("ok orphanpoke");
}

/* An abandoning close that gives up on its completion thread (held up past ~200 ms, as
 * check_orphanpoke's) while the queue holds a device wait (deferred) on a timeline nothing
 * signals, its kick registered there: the close drops the held wait but returns without
 * taking the kick off (only a close that joined the thread does, am_cuq_close), and the
 * orphaned thread does not either (cuq_stop). The kick keeps its references of the queue
 * and of the timeline for good: once Python frees the timeline (its owner's reference),
 * neither the timeline nor the queue is ever freed (a leak: LeakSanitizer). */
static fake_queue orphankick_q;
static atomic_int orphankick_hooked, orphankick_armed;

static void *orphankick_closer(void *arg) {
    (void)arg;
    am_cuq_close(orphankick_q.q, 1);
    am_timeline_free(orphankick_q.t);  /* what Python does once the close returned */
    return NULL;
}

static void close_kicked_at_confirmed(int where, am_cuq *q) {
    if (where != CU_HOOK_CONFIRMED || q != orphankick_q.q ||
        atomic_exchange(&orphankick_hooked, 1))
        return;
    int64_t deadline = now_ns() + 10000000000LL;
    /* the wait is held, its kick registered */
    for (int64_t look = 0; !atomic_load(&orphankick_armed); look_again(&look))
        if (now_ns() > deadline) die("orphankick: (setup) never armed");
    pthread_t closer;
    if (pthread_create(&closer, NULL, orphankick_closer, NULL)) die("orphankick: pthread_create");
    pthread_join(closer, NULL);  /* (the close gave up on this thread) */
}

static void check_orphankick(void) {
    long left = atomic_load(&events_made) - atomic_load(&events_destroyed);
    free_timeline t = free_timeline_new();  /* nobody signals it */
    orphankick_q = queue_new();
    atomic_store(&orphankick_hooked, 0);
    atomic_store(&orphankick_armed, 0);
    atomic_store(&test_hook, close_kicked_at_confirmed);
    if (launch(orphankick_q, NULL, 1, 1)) die("orphankick: launch failed");
    if (wait_held(orphankick_q, t.t, 1, 2)) die("orphankick: the wait failed at once");
    if (!atomic_load(&t.t->has_kicks)) die("orphankick: (setup) the wait's kick is not registered");
    atomic_store(&orphankick_armed, 1);
    int64_t deadline = now_ns() + 10000000000LL;
    for (int64_t look = 0; !atomic_load(&orphankick_hooked) ||
                           atomic_load(&events_made) - atomic_load(&events_destroyed) != left;
         look_again(&look))
        if (now_ns() > deadline) die("orphankick: the orphaned thread never stopped");
    nap_ns(10000000);  /* (its last steps after that) */
    atomic_store(&test_hook, NULL);
    int kicks = atomic_load(&t.t->has_kicks), refs = atomic_load(&t.t->refs);
    am_timeline_free(t.t);  /* what Python does: the queue is closed, its wait dropped */
    if (kicks || refs != 1) {
        fprintf(stderr, "orphankick: has_kicks %d, refs %d (want 0, 1)\n", kicks, refs);
        if (!getenv("ORPHANKICK_LEAK"))
            die("orphankick: an abandoning close that gave up on its thread left the held "
                "wait's kick registered, holding the queue and the waited timeline for good");
    }
    stream_free(orphankick_q.s, 1);
    free(orphankick_q.word);
    memset(&orphankick_q, 0, sizeof orphankick_q);  /* (nothing here keeps the queue) */
    free(t.word);
    puts("ok orphankick");
}

/* A held device wait's kick comes due (a host signal of t1, whose thread runs the kicks
 * it took off t1, another queue's first -- its hand-over held up here at the runtime's
 * hook, as one behind a slow driver call is) but has not run yet, while the wait's
 * command is dropped for want of memory (cuq_no_memory: its end cannot be held; the kick
 * is not taken off, cuq_unkick finds it due). The caller takes the value back and
 * submits a wait on t2 instead: handed over at once, it must be held. Were the same
 * kick registered on t2 now (q->kick_on = t2) while it is on the list of kicks due that
 * t1's signalling thread runs, that thread's run of it, after t2's host signal ran it,
 * would let go of t2's reference a second time (cuq_kicked reads q->kick_on), and never
 * of t1's: t1 keeps a reference for good (a leak), t2 is freed under its owner (use
 * after free once Python frees it). Both waits must run, and each timeline keep only
 * its owner's reference. */
static fake_queue stalekick_q0, stalekick_q;
static free_timeline stalekick_t1, stalekick_t2;
static atomic_int stalekick_armed, stalekick_done;
static pthread_t stalekick_main;

static void stalekick_at_drain(int where, am_cuq *q) {
    if (where != CU_HOOK_DRAIN_HANDING || q != stalekick_q0.q || !atomic_load(&stalekick_armed) ||
        atomic_exchange(&stalekick_done, 1))
        return;
    if (!pthread_equal(pthread_self(), stalekick_main))
        die("stalekick: (setup) q0's wait was not handed over by its kick");
    am_cuq *k = stalekick_q.q;
    pthread_mutex_lock(&k->mu);
    int deferred = k->deferred;
    pthread_mutex_unlock(&k->mu);
    if (!deferred || timeline_undefer(stalekick_t1.t, &k->kick, 0))
        die("stalekick: (setup) q's kick is not due and waiting to run");
    /* the wait's end cannot be held: the command is dropped, its value given back */
    atomic_store(&refuse_allocs, 1);
    if (am_cuq_finish(k, 1, stalekick_t1.t, 1, 0, CU_FINISH_PLAIN | CU_FINISH_WAITED) != -1)
        die("stalekick: (setup) the wait's end was held without memory");
    atomic_store(&refuse_allocs, 0);
    /* that value again: a wait on t2, held (t2 is not there yet) -- its kick registered
     * on t2, or (the same kick, due on t1, not run yet) held until that kick ran */
    if (wait_held(stalekick_q, stalekick_t2.t, 1, 1)) die("stalekick: the wait on t2 failed");
    uint64_t stats[8];
    am_cuq_stats(k, stats);
    if (!stats[6]) die("stalekick: (setup) the wait on t2 was not held");
    am_timeline_host_signal(stalekick_t2.t, 1, NULL);  /* a kick registered there runs (here) */
}

static void check_stalekick(void) {
    stalekick_main = pthread_self();
    stalekick_t1 = free_timeline_new();
    stalekick_t2 = free_timeline_new();
    stalekick_q0 = queue_new();
    stalekick_q = queue_new();
    atomic_store(&stalekick_done, 0);
    atomic_store(&stalekick_armed, 0);
    /* q0's kick registered on t1 before q's: the signal's thread runs it first */
    if (wait_held(stalekick_q0, stalekick_t1.t, 1, 1)) die("stalekick: q0's wait failed");
    if (am_cuq_wait_timeline(stalekick_q.q, stalekick_t1.t, 1, 1)) die("stalekick: q's wait failed");
    pthread_mutex_lock(&stalekick_q.q->mu);
    int deferred = stalekick_q.q->deferred;
    pthread_mutex_unlock(&stalekick_q.q->mu);
    if (!deferred) die("stalekick: (setup) q's wait is not deferred");
    atomic_store(&test_hook, stalekick_at_drain);
    atomic_store(&stalekick_armed, 1);
    am_timeline_host_signal(stalekick_t1.t, 1, NULL);
    if (!atomic_load(&stalekick_done)) die("stalekick: (setup) the hook never ran");
    atomic_store(&test_hook, NULL);
    reach(stalekick_q0.t, 1, "stalekick: q0's wait never ran");
    reach(stalekick_q.t, 1, "stalekick: q's wait on t2 never ran");
    nap_ns(20000000);  /* (the completion threads' last steps) */
    int refs1 = atomic_load(&stalekick_t1.t->refs), kicks1 = atomic_load(&stalekick_t1.t->has_kicks);
    if (refs1 != 1 || kicks1) {
        fprintf(stderr, "stalekick: t1 refs %d has_kicks %d (want 1, 0)\n", refs1, kicks1);
        if (!getenv("STALEKICK_GO_ON"))
            die("stalekick: the kick run after it was re-registered on another timeline let "
                "go of that timeline's reference (cuq_kicked reads q->kick_on), never of t1's");
    }
    queue_free(stalekick_q, 0);
    queue_free(stalekick_q0, 0);
    free_timeline_free(stalekick_t2);  /* what Python does: t2 must still be its own */
    free_timeline_free(stalekick_t1);
    puts("ok stalekick");
}

/* The same for a device wait held (deferred) on a timeline nothing has signalled yet,
 * its kick registered there: the queue fails and settles behind it, Python lets go of
 * the waited timeline and frees it, and the queue's abandoning close then drops the held
 * wait and takes its kick off that timeline (timeline_undefer): no use after free (ASan),
 * with the held operation's reference of it dropped first. */
static void check_kickfreed(void) {
    /* 200 ms: not confirmed before the check has set up what follows it (also under
     * ThreadSanitizer on a loaded machine) */
    static kernel slow = {0, 200000000, NULL, 0};
    fake_queue f = queue_new();
    free_timeline t = free_timeline_new();
    if (launch(f, &slow, 1, 1)) die("kickfreed: launch 1 failed");
    if (wait_held(f, t.t, 1, 2)) die("kickfreed: the wait failed at once");
    if (!atomic_load(&t.t->has_kicks)) die("kickfreed: (setup) the wait's kick is not registered");
    atomic_store(&fault_code, ILLEGAL_ADDRESS);  /* command 1 fails once confirmed */
    reach(f.t, UINT64_MAX, "kickfreed: the failed queue never settled");
    am_timeline_free(t.t);  /* what Python does once f's timeline passed the wait */
    am_cuq_close(f.q, 1);
    abandoned_free(f);
    atomic_store(&fault_code, 0);
    free(t.word);
    puts("ok kickfreed");
}

/* Until am_timeline_refs reads 1, t is still held (refsheld). */
static void refs_reach_one(am_timeline *t, const char *what) {
    int64_t deadline = now_ns() + 10000000000LL;
    for (int64_t look = 0; am_timeline_refs(t) != 1; look_again(&look))
        if (now_ns() > deadline) die(what);
}

/* What a timeline's owner reads before its device word's slot may go to another
 * timeline (am_timeline_refs, CUDABackend._retire_timeline): above 1 while a queue's
 * thread still holds it -- a signal's command that thread has yet to see end, confirmed
 * meanwhile through another queue's wait (as signalfreed); a device wait held on the
 * host, its operation and its kick (as kickfreed) -- and 1 once every holder is done,
 * the thread's raise of the signalled timeline made before. */
static void check_refsheld(void) {
    static kernel slow = {0, 200000000, NULL, 0};  /* (200 ms: as kickfreed's) */
    fake_queue a = queue_new(), b = queue_new(), f = queue_new();
    free_timeline s = free_timeline_new(), w = free_timeline_new();
    if (am_timeline_refs(s.t) != 1) die("refsheld: a new timeline is held by more than its owner");
    hold_next(a);
    if (signal_free(a, s, 1, 1)) die("refsheld: a's signal");
    check_held(a, "refsheld: (setup) a's signal is not the command held");
    if (wait_queue(b, a, 1, 1)) die("refsheld: b's wait");
    reach(a.t, 1, "refsheld: a's signal never confirmed through b");
    if (am_timeline_refs(s.t) != 2)
        die("refsheld: a's thread, yet to see its signal end, holds no reference of it");
    let_held_go(a, "refsheld: a's thread never saw its signal");
    refs_reach_one(s.t, "refsheld: a's thread, past its signal, still holds it");
    if (am_timeline_value(s.t) != 1) die("refsheld: let go of before its raise");
    if (launch(f, &slow, 1, 1)) die("refsheld: f's launch");
    if (wait_held(f, w.t, 1, 2)) die("refsheld: f's wait");
    if (!atomic_load(&w.t->has_kicks)) die("refsheld: (setup) the wait's kick is not registered");
    if (am_timeline_refs(w.t) < 3) die("refsheld: a held wait and its kick hold no references");
    am_timeline_host_signal(w.t, 1, NULL);
    reach(f.t, 2, "refsheld: f's wait never ran");
    refs_reach_one(w.t, "refsheld: f's thread, past its wait, still holds its timeline");
    queue_free(f, 0);
    queue_free(b, 0);
    queue_free(a, 0);
    free_timeline_free(w);
    free_timeline_free(s);
    puts("ok refsheld");
}

/* A signal whose end the driver refused after its word write reached it, and the fence
 * behind it too (kept for the fence: cuq_unfence), behind a command still in flight --
 * a device wait for another queue, abandoned meanwhile: that command fails once
 * confirmed and the queue settles, its timeline at UINT64_MAX, with the fence still to
 * be recorded. Python then lets go of the signal's timeline and frees it, and the fence,
 * recorded at the completion thread's next try, carries it (cuq_refence): no use after
 * free (ASan). */
static void check_unfencedfreed(void) {
    /* 200 ms: not confirmed before the check has set up what follows it (also under
     * ThreadSanitizer on a loaded machine) */
    static kernel slow = {0, 200000000, NULL, 0};
    fake_queue a = queue_new(), f = queue_new();
    free_timeline s = free_timeline_new();
    if (launch(a, &slow, 1, 1)) die("unfencedfreed: a's launch failed");
    if (wait_queue(f, a, 1, 1)) die("unfencedfreed: f's wait failed");
    hold_head(f);
    if (kernel_part(f, NULL, 2) || am_cuq_write(f.q, s.word, 5, 2))
        die("unfencedfreed: the signal's kernel or word write failed");
    atomic_store(&records_refused, 0);
    atomic_store(&refuse_more_code, OUT_OF_MEMORY);  /* the fence's: tried again */
    atomic_store(&refuse_more, 1000000);
    atomic_store(&refuse_records, f.s);
    if (am_cuq_finish(f.q, 2, s.t, 5, 0, 0) != 1)
        die("unfencedfreed: the refusal was not reported");
    pthread_mutex_lock(&f.q->mu);
    int kept = f.q->unfenced == 2 && f.q->unfenced_extra == s.t;
    pthread_mutex_unlock(&f.q->mu);
    if (!kept) die("unfencedfreed: (setup) the signal was not kept for the fence");
    am_cuq_close(a.q, 1);  /* f's wait fails from 1 (cuq_abandon_waiters) */
    let_held_go(f, "unfencedfreed: f's thread never saw its wait");
    reach(f.t, UINT64_MAX, "unfencedfreed: the failed queue never settled");
    am_timeline_free(s.t);  /* what Python does once f's timeline passed the signal */
    refusals_off();  /* the fence is recorded at the next try */
    int64_t deadline = now_ns() + 10000000000LL;
    for (int64_t look = 0;; look_again(&look)) {
        pthread_mutex_lock(&f.q->mu);
        int unfenced = f.q->unfenced || f.q->count;
        pthread_mutex_unlock(&f.q->mu);
        if (!unfenced) break;
        if (now_ns() > deadline) die("unfencedfreed: the fence was never recorded");
    }
    queue_free(f, 0);
    abandoned_free(a);
    free(s.word);
    puts("ok unfencedfreed");
}

static void check_orphaned(void) {
    int released = atomic_exchange(&release_syncs, 0);  /* (as check_foreign) */
    fake_queue a = queue_bounded(1), b = queue_new();
    uint64_t *gates = calloc(2, sizeof(uint64_t));
    for (uint64_t v = 1; v <= 4; v++)  /* 2 to 4 held on the host; 1 and 2 behind gates */
        if (v <= 2 ? gated_launch(a, &gates[v - 1], v) : launch(a, NULL, (int64_t)v, v))
            die("orphaned: a launch on a failed");
    if (am_cuq_wait_queue(b.q, a.q, 4, 1) || launch(b, NULL, 1, 1)) die("orphaned: b's wait");
    uint64_t stats[8];
    am_cuq_stats(b.q, stats);
    if (!stats[6]) die("orphaned: b's wait for a held command was not held");
    atomic_store((_Atomic uint64_t *)&gates[0], 1);
    reach(a.t, 1, "orphaned: a's first command never ran");  /* then 2 is in flight */
    queue_free(a, 1);
    free(gates);
    reach(b.t, 1, "orphaned: a wait held for an abandoned queue's command never went on");
    /* it went on for a command that never ran: b's command fails without running,
     * naming the abandon */
    uint64_t at = 0, value = 0;
    int error = 0;
    if (atomic_load(&b.s->ran)) die("orphaned: a kernel behind a wait for an abandoned command ran");
    if (am_cuq_error(b.q, &at) != CU_HELD_FAILED || at != 1 ||
        !am_cuq_cause(b.q, &error, &value) || error != AM_ABANDONED || value != 2)
        die("orphaned: a wait held for an abandoned command did not fail what followed it");
    queue_free(b, 0);
    atomic_store(&release_syncs, released);
    puts("ok orphaned");
}

/* The error and cause a queue reports: 1 if they are a failed wait, from command `at`,
 * for queue `cause`'s abandoned command `value`. */
static int abandoned_cause(fake_queue f, uint64_t at, am_timeline *cause, uint64_t value) {
    uint64_t from = 0, v = 0;
    int error = 0;
    return am_cuq_error(f.q, &from) == CU_WAITED_FAILED && from == at &&
           am_cuq_cause(f.q, &error, &v) == cause && error == AM_ABANDONED && v == value;
}

static void check_abandonwait(void) {
    /* a: command 1 runs; command 2 waits for a timeline nobody signals; command 3 is
     * behind it. b waits on the device for a's 3, c for b's 2, d for a's 1. */
    fake_queue a = queue_new(), b = queue_new(), c = queue_new(), d = queue_new();
    free_timeline gate = free_timeline_new();
    if (launch(a, NULL, 1, 1)) die("abandonwait: a's launch failed");
    reach(a.t, 1, "abandonwait: a's first command never ran");
    if (wait_free(a, gate, 1, 2) || launch(a, NULL, 2, 3)) die("abandonwait: a failed at once");
    if (am_cuq_wait_queue(b.q, a.q, 3, 1) || am_cuq_finish(b.q, 1, NULL, 0, 0, CU_FINISH_PLAIN) ||
        launch(b, NULL, 1, 2))
        die("abandonwait: b failed at once");
    if (am_cuq_wait_queue(c.q, b.q, 2, 1) || am_cuq_finish(c.q, 1, NULL, 0, 0, CU_FINISH_PLAIN) ||
        launch(c, NULL, 1, 2))
        die("abandonwait: c failed at once");
    if (am_cuq_wait_queue(d.q, a.q, 1, 1) || am_cuq_finish(d.q, 1, NULL, 0, 0, CU_FINISH_PLAIN) ||
        launch(d, NULL, 1, 2))
        die("abandonwait: d failed at once");
    nap_ns(50000000);  /* a's thread naps on the wait */
    am_cuq_close(a.q, 1);  /* a's commands 2 and 3 are abandoned */
    /* As a device's close does: the word a's stream waits on is raised, so a's abandoned
     * commands run after all, and b's and c's streams go on behind them. */
    am_timeline_close(gate.t, 0);
    reach(b.t, 2, "abandonwait: b never went on");
    reach(c.t, 2, "abandonwait: c never went on");
    reach(d.t, 2, "abandonwait: d never went on");
    if (!abandoned_cause(b, 1, a.t, 2) || !abandoned_cause(c, 1, a.t, 2))
        die("abandonwait: commands behind a wait for an abandoned command did not fail");
    uint64_t at = 0;
    if (am_cuq_error(d.q, &at) || am_timeline_value(d.t) != 2)
        die("abandonwait: a wait for a command confirmed before the abandon failed");
    stream_free(a.s, 0);
    am_timeline_free(a.t);
    free(a.word);
    queue_free(b, 0);
    queue_free(c, 0);
    queue_free(d, 0);
    free_timeline_free(gate);
}

static void check_closedwait(void) {
    /* b waits on the device for a's value 3, which a is never given: a closes after its
     * command 1 ran */
    fake_queue a = queue_new(), b = queue_new();
    if (launch(a, NULL, 1, 1)) die("closedwait: a's launch failed");
    if (am_cuq_wait_queue(b.q, a.q, 3, 1) || am_cuq_finish(b.q, 1, NULL, 0, 0, CU_FINISH_PLAIN) ||
        launch(b, NULL, 1, 2))
        die("closedwait: b failed at once");
    reach(a.t, 1, "closedwait: a's command never ran");
    am_timeline *gone = a.t;
    queue_free(a, 0);
    reach(b.t, 2, "closedwait: a wait for a value a closed queue was never given never ended");
    uint64_t at = 0, value = 0;
    int error = 0;
    if (am_cuq_error(b.q, &at) != CU_HELD_FAILED || at != 1 || atomic_load(&b.s->ran) ||
        am_cuq_cause(b.q, &error, &value) != gone || error != AM_CLOSED || value != 2)
        die("closedwait: the commands behind that wait did not fail, naming the close");
    queue_free(b, 0);
}

static void check_shared(void) {
    int released = atomic_exchange(&release_syncs, 0);  /* (as check_foreign) */
    fake_stream *hw = stream_new(), *consumer = stream_sharing(hw);
    fake_queue a = queue_on(stream_sharing(hw), 2), b = queue_on(stream_sharing(hw), 1 << 20),
               c = queue_on(stream_sharing(hw), 1 << 20);
    static kernel slow = {0, 1000000, NULL, 0};
    /* b waits for a's command 8, which a holds on the host (2 in flight at most) */
    for (uint64_t v = 1; v <= 8; v++)
        if (launch(a, &slow, (int64_t)v, v)) die("shared: a launch on a failed");
    if (am_cuq_wait_queue(b.q, a.q, 8, 1) || launch(b, NULL, 1, 1)) die("shared: b's wait");
    reach(b.t, 1, "shared: a wait for a held command held up that command");
    /* c waits on a timeline before the signal that raises it was submitted (by a) */
    am_timeline *t = am_timeline_new(), *gate = am_timeline_new();
    uint64_t *words = calloc(2, sizeof(uint64_t));
    am_timeline_set_word(t, &words[0]);
    am_timeline_set_word(gate, &words[1]);
    if (am_cuq_wait_timeline(c.q, t, 1, 1) || am_cuq_finish(c.q, 1, NULL, 0, 0, CU_FINISH_PLAIN) ||
        launch(c, NULL, 2, 2))
        die("shared: c's wait");
    for (uint64_t v = 9; v <= 12; v++)
        if (launch(a, &slow, (int64_t)v, v)) die("shared: a launch on a failed");
    if (am_cuq_write(a.q, &words[0], 1, 13) || am_cuq_finish(a.q, 13, t, 1, 0, 0))
        die("shared: a's signal");
    reach(c.t, 2, "shared: a wait on a timeline before its signal held up the signal");
    /* another library's stream waits for a's command 21, held on the host */
    for (uint64_t v = 14; v <= 21; v++)
        if (launch(a, &slow, (int64_t)v, v)) die("shared: a launch on a failed");
    int call = -1;
    if (am_cuq_wait_foreign(a.q, (void *)1, consumer, 21, &call))
        die("shared: the other library's wait failed");
    _Atomic uint64_t *done = calloc(1, sizeof *done);
    ((int (*)(void *, void *, uint64_t, unsigned))cu_funcs[CU_WRITE64])(consumer, (void *)done,
                                                                         1, 0);
    int64_t deadline = now_ns() + 10000000000LL;
    for (int64_t look = 0; !atomic_load(done); look_again(&look))
        if (now_ns() > deadline) die("shared: another library's wait held up what it waits for");
    /* a's command 21 ran before the write (one hardware queue runs them all, in order;
     * a's timeline may not be raised yet: its completion thread confirms after) */
    long ran = atomic_load(&hw->ran), seen21 = 0;
    for (long i = 0; i < ran && i < (1 << 16); i++) seen21 |= hw->log[i] == 21;
    if (!seen21) die("shared: another library's stream did not wait");
    /* a wait the host releases: held until the signal, then handed over */
    if (am_cuq_wait_timeline(c.q, gate, 1, 3) || am_cuq_finish(c.q, 3, NULL, 0, 0, CU_FINISH_PLAIN) ||
        launch(c, NULL, 4, 4))
        die("shared: c's second wait");
    nap_ns(5000000);
    uint64_t stats[8];
    am_cuq_stats(c.q, stats);
    if (am_timeline_value(c.t) > 2 || stats[6] < 3)
        die("shared: a wait nothing signalled was handed over, or passed");
    am_timeline_host_signal(gate, 1, NULL);
    reach(c.t, 4, "shared: a host signal did not release the wait held for it");
    /* gate is a timeline only the host signals: its next wait goes to the device at once */
    if (am_cuq_wait_timeline(c.q, gate, 2, 5) || am_cuq_finish(c.q, 5, NULL, 0, 0, CU_FINISH_PLAIN) ||
        launch(c, NULL, 6, 6))
        die("shared: c's third wait");
    am_cuq_stats(c.q, stats);
    if (stats[6]) die("shared: a wait on a timeline only the host signals was held");
    am_timeline_host_signal(gate, 2, NULL);
    reach(c.t, 6, "shared: a host signal did not release the device's wait");
    reach(a.t, 21, "shared: a never finished");
    queue_free(a, 0);
    queue_free(b, 0);
    queue_free(c, 0);
    stream_free(consumer, 0);
    stream_free(hw, 0);
    am_timeline_free(t);
    am_timeline_free(gate);
    free(words);
    free((void *)done);
    atomic_store(&release_syncs, released);
    puts("ok shared");
}

/* q1 and q wait for other's command 5, held behind other's gate: both deferred, q1's kick
 * registered first. Once the gate opens, other's completion thread hands 5 over and runs
 * the kicks, q1's first, whose hand-over of q1's wait on other's event is slow in the
 * driver. Meanwhile another library's stream waits for q's command 2. */
static void check_handover(void) {
    int released = atomic_exchange(&release_syncs, 0);  /* (as check_foreign) */
    _Atomic uint64_t *gate = calloc(1, sizeof *gate);
    fake_queue other = queue_bounded(1), q1 = queue_new(), q = queue_new();
    fake_stream *consumer = stream_new();
    static kernel after_q = {0, 0, NULL, 1};
    after_q.check = q.s;
    if (am_cuq_wait(other.q, (void *)gate, 1, 1) ||
        am_cuq_finish(other.q, 1, NULL, 0, 0, CU_FINISH_PLAIN))
        die("handover: other's gate failed");
    for (uint64_t v = 2; v <= 5; v++)
        if (launch(other, NULL, (int64_t)v, v)) die("handover: a launch on other failed");
    if (am_cuq_wait_queue(q1.q, other.q, 5, 1) || am_cuq_finish(q1.q, 1, NULL, 0, 0, CU_FINISH_PLAIN))
        die("handover: q1's wait failed");
    if (am_cuq_wait_queue(q.q, other.q, 5, 1) || am_cuq_finish(q.q, 1, NULL, 0, 0, CU_FINISH_PLAIN) ||
        launch(q, NULL, 2, 2))
        die("handover: q's wait failed");
    uint64_t stats[8];
    am_cuq_stats(q.q, stats);
    if (stats[6] < 3) die("handover: q's wait for a held command was not held");
    atomic_store(&wait_event_ns, 200000000);  /* 200 ms */
    atomic_store(gate, 1);
    int64_t deadline = now_ns() + 10000000000LL;
    /* q1's kick: its wait in the driver */
    for (int64_t look = 0; !atomic_load(&waits_in_driver); look_again(&look))
        if (now_ns() > deadline) die("handover: q1's wait never reached the driver");
    int call = -1;
    struct timespec cpu0, cpu1;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &cpu0);
    int r = am_cuq_wait_foreign(q.q, (void *)1, consumer, 2, &call);
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &cpu1);
    long cpu_ms = (cpu1.tv_sec - cpu0.tv_sec) * 1000 + (cpu1.tv_nsec - cpu0.tv_nsec) / 1000000;
    if (cpu_ms > 40) die("handover: waiting for q's kick on another thread kept a core busy");
    if (r == CU_DEFERRED) die("handover: refused while q's kick was under way");
    if (r) die("handover: another library's wait failed");
    atomic_store(&wait_event_ns, 0);
    /* the other library's kernel, behind its wait: it runs after q's kernel */
    int64_t arg = 0;
    void *params[1] = {&arg};
    if (((int (*)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                  void *, void **, void **))cu_funcs[CU_LAUNCH])(&after_q, 1, 1, 1, 1, 1, 1, 0,
                                                                   consumer, params, NULL))
        die("handover: the other library's launch failed");
    for (int64_t look = 0; atomic_load(&consumer->ran) < 1; look_again(&look))
        if (now_ns() > deadline) die("handover: the other library's kernel never ran");
    reach(q.t, 2, "handover: q never finished");
    reach(q1.t, 1, "handover: q1 never finished");
    fake_queue all[3] = {other, q1, q};
    for (int i = 0; i < 3; i++) queue_free(all[i], 0);
    stream_free(consumer, 0);
    free((void *)gate);
    atomic_store(&release_syncs, released);
    puts("ok handover");
}

typedef struct { am_timeline *t; uint64_t v; } host_signal;

static void *signal_from_host(void *arg) {
    host_signal *h = arg;
    am_timeline_host_signal(h->t, h->v, NULL);  /* runs the kick: hands the queue's work over */
    return NULL;
}

/* A queue whose wait on a timeline nothing signalled yet is held, closed (to finish, then
 * abandoned) while a host signal's thread hands its command over, slowly (its event
 * record takes 100 ms in the driver). */
static void check_signalrecord(void) {
    fake_queue a = queue_bounded(1), c = queue_new();
    free_timeline t = free_timeline_new();
    uint64_t stats[8], at = 0, value = 0, *gate = calloc(1, sizeof(uint64_t));
    int error = 0;
    if (gated_launch(a, gate, 1) || signal_free(a, t, 5, 2)) die("signalrecord: a failed at once");
    am_cuq_stats(a.q, stats);
    if (stats[6] != 2) die("signalrecord: a's signal was not held on the host");
    /* c's wait is held on the host until a signal of t gets to a driver */
    if (wait_held(c, t.t, 5, 1) || launch(c, NULL, 1, 2))
        die("signalrecord: c failed at once");
    atomic_store(&refuse_records, a.s);  /* the signal's record, once handed over */
    atomic_store((_Atomic uint64_t *)gate, 1);
    reach(t.t, 5, "signalrecord: a wait on the timeline of a refused signal never ended");
    reach(c.t, 2, "signalrecord: a queue's wait on a refused signal's timeline never ended");
    if (am_timeline_value(t.t) != UINT64_MAX || atomic_load((_Atomic uint64_t *)t.word) != AM_WORD_RELEASED)
        die("signalrecord: the timeline of the refused signal did not settle");
    /* a settles once the stream is past the fence behind the refused record, which
     * fails t first: on a busy machine this thread may look between the two */
    reach(a.t, UINT64_MAX, "signalrecord: the refused signal's queue never settled");
    if (am_cuq_error(a.q, &at) != 1 || at != 2 || am_timeline_value(a.t) != UINT64_MAX ||
        atomic_load(&a.s->ran) != 1)
        die("signalrecord: the refused signal's queue did not fail from it, once the launch ran");
    if (am_cuq_error(c.q, &at) != CU_HELD_FAILED || at != 1 || atomic_load(&c.s->ran) ||
        am_cuq_cause(c.q, &error, &value) != a.t || error != 1 || value != 2)
        die("signalrecord: the waiting queue did not fail from its wait without running, "
            "naming the signal");
    queue_free(a, 0);
    queue_free(c, 0);
    free_timeline_free(t);
    free(gate);
    puts("ok signalrecord");
}

static void check_nomemory(void) {
    uint64_t stats[8], at = 0, *gate_a = calloc(1, sizeof(uint64_t));
    free_timeline t = free_timeline_new(), t2 = free_timeline_new();  /* t: nobody signals it */
    /* a: a wait held behind a launch (the bound; behind a gate, raised once the value
     * was given back and taken again), whose end cannot be held */
    fake_queue a = queue_bounded(1);
    if (gated_launch(a, gate_a, 1) || am_cuq_wait_timeline(a.q, t.t, 1, 2))
        die("nomemory: a failed");
    atomic_store(&refuse_allocs, 1);
    if (am_cuq_finish(a.q, 2, t.t, 1, 0, CU_FINISH_PLAIN | CU_FINISH_WAITED) != -1)
        die("nomemory: a wait's end was held without memory");
    am_cuq_stats(a.q, stats);
    if (stats[6]) die("nomemory: part of a command that could not be held stayed held");
    if (launch(a, NULL, 2, 2)) die("nomemory: the value given back was refused");
    atomic_store((_Atomic uint64_t *)gate_a, 1);
    reach(a.t, 2, "nomemory: a command given back held up the queue's next one");
    if (am_cuq_error(a.q, &at)) die("nomemory: a command given back failed its queue");
    /* b: a wait for a signal none submitted yet (held, a kick registered) that cannot be
     * held; past b's bound, what follows is held, and must not stay held behind it */
    fake_queue b = queue_bounded(2);
    atomic_store(&refuse_allocs, 1);
    if (am_cuq_wait_timeline(b.q, t.t, 1, 1) != -1) die("nomemory: a wait was held without memory");
    for (uint64_t v = 1; v <= 8; v++)
        if (launch(b, NULL, (int64_t)v, v)) die("nomemory: a launch after the wait failed");
    reach(b.t, 8, "nomemory: commands after a wait that could not be held never ran");
    /* c: a signal whose word write reached the driver; its end finds the ring full, and
     * cannot grow it */
    fake_queue c = queue_new();
    uint64_t *gate = calloc(1, sizeof(uint64_t));
    if (am_cuq_wait(c.q, gate, 1, 1) || am_cuq_finish(c.q, 1, NULL, 0, 0, CU_FINISH_PLAIN))
        die("nomemory: c's gate failed");
    pthread_mutex_lock(&c.q->mu);
    uint64_t full = c.q->cap;
    pthread_mutex_unlock(&c.q->mu);
    for (uint64_t v = 2; v <= full; v++)
        if (launch(c, NULL, (int64_t)v, v)) die("nomemory: a launch on c failed");
    if (am_cuq_write(c.q, t2.word, 3, full + 1)) die("nomemory: the signal's write failed");
    atomic_store(&refuse_allocs, 1);
    if (am_cuq_finish(c.q, full + 1, t2.t, 3, 0, 0) != -1)
        die("nomemory: the completion ring grew without memory");
    if (am_timeline_value(t2.t) == UINT64_MAX)  /* (its write waits behind c's gate) */
        die("nomemory: the signal's timeline failed while its word write could still land");
    if (am_cuq_error(c.q, &at) != -1 || at != full + 1)
        die("nomemory: a command part of which reached the driver did not fail its queue");
    if (launch(c, NULL, 0, full + 1) != -1) die("nomemory: the failed queue took a command");
    atomic_store((_Atomic uint64_t *)gate, 1);
    reach(c.t, UINT64_MAX, "nomemory: the failed queue never settled");
    if (atomic_load(&c.s->ran) != (long)full - 1) die("nomemory: c settled before its launches ran");
    if (am_timeline_value(t2.t) != UINT64_MAX) die("nomemory: the failed signal's timeline is unsettled");
    if (atomic_load((_Atomic uint64_t *)t2.word) != AM_WORD_RELEASED)
        die("nomemory: the signal's word write landed on its failed timeline's released word");
    /* d: a long kernel reached the driver; its end finds the ring full, and cannot grow
     * it. The queue fails from it, and settles only once its stream is past the kernel
     * (a fence the completion thread records behind it): not as soon as the commands
     * before it are confirmed, while the kernel may still write its buffers. */
    static kernel longer = {0, 200000000, NULL, 0};
    fake_queue d = queue_new();
    uint64_t *gate_d = calloc(1, sizeof(uint64_t));
    if (am_cuq_wait(d.q, gate_d, 1, 1) || am_cuq_finish(d.q, 1, NULL, 0, 0, CU_FINISH_PLAIN))
        die("nomemory: d's gate failed");
    pthread_mutex_lock(&d.q->mu);
    full = d.q->cap;
    pthread_mutex_unlock(&d.q->mu);
    for (uint64_t v = 2; v <= full; v++)
        if (launch(d, NULL, (int64_t)v, v)) die("nomemory: a launch on d failed");
    atomic_store(&refuse_allocs, 1);
    if (launch(d, &longer, 0, full + 1) != -1)
        die("nomemory: the completion ring grew without memory for a launch's end");
    if (am_cuq_error(d.q, &at) != -1 || at != full + 1)
        die("nomemory: a launch that reached the driver did not fail its queue");
    atomic_store((_Atomic uint64_t *)gate_d, 1);
    reach(d.t, UINT64_MAX, "nomemory: the queue of the launch without memory never settled");
    if (atomic_load(&d.s->ran) != (long)full)
        die("nomemory: d settled while the launch without memory could still run");
    fake_queue all[4] = {a, b, c, d};
    for (int i = 0; i < 4; i++) queue_free(all[i], 0);
    free_timeline frees[2] = {t, t2};
    for (int i = 0; i < 2; i++) {
        am_timeline_free(frees[i].t);
        free(frees[i].word);
    }
    free(gate);
    free(gate_d);
    free(gate_a);
    puts("ok nomemory");
}

/* A close to finish of a queue, on a thread of its own (closer), so that a check can
 * bound how long it takes. */
static pthread_mutex_t closer_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t closer_cv;  /* timed (am_cond_init, in main) */
static int closer_done;

static void *closer(void *arg) {
    am_cuq_close(arg, 0);
    pthread_mutex_lock(&closer_mu);
    closer_done = 1;
    pthread_cond_signal(&closer_cv);
    pthread_mutex_unlock(&closer_mu);
    return NULL;
}

/* Close q to finish; `what` fails the check unless the close returns within ns. */
static void close_within(am_cuq *q, long ns, const char *what) {
    pthread_t thread;
    struct timespec until;
    closer_done = 0;  /* (no closer runs yet) */
    if (pthread_create(&thread, NULL, closer, q)) die("close_within: pthread_create");
    deadline_after(&until, ns);
    pthread_mutex_lock(&closer_mu);
    while (!closer_done)
        if (am_cond_timedwait(&closer_cv, &closer_mu, &until) == ETIMEDOUT) die(what);
    pthread_mutex_unlock(&closer_mu);
    pthread_join(thread, NULL);
}

/* The driver's refusals of event records back to none. */
static void refusals_off(void) {
    atomic_store(&refuse_records, NULL);
    atomic_store(&refuse_more, 0);
    atomic_store(&refuse_code, 0);
    atomic_store(&refuse_more_code, 0);
    atomic_store(&records_refused, 0);
}

/* A signal whose end (its event record) the driver refuses once its word write reached
 * the driver, behind a slow kernel of the same command, and then the fence behind it
 * too, twice, for lack of memory (the completion thread's second try is taken). */
static void check_unfencedsignal(void) {
    static kernel slow = {0, 200000000, NULL, 0};
    fake_queue f = queue_new();
    free_timeline t = free_timeline_new();
    int error = 0;
    uint64_t at = 0, value = 0;
    am_timeline *cause = NULL;
    if (launch(f, NULL, 1, 1)) die("unfencedsignal: launch 1 failed");
    reach(f.t, 1, "unfencedsignal: launch 1 never ran");
    if (kernel_part(f, &slow, 2) || am_cuq_write(f.q, t.word, 5, 2))
        die("unfencedsignal: the signal's kernel or word write failed");
    atomic_store(&records_refused, 0);
    atomic_store(&refuse_more_code, OUT_OF_MEMORY);  /* the fence's: tried again */
    atomic_store(&refuse_more, 2);
    atomic_store(&refuse_records, f.s);
    if (am_cuq_finish(f.q, 2, t.t, 5, 0, 0) != 1) die("unfencedsignal: the refusal was not reported");
    reach(t.t, UINT64_MAX, "unfencedsignal: the refused signal's timeline never settled");
    /* (its word write is behind the kernel: the stream ran the kernel before the write) */
    if (atomic_load(&f.s->ran) != 2)
        die("unfencedsignal: the signal's timeline failed while its word write could still land");
    reach(f.t, UINT64_MAX, "unfencedsignal: the queue never settled");
    if (atomic_load((_Atomic uint64_t *)t.word) != AM_WORD_RELEASED)
        die("unfencedsignal: the word write landed on the failed timeline's released word");
    if (am_timeline_failure(t.t, &error, &value, &cause) != 1 || error != 1 || value != 2 ||
        cause != f.t)
        die("unfencedsignal: the timeline does not name the refused command");
    if (am_cuq_error(f.q, &at) != 1 || at != 2) die("unfencedsignal: the queue's failure is wrong");
    if (atomic_load(&refuse_records)) die("unfencedsignal: the fence was not tried again");
    refusals_off();
    queue_free(f, 0);
    free_timeline_free(t);
    puts("ok unfencedsignal");
}

/* A command part of which reached the driver (a kernel, a signal's word write) whose end
 * the driver refuses with a sticky error -- the context faulted -- and so the fence
 * behind it: nothing of the context runs any more, so the queue and the timeline the
 * signal was to raise settle at once (no fence is tried again). */
static void check_stickyfence(void) {
    static kernel slow = {0, 50000000, NULL, 0};
    fake_queue f = queue_new();
    free_timeline t = free_timeline_new();
    uint64_t at = 0;
    if (launch(f, NULL, 1, 1)) die("stickyfence: launch 1 failed");
    reach(f.t, 1, "stickyfence: launch 1 never ran");
    if (kernel_part(f, &slow, 2) || am_cuq_write(f.q, t.word, 5, 2))
        die("stickyfence: the signal's kernel or word write failed");
    atomic_store(&fault_code, ILLEGAL_ADDRESS);  /* every call fails with it from now on */
    if (am_cuq_finish(f.q, 2, t.t, 5, 0, 0) != ILLEGAL_ADDRESS)
        die("stickyfence: the sticky refusal was not reported");
    if (am_timeline_value(f.t) != UINT64_MAX) die("stickyfence: the queue did not settle at once");
    if (am_timeline_value(t.t) != UINT64_MAX)
        die("stickyfence: the signal's timeline did not settle at once");
    if (am_cuq_error(f.q, &at) != ILLEGAL_ADDRESS || at != 2)
        die("stickyfence: the queue's failure is wrong");
    queue_free(f, 0);
    atomic_store(&fault_code, 0);
    free_timeline_free(t);
    puts("ok stickyfence");
}

/* Context 2's completion thread, stopped at its start until `start_go`. */
static atomic_int start_held, start_go;

static void hold_start(int where, am_cuq *q) {
    if (where != CU_HOOK_RUN_START || q->ctx != (void *)2) return;
    atomic_store(&start_held, 1);
    int64_t deadline = now_ns() + 10000000000LL;
    for (int64_t look = 0; !atomic_load(&start_go); look_again(&look))
        if (now_ns() > deadline) die("nocontext: the check never let the thread go on");
}

/* A queue of context 2 (bounded to `bound` in flight) whose completion thread the driver
 * refuses to make that context current, the thread held at its start until start_go;
 * the calling thread has it current already, so its submissions need no such call. */
static fake_queue nocontext_queue(long bound, const char *check) {
    char made[96], started[96];
    snprintf(made, sizeof made, "%s: am_cuq_new", check);
    snprintf(started, sizeof started, "%s: the completion thread never started", check);
    fake_queue f = {stream_new(), am_timeline_new(), calloc(1, sizeof(uint64_t)), NULL};
    am_timeline_set_word(f.t, f.word);
    atomic_store(&start_held, 0);
    atomic_store(&start_go, 0);
    atomic_store(&test_hook, hold_start);
    atomic_store(&refuse_ctx, (void *)2);
    fake_ctx_set_current((void *)2);
    f.q = am_cuq_new((void *)2, f.s, f.t, 30000, bound);
    if (!f.q) die(made);
    for (int64_t deadline = now_ns() + 10000000000LL, look = 0;
         !atomic_load(&start_held);
         look_again(&look))
        if (now_ns() > deadline) die(started);
    return f;
}

/* A queue whose completion thread the driver refuses to make its context current (the
 * submitting thread has it current already, so its submissions need no such call):
 * commands handed over and held before the thread got there fail, and so does a
 * signal held, the queue settles and refuses what comes after, and a close ends (to
 * finish, and abandoned). */
static void check_nocontext(void) {
    void *mine = fake_ctx_current();
    for (int abandon = 0; abandon < 2; abandon++) {
        free_timeline t = free_timeline_new();
        int error = 0;
        uint64_t at = 0, value = 0;
        am_timeline *cause = NULL;
        fake_queue f = nocontext_queue(1, "nocontext");
        /* launch 1 handed over; the signal and launch 3 held (the bound) */
        if (launch(f, NULL, 1, 1) || am_cuq_write(f.q, t.word, 5, 2) ||
            am_cuq_finish(f.q, 2, t.t, 5, 0, 0) || launch(f, NULL, 3, 3))
            die("nocontext: a submission failed before the thread got to its context");
        atomic_store(&start_go, 1);
        reach(f.t, UINT64_MAX, "nocontext: the queue never settled");
        if (am_cuq_error(f.q, &at) != 1 || at != 1 || am_cuq_failed_call(f.q) != CU_CTX_SET)
            die("nocontext: the queue did not fail from its first command, naming cuCtxSetCurrent");
        if (am_timeline_value(t.t) != UINT64_MAX ||
            am_timeline_failure(t.t, &error, &value, &cause) != 1 || error != 1 || value != 1 ||
            cause != f.t)
            die("nocontext: the held signal's timeline did not fail, naming the queue's failure");
        if (launch(f, NULL, 4, 4) != 1) die("nocontext: the failed queue took another command");
        atomic_store(&test_hook, NULL);
        queue_free(f, abandon);  /* (one that never returned: the run times out) */
        atomic_store(&refuse_ctx, NULL);
        free_timeline_free(t);
    }
    fake_ctx_set_current(mine);
    puts("ok nocontext");
}

/* A fence behind a command part of which the driver has (its end and fence refused: no
 * signal kept) that the completion thread records again, slowly in the driver; meanwhile
 * a signal of that command whose word write reached the driver is kept for the fence (as
 * cuq_no_memory keeps one a submitter could not hold): once the fence is confirmed, that
 * signal's timeline fails rather than being forgotten (its waiters would block for
 * good). */
static void check_refencekept(void) {
    static kernel slow = {0, 20000000, NULL, 0};
    fake_queue f = queue_new();
    free_timeline t = free_timeline_new();
    if (launch(f, NULL, 1, 1)) die("refencekept: launch 1 failed");
    reach(f.t, 1, "refencekept: launch 1 never ran");
    if (kernel_part(f, &slow, 2)) die("refencekept: the kernel failed");
    atomic_store(&records_refused, 0);
    atomic_store(&refuse_more_code, OUT_OF_MEMORY);  /* the fence's: tried again */
    atomic_store(&refuse_more, 1);  /* command 2's end, and its fence */
    atomic_store(&refuse_records, f.s);
    atomic_store(&record_gate_on, f.s);  /* the fence tried again: in the driver until let go */
    if (am_cuq_finish(f.q, 2, NULL, 0, 0, CU_FINISH_PLAIN) != 1)
        die("refencekept: the refusal was not reported");
    for (int64_t deadline = now_ns() + 5000000000LL, look = 0;
         !atomic_load(&records_in_driver);
         look_again(&look))
        if (now_ns() > deadline) die("refencekept: the fence was never tried again");
    am_cuop op = {.kind = CUOP_FINISH, .value = 2, .extra = t.t, .extra_value = 5};
    pthread_mutex_lock(&f.q->mu);
    cuq_fail_signal_held(f.q, &op, -1, 2, f.t);
    int kept = cuq_unfence(f.q, 2, &op);
    pthread_mutex_unlock(&f.q->mu);
    if (!kept) die("refencekept: the signal was not kept for the fence");
    atomic_store(&record_gate_on, NULL);
    reach(f.t, UINT64_MAX, "refencekept: the queue never settled");
    reach(t.t, UINT64_MAX, "refencekept: the kept signal's timeline never failed");
    refusals_off();
    queue_free(f, 0);
    free_timeline_free(t);
    puts("ok refencekept");
}

/* The wall clock as this process reads it (clock_gettime here takes the C library's
 * place for the runtime compiled in): wall_ahead_ns ahead of the one the kernel keeps,
 * which a timed wait on a CLOCK_REALTIME condition ends by -- as if the wall clock were
 * stepped back that far (NTP, settimeofday) just after each read. */
static _Atomic int64_t wall_ahead_ns;

int clock_gettime(clockid_t id, struct timespec *ts) {
    static int (*_Atomic libc)(clockid_t, struct timespec *);
    int (*real)(clockid_t, struct timespec *) = atomic_load(&libc);
    if (!real) {
        real = (int (*)(clockid_t, struct timespec *))dlsym(RTLD_NEXT, "clock_gettime");
        if (!real) die("clock_gettime: the C library's is not found");
        atomic_store(&libc, real);
    }
    int r = real(id, ts);
    int64_t ahead = atomic_load(&wall_ahead_ns);
    if (r == 0 && id == CLOCK_REALTIME && ahead) {
        ts->tv_sec += (time_t)(ahead / 1000000000);
        ts->tv_nsec += (long)(ahead % 1000000000);
        if (ts->tv_nsec >= 1000000000L) { ts->tv_sec++; ts->tv_nsec -= 1000000000L; }
    }
    return r;
}

/* Fails `what` unless a wait that started at `start` (now_ns()) for at most 10 ms ended
 * within 2 s. */
static void ended_on_time(int64_t start, const char *what) {
    if (now_ns() - start > 2000000000LL) die(what);
}

/* The runtime's timed waits with the wall clock 30 s ahead of the kernel's: each ends by
 * the monotonic clock, on time. A wait whose deadline were read from the wall clock
 * (CLOCK_REALTIME, a condition's default) would last 30 s longer -- past each bound here
 * (2 s; the fence's, reach's 10 s). Checked: fails on such a wait. */
static void check_wallclock(void) {
    static kernel quick = {0, 1000000, NULL, 0};
    atomic_store(&wall_ahead_ns, 30000000000LL);
    int64_t start = now_ns();
    if (kick_nap(10000000, atomic_load(&kick_gen))) die("wallclock: a kick's nap was kicked");
    ended_on_time(start, "wallclock: a kick's nap outlasted its 10 ms");
    am_timeline *t = am_timeline_new();
    if (!t) die("wallclock: am_timeline_new");
    start = now_ns();
    if (am_host_wait(t, 1, 0, NULL, 10000000)) die("wallclock: a host wait saw a value never signalled");
    ended_on_time(start, "wallclock: a host wait outlasted its 10 ms");
    am_timeline_free(t);
    start = now_ns();
    am_blocks_wait(am_blocks_wait(0, 0), 10000000);
    ended_on_time(start, "wallclock: a wait for a block outlasted its 10 ms");
    /* A command's end refused, and its fence (out of memory: tried again after a 1 ms
     * nap): the queue settles once the fence tried again is confirmed. */
    fake_queue f = queue_new();
    if (launch(f, NULL, 1, 1)) die("wallclock: launch 1 failed");
    reach(f.t, 1, "wallclock: launch 1 never ran");
    if (kernel_part(f, &quick, 2)) die("wallclock: the kernel failed");
    atomic_store(&records_refused, 0);
    atomic_store(&refuse_more_code, OUT_OF_MEMORY);
    atomic_store(&refuse_more, 1);  /* command 2's end, and its fence */
    atomic_store(&refuse_records, f.s);
    if (am_cuq_finish(f.q, 2, NULL, 0, 0, CU_FINISH_PLAIN) != 1)
        die("wallclock: the refusal was not reported");
    reach(f.t, UINT64_MAX, "wallclock: the refused fence's nap outlasted 10 s (cuq_refence)");
    if (atomic_load(&refuse_records)) die("wallclock: the fence was not tried again");
    refusals_off();
    queue_free(f, 0);
    atomic_store(&wall_ahead_ns, 0);
    puts("ok wallclock");
}

/* The same fence, a signal kept for it, and the queue closed with abandon while the
 * fence is in the driver: the close returns only once the fence's driver calls are done
 * (they hand the signal's timeline over), so the caller may let go of that timeline. */
static void check_refenceabandon(void) {
    static kernel slow = {0, 20000000, NULL, 0};
    fake_queue f = queue_new();
    free_timeline t = free_timeline_new();
    if (launch(f, NULL, 1, 1)) die("refenceabandon: launch 1 failed");
    reach(f.t, 1, "refenceabandon: launch 1 never ran");
    if (kernel_part(f, &slow, 2) || am_cuq_write(f.q, t.word, 5, 2))
        die("refenceabandon: the signal's kernel or word write failed");
    atomic_store(&records_refused, 0);
    atomic_store(&refuse_more_code, OUT_OF_MEMORY);  /* the fence's: tried again */
    atomic_store(&refuse_more, 1);  /* the signal's end, and its fence */
    atomic_store(&refuse_records, f.s);
    atomic_store(&record_ns, 300000000);  /* the fence tried again: past a close's 200 ms */
    if (am_cuq_finish(f.q, 2, t.t, 5, 0, 0) != 1) die("refenceabandon: the refusal was not reported");
    for (int64_t deadline = now_ns() + 5000000000LL, look = 0;
         !atomic_load(&records_in_driver);
         look_again(&look))
        if (now_ns() > deadline) die("refenceabandon: the fence was never tried again");
    am_cuq_close(f.q, 1);
    if (atomic_load(&records_in_driver))
        die("refenceabandon: an abandoning close returned with the fence in the driver");
    atomic_store(&record_ns, 0);
    refusals_off();
    free_timeline_free(t);  /* (AddressSanitizer: nothing of the queue's reads it now) */
    abandoned_free(f);
    puts("ok refenceabandon");
}

/* The queue in check_nocontext's state, with a signal in flight: while its completion
 * thread fails that signal's timeline (its lock released), a submitter keeps another
 * signal, whose word write reached the driver, for a fence (as cuq_submit_then does for
 * one whose end and fence the driver refused; here at a kick that comes due as the first
 * timeline fails): that signal's timeline fails too, no fence being recorded. */
static am_cuq *kept_queue;
static free_timeline kept_timeline;
static atomic_int kept_at_kick;

static void keep_at_kick(am_kick *k) {
    (void)k;
    am_cuop op = {.kind = CUOP_FINISH, .value = 3, .extra = kept_timeline.t, .extra_value = 7};
    pthread_mutex_lock(&kept_queue->mu);
    cuq_fail_signal_held(kept_queue, &op, 1, 3, kept_queue->timeline);
    int kept = cuq_unfence(kept_queue, 3, &op);
    pthread_mutex_unlock(&kept_queue->mu);
    atomic_store(&kept_at_kick, 1 + kept);
}

static void check_nocontextkept(void) {
    void *mine = fake_ctx_current();
    free_timeline t = free_timeline_new();
    kept_timeline = free_timeline_new();
    static am_kick kick;
    fake_queue f = nocontext_queue(8, "nocontextkept");
    kept_queue = f.q;
    if (launch(f, NULL, 1, 1) || am_cuq_write(f.q, t.word, 1, 2) ||
        am_cuq_finish(f.q, 2, t.t, 1, 0, 0))
        die("nocontextkept: a submission failed before the thread got to its context");
    kick.fn = keep_at_kick;
    if (!timeline_defer(t.t, AM_WORD_RELEASED, &kick)) die("nocontextkept: the kick came due at once");
    /* The signal's word write ran on the stream before the thread fails t: landing
     * between the failure's raise of the word and its look for the kicks due, it would
     * lower the word (a store), and the kick would not come due. */
    for (int64_t deadline = now_ns() + 10000000000LL, look = 0;
         atomic_load((_Atomic uint64_t *)t.word) != 1;
         look_again(&look))
        if (now_ns() > deadline) die("nocontextkept: the signal's word write never ran");
    atomic_store(&start_go, 1);
    reach(f.t, UINT64_MAX, "nocontextkept: the queue never settled");
    reach(t.t, UINT64_MAX, "nocontextkept: the signal in flight never failed");
    if (atomic_load(&kept_at_kick) != 2) die("nocontextkept: the signal was not kept for a fence");
    reach(kept_timeline.t, UINT64_MAX, "nocontextkept: the kept signal's timeline never failed");
    atomic_store(&test_hook, NULL);
    queue_free(f, 0);
    atomic_store(&refuse_ctx, NULL);
    fake_ctx_set_current(mine);
    free_timeline_free(t);
    free_timeline_free(kept_timeline);
    puts("ok nocontextkept");
}

/* A queue whose completion thread cannot make its context current fails the timeline of
 * its signal in flight (the word released) without seeing that signal's word write,
 * which its stream runs later (gated here): landing then, the write lowers the word (a
 * store). A queue's device wait for more of that timeline, held on the host until what
 * gets it there reached a driver, still goes on then -- the timeline failed for it --
 * and is not made: the queue fails from the wait on (CU_HELD_FAILED), naming the
 * failure, its kernel behind the wait never launched. Checked: fails without the fix
 * (the wait's kick, due by the word or a hand-over only, was left registered for good). */
static void check_nocontextlowered(void) {
    void *mine = fake_ctx_current();
    free_timeline t = free_timeline_new();
    fake_queue b = queue_new();
    uint64_t *gate = calloc(2, sizeof(uint64_t)), at = 0, value = 0;
    int error = 0;
    fake_queue f = nocontext_queue(8, "nocontextlowered");
    /* command 1 waits on the stream for the gate; command 2 signals t to 5 */
    if (gated_launch(f, gate, 1) || signal_free(f, t, 5, 2))
        die("nocontextlowered: a submission failed before the thread got to its context");
    atomic_store(&start_go, 1);
    reach(t.t, UINT64_MAX, "nocontextlowered: the signal in flight never failed");
    reach(f.t, UINT64_MAX, "nocontextlowered: the queue never settled");
    atomic_store(&test_hook, NULL);
    atomic_store((_Atomic uint64_t *)gate, 1);  /* the stream runs the write now */
    for (int64_t deadline = now_ns() + 10000000000LL, look = 0;
         atomic_load((_Atomic uint64_t *)t.word) != 5;
         look_again(&look))
        if (now_ns() > deadline) die("nocontextlowered: the signal's word write never ran");
    fake_ctx_set_current(mine);
    /* b: command 1 waits on the stream for b's gate (raised once all is submitted: b
     * settles no earlier); command 2 waits for t's 7, command 3 launches behind it */
    if (gated_launch(b, gate + 1, 1) || wait_held(b, t.t, 7, 2) || launch(b, NULL, 3, 3))
        die("nocontextlowered: b");
    atomic_store((_Atomic uint64_t *)(gate + 1), 1);
    int64_t deadline = now_ns() + 3000000000LL;
    for (int64_t look = 0; am_timeline_value(b.t) < 3; look_again(&look))
        if (now_ns() > deadline)
            die("nocontextlowered: a device wait for a failed timeline, whose word a signal's "
                "write landing after the failure lowered, was held for good");
    if (am_cuq_error(b.q, &at) != CU_HELD_FAILED || at != 2 ||
        am_cuq_cause(b.q, &error, &value) != (void *)f.t || error != 1 || value != 1)
        die("nocontextlowered: b did not fail from its wait, naming the queue's failure");
    if (atomic_load(&b.s->ran) != 1)
        die("nocontextlowered: b's kernel before the wait did not run, or the one behind it did");
    queue_free(b, 0);
    queue_free(f, 0);
    atomic_store(&refuse_ctx, NULL);
    free_timeline_free(t);
    free(gate);
    puts("ok nocontextlowered");
}

/* A fence the driver refuses with an error no later try cures: nothing more to wait
 * for. Checked: fails without the fix (the completion thread tried the fence again for
 * good: the queue never settled, the signal's waiters waited for good, a close to
 * finish never returned). */
static void check_fencegone(void) {
    /* CUDA_ERROR_CONTEXT_IS_DESTROYED, _INVALID_CONTEXT, _DEINITIALIZED,
     * _NOT_INITIALIZED */
    static const int codes[] = {709, 201, 4, 3};
    static kernel slow = {0, 20000000, NULL, 0};
    for (size_t i = 0; i < sizeof codes / sizeof *codes; i++) {
        for (int when = 0; when < 3; when++) {  /* at once, at the hand-over, on a retry */
            int code = codes[i], error = 0;
            uint64_t at = 0, value = 0, *gate = calloc(1, sizeof(uint64_t));
            am_timeline *cause = NULL;
            fake_queue f = when == 1 ? queue_bounded(1) : queue_new();
            free_timeline t = free_timeline_new();
            if (when == 1) {  /* command 2 held behind command 1, gated */
                if (gated_launch(f, gate, 1)) die("fencegone: launch 1 failed");
            } else {
                if (launch(f, NULL, 1, 1)) die("fencegone: launch 1 failed");
                reach(f.t, 1, "fencegone: launch 1 never ran");
            }
            if (kernel_part(f, &slow, 2) || am_cuq_write(f.q, t.word, 5, 2))
                die("fencegone: the signal's kernel or word write failed");
            atomic_store(&records_refused, 0);
            atomic_store(&refuse_code, code);
            atomic_store(&refuse_more_code, when == 2 ? OUT_OF_MEMORY : code);
            atomic_store(&refuse_more, 1 << 30);  /* every record from now on */
            atomic_store(&refuse_records, f.s);
            if (am_cuq_finish(f.q, 2, t.t, 5, 0, 0) != (when == 1 ? 0 : code))
                die("fencegone: the refusal was not reported");
            if (when == 1) atomic_store((_Atomic uint64_t *)gate, 1);
            if (when == 2) {  /* tried again, refused for lack of memory; then for good */
                for (int64_t deadline = now_ns() + 5000000000LL, look = 0;
                     atomic_load(&records_refused) < 3; look_again(&look))
                    if (now_ns() > deadline) die("fencegone: the fence was never tried again");
                atomic_store(&refuse_more_code, code);
            }
            reach(f.t, UINT64_MAX, "fencegone: the queue never settled");
            reach(t.t, UINT64_MAX, "fencegone: the signal's timeline never failed");
            if (am_timeline_failure(t.t, &error, &value, &cause) != 1 || error != code ||
                value != 2 || cause != f.t)
                die("fencegone: the signal's timeline does not name the refused command");
            if (am_cuq_error(f.q, &at) != code || at != 2)
                die("fencegone: the queue's failure is wrong");
            close_within(f.q, 10000000000L, "fencegone: a close to finish never returned");
            refusals_off();
            stream_free(f.s, 0);
            am_timeline_free(f.t);
            free(f.word);
            free_timeline_free(t);
            free(gate);
        }
    }
    puts("ok fencegone");
}

static void check_handsignal(void) {
    int released = atomic_exchange(&release_syncs, 0);  /* (as check_foreign) */
    static kernel after_w = {0, 0, NULL, 1};
    fake_queue s = queue_bounded(1), w = queue_new(), b = queue_new();
    after_w.check = w.s;
    free_timeline t = free_timeline_new();
    /* s's command 1 waits for a gate, raised once both waits below were asked for: its
     * signal stays held on the host until handed over here (s's thread would hand it
     * over once command 1 ran) */
    uint64_t *gate = calloc(1, sizeof(uint64_t));
    if (gated_launch(s, gate, 1) || signal_free(s, t, 1, 2)) die("handsignal: s failed at once");
    if (wait_held(w, t.t, 1, 1) || launch(w, NULL, 7, 2))
        die("handsignal: w failed at once");
    int call = -1;
    if (am_cuq_wait_foreign(w.q, (void *)1, b.s, 2, &call) != CU_DEFERRED)
        die("handsignal: a stream waited for a command behind a wait nothing handed over");
    if (am_cuq_hand_over(s.q, 2)) die("handsignal: the held signal was not handed over");
    if (am_cuq_wait_foreign(w.q, (void *)1, b.s, 2, &call) || call != CU_WAIT_EVENT)
        die("handsignal: once the signal was handed over, the stream did not wait on the event");
    atomic_store((_Atomic uint64_t *)gate, 1);
    if (launch(b, &after_w, 1, 1)) die("handsignal: b's launch failed");
    reach(b.t, 1, "handsignal: the consumer's stream never got past its wait");
    reach(w.t, 2, "handsignal: w never finished");
    reach(s.t, 2, "handsignal: s never finished");
    queue_free(s, 0);
    queue_free(w, 0);
    queue_free(b, 0);
    free_timeline_free(t);
    free(gate);
    atomic_store(&release_syncs, released);
    puts("ok handsignal");
}

static void check_closing(void) {
    int released = atomic_exchange(&release_syncs, 0);  /* (as check_foreign) */
    for (int abandon = 0; abandon < 2; abandon++) {
        fake_queue f = queue_new();
        am_timeline *t = am_timeline_new();
        uint64_t *word = calloc(1, sizeof(uint64_t));
        am_timeline_set_word(t, word);
        if (am_cuq_wait_timeline(f.q, t, 1, 1) || am_cuq_finish(f.q, 1, NULL, 0, 0, CU_FINISH_PLAIN))
            die("closing: the wait failed");
        /* 400 ms: longer than an abandoning close waits for a thread blocked on an event */
        atomic_store(&record_ns, 400000000);
        host_signal h = {t, 1};
        pthread_t thread;
        pthread_create(&thread, NULL, signal_from_host, &h);
        int64_t deadline = now_ns() + 10000000000LL;
        for (int64_t look = 0; !atomic_load(&records_in_driver); look_again(&look))
            if (now_ns() > deadline) die("closing: the kick never handed the command over");
        am_cuq_close(f.q, abandon);
        atomic_store(&f.s->released, 1);  /* its owner may destroy the stream now */
        if (!abandon && am_timeline_value(f.t) < 1)
            die("closing: closed to finish, before the command handed over was confirmed");
        pthread_join(thread, NULL);
        atomic_store(&record_ns, 0);
        stream_free(f.s, abandon);
        am_timeline_free(f.t);
        free(f.word);
        am_timeline_free(t);
        free(word);
    }
    /* Abandoned while its wait is held for a timeline nothing signals: the kick goes. */
    fake_queue f = queue_new();
    am_timeline *t = am_timeline_new();
    uint64_t *word = calloc(1, sizeof(uint64_t));
    am_timeline_set_word(t, word);
    if (am_cuq_wait_timeline(f.q, t, 1, 1) || am_cuq_finish(f.q, 1, NULL, 0, 0, CU_FINISH_PLAIN) ||
        launch(f, NULL, 2, 2))
        die("closing: the wait failed");
    if (!atomic_load(&t->has_kicks)) die("closing: the wait was not held");
    queue_free(f, 1);
    if (atomic_load(&t->has_kicks)) die("closing: an abandoned queue's kick stayed registered");
    am_timeline_free(t);
    free(word);
    atomic_store(&release_syncs, released);
    puts("ok closing");
}

enum { STRESS_ROUNDS = 300 };

typedef struct {
    fake_queue q[4];
    am_timeline *signalled, *host;  /* signalled by q[0]; by the host thread */
    uint64_t *words;
    _Atomic uint64_t submitted[4];  /* each queue's last value submitted */
    atomic_int done;
    fake_stream *consumer;          /* another library's, on the same hardware queue */
    long refused, waited;           /* the consumer thread's */
} stress;

/* A command of q (value v) that waits for `other`'s command `target`. */
static void stress_wait_queue(am_cuq *q, am_cuq *other, uint64_t target, uint64_t v) {
    if (am_cuq_wait_queue(q, other, target, v) || am_cuq_finish(q, v, NULL, 0, 0, CU_FINISH_PLAIN))
        die("stress: a wait on a queue failed");
}

/* A command of q (value v) that waits for t to reach `target`, confirmed once it did. */
static void stress_wait_timeline(am_cuq *q, am_timeline *t, uint64_t target, uint64_t v) {
    if (am_cuq_wait_timeline(q, t, target, v) ||
        am_cuq_finish(q, v, t, target, 0, CU_FINISH_PLAIN | CU_FINISH_WAITED))
        die("stress: a wait on a timeline failed");
}

/* A kernel on st->q[i] (its value ++*v), then that value published to the other threads. */
static void stress_launch(stress *st, int i, uint64_t r, uint64_t *v) {
    if (launch(st->q[i], NULL, (int64_t)r, ++*v)) die("stress: a launch failed");
    atomic_store(&st->submitted[i], *v);
}

/* q[0]: kernels, signalling `signalled` every round; q[1]: waits on q[2]'s commands. */
static void *stress_a(void *arg) {
    stress *st = arg;
    uint64_t v0 = 0, v1 = 0;
    for (uint64_t r = 1; r <= STRESS_ROUNDS; r++) {
        stress_launch(st, 0, r, &v0);
        ++v0;
        if (am_cuq_write(st->q[0].q, &st->words[0], r, v0) ||
            am_cuq_finish(st->q[0].q, v0, st->signalled, r, 0, 0))
            die("stress: q0's signal failed");
        atomic_store(&st->submitted[0], v0);
        uint64_t theirs = atomic_load(&st->submitted[2]);
        if (theirs && r % 3 == 0) stress_wait_queue(st->q[1].q, st->q[2].q, theirs, ++v1);
        stress_launch(st, 1, r, &v1);
        if (r % 16 == 0) sched_yield();
    }
    return NULL;
}

/* q[2]: waits on `signalled` (often before q[0] signals it); q[3]: on q[1]'s commands and
 * on the host's timeline. */
static void *stress_b(void *arg) {
    stress *st = arg;
    uint64_t v2 = 0, v3 = 0;
    for (uint64_t r = 1; r <= STRESS_ROUNDS; r++) {
        uint64_t ahead = r + 2 <= STRESS_ROUNDS ? r + 2 : STRESS_ROUNDS;
        if (r % 2 == 0) stress_wait_timeline(st->q[2].q, st->signalled, ahead, ++v2);
        stress_launch(st, 2, r, &v2);
        uint64_t theirs = atomic_load(&st->submitted[1]);
        if (theirs && r % 4 == 1) stress_wait_queue(st->q[3].q, st->q[1].q, theirs, ++v3);
        if (r % 5 == 0) stress_wait_timeline(st->q[3].q, st->host, r / 5, ++v3);
        stress_launch(st, 3, r, &v3);
        if (r % 16 == 0) sched_yield();
    }
    return NULL;
}

static void *stress_host(void *arg) {
    stress *st = arg;
    for (uint64_t v = 1; v <= STRESS_ROUNDS / 5; v++) {
        nap_ns(200000);
        am_timeline_host_signal(st->host, v, NULL);
    }
    return NULL;
}

/* Other libraries' streams (sharing the hardware queue) wait for the queues' commands. */
static void *stress_consumer(void *arg) {
    stress *st = arg;
    fake_stream *consumer = st->consumer;
    for (int i = 0; !atomic_load(&st->done); i++) {
        int k = 1 + i % 3;
        uint64_t target = atomic_load(&st->submitted[k]);
        if (!target) continue;
        int call = -1;
        int r = am_cuq_wait_foreign(st->q[k].q, (void *)1, consumer, target, &call);
        if (r == CU_DEFERRED) {
            /* only a queue behind a wait on a timeline (q2, and q1 and q3 through q2) */
            st->refused++;
        } else if (r) {
            die("stress: another library's wait failed");
        } else {
            st->waited++;
        }
        nap_ns(50000);
    }
    return NULL;
}

static void check_stress(void) {
    int released = atomic_exchange(&release_syncs, 0);  /* (as check_foreign) */
    fake_stream *hw = stream_new();
    static stress st;
    long bounds[4] = {3, 2, 4, 2};
    for (int i = 0; i < 4; i++) st.q[i] = queue_on(stream_sharing(hw), bounds[i]);
    st.consumer = stream_sharing(hw);
    st.signalled = am_timeline_new();
    st.host = am_timeline_new();
    st.words = calloc(2, sizeof(uint64_t));
    am_timeline_set_word(st.signalled, &st.words[0]);
    am_timeline_set_word(st.host, &st.words[1]);
    pthread_t a, b, h, c;
    pthread_create(&a, NULL, stress_a, &st);
    pthread_create(&b, NULL, stress_b, &st);
    pthread_create(&h, NULL, stress_host, &st);
    pthread_create(&c, NULL, stress_consumer, &st);
    pthread_join(a, NULL);
    pthread_join(b, NULL);
    pthread_join(h, NULL);
    for (int i = 0; i < 4; i++) {
        int64_t deadline = now_ns() + 30000000000LL;
        for (int64_t look = 0;
             am_timeline_value(st.q[i].t) < atomic_load(&st.submitted[i]);
             look_again(&look))
            if (now_ns() > deadline) die("stress: a queue never finished (a wait hangs)");
        uint64_t at = 0;
        if (am_cuq_error(st.q[i].q, &at)) die("stress: a queue failed");
    }
    atomic_store(&st.done, 1);
    pthread_join(c, NULL);
    if (!st.waited) die("stress: no other library's wait was made");
    if (getenv("STRESS_VERBOSE"))
        fprintf(stderr, "stress: %ld waited, %ld refused\n", st.waited, st.refused);
    for (int i = 0; i < 4; i++) queue_free(st.q[i], 0);
    stream_free(st.consumer, 0);
    stream_free(hw, 0);
    am_timeline_free(st.signalled);
    am_timeline_free(st.host);
    free(st.words);
    atomic_store(&release_syncs, released);
    puts("ok stress");
}

/* The hook's part of check_discardkick: the host signal that makes the held wait's kick
 * due, run (with the kick) between the discard's unlock and its taking the kick off. */
static am_timeline *_Atomic signal_at_discard;

static void host_signal_at_discard(int where, am_cuq *q) {
    (void)q;
    am_timeline *t = where == CU_HOOK_DISCARD_UNLOCKED ? atomic_exchange(&signal_at_discard, NULL)
                                                      : NULL;
    if (t) am_timeline_host_signal(t, 1, NULL);
}

/* f's held wait for t was dropped: its kick too, and f defers nothing. */
static void kick_gone(fake_queue f, free_timeline t, const char *what) {
    pthread_mutex_lock(&f.q->mu);
    int deferred = f.q->deferred;
    pthread_mutex_unlock(&f.q->mu);
    if (deferred || atomic_load(&t.t->has_kicks)) die(what);
}

/* f holds a wait for t (which s signals, its signal held behind s's gate), and commands
 * behind it; the discard drops them all, and the wait's kick runs right after the
 * discard let go of f's lock -- a host signal of t on another thread. The kick ends its
 * reference of f once, whichever of the two takes it: f settles, failed from 1, nothing
 * held or registered, and its close frees it (ASan: no use after free, no leak). */
static void check_discardkick(void) {
    int released = atomic_exchange(&release_syncs, 0);  /* (as check_foreign) */
    fake_queue f = queue_new(), s = queue_bounded(1);
    free_timeline t = free_timeline_new();
    uint64_t *gate = calloc(1, sizeof(uint64_t));
    if (am_cuq_wait(s.q, gate, 1, 1) || am_cuq_finish(s.q, 1, NULL, 0, 0, CU_FINISH_PLAIN) ||
        signal_free(s, t, 1, 2))
        die("discardkick: s failed at once");
    if (wait_held(f, t.t, 1, 1) ||
        launch(f, NULL, 2, 2) || launch(f, NULL, 3, 3))
        die("discardkick: f failed at once");
    uint64_t stats[8];
    am_cuq_stats(f.q, stats);
    if (stats[6] != 6 || !atomic_load(&t.t->has_kicks))  /* (two per launch) */
        die("discardkick: (setup) f's wait was not held, its kick registered");
    atomic_store(&signal_at_discard, t.t);
    atomic_store(&test_hook, host_signal_at_discard);
    am_cuq_discard(f.q);
    atomic_store(&test_hook, NULL);
    if (atomic_load(&signal_at_discard)) die("discardkick: (setup) the hook did not run");
    reach(f.t, UINT64_MAX, "discardkick: the discarded queue never settled");
    uint64_t at = 0;
    am_cuq_stats(f.q, stats);
    if (am_cuq_error(f.q, &at) != AM_DISCARDED || at != 1 || stats[6] || atomic_load(&f.s->ran))
        die("discardkick: the held commands were not all dropped, failing from the first");
    kick_gone(f, t, "discardkick: the dropped wait's kick stayed registered, or f deferred");
    atomic_store((_Atomic uint64_t *)gate, 1);
    reach(s.t, 2, "discardkick: s never finished");
    queue_free(f, 0);
    queue_free(s, 0);
    free_timeline_free(t);
    free(gate);
    atomic_store(&release_syncs, released);
    puts("ok discardkick");
}

/* The hook's part of check_discarddrain: the discard, run while the queue's completion
 * thread hands its held wait over -- after taking it off the held operations, before the
 * driver call that finds it must be held again. */
static am_cuq *_Atomic discard_at_drain;

static void discard_while_draining(int where, am_cuq *q) {
    am_cuq *expected = q;
    if ((where == CU_HOOK_DRAIN_HANDING || where == CU_HOOK_SUBMIT_HANDING) &&
        atomic_compare_exchange_strong(&discard_at_drain, &expected, NULL))
        am_cuq_discard(q);
}

/* f, one command in flight at most, holds a wait for t (which nothing signals) behind a
 * kernel, and a kernel behind the wait. The first kernel done, f's completion thread
 * takes the wait off the held operations to hand it over, and the discard runs then:
 * it takes the wait's command for handed over (being handed now) and keeps it, dropping
 * only the kernel behind. The thread finds the wait must be held and puts it back; it
 * then discards again, so the wait goes too (its kick with it) and f settles, failed
 * from 2. (Before, the wait stayed held for good and f never settled.) */
static void check_discarddrain(void) {
    fake_queue f = queue_bounded(1);
    free_timeline t = free_timeline_new();
    uint64_t *gate = calloc(1, sizeof(uint64_t));  /* the wait is held behind it */
    atomic_store(&discard_at_drain, f.q);
    atomic_store(&test_hook, discard_while_draining);
    if (gated_launch(f, gate, 1) || wait_held(f, t.t, 1, 2) ||
        launch(f, NULL, 3, 3))
        die("discarddrain: f failed at once");
    atomic_store((_Atomic uint64_t *)gate, 1);
    reach(f.t, 1, "discarddrain: the first kernel never ran");
    reach(f.t, UINT64_MAX, "discarddrain: the discarded queue never settled (its wait kept)");
    atomic_store(&test_hook, NULL);
    if (atomic_load(&discard_at_drain)) die("discarddrain: (setup) the hook did not run");
    uint64_t at = 0, stats[8];
    am_cuq_stats(f.q, stats);
    if (am_cuq_error(f.q, &at) != AM_DISCARDED || at != 2 || stats[6] ||
        atomic_load(&f.s->ran) != 1)
        die("discarddrain: the wait and the kernel behind it were not dropped, from 2");
    kick_gone(f, t, "discarddrain: the dropped wait's kick stayed registered, or f deferred");
    queue_free(f, 0);
    free_timeline_free(t);
    /* The same where the submitting thread hands the wait over itself (nothing held):
     * the discard, run before the driver call, finds nothing to drop; the wait, put back
     * held, goes once that thread discards again. */
    f = queue_new();
    t = free_timeline_new();
    atomic_store(&discard_at_drain, f.q);
    atomic_store(&test_hook, discard_while_draining);
    if (am_cuq_wait_timeline(f.q, t.t, 1, 1))
        die("discarddrain: f's wait failed at once");
    atomic_store(&test_hook, NULL);
    if (atomic_load(&discard_at_drain)) die("discarddrain: (setup) the hook did not run");
    reach(f.t, UINT64_MAX, "discarddrain: a wait its submitter put back held was kept");
    if (am_cuq_error(f.q, &at) != AM_DISCARDED || at != 1)
        die("discarddrain: the wait put back held was not dropped");
    queue_free(f, 0);
    free_timeline_free(t);
    free(gate);
    puts("ok discarddrain");
}

/* ---- discardstress: a discard among the threads that hand a queue's work over ------- */

enum { DS_ROUNDS = 60, DS_COMMANDS = 40, DS_SIGNALS = 30, DS_HOST = 20 };

typedef struct {
    fake_queue f, w, s;             /* f discarded; w waits on f's values; s signals dev */
    fake_stream *consumer;          /* another library's stream waiting for f's values */
    free_timeline dev, host, u;     /* signalled by s; by the host thread; by f */
    _Atomic uint64_t f_published, s_published;
    atomic_int stop;                /* the waiting threads stop (before f closes) */
    uint64_t w_waits[64][2];        /* w's waits for f: (w's command, f's value) */
    int w_count;
    uint64_t seed;
} dstress;

static uint64_t ds_rand(uint64_t *x) {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    return *x;
}

/* s: kernels and signals of `dev` (s holds them past its bound of 1: its completion
 * thread hands them over, and runs the kicks of f's waits held for them). */
static void *ds_signaller(void *arg) {
    dstress *d = arg;
    uint64_t v = 0;
    for (uint64_t target = 1; target <= DS_SIGNALS; target++) {
        if (launch(d->s, NULL, (int64_t)target, ++v) || signal_free(d->s, d->dev, target, ++v))
            die("discardstress: s failed");
        atomic_store(&d->s_published, v);
        if (target % 4 == 0) nap_ns(20000);
    }
    return NULL;
}

/* The host signals `host` (each signal kicks the waits held for it, on this thread). */
static void *ds_host(void *arg) {
    dstress *d = arg;
    uint64_t x = d->seed ^ 0x9e3779b97f4a7c15ULL;
    for (uint64_t v = 1; v <= DS_HOST; v++) {
        nap_ns((long)(ds_rand(&x) % 150000));
        am_timeline_host_signal(d->host.t, v, NULL);
    }
    return NULL;
}

/* w waits on the device for f's values published so far (as another queue's wait). */
static void *ds_waiter(void *arg) {
    dstress *d = arg;
    uint64_t x = d->seed ^ 0x5bd1e995ULL, v = 0;
    while (!atomic_load(&d->stop) && d->w_count < 64) {
        uint64_t p = atomic_load(&d->f_published);
        if (!p) { sched_yield(); continue; }
        uint64_t target = 1 + ds_rand(&x) % p, at = 0;
        int r = am_cuq_wait_queue(d->w.q, d->f.q, target, ++v);
        if (!r) r = am_cuq_finish(d->w.q, v, NULL, 0, 0, CU_FINISH_PLAIN);
        if (!r) {
            d->w_waits[d->w_count][0] = v;
            d->w_waits[d->w_count][1] = target;
            d->w_count++;
            r = launch(d->w, NULL, 0, ++v);
        }
        if (r) {  /* w failed already, from a wait for a dropped value: it takes no more */
            int e = am_cuq_error(d->w.q, &at);
            if (e != CU_WAITED_FAILED && e != CU_HELD_FAILED) die("discardstress: w failed");
            break;
        }
        nap_ns((long)(ds_rand(&x) % 50000));
    }
    return NULL;
}

/* Another library's stream waits for f's values (f's held work up to it handed over). */
static void *ds_foreign(void *arg) {
    dstress *d = arg;
    uint64_t x = d->seed ^ 0xc2b2ae35ULL;
    while (!atomic_load(&d->stop)) {
        uint64_t p = atomic_load(&d->f_published);
        if (!p) { sched_yield(); continue; }
        int call = -1;
        int r = am_cuq_wait_foreign(d->f.q, (void *)1, d->consumer, 1 + ds_rand(&x) % p, &call);
        if (r && r != CU_DEFERRED) die("discardstress: another library's wait failed");
        nap_ns((long)(ds_rand(&x) % 40000));
    }
    return NULL;
}

static void ds_round(int round) {
    static dstress d;
    memset(&d, 0, sizeof d);
    d.seed = 0x2545f4914f6cdd1dULL * (uint64_t)(round + 1);
    d.f = queue_bounded(2);
    d.w = queue_new();
    d.s = queue_bounded(1);
    d.consumer = stream_new();
    d.dev = free_timeline_new();
    d.host = free_timeline_new();
    d.u = free_timeline_new();
    pthread_t threads[4];
    void *(*runs[4])(void *) = {ds_signaller, ds_host, ds_waiter, ds_foreign};
    for (int i = 0; i < 4; i++) pthread_create(&threads[i], NULL, runs[i], &d);
    /* f: kernels, waits held until what they wait for was handed over (a signal of dev,
     * the host's signal, a command of s), and signals of u -- most held past f's bound. */
    uint64_t x = d.seed, launches[DS_COMMANDS + 1] = {0}, signals[DS_COMMANDS + 1] = {0};
    uint64_t u_target = 0;
    /* In some rounds a wait for a value nothing signals: it and all behind it are held
     * until the discard drops them (its kick with them). */
    uint64_t never = ds_rand(&x) % 3 ? 0 : DS_COMMANDS / 2 + ds_rand(&x) % (DS_COMMANDS / 2);
    for (uint64_t v = 1; v <= DS_COMMANDS; v++) {
        int r = 0;
        switch (v == never ? 8 : ds_rand(&x) % 8) {
        case 8:
            r = am_cuq_wait_timeline(d.f.q, d.dev.t, DS_SIGNALS + 1, v) ||
                am_cuq_finish(d.f.q, v, d.dev.t, DS_SIGNALS + 1, 0,
                              CU_FINISH_PLAIN | CU_FINISH_WAITED);
            break;
        case 0: {
            uint64_t target = 1 + ds_rand(&x) % DS_SIGNALS;
            r = am_cuq_wait_timeline(d.f.q, d.dev.t, target, v) ||
                am_cuq_finish(d.f.q, v, d.dev.t, target, 0, CU_FINISH_PLAIN | CU_FINISH_WAITED);
            break;
        }
        case 1: {
            uint64_t target = 1 + ds_rand(&x) % DS_HOST;
            r = am_cuq_wait_timeline(d.f.q, d.host.t, target, v) ||
                am_cuq_finish(d.f.q, v, d.host.t, target, 0, CU_FINISH_PLAIN | CU_FINISH_WAITED);
            break;
        }
        case 2:
            r = am_cuq_wait_queue(d.f.q, d.s.q, 1 + ds_rand(&x) % (2 * DS_SIGNALS), v) ||
                am_cuq_finish(d.f.q, v, NULL, 0, 0, CU_FINISH_PLAIN);
            break;
        case 3:
            signals[v] = ++u_target;
            r = signal_free(d.f, d.u, u_target, v);
            break;
        default:
            launches[v] = 1;
            r = launch(d.f, NULL, (int64_t)v, v);
        }
        if (r) die("discardstress: f failed at once");
        atomic_store(&d.f_published, v);
        if (ds_rand(&x) % 8 == 0) sched_yield();
    }
    nap_ns((long)(ds_rand(&x) % 300000));
    am_cuq_discard(d.f.q);
    atomic_store(&d.stop, 1);
    for (int i = 0; i < 4; i++) pthread_join(threads[i], NULL);
    /* Everything f's kept commands wait for was signalled: f finishes, or settles. Its
     * error is read after: a thread handing a held wait over as the discard ran (which
     * took the wait's command for handed over) discards again once it puts it back. */
    reach(d.f.t, DS_COMMANDS,
          "discardstress: a discarded queue never settled (a wait it kept left un-kicked?)");
    uint64_t first = 0;
    int error = am_cuq_error(d.f.q, &first);
    if (error && (error != AM_DISCARDED || !first || first > DS_COMMANDS))
        die("discardstress: f failed otherwise than by the discard");
    if (!error) first = DS_COMMANDS + 1;  /* nothing was held: nothing dropped */
    if (never && first > never) die("discardstress: a wait nothing signals was not dropped");
    reach(d.f.t, error ? UINT64_MAX : DS_COMMANDS,
          "discardstress: a discarded queue never settled (a wait it kept left un-kicked?)");
    uint64_t stats[8];
    am_cuq_stats(d.f.q, stats);
    if (stats[6]) die("discardstress: operations still held once the queue settled");
    /* Its kernels before the first dropped command ran, in order; none after. */
    long ran = 0;
    for (uint64_t v = 1; v <= DS_COMMANDS; v++)
        if (launches[v] && v < first) {
            if (ran >= atomic_load(&d.f.s->ran) || d.f.s->log[ran] != (int64_t)v)
                die("discardstress: a kept command did not run, or ran out of order");
            ran++;
        }
    if (atomic_load(&d.f.s->ran) != ran) die("discardstress: a dropped command ran");
    /* u: raised by the signals kept; failed, naming the discard, by one dropped. */
    uint64_t dropped_signal = 0, dropped_at = 0, kept_target = 0;
    for (uint64_t v = 1; v <= DS_COMMANDS; v++)
        if (signals[v] && v >= first && !dropped_signal) dropped_signal = signals[v], dropped_at = v;
        else if (signals[v] && v < first) kept_target = signals[v];
    int u_error = 0;
    uint64_t u_value = 0;
    am_timeline *cause = NULL;
    if (dropped_signal) {
        reach(d.u.t, UINT64_MAX, "discardstress: a dropped signal's timeline never failed");
        /* (It names the first command dropped by the discard that dropped the signal: a
         * wait put back and dropped after came before.) */
        if (!am_timeline_failure(d.u.t, &u_error, &u_value, &cause) || u_error != AM_DISCARDED ||
            u_value < first || u_value > dropped_at || cause != d.f.t)
            die("discardstress: a dropped signal's timeline did not fail, naming the discard");
    } else if (am_timeline_value(d.u.t) != kept_target) {
        die("discardstress: the signals kept did not raise their timeline");
    }
    /* w: its waits for f's values before the first dropped one succeed; from the first
     * wait for a dropped one on, it fails. */
    uint64_t w_last = d.w_count ? d.w_waits[d.w_count - 1][0] + 1 : 0, w_first = 0;
    for (int i = 0; i < d.w_count && !w_first; i++)
        if (d.w_waits[i][1] >= first) w_first = d.w_waits[i][0];
    reach(d.w.t, w_first ? UINT64_MAX : w_last, "discardstress: a wait for f never ended");
    uint64_t at = 0;
    int w_error = am_cuq_error(d.w.q, &at);
    /* (held on the host until f's failure was known, w's work from there never ran) */
    int w_failed = w_error == CU_WAITED_FAILED || w_error == CU_HELD_FAILED;
    if (w_first ? !w_failed || at != w_first : w_error != 0)
        die("discardstress: a wait for a discarded command did not fail from there, or one "
            "for a kept command failed");
    stream_free(d.consumer, 0);  /* (it may have waited on f's word: before f's goes) */
    /* w's stream may still be reading f's word, released by f's close: the word goes
     * once w's stream has ended */
    uint64_t *f_word = d.f.word;
    d.f.word = NULL;
    queue_free(d.f, round % 2);
    queue_free(d.w, 0);
    free(f_word);
    queue_free(d.s, 0);
    free_timeline_free(d.dev);
    free_timeline_free(d.host);
    free_timeline_free(d.u);
}

static void check_discardstress(void) {
    int released = atomic_exchange(&release_syncs, 0);  /* (as check_foreign) */
    const char *rounds = getenv("DISCARD_ROUNDS");
    int n = rounds ? atoi(rounds) : DS_ROUNDS;
    for (int round = 0; round < n; round++) ds_round(round);
    atomic_store(&release_syncs, released);
    puts("ok discardstress");
}

/* Whether f failed from a device wait, held on the host, for a value never produced:
 * from that wait on nothing ran. */
static int wait_skipped(fake_queue f) {
    uint64_t at = 0;
    return am_cuq_error(f.q, &at) == CU_HELD_FAILED && !atomic_load(&f.s->ran);
}

/* A waiter's record stays in a's waiters after the waiter closed and its timeline was
 * freed; a's abandon then reads that timeline (cuq_abandon_waiters). ASan: UAF. */
static void check_uafwaiter(void) {
    fake_queue a = queue_new(), b = queue_new();
    free_timeline gate = free_timeline_new();
    static kernel slow = {0, 20000000, NULL, 0};
    if (launch(a, &slow, 1, 1)) die("uafwaiter: a");
    if (wait_free(a, gate, 1, 2) || launch(a, NULL, 2, 3)) die("uafwaiter: a2");
    if (am_cuq_wait_queue(b.q, a.q, 1, 1) || am_cuq_finish(b.q, 1, a.t, 1, 0, CU_FINISH_PLAIN))
        die("uafwaiter: b");
    reach(b.t, 1, "uafwaiter: b never went on");
    reach(a.t, 1, "uafwaiter: a 1");
    queue_free(b, 0);          /* b's timeline freed; its record stays in a's waiters */
    am_cuq_close(a.q, 1);      /* reads b's freed timeline */
    am_timeline_close(gate.t, 0);
    abandoned_free(a);
    free_timeline_free(gate);
}

/* a's command 1 confirmed through b's wait (a's timeline at 1) but not yet by a's own
 * thread; a abandoned: c's wait for a's 1 must not fail. */
static void check_confirmedfirst(void) {
    fake_queue a = queue_new(), b = queue_new(), c = queue_new();
    free_timeline gate = free_timeline_new();
    static kernel slow = {0, 20000000, NULL, 0}, cslow = {0, 300000000, NULL, 0};
    hold_next(a);
    if (launch(a, &slow, 1, 1)) die("confirmedfirst: a");
    check_held(a, "confirmedfirst: (setup) a's launch is not the command held");
    if (wait_free(a, gate, 1, 2)) die("confirmedfirst: a2");
    if (launch(c, &cslow, 1, 1) || am_cuq_wait_queue(c.q, a.q, 1, 2) ||
        am_cuq_finish(c.q, 2, a.t, 1, 0, CU_FINISH_PLAIN) || launch(c, NULL, 3, 3))
        die("confirmedfirst: c");
    if (am_cuq_wait_queue(b.q, a.q, 1, 1) || am_cuq_finish(b.q, 1, a.t, 1, 0, CU_FINISH_PLAIN))
        die("confirmedfirst: b");
    reach(a.t, 1, "falsepos: a's 1 never confirmed through b");
    am_cuq_close(a.q, 1);
    atomic_store(&held, NULL);
    am_timeline_close(gate.t, 0);
    reach(c.t, 3, "falsepos: c never went on");
    uint64_t at = 0;
    if (am_cuq_error(c.q, &at))
        die("confirmedfirst: a wait for a command confirmed (through another queue's wait) "
            "before its queue was abandoned failed");
    abandoned_free(a);
    queue_free(b, 0);
    queue_free(c, 0);
    free_timeline_free(gate);
}

/* w, which waited for a command of f (abandoned by the check), gets past its wait (to
 * its command 2) and fails -- without running what follows it if its wait was still
 * held when f was abandoned (`held`; else its wait may have gone to the device just
 * before, on a loaded machine, and what follows it ran); both are freed. */
static void wait_failed(fake_queue f, fake_queue w, int held, const char *what) {
    reach(w.t, 2, what);
    uint64_t at = 0;
    int error = am_cuq_error(w.q, &at);
    if (held ? !wait_skipped(w) : error != CU_WAITED_FAILED && error != CU_HELD_FAILED)
        die(what);
    abandoned_free(f);
    queue_free(w, 0);
}

/* Lets the record held in the driver on `arg` (a fake_queue's) go once its queue's
 * abandoning close has done all it does before waiting for that driver call (the last
 * of it: its timeline handed over to the end). */
static void *let_record_go_at_close(void *arg) {
    fake_queue *f = arg;
    int64_t deadline = now_ns() + 10000000000LL;
    for (int64_t look = 0; atomic_load(&f->t->handed) != UINT64_MAX; look_again(&look))
        if (now_ns() > deadline) die("kickmiss: the close never began");
    atomic_store(&record_gate_on, NULL);
    return NULL;
}

/* f abandoned while a kick's thread is inside the driver call of f's command 1's end
 * (popped off held, not yet in the ring): w's wait for f's 1 must fail. */
static void check_kickmiss(void) {
    fake_queue f = queue_new(), w = queue_new();
    free_timeline t = free_timeline_new();
    if (am_cuq_wait_timeline(f.q, t.t, 1, 1) || am_cuq_finish(f.q, 1, NULL, 0, 0, CU_FINISH_PLAIN))
        die("kickmiss: f");
    if (am_cuq_wait_queue(w.q, f.q, 1, 1) || am_cuq_finish(w.q, 1, f.t, 1, 0, CU_FINISH_PLAIN) ||
        launch(w, NULL, 2, 2))
        die("kickmiss: w");
    atomic_store(&record_gate_on, f.s);  /* the end's record: in the driver until let go */
    host_signal h = {t.t, 1};
    pthread_t thread, letter;
    pthread_create(&thread, NULL, signal_from_host, &h);
    int64_t deadline = now_ns() + 10000000000LL;
    for (int64_t look = 0; !atomic_load(&records_in_driver); look_again(&look))
        if (now_ns() > deadline) die("kickmiss: the kick never handed the command over");
    pthread_create(&letter, NULL, let_record_go_at_close, &f);
    am_cuq_close(f.q, 1);
    pthread_join(letter, NULL);
    pthread_join(thread, NULL);
    wait_failed(f, w, 0, "kickmiss: a wait for a command being handed over when its queue was "
                      "abandoned did not fail");
    free_timeline_free(t);
}

/* f idle (all confirmed) abandoned: w's held wait for f's never-given 2 must fail (a
 * normal close fails it: AM_CLOSED). */
static void check_idleabandon(void) {
    fake_queue f = queue_new(), w = queue_new();
    if (launch(f, NULL, 1, 1)) die("idleabandon: f");
    reach(f.t, 1, "idleabandon: f 1");
    if (am_cuq_wait_queue(w.q, f.q, 2, 1) || am_cuq_finish(w.q, 1, f.t, 2, 0, CU_FINISH_PLAIN) ||
        launch(w, NULL, 2, 2))
        die("idleabandon: w");
    am_cuq_close(f.q, 1);
    wait_failed(f, w, 1, "idleabandon: a wait for a value an idle queue abandoned was never "
                      "given did not fail");
}

/* A wait held on the host for a timeline nobody signalled (not on the device yet: no
 * signal of it handed over), and the timeline's device closes (am_timeline_close): the
 * held wait goes on and fails, as a device wait on it does. */
static void check_closekick(void) {
    fake_queue w = queue_new();
    free_timeline t = free_timeline_new();
    if (wait_held(w, t.t, 5, 1) ||
        launch(w, NULL, 2, 2))
        die("closekick: w");
    uint64_t stats[8];
    am_cuq_stats(w.q, stats);
    if (!stats[6]) die("closekick: the wait was not held");
    am_timeline_close(t.t, 0);
    int64_t deadline = now_ns() + 3000000000LL;
    for (int64_t look = 0; am_timeline_value(w.t) < 2; look_again(&look))
        if (now_ns() > deadline)
            die("closekick: a wait held for a value of a closed timeline never went on "
                "(am_timeline_close runs no kicks)");
    if (!wait_skipped(w)) die("closekick: the commands behind it did not fail without running");
    queue_free(w, 0);
    free_timeline_free(t);
}

/* A signal passed behind a failed wait marks its timeline failed from the value after
 * the one a signal of its queue in flight before it raises it to -- and that queue is
 * then abandoned, that signal never confirmed, and the timeline's device closes: a
 * host queue's wait for that lower value ends (failed, AM_CLOSED), not waits for good. */
static void check_closeearly(void) {
    am_timeline *hgate = am_timeline_new(), *h = am_timeline_new(), *cause = am_timeline_new();
    am_timeline *h2 = am_timeline_new();
    am_queue *hq = am_queue_new(h, 0, 0), *waiter = am_queue_new(h2, 0, 0);
    if (!hq || !waiter || am_queue_wait(hq, hgate, 1, 1)) die("closeearly: the host queues");
    /* a: command 1 signals t to 1 behind a gate never raised; command 2 waits for h;
     * command 3 signals t to 2 (passed once h fails) */
    fake_queue a = queue_new();
    free_timeline t = free_timeline_new();
    uint64_t *a_gate = calloc(1, sizeof(uint64_t));
    if (am_cuq_wait(a.q, a_gate, 1, 1) || signal_free(a, t, 1, 1) ||
        wait_held(a, h, 1, 2) ||
        signal_free(a, t, 2, 3))
        die("closeearly: a failed at once");
    if (am_queue_wait(waiter, t.t, 1, 1)) die("closeearly: the waiting host queue");
    am_timeline_fail(hgate, 1, ILLEGAL_ADDRESS, 7, cause);
    int error = 0;
    uint64_t value = 0;
    am_timeline *by = NULL;
    int64_t deadline = now_ns() + 10000000000LL;
    for (int64_t look = 0; !am_timeline_failure(t.t, &error, &value, &by); look_again(&look))
        if (now_ns() > deadline) die("closeearly: a's passed signal did not fail its timeline");
    am_cuq_close(a.q, 1);  /* its signal of t to 1, in flight, never confirmed */
    am_timeline_close(t.t, 0);
    reach(h2, 1, "closeearly: a wait for a value below an early failure mark never ended "
                 "once the timeline closed");
    if (am_queue_failure(waiter, &error, &value, &by) != 1 || error != AM_CLOSED)
        die("closeearly: the wait did not fail, naming the close");
    am_queue_close(hq, 0);
    am_queue_close(waiter, 0);
    abandoned_free(a);
    free_timeline_free(t);
    free(a_gate);
    am_timeline_free(hgate);
    am_timeline_free(h);
    am_timeline_free(h2);
    am_timeline_free(cause);
}

/* A timeline only the host signalled (to 1): c's device wait for 3 is made at once,
 * behind a gate. a then signals it to 2 (its write behind a gate of its own), and the
 * timeline's device closes: the word is released to 2**63 - 1, then a's write (its gate
 * raised once the close returned) stores 2 over it; c's stream gets to its wait once
 * a's signal was confirmed (its gate raised then). c's stream must still get past its
 * wait. */
static void check_lowered(void) {
    fake_queue a = queue_new(), c = queue_new();
    free_timeline t = free_timeline_new();
    uint64_t *gates = calloc(2, sizeof(uint64_t)), *a_gate = gates, *c_gate = gates + 1;
    am_timeline_host_signal(t.t, 1, NULL);
    if (gated_launch(c, c_gate, 1) || wait_held(c, t.t, 3, 2) ||
        launch(c, NULL, 3, 3))
        die("lowered: c");
    if (gated_launch(a, a_gate, 1) || signal_free(a, t, 2, 2)) die("lowered: a");
    am_timeline_close(t.t, 0);  /* its device closed: the word released */
    atomic_store((_Atomic uint64_t *)a_gate, 1);
    reach(a.t, 2, "lowered: a never ran");
    atomic_store((_Atomic uint64_t *)c_gate, 1);
    int64_t deadline = now_ns() + 3000000000LL;
    for (int64_t look = 0; am_timeline_value(c.t) < 3; look_again(&look))
        if (now_ns() > deadline)
            die("lowered: a signal's word write after the timeline was released stored a "
                "lower value over 2**63 - 1: a device wait it had released waits for good");
    queue_free(a, 0);
    queue_free(c, 0);
    free_timeline_free(t);
    free(gates);
}

/* a fails (a held command refused) while an earlier command of it waits on a gate; a
 * consumer stream (b's) waits for a's refused value: on a's word (a failed). a is
 * abandoned and the gate closed, as a device's close does before cuCtxSynchronize: the
 * consumer's stream must get to its end (a's word released), before a's timeline is
 * failed (Device.close's abandon(), which comes after the backend's close). */
static void check_foreignabandon(void) {
    fake_queue a = queue_bounded(2), b = queue_new();
    free_timeline gate = free_timeline_new();
    static kernel slow = {0, 50000000, NULL, 0}, refused = {0, 0, NULL, 0};
    refuse_fn = &refused;
    if (launch(a, &slow, 1, 1) || wait_free(a, gate, 1, 2) || launch(a, &refused, 3, 3))
        die("foreignabandon: a");
    uint64_t at = 0;
    int64_t deadline = now_ns() + 3000000000LL;
    for (int64_t look = 0; !am_cuq_error(a.q, &at); look_again(&look))
        if (now_ns() > deadline) die("foreignabandon: (setup) a's held command not refused");
    int call = -1;
    if (am_cuq_wait_foreign(a.q, (void *)1, b.s, 3, &call) || call != CU_WAIT64)
        die("foreignabandon: (setup) the consumer's wait was not made on a's word");
    if (launch(b, NULL, 1, 1)) die("foreignabandon: b");
    am_cuq_close(a.q, 1);
    am_timeline_close(gate.t, 0);
    deadline = now_ns() + 3000000000LL;
    for (int64_t look = 0; am_timeline_value(b.t) < 1; look_again(&look))
        if (now_ns() > deadline)
            die("foreignabandon: a consumer stream waiting on the word of a failed queue "
                "that was abandoned before it settled waits for good (call was "
                "cuStreamWaitValue64)");
    refuse_fn = NULL;
    abandoned_free(a);
    queue_free(b, 0);
    free_timeline_free(gate);
}

/* A thread of the parent's holding a queue's lock (as its completion thread or a
 * submitter does, for a moment, at any time) until told to let go. */
static atomic_int forked_holding, forked_let_go;

static void *hold_queue_lock(void *arg) {
    am_cuq *q = arg;
    pthread_mutex_lock(&q->mu);
    atomic_store(&forked_holding, 1);
    while (!atomic_load(&forked_let_go)) nap_ns(100000);
    pthread_mutex_unlock(&q->mu);
    return NULL;
}

/* A forked child gets the parent's memory and none of its threads: a queue of the
 * parent's has no completion thread there, and its lock, held by a thread of the parent
 * at the fork, is held for good in the child. A discard or a close of it in the child
 * (Queue.close(discard=True) of a queue the child inherited discards it) leaves it as
 * it is -- the parent's memory, never a hang -- as a cpu queue's do (host_queues.c); the
 * parent's queue goes on. Checked: fails without the fix (the child hung). */
static void check_forked(void) {
    fake_queue f = queue_new();
    if (launch(f, NULL, 1, 1)) die("forked: launch 1 failed");
    reach(f.t, 1, "forked: launch 1 never ran");
    pthread_t holder;
    atomic_store(&forked_holding, 0);
    atomic_store(&forked_let_go, 0);
    if (pthread_create(&holder, NULL, hold_queue_lock, f.q)) die("forked: pthread_create");
    while (!atomic_load(&forked_holding)) nap_ns(100000);
    fflush(stdout);  /* (the child's exit writes nothing of the parent's) */
    pid_t pid = fork();
    if (pid < 0) die("forked: fork");
    if (pid == 0) {
        am_cuq_discard(f.q);
        am_cuq_close(f.q, 0);
        _exit(0);
    }
    int status = 0;
    pid_t done = 0;
    for (int64_t deadline = now_ns() + 5000000000LL; !done && now_ns() < deadline;) {
        done = waitpid(pid, &status, WNOHANG);
        if (!done) nap_ns(1000000);
    }
    if (!done) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        die("forked: a discard or a close in a forked child of a queue of its parent "
            "hung on a lock a thread of the parent held at the fork");
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status))
        die("forked: the child's discard or close of its parent's queue failed");
    atomic_store(&forked_let_go, 1);
    pthread_join(holder, NULL);
    if (launch(f, NULL, 2, 2)) die("forked: the parent's queue refused a launch after the fork");
    reach(f.t, 2, "forked: the parent's queue stopped at the fork");
    queue_free(f, 0);
    puts("ok forked");
}

/* Run a check with blocked syncs left blocked (as check_foreign does), then say so. */
static void unreleased(void (*check)(void), const char *name) {
    int released = atomic_exchange(&release_syncs, 0);
    check();
    atomic_store(&release_syncs, released);
    printf("ok %s\n", name);
}

int main(void) {
    am_cond_init(&closer_cv);
    fake_driver_install();
    check_order();
    check_cross();
    check_long();
    check_fill();
    if (atomic_load(&events_made) != atomic_load(&events_destroyed))
        die("events: am_cuq_close left events behind");
    puts("ok events");
    check_fault();
    check_faultheld();
    check_faulthanding();
    check_causal();
    check_bound();
    check_refused();
    check_discard();
    check_partial();
    check_refusedpart();
    check_release();
    check_hostwait();
    check_hostheld();
    check_hostfailed();
    check_skipsignal();
    check_twosignals();
    check_poisonsignal();
    check_poisonflight();
    check_poisonlater();
    check_failedqueue();
    check_poisonheld();
    check_poisondeferred();
    check_refusedpromise();
    check_promisedlater();
    check_waitrace();
    check_waitraceclose();
    check_waitrace2();
    check_abandonrace();
    check_waittaken();
    check_poisonoom();
    check_chainclose();
    check_signal();
    check_signalrecord();
    check_nomemory();
    check_unfencedsignal();
    check_stickyfence();
    check_nocontext();
    check_refencekept();
    check_wallclock();
    check_refenceabandon();
    check_nocontextkept();
    check_nocontextlowered();
    check_fencegone();
    check_predict();  /* before abandon, after which a blocking wait never blocks */
    check_near();
    check_kick();
    check_hostnap();
    check_selfseen();
    check_handkick();
    check_abandon();
    check_context();
    check_foreign();
    check_unlocked();
    check_waitstream();
    check_orphaned();
    check_waitedfreed();
    check_signalfreed();
    check_confirmfreed();
    check_heldfreed();
    check_waitqueuefreed();
    check_kickfreed();
    check_poisonclosed();
    check_orphanpoke();
    check_orphankick();
    check_stalekick();
    check_unfencedfreed();
    check_refsheld();
    check_forked();
    unreleased(check_abandonwait, "abandonwait");
    unreleased(check_closedwait, "closedwait");
    unreleased(check_uafwaiter, "uafwaiter");
    unreleased(check_confirmedfirst, "confirmedfirst");
    unreleased(check_kickmiss, "kickmiss");
    unreleased(check_idleabandon, "idleabandon");
    check_shared();
    check_handover();
    check_handsignal();
    check_closing();
    check_stress();
    check_discardkick();
    check_discarddrain();
    check_discardstress();
    unreleased(check_closekick, "closekick");
    unreleased(check_closeearly, "closeearly");
    unreleased(check_lowered, "lowered");
    unreleased(check_foreignabandon, "foreignabandon");
    /* The abandoned queues' threads have all returned (check_abandon's blocked one once
     * its sync gave up), each destroying its queue's events as it stopped. */
    int64_t deadline = now_ns() + 10000000000LL;
    for (int64_t look = 0;
         atomic_load(&events_made) != atomic_load(&events_destroyed);
         look_again(&look))
        if (now_ns() > deadline) die("released: events of abandoned queues were never destroyed");
    puts("ok released");
    return 0;
}

