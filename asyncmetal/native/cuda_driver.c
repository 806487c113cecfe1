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
    "cuMemsetD32Async"};

const char *am_cuda_name(int i) { return i >= 0 && i < CU_NFUNCS ? cu_names[i] : "?"; }
void am_cuda_set(int i, void *fn) { if (i >= 0 && i < CU_NFUNCS) cu_funcs[i] = fn; }

/* Kicks: a host signal of a device timeline bumps the generation; completion threads
 * napping on a command wake at once and poll again (the device sees the word within
 * microseconds). A thread notes the generation when it starts waiting on a command, so
 * a kick between then and its nap is not lost. */
static pthread_mutex_t kick_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t kick_cv = PTHREAD_COND_INITIALIZER;
AM_HIDDEN atomic_uint kick_gen;
static atomic_int kick_sleepers;

AM_HIDDEN void host_signalled(void) {
    atomic_fetch_add(&kick_gen, 1);
    if (atomic_load(&kick_sleepers)) {
        pthread_mutex_lock(&kick_mu);
        pthread_cond_broadcast(&kick_cv);
        pthread_mutex_unlock(&kick_mu);
    }
}

/* A host signal of a device timeline (Timeline.signal): the word first, then the kick. */
void am_timeline_host_signal(am_timeline *t, uint64_t v) {
    am_timeline_signal(t, v);
    host_signalled();
}

AM_HIDDEN void deadline_after(struct timespec *ts, long ns) {
    clock_gettime(CLOCK_REALTIME, ts);
    ts->tv_sec += ns / 1000000000L;
    ts->tv_nsec += ns % 1000000000L;
    if (ts->tv_nsec >= 1000000000L) { ts->tv_sec++; ts->tv_nsec -= 1000000000L; }
}

/* Nap up to ns, or until a kick after generation `seen`: 1 if kicked. */
AM_HIDDEN int kick_nap(long ns, unsigned seen) {
    struct timespec until;
    deadline_after(&until, ns);
    pthread_mutex_lock(&kick_mu);
    atomic_fetch_add(&kick_sleepers, 1);
    int r = 0;
    while (atomic_load(&kick_gen) == seen && r != ETIMEDOUT)
        r = pthread_cond_timedwait(&kick_cv, &kick_mu, &until);
    atomic_fetch_sub(&kick_sleepers, 1);
    int kicked = atomic_load(&kick_gen) != seen;
    pthread_mutex_unlock(&kick_mu);
    return kicked;
}
