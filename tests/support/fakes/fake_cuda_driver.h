/* A simulated CUDA driver for the harness fake_cuda.c (its checks are there). Each fake
 * stream is a thread that runs its operations in order: kernels (a busy wait, then an
 * entry in the stream's log; one may fault, which, as on a GPU, fails every call after
 * it on that context), event records, 64-bit word writes and waits, event waits, fills
 * and copies (device memory is host memory here: fake_mem_alloc). A query
 * reports an event done once the stream ran past its latest record. Streams may share one
 * hardware queue (stream_sharing), as streams beyond a GPU's CUDA_DEVICE_MAX_CONNECTIONS
 * do: their operations run in the order they were handed over, one at a time, so a wait
 * holds up every stream behind it. A context's synchronize (fake_ctx_synchronize) waits
 * for the streams made in it, as cuCtxSynchronize does. The handles 0 and 1
 * (CU_STREAM_LEGACY) name the calling thread's current context's legacy default stream,
 * and 2 (CU_STREAM_PER_THREAD) that thread's own default stream of it, as the driver's
 * (fake_stream_of). A thread of the driver that waits for something sleeps until it
 * changes (fake_cuda_driver.c, "waiting"), as a GPU's waits take no CPU.
 */
#ifndef FAKE_CUDA_DRIVER_H
#define FAKE_CUDA_DRIVER_H

#include "cuda_stream.h"
#include <stdio.h>

#define NOT_READY 600
#define ILLEGAL_ADDRESS 700
#define INVALID_CONTEXT 201  /* CUDA_ERROR_INVALID_CONTEXT: a default stream, none current */
#define OUT_OF_MEMORY 2  /* CUDA_ERROR_OUT_OF_MEMORY: a fence refused so is tried again */


#define FAKE_RECORDS 4096  /* an event's records whose ends are told apart (a ring) */

typedef struct {
    /* Each record is a point of its own, as the driver's: a stream's wait waits for the
     * record current when it was called, however often the event is recorded again
     * (elsewhere, ending sooner) meanwhile; a query looks at the latest. `ended` holds
     * whether record n has run, at n % FAKE_RECORDS. */
    _Atomic int64_t recorded;
    _Atomic unsigned char ended[FAKE_RECORDS];
    unsigned flags;
    atomic_int waited;             /* stream waits on it inside the driver now */
    atomic_int refs;               /* its handle's (until destroyed) and one per operation
                                      on a stream that refers to it: freed at none, as
                                      the driver releases a destroyed event's resources
                                      once the work referring to it is done */
} fake_event;

enum { OP_KERNEL, OP_RECORD, OP_WRITE, OP_WAIT, OP_WAIT_EVENT, OP_FILL, OP_COPY };

typedef struct {
    int kind;
    int64_t a;          /* kernel: duration ns; record/wait event: generation; word: value;
                           fill: items; copy: its slot in the copies pending */
    void *p;            /* kernel: its spec; record/wait event: the event; word: the word;
                           fill: where (a device pointer is a host address here) */
    int64_t arg;        /* kernel: its first parameter; fill: the pattern, then its size in
                           bits 32-39 */
} op;

typedef struct fake_stream {
    pthread_t thread;
    pthread_mutex_t mu;
    op *ops;
    size_t cap, head, tail;
    atomic_int stop;
    _Atomic int64_t log[1 << 16];  /* parameters of the kernels run, in order */
    atomic_long ran;
    struct fake_stream *hw;        /* the stream whose hardware queue it shares, or NULL */
    atomic_int released;           /* its queue was closed: a driver call on it fails the
                                      check (the stream's owner may have destroyed it) */
    /* (After the log: test_timeline_order_cuda.py reads the members up to it by offset.) */
    void *ctx;                     /* the context current on the thread that made it */
    int waiting;                   /* (under mu) its thread is inside a wait operation */
    struct fake_stream *next_live; /* (under live_mu) the next stream not yet freed */
    pthread_cond_t moved;          /* (with mu) broadcast as operations come, as one leaves
                                      it, and as it is stopped */
} fake_stream;

typedef struct {
    int fault;                     /* 1: this kernel faults */
    long duration_ns;              /* how long it runs (0: a few us, by its parameter) */
    fake_stream *check;            /* else: check at run time that `check` ran ... */
    long at_least;                 /* ... at least this many kernels */
    unsigned max_threads;          /* most threads per block it takes (0: the device's),
                                      as the driver's CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK */
} kernel;

typedef struct {
    fake_stream *s;
    am_timeline *t;
    uint64_t *word;
    am_cuq *q;
} fake_queue;

void die(const char *what);
void enqueue(fake_stream *s, op o);  /* an operation on a stream, behind the others */
void stream_free(fake_stream *s, int abandon);
void stream_destroy(fake_stream *s);  /* as cuStreamDestroy: returns at once */
void streams_release(void);  /* the context released: destroyed streams' work dropped */
/* As cuCtxSynchronize: returns once every stream made with `ctx` current (destroyed ones
 * too) ran out of work it can run (fake_cuda_driver.c says what counts). */
int fake_ctx_synchronize(void *ctx);
fake_stream *stream_new(void);
/* The stream a handle names: itself, or a default stream (0, 1, 2) of the calling
 * thread's current context, made at its first use; NULL for a default stream where no
 * context is current (the driver's calls then fail with INVALID_CONTEXT). */
fake_stream *fake_stream_of(void *handle);
fake_stream *stream_sharing(fake_stream *hw);  /* runs its operations on hw's queue */
fake_queue queue_on(fake_stream *s, long bound);  /* a queue on stream s */
void fake_driver_install(void);
void fake_ctx_set_current(void *ctx);  /* the calling thread's current context */
void *fake_ctx_current(void);
fake_queue queue_new(void);
fake_queue queue_bounded(long bound);  /* at most `bound` commands in flight */
void queue_free(fake_queue f, int abandon);
int launch(fake_queue f, kernel *k, int64_t arg, uint64_t value);

extern atomic_long events_made, events_destroyed;
extern atomic_long event_queries;     /* cuEventQuery calls (the runtime's) */
extern atomic_long deep_limit;        /* >0: a launch blocks while its stream has more ops */
extern atomic_long blocked_launches;  /* launches that had to block for that */
extern atomic_int release_syncs;      /* 1: blocked syncs give up (NOT_READY) */
extern void *refuse_fn;               /* a launch of this function is refused */
/* The device's launch limits, an H200's: a block's most threads, then its most per
 * dimension (x, y, z), then a grid's most blocks per dimension. A launch beyond them, or
 * beyond its kernel's max_threads, is refused (CUDA_ERROR_INVALID_VALUE), as the driver's
 * cuLaunchKernel refuses it, and counted. */
extern const unsigned fake_launch_limits[7];
extern atomic_long oversized_launches;
extern uint64_t refuse_word;          /* a word write to it is refused */
extern atomic_int fault_code;         /* the context's sticky error once a kernel faulted */
extern void *_Atomic held;            /* an event whose queries report it unfinished */
extern fake_stream *_Atomic hold_records_on;  /* the next event recorded on it is held */
extern atomic_long wait_event_ns;     /* >0: a stream's wait on an event takes this long */
extern atomic_int waits_in_driver;    /* ... such waits inside the driver now */
extern fake_stream *_Atomic refuse_records;  /* the next event record on it is refused, */
extern atomic_int refuse_more;               /* ... and then this many more there, */
extern atomic_int refuse_code;               /* ... the first (records_refused 0) with
                                                this CUresult (0: CUDA_ERROR_INVALID_VALUE), */
extern atomic_int refuse_more_code;          /* ... those after it with this one (0: the
                                                same) */
extern atomic_int records_refused;  /* event records refused (a check sets it back to 0) */
extern atomic_int refuse_allocs;      /* >0: the runtime's next that many cuq_alloc fail */
extern void *_Atomic refuse_ctx;      /* a cuCtxSetCurrent of this context is refused */
extern void *_Atomic stream_context; /* the context every stream belongs to (cuStreamGetCtx) */
extern void *_Atomic stream_green;   /* non-NULL: the green context every stream is of */
extern atomic_int stream_context_error; /* non-zero: cuStreamGetCtx fails with it */
extern atomic_long record_ns;         /* >0: an event record takes this long */
extern atomic_int records_in_driver;  /* ... such records inside the driver now */
extern fake_stream *_Atomic record_gate_on;  /* a record on this stream stays in the driver
                                                (counted as above) until it is cleared */
extern fake_stream *_Atomic wait_gate_on;    /* a wait on an event on this stream stays
                                                in the driver (waits_in_driver) until it
                                                is cleared */
extern void (*_Atomic test_hook)(int where, am_cuq *q);  /* run at the runtime's hooks */
extern long max_inflight;             /* the queues' bound (most checks: none) */
extern const unsigned dims[7];
/* Copies (fake_cuda_driver.c says what they check): device memory, host registrations,
 * and what broke the copies' rules. */
extern atomic_long copy_ns;           /* >0: a device copy takes this long */
extern atomic_long copies_started;    /* device copies the streams began */
extern atomic_long hold_after;        /* >0: copies begun after this many are held */
extern atomic_long torn_copies;       /* copies whose source changed as the device read it */
extern atomic_long freed_busy;        /* device memory freed while a copy still used it */
extern atomic_long unregistered_busy; /* host memory unregistered while a copy used it */
void *fake_mem_alloc(size_t nbytes);
void fake_mem_free(void *p);
int fake_copy_busy(uintptr_t address, size_t nbytes);  /* a pending copy touches it */
void fake_host_register(uintptr_t address, size_t nbytes);
void fake_host_unregister(uintptr_t address);

#endif
