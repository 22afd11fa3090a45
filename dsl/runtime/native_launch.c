/* Kiln's native launch shim: one Python call -> cuLaunchKernel / cuLaunchKernelEx.
 *
 * Built by kiln.runtime.native at first use with the system C compiler and cached in the
 * owner-only cache directory (content-addressed, digest-checked before loading). It never
 * links against libcuda: every driver entry point arrives as an address in the launch record
 * that kiln.runtime.driver_launch fills once per argument block (so a no-op "driver" can
 * stand in on machines without a GPU). The record's layout is mirrored by the ctypes
 * structure _Record there; RECORD_BYTES lets Python check that both agree.
 */
#include "native_launch.h"

enum { CUDA_ERROR_INVALID_CONTEXT = 201 };

static PyObject *error_handler = NULL;
static PyObject *s_data_ptr = NULL;
torch_view_fn read_torch_view = NULL;

static int launch_once(launch_record *r)
{
    const uint64_t *w = r->words + r->grid_slot;
    unsigned gx = (unsigned)w[0], gy = (unsigned)w[1], gz = (unsigned)w[2];
    unsigned shared_bytes = (unsigned)(uint32_t)w[3];
    void *stream = (void *)(uintptr_t)w[4];
    if (r->config != NULL) {
        launch_config *c = r->config;
        c->grid_x = gx; c->grid_y = gy; c->grid_z = gz;
        c->shared_bytes = shared_bytes;
        c->stream = stream;
        int code = r->launch_ex(c, r->function, r->params, NULL);
        if (code == 0 || !r->plain_fallback)
            return code;
    }
    return r->launch(r->function, gx, gy, gz, r->block[0], r->block[1], r->block[2],
                     shared_bytes, stream, r->params, NULL);
}

/* A thread with no current context gets the module's; one with another context current
 * (another device's) launches inside a push/pop of it, as MLIR's wrappers always do. */
int launch_in_context(launch_record *r)
{
    int code = launch_once(r);
    if (code == 0 || r->context == NULL)
        return code;
    if (code == CUDA_ERROR_INVALID_CONTEXT && r->set_current(r->context) == 0)
        return launch_once(r);
    if (r->push_current(r->context) != 0)
        return code;
    code = launch_once(r);
    void *previous = NULL;
    r->pop_current(&previous);
    return code;
}

PyObject *finish(int code)
{
    if (code == 0)
        Py_RETURN_NONE;
    if (error_handler == NULL) {
        PyErr_Format(PyExc_RuntimeError, "CUDA launch failed with error %d", code);
        return NULL;
    }
    PyObject *result = PyObject_CallFunction(error_handler, "i", code);
    if (result == NULL)
        return NULL;
    Py_DECREF(result);
    Py_RETURN_NONE;
}

launch_record *record_of(PyObject *address)
{
    void *record = PyLong_AsVoidPtr(address);
    if (record == NULL && !PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "null launch record");
    return (launch_record *)record;
}

/* launch(record_address): launch with the slots as they are. */
static PyObject *launch(PyObject *self, PyObject *address)
{
    launch_record *r = record_of(address);
    if (r == NULL)
        return NULL;
    return finish(launch_in_context(r));
}

/* Write each address into its slot (a tensor's allocated and aligned pointers, or one word;
 * with `mapped`, a tensor map's tensor address becomes its memoised descriptor's) and the
 * stream: 1 done, 0 a memo miss (nothing launched). No Python code runs here, so the words
 * written and the launch that follows are one step under the GIL. */
static int put_values(launch_record *r, const uint64_t *values, uint64_t stream, int mapped)
{
    if (mapped && *r->evictions != r->memo_evictions)
        return 0;
    for (uint32_t i = 0; i < r->pointer_count; i++) {
        uint64_t value = values[i];
        int32_t slot = r->pointer_slots[i];
        if (slot >= 0) {
            r->words[slot] = value;
            r->words[slot + 1] = value;
            continue;
        }
        if (mapped) {
            const uint64_t *entry = memo_entry(r, i, value);
            if (entry[0] != value || entry[1] == 0)
                return 0;
            value = entry[1];
        }
        r->words[~slot] = value;
    }
    r->words[r->grid_slot + 4] = stream;
    return 1;
}

/* A stream argument (None: 0) as a handle; -1 with an error set. */
int stream_of(PyObject *stream, uint64_t *handle)
{
    *handle = 0;
    if (stream == Py_None)
        return 0;
    *handle = PyLong_AsUnsignedLongLong(stream);
    return *handle == (uint64_t)-1 && PyErr_Occurred() ? -1 : 0;
}

/* put_values of args[2:] (Python ints) with the stream args[1]: 1, 0 (a memo miss), -1. */
static int put_pointers(launch_record *r, PyObject *const *args, Py_ssize_t nargs, int mapped)
{
    if ((size_t)(nargs - 2) != r->pointer_count || nargs - 2 > MAX_POINTERS) {
        PyErr_Format(PyExc_TypeError, "this launch binds %u addresses, got %zd",
                     r->pointer_count, nargs - 2);
        return -1;
    }
    uint64_t stream, values[MAX_POINTERS];
    if (stream_of(args[1], &stream) < 0)
        return -1;
    for (Py_ssize_t i = 0; i < nargs - 2; i++) {
        values[i] = PyLong_AsUnsignedLongLong(args[i + 2]);
        if (values[i] == (uint64_t)-1 && PyErr_Occurred())
            return -1;
    }
    return put_values(r, values, stream, mapped);
}

static launch_record *checked_record(PyObject *const *args, Py_ssize_t nargs, const char *usage)
{
    if (nargs < 2) {
        PyErr_SetString(PyExc_TypeError, usage);
        return NULL;
    }
    return record_of(args[0]);
}

/* launch_pointers(record_address, stream, *addresses): write the addresses (a tensor map's
 * descriptor address for its slot) and the stream, launch. */
static PyObject *launch_pointers(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    launch_record *r = checked_record(args, nargs, "launch_pointers(record, stream, *addresses)");
    if (r == NULL || put_pointers(r, args, nargs, 0) < 0)
        return NULL;
    return finish(launch_in_context(r));
}

/* launch_mapped(record_address, stream, *addresses): launch_pointers with each tensor map's
 * tensor address, looked up in the record's memo: True launched, False a miss or a stale
 * memo (nothing launched; the caller encodes, memo_store()s and uses launch_pointers). */
static PyObject *launch_mapped(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    launch_record *r = checked_record(args, nargs, "launch_mapped(record, stream, *addresses)");
    if (r == NULL)
        return NULL;
    if (r->map_memo == NULL) {
        PyErr_SetString(PyExc_ValueError, "this launch record has no descriptor memo");
        return NULL;
    }
    int put = put_pointers(r, args, nargs, 1);
    if (put < 0)
        return NULL;
    if (put == 0)
        Py_RETURN_FALSE;
    PyObject *result = finish(launch_in_context(r));
    if (result == NULL)
        return NULL;
    Py_DECREF(result);
    Py_RETURN_TRUE;
}

/* launch_direct(record_address, fallback, stream, *addresses): a bound launch in one C call,
 * what BoundLaunch.launch_on partially applies to its record and fallback: launch_mapped for
 * a record with a descriptor memo, launch_pointers for one without; on a memo miss it returns
 * fallback(stream, *addresses), which encodes and launches in Python. */
static PyObject *launch_direct(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 3) {
        PyErr_SetString(PyExc_TypeError, "launch_direct(record, fallback, stream, *addresses)");
        return NULL;
    }
    launch_record *r = record_of(args[0]);
    if (r == NULL)
        return NULL;
    PyObject *const *call = args + 1;  /* (record, stream, *addresses) for put_pointers */
    int put = put_pointers(r, call, nargs - 1, r->map_memo != NULL);
    if (put < 0)
        return NULL;
    if (put == 0)
        return PyObject_Vectorcall(args[1], args + 2, (size_t)(nargs - 2), NULL);
    return finish(launch_in_context(r));
}

/* Write values (one address per pointer slot) and the stream handle into r and launch; on a
 * descriptor memo miss call fallback(stream, *addresses) instead (it encodes and launches in
 * Python). New reference to None, or NULL with the error set. */
PyObject *launch_values(launch_record *r, PyObject *fallback, PyObject *stream,
                        const uint64_t *values, uint64_t handle)
{
    if (put_values(r, values, handle, r->map_memo != NULL))
        return finish(launch_in_context(r));
    Py_ssize_t count = (Py_ssize_t)r->pointer_count, built = 0;
    PyObject *call[MAX_POINTERS + 1];
    call[0] = stream;
    for (; built < count; built++) {
        call[built + 1] = PyLong_FromUnsignedLongLong(values[built]);
        if (call[built + 1] == NULL)
            break;
    }
    PyObject *result = built == count ?
        PyObject_Vectorcall(fallback, call, (size_t)count + 1, NULL) : NULL;
    for (Py_ssize_t i = 0; i < built; i++)
        Py_DECREF(call[i + 1]);
    return result;
}

/* The fresh outputs of launch_outputs: a tuple of makers, each called with no argument (one
 * maker: its tensor alone, else the tuple of tensors), or one callable given the stream
 * (it returns a tensor or a tuple of tensors). New reference, NULL on error. */
PyObject *make_outputs(PyObject *outputs, PyObject *stream)
{
    if (!PyTuple_Check(outputs))
        return PyObject_CallOneArg(outputs, stream);
    Py_ssize_t n = PyTuple_GET_SIZE(outputs);
    if (n == 1)
        return PyObject_CallNoArgs(PyTuple_GET_ITEM(outputs, 0));
    PyObject *made = PyTuple_New(n);
    for (Py_ssize_t i = 0; made != NULL && i < n; i++) {
        PyObject *tensor = PyObject_CallNoArgs(PyTuple_GET_ITEM(outputs, i));
        if (tensor == NULL)
            Py_CLEAR(made);
        else
            PyTuple_SET_ITEM(made, i, tensor);
    }
    return made;
}

/* An item's address: an int as it is, a torch tensor's through the torch bridge, else
 * item.data_ptr(). 0 done, -1 error. */
int address_of(PyObject *item, uint64_t *value)
{
    torch_view view;
    if (PyLong_CheckExact(item)) {
        *value = PyLong_AsUnsignedLongLong(item);
    } else if (read_torch_view != NULL && read_torch_view(item, &view)) {
        *value = view.data;
        return 0;
    } else {
        PyObject *pointer = PyObject_CallMethodNoArgs(item, s_data_ptr);
        if (pointer == NULL)
            return -1;
        *value = PyLong_AsUnsignedLongLong(pointer);
        Py_DECREF(pointer);
    }
    return *value == (uint64_t)-1 && PyErr_Occurred() ? -1 : 0;
}

/* launch_outputs(record_address, fallback, outputs, stream, *items): a library call's
 * steady state in one C call: make the fresh outputs (make_outputs), take each item's
 * address (an int as it is, a tensor's data_ptr(), None the next output's), write them and
 * the stream, launch (on a descriptor memo miss: fallback(stream, *addresses)), and return
 * the outputs. */
static PyObject *launch_outputs(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 4) {
        PyErr_SetString(PyExc_TypeError,
                        "launch_outputs(record, fallback, outputs, stream, *items)");
        return NULL;
    }
    launch_record *r = record_of(args[0]);
    if (r == NULL)
        return NULL;
    Py_ssize_t count = nargs - 4;
    if ((size_t)count != r->pointer_count || count > MAX_POINTERS) {
        PyErr_Format(PyExc_TypeError, "this launch binds %u addresses, got %zd",
                     r->pointer_count, count);
        return NULL;
    }
    uint64_t stream, values[MAX_POINTERS];
    if (stream_of(args[3], &stream) < 0)
        return NULL;
    PyObject *made = make_outputs(args[2], args[3]);
    if (made == NULL)
        return NULL;
    PyObject *const *outs = &made;
    Py_ssize_t n_outs = 1, next = 0;
    if (PyTuple_Check(made)) {
        outs = &PyTuple_GET_ITEM(made, 0);
        n_outs = PyTuple_GET_SIZE(made);
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = args[4 + i];
        if (item == Py_None) {
            if (next == n_outs) {
                PyErr_SetString(PyExc_ValueError, "launch_outputs: more None items than outputs");
                goto error;
            }
            item = outs[next++];
        }
        if (address_of(item, &values[i]) < 0)
            goto error;
    }
    PyObject *result = launch_values(r, args[1], args[3], values, stream);
    if (result == NULL)
        goto error;
    Py_DECREF(result);
    return made;
error:
    Py_DECREF(made);
    return NULL;
}

/* memo_store(record_address, position, tensor_address, descriptor_address): remember the
 * descriptor of the tensor at that address position (replacing its way's entry); a stale
 * memo (the cache evicted since) is emptied first. */
static PyObject *memo_store(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "memo_store(record, position, address, descriptor)");
        return NULL;
    }
    launch_record *r = record_of(args[0]);
    if (r == NULL)
        return NULL;
    Py_ssize_t position = PyLong_AsSsize_t(args[1]);
    uint64_t address = PyLong_AsUnsignedLongLong(args[2]);
    uint64_t descriptor = PyLong_AsUnsignedLongLong(args[3]);
    if (PyErr_Occurred())
        return NULL;
    if (position < 0 || (size_t)position >= r->pointer_count || r->map_memo == NULL) {
        PyErr_SetString(PyExc_ValueError, "no memo at this address position");
        return NULL;
    }
    if (*r->evictions != r->memo_evictions) {
        memset(r->map_memo, 0, 2 * sizeof(uint64_t) * MEMO_WAYS * r->pointer_count);
        r->memo_evictions = *r->evictions;
    }
    uint64_t *entry = memo_entry(r, position, address);
    entry[0] = address;
    entry[1] = descriptor;
    Py_RETURN_NONE;
}

/* set_torch_view(capsule): the torch bridge's tensor reader (kiln.runtime.native_torch);
 * None: read tensors through their Python attributes again. */
static PyObject *set_torch_view(PyObject *self, PyObject *capsule)
{
    if (capsule == Py_None) {
        read_torch_view = NULL;
        Py_RETURN_NONE;
    }
    void *reader = PyCapsule_GetPointer(capsule, "kiln.torch_view");
    if (reader == NULL)
        return NULL;
    read_torch_view = (torch_view_fn)reader;
    Py_RETURN_NONE;
}

/* set_error_handler(callable): called with the CUresult of a failed launch; it raises. */
static PyObject *set_error_handler(PyObject *self, PyObject *handler)
{
    Py_XINCREF(handler);
    Py_XSETREF(error_handler, handler);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"launch", launch, METH_O, "launch(record_address): launch with the record's slots."},
    {"launch_pointers", (PyCFunction)(void (*)(void))launch_pointers, METH_FASTCALL,
     "launch_pointers(record_address, stream, *addresses): write the addresses, launch."},
    {"launch_mapped", (PyCFunction)(void (*)(void))launch_mapped, METH_FASTCALL,
     "launch_mapped(record_address, stream, *addresses): launch_pointers with tensor maps "
     "looked up in the record's memo (True), or nothing on a miss (False)."},
    {"launch_direct", (PyCFunction)(void (*)(void))launch_direct, METH_FASTCALL,
     "launch_direct(record_address, fallback, stream, *addresses): launch_mapped (or "
     "launch_pointers) that calls fallback(stream, *addresses) on a memo miss."},
    {"launch_outputs", (PyCFunction)(void (*)(void))launch_outputs, METH_FASTCALL,
     "launch_outputs(record_address, fallback, outputs, stream, *items): make the fresh "
     "outputs, launch with the items' addresses (None: the next output's), return them."},
    {"memo_store", (PyCFunction)(void (*)(void))memo_store, METH_FASTCALL,
     "memo_store(record_address, position, address, descriptor): memoise a descriptor."},
    {"launch_guarded", (PyCFunction)(void (*)(void))launch_guarded, METH_FASTCALL,
     "launch_guarded(record, spec, grid, args, kwargs, stream): kernel[grid](...) if it "
     "matches the spec (True), else False."},
    {"guard_values", (PyCFunction)(void (*)(void))guard_values, METH_FASTCALL,
     "guard_values(spec, [checker,] values): whether values match a plan guard's spec."},
    {"call_plan", (PyCFunction)(void (*)(void))call_plan, METH_FASTCALL,
     "call_plan(entries, checker, aligns, makers, result, stream, workspace, launches): a "
     "library plan's steady-state call in one C call (native_call.c)."},
    {"set_torch_view", set_torch_view, METH_O,
     "set_torch_view(capsule or None): read torch tensors through the torch bridge or not."},
    {"set_error_handler", set_error_handler, METH_O,
     "set_error_handler(callable): what a failed launch calls with its CUresult."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kiln_launch", "Kiln's native launch shim.", -1, methods,
};

PyMODINIT_FUNC PyInit__kiln_launch(void)
{
    if (guard_init() != 0 || call_plan_init() != 0)
        return NULL;
    s_data_ptr = PyUnicode_InternFromString("data_ptr");
    if (s_data_ptr == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddIntConstant(m, "RECORD_BYTES", sizeof(launch_record)) < 0 ||
                      PyModule_AddIntConstant(m, "MEMO_WAYS", MEMO_WAYS) < 0 ||
                      PyModule_AddIntConstant(m, "TORCH_VIEW_BYTES", sizeof(torch_view)) < 0 ||
                      PyModule_AddIntConstant(m, "GUARD_VALUE", GUARD_VALUE) < 0 ||
                      PyModule_AddIntConstant(m, "GUARD_TENSOR", GUARD_TENSOR) < 0 ||
                      PyModule_AddIntConstant(m, "GUARD_CHECKED", GUARD_CHECKED) < 0 ||
                      PyModule_AddIntConstant(m, "CALL_VALUE", CALL_VALUE) < 0 ||
                      PyModule_AddIntConstant(m, "CALL_TENSOR", CALL_TENSOR) < 0 ||
                      PyModule_AddIntConstant(m, "CALL_CONST", CALL_CONST) < 0 ||
                      PyModule_AddIntConstant(m, "CALL_INPUT", CALL_INPUT) < 0 ||
                      PyModule_AddIntConstant(m, "CALL_OUTPUT", CALL_OUTPUT) < 0 ||
                      PyModule_AddIntConstant(m, "CALL_SPACE", CALL_SPACE) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
