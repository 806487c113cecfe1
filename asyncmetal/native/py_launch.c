/* Queue.launch's common case in one call of asyncmetal's native extension module
 * (py_ext.h says what the module is; asyncmetal/_native_contract.py declares every
 * attribute, method and tuple read here).
 *
 * launch(queue, target, program, buffers, vals, global, local) -> Completion or None.
 * It submits only what asyncmetal.Queue.launch would accept: a Program of the queue's
 * device, live Buffers of that device (exactly Buffer), vals a tuple or list of exact
 * ints within int32 -- or, for a program whose launch_layout names other integer types,
 * within each one's range (a float parameter's value is left to Python) -- sizes the
 * default, an int or a tuple/list of 1-3 exact ints >= 1 (on cuda, within the device's
 * launch limits and the kernel's: target's), and a queue holding nothing back. Anything
 * else returns None *before* submitting, and
 * Queue.launch's Python path then checks and explains it: this path raises only what a
 * submission raises (the backend's own error, through its Python hooks).
 *
 * target (the backend queue's launch_target(), built by _native_contract.py):
 *   (1, am_cuq, native, limits, kernel_threads)                  cuda: am_cuq_launch
 *     limits: the address of the device's launch limits, 7 unsigned ints (a block's
 *     threads; a block's threads in x, y, z; a grid's blocks in x, y, z);
 *     kernel_threads: a dict, CUfunction (int) -> the kernel's most threads per block
 *   (0, am_queue, native, times, times_address, kept, keep_items) cpu: am_queue_call
 */
#include "py_ext.h"

static PyObject *Program_type, *Buffer_type, *Completion_type, *one3;
#define NAME(key) am_names[N_##key]  /* an attribute's or method's name (py_ext.h) */

/* setup(Program, Buffer, Completion, ONE3): the classes the fast path recognizes. */
PyObject *py_setup(PyObject *self, PyObject *const *a, Py_ssize_t n) {
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
 * kind (the Python path decides: it refuses sizes of 2**32 or more), -1 on error. */
static int simple_size(PyObject *size, uint64_t out[3]) {
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
        if (overflow || v < 1 || v > UINT32_MAX) return 1;
        out[i] = (uint64_t)v;
    }
    return 0;
}

/* Whether an int fits the parameter type of code (CODES in asyncmetal/_scalars.py); a
 * float's code, or a uint64 past int64 (an overflow before this), fits none here. */
static int value_fits(long long x, char code) {
    switch (code) {
    case 'i': return x >= INT32_MIN && x <= INT32_MAX;
    case 'I': return x >= 0 && x <= UINT32_MAX;
    case 'q': return 1;
    case 'Q': return x >= 0;
    case 'h': return x >= INT16_MIN && x <= INT16_MAX;
    case 'H': return x >= 0 && x <= UINT16_MAX;
    case 'b': return x >= INT8_MIN && x <= INT8_MAX;
    case 'B': return x >= 0 && x <= UINT8_MAX;
    case '?': return x == 0 || x == 1;
    default: return 0;
    }
}

/* The command numbered value was not submitted: its number is taken back (an error is
 * set already; it stays the one raised). */
static void unnumber(PyObject *queue, uint64_t value) {
    PyObject *type, *exc, *tb;
    PyErr_Fetch(&type, &exc, &tb);
    PyObject *back = PyLong_FromUnsignedLongLong(value - 1);
    if (back) {
        PyObject_SetAttr(queue, NAME(QUEUE_SUBMITTED), back);
        Py_DECREF(back);
    }
    PyErr_Restore(type, exc, tb);
}

/* The runtime call just made could not make the calling thread's context current again
 * (amrt.h, am_cu_unrestored: a thread-local read, no more, in the common case): the
 * backend queue's hook warns of it. 0, or -1 with an error set (the warning raised as
 * one). */
static int warn_unrestored(PyObject *native) {
    if (!am_cu_unrestored) return 0;
    PyObject *r = PyObject_CallMethodObjArgs(native, NAME(CUDA_QUEUE_UNRESTORED), NULL);
    Py_XDECREF(r);
    return r ? 0 : -1;
}

/* A backend queue's launch_target(), read once per launch. */
typedef struct {
    long kind;             /* 1: cuda, 0: cpu */
    void *handle;          /* the am_cuq or am_queue */
    PyObject *native;      /* the backend queue (its error hooks) */
    const unsigned *limits;  /* cuda: the device's launch limits */
    PyObject *kernel_threads;  /* cuda: each kernel's most threads per block (a dict) */
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
    if (t->kind == 1) {
        if (PyTuple_GET_SIZE(target) != 5) return 1;
        t->limits = PyLong_AsVoidPtr(PyTuple_GET_ITEM(target, 3));
        t->kernel_threads = PyTuple_GET_ITEM(target, 4);
        if (PyErr_Occurred()) return -1;
        return !t->limits || !PyDict_CheckExact(t->kernel_threads);
    }
    if (PyTuple_GET_SIZE(target) != 7) return 1;
    t->times = PyTuple_GET_ITEM(target, 3);
    t->times_base = PyLong_AsVoidPtr(PyTuple_GET_ITEM(target, 4));
    t->kept = PyLong_AsLong(PyTuple_GET_ITEM(target, 5));
    t->keep = PyTuple_GET_ITEM(target, 6);
    if (PyErr_Occurred()) return -1;
    return !t->times_base || t->kept <= 0;
}

/* 1 if a cuda launch of dims (grid_dims') is beyond its device's launch limits or its
 * kernel's (function: its CUfunction, a key of t->kernel_threads) -- the driver would
 * refuse it, and a launch held on the host only later, failing the queue: declined, the
 * Python path raises naming the limit -- 0 if within them, -1 on error. */
static int beyond_limits(const target_t *t, PyObject *function, const unsigned *dims) {
    const unsigned *most = t->limits;
    for (int i = 0; i < 3; i++)
        if (dims[3 + i] > most[1 + i] || dims[i] > most[4 + i]) return 1;
    unsigned long long threads = (unsigned long long)dims[3] * dims[4] * dims[5];
    if (threads > most[0]) return 1;
    PyObject *kernel = PyDict_GetItemWithError(t->kernel_threads, function);  /* borrowed */
    if (!kernel) return PyErr_Occurred() ? -1 : 1;
    unsigned long long kernel_most = PyLong_AsUnsignedLongLong(kernel);
    if (PyErr_Occurred()) return -1;
    return threads > kernel_most;
}

/* Number the command and hand it over, then make its Completion and record each
 * buffer's use. From reading the last number to the hand-over no Python code runs (plain
 * attributes, ints -- whose making never starts a garbage collection -- and the
 * runtime's call, made holding the GIL): no other thread runs meanwhile. So another
 * thread's command of this queue is numbered and handed over wholly before or after
 * this one, and a close (which sets `closed` under the submission lock) either counts
 * this command or is seen here. Unless a Python-path submission of the device is half
 * done (DeviceState.busy): then None, and the Python path, which waits for the lock
 * that one holds, submits this one. Errors before the hand-over take the number back,
 * as does a refused hand-over -- but for a cuda launch refused after its kernel reached
 * the driver, which stays submitted, failed, as on the Python path (CUDAQueue._kept);
 * None also where the device closed meanwhile (the Python path raises it). */
static PyObject *submit(PyObject *queue, PyObject *state, const target_t *t, void *fn,
                        const unsigned *dims, int64_t *slots, Py_ssize_t nargs,
                        PyObject *handles, PyObject *const *allocations, Py_ssize_t nbuf) {
    int busy = attr_true(state, NAME(STATE_BUSY));
    if (busy) {
        if (busy < 0) return NULL;
        Py_RETURN_NONE;
    }
    PyObject *last = PyObject_GetAttr(queue, NAME(QUEUE_SUBMITTED));
    if (!last) return NULL;
    uint64_t value = PyLong_AsUnsignedLongLong(last) + 1;
    Py_DECREF(last);
    if (PyErr_Occurred()) return NULL;
    PyObject *value_obj = PyLong_FromUnsignedLongLong(value);
    if (!value_obj) return NULL;
    PyObject *done = NULL;
    if (PyObject_SetAttr(queue, NAME(QUEUE_SUBMITTED), value_obj)) goto out;
    int closed = attr_true(state, NAME(STATE_CLOSED));
    /* From here to the hand-over no Python code runs, so no other thread can close the
     * queue, have the device let go of it, or free a buffer: checked last here (Python
     * code -- a collection -- may have run since the launch's own checks). */
    if (!closed) {
        PyObject *fast = PyObject_GetAttr(queue, NAME(QUEUE_FAST));
        closed = !fast ? -1 : fast == Py_None;
        Py_XDECREF(fast);
    }
    for (Py_ssize_t i = 0; !closed && i < nbuf; i++)
        closed = attr_true(allocations[i], NAME(ALLOCATION_FREED));
    if (closed) {
        if (closed > 0) done = Py_NewRef(Py_None);  /* the Python path raises or takes it */
        unnumber(queue, value);
        goto out;
    }
    int code, kept = 0;
    uint64_t row = 0;
    if (t->kind == 1) {
        void *params[AM_MAX_PARAMS];
        for (Py_ssize_t i = 0; i < nargs; i++) params[i] = &slots[i];
        int clean = !am_cuq_failed_now(t->handle);  /* before: the call sets it */
        code = am_cuq_launch(t->handle, fn, dims, params, (int)nargs, value);
        if (code && clean) {
            /* Refused after the kernel reached the driver (its end refused): the queue
             * failed from this command on, which runs -- not taken back as never run,
             * but kept, submitted and failed, as CUDAQueue._kept keeps it. */
            uint64_t first = 0;
            kept = am_cuq_error(t->handle, &first) != 0 && first == value;
        }
    } else {
        row = value % (uint64_t)t->kept;  /* the times row the queue thread writes */
        code = am_queue_call(t->handle, fn, (int)nargs, slots, 0, t->times_base + 3 * row, value);
    }
    if (code && !kept) {  /* not handed over: its number back, then the backend's hook explains */
        unnumber(queue, value);
        if (t->kind == 1 && warn_unrestored(t->native)) goto out;
        PyObject *code_obj = PyLong_FromLong(code);
        if (code_obj && t->kind == 1) {  /* it raises or returns the error */
            PyObject *exc =
                PyObject_CallMethodObjArgs(t->native, NAME(CUDA_QUEUE_FAILED), code_obj, NULL);
            if (exc) {
                PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
                Py_DECREF(exc);
            }
        } else if (code_obj) {  /* CPUQueue._submitted raises it */
            PyObject *res = PyObject_CallMethodObjArgs(t->native, NAME(CPU_QUEUE_SUBMITTED),
                                                       code_obj, value_obj, Py_None, NULL);
            Py_XDECREF(res);
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_MemoryError, "am_queue_call");
        }
        Py_XDECREF(code_obj);
        goto out;
    }
    /* Each buffer's allocation: used by this queue up to value (unless another thread's
     * later command of the queue recorded a higher value) -- before any Python code runs:
     * a free on another thread then sees this use and waits for it. */
    for (Py_ssize_t i = 0; i < nbuf; i++) {
        PyObject *uses = PyObject_GetAttr(allocations[i], NAME(ALLOCATION_LAST_USE));
        int failed = !uses;
        if (uses) {
            PyObject *had = PyDict_CheckExact(uses) ? PyDict_GetItemWithError(uses, queue) : NULL;
            if (!PyErr_Occurred() && (!had || PyLong_AsUnsignedLongLong(had) < value))
                PyObject_SetItem(uses, queue, value_obj);
            failed = PyErr_Occurred() != NULL;
            Py_DECREF(uses);
        }
        if (failed) goto out;
    }
    /* Recorded: Python code may run from here on. */
    done = PyObject_CallFunctionObjArgs(Completion_type, queue, value_obj, NULL);
    if (!done) goto out;
    if (t->kind == 1 && warn_unrestored(t->native)) {  /* submitted, recorded: raised */
        Py_CLEAR(done);
        goto out;
    }
    if (t->kind == 0) {
        PyObject *row_obj = PyLong_FromUnsignedLongLong(row);
        int failed = !row_obj || PyObject_SetAttr(done, NAME(COMPLETION_RING), t->times) ||
                     PyObject_SetAttr(done, NAME(COMPLETION_ROW), row_obj);
        Py_XDECREF(row_obj);
        if (failed) {
            Py_CLEAR(done);
            goto out;
        }
        /* CPUQueue._submitted: the buffers' handles kept alive until the command
         * passed, and what the commands passed before let go of -- a call for nothing
         * where there are neither (values only, nothing kept) */
        if (handles || PyObject_Length(t->keep)) {
            PyObject *status = PyLong_FromLong(0);
            PyObject *res = status ? PyObject_CallMethodObjArgs(
                                         t->native, NAME(CPU_QUEUE_SUBMITTED), status, value_obj,
                                         handles ? handles : Py_None, NULL)
                                   : NULL;
            Py_XDECREF(status);
            if (!res) {
                Py_CLEAR(done);
                goto out;
            }
            Py_DECREF(res);
        }
    }
out:
    Py_DECREF(value_obj);
    return done;
}

PyObject *py_launch(PyObject *self, PyObject *const *a, Py_ssize_t n) {
    (void)self;
    if (take_args(n, 7, "launch")) return NULL;
    PyObject *queue = a[0], *target = a[1], *program = a[2], *buffers = a[3], *vals = a[4];
    if (!Program_type || !NAME(QUEUE_DEVICE)) {
        PyErr_SetString(PyExc_RuntimeError, "launch: setup() or set_names() was not called");
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

    /* The queue's device is open and the program's. (r: 0 so far the common case, 1 not,
     * -1 an error; any error set is raised.) */
    PyObject *handles = NULL;  /* cpu: the buffers' handles, kept alive by the queue */
    PyObject *layout = NULL;   /* the program's launch_layout */
    PyObject *device = PyObject_GetAttr(queue, NAME(QUEUE_DEVICE));
    if (!device) return NULL;
    PyObject *state = PyObject_GetAttr(queue, NAME(QUEUE_STATE));
    if (!state) {
        Py_DECREF(device);
        return NULL;
    }
    int r = attr_true(state, NAME(STATE_CLOSED));
    if (r == 0) r = 1 - attr_is(program, NAME(PROGRAM_DEVICE), device);
    if (r) goto fallback;

    Py_ssize_t nbuf = PyTuple_GET_SIZE(buffers), nval = PySequence_Fast_GET_SIZE(vals);
    if (attr_ssize(program, NAME(PROGRAM_BUFFER_COUNT)) != nbuf || attr_ssize(program, NAME(PROGRAM_VALUE_COUNT)) != nval ||
        nbuf + nval > most)
        goto fallback;
    uint64_t global[3], local[3];
    if ((r = simple_size(a[5], global)) || (r = simple_size(a[6], local))) goto fallback;

    /* The arguments in launch order (buffers, then vals), each a 64-bit slot. */
    int64_t packed[AM_MAX_PARAMS];
    PyObject *allocations[AM_MAX_PARAMS];
    if (t.kind == 0 && nbuf && !(handles = PyTuple_New(nbuf))) goto fallback;
    for (Py_ssize_t i = 0; i < nbuf; i++) {
        PyObject *buf = PyTuple_GET_ITEM(buffers, i);
        if ((PyObject *)Py_TYPE(buf) != Buffer_type || attr_is(buf, NAME(BUFFER_DEVICE), device) != 1) {
            r = 1;
            goto fallback;
        }
        PyObject *allocation = PyObject_GetAttr(buf, NAME(BUFFER_ALLOCATION));
        if (!allocation) { r = -1; goto fallback; }
        allocations[i] = allocation;  /* borrowed: buf holds it for this call */
        Py_DECREF(allocation);
        if ((r = attr_true(allocation, NAME(ALLOCATION_FREED))) != 0) goto fallback;
        PyObject *h = PyObject_GetAttr(allocation, NAME(ALLOCATION_HANDLE));
        if (!h) { r = -1; goto fallback; }
        PyObject *base = t.kind == 0 ? PyObject_GetAttr(h, NAME(CPU_MEMORY_ADDRESS)) : (Py_INCREF(h), h);
        if (handles) PyTuple_SET_ITEM(handles, i, h);  /* takes the reference */
        else Py_DECREF(h);
        if (!base) { r = -1; goto fallback; }
        Py_ssize_t offset = attr_ssize(buf, NAME(BUFFER_OFFSET));
        packed[i] = (int64_t)PyLong_AsUnsignedLongLong(base) + offset;
        Py_DECREF(base);
        if (PyErr_Occurred()) { r = -1; goto fallback; }
        if (offset < 0) { r = 1; goto fallback; }
    }
    /* The program's launch layout: None in the common case (the kernel takes the
     * buffers, then the values, each an int32), else (order, value_codes). */
    layout = PyObject_GetAttr(program, NAME(PROGRAM_LAUNCH_LAYOUT));
    if (!layout) { r = -1; goto fallback; }
    PyObject *order = Py_None;  /* borrowed from layout */
    const char *codes = NULL;   /* each value's type (asyncmetal/_scalars.py's CODES) */
    if (layout != Py_None) {
        PyObject *value_codes = NULL;
        if (PyTuple_CheckExact(layout) && PyTuple_GET_SIZE(layout) == 2) {
            order = PyTuple_GET_ITEM(layout, 0);
            value_codes = PyTuple_GET_ITEM(layout, 1);
        }
        if (!value_codes) r = 1;
        else if (value_codes != Py_None && PyBytes_CheckExact(value_codes) &&
                 PyBytes_GET_SIZE(value_codes) == nval)
            codes = PyBytes_AS_STRING(value_codes);
        else if (value_codes != Py_None) r = 1;
        if (r) goto fallback;
    }
    for (Py_ssize_t i = 0; i < nval; i++) {
        PyObject *v = PySequence_Fast_ITEMS(vals)[i];
        if (!PyLong_CheckExact(v)) { r = 1; goto fallback; }
        int overflow;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (overflow || !value_fits(x, codes ? codes[i] : 'i')) { r = 1; goto fallback; }
        packed[nbuf + i] = x;
    }
    /* Reordered to the kernel's parameter order where it differs. */
    int64_t slots[AM_MAX_PARAMS];
    Py_ssize_t nargs = nbuf + nval;
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
    if (r) goto fallback;
    PyObject *function = PyObject_GetAttr(program, NAME(PROGRAM_NATIVE));
    if (!function) { r = -1; goto fallback; }
    void *fn = PyLong_AsVoidPtr(function);
    unsigned dims[7];
    if (!PyErr_Occurred() && t.kind == 1 && !(r = grid_dims(global, local, dims)))
        r = beyond_limits(&t, function, dims);
    Py_DECREF(function);
    if (PyErr_Occurred()) r = -1;
    if (r) goto fallback;

    /* Number it, make its Completion, submit. */
    Py_DECREF(device);
    Py_DECREF(layout);
    PyObject *done = submit(queue, state, &t, fn, dims, slots, nargs, handles, allocations, nbuf);
    Py_DECREF(state);
    Py_XDECREF(handles);
    return done;

fallback:
    Py_DECREF(device);
    Py_DECREF(state);
    Py_XDECREF(handles);
    Py_XDECREF(layout);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}
