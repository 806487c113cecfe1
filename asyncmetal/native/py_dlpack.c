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
 *                                    shape, or a size past 64 bits
 * Refused capsules are left as they were: their own destructor calls the deleter.
 * The structures are dlpack.h's (DLPack 1.x); data + byte_offset is the address.
 */
#include "py_ext.h"

enum { TAKEN, NO_CAPSULE, NEWER_VERSION, READ_ONLY, EMPTY, NOT_CONTIGUOUS, MALFORMED };
#define DLPACK_MAJOR 1       /* the major version read here */
#define FLAG_READ_ONLY 1ULL  /* DLPACK_FLAG_BITMASK_READ_ONLY */

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

/* Bytes of a C-contiguous tensor, or a status (EMPTY, NOT_CONTIGUOUS, MALFORMED with
 * *what set) as a negative number. */
static int64_t tensor_nbytes(const DLTensor *t, const char **what) {
    if (t->ndim < 0) { *what = "a negative ndim"; return -MALFORMED; }
    if (t->ndim > 0 && !t->shape) { *what = "no shape"; return -MALFORMED; }
    uint64_t count = 1, itembits = (uint64_t)t->dtype.bits * t->dtype.lanes;
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
    if (PyCapsule_IsValid(capsule, NAME_VERSIONED)) {
        DLManagedTensorVersioned *m = PyCapsule_GetPointer(capsule, NAME_VERSIONED);
        if (m->version.major > DLPACK_MAJOR)
            return Py_BuildValue("(iII)", NEWER_VERSION, m->version.major, m->version.minor);
        if (m->flags & FLAG_READ_ONLY) return status(READ_ONLY);
        managed = m, tensor = &m->dl_tensor, used = USED_VERSIONED, deleter = delete_versioned;
    } else if (PyCapsule_IsValid(capsule, NAME)) {
        DLManagedTensor *m = PyCapsule_GetPointer(capsule, NAME);
        managed = m, tensor = &m->dl_tensor, used = USED, deleter = delete_legacy;
    } else {
        return status(NO_CAPSULE);
    }
    const char *what = "";
    int64_t nbytes = tensor_nbytes(tensor, &what);
    if (nbytes < 0) return nbytes == -MALFORMED ? Py_BuildValue("(is)", MALFORMED, what)
                                                : status((int)-nbytes);
    uint64_t data = (uint64_t)(uintptr_t)tensor->data + tensor->byte_offset;
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
