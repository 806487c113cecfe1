/* A producer's DLPack capsule taken in one call of asyncmetal's native extension module
 * (py_ext.h says what the module is): asyncmetal.from_dlpack's parsing, which through
 * ctypes (asyncmetal/_dlpack.py's take_capsule, the fallback without the extension)
 * reads a dozen fields one libffi call or structure access each.
 *
 * dlpack_take(capsule) -> a tuple whose first item says what it found (asyncmetal/
 * _dlpack.py raises the matching error, with the same message for both paths):
 *   (TAKEN, owner, data, nbytes, device_type, device_id)  taken: the capsule is renamed
 *        "used_dltensor[_versioned]", as the protocol says of a consumer, and `owner` (a
 *        capsule of ours) calls the producer's deleter once it is collected
 *   (NO_CAPSULE,)                    neither name, or a capsule consumed already
 *   (NEWER_VERSION, major, minor)    a versioned capsule of a major version not read here
 *   (READ_ONLY,)                     a versioned capsule flagged read-only
 *   (EMPTY,)                         no elements
 *   (NOT_CONTIGUOUS,)                strides that are not C-contiguous
 *   (MALFORMED, what)                a negative ndim or extent, a zero-sized type, no
 *                                    shape, a size past 64 bits, no data, or data
 *                                    (+ byte_offset + size) past the address space
 * Refused capsules are left as they were: their own destructor calls the deleter.
 * The structures are dlpack.h's (DLPack 1.x); data + byte_offset is the address, and
 * nbytes counts elements of fewer than 8 bits packed, or one a byte where a versioned
 * capsule flags them padded (DLPack 1.1's DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED).
 *
 * dlpack_export(...) is the other way, Buffer.__dlpack__'s capsule made in one call
 * (below): the ctypes fallback (asyncmetal/_dlpack.py's numpy_capsule) has numpy make
 * one over the memory and then edits its device, a few dozen ctypes steps.
 */
#include "py_ext.h"

enum { TAKEN, NO_CAPSULE, NEWER_VERSION, READ_ONLY, EMPTY, NOT_CONTIGUOUS, MALFORMED };
#define DLPACK_MAJOR 1       /* the major version read here */
#define FLAG_READ_ONLY 1ULL  /* DLPACK_FLAG_BITMASK_READ_ONLY */
/* DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED (1.1): elements of fewer than 8 bits are
 * one a byte, not packed (the default) */
#define FLAG_SUBBYTE_PADDED 4ULL

typedef struct { int32_t device_type, device_id; } DLDevice;
typedef struct { uint8_t code, bits; uint16_t lanes; } DLDataType;
typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides;  /* in elements; NULL: C-contiguous */
    uint64_t byte_offset;
} DLTensor;
typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *);
} DLManagedTensor;
typedef struct { uint32_t major, minor; } DLPackVersion;
typedef struct DLManagedTensorVersioned {
    DLPackVersion version;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensorVersioned *);
    uint64_t flags;
    DLTensor dl_tensor;
} DLManagedTensorVersioned;

static const char NAME[] = "dltensor", NAME_VERSIONED[] = "dltensor_versioned";
static const char USED[] = "used_dltensor", USED_VERSIONED[] = "used_dltensor_versioned";
static const char OWNER[] = "asyncmetal.dlpack_owner";

/* The owner's destructors: the producer's deleter, once, with the GIL held (numpy's
 * takes it again, which is allowed). */
static void delete_legacy(PyObject *owner) {
    DLManagedTensor *m = PyCapsule_GetPointer(owner, OWNER);
    if (m && m->deleter) m->deleter(m);
}

static void delete_versioned(PyObject *owner) {
    DLManagedTensorVersioned *m = PyCapsule_GetPointer(owner, OWNER);
    if (m && m->deleter) m->deleter(m);
}

/* Bytes of a C-contiguous tensor (its sub-byte elements one a byte where `padded`), or a
 * status (EMPTY, NOT_CONTIGUOUS, MALFORMED with *what set) as a negative number. */
static int64_t tensor_nbytes(const DLTensor *t, int padded, const char **what) {
    if (t->ndim < 0) { *what = "a negative ndim"; return -MALFORMED; }
    if (t->ndim > 0 && !t->shape) { *what = "no shape"; return -MALFORMED; }
    uint64_t bits_each = padded && t->dtype.bits && t->dtype.bits < 8 ? 8 : t->dtype.bits;
    uint64_t count = 1, itembits = bits_each * t->dtype.lanes;
    int past = 0;  /* the element count is past 64 bits (unless an extent is 0) */
    for (int32_t i = 0; i < t->ndim; i++) {
        if (t->shape[i] < 0) { *what = "a negative extent"; return -MALFORMED; }
        if (__builtin_mul_overflow(count, (uint64_t)t->shape[i], &count)) past = 1, count = 1;
        if (!t->shape[i]) return -EMPTY;
    }
    if (past) { *what = "a size past 64 bits"; return -MALFORMED; }
    if (t->strides) {
        uint64_t expected = 1;
        for (int32_t i = t->ndim - 1; i >= 0; i--) {
            if (t->shape[i] != 1 && (uint64_t)t->strides[i] != expected) return -NOT_CONTIGUOUS;
            expected *= (uint64_t)t->shape[i];  /* no overflow: count fitted */
        }
    }
    if (!itembits) { *what = "a zero-sized element type"; return -MALFORMED; }
    uint64_t bits;
    if (__builtin_mul_overflow(count, itembits, &bits) || bits > (uint64_t)INT64_MAX - 7) {
        *what = "a size past 64 bits";
        return -MALFORMED;
    }
    return (int64_t)((bits + 7) / 8);
}

static PyObject *status(int code) { return Py_BuildValue("(i)", code); }

PyObject *py_dlpack_take(PyObject *self, PyObject *capsule) {
    (void)self;
    void *managed;
    DLTensor *tensor;
    const char *used;
    PyCapsule_Destructor deleter;
    int padded = 0;  /* (a legacy capsule has no flags: packed) */
    if (PyCapsule_IsValid(capsule, NAME_VERSIONED)) {
        DLManagedTensorVersioned *m = PyCapsule_GetPointer(capsule, NAME_VERSIONED);
        if (m->version.major > DLPACK_MAJOR)
            return Py_BuildValue("(iII)", NEWER_VERSION, m->version.major, m->version.minor);
        if (m->flags & FLAG_READ_ONLY) return status(READ_ONLY);
        padded = (m->flags & FLAG_SUBBYTE_PADDED) != 0;
        managed = m, tensor = &m->dl_tensor, used = USED_VERSIONED, deleter = delete_versioned;
    } else if (PyCapsule_IsValid(capsule, NAME)) {
        DLManagedTensor *m = PyCapsule_GetPointer(capsule, NAME);
        managed = m, tensor = &m->dl_tensor, used = USED, deleter = delete_legacy;
    } else {
        return status(NO_CAPSULE);
    }
    const char *what = "";
    int64_t nbytes = tensor_nbytes(tensor, padded, &what);
    if (nbytes < 0) return nbytes == -MALFORMED ? Py_BuildValue("(is)", MALFORMED, what)
                                                : status((int)-nbytes);
    /* No memory, or memory that would end past the address space: a Buffer over it
     * would have kernels and copies write wherever the sum wrapped to. */
    uint64_t data, end;
    if (!tensor->data) return Py_BuildValue("(is)", MALFORMED, "no data");
    if (__builtin_add_overflow((uint64_t)(uintptr_t)tensor->data, tensor->byte_offset, &data) ||
        __builtin_add_overflow(data, (uint64_t)nbytes, &end) || end > UINTPTR_MAX)
        return Py_BuildValue("(is)", MALFORMED, "an address past the address space");
    /* The owner gets its destructor only once the capsule is ours: were the rename to
     * fail, the capsule's destructor would still be the one to call the deleter. */
    PyObject *owner = PyCapsule_New(managed, OWNER, NULL);
    if (!owner) return NULL;
    if (PyCapsule_SetName(capsule, used) || PyCapsule_SetDestructor(owner, deleter)) {
        Py_DECREF(owner);
        return NULL;
    }
    return Py_BuildValue("(iNKLii)", TAKEN, owner, (unsigned long long)data, (long long)nbytes,
                         (int)tensor->device.device_type, (int)tensor->device.device_id);
}

/* dlpack_export(data, byte_offset, device_type, device_id, code, bits, shape, versioned,
 *               flags, release) -> a capsule named "dltensor_versioned" (versioned)
 * or "dltensor" over a C-contiguous tensor of `shape` (a tuple of ints; its strides are
 * written out, in items, as numpy does). Its version is DLPack 1.1, its flags `flags`
 * (read-only, sub-byte elements padded: asyncmetal/_dlpack.py refuses a legacy capsule
 * that would need one before it gets here). `release` is called, with no arguments, once, when the
 * tensor is deleted: by the consumer's deleter call (on any thread) or, never consumed,
 * by the capsule's destructor. It ends the buffer's loan of its memory.
 *
 * The tensor, its shape and strides and the manager's state are one allocation; the
 * managed tensor comes first, so the capsule's pointer is also the allocation's. */
#define EXPORT_MINOR 1  /* the DLPack version the structures above are: 1.1 */

typedef struct {
    union {
        DLManagedTensorVersioned versioned;
        DLManagedTensor legacy;
    } managed;
    PyObject *release;
    int64_t extents[];  /* shape, then strides */
} Export;

#if PY_VERSION_HEX >= 0x030D0000
#define finalizing() Py_IsFinalizing()
#else
#define finalizing() _Py_IsFinalizing()
#endif

/* The deleter's work, on whatever thread the consumer lets go from. Past the
 * interpreter's end (or during it, on a thread that cannot take the GIL any more) the
 * export is left as it is: the memory's process is going. */
static void export_delete(Export *e) {
    if (!Py_IsInitialized() || (finalizing() && !PyGILState_Check())) return;
    PyGILState_STATE gil = PyGILState_Ensure();
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *raised = PyErr_GetRaisedException();  /* a destructor may run mid-raise */
#else
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
#endif
    PyObject *release = e->release, *r = PyObject_CallNoArgs(release);
    if (r) Py_DECREF(r);
    else PyErr_WriteUnraisable(release);
    Py_DECREF(release);
    PyMem_Free(e);
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(raised);
#else
    PyErr_Restore(type, value, traceback);
#endif
    PyGILState_Release(gil);
}

static void export_delete_versioned(DLManagedTensorVersioned *m) { export_delete(m->manager_ctx); }
static void export_delete_legacy(DLManagedTensor *m) { export_delete(m->manager_ctx); }

/* The capsule's destructor: a capsule still named "dltensor[_versioned]" was never
 * consumed, and deletes its tensor; a consumer renamed it and calls the deleter itself. */
static void export_capsule_destructor(PyObject *capsule) {
    if (PyCapsule_IsValid(capsule, NAME_VERSIONED)) {
        DLManagedTensorVersioned *m = PyCapsule_GetPointer(capsule, NAME_VERSIONED);
        m->deleter(m);
    } else if (PyCapsule_IsValid(capsule, NAME)) {
        DLManagedTensor *m = PyCapsule_GetPointer(capsule, NAME);
        m->deleter(m);
    }
}

PyObject *py_dlpack_export(PyObject *self, PyObject *const *a, Py_ssize_t n) {
    (void)self;
    if (take_args(n, 10, "dlpack_export")) return NULL;
    void *data = PyLong_AsVoidPtr(a[0]);
    uint64_t byte_offset = PyLong_AsUnsignedLongLong(a[1]);
    long device_type = PyLong_AsLong(a[2]), device_id = PyLong_AsLong(a[3]);
    long code = PyLong_AsLong(a[4]), bits = PyLong_AsLong(a[5]);
    PyObject *shape = a[6], *release = a[9];
    int versioned = PyObject_IsTrue(a[7]);
    uint64_t flags = PyLong_AsUnsignedLongLong(a[8]);
    if (PyErr_Occurred()) return NULL;
    if (!PyTuple_Check(shape) || !PyCallable_Check(release) || code < 0 || code > UINT8_MAX ||
        bits <= 0 || bits > UINT8_MAX || PyTuple_GET_SIZE(shape) > INT32_MAX / 2) {
        PyErr_SetString(PyExc_TypeError, "dlpack_export: a shape tuple, a callable release, "
                                         "and a type code and bits that fit a DLDataType");
        return NULL;
    }
    int32_t ndim = (int32_t)PyTuple_GET_SIZE(shape);
    Export *e = PyMem_Malloc(sizeof(Export) + 2 * (size_t)ndim * sizeof(int64_t));
    if (!e) return PyErr_NoMemory();
    int64_t *extents = ndim ? e->extents : NULL, *strides = ndim ? e->extents + ndim : NULL;
    int64_t stride = 1;
    for (int32_t i = ndim - 1; i >= 0; i--) {
        long long extent = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i));
        if (extent < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a negative extent");
            PyMem_Free(e);
            return NULL;
        }
        extents[i] = extent, strides[i] = stride;
        if (__builtin_mul_overflow(stride, (int64_t)extent, &stride)) {
            PyErr_SetString(PyExc_ValueError, "a shape of more than 2**63 items");
            PyMem_Free(e);
            return NULL;
        }
    }
    DLTensor tensor = {
        .data = data,
        .device = {(int32_t)device_type, (int32_t)device_id},
        .ndim = ndim,
        .dtype = {(uint8_t)code, (uint8_t)bits, 1},
        .shape = extents,
        .strides = strides,
        .byte_offset = byte_offset,
    };
    const char *name;
    if (versioned) {
        e->managed.versioned = (DLManagedTensorVersioned){
            .version = {DLPACK_MAJOR, EXPORT_MINOR},
            .manager_ctx = e,
            .deleter = export_delete_versioned,
            .flags = flags,
            .dl_tensor = tensor,
        };
        name = NAME_VERSIONED;
    } else {
        e->managed.legacy = (DLManagedTensor){
            .dl_tensor = tensor, .manager_ctx = e, .deleter = export_delete_legacy};
        name = NAME;
    }
    /* Until the capsule exists, its destructor cannot delete the tensor: free it here,
     * without calling release (the caller still owns the loan on failure). */
    PyObject *capsule = PyCapsule_New(&e->managed, name, export_capsule_destructor);
    if (!capsule) {
        PyMem_Free(e);
        return NULL;
    }
    e->release = Py_NewRef(release);
    return capsule;
}
