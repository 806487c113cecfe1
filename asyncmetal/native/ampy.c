/* The launch path of asyncmetal's native runtime as a CPython extension module.
 *
 * Built into the same shared object as amrt.c (appended to it) when the interpreter's
 * headers are there, and imported as asyncmetal._amrt from the very file ctypes loads:
 * one library, one set of queues. It saves the launch of every command the price of a
 * ctypes call (argument conversion, a libffi call; ~1-2 us on the GPU machine's VM) and
 * the Python loop that packs the kernel's arguments: both done here, in one call.
 *
 * Each launch function takes the queue's native handle, the kernel, the asyncmetal.Arg
 * list ((handle, offset, val) tuples: a buffer where val is None, else an int32 value)
 * and the command's timeline value, and returns what the ctypes function it replaces
 * returns. spin() is the short check of a timeline between two yields of a waiter.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define AM_MAX_PARAMS 64  /* a cuda kernel's parameters (backends/cuda.py MAX_PARAMS) */

static PyObject *address_name;  /* "address": a cpu buffer's host address */

/* Arguments to 64-bit slots: a buffer's address plus its offset, or a value. */
static int pack_args(PyObject *args, int64_t *slots, Py_ssize_t most, int by_attribute) {
    if (!PyList_CheckExact(args) && !PyTuple_Check(args)) {
        PyErr_SetString(PyExc_TypeError, "args must be a list of Arg");
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(args);
    if (n > most) {
        PyErr_Format(PyExc_ValueError, "at most %zd kernel parameters", most);
        return -1;
    }
    PyObject **items = PySequence_Fast_ITEMS(args);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *arg = items[i];
        if (!PyTuple_Check(arg) || PyTuple_GET_SIZE(arg) != 3) {
            PyErr_SetString(PyExc_TypeError, "each arg must be an Arg (handle, offset, val)");
            return -1;
        }
        PyObject *val = PyTuple_GET_ITEM(arg, 2);
        if (val != Py_None) {
            slots[i] = PyLong_AsLongLong(val);
        } else {
            PyObject *handle = PyTuple_GET_ITEM(arg, 0);
            int64_t base;
            if (by_attribute) {
                PyObject *address = PyObject_GetAttr(handle, address_name);
                if (!address) return -1;
                base = (int64_t)PyLong_AsUnsignedLongLong(address);
                Py_DECREF(address);
            } else {
                base = (int64_t)PyLong_AsUnsignedLongLong(handle);
            }
            slots[i] = base + PyLong_AsLongLong(PyTuple_GET_ITEM(arg, 1));
        }
        if (PyErr_Occurred()) return -1;
    }
    return (int)n;
}

static int take_args(PyObject *const *a, Py_ssize_t n, Py_ssize_t want, const char *name) {
    if (n == want) return 0;
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", name, want, n);
    return -1;
}

/* queue_call(queue, fn, args, times_row, value) -> am_queue_call's status.
 * The cpu device: buffer handles have an .address; the queue copies the slots. */
static PyObject *py_queue_call(PyObject *self, PyObject *const *a, Py_ssize_t n) {
    (void)self;
    int64_t slots[AM_MAX_ARGS];
    if (take_args(a, n, 5, "queue_call")) return NULL;
    void *q = PyLong_AsVoidPtr(a[0]), *fn = PyLong_AsVoidPtr(a[1]);
    int64_t *row = PyLong_AsVoidPtr(a[3]);
    uint64_t value = PyLong_AsUnsignedLongLong(a[4]);
    if (PyErr_Occurred()) return NULL;
    int nargs = pack_args(a[2], slots, AM_MAX_ARGS, 1);
    if (nargs < 0) return NULL;
    return PyLong_FromLong(am_queue_call(q, fn, nargs, slots, row, value));
}

/* The launch sizes: grid = ceil(global / local) and block = local, per dimension, from
 * two 3-tuples of ints >= 1 (asyncmetal.Queue checked them), no shared memory. */
static int launch_dims(PyObject *global, PyObject *local, unsigned *dims) {
    if (!PyTuple_Check(global) || !PyTuple_Check(local) || PyTuple_GET_SIZE(global) != 3 ||
        PyTuple_GET_SIZE(local) != 3) {
        PyErr_SetString(PyExc_TypeError, "global and local sizes must be 3-tuples");
        return -1;
    }
    for (int i = 0; i < 3; i++) {
        unsigned long g = PyLong_AsUnsignedLong(PyTuple_GET_ITEM(global, i));
        unsigned long l = PyLong_AsUnsignedLong(PyTuple_GET_ITEM(local, i));
        if (PyErr_Occurred()) return -1;
        if (!g || !l || g > UINT32_MAX || l > UINT32_MAX) {
            PyErr_SetString(PyExc_ValueError, "launch sizes must be in [1, 2**32)");
            return -1;
        }
        dims[i] = (unsigned)((g + l - 1) / l);
        dims[3 + i] = (unsigned)l;
    }
    dims[6] = 0;
    return 0;
}

/* cuq_launch(queue, function, global, local, args, value) -> am_cuq_launch's CUresult.
 * Values are int32 kernel parameters (the low half of their slot). The GIL is released
 * around the driver calls: a driver thread holding a driver lock may be waiting for it
 * (a host function that runs Python, numba-cuda #317). */
static PyObject *py_cuq_launch(PyObject *self, PyObject *const *a, Py_ssize_t n) {
    (void)self;
    int64_t slots[AM_MAX_PARAMS];
    void *params[AM_MAX_PARAMS];
    unsigned dims[7];
    if (take_args(a, n, 6, "cuq_launch")) return NULL;
    void *q = PyLong_AsVoidPtr(a[0]), *fn = PyLong_AsVoidPtr(a[1]);
    uint64_t value = PyLong_AsUnsignedLongLong(a[5]);
    if (PyErr_Occurred()) return NULL;
    if (!q) {
        PyErr_SetString(PyExc_ValueError, "cuq_launch: null queue");
        return NULL;
    }
    if (launch_dims(a[2], a[3], dims)) return NULL;
    int nargs = pack_args(a[4], slots, AM_MAX_PARAMS, 0);
    if (nargs < 0) return NULL;
    for (int i = 0; i < nargs; i++) params[i] = &slots[i];
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = am_cuq_launch(q, fn, dims, params, value);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(r);
}

/* cuq_copy(queue, dst, src, src_context, nbytes, value, poll_ns) -> am_cuq_copy's
 * CUresult: a device copy (a peer copy where src_context is not None), GIL released. */
static PyObject *py_cuq_copy(PyObject *self, PyObject *const *a, Py_ssize_t n) {
    (void)self;
    if (take_args(a, n, 7, "cuq_copy")) return NULL;
    void *q = PyLong_AsVoidPtr(a[0]);
    uint64_t dst = PyLong_AsUnsignedLongLong(a[1]), src = PyLong_AsUnsignedLongLong(a[2]);
    void *src_ctx = a[3] == Py_None ? NULL : PyLong_AsVoidPtr(a[3]);
    size_t nbytes = PyLong_AsSize_t(a[4]);
    uint64_t value = PyLong_AsUnsignedLongLong(a[5]);
    long poll_ns = PyLong_AsLong(a[6]);
    if (PyErr_Occurred()) return NULL;
    if (!q) {
        PyErr_SetString(PyExc_ValueError, "cuq_copy: null queue");
        return NULL;
    }
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = am_cuq_copy(q, dst, src, src_ctx, nbytes, value, poll_ns);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(r);
}

/* spin(timeline, value, max_ns) -> bool: am_timeline_spin without the GIL. */
static PyObject *py_spin(PyObject *self, PyObject *const *a, Py_ssize_t n) {
    (void)self;
    if (take_args(a, n, 3, "spin")) return NULL;
    am_timeline *t = PyLong_AsVoidPtr(a[0]);
    uint64_t value = PyLong_AsUnsignedLongLong(a[1]);
    long max_ns = PyLong_AsLong(a[2]);
    if (PyErr_Occurred()) return NULL;
    if (!t) {
        PyErr_SetString(PyExc_ValueError, "spin: null timeline");
        return NULL;
    }
    int reached;
    Py_BEGIN_ALLOW_THREADS
    reached = am_timeline_spin(t, value, max_ns);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(reached);
}

/* The address of a runtime function, to check that ctypes loaded this same library. */
static PyObject *py_address_of(PyObject *self, PyObject *name) {
    (void)self;
    const char *s = PyUnicode_AsUTF8(name);
    if (!s) return NULL;
    if (!strcmp(s, "am_queue_call")) return PyLong_FromVoidPtr((void *)am_queue_call);
    if (!strcmp(s, "am_cuq_launch")) return PyLong_FromVoidPtr((void *)am_cuq_launch);
    if (!strcmp(s, "am_cuq_copy")) return PyLong_FromVoidPtr((void *)am_cuq_copy);
    PyErr_Format(PyExc_KeyError, "%s", s);
    return NULL;
}

static PyMethodDef methods[] = {
    {"queue_call", (PyCFunction)(void (*)(void))py_queue_call, METH_FASTCALL,
     "queue_call(queue, fn, args, times_row, value) -> status"},
    {"cuq_launch", (PyCFunction)(void (*)(void))py_cuq_launch, METH_FASTCALL,
     "cuq_launch(queue, function, global, local, args, value) -> CUresult"},
    {"cuq_copy", (PyCFunction)(void (*)(void))py_cuq_copy, METH_FASTCALL,
     "cuq_copy(queue, dst, src, src_context, nbytes, value, poll_ns) -> CUresult"},
    {"spin", (PyCFunction)(void (*)(void))py_spin, METH_FASTCALL,
     "spin(timeline, value, max_ns) -> whether the timeline reached value"},
    {"address_of", py_address_of, METH_O, "address_of(name) -> int"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "asyncmetal._amrt",
    "asyncmetal's native launch path (see native/ampy.c)", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__amrt(void) {
    address_name = PyUnicode_InternFromString("address");
    if (!address_name) return NULL;
    return PyModule_Create(&module);
}
