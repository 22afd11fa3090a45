/* Kiln's native launch shim: one Python call -> cuLaunchKernel / cuLaunchKernelEx.
 *
 * Built by kiln.runtime.native at first use with the system C compiler and cached in the
 * owner-only cache directory (content-addressed, digest-checked before loading). It never
 * links against libcuda: every driver entry point arrives as an address in the launch record
 * that kiln.runtime.driver_launch fills once per argument block (so a no-op "driver" can
 * stand in on machines without a GPU). The record's layout is mirrored by the ctypes
 * structure _Record there; RECORD_BYTES lets Python check that both agree.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef int (*launch_kernel_fn)(void *function, unsigned gx, unsigned gy, unsigned gz,
                                unsigned bx, unsigned by, unsigned bz, unsigned shared_bytes,
                                void *stream, void **params, void **extra);
typedef int (*launch_kernel_ex_fn)(const void *config, void *function, void **params,
                                   void **extra);
typedef int (*context_fn)(void *context);
typedef int (*pop_context_fn)(void **context);

/* CUlaunchConfig (cuda.h). */
typedef struct {
    uint32_t grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_bytes;
    void *stream;
    void *attrs;
    uint32_t num_attrs;
} launch_config;

typedef struct {
    void *function;                 /* CUfunction, loaded once per specialisation */
    launch_kernel_fn launch;        /* cuLaunchKernel */
    launch_kernel_ex_fn launch_ex;  /* cuLaunchKernelEx, used when config is set */
    context_fn set_current;         /* cuCtxSetCurrent */
    context_fn push_current;        /* cuCtxPushCurrent */
    pop_context_fn pop_current;     /* cuCtxPopCurrent */
    void *context;                  /* the primary context the module was loaded in */
    launch_config *config;          /* cluster / programmatic launch attributes, or NULL */
    uint64_t *words;                /* flat arguments, then grid x y z, shared bytes, stream */
    void **params;                  /* &words[i] for each kernel parameter */
    const int32_t *pointer_slots;   /* launch_pointers: slot per address, ~slot: one word */
    uint32_t pointer_count;
    uint32_t grid_slot;
    uint32_t block[3];
    uint32_t plain_fallback;        /* programmatic: plain launch when the attribute is refused */
} launch_record;

enum { CUDA_ERROR_INVALID_CONTEXT = 201 };

static PyObject *error_handler = NULL;

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
static int launch_in_context(launch_record *r)
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

static PyObject *finish(int code)
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

static launch_record *record_of(PyObject *address)
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

/* launch_pointers(record_address, stream, *addresses): write each address into its slot
 * (a tensor's allocated and aligned pointers, or one word), the stream (None: 0), launch. */
static PyObject *launch_pointers(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 2) {
        PyErr_SetString(PyExc_TypeError, "launch_pointers(record, stream, *addresses)");
        return NULL;
    }
    launch_record *r = record_of(args[0]);
    if (r == NULL)
        return NULL;
    if ((size_t)(nargs - 2) != r->pointer_count) {
        PyErr_Format(PyExc_TypeError, "this launch binds %u addresses, got %zd",
                     r->pointer_count, nargs - 2);
        return NULL;
    }
    uint64_t stream = 0;
    if (args[1] != Py_None) {
        stream = PyLong_AsUnsignedLongLong(args[1]);
        if (PyErr_Occurred())
            return NULL;
    }
    for (Py_ssize_t i = 0; i < nargs - 2; i++) {
        uint64_t value = PyLong_AsUnsignedLongLong(args[i + 2]);
        if (value == (uint64_t)-1 && PyErr_Occurred())
            return NULL;
        int32_t slot = r->pointer_slots[i];
        if (slot >= 0) {
            r->words[slot] = value;
            r->words[slot + 1] = value;
        } else {
            r->words[~slot] = value;
        }
    }
    r->words[r->grid_slot + 4] = stream;
    return finish(launch_in_context(r));
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
    {"set_error_handler", set_error_handler, METH_O,
     "set_error_handler(callable): what a failed launch calls with its CUresult."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kiln_launch", "Kiln's native launch shim.", -1, methods,
};

PyMODINIT_FUNC PyInit__kiln_launch(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "RECORD_BYTES", sizeof(launch_record)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
