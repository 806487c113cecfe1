/* The simulated Metal's shared declarations (objc_runtime.c says what the simulation
 * is and does; each file holds one part of it):
 *   objc_runtime.c     the Objective-C runtime: selectors, objects, autorelease pools,
 *                      objc_msgSend, libdispatch queues, NSObject, NSString, NSError
 *   metal_objects.c    MTLDevice, MTLBuffer, MTLSharedEvent (and listeners), libraries,
 *                      functions and pipeline states
 *   command_buffers.c  MTLCommandQueue, MTLCommandBuffer and the "GPU" thread of a queue
 *   encoders.c         compute and blit command encoders
 *   compiler.c         the Metal compiler service
 */
#ifndef ASYNCMETAL_METAL_SIM_H
#define ASYNCMETAL_METAL_SIM_H

#define _GNU_SOURCE
#include <Block.h>
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef const char *SEL;

typedef void (*IMP)(void);

typedef struct sim_class sim_class;

#define MAGIC_LIVE 0x4d544c4fu  /* "MTLO" */
#define MAGIC_DEAD 0x5a4f4d42u  /* "ZOMB" */

typedef struct object {
    const sim_class *isa;
    uint32_t magic;
    int is_class;
    _Atomic long refs;
} object;

typedef struct { const char *name; IMP imp; } method;

struct sim_class {
    object obj;                     /* a class is an object whose isa is its metaclass */
    const char *name;
    const sim_class *super;
    const method *methods;
    size_t size;                    /* instance size */
    void (*dealloc)(object *);
    _Atomic long live;              /* instances alive */
};

typedef struct task { void (*fn)(void *); void *ctx; struct task *next; } task;

typedef struct {
    object obj;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    task *head, *tail;
    int started;
    char label[64];
} dqueue;

typedef struct { object obj; void *bytes; size_t size; } ddata;

typedef struct { object obj; char *text; } nsstring;

typedef struct { object obj; nsstring *description; } nserror;

typedef struct {
    object obj;
    char *contents;
    unsigned long length;
    int owned;                      /* contents allocated here (not a no-copy wrapper) */
} mtlbuffer;

typedef struct notification {
    object *listener;
    uint64_t value;
    void (^block)(void *event, uint64_t value);
    struct notification *next;
} notification;

typedef struct {
    object obj;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    uint64_t value;
    notification *pending;
} mtlevent;

typedef struct { object obj; dqueue *queue; } mtllistener;

typedef struct { mtlevent *event; uint64_t value; notification *n; } fired;

typedef int (*kernel_fn)(void **bindings, const unsigned *gid);

typedef struct { object obj; void *handle; } mtllibrary;

typedef struct {
    object obj;
    mtllibrary *library;
    kernel_fn fn;
    const int *params;              /* count, then each parameter's buffer index (-1: position) */
    const int *sizes;               /* each parameter's size in bytes (0: a pointer) */
    char name[128];
} mtlfunction;

typedef struct { object obj; mtlfunction *function; } mtlpipeline;

enum { CMD_WAIT, CMD_SIGNAL, CMD_DISPATCH, CMD_COPY, CMD_FILL };

#define MAX_BINDINGS 31
typedef struct command {
    int kind;
    struct command *next;
    mtlevent *event;                /* wait, signal */
    uint64_t value;
    mtlpipeline *pipeline;          /* dispatch */
    object *buffers[MAX_BINDINGS];  /* retained */
    unsigned long offsets[MAX_BINDINGS];
    void *bytes[MAX_BINDINGS];      /* setBytes: copies */
    unsigned long lengths[MAX_BINDINGS];
    unsigned long grid[3];
    mtlbuffer *src, *dst;           /* copy (fill: dst) */
    unsigned long src_offset, dst_offset, size;
    unsigned char fill_value;       /* fill */
} command;

typedef struct handler {
    void (^block)(void *);
    struct handler *next;
    void *isa;                      /* the block's first words when it was copied */
    int flags;
} handler;

typedef struct mtlqueue mtlqueue;

typedef struct mtlcmdbuf {
    object obj;
    mtlqueue *queue;
    command *commands, *last;
    object *encoder;                /* the open encoder, if any */
    handler *handlers;
    _Atomic unsigned long status;   /* MTLCommandBufferStatus */
    nserror *error;
    double start, end;
    struct mtlcmdbuf *next;         /* in its queue's committed list */
    pthread_t committer;            /* the thread that committed it */
    pthread_mutex_t lock;
    pthread_cond_t cond;
} mtlcmdbuf;

enum { STATUS_NOT_ENQUEUED, STATUS_ENQUEUED, STATUS_COMMITTED, STATUS_SCHEDULED,
       STATUS_COMPLETED, STATUS_ERROR };

typedef struct {
    object obj;
    mtlcmdbuf *cb;                  /* retained while open */
    int ended;
    command *dispatch;              /* the bindings being set */
} mtlencoder;

struct mtlqueue {
    object obj;
    object *device;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    mtlcmdbuf *head, *tail;         /* committed, not yet run */
    int thread_started;
    unsigned long max_buffers;
    unsigned long outstanding;      /* made and not yet completed */
    /* (test hook) completed command buffers whose handlers are held back, in order, while
     * hold_handlers is set (asyncmetal_sim_hold_handlers): the GPU thread goes on */
    int hold_handlers;
    mtlcmdbuf *held_head, *held_tail;
};

typedef struct {
    object obj;
    dqueue *completions;            /* where completed handlers run */
    nsstring *name;
} mtldevice;

typedef struct { mtlcmdbuf *cb; } completion;

typedef struct { unsigned long width, height, depth; } MTLSize;
typedef struct { unsigned long location, length; } NSRange;

#define M(name, fn) {name, (IMP)(fn)}

/* The classes, each defined with its method tables where its methods are. */
extern sim_class NSObject_class, NSString_class, NSError_class, MTLDevice_class,
    MTLCommandQueue_class, MTLCommandBuffer_class, MTLComputeCommandEncoder_class,
    MTLBlitCommandEncoder_class, MTLBuffer_class, MTLSharedEvent_class,
    MTLSharedEventListener_class, MTLLibrary_class, MTLFunction_class,
    MTLComputePipelineState_class, OS_dispatch_queue_class, OS_dispatch_data_class,
    NSString_meta, MTLSharedEventListener_meta;

#define CLASS(cls, super, meta_methods, methods, type, dealloc)                           \
    sim_class cls##_meta = {{NULL, MAGIC_LIVE, 1, 1}, #cls, &NSObject_class, meta_methods, \
                            0, NULL, 0};                                                  \
    sim_class cls##_class = {{&cls##_meta, MAGIC_LIVE, 1, 1}, #cls, super, methods,       \
                             sizeof(type), dealloc, 0};

#pragma GCC visibility push(hidden)
extern const method no_methods[];
void fail(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));
void *new_object(sim_class *cls);
void *retain(void *p);
void release(void *p);
void *autorelease(void *p);
void dispatch_async_f(dqueue *q, void *ctx, void (*fn)(void *));
dqueue *make_dqueue(const char *label);
void expect(const void *p, const sim_class *cls, const char *what);
nsstring *make_string(const char *text);
nserror *make_error(const char *text);
void check_block_signature(const void *block, const char *want, const char *what);
void event_set(mtlevent *e, uint64_t value);
void free_command(command *c);
void add_command(mtlcmdbuf *cb, command *c);
MTLSize max_threads_per_threadgroup(void);
#pragma GCC visibility pop

#endif
