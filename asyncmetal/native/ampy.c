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

#define AM_MAX_PARAMS 64  /* a cuda kernel's parameters (backends/cuda/_queue.py MAX_PARAMS) */

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

static int take_args(Py_ssize_t n, Py_ssize_t want, const char *name) {
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
    if (take_args(n, 5, "queue_call")) return NULL;
    void *q = PyLong_AsVoidPtr(a[0]), *fn = PyLong_AsVoidPtr(a[1]);
    int64_t *row = PyLong_AsVoidPtr(a[3]);
    uint64_t value = PyLong_AsUnsignedLongLong(a[4]);
    if (PyErr_Occurred()) return NULL;
    int nargs = pack_args(a[2], slots, AM_MAX_ARGS, 1);
    if (nargs < 0) return NULL;
    return PyLong_FromLong(am_queue_call(q, fn, nargs, slots, row, value));
}

/* grid = ceil(global / local) and block = local per dimension, no shared memory; 1 if
 * a size is outside [1, 2**32). */
static int grid_dims(const unsigned long *global, const unsigned long *local, unsigned *dims) {
    for (int i = 0; i < 3; i++) {
        unsigned long g = global[i], l = local[i];
        if (!g || !l || g > UINT32_MAX || l > UINT32_MAX) return 1;
        dims[i] = (unsigned)((g + l - 1) / l);
        dims[3 + i] = (unsigned)l;
    }
    dims[6] = 0;
    return 0;
}

/* The launch sizes from two 3-tuples of ints >= 1 (asyncmetal.Queue checked them). */
static int launch_dims(PyObject *global, PyObject *local, unsigned *dims) {
    if (!PyTuple_Check(global) || !PyTuple_Check(local) || PyTuple_GET_SIZE(global) != 3 ||
        PyTuple_GET_SIZE(local) != 3) {
        PyErr_SetString(PyExc_TypeError, "global and local sizes must be 3-tuples");
        return -1;
    }
    unsigned long g[3], l[3];
    for (int i = 0; i < 3; i++) {
        g[i] = PyLong_AsUnsignedLong(PyTuple_GET_ITEM(global, i));
        l[i] = PyLong_AsUnsignedLong(PyTuple_GET_ITEM(local, i));
        if (PyErr_Occurred()) return -1;
    }
    if (grid_dims(g, l, dims)) {
        PyErr_SetString(PyExc_ValueError, "launch sizes must be in [1, 2**32)");
        return -1;
    }
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
    if (take_args(n, 6, "cuq_launch")) return NULL;
    void *q = PyLong_AsVoidPtr(a[0]), *fn = PyLong_AsVoidPtr(a[1]);
    uint64_t value = PyLong_AsUnsignedLongLong(a[5]);
    if (converted(q, "cuq_launch: null queue")) return NULL;
    if (launch_dims(a[2], a[3], dims)) return NULL;
    int nargs = pack_args(a[4], slots, AM_MAX_PARAMS, 0);
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

/* ---- Queue.launch's common case ---------------------------------------------------
 *
 * launch(queue, target, program, buffers, vals, global, local) -> Completion or None.
 * It submits only what asyncmetal.Queue.launch would accept: a Program of the queue's
 * device, live Buffers of that device (exactly Buffer), vals a tuple or list of exact
 * ints within int32, sizes the default, an int or a tuple/list of 1-3 exact ints >= 1,
 * and a queue holding nothing back. Anything else returns None *before* submitting, and
 * Queue.launch's Python path then checks and explains it: this path raises only what a
 * submission raises (the backend's own error, through its Python hooks).
 *
 * target (the backend queue's launch_target()):
 *   (1, am_cuq, native)                                          cuda: am_cuq_launch
 *   (0, am_queue, native, times, times_address, kept, keep_items) cpu: am_queue_call
 */
static PyObject *Program_type, *Buffer_type, *Completion_type, *one3;
static PyObject *s_device, *s_closed, *s_held, *s_gate, *s_submitted, *s_native, *s_buffer_count,
    *s_value_count, *s_order, *s_allocation, *s_freed, *s_handle, *s_offset, *s_last_use,
    *s_failed, *s_ring, *s_row;

/* setup(Program, Buffer, Completion, ONE3): the classes the fast path recognizes. */
static PyObject *py_setup(PyObject *self, PyObject *const *a, Py_ssize_t n) {
    (void)self;
    if (take_args(n, 4, "setup")) return NULL;
    PyObject **slots[4] = {&Program_type, &Buffer_type, &Completion_type, &one3};
    for (int i = 0; i < 4; i++) {
        Py_XDECREF(*slots[i]);
        Py_INCREF(a[i]);
        *slots[i] = a[i];
    }
    Py_RETURN_NONE;
}

/* 1: the attribute is exactly this object; 0: not; -1: error. */
static int attr_is(PyObject *obj, PyObject *name, PyObject *want) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (!v) return -1;
    int r = v == want;
    Py_DECREF(v);
    return r;
}

/* An attribute's truth: 1, 0 or -1 (error). */
static int attr_true(PyObject *obj, PyObject *name) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (!v) return -1;
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

/* An attribute as a C integer (ssize_t); -1 with an error set, or -2: not an exact int. */
static Py_ssize_t attr_ssize(PyObject *obj, PyObject *name) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (!v) return -1;
    Py_ssize_t r = PyLong_CheckExact(v) ? PyLong_AsSsize_t(v) : -2;
    Py_DECREF(v);
    return r;
}

/* A launch size the Python path accepts: 0 with out[3] filled, 1 if not the simple
 * kind (the Python path decides), -1 on error. */
static int simple_size(PyObject *size, unsigned long out[3]) {
    out[0] = out[1] = out[2] = 1;
    if (size == one3) return 0;
    PyObject *items[3];
    Py_ssize_t n;
    if (PyLong_CheckExact(size)) {
        items[0] = size;
        n = 1;
    } else if (PyTuple_CheckExact(size) || PyList_CheckExact(size)) {
        n = PySequence_Fast_GET_SIZE(size);
        if (n < 1 || n > 3) return 1;
        for (Py_ssize_t i = 0; i < n; i++) items[i] = PySequence_Fast_ITEMS(size)[i];
    } else {
        return 1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyLong_CheckExact(items[i])) return 1;
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(items[i], &overflow);
        if (v == -1 && PyErr_Occurred()) return -1;
        if (overflow || v < 1) return 1;
        out[i] = (unsigned long)v;
    }
    return 0;
}

/* The command numbered value was not submitted: its number is taken back (an error is
 * set already; it stays the one raised). */
static void unnumber(PyObject *queue, uint64_t value) {
    PyObject *type, *exc, *tb;
    PyErr_Fetch(&type, &exc, &tb);
    PyObject *back = PyLong_FromUnsignedLongLong(value - 1);
    if (back) {
        PyObject_SetAttr(queue, s_submitted, back);
        Py_DECREF(back);
    }
    PyErr_Restore(type, exc, tb);
}

/* A backend queue's launch_target(), read once per launch. */
typedef struct {
    long kind;             /* 1: cuda, 0: cpu */
    void *handle;          /* the am_cuq or am_queue */
    PyObject *native;      /* the backend queue (its error hooks) */
    PyObject *times, *keep;  /* cpu: its times rows and its keep-alive items */
    int64_t *times_base;
    long kept;
} target_t;

/* 0 with *t filled, 1 if target is not one of the forms above, -1 on error. */
static int parse_target(PyObject *target, target_t *t) {
    if (!PyTuple_CheckExact(target) || PyTuple_GET_SIZE(target) < 3) return 1;
    t->kind = PyLong_AsLong(PyTuple_GET_ITEM(target, 0));
    t->handle = PyLong_AsVoidPtr(PyTuple_GET_ITEM(target, 1));
    t->native = PyTuple_GET_ITEM(target, 2);
    if (PyErr_Occurred()) return -1;
    if ((t->kind != 0 && t->kind != 1) || !t->handle) return 1;
    if (t->kind == 1) return 0;
    if (PyTuple_GET_SIZE(target) != 7) return 1;
    t->times = PyTuple_GET_ITEM(target, 3);
    t->times_base = PyLong_AsVoidPtr(PyTuple_GET_ITEM(target, 4));
    t->kept = PyLong_AsLong(PyTuple_GET_ITEM(target, 5));
    t->keep = PyTuple_GET_ITEM(target, 6);
    if (PyErr_Occurred()) return -1;
    return !t->times_base || t->kept <= 0;
}

/* Number the command, make its Completion and submit it; then record each buffer's use.
 * Errors after numbering take the number back. */
static PyObject *submit(PyObject *queue, const target_t *t, void *fn, const unsigned *dims,
                        int64_t *slots, Py_ssize_t nargs, PyObject *handles,
                        PyObject *const *allocations, Py_ssize_t nbuf) {
    PyObject *last = PyObject_GetAttr(queue, s_submitted);
    if (!last) return NULL;
    uint64_t value = PyLong_AsUnsignedLongLong(last) + 1;
    Py_DECREF(last);
    if (PyErr_Occurred()) return NULL;
    PyObject *value_obj = PyLong_FromUnsignedLongLong(value);
    if (!value_obj) return NULL;
    PyObject *done = NULL;
    if (PyObject_SetAttr(queue, s_submitted, value_obj)) goto out;
    done = PyObject_CallFunctionObjArgs(Completion_type, queue, value_obj, NULL);
    if (!done) goto unnumbered;
    int code;
    if (t->kind == 1) {
        void *params[AM_MAX_PARAMS];
        for (Py_ssize_t i = 0; i < nargs; i++) params[i] = &slots[i];
        Py_BEGIN_ALLOW_THREADS
        code = am_cuq_launch(t->handle, fn, dims, params, (int)nargs, value);
        Py_END_ALLOW_THREADS
        if (code) {  /* the backend's hook explains it: it raises or returns the error */
            PyObject *code_obj = PyLong_FromLong(code);
            PyObject *exc =
                code_obj ? PyObject_CallMethodObjArgs(t->native, s_failed, code_obj, NULL)
                         : NULL;
            Py_XDECREF(code_obj);
            if (exc) {
                PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
                Py_DECREF(exc);
            }
            goto unnumbered;
        }
    } else {
        /* The times row the queue thread writes, as CPUQueue.launch records it. */
        uint64_t row = value % (uint64_t)t->kept;
        PyObject *row_obj = PyLong_FromUnsignedLongLong(row);
        int failed = !row_obj || PyObject_SetAttr(done, s_ring, t->times) ||
                     PyObject_SetAttr(done, s_row, row_obj);
        Py_XDECREF(row_obj);
        if (failed) goto unnumbered;
        code = am_queue_call(t->handle, fn, (int)nargs, slots, t->times_base + 3 * row, value);
        if (code || nargs || PyObject_Length(t->keep)) {  /* CPUQueue._submitted: errors,
                                                             keeping the handles alive */
            PyObject *status = PyLong_FromLong(code);
            PyObject *res = status ? PyObject_CallMethodObjArgs(
                                         t->native, s_submitted, status, value_obj,
                                         handles ? handles : Py_None, NULL)
                                   : NULL;
            Py_XDECREF(status);
            if (!res) goto unnumbered;
            Py_DECREF(res);
        }
    }
    /* Each buffer's allocation: used by this queue up to value. */
    for (Py_ssize_t i = 0; i < nbuf; i++) {
        PyObject *uses = PyObject_GetAttr(allocations[i], s_last_use);
        int failed = !uses || PyObject_SetItem(uses, queue, value_obj);
        Py_XDECREF(uses);
        if (failed) {
            Py_CLEAR(done);
            goto out;
        }
    }
    goto out;
unnumbered:
    Py_CLEAR(done);
    unnumber(queue, value);
out:
    Py_DECREF(value_obj);
    return done;
}

static PyObject *py_launch(PyObject *self, PyObject *const *a, Py_ssize_t n) {
    (void)self;
    if (take_args(n, 7, "launch")) return NULL;
    PyObject *queue = a[0], *target = a[1], *program = a[2], *buffers = a[3], *vals = a[4];
    if (!Program_type) {
        PyErr_SetString(PyExc_RuntimeError, "launch: setup() was not called");
        return NULL;
    }
    if (!PyTuple_CheckExact(buffers) || (!PyTuple_CheckExact(vals) && !PyList_CheckExact(vals)) ||
        (PyObject *)Py_TYPE(program) != Program_type) {
        Py_RETURN_NONE;
    }
    target_t t = {0};
    int parsed = parse_target(target, &t);
    if (parsed < 0) return NULL;
    if (parsed) Py_RETURN_NONE;
    Py_ssize_t most = t.kind == 1 ? AM_MAX_PARAMS : AM_MAX_ARGS;

    /* The queue holds nothing back, and its device is open and the program's. (r: 0 so
     * far the common case, 1 not, -1 an error; any error set is raised.) */
    PyObject *handles = NULL;  /* cpu: the buffers' handles, kept alive by the queue */
    PyObject *device = PyObject_GetAttr(queue, s_device);
    if (!device) return NULL;
    int r = attr_true(queue, s_held);
    if (r == 0) r = 1 - attr_is(queue, s_gate, Py_None);
    if (r == 0) r = attr_true(device, s_closed);
    if (r == 0) r = 1 - attr_is(program, s_device, device);
    if (r) goto fallback;

    Py_ssize_t nbuf = PyTuple_GET_SIZE(buffers), nval = PySequence_Fast_GET_SIZE(vals);
    if (attr_ssize(program, s_buffer_count) != nbuf || attr_ssize(program, s_value_count) != nval ||
        nbuf + nval > most)
        goto fallback;
    unsigned long global[3], local[3];
    if ((r = simple_size(a[5], global)) || (r = simple_size(a[6], local))) goto fallback;

    /* The arguments in launch order (buffers, then vals), each a 64-bit slot. */
    int64_t packed[AM_MAX_PARAMS];
    PyObject *allocations[AM_MAX_PARAMS];
    if (t.kind == 0 && nbuf && !(handles = PyTuple_New(nbuf))) goto fallback;
    for (Py_ssize_t i = 0; i < nbuf; i++) {
        PyObject *buf = PyTuple_GET_ITEM(buffers, i);
        if ((PyObject *)Py_TYPE(buf) != Buffer_type || attr_is(buf, s_device, device) != 1) {
            r = 1;
            goto fallback;
        }
        PyObject *allocation = PyObject_GetAttr(buf, s_allocation);
        if (!allocation) { r = -1; goto fallback; }
        allocations[i] = allocation;  /* borrowed: buf holds it for this call */
        Py_DECREF(allocation);
        if ((r = attr_true(allocation, s_freed)) != 0) goto fallback;
        PyObject *h = PyObject_GetAttr(allocation, s_handle);
        if (!h) { r = -1; goto fallback; }
        PyObject *base = t.kind == 0 ? PyObject_GetAttr(h, address_name) : (Py_INCREF(h), h);
        if (handles) PyTuple_SET_ITEM(handles, i, h);  /* takes the reference */
        else Py_DECREF(h);
        if (!base) { r = -1; goto fallback; }
        Py_ssize_t offset = attr_ssize(buf, s_offset);
        packed[i] = (int64_t)PyLong_AsUnsignedLongLong(base) + offset;
        Py_DECREF(base);
        if (PyErr_Occurred()) { r = -1; goto fallback; }
        if (offset < 0) { r = 1; goto fallback; }
    }
    for (Py_ssize_t i = 0; i < nval; i++) {
        PyObject *v = PySequence_Fast_ITEMS(vals)[i];
        if (!PyLong_CheckExact(v)) { r = 1; goto fallback; }
        int overflow;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (overflow || x < INT32_MIN || x > INT32_MAX) { r = 1; goto fallback; }
        packed[nbuf + i] = x;
    }
    /* Reordered to the kernel's parameter order where it differs. */
    int64_t slots[AM_MAX_PARAMS];
    Py_ssize_t nargs = nbuf + nval;
    PyObject *order = PyObject_GetAttr(program, s_order);
    if (!order) { r = -1; goto fallback; }
    if (order == Py_None) {
        memcpy(slots, packed, nargs * sizeof *slots);
    } else if (!PyList_CheckExact(order) || PyList_GET_SIZE(order) != nargs) {
        r = 1;
    } else {
        for (Py_ssize_t i = 0; i < nargs && !r; i++) {
            Py_ssize_t j = PyLong_AsSsize_t(PyList_GET_ITEM(order, i));
            if (j < 0 || j >= nargs) r = PyErr_Occurred() ? -1 : 1;
            else slots[i] = packed[j];
        }
    }
    Py_DECREF(order);
    if (r) goto fallback;
    PyObject *function = PyObject_GetAttr(program, s_native);
    if (!function) { r = -1; goto fallback; }
    void *fn = PyLong_AsVoidPtr(function);
    Py_DECREF(function);
    if (PyErr_Occurred()) { r = -1; goto fallback; }
    unsigned dims[7];
    if (t.kind == 1 && (r = grid_dims(global, local, dims))) goto fallback;

    /* Number it, make its Completion, submit. */
    Py_DECREF(device);
    PyObject *done = submit(queue, &t, fn, dims, slots, nargs, handles, allocations, nbuf);
    Py_XDECREF(handles);
    return done;

fallback:
    Py_DECREF(device);
    Py_XDECREF(handles);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
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
    {"setup", (PyCFunction)(void (*)(void))py_setup, METH_FASTCALL,
     "setup(Program, Buffer, Completion, ONE3): the classes launch() recognizes"},
    {"launch", (PyCFunction)(void (*)(void))py_launch, METH_FASTCALL,
     "launch(queue, target, program, buffers, vals, global, local) -> Completion | None"},
    {"spin", (PyCFunction)(void (*)(void))py_spin, METH_FASTCALL,
     "spin(timeline, value, max_ns) -> whether the timeline reached value"},
    {"timeline_value", py_timeline_value, METH_O,
     "timeline_value(timeline) -> its value (an acquire load)"},
    {"address_of", py_address_of, METH_O, "address_of(name) -> int"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "asyncmetal._amrt",
    "asyncmetal's native launch path (see native/ampy.c)", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__amrt(void) {
    struct { PyObject **slot; const char *name; } names[] = {
        {&address_name, "address"}, {&s_device, "device"}, {&s_closed, "closed"},
        {&s_held, "_held"}, {&s_gate, "_gate"}, {&s_submitted, "_submitted"},
        {&s_native, "native"}, {&s_buffer_count, "buffer_count"},
        {&s_value_count, "value_count"}, {&s_order, "order"}, {&s_allocation, "_allocation"},
        {&s_freed, "freed"}, {&s_handle, "handle"}, {&s_offset, "offset"},
        {&s_last_use, "last_use"}, {&s_failed, "_failed"},
        {&s_ring, "ring"}, {&s_row, "row"},
    };
    for (size_t i = 0; i < sizeof names / sizeof *names; i++)
        if (!(*names[i].slot = PyUnicode_InternFromString(names[i].name))) return NULL;
    return PyModule_Create(&module);
}
