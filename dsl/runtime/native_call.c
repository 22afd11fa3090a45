/* Kiln's native launch shim, its library half: a library plan's whole steady-state call in one
 * C call (kiln.kernels.one_call builds them; docs/lowering.md, "One call a library call").
 *
 * call_plan(entries, checker, aligns, makers, result, stream, workspace, launches) makes a
 * CallPlan: a callable of an entry point's values (its tensors and options, in a fixed order)
 * that checks them against the plan's guard, reads the current stream, takes the plan's
 * internal buffers for that stream, makes the fresh outputs, launches each kernel of the call
 * with its addresses and returns the outputs; or returns None, having done nothing, when the
 * values are not the plan's (the entry point then takes its Python path, which reports what
 * is wrong). Only the stream getter, the workspace getter, the makers and the tensor checker
 * are Python-level calls, each a C function where the torch bridge or torch provides one.
 *
 *   entries   one per value: None (the value must be None), (CALL_VALUE, type, constant)
 *             (type(v) is type and v == constant) or (CALL_TENSOR, type): type(v) is type,
 *             and the value goes, with the other tensors in order, to checker (the torch
 *             bridge's tensor_guard of the example tensors: sizes, strides, dtype, device)
 *   aligns    ((value index, bytes), ...): tensor addresses that must be multiples of bytes
 *   makers    launch_outputs' outputs (a tuple of makers), or None for a call with no fresh
 *             output
 *   result    None: return what the makers made; else a tuple of value indices to return
 *   stream    a callable giving the current stream's handle
 *   workspace None, or (getter, capturing, keep, count): getter(stream) gives (owners,
 *             addresses) of the plan's internal buffers, at least count addresses
 *             (kiln.kernels.workspaces.StreamWorkspaces.get); the set of one stream is kept
 *             here while the stream captures nothing (capturing() is false, or capturing is
 *             the address of cuStreamIsCapturing and it says so) and keep is true
 *   launches  ((record address, fallback, items[, owner]), ...), launched in order; an item
 *             is (CALL_CONST, address), (CALL_INPUT, value index), (CALL_OUTPUT, output index)
 *             or (CALL_SPACE, workspace address index), one per address of the bound launch;
 *             owner (the bound launch, which keeps the kernel's module loaded) is only held
 */
#include "native_launch.h"

#include <stddef.h>
#include <structmember.h>

enum { MAX_VALUES = 32, MAX_LAUNCHES = 4, MAX_SPACES = 16, MAX_ALIGNS = 8 };

typedef struct {
    int32_t kind;
    uint64_t value;
} call_item;

typedef int (*capture_status_fn)(void *stream, int *status);  /* cuStreamIsCapturing */

typedef struct {
    launch_record *record;
    PyObject *fallback;
    Py_ssize_t count;
    call_item items[MAX_POINTERS];
} call_launch;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *spec;     /* the constructor's arguments: the references below are borrowed */
    PyObject *ws_held;  /* the workspace set kept for ws_stream, or NULL */
    uint64_t ws_stream;
    uint64_t ws_values[MAX_SPACES];
    Py_ssize_t n_values, n_aligns, n_launches, ws_count;
    int32_t kinds[MAX_VALUES];
    PyObject *types[MAX_VALUES], *constants[MAX_VALUES];
    Py_ssize_t align_index[MAX_ALIGNS];
    uint64_t align_bytes[MAX_ALIGNS];
    PyObject *checker, *makers, *result, *stream, *ws_getter, *ws_capturing;
    capture_status_fn ws_status;  /* cuStreamIsCapturing, or NULL: ws_capturing is asked */
    int ws_keep;
    unsigned long long hits;  /* calls served (the benches report it) */
    call_launch *launches;
} CallPlan;

static PyTypeObject CallPlanType;

/* 1 the values are the plan's, 0 not (or a value could not be compared), -1 error. */
static int values_match(CallPlan *p, PyObject *const *args)
{
    PyObject *tensors[MAX_VALUES];
    Py_ssize_t checked = 0;
    for (Py_ssize_t i = 0; i < p->n_values; i++) {
        PyObject *v = args[i];
        if (p->kinds[i] == CALL_NONE) {
            if (v != Py_None)
                return 0;
            continue;
        }
        if ((PyObject *)Py_TYPE(v) != p->types[i])
            return 0;
        if (p->kinds[i] == CALL_TENSOR) {
            tensors[checked++] = v;
            continue;
        }
        if (v != p->constants[i]) {
            int eq = PyObject_RichCompareBool(v, p->constants[i], Py_EQ);
            if (eq < 0)
                PyErr_Clear();  /* an odd __eq__: the Python path decides */
            if (eq != 1)
                return 0;
        }
    }
    if (checked > 0) {
        PyObject *ok = PyObject_Vectorcall(p->checker, tensors, (size_t)checked, NULL);
        if (ok == NULL)
            return -1;
        int passed = ok == Py_True;
        Py_DECREF(ok);
        if (!passed)
            return 0;
    }
    for (Py_ssize_t i = 0; i < p->n_aligns; i++) {
        uint64_t address;
        if (address_of(args[p->align_index[i]], &address) < 0)
            return -1;
        if (address % p->align_bytes[i])
            return 0;
    }
    return 1;
}

/* The workspace addresses for a call on stream (handle): the kept set, or the getter's
 * (*held: a new reference the caller drops once its launches are queued). 0 / -1. */
static int workspace_of(CallPlan *p, PyObject *stream, uint64_t handle, uint64_t *values,
                        PyObject **held)
{
    *held = NULL;
    int eager, status = 0;
    if (p->ws_status != NULL) {  /* an error (an implicit capture) counts as capturing */
        eager = p->ws_status((void *)(uintptr_t)handle, &status) == 0 && status == 0;
    } else {
        PyObject *capturing = PyObject_CallNoArgs(p->ws_capturing);
        if (capturing == NULL)
            return -1;
        eager = capturing == Py_False;
        Py_DECREF(capturing);
    }
    if (eager && p->ws_held != NULL && p->ws_stream == handle) {
        memcpy(values, p->ws_values, sizeof(uint64_t) * (size_t)p->ws_count);
        return 0;
    }
    PyObject *got = PyObject_CallOneArg(p->ws_getter, stream);
    if (got == NULL)
        return -1;
    PyObject *addresses = PyTuple_Check(got) && PyTuple_GET_SIZE(got) == 2 ?
        PyTuple_GET_ITEM(got, 1) : NULL;
    if (addresses == NULL || !PyTuple_Check(addresses) ||
            PyTuple_GET_SIZE(addresses) < p->ws_count) {
        Py_DECREF(got);
        PyErr_SetString(PyExc_TypeError, "a call plan's workspace getter must give (owners, "
                        "addresses) with one address per workspace item");
        return -1;
    }
    for (Py_ssize_t i = 0; i < p->ws_count; i++) {
        values[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(addresses, i));
        if (values[i] == (uint64_t)-1 && PyErr_Occurred()) {
            Py_DECREF(got);
            return -1;
        }
    }
    if (eager && p->ws_keep) {  /* the stream's set for every later eager call on it */
        Py_XSETREF(p->ws_held, Py_NewRef(got));
        p->ws_stream = handle;
        memcpy(p->ws_values, values, sizeof(uint64_t) * (size_t)p->ws_count);
    }
    *held = got;
    return 0;
}

static int launch_all(CallPlan *p, PyObject *const *args, PyObject *made, PyObject *stream,
                      uint64_t handle, const uint64_t *spaces)
{
    PyObject *const *outs = &made;
    Py_ssize_t n_outs = made == NULL ? 0 : 1;
    if (made != NULL && PyTuple_Check(made)) {
        outs = &PyTuple_GET_ITEM(made, 0);
        n_outs = PyTuple_GET_SIZE(made);
    }
    uint64_t values[MAX_POINTERS];
    for (Py_ssize_t l = 0; l < p->n_launches; l++) {
        const call_launch *launch = &p->launches[l];
        for (Py_ssize_t i = 0; i < launch->count; i++) {
            const call_item *item = &launch->items[i];
            if (item->kind == CALL_CONST) {
                values[i] = item->value;
            } else if (item->kind == CALL_SPACE) {
                values[i] = spaces[item->value];
            } else if (item->kind == CALL_INPUT) {
                if (address_of(args[item->value], &values[i]) < 0)
                    return -1;
            } else if ((Py_ssize_t)item->value < n_outs) {
                if (address_of(outs[item->value], &values[i]) < 0)
                    return -1;
            } else {
                PyErr_SetString(PyExc_ValueError, "a call plan's makers gave fewer outputs "
                                "than its launches take");
                return -1;
            }
        }
        PyObject *done = launch_values(launch->record, launch->fallback, stream, values, handle);
        if (done == NULL)
            return -1;
        Py_DECREF(done);
    }
    return 0;
}

static PyObject *call_plan_call(PyObject *self, PyObject *const *args, size_t nargsf,
                                PyObject *kwnames)
{
    CallPlan *p = (CallPlan *)self;
    if (PyVectorcall_NARGS(nargsf) != p->n_values || (kwnames && PyTuple_GET_SIZE(kwnames)))
        Py_RETURN_NONE;
    int match = values_match(p, args);
    if (match <= 0)
        return match < 0 ? NULL : Py_NewRef(Py_None);
    uint64_t handle, spaces[MAX_SPACES];
    PyObject *stream = PyObject_CallNoArgs(p->stream), *held = NULL, *made = NULL;
    if (stream == NULL)
        return NULL;
    if (stream_of(stream, &handle) < 0)
        goto error;
    if (p->ws_getter != NULL && workspace_of(p, stream, handle, spaces, &held) < 0)
        goto error;
    if (p->makers != NULL && (made = make_outputs(p->makers, stream)) == NULL)
        goto error;
    if (launch_all(p, args, made, stream, handle, spaces) < 0)
        goto error;
    Py_XDECREF(held);  /* the launches are queued: the caller's hold on the set ends */
    Py_DECREF(stream);
    p->hits++;
    if (p->result == Py_None)
        return made != NULL ? made : Py_NewRef(Py_None);
    Py_XDECREF(made);
    Py_ssize_t n = PyTuple_GET_SIZE(p->result);
    PyObject *given = PyTuple_New(n);
    for (Py_ssize_t i = 0; given != NULL && i < n; i++)
        PyTuple_SET_ITEM(given, i,
                         Py_NewRef(args[PyLong_AsSsize_t(PyTuple_GET_ITEM(p->result, i))]));
    return given;
error:
    Py_XDECREF(made);
    Py_XDECREF(held);
    Py_DECREF(stream);
    return NULL;
}

/* --- construction ---------------------------------------------------------------------- */

static int bad_spec(const char *what)
{
    if (!PyErr_Occurred())
        PyErr_Format(PyExc_TypeError, "call_plan: %s", what);
    return -1;
}

static int parse_entries(CallPlan *p, PyObject *entries, PyObject *checker)
{
    if (!PyTuple_Check(entries) || PyTuple_GET_SIZE(entries) > MAX_VALUES)
        return bad_spec("entries must be a tuple of at most 32 entries");
    p->n_values = PyTuple_GET_SIZE(entries);
    Py_ssize_t tensors = 0;
    for (Py_ssize_t i = 0; i < p->n_values; i++) {
        PyObject *entry = PyTuple_GET_ITEM(entries, i);
        if (entry == Py_None) {
            p->kinds[i] = CALL_NONE;
            continue;
        }
        Py_ssize_t size = PyTuple_Check(entry) ? PyTuple_GET_SIZE(entry) : 0;
        long kind = size >= 2 ? PyLong_AsLong(PyTuple_GET_ITEM(entry, 0)) : -1;
        if (!((kind == CALL_VALUE && size == 3) || (kind == CALL_TENSOR && size == 2)) ||
                !PyType_Check(PyTuple_GET_ITEM(entry, 1)))
            return bad_spec("an entry is None, (CALL_VALUE, type, constant) or "
                            "(CALL_TENSOR, type)");
        p->kinds[i] = (int32_t)kind;
        p->types[i] = PyTuple_GET_ITEM(entry, 1);
        p->constants[i] = kind == CALL_VALUE ? PyTuple_GET_ITEM(entry, 2) : NULL;
        tensors += kind == CALL_TENSOR;
    }
    if (tensors > 0 && !PyCallable_Check(checker))
        return bad_spec("tensor entries need a checker");
    p->checker = checker;
    return 0;
}

static int parse_pairs(PyObject *pairs, Py_ssize_t limit, const char *what)
{
    if (!PyTuple_Check(pairs) || PyTuple_GET_SIZE(pairs) > limit)
        return bad_spec(what);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(pairs); i++) {
        PyObject *pair = PyTuple_GET_ITEM(pairs, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 ||
                !PyLong_Check(PyTuple_GET_ITEM(pair, 0)) ||
                !PyLong_Check(PyTuple_GET_ITEM(pair, 1)))
            return bad_spec(what);
    }
    return 0;
}

static int parse_launches(CallPlan *p, PyObject *launches)
{
    if (!PyTuple_Check(launches) || PyTuple_GET_SIZE(launches) < 1 ||
            PyTuple_GET_SIZE(launches) > MAX_LAUNCHES)
        return bad_spec("launches must be a tuple of 1 to 4 launches");
    p->n_launches = PyTuple_GET_SIZE(launches);
    p->launches = PyMem_Calloc((size_t)p->n_launches, sizeof(call_launch));
    if (p->launches == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t l = 0; l < p->n_launches; l++) {
        PyObject *spec = PyTuple_GET_ITEM(launches, l);
        if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) < 3 || PyTuple_GET_SIZE(spec) > 4 ||
                !PyCallable_Check(PyTuple_GET_ITEM(spec, 1)))
            return bad_spec("a launch is (record address, fallback, items[, owner])");
        call_launch *launch = &p->launches[l];
        launch->record = record_of(PyTuple_GET_ITEM(spec, 0));
        if (launch->record == NULL)
            return -1;
        launch->fallback = PyTuple_GET_ITEM(spec, 1);
        PyObject *items = PyTuple_GET_ITEM(spec, 2);
        if (parse_pairs(items, MAX_POINTERS, "items must be (kind, value) pairs") < 0)
            return -1;
        launch->count = PyTuple_GET_SIZE(items);
        if ((size_t)launch->count != launch->record->pointer_count)
            return bad_spec("a launch needs one item per address of its bound launch");
        for (Py_ssize_t i = 0; i < launch->count; i++) {
            PyObject *pair = PyTuple_GET_ITEM(items, i);
            long kind = PyLong_AsLong(PyTuple_GET_ITEM(pair, 0));
            uint64_t value = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(pair, 1));
            if (PyErr_Occurred())
                return -1;
            if (kind < CALL_CONST || kind > CALL_SPACE ||
                    (kind == CALL_INPUT && value >= (uint64_t)p->n_values) ||
                    (kind == CALL_SPACE && value >= (uint64_t)p->ws_count))
                return bad_spec("an item's kind or index is out of range");
            launch->items[i].kind = (int32_t)kind;
            launch->items[i].value = value;
        }
    }
    return 0;
}

/* call_plan(entries, checker, aligns, makers, result, stream, workspace, launches): see the
 * file's docs. */
PyObject *call_plan(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "call_plan(entries, checker, aligns, makers, result, "
                        "stream, workspace, launches)");
        return NULL;
    }
    CallPlan *p = PyObject_GC_New(CallPlan, &CallPlanType);
    if (p == NULL)
        return NULL;
    p->vectorcall = call_plan_call;
    p->spec = PyTuple_New(nargs);
    p->ws_held = NULL;
    p->launches = NULL;
    p->n_values = -1;  /* no call matches until the spec is parsed */
    p->n_launches = p->n_aligns = p->ws_count = 0;
    p->ws_stream = 0;
    p->hits = 0;
    if (p->spec == NULL) {
        Py_DECREF(p);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nargs; i++)
        PyTuple_SET_ITEM(p->spec, i, Py_NewRef(args[i]));
    PyObject *aligns = args[2], *workspace = args[6];
    p->makers = args[3] == Py_None ? NULL : args[3];
    p->result = args[4];
    p->stream = args[5];
    p->ws_getter = p->ws_capturing = NULL;
    p->ws_status = NULL;
    p->ws_keep = 0;
    if (workspace != Py_None) {
        if (!PyTuple_Check(workspace) || PyTuple_GET_SIZE(workspace) != 4) {
            bad_spec("workspace is None or (getter, capturing, keep, count)");
            goto error;
        }
        p->ws_getter = PyTuple_GET_ITEM(workspace, 0);
        p->ws_capturing = PyTuple_GET_ITEM(workspace, 1);
        if (PyLong_Check(p->ws_capturing)) {  /* the driver's check, by its address */
            p->ws_status = (capture_status_fn)PyLong_AsVoidPtr(p->ws_capturing);
            if (p->ws_status == NULL) {
                bad_spec("a null capture check");
                goto error;
            }
        }
        p->ws_keep = PyObject_IsTrue(PyTuple_GET_ITEM(workspace, 2));
        p->ws_count = PyLong_AsSsize_t(PyTuple_GET_ITEM(workspace, 3));
        if (PyErr_Occurred() || p->ws_count < 0 || p->ws_count > MAX_SPACES) {
            bad_spec("a workspace has 0 to 16 addresses");
            goto error;
        }
    }
    if (parse_entries(p, args[0], args[1]) < 0)
        goto error;
    Py_ssize_t n_values = p->n_values;
    if ((p->makers != NULL && !PyTuple_Check(p->makers)) || !PyCallable_Check(p->stream) ||
            (p->result != Py_None && !PyTuple_Check(p->result))) {
        bad_spec("makers is a tuple or None, stream a callable, result None or a tuple");
        goto error;
    }
    if (parse_pairs(aligns, MAX_ALIGNS, "aligns must be at most 8 (index, bytes) pairs") < 0)
        goto error;
    p->n_aligns = PyTuple_GET_SIZE(aligns);
    for (Py_ssize_t i = 0; i < p->n_aligns; i++) {
        PyObject *pair = PyTuple_GET_ITEM(aligns, i);
        p->align_index[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(pair, 0));
        p->align_bytes[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(pair, 1));
        if (PyErr_Occurred() || p->align_index[i] < 0 || p->align_index[i] >= n_values ||
                p->align_bytes[i] == 0) {
            bad_spec("an alignment names a value and a positive byte count");
            goto error;
        }
    }
    if (p->result != Py_None) {
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(p->result); i++) {
            Py_ssize_t index = PyLong_AsSsize_t(PyTuple_GET_ITEM(p->result, i));
            if (PyErr_Occurred() || index < 0 || index >= n_values) {
                bad_spec("result names values by index");
                goto error;
            }
        }
    }
    if (parse_launches(p, args[7]) < 0)
        goto error;
    PyObject_GC_Track(p);
    return (PyObject *)p;
error:
    Py_DECREF(p);
    return NULL;
}

static int call_plan_traverse(PyObject *self, visitproc visit, void *arg)
{
    CallPlan *p = (CallPlan *)self;
    Py_VISIT(p->spec);
    Py_VISIT(p->ws_held);
    return 0;
}

static int call_plan_clear(PyObject *self)
{
    CallPlan *p = (CallPlan *)self;
    p->n_values = -1;  /* the borrowed references go with spec: no call matches any more */
    p->n_launches = 0;
    Py_CLEAR(p->spec);
    Py_CLEAR(p->ws_held);
    return 0;
}

static void call_plan_dealloc(PyObject *self)
{
    PyObject_GC_UnTrack(self);
    call_plan_clear(self);
    PyMem_Free(((CallPlan *)self)->launches);
    PyObject_GC_Del(self);
}

static PyMemberDef call_plan_members[] = {
    {"hits", T_ULONGLONG, offsetof(CallPlan, hits), READONLY, "calls served"},
    {NULL, 0, 0, 0, NULL},
};

int call_plan_init(void)
{
    CallPlanType.tp_members = call_plan_members;
    CallPlanType.tp_name = "kiln.CallPlan";
    CallPlanType.tp_basicsize = sizeof(CallPlan);
    CallPlanType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_HAVE_GC;
    CallPlanType.tp_dealloc = call_plan_dealloc;
    CallPlanType.tp_traverse = call_plan_traverse;
    CallPlanType.tp_clear = call_plan_clear;
    CallPlanType.tp_call = PyVectorcall_Call;
    CallPlanType.tp_vectorcall_offset = offsetof(CallPlan, vectorcall);
    CallPlanType.tp_doc = "A library plan's steady-state call in one C call (call_plan).";
    return PyType_Ready(&CallPlanType);
}
