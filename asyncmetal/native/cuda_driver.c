/* The CUDA driver's functions, set once from Python (cuGetProcAddress through
 * cuda-bindings), and the kicks: a host signal of a device timeline wakes the
 * completion threads napping on a command at once.
 */
#include "cuda_stream.h"

AM_HIDDEN void *cu_funcs[CU_NFUNCS];
static const char *cu_names[CU_NFUNCS] = {
    "cuLaunchKernel", "cuStreamWriteValue64", "cuStreamWaitValue64", "cuEventCreate",
    "cuEventRecord", "cuEventQuery", "cuEventSynchronize", "cuEventDestroy", "cuCtxSetCurrent",
    "cuStreamWaitEvent", "cuCtxGetCurrent", "cuMemcpyDtoDAsync", "cuMemcpyPeerAsync",
    "cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync", "cuMemsetD8Async", "cuMemsetD16Async",
    "cuMemsetD32Async", "cuStreamGetCtx"};

const char *am_cuda_name(int i) { return i >= 0 && i < CU_NFUNCS ? cu_names[i] : "?"; }
void am_cuda_set(int i, void *fn) { if (i >= 0 && i < CU_NFUNCS) cu_funcs[i] = fn; }

/* Restores of a thread's context the driver refused (amrt.h): the thread's note (the
 * CUresult in am_cu_unrestored, the rest here) and the number of threads holding one. */
AM_HIDDEN _Thread_local int am_cu_unrestored;
static _Thread_local void *unrestored_before, *unrestored_now;
static _Thread_local int unrestored_now_unknown;
static atomic_int unrestored_notes;

AM_HIDDEN void cu_restore(void *before) {
    int r = ((int (*)(void *))cu_funcs[CU_CTX_SET])(before);
    if (!r) return;
    void *now = NULL;
    int unknown = ((int (*)(void **))cu_funcs[CU_CTX_GET])(&now) != 0;
    if (!am_cu_unrestored) atomic_fetch_add(&unrestored_notes, 1);
    am_cu_unrestored = r;  /* the latest: the outermost restore comes last */
    unrestored_before = before;
    unrestored_now = now;
    unrestored_now_unknown = unknown;
}

int am_cuda_unrestored(void **before, void **now, int *now_unknown) {
    int r = am_cu_unrestored;
    if (!r) return 0;
    *before = unrestored_before;
    *now = unrestored_now;
    *now_unknown = unrestored_now_unknown;
    am_cu_unrestored = 0;
    atomic_fetch_sub(&unrestored_notes, 1);
    return r;
}

const int *am_cuda_unrestored_notes(void) { return (const int *)&unrestored_notes; }

/* Kicks: a host signal of a device timeline bumps the generation; completion threads
 * napping on a command wake at once and poll again (the device sees the word within
 * microseconds). A thread notes the generation when it starts waiting on a command, so
 * a kick between then and its nap is not lost. */
static pthread_mutex_t kick_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t kick_cv;  /* timed (am_cond_init), as the runtime loads */
AM_HIDDEN atomic_uint kick_gen;
static atomic_int kick_sleepers;

__attribute__((constructor)) static void kick_cv_init(void) { am_cond_init(&kick_cv); }

AM_HIDDEN void host_signalled(void) {
    atomic_fetch_add(&kick_gen, 1);
    if (atomic_load(&kick_sleepers)) {
        pthread_mutex_lock(&kick_mu);
        pthread_cond_broadcast(&kick_cv);
        pthread_mutex_unlock(&kick_mu);
    }
}

/* A host signal of a device timeline (Timeline.signal): the word first, then the kick.
 * `here`: as am_timeline_signal_here's (NULL: every loop waiting is written to). */
void am_timeline_host_signal(am_timeline *t, uint64_t v, am_notifier *here) {
    am_timeline_signal_here(t, v, here);
    host_signalled();
}

/* Nap up to ns, or until a kick after generation `seen`: 1 if kicked. */
AM_HIDDEN int kick_nap(long ns, unsigned seen) {
    struct timespec until;
    deadline_after(&until, ns);
    pthread_mutex_lock(&kick_mu);
    atomic_fetch_add(&kick_sleepers, 1);
    int r = 0;
    while (atomic_load(&kick_gen) == seen && r != ETIMEDOUT)
        r = am_cond_timedwait(&kick_cv, &kick_mu, &until);
    atomic_fetch_sub(&kick_sleepers, 1);
    int kicked = atomic_load(&kick_gen) != seen;
    pthread_mutex_unlock(&kick_mu);
    return kicked;
}
