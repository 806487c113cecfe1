/* asyncmetal's native extension module (asyncmetal._amrt; py_ext.h says what it is):
 * the module, the names it reads objects by, and one-call wrappers of runtime functions.
 *
 * Each wrapper takes the native handles as ints and does what the ctypes call it
 * replaces does, without ctypes' argument conversion and libffi call (~1-2 us on the GPU
 * machine's VM), packing a kernel's arguments (a list of asyncmetal.Arg: a buffer
 * handle plus offset, an int32 value, or a Scalar: another type's bits) itself.
 */
#include "py_ext.h"

#define AM_KEY_STRING(name, key) key,
static const char *const contract_keys[AM_NAMES] = {AM_CONTRACT_KEYS(AM_KEY_STRING)};
AM_HIDDEN PyObject *am_names[AM_NAMES];

/* set_names(names): the attribute and method names, one per CONTRACT_KEYS entry, in its
 * order (asyncmetal/_native_contract.py builds the tuple from its declaration). */
static PyObject *py_set_names(PyObject *self, PyObject *names) {
    (void)self;
    if (!PyTuple_CheckExact(names) || PyTuple_GET_SIZE(names) != AM_NAMES) {
        PyErr_Format(PyExc_TypeError, "set_names takes a tuple of %d names", (int)AM_NAMES);
        return NULL;
    }
    for (int i = 0; i < AM_NAMES; i++) {
        PyObject *name = PyTuple_GET_ITEM(names, i);
        if (!PyUnicode_CheckExact(name)) {
            PyErr_Format(PyExc_TypeError, "the name for %s is not a str", contract_keys[i]);
            return NULL;
        }
    }
    for (int i = 0; i < AM_NAMES; i++) {
        PyObject *name = PyTuple_GET_ITEM(names, i);
        Py_INCREF(name);
        PyUnicode_InternInPlace(&name);
        Py_XSETREF(am_names[i], name);
    }
    Py_RETURN_NONE;
}

/* Arguments to 64-bit slots: a buffer's address plus its offset, or a value (an int32,
 * or a Scalar's bits). *floats (where not NULL) gets bit i set where argument i is a
 * floating-point Scalar (its type's name starts with "f"). */
static int pack_args(PyObject *args, int64_t *slots, Py_ssize_t most, int by_attribute,
                     uint32_t *floats) {
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
        if (val != Py_None && !PyLong_Check(val)) {  /* a Scalar: (bits, type) */
            PyObject *type = PyTuple_Check(val) && PyTuple_GET_SIZE(val) == 2
                                 ? PyTuple_GET_ITEM(val, 1) : NULL;
            if (!type || !PyUnicode_Check(type) || !PyUnicode_GET_LENGTH(type)) {
                PyErr_SetString(PyExc_TypeError, "each value must be an int or a Scalar");
                return -1;
            }
            slots[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(val, 0));
            if (floats && PyUnicode_READ_CHAR(type, 0) == 'f') *floats |= (uint32_t)1 << i;
        } else if (val != Py_None) {
            slots[i] = PyLong_AsLongLong(val);
        } else {
            PyObject *handle = PyTuple_GET_ITEM(arg, 0);
            int64_t base;
            if (by_attribute) {
                PyObject *address_name = am_names[N_CPU_MEMORY_ADDRESS];
                if (!address_name) {
                    PyErr_SetString(PyExc_RuntimeError, "set_names() was not called");
                    return -1;
                }
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

int take_args(Py_ssize_t n, Py_ssize_t want, const char *name) {
    if (n == want) return 0;
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", name, want, n);
    return -1;
}

/* 0, or -1 with an error set: a conversion failed, or the native handle is NULL. */
static int converted(const void *handle, const char *null_message) {
    if (PyErr_Occurred()) return -1;
    if (handle) return 0;
    PyErr_SetString(PyExc_ValueError, null_message);
    return -1;
}

/* queue_call(queue, fn, args, times_row, value) -> am_queue_call's status.
 * The cpu device: buffer handles have an .address; the queue copies the slots. */
static PyObject *py_queue_call(PyObject *self, PyObject *const *a, Py_ssize_t n) {
    (void)self;
    int64_t slots[AM_MAX_ARGS];
    uint32_t floats = 0;
    if (take_args(n, 5, "queue_call")) return NULL;
    void *q = PyLong_AsVoidPtr(a[0]), *fn = PyLong_AsVoidPtr(a[1]);
    int64_t *row = PyLong_AsVoidPtr(a[3]);
    uint64_t value = PyLong_AsUnsignedLongLong(a[4]);
    if (PyErr_Occurred()) return NULL;
    int nargs = pack_args(a[2], slots, AM_MAX_ARGS, 1, &floats);
    if (nargs < 0) return NULL;
    return PyLong_FromLong(am_queue_call(q, fn, nargs, slots, floats, row, value));
}

/* grid = ceil(global / local) and block = local per dimension, no shared memory; 1 if
 * a size is outside [1, 2**32). In 64 bits: global + local - 1 reaches 2**33 - 3 (an
 * unsigned long, 32 bits on LLP64 Windows, would wrap to a grid of 0). */
int grid_dims(const uint64_t *global, const uint64_t *local, unsigned *dims) {
    for (int i = 0; i < 3; i++) {
        uint64_t g = global[i], l = local[i];
        if (!g || !l || g > UINT32_MAX || l > UINT32_MAX) return 1;
        dims[i] = (unsigned)((g + l - 1) / l);
        dims[3 + i] = (unsigned)l;
    }
    dims[6] = 0;
    return 0;
}

/* A launch size: an int as it is, or 0 (refused by grid_dims, as 0 is) for one below 0
 * or beyond 64 bits, which a conversion would refuse with an OverflowError instead of
 * the ValueError naming the range; 0 with an error set for what is no int. */
static uint64_t launch_size(PyObject *size) {
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(size, &overflow);
    return overflow || v < 0 ? 0 : (uint64_t)v;
}

/* The launch sizes from two 3-tuples of ints >= 1 (asyncmetal.Queue checked them). */
static int launch_dims(PyObject *global, PyObject *local, unsigned *dims) {
    if (!PyTuple_Check(global) || !PyTuple_Check(local) || PyTuple_GET_SIZE(global) != 3 ||
        PyTuple_GET_SIZE(local) != 3) {
        PyErr_SetString(PyExc_TypeError, "global and local sizes must be 3-tuples");
        return -1;
    }
    uint64_t g[3], l[3];
    for (int i = 0; i < 3; i++) {
        g[i] = launch_size(PyTuple_GET_ITEM(global, i));
        l[i] = launch_size(PyTuple_GET_ITEM(local, i));
        if (PyErr_Occurred()) return -1;
    }
    if (grid_dims(g, l, dims)) {
        PyErr_SetString(PyExc_ValueError, "launch sizes must be in [1, 2**32)");
        return -1;
    }
    return 0;
}

/* cuq_launch(queue, function, global, local, args, value) -> am_cuq_launch's CUresult.
 * Each parameter's pointer is its 8-byte (so 8-aligned) slot, the value in its low bytes:
 * the driver copies as many as the kernel's parameter takes. The GIL is released
 * around the driver calls: a driver thread holding a driver lock may be waiting for it
 * (a host function that runs Python, numba-cuda #317). */
static PyObject *py_cuq_launch(PyObject *self, PyObject *const *a, Py_ssize_t n) {
    (void)self;
    int64_t slots[AM_MAX_PARAMS];
    void *params[AM_MAX_PARAMS];
    unsigned dims[7];
    if (take_args(n, 6, "cuq_launch")) return NULL;
    void *q = PyLong_AsVoidPtr(a[0]), *fn = PyLong_AsVoidPtr(a[1]);
    uint64_t value = PyLong_AsUnsignedLongLong(a[5]);
    if (converted(q, "cuq_launch: null queue")) return NULL;
    if (launch_dims(a[2], a[3], dims)) return NULL;
    int nargs = pack_args(a[4], slots, AM_MAX_PARAMS, 0, NULL);
    if (nargs < 0) return NULL;
    for (int i = 0; i < nargs; i++) params[i] = &slots[i];
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = am_cuq_launch(q, fn, dims, params, nargs, value);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(r);
}

/* cuq_copy(queue, dst, src, src_context, nbytes, value, poll_ns) -> am_cuq_copy's
 * CUresult: a device copy (a peer copy where src_context is not None), GIL released. */
static PyObject *py_cuq_copy(PyObject *self, PyObject *const *a, Py_ssize_t n) {
    (void)self;
    if (take_args(n, 7, "cuq_copy")) return NULL;
    void *q = PyLong_AsVoidPtr(a[0]);
    uint64_t dst = PyLong_AsUnsignedLongLong(a[1]), src = PyLong_AsUnsignedLongLong(a[2]);
    void *src_ctx = a[3] == Py_None ? NULL : PyLong_AsVoidPtr(a[3]);
    size_t nbytes = PyLong_AsSize_t(a[4]);
    uint64_t value = PyLong_AsUnsignedLongLong(a[5]);
    long poll_ns = PyLong_AsLong(a[6]);
    if (converted(q, "cuq_copy: null queue")) return NULL;
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = am_cuq_copy(q, dst, src, src_ctx, nbytes, value, poll_ns);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(r);
}

/* cuq_wait_stream(queue, context, stream, value, poll_ns, flags) -> (CUresult, call):
 * am_cuq_wait_stream_end (call: the driver call that failed). */
static PyObject *py_cuq_wait_stream(PyObject *self, PyObject *const *a, Py_ssize_t n) {
    (void)self;
    if (take_args(n, 6, "cuq_wait_stream")) return NULL;
    void *q = PyLong_AsVoidPtr(a[0]), *ctx = PyLong_AsVoidPtr(a[1]);
    void *stream = PyLong_AsVoidPtr(a[2]);
    uint64_t value = PyLong_AsUnsignedLongLong(a[3]);
    long poll_ns = PyLong_AsLong(a[4]);
    int flags = (int)PyLong_AsLong(a[5]);
    if (converted(q, "cuq_wait_stream: null queue")) return NULL;
    int r, call = 0;
    Py_BEGIN_ALLOW_THREADS
    r = am_cuq_wait_stream_end(q, ctx, stream, value, poll_ns, flags, &call);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(ii)", r, call);
}

/* spin(timeline, value, max_ns) -> bool: am_timeline_spin without the GIL. */
static PyObject *py_spin(PyObject *self, PyObject *const *a, Py_ssize_t n) {
    (void)self;
    if (take_args(n, 3, "spin")) return NULL;
    am_timeline *t = PyLong_AsVoidPtr(a[0]);
    uint64_t value = PyLong_AsUnsignedLongLong(a[1]);
    long max_ns = PyLong_AsLong(a[2]);
    if (converted(t, "spin: null timeline")) return NULL;
    int reached;
    Py_BEGIN_ALLOW_THREADS
    reached = am_timeline_spin(t, value, max_ns);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(reached);
}

/* due(timeline, value) -> int: am_timeline_due (a time.perf_counter_ns(), 0: unknown). */
static PyObject *py_due(PyObject *self, PyObject *const *a, Py_ssize_t n) {
    (void)self;
    if (take_args(n, 2, "due")) return NULL;
    am_timeline *t = PyLong_AsVoidPtr(a[0]);
    uint64_t value = PyLong_AsUnsignedLongLong(a[1]);
    if (converted(t, "due: null timeline")) return NULL;
    return PyLong_FromLongLong(am_timeline_due(t, value));
}

/* host_running() -> int: am_host_running. */
static PyObject *py_host_running(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyLong_FromLong(am_host_running());
}

/* host_starved() -> bool: am_host_starved. */
static PyObject *py_host_starved(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyBool_FromLong(am_host_starved());
}

/* The calls on the way from a host signal to the task it releases, which ctypes makes
 * several times slower (and slower still on a CPU that has just been idle): none waits
 * for more than another thread's few instructions under a timeline's lock, so they keep
 * the GIL. */

/* fn(timeline, value, notifier) with the arguments of a call named `name` (the
 * notifier of the calling thread's loop, or 0). */
static PyObject *timeline_call(PyObject *const *a, Py_ssize_t n, const char *name,
                               void (*fn)(am_timeline *, uint64_t, am_notifier *)) {
    if (take_args(n, 3, name)) return NULL;
    am_timeline *t = PyLong_AsVoidPtr(a[0]);
    uint64_t value = PyLong_AsUnsignedLongLong(a[1]);
    am_notifier *here = PyLong_AsVoidPtr(a[2]);
    if (PyErr_Occurred()) return NULL;
    if (!t) return PyErr_Format(PyExc_ValueError, "%s: null timeline", name);
    fn(t, value, here);
    Py_RETURN_NONE;
}

/* timeline_signal(timeline, value, here): am_timeline_signal_here. */
static PyObject *py_timeline_signal(PyObject *self, PyObject *const *a, Py_ssize_t n) {
    (void)self;
    return timeline_call(a, n, "timeline_signal", am_timeline_signal_here);
}

/* host_signal(timeline, value, here): am_timeline_host_signal (the word devices wait on,
 * and the napping completion threads woken). */
static PyObject *py_host_signal(PyObject *self, PyObject *const *a, Py_ssize_t n) {
    (void)self;
    return timeline_call(a, n, "host_signal", am_timeline_host_signal);
}

/* watch_arm(watch, next) -> bool: am_watch_arm (whether next is reached already). */
static PyObject *py_watch_arm(PyObject *self, PyObject *const *a, Py_ssize_t n) {
    (void)self;
    if (take_args(n, 2, "watch_arm")) return NULL;
    am_watch *w = PyLong_AsVoidPtr(a[0]);
    uint64_t next = PyLong_AsUnsignedLongLong(a[1]);
    if (converted(w, "watch_arm: null watch")) return NULL;
    return PyBool_FromLong(am_watch_arm(w, next));
}

/* notifier_reset(notifier) -> int: am_notifier_reset (until when the loop was asked to
 * stay awake, a time.perf_counter_ns(); 0: not asked). */
static PyObject *py_notifier_reset(PyObject *self, PyObject *arg) {
    (void)self;
    am_notifier *notifier = PyLong_AsVoidPtr(arg);
    if (converted(notifier, "notifier_reset: null notifier")) return NULL;
    return PyLong_FromLongLong(am_notifier_reset(notifier));
}

/* timeline_value(timeline) -> int: the timeline's value, an acquire load: whatever the
 * thread that raised it wrote before (a kernel's results, a copy's bytes, a times row)
 * is visible to the caller's later reads. Where a plain load is not that (arm64),
 * asyncmetal._native.timeline_reader reads values through this. */
static PyObject *py_timeline_value(PyObject *self, PyObject *arg) {
    (void)self;
    am_timeline *t = PyLong_AsVoidPtr(arg);
    if (converted(t, "timeline_value: null timeline")) return NULL;
    return PyLong_FromUnsignedLongLong(atomic_load_explicit(&t->value, memory_order_acquire));
}

/* buffer_address(obj) -> (address, nbytes): where the bytes of an object supporting
 * the buffer protocol are, as numpy.frombuffer(obj, numpy.uint8).ctypes.data finds them
 * (a simple request: an exporter refuses one that is not C-contiguous, with its own
 * error, as it refuses numpy's) without making an array and its ctypes object (~1.3 us
 * on the 2-core VM), for a host copy's operand looked up among the memory lent out
 * (asyncmetal/_copyargs.py). The view is released before returning: the address stays
 * valid while the caller holds obj. */
static PyObject *py_buffer_address(PyObject *self, PyObject *obj) {
    (void)self;
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) < 0) return NULL;
    void *address = view.buf;
    Py_ssize_t nbytes = view.len;
    PyBuffer_Release(&view);
    return Py_BuildValue("(Nn)", PyLong_FromVoidPtr(address), nbytes);
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
    {"cuq_wait_stream", (PyCFunction)(void (*)(void))py_cuq_wait_stream, METH_FASTCALL,
     "cuq_wait_stream(queue, context, stream, value, poll_ns, flags) -> (CUresult, call)"},
    {"set_names", py_set_names, METH_O,
     "set_names(names): the attribute and method names, in CONTRACT_KEYS's order"},
    {"setup", (PyCFunction)(void (*)(void))py_setup, METH_FASTCALL,
     "setup(Program, Buffer, Completion, ONE3): the classes launch() recognizes"},
    {"launch", (PyCFunction)(void (*)(void))py_launch, METH_FASTCALL,
     "launch(queue, target, program, buffers, vals, global, local) -> Completion | None"},
    {"spin", (PyCFunction)(void (*)(void))py_spin, METH_FASTCALL,
     "spin(timeline, value, max_ns) -> whether the timeline reached value"},
    {"due", (PyCFunction)(void (*)(void))py_due, METH_FASTCALL,
     "due(timeline, value) -> when the command reaching value is expected done, or 0"},
    {"host_running", py_host_running, METH_NOARGS,
     "host_running() -> the cpu queues' commands running now, in the process"},
    {"host_starved", py_host_starved, METH_NOARGS,
     "host_starved() -> whether the cpu queues' commands lately waited for a core"},
    {"timeline_signal", (PyCFunction)(void (*)(void))py_timeline_signal, METH_FASTCALL,
     "timeline_signal(timeline, value, here): raise a native timeline from the host"},
    {"host_signal", (PyCFunction)(void (*)(void))py_host_signal, METH_FASTCALL,
     "host_signal(timeline, value, here): raise a device timeline's word from the host"},
    {"watch_arm", (PyCFunction)(void (*)(void))py_watch_arm, METH_FASTCALL,
     "watch_arm(watch, next) -> whether the timeline reached next already"},
    {"notifier_reset", py_notifier_reset, METH_O,
     "notifier_reset(notifier) -> int: let the next advance write the pipe again"},
    {"timeline_value", py_timeline_value, METH_O,
     "timeline_value(timeline) -> its value (an acquire load)"},
    {"dlpack_take", py_dlpack_take, METH_O,
     "dlpack_take(capsule) -> (status, ...): a DLPack capsule checked and taken"},
    {"dlpack_export", (PyCFunction)(void (*)(void))py_dlpack_export, METH_FASTCALL,
     "dlpack_export(data, byte_offset, device_type, device_id, code, bits, shape, "
     "versioned, flags, release) -> a DLPack capsule"},
    {"buffer_address", py_buffer_address, METH_O,
     "buffer_address(obj) -> (address, nbytes): where a C-contiguous buffer's bytes are"},
    {"address_of", py_address_of, METH_O, "address_of(name) -> int"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "asyncmetal._amrt",
    "asyncmetal's native launch path (see native/py_ext.h)", -1, methods,
    NULL, NULL, NULL, NULL,
};

/* Module attributes: CONTRACT_KEYS (what set_names() names, in order) and LAYOUTS (the
 * fields of each positional tuple read), which asyncmetal/_native_contract.py checks
 * against its declaration. */
static int add_strings(PyObject *module, const char *attribute, const char *const *items,
                       Py_ssize_t n, PyObject *into) {
    PyObject *tuple = PyTuple_New(n);
    if (!tuple) return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *s = PyUnicode_FromString(items[i]);
        if (!s) { Py_DECREF(tuple); return -1; }
        PyTuple_SET_ITEM(tuple, i, s);
    }
    int r = into ? PyDict_SetItemString(into, attribute, tuple)
                 : PyModule_AddObjectRef(module, attribute, tuple);
    Py_DECREF(tuple);
    return r;
}

#define STRINGS(...) ((const char *const[]){__VA_ARGS__}), \
    (Py_ssize_t)(sizeof((const char *const[]){__VA_ARGS__}) / sizeof(const char *))

PyMODINIT_FUNC PyInit__amrt(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    PyObject *layouts = PyDict_New();
    if (!layouts || add_strings(m, "CONTRACT_KEYS", contract_keys, AM_NAMES, NULL) ||
        add_strings(m, "Arg", STRINGS(LAYOUT_ARG), layouts) ||
        add_strings(m, "Scalar", STRINGS(LAYOUT_SCALAR), layouts) ||
        add_strings(m, "launch_layout", STRINGS(LAYOUT_LAUNCH_LAYOUT), layouts) ||
        add_strings(m, "cuda_target", STRINGS(LAYOUT_CUDA_TARGET), layouts) ||
        add_strings(m, "cpu_target", STRINGS(LAYOUT_CPU_TARGET), layouts) ||
        PyModule_AddObjectRef(m, "LAYOUTS", layouts)) {
        Py_XDECREF(layouts);
        Py_DECREF(m);
        return NULL;
    }
    Py_DECREF(layouts);
    return m;
}
