/* Plays Metal's part with a real blocks runtime (clang -fblocks, libBlocksRuntime): it
 * copies a block made by asyncmetal in Python with Block_copy, keeps it, and invokes it
 * later from another thread, then releases it. */
#include <Block.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

typedef void (^completed_t)(void *command_buffer);
typedef void (^reached_t)(void *event, uint64_t value);

struct layout {  /* the Block ABI literal, to read what the runtime sees */
    void *isa; int flags; int reserved; void *invoke;
    struct { unsigned long reserved, size; const char *signature; } *descriptor;
};

static completed_t kept_completed;
static reached_t kept_reached;

const char *signature_of(void *block) { return ((struct layout *)block)->descriptor->signature; }
int flags_of(void *block) { return ((struct layout *)block)->flags; }

void *keep_completed(void *block) {
    kept_completed = Block_copy((completed_t)block);
    return (void *)kept_completed;
}

void *keep_reached(void *block) {
    kept_reached = Block_copy((reached_t)block);
    return (void *)kept_reached;
}

struct call { void *arg; uint64_t value; unsigned delay_us; };
static struct call pending;

static void *later_completed(void *unused) {
    usleep(pending.delay_us);
    kept_completed(pending.arg);
    Block_release(kept_completed);
    return NULL;
}

static void *later_reached(void *unused) {
    usleep(pending.delay_us);
    kept_reached(pending.arg, pending.value);
    Block_release(kept_reached);
    return NULL;
}

void call_completed_later(void *arg, unsigned delay_us) {
    pthread_t t;
    pending.arg = arg; pending.delay_us = delay_us;
    pthread_create(&t, NULL, later_completed, NULL);
    pthread_detach(t);
}

void call_reached_later(void *event, uint64_t value, unsigned delay_us) {
    pthread_t t;
    pending.arg = event; pending.value = value; pending.delay_us = delay_us;
    pthread_create(&t, NULL, later_reached, NULL);
    pthread_detach(t);
}

/* The Metal compiler service's part: it calls the reply block before returning. */
typedef void (^codegen_t)(int32_t error, void *data, size_t length, const char *message);

void call_codegen(void *block, int32_t error, void *data, size_t length, const char *message) {
    codegen_t kept = Block_copy((codegen_t)block);
    kept(error, data, length, message);
    Block_release(kept);
}
