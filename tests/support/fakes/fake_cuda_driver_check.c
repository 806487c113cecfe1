/* Checks of the simulated driver itself (fake_cuda_driver.c), through the driver table it
 * installs -- the calls the runtime makes. Prints "ok NAME" for each check that passed;
 * fails (exit 1, "FAIL what") at the first that did not.
 *
 *   defaults  the default streams by their handles, as the driver's: with no context
 *             current a call on one fails with CUDA_ERROR_INVALID_CONTEXT; 0 and 1 are
 *             one stream, the current context's legacy stream (a word written on 0
 *             behind a wait on 1 lands only once the wait is met), another context's
 *             is another; 2 is the calling thread's own (another thread's work on it is
 *             not held up by this thread's wait); cuStreamGetCtx of one gives the
 *             current context; a context's synchronize waits for its default streams.
 *   idle      (with argument "cpu": the process's CPU time checked) streams waiting on
 *             the device for words and an event nobody sets, idle streams, a launch
 *             blocked behind its stream's deep queue, a cuEventSynchronize and a
 *             cuCtxSynchronize waiting for a long kernel take less than a third of a core
 *             between them over 300 ms (spinning, they took every core there is); each
 *             returns once what it waits for comes.
 */
#include "fake_cuda_driver.h"
#include <string.h>
#include <time.h>

typedef int (*word_fn)(void *, void *, uint64_t, unsigned);
#define CALL(i, type) ((type)cu_funcs[i])

static int write_on(void *stream, _Atomic uint64_t *word, uint64_t value) {
    return CALL(CU_WRITE64, word_fn)(stream, (void *)word, value, 0);
}
static int wait_on(void *stream, _Atomic uint64_t *word, uint64_t value) {
    return CALL(CU_WAIT64, word_fn)(stream, (void *)word, value, 0);
}
static int launch_on(void *stream, kernel *k) {
    int64_t arg = 0;
    void *params[1] = {&arg};
    return CALL(CU_LAUNCH, int (*)(void *, unsigned, unsigned, unsigned, unsigned, unsigned,
                                   unsigned, unsigned, void *, void **, void **))(
        k, 1, 1, 1, 1, 1, 1, 0, stream, params, NULL);
}

/* Until *word is `value`, 10 s at most (a stream that never writes it fails the check). */
static void await_word(_Atomic uint64_t *word, uint64_t value, const char *what) {
    int64_t deadline = now_ns() + 10000000000LL;
    while (atomic_load(word) != value)
        if (now_ns() > deadline) die(what);
        else nap_ns(100000);
}

static _Atomic uint64_t words[16];

static void *per_thread_writer(void *ctx) {
    fake_ctx_set_current(ctx);
    if (write_on((void *)2, &words[4], 1)) die("defaults: a write on the per-thread stream");
    return NULL;
}

static void check_defaults(void) {
    void *ctx = (void *)0x100, *other = (void *)0x200, *got = NULL, *green = NULL;
    fake_ctx_set_current(NULL);
    for (uintptr_t handle = 0; handle <= 2; handle++) {
        if (write_on((void *)handle, &words[0], 1) != INVALID_CONTEXT)
            die("defaults: a default stream's call, no context current, not refused");
        if (CALL(CU_STREAM_GET_CTX, int (*)(void *, void **, void **))((void *)handle, &got,
                                                                       &green) !=
            INVALID_CONTEXT)
            die("defaults: cuStreamGetCtx of a default stream, no context current");
    }
    fake_ctx_set_current(ctx);
    for (uintptr_t handle = 0; handle <= 2; handle++) {
        got = green = (void *)1;
        if (CALL(CU_STREAM_GET_CTX, int (*)(void *, void **, void **))((void *)handle, &got,
                                                                       &green) ||
            got != ctx || green)
            die("defaults: cuStreamGetCtx of a default stream is not the current context");
    }
    /* 0 and 1: one stream */
    if (wait_on((void *)1, &words[1], 1) || write_on(NULL, &words[2], 1))
        die("defaults: a call on the legacy stream");
    /* another context's legacy stream: another stream */
    fake_ctx_set_current(other);
    if (write_on((void *)1, &words[3], 1)) die("defaults: a call on another legacy stream");
    await_word(&words[3], 1, "defaults: another context's legacy stream was held up");
    fake_ctx_set_current(ctx);
    /* 2: this thread's own */
    if (wait_on((void *)2, &words[5], 1) || write_on((void *)2, &words[6], 1))
        die("defaults: a call on the per-thread stream");
    pthread_t t;
    pthread_create(&t, NULL, per_thread_writer, ctx);
    pthread_join(t, NULL);
    await_word(&words[4], 1, "defaults: another thread's per-thread stream was held up");
    nap_ns(20000000);  /* (what was held up would have had time to run by now) */
    if (atomic_load(&words[2]) || atomic_load(&words[6]))
        die("defaults: a default stream ran a write before the wait in front of it");
    /* the context's synchronize: a default stream inside a wait nothing met counts as
     * run out; once met, it waits for the work behind it */
    if (fake_ctx_synchronize(ctx)) die("defaults: cuCtxSynchronize failed");
    atomic_store(&words[1], 1);
    atomic_store(&words[5], 1);
    if (fake_ctx_synchronize(ctx)) die("defaults: cuCtxSynchronize failed");
    if (atomic_load(&words[2]) != 1 || atomic_load(&words[6]) != 1)
        die("defaults: cuCtxSynchronize returned before a default stream's work ran");
    fake_ctx_set_current(NULL);
    puts("ok defaults");
}

static int64_t cpu_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static atomic_int synced;
static void *event_sync(void *e) {
    if (CALL(CU_EVENT_SYNC, int (*)(void *))(e)) die("idle: cuEventSynchronize failed");
    atomic_store(&synced, 1);
    return NULL;
}
static fake_stream *deep;
static kernel quick;
static atomic_int launched;
static void *blocked_launch(void *arg) {
    (void)arg;
    if (launch_on(deep, &quick)) die("idle: a blocked launch failed");
    atomic_store(&launched, 1);
    return NULL;
}
static atomic_int ctx_synced;
static void *ctx_sync(void *ctx) {
    if (fake_ctx_synchronize(ctx)) die("idle: cuCtxSynchronize failed");
    atomic_store(&ctx_synced, 1);
    return NULL;
}

static void check_idle(int cpu) {
    void *ctx = (void *)0x300;
    fake_ctx_set_current(ctx);
    fake_stream *waiting[3], *idle[3];
    for (int i = 0; i < 3; i++) idle[i] = stream_new();
    for (int i = 0; i < 3; i++) waiting[i] = stream_new();
    _Atomic uint64_t *gate = &words[8], *done = &words[9];
    if (wait_on(waiting[0], gate, 1) || wait_on(waiting[1], gate, 1)) die("idle: a wait");
    /* waiting[2] waits for an event recorded behind waiting[1]'s wait */
    void *ended = NULL;
    if (CALL(CU_EVENT_CREATE, int (*)(void **, unsigned))(&ended, 0x1) ||
        CALL(CU_EVENT_RECORD, int (*)(void *, void *))(ended, waiting[1]) ||
        CALL(CU_WAIT_EVENT, int (*)(void *, void *, unsigned))(waiting[2], ended, 0) ||
        write_on(waiting[2], done, 1))
        die("idle: an event");
    pthread_t sync_thread, launch_thread, ctx_thread;
    pthread_create(&sync_thread, NULL, event_sync, ended);
    /* a launch blocked behind its stream's queue: deeper than deep_limit */
    deep = waiting[0];
    for (int i = 0; i < 3; i++)
        if (launch_on(deep, &quick)) die("idle: a launch");
    atomic_store(&deep_limit, 2);
    pthread_create(&launch_thread, NULL, blocked_launch, NULL);
    /* a context's synchronize waiting for a kernel of 300 ms (naps: takes no CPU) */
    static kernel slow = {0, 300000000, NULL, 0, 0};
    void *other = (void *)0x400;
    fake_ctx_set_current(other);
    fake_stream *running = stream_new();
    if (launch_on(running, &slow)) die("idle: a long launch");
    pthread_create(&ctx_thread, NULL, ctx_sync, other);
    nap_ns(20000000);  /* (everything in its wait) */
    int64_t wall = now_ns(), used = cpu_ns();
    nap_ns(300000000);
    wall = now_ns() - wall;
    used = cpu_ns() - used;
    if (atomic_load(&synced) || atomic_load(&launched) || atomic_load(done))
        die("idle: a wait returned before what it waited for came");
    fprintf(stderr, "idle: %lld us of CPU in %lld ms\n", (long long)(used / 1000),
            (long long)(wall / 1000000));
    if (cpu && used > wall / 3) die("idle: the driver's waits took the CPU");
    atomic_store(gate, 1);  /* (a host store: no wake-up, seen on a waiter's own look) */
    pthread_join(sync_thread, NULL);
    pthread_join(launch_thread, NULL);
    pthread_join(ctx_thread, NULL);
    await_word(done, 1, "idle: a stream's wait on an event never ended");
    atomic_store(&deep_limit, 0);
    if (fake_ctx_synchronize(ctx) || fake_ctx_synchronize(other))
        die("idle: cuCtxSynchronize failed");
    for (int i = 0; i < 3; i++) {
        stream_free(idle[i], 0);
        stream_free(waiting[i], 0);
    }
    stream_free(running, 0);
    CALL(CU_EVENT_DESTROY, int (*)(void *))(ended);
    fake_ctx_set_current(NULL);
    puts("ok idle");
}

int main(int argc, char **argv) {
    fake_driver_install();
    check_defaults();
    check_idle(argc > 1 && !strcmp(argv[1], "cpu"));
    return 0;
}
