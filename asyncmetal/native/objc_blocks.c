/* Objective-C blocks whose invoke functions never take the GIL (the Metal backend's
 * completed handlers and shared-event listeners; am_block's layout is in amrt.h). They
 * only record their argument and raise a timeline, which wakes the waiting loops
 * through their pipes.
 */
#include "amrt.h"

/* The count of calls is the last thing written: once it is seen, the block may be freed
 * (release_ran), so nothing reads the block after it. */

#define MTL_COMMAND_BUFFER_STATUS_ERROR 5

/* "v16@?0@8": void (^)(id<MTLCommandBuffer>) */
void am_block_completed(am_block *b, void *arg) {
    b->arg = arg;
    if (b->status_send) {
        long status = ((long (*)(void *, void *))b->status_send)(arg, b->status_selector);
        uint64_t none = 0;
        if (status == MTL_COMMAND_BUFFER_STATUS_ERROR)
            atomic_compare_exchange_strong(&b->timeline->failed_command, &none, b->value);
    }
    uint64_t failed = atomic_load(&b->timeline->failed_command);
    if (b->copy_nbytes) memmove(b->copy_dst, b->copy_src, b->copy_nbytes);
    am_timeline_signal(b->timeline, b->value);
    if (b->then) {
        if (failed && b->value >= failed)  /* a signal its queue's failure kept from running */
            am_timeline_fail(b->then, b->then_value, AM_COMMAND_FAILED, failed, b->timeline);
        else
            am_timeline_signal(b->then, b->then_value);
    }
    atomic_fetch_add(&b->calls, 1);
}

/* "v24@?0@8Q16": void (^)(id<MTLSharedEvent>, uint64_t) */
void am_block_reached(am_block *b, void *event, uint64_t value) {
    b->arg = event;
    am_timeline_signal(b->timeline, value);
    atomic_fetch_add(&b->calls, 1);
}

/* Blocks live in C memory, with static descriptors: a block still kept by Metal when the
 * interpreter exits is never freed under it. */
typedef struct { unsigned long reserved, size; const char *signature; } am_block_descriptor;
static am_block_descriptor completed_descriptor = {0, sizeof(am_block), "v16@?0@8"};
static am_block_descriptor reached_descriptor = {0, sizeof(am_block), "v24@?0@8Q16"};

/* A block that ran is not returned to malloc but kept for the next one: Metal may still
 * hold its copy of it (Block_copy of a global block is the block itself) and
 * Block_release it later -- which reads its flags, and for a block that is not global
 * writes them. Memory that stays a global block makes that late release harmless;
 * memory handed back to malloc and reused (as anything) would be corrupted. */
static pthread_mutex_t spare_blocks_mu = PTHREAD_MUTEX_INITIALIZER;
static am_block *spare_blocks;

am_block *am_block_new(void *isa, int reached, am_timeline *timeline, uint64_t value) {
    pthread_mutex_lock(&spare_blocks_mu);
    am_block *b = spare_blocks;
    if (b) spare_blocks = b->copy_dst;
    pthread_mutex_unlock(&spare_blocks_mu);
    if (b) {
        /* Still a global block while it is cleared: its flags are rewritten unchanged. */
        b->timeline = NULL;
        b->value = 0;
        b->arg = NULL;
        atomic_store(&b->calls, 0);
        b->reserved2 = 0;
        b->copy_dst = NULL;
        b->copy_src = NULL;
        b->copy_nbytes = 0;
        b->then = NULL;
        b->then_value = 0;
        b->status_send = NULL;
        b->status_selector = NULL;
    } else {
        b = calloc(1, sizeof *b);
    }
    if (!b) return NULL;
    b->isa = isa;
    b->flags = (1 << 28) | (1 << 30);  /* BLOCK_IS_GLOBAL | BLOCK_HAS_SIGNATURE */
    b->invoke = reached ? (void *)am_block_reached : (void *)am_block_completed;
    b->descriptor = reached ? &reached_descriptor : &completed_descriptor;
    b->timeline = timeline;
    b->value = value;
    return b;
}

void am_block_free(am_block *b) {
    pthread_mutex_lock(&spare_blocks_mu);
    b->copy_dst = spare_blocks;
    spare_blocks = b;
    pthread_mutex_unlock(&spare_blocks_mu);
}
