/* The simulated Metal's compute and blit command encoders (sim.h lists the files). */
#include "sim.h"

/* ---------------------------------------------------------------- encoders ------ */

static mtlencoder *open_encoder(mtlencoder *e, const char *what) {
    if (e->ended) fail("%s on an encoder after endEncoding", what);
    return e;
}

static command *dispatch_state(mtlencoder *e) {
    if (!e->dispatch) e->dispatch = calloc(1, sizeof(command));
    return e->dispatch;
}

static void Compute_setPipeline(mtlencoder *self, SEL s, mtlpipeline *pipeline) {
    (void)s;
    open_encoder(self, "setComputePipelineState:");
    expect(pipeline, &MTLComputePipelineState_class, "setComputePipelineState:");
    command *c = dispatch_state(self);
    retain(pipeline);
    release(c->pipeline);
    c->pipeline = pipeline;
}

static void Compute_setBuffer(mtlencoder *self, SEL s, mtlbuffer *buffer, unsigned long offset,
                              unsigned long index) {
    (void)s;
    open_encoder(self, "setBuffer:offset:atIndex:");
    if (index >= MAX_BINDINGS) fail("setBuffer:offset:atIndex: index %lu out of range", index);
    expect(buffer, &MTLBuffer_class, "setBuffer:offset:atIndex:");
    if (offset > buffer->length)
        fail("setBuffer:offset:atIndex: offset %lu past a buffer of %lu bytes", offset,
             buffer->length);
    command *c = dispatch_state(self);
    retain(buffer);
    release(c->buffers[index]);
    free(c->bytes[index]);
    c->bytes[index] = NULL;
    c->buffers[index] = &buffer->obj;
    c->offsets[index] = offset;
}

static void Compute_setBytes(mtlencoder *self, SEL s, const void *bytes, unsigned long length,
                             unsigned long index) {
    (void)s;
    open_encoder(self, "setBytes:length:atIndex:");
    if (index >= MAX_BINDINGS) fail("setBytes:length:atIndex: index %lu out of range", index);
    if (length == 0 || length > 4096) fail("setBytes:length:atIndex: length %lu", length);
    command *c = dispatch_state(self);
    release(c->buffers[index]);
    c->buffers[index] = NULL;
    free(c->bytes[index]);
    c->bytes[index] = malloc(length);
    memcpy(c->bytes[index], bytes, length);  /* Metal copies the bytes at this call */
    c->lengths[index] = length;
}

static void encode_dispatch(mtlencoder *self, MTLSize grid, MTLSize group, const char *what) {
    open_encoder(self, what);
    command *state = dispatch_state(self);
    if (!state->pipeline) fail("%s without a compute pipeline state", what);
    MTLSize most = max_threads_per_threadgroup();
    if (!group.width || !group.height || !group.depth ||
        group.width * group.height * group.depth > 1024 || group.width > most.width ||
        group.height > most.height || group.depth > most.depth)
        fail("%s: threads per threadgroup %lux%lux%lu", what, group.width, group.height,
             group.depth);
    const mtlfunction *function = state->pipeline->function;
    const int *params = function->params;
    for (int i = 1; i <= params[0]; i++) {
        int index = params[i];
        if (index >= 0 && !state->buffers[index] && !state->bytes[index])
            fail("%s: kernel %s's argument at buffer(%d) is not bound", what, function->name,
                 index);
        /* Metal's validation: the bytes set must cover the argument's type (fewer would
         * have the kernel read past them). */
        int size = function->sizes[i - 1];
        if (index >= 0 && state->bytes[index] && size > 0 &&
            state->lengths[index] < (unsigned long)size)
            fail("%s: kernel %s's argument at buffer(%d) takes %d bytes, setBytes gave %lu",
                 what, function->name, index, size, state->lengths[index]);
    }
    /* The command takes the bindings as they are now; later set* calls change only the
     * encoder's state for the next dispatch (as in Metal). */
    command *c = calloc(1, sizeof *c);
    c->kind = CMD_DISPATCH;
    c->pipeline = retain(state->pipeline);
    for (int i = 0; i < MAX_BINDINGS; i++) {
        c->buffers[i] = retain(state->buffers[i]);
        c->offsets[i] = state->offsets[i];
        if (state->bytes[i]) {
            c->bytes[i] = malloc(state->lengths[i]);
            memcpy(c->bytes[i], state->bytes[i], state->lengths[i]);
            c->lengths[i] = state->lengths[i];
        }
    }
    c->grid[0] = grid.width;
    c->grid[1] = grid.height;
    c->grid[2] = grid.depth;
    add_command(self->cb, c);
}

static void Compute_dispatchThreads(mtlencoder *self, SEL s, MTLSize grid, MTLSize group) {
    (void)s;
    encode_dispatch(self, grid, group, "dispatchThreads:threadsPerThreadgroup:");
}

static void Compute_dispatchThreadgroups(mtlencoder *self, SEL s, MTLSize groups,
                                         MTLSize group) {
    (void)s;
    MTLSize grid = {groups.width * group.width, groups.height * group.height,
                    groups.depth * group.depth};
    encode_dispatch(self, grid, group, "dispatchThreadgroups:threadsPerThreadgroup:");
}

static void Encoder_endEncoding(mtlencoder *self, SEL s) {
    (void)s;
    open_encoder(self, "endEncoding");
    self->ended = 1;
    self->cb->encoder = NULL;
}

static void mtlencoder_dealloc(object *o) {
    mtlencoder *e = (mtlencoder *)o;
    if (!e->ended) fail("an encoder was deallocated without endEncoding");
    if (e->dispatch) free_command(e->dispatch);
    release(e->cb);
}

static void Blit_copy(mtlencoder *self, SEL s, mtlbuffer *src, unsigned long src_offset,
                      mtlbuffer *dst, unsigned long dst_offset, unsigned long size) {
    (void)s;
    const char *what = "copyFromBuffer:sourceOffset:toBuffer:destinationOffset:size:";
    open_encoder(self, what);
    expect(src, &MTLBuffer_class, what);
    expect(dst, &MTLBuffer_class, what);
    if (src_offset > src->length || size > src->length - src_offset)
        fail("%s: source range %lu+%lu out of a buffer of %lu bytes", what, src_offset, size,
             src->length);
    if (dst_offset > dst->length || size > dst->length - dst_offset)
        fail("%s: destination range %lu+%lu out of a buffer of %lu bytes", what, dst_offset,
             size, dst->length);
    command *c = calloc(1, sizeof *c);
    c->kind = CMD_COPY;
    c->src = retain(src);
    c->dst = retain(dst);
    c->src_offset = src_offset;
    c->dst_offset = dst_offset;
    c->size = size;
    add_command(self->cb, c);
}

/* As on macOS: a range of whole 4-byte words (iOS takes any), at least one, within the
 * buffer; the value is one byte. */
static void Blit_fill(mtlencoder *self, SEL s, mtlbuffer *buffer, NSRange range,
                      unsigned char value) {
    (void)s;
    const char *what = "fillBuffer:range:value:";
    open_encoder(self, what);
    expect(buffer, &MTLBuffer_class, what);
    if (range.length == 0 || range.location % 4 || range.length % 4)
        fail("%s: range %lu+%lu is not of whole 4-byte words (at least one)", what,
             range.location, range.length);
    if (range.location > buffer->length || range.length > buffer->length - range.location)
        fail("%s: range %lu+%lu out of a buffer of %lu bytes", what, range.location,
             range.length, buffer->length);
    command *c = calloc(1, sizeof *c);
    c->kind = CMD_FILL;
    c->dst = retain(buffer);
    c->dst_offset = range.location;
    c->size = range.length;
    c->fill_value = value;
    add_command(self->cb, c);
}

/* ---------------------------------------------------------------- classes ------ */

static const method MTLComputeCommandEncoder_methods[] = {
    M("setComputePipelineState:", Compute_setPipeline),
    M("setBuffer:offset:atIndex:", Compute_setBuffer),
    M("setBytes:length:atIndex:", Compute_setBytes),
    M("dispatchThreads:threadsPerThreadgroup:", Compute_dispatchThreads),
    M("dispatchThreadgroups:threadsPerThreadgroup:", Compute_dispatchThreadgroups),
    M("endEncoding", Encoder_endEncoding),
    {0, 0}};
CLASS(MTLComputeCommandEncoder, &NSObject_class, no_methods, MTLComputeCommandEncoder_methods,
      mtlencoder, mtlencoder_dealloc)
static const method MTLBlitCommandEncoder_methods[] = {
    M("copyFromBuffer:sourceOffset:toBuffer:destinationOffset:size:", Blit_copy),
    M("fillBuffer:range:value:", Blit_fill),
    M("endEncoding", Encoder_endEncoding),
    {0, 0}};
CLASS(MTLBlitCommandEncoder, &NSObject_class, no_methods, MTLBlitCommandEncoder_methods,
      mtlencoder, mtlencoder_dealloc)
