/* asyncmetal's native extension module (asyncmetal._amrt): what its two files share.
 *
 *   py_module.c   the module, and one-call wrappers of runtime functions (a cpu kernel
 *                 call, a cuda launch or copy, a timeline's spin and acquire load); a
 *                 host buffer's address
 *   py_launch.c   Queue.launch's common case, checked and submitted in one call
 *   py_dlpack.c   a producer's DLPack capsule checked and taken in one call, and a
 *                 Buffer's capsule made in one
 *
 * Built into the same shared object as the runtime where the interpreter's headers are
 * (Python.h), and imported from the very file ctypes loads: one library, one set of
 * queues.
 *
 * The Python objects it reads are declared in asyncmetal/_native_contract.py, not here:
 * the C side names each thing it reads by a key (CONTRACT_KEYS below, in this order),
 * and set_names() hands it the attribute and method names, once, when the module loads.
 * The positional tuples it reads are listed in LAYOUT_* below; the contract module
 * checks both against its own declaration and raises if they differ.
 */
#ifndef ASYNCMETAL_PY_EXT_H
#define ASYNCMETAL_PY_EXT_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "amrt.h"

#define AM_MAX_PARAMS 64  /* a cuda kernel's parameters (the cuda backend's MAX_PARAMS) */

/* The keys of what the extension reads from Python objects, in CONTRACT_KEYS's order:
 * "Class.role"; _native_contract.py maps each to the attribute or method name. */
#define AM_CONTRACT_KEYS(X)                                                               \
    X(QUEUE_DEVICE, "Queue.device")                                                       \
    X(QUEUE_SUBMITTED, "Queue.submitted")                                                 \
    X(QUEUE_STATE, "Queue.state")                                                         \
    X(QUEUE_FAST, "Queue.fast")                                                           \
    X(STATE_CLOSED, "DeviceState.closed")                                                 \
    X(STATE_BUSY, "DeviceState.busy")                                                     \
    X(PROGRAM_DEVICE, "Program.device")                                                   \
    X(PROGRAM_BUFFER_COUNT, "Program.buffer_count")                                       \
    X(PROGRAM_VALUE_COUNT, "Program.value_count")                                         \
    X(PROGRAM_LAUNCH_LAYOUT, "Program.launch_layout")                                     \
    X(PROGRAM_NATIVE, "Program.native")                                                   \
    X(BUFFER_DEVICE, "Buffer.device")                                                     \
    X(BUFFER_ALLOCATION, "Buffer.allocation")                                             \
    X(BUFFER_OFFSET, "Buffer.offset")                                                     \
    X(ALLOCATION_FREED, "Allocation.freed")                                               \
    X(ALLOCATION_HANDLE, "Allocation.handle")                                             \
    X(ALLOCATION_LAST_USE, "Allocation.last_use")                                         \
    X(COMPLETION_RING, "Completion.ring")                                                 \
    X(COMPLETION_ROW, "Completion.row")                                                   \
    X(CPU_MEMORY_ADDRESS, "CPUMemory.address")                                            \
    X(CUDA_QUEUE_FAILED, "CUDAQueue.failed")                                              \
    X(CUDA_QUEUE_UNRESTORED, "CUDAQueue.unrestored")                                      \
    X(CPU_QUEUE_SUBMITTED, "CPUQueue.submitted")

#define AM_KEY_ENUM(name, key) N_##name,
enum { AM_CONTRACT_KEYS(AM_KEY_ENUM) AM_NAMES };

/* The interned names set_names() was given, indexed by N_*; NULL before. */
extern AM_HIDDEN PyObject *am_names[AM_NAMES];

/* Positional tuples the extension reads, field by field (checked by the contract). */
#define LAYOUT_ARG "handle", "offset", "value"
#define LAYOUT_SCALAR "bits", "type"
#define LAYOUT_LAUNCH_LAYOUT "order", "value_codes"
#define LAYOUT_CUDA_TARGET "kind", "queue", "backend_queue", "limits", "kernel_threads"
#define LAYOUT_CPU_TARGET                                                                 \
    "kind", "queue", "backend_queue", "times", "times_address", "times_kept", "keep_items"

/* py_module.c */
AM_HIDDEN int take_args(Py_ssize_t n, Py_ssize_t want, const char *name);
AM_HIDDEN int grid_dims(const uint64_t *global, const uint64_t *local, unsigned *dims);

/* py_launch.c */
AM_HIDDEN PyObject *py_setup(PyObject *self, PyObject *const *a, Py_ssize_t n);
AM_HIDDEN PyObject *py_launch(PyObject *self, PyObject *const *a, Py_ssize_t n);

/* py_dlpack.c */
AM_HIDDEN PyObject *py_dlpack_take(PyObject *self, PyObject *capsule);
AM_HIDDEN PyObject *py_dlpack_export(PyObject *self, PyObject *const *a, Py_ssize_t n);

#endif
