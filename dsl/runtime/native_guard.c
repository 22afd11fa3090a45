/* Kiln's native launch shim, its guarded half: kernel[grid](...)'s steady state and a library
 * plan's guard, each checked and (for the first) launched in one C call. */
#include "native_launch.h"

#include <float.h>
#include <math.h>

/* --- launch_guarded: kernel[grid](...)'s steady state in one C call ------------------------
 *
 * launch_guarded(record, spec, grid, args, kwargs, stream) checks that a call has the launch
 * key the spec was made for (kiln.runtime.launch_fast.native_guarded documents the spec),
 * writes every flat argument, the grid and the stream into the record's words and launches;
 * True when it launched, False (nothing launched) when the call does not match or a value
 * does not fit: the caller then takes the checked Python path, which reports it. Everything
 * is read into a local copy of the words first (reading may run Python code: a stream getter,
 * a grid function, a tensor subclass, and so let another thread in); the copy into the
 * record and the launch then run without releasing the GIL, so one argument block serves
 * every thread. */

enum { ARG_TENSOR = 0, ARG_INT = 1, ARG_F32 = 2, ARG_F64 = 3 };
enum { MAX_GUARDED_WORDS = 1024 };  /* flat arguments of a guarded launch (the rest: Python) */
static const long long GRID_LIMITS[3] = {2147483647LL, 65535LL, 65535LL};
static PyObject *s_dtype, *s_shape, *s_stride, *s_is_cuda, *s_data_ptr;

/* 1: equal, 0: not, -1: error. */
static int same(PyObject *a, PyObject *b)
{
    return a == b ? 1 : PyObject_RichCompareBool(a, b, Py_EQ);
}

/* A tuple of ints into words (int64 each); 0 when an entry is not an int. */
static int put_ints(PyObject *tuple, uint64_t *words)
{
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tuple); i++) {
        long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(tuple, i));
        if (v == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
        words[i] = (uint64_t)v;
    }
    return 1;
}

/* The memref fields of a tensor read through the torch bridge, as put_tensor writes them:
 * 1 written, 0 no match. */
static int put_view(const torch_view *v, long scalar_type, Py_ssize_t rank, int want_cuda,
                    int want_last, uint64_t *w)
{
    if (v->scalar_type != scalar_type || v->ndim != rank || (v->device_type == 1) != want_cuda)
        return 0;
    if (rank > 0 && (v->strides[rank - 1] == 1 || v->sizes[rank - 1] <= 1) != want_last)
        return 0;
    w[0] = w[1] = v->data;
    w[2] = 0;
    memcpy(w + 3, v->sizes, sizeof(uint64_t) * rank);
    memcpy(w + 3 + rank, v->strides, sizeof(uint64_t) * rank);
    return 1;
}

/* spec: (ARG_TENSOR, type, dtype, rank, is_cuda, contiguous_last, slot[, scalar_type]). Writes
 * the memref fields (pointer twice, offset 0, sizes, strides) from slot on: 1 written, 0 no
 * match, -1 error. With the torch bridge loaded and the spec's scalar type (the bridge's
 * code of the dtype, -1 for none), a plain torch tensor is read from its C++ metadata. */
static int put_tensor(PyObject *a, PyObject *spec, uint64_t *words)
{
    if ((PyObject *)Py_TYPE(a) != PyTuple_GET_ITEM(spec, 1))
        return 0;
    Py_ssize_t rank = PyLong_AsSsize_t(PyTuple_GET_ITEM(spec, 3));
    int want_cuda = PyTuple_GET_ITEM(spec, 4) == Py_True;
    int want_last = PyTuple_GET_ITEM(spec, 5) == Py_True;
    uint64_t *w = words + PyLong_AsSsize_t(PyTuple_GET_ITEM(spec, 6));
    torch_view view;
    if (read_torch_view != NULL && PyTuple_GET_SIZE(spec) > 7 && read_torch_view(a, &view)) {
        long scalar_type = PyLong_AsLong(PyTuple_GET_ITEM(spec, 7));
        if (scalar_type >= 0)
            return put_view(&view, scalar_type, rank, want_cuda, want_last, w);
    }
    int result = 0;
    PyObject *dtype = NULL, *shape = NULL, *cuda = NULL, *strides = NULL, *ptr = NULL;
    dtype = PyObject_GetAttr(a, s_dtype);
    if (dtype == NULL)
        goto error;
    int eq = same(dtype, PyTuple_GET_ITEM(spec, 2));
    if (eq <= 0) {
        result = eq;
        goto done;
    }
    shape = PyObject_GetAttr(a, s_shape);
    if (shape == NULL)
        goto error;
    if (!PyTuple_Check(shape) || PyTuple_GET_SIZE(shape) != rank)
        goto done;
    cuda = PyObject_GetAttr(a, s_is_cuda);
    if (cuda == NULL)
        goto error;
    if (cuda != (want_cuda ? Py_True : Py_False))
        goto done;
    strides = PyObject_CallMethodNoArgs(a, s_stride);
    if (strides == NULL)
        goto error;
    if (!PyTuple_Check(strides) || PyTuple_GET_SIZE(strides) != rank)
        goto done;
    if (!put_ints(shape, w + 3) || !put_ints(strides, w + 3 + rank))
        goto done;
    if (rank > 0) {
        int last = w[3 + 2 * rank - 1] == 1 || (long long)w[3 + rank - 1] <= 1;
        if (last != want_last)
            goto done;
    }
    ptr = PyObject_CallMethodNoArgs(a, s_data_ptr);
    if (ptr == NULL)
        goto error;
    uint64_t address = PyLong_AsUnsignedLongLong(ptr);
    if (address == (uint64_t)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        goto done;
    }
    w[0] = w[1] = address;
    w[2] = 0;
    result = 1;
    goto done;
error:
    result = -1;
done:
    Py_XDECREF(dtype);
    Py_XDECREF(shape);
    Py_XDECREF(cuda);
    Py_XDECREF(strides);
    Py_XDECREF(ptr);
    return result;
}

/* spec: (ARG_INT / ARG_F32 / ARG_F64, type, integer bits or 0, slot). 1 written, 0 no match
 * or out of range. */
static int put_scalar(PyObject *a, PyObject *spec, uint64_t *words)
{
    if ((PyObject *)Py_TYPE(a) != PyTuple_GET_ITEM(spec, 1))
        return 0;
    long kind = PyLong_AsLong(PyTuple_GET_ITEM(spec, 0));
    uint64_t *w = words + PyLong_AsSsize_t(PyTuple_GET_ITEM(spec, 3));
    if (kind == ARG_INT) {
        long bits = PyLong_AsLong(PyTuple_GET_ITEM(spec, 2));
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(a, &overflow);
        if (overflow || (v == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            return 0;
        }
        if (bits < 64 && (v < -(1LL << (bits - 1)) || v > (1LL << (bits - 1)) - 1))
            return 0;
        *w = (uint64_t)v;  /* little-endian: a narrower slot reads the low bytes */
        return 1;
    }
    double d = PyFloat_AsDouble(a);
    if (d == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (kind == ARG_F32) {
        if (isfinite(d) && fabs(d) > FLT_MAX)
            return 0;  /* struct's 'f' refuses it too: the checked path reports it */
        float f = (float)d;
        *w = 0;
        memcpy(w, &f, sizeof f);
    } else {
        memcpy(w, &d, sizeof d);
    }
    return 1;
}

/* The grid as three ints in range; 0 when it is not (the checked path reports it). */
static int put_grid(PyObject *grid, uint64_t *w)
{
    long long dims[3] = {1, 1, 1};
    if (PyLong_CheckExact(grid)) {
        dims[0] = PyLong_AsLongLong(grid);
    } else if (PyTuple_CheckExact(grid) && PyTuple_GET_SIZE(grid) >= 1 &&
               PyTuple_GET_SIZE(grid) <= 3) {
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(grid); i++) {
            PyObject *item = PyTuple_GET_ITEM(grid, i);
            if (!PyLong_CheckExact(item))
                return 0;
            dims[i] = PyLong_AsLongLong(item);
        }
    } else {
        return 0;
    }
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    for (int i = 0; i < 3; i++) {
        if (dims[i] < 1 || dims[i] > GRID_LIMITS[i])
            return 0;
        w[i] = (uint64_t)dims[i];
    }
    return 1;
}

/* spec: (keywords, keyword types ((name, type), ...), arguments, meta, current_stream,
 *        stream_handle); arguments: one tensor or scalar spec per positional argument. */
PyObject *launch_guarded(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6 || !PyTuple_Check(args[1]) || PyTuple_GET_SIZE(args[1]) != 6 ||
            !PyTuple_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError,
                        "launch_guarded(record, spec, grid, args, kwargs, stream)");
        return NULL;
    }
    launch_record *r = record_of(args[0]);
    if (r == NULL)
        return NULL;
    uint64_t words[MAX_GUARDED_WORDS];
    size_t count = (size_t)r->grid_slot + 5;
    if (count > MAX_GUARDED_WORDS)
        Py_RETURN_FALSE;
    words[r->grid_slot + 3] = r->words[r->grid_slot + 3];  /* dynamic shared bytes */
    PyObject *spec = args[1], *grid = args[2], *call = args[3], *kwargs = args[4];
    PyObject *arg_specs = PyTuple_GET_ITEM(spec, 2);
    Py_ssize_t n = PyTuple_GET_SIZE(arg_specs);
    if (PyTuple_GET_SIZE(call) != n)
        Py_RETURN_FALSE;
    /* Keywords: equal to the spec's, each of the same type. */
    PyObject *want = PyTuple_GET_ITEM(spec, 0), *kinds = PyTuple_GET_ITEM(spec, 1);
    if (kwargs == Py_None || !PyDict_Check(kwargs))
        Py_RETURN_FALSE;
    int eq = PyDict_GET_SIZE(kwargs) == 0 && PyDict_GET_SIZE(want) == 0 ? 1 :
        PyObject_RichCompareBool(kwargs, want, Py_EQ);
    if (eq < 0)
        return NULL;
    if (!eq)
        Py_RETURN_FALSE;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(kinds); i++) {
        PyObject *pair = PyTuple_GET_ITEM(kinds, i);
        PyObject *value = PyDict_GetItemWithError(kwargs, PyTuple_GET_ITEM(pair, 0));
        if (value == NULL) {
            if (PyErr_Occurred())
                return NULL;
            Py_RETURN_FALSE;
        }
        if ((PyObject *)Py_TYPE(value) != PyTuple_GET_ITEM(pair, 1))
            Py_RETURN_FALSE;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *arg_spec = PyTuple_GET_ITEM(arg_specs, i);
        PyObject *a = PyTuple_GET_ITEM(call, i);
        int done = PyLong_AsLong(PyTuple_GET_ITEM(arg_spec, 0)) == ARG_TENSOR ?
            put_tensor(a, arg_spec, words) : put_scalar(a, arg_spec, words);
        if (done < 0)
            return NULL;
        if (done == 0)
            Py_RETURN_FALSE;
    }
    PyObject *called = NULL;
    if (PyCallable_Check(grid)) {
        grid = called = PyObject_CallOneArg(grid, PyTuple_GET_ITEM(spec, 3));
        if (grid == NULL)
            return NULL;
    }
    int fits = put_grid(grid, words + r->grid_slot);
    Py_XDECREF(called);
    if (!fits)
        Py_RETURN_FALSE;
    PyObject *stream = args[5], *handle;
    if (stream == Py_None)
        handle = PyObject_CallNoArgs(PyTuple_GET_ITEM(spec, 4));
    else
        handle = PyObject_CallOneArg(PyTuple_GET_ITEM(spec, 5), stream);
    if (handle == NULL)
        return NULL;
    uint64_t h = 0;
    if (handle != Py_None) {
        h = PyLong_AsUnsignedLongLong(handle);
        if (h == (uint64_t)-1 && PyErr_Occurred()) {
            Py_DECREF(handle);
            return NULL;
        }
    }
    Py_DECREF(handle);
    words[r->grid_slot + 4] = h;
    memcpy(r->words, words, count * sizeof(uint64_t));  /* no Python code from here on */
    PyObject *result = finish(launch_in_context(r));
    if (result == NULL)
        return NULL;
    Py_DECREF(result);
    Py_RETURN_TRUE;
}

/* --- guard_values: a library plan's guard (kiln.kernels.plan_guard) in one C call ---------
 *
 * spec: one entry per value: None (the value must be None), (GUARD_VALUE, type, constant)
 * (type(v) is type and v == constant), (GUARD_TENSOR, type, shape, dtype, device, strides)
 * (type(v) is type, v.shape == shape, v.dtype is dtype, v.is_contiguous() when strides is
 * None else v.stride() == strides, v.get_device() == device), or (GUARD_CHECKED, type):
 * type(v) is type, and the value is passed, with the other such values in order, to the
 * checker given after the spec (one call, made last: torch's C++ tensor guard, which reads
 * the tensors' metadata directly). */

static PyObject *s_is_contiguous, *s_get_device;

/* 1 the value matches its entry, 0 not, -1 error. */
static int guard_one(PyObject *entry, PyObject *v)
{
    if (entry == Py_None)
        return v == Py_None;
    if ((PyObject *)Py_TYPE(v) != PyTuple_GET_ITEM(entry, 1))
        return 0;
    if (PyLong_AsLong(PyTuple_GET_ITEM(entry, 0)) == GUARD_VALUE)
        return PyObject_RichCompareBool(v, PyTuple_GET_ITEM(entry, 2), Py_EQ);
    PyObject *got = PyObject_GetAttr(v, s_shape);
    if (got == NULL)
        return -1;
    int ok = same(got, PyTuple_GET_ITEM(entry, 2));
    Py_DECREF(got);
    if (ok != 1)
        return ok;
    got = PyObject_GetAttr(v, s_dtype);
    if (got == NULL)
        return -1;
    ok = got == PyTuple_GET_ITEM(entry, 3);
    Py_DECREF(got);
    if (!ok)
        return 0;
    PyObject *strides = PyTuple_GET_ITEM(entry, 5);
    got = PyObject_CallMethodNoArgs(v, strides == Py_None ? s_is_contiguous : s_stride);
    if (got == NULL)
        return -1;
    ok = strides == Py_None ? PyObject_IsTrue(got) : same(got, strides);
    Py_DECREF(got);
    if (ok != 1)
        return ok;
    got = PyObject_CallMethodNoArgs(v, s_get_device);
    if (got == NULL)
        return -1;
    ok = same(got, PyTuple_GET_ITEM(entry, 4));
    Py_DECREF(got);
    return ok;
}

enum { MAX_CHECKED = 64 };  /* GUARD_CHECKED values of one guard */

/* guard_values(spec, [checker,] values): True when every value matches its entry (and the
 * checker passes the GUARD_CHECKED ones), else False. */
PyObject *guard_values(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if ((nargs != 2 && nargs != 3) || !PyTuple_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "guard_values(spec, [checker,] values)");
        return NULL;
    }
    PyObject *spec = args[0], *values = args[nargs - 1];
    PyObject *checker = nargs == 3 ? args[1] : NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(spec), checked = 0;
    PyObject *deferred[MAX_CHECKED];
    if (!PyTuple_Check(values) || PyTuple_GET_SIZE(values) != n)
        Py_RETURN_FALSE;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *entry = PyTuple_GET_ITEM(spec, i), *value = PyTuple_GET_ITEM(values, i);
        if (entry != Py_None && PyTuple_GET_SIZE(entry) == 2) {  /* (GUARD_CHECKED, type) */
            if (checker == NULL || checked == MAX_CHECKED) {
                PyErr_SetString(PyExc_ValueError, "guard_values: no checker for this spec");
                return NULL;
            }
            if ((PyObject *)Py_TYPE(value) != PyTuple_GET_ITEM(entry, 1))
                Py_RETURN_FALSE;  /* the checker only ever sees values of the spec's types */
            deferred[checked++] = value;
            continue;
        }
        int ok = guard_one(entry, value);
        if (ok < 0)
            return NULL;
        if (!ok)
            Py_RETURN_FALSE;
    }
    if (checked == 0)
        Py_RETURN_TRUE;
    PyObject *result = PyObject_Vectorcall(checker, deferred, (size_t)checked, NULL);
    if (result == NULL)
        return NULL;
    int ok = PyObject_IsTrue(result);
    Py_DECREF(result);
    if (ok < 0)
        return NULL;
    return PyBool_FromLong(ok);
}

int guard_init(void)
{
    s_dtype = PyUnicode_InternFromString("dtype");
    s_shape = PyUnicode_InternFromString("shape");
    s_stride = PyUnicode_InternFromString("stride");
    s_is_cuda = PyUnicode_InternFromString("is_cuda");
    s_data_ptr = PyUnicode_InternFromString("data_ptr");
    s_is_contiguous = PyUnicode_InternFromString("is_contiguous");
    s_get_device = PyUnicode_InternFromString("get_device");
    return s_dtype && s_shape && s_stride && s_is_cuda && s_data_ptr && s_is_contiguous &&
           s_get_device ? 0 : -1;
}
