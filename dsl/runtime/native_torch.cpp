// Kiln's torch bridge: fresh torch tensors, tensor guards and tensor views from C++, without
// torch's Python argument parsing or attribute reads.
//
// Built by kiln.runtime.native_torch at first use, against the headers and libraries of the
// torch wheel the process imported, with the system C++ compiler; cached like the launch shim
// (kiln.runtime.native). It includes only light ATen/c10 headers (no pybind11: the build takes
// about a second) and declares the two torch Python symbols it needs; a signature that changed
// fails to load (an undefined symbol), and the layout of torch's Python tensor object is checked
// when the module loads, so a torch that differs falls back to the Python paths.
#include <Python.h>

#include <ATen/Context.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/TensorBase.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>
#include <torch/csrc/Export.h>

#include <chrono>
#include <cstring>

TORCH_PYTHON_API extern PyObject* THPVariableClass;
TORCH_PYTHON_API PyObject* THPVariable_Wrap(const at::TensorBase& var);

namespace {

// torch's THPVariable (torch/csrc/autograd/python_variable.h): the tensor right after the
// object header; at::Tensor adds no member to at::TensorBase. Checked in module_init.
struct Variable {
    PyObject_HEAD
    at::TensorBase cdata;
};

const at::TensorBase& unpack(PyObject* obj) { return reinterpret_cast<Variable*>(obj)->cdata; }

bool is_plain_tensor(PyObject* obj)
{
    return THPVariableClass != nullptr && Py_TYPE(obj) == (PyTypeObject*)THPVariableClass;
}

PyObject* out_of_memory = nullptr;  // torch.OutOfMemoryError, set by set_out_of_memory_error

// A C++ exception as the Python error torch itself would raise (out of memory) or RuntimeError.
PyObject* raise_from(const std::exception& err, bool oom)
{
    PyErr_SetString(oom && out_of_memory ? out_of_memory : PyExc_RuntimeError, err.what());
    return nullptr;
}

constexpr int MAX_DIMS = 16;

// --- empty makers --------------------------------------------------------------------------

struct Maker {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject* fallback;      // the Python maker, for torch's deterministic fill of new memory
    c10::Allocator* allocator;
    uint64_t keys;           // DispatchKeySet's raw bits
    int64_t sizes[MAX_DIMS];
    int32_t ndim;
    int8_t scalar_type, device_type, device_index;
};

at::TensorBase allocate(const Maker* m)
{
    c10::DispatchKeySet keys(c10::DispatchKeySet::RAW, m->keys);
    return at::detail::empty_generic(c10::IntArrayRef(m->sizes, m->ndim), m->allocator, keys,
                                     static_cast<c10::ScalarType>(m->scalar_type), std::nullopt);
}

// A fresh tensor on the maker's device: the allocation inside a device guard only when another
// device is current (the caching allocator allocates on the current one).
at::TensorBase make(const Maker* m)
{
    c10::Device device(static_cast<c10::DeviceType>(m->device_type), m->device_index);
    if (device.is_cpu() || c10::impl::getDeviceGuardImpl(device.type())->getDevice() == device)
        return allocate(m);
    c10::DeviceGuard guard(device);
    return allocate(m);
}

PyObject* maker_call(PyObject* self, PyObject* const*, size_t nargsf, PyObject* kwnames)
{
    if (PyVectorcall_NARGS(nargsf) != 0 || (kwnames && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "an empty maker takes no argument");
        return nullptr;
    }
    Maker* m = reinterpret_cast<Maker*>(self);
    try {
        const auto& context = at::globalContext();
        if (context.deterministicAlgorithms() && context.deterministicFillUninitializedMemory())
            return PyObject_CallNoArgs(m->fallback);  // torch.empty then fills the memory
        return THPVariable_Wrap(make(m));
    } catch (const c10::OutOfMemoryError& err) {
        return raise_from(err, true);
    } catch (const std::exception& err) {
        return raise_from(err, false);
    }
}

void maker_dealloc(PyObject* self)
{
    Py_XDECREF(reinterpret_cast<Maker*>(self)->fallback);
    PyObject_Free(self);
}

PyTypeObject MakerType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// empty_maker(template, shape, fallback): a callable giving a fresh contiguous tensor of that
// shape with the template's dtype and device (its storage's allocator).
PyObject* empty_maker(PyObject*, PyObject* const* args, Py_ssize_t nargs)
{
    if (nargs != 3 || !is_plain_tensor(args[0]) || !PyTuple_Check(args[1]) ||
            PyTuple_GET_SIZE(args[1]) > MAX_DIMS || !PyCallable_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "empty_maker(template tensor, shape tuple, fallback)");
        return nullptr;
    }
    const at::TensorBase& like = unpack(args[0]);
    try {
        c10::Allocator* allocator = like.has_storage() ? like.storage().allocator() : nullptr;
        if (allocator == nullptr || like.layout() != c10::kStrided)
            Py_RETURN_NONE;  // no allocator to reuse: the Python maker
        Maker* m = PyObject_New(Maker, &MakerType);
        if (m == nullptr)
            return nullptr;
        m->vectorcall = maker_call;
        m->fallback = Py_NewRef(args[2]);
        m->allocator = allocator;
        c10::Device device = like.device();
        auto key = c10::computeDispatchKey(like.scalar_type(), c10::kStrided, device);
        m->keys = c10::DispatchKeySet(key).raw_repr();
        m->scalar_type = static_cast<int8_t>(like.scalar_type());
        m->device_type = static_cast<int8_t>(device.type());
        m->device_index = device.index();
        m->ndim = static_cast<int32_t>(PyTuple_GET_SIZE(args[1]));
        for (int32_t i = 0; i < m->ndim; i++) {
            m->sizes[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(args[1], i));
            if (m->sizes[i] < 0) {
                Py_DECREF(m);
                if (!PyErr_Occurred())
                    PyErr_SetString(PyExc_ValueError, "empty_maker: a negative size");
                return nullptr;
            }
        }
        return reinterpret_cast<PyObject*>(m);
    } catch (const std::exception& err) {
        return raise_from(err, false);
    }
}

// --- joint makers: a call's fresh tensors in one allocation ---------------------------------

constexpr int MAX_PARTS = 4;
constexpr int64_t PART_ALIGN = 256;  // bytes between parts' starts: what the allocator aligns

struct Part {
    int64_t sizes[MAX_DIMS];
    int64_t offset;      // elements of its dtype into the shared storage
    uint64_t keys;       // DispatchKeySet's raw bits
    int32_t ndim;
    int8_t scalar_type;
};

struct JointMaker {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject* fallback;  // the Python maker of the tuple, for torch's deterministic fill
    c10::Allocator* allocator;
    int64_t nbytes;
    int32_t count;
    int8_t device_type, device_index;
    Part parts[MAX_PARTS];
};

// The tuple of fresh tensors, one storage under them all (new reference, or NULL).
PyObject* make_parts(const JointMaker* m)
{
    auto storage = c10::make_intrusive<c10::StorageImpl>(
        c10::StorageImpl::use_byte_size_t(), m->nbytes, m->allocator, /*resizable=*/true);
    PyObject* made = PyTuple_New(m->count);
    for (int32_t i = 0; made != nullptr && i < m->count; i++) {
        const Part& p = m->parts[i];
        at::TensorBase tensor = at::detail::make_tensor_base<c10::TensorImpl>(
            c10::Storage(storage), c10::DispatchKeySet(c10::DispatchKeySet::RAW, p.keys),
            c10::scalarTypeToTypeMeta(static_cast<c10::ScalarType>(p.scalar_type)));
        c10::TensorImpl* impl = tensor.unsafeGetTensorImpl();
        impl->set_sizes_contiguous(c10::IntArrayRef(p.sizes, p.ndim));
        impl->set_storage_offset(p.offset);
        PyObject* obj = THPVariable_Wrap(tensor);
        if (obj == nullptr)
            Py_CLEAR(made);
        else
            PyTuple_SET_ITEM(made, i, obj);
    }
    return made;
}

PyObject* joint_call(PyObject* self, PyObject* const*, size_t nargsf, PyObject* kwnames)
{
    if (PyVectorcall_NARGS(nargsf) != 0 || (kwnames && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "a joint maker takes no argument");
        return nullptr;
    }
    JointMaker* m = reinterpret_cast<JointMaker*>(self);
    try {
        const auto& context = at::globalContext();
        if (context.deterministicAlgorithms() && context.deterministicFillUninitializedMemory())
            return PyObject_CallNoArgs(m->fallback);  // torch.empty then fills the memory
        c10::Device device(static_cast<c10::DeviceType>(m->device_type), m->device_index);
        if (device.is_cpu() || c10::impl::getDeviceGuardImpl(device.type())->getDevice() == device)
            return make_parts(m);
        c10::DeviceGuard guard(device);
        return make_parts(m);
    } catch (const c10::OutOfMemoryError& err) {
        return raise_from(err, true);
    } catch (const std::exception& err) {
        return raise_from(err, false);
    }
}

void joint_dealloc(PyObject* self)
{
    Py_XDECREF(reinterpret_cast<JointMaker*>(self)->fallback);
    PyObject_Free(self);
}

PyTypeObject JointMakerType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// joint_maker(parts, fallback): a callable giving a tuple of fresh contiguous tensors, one per
// (template tensor, shape tuple) of parts (the template's dtype and device), carved from one
// allocation of the first template's storage allocator; None where a template is not a plain
// strided tensor on that device with that allocator.
PyObject* joint_maker(PyObject*, PyObject* const* args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyTuple_Check(args[0]) || PyTuple_GET_SIZE(args[0]) < 1 ||
            PyTuple_GET_SIZE(args[0]) > MAX_PARTS || !PyCallable_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "joint_maker(((template, shape), ...), fallback)");
        return nullptr;
    }
    PyObject* specs = args[0];
    Py_ssize_t count = PyTuple_GET_SIZE(specs);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject* spec = PyTuple_GET_ITEM(specs, i);
        if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) != 2 ||
                !is_plain_tensor(PyTuple_GET_ITEM(spec, 0)) ||
                !PyTuple_Check(PyTuple_GET_ITEM(spec, 1)) ||
                PyTuple_GET_SIZE(PyTuple_GET_ITEM(spec, 1)) > MAX_DIMS) {
            PyErr_SetString(PyExc_TypeError, "joint_maker: each part is (template, shape)");
            return nullptr;
        }
    }
    try {
        const at::TensorBase& first = unpack(PyTuple_GET_ITEM(PyTuple_GET_ITEM(specs, 0), 0));
        c10::Allocator* allocator = first.has_storage() ? first.storage().allocator() : nullptr;
        c10::Device device = first.device();
        if (allocator == nullptr)
            Py_RETURN_NONE;
        JointMaker* m = PyObject_New(JointMaker, &JointMakerType);
        if (m == nullptr)
            return nullptr;
        m->vectorcall = joint_call;
        m->fallback = Py_NewRef(args[1]);
        m->allocator = allocator;
        m->count = static_cast<int32_t>(count);
        m->device_type = static_cast<int8_t>(device.type());
        m->device_index = device.index();
        int64_t bytes = 0;
        for (Py_ssize_t i = 0; i < count; i++) {
            PyObject* spec = PyTuple_GET_ITEM(specs, i);
            const at::TensorBase& like = unpack(PyTuple_GET_ITEM(spec, 0));
            PyObject* shape = PyTuple_GET_ITEM(spec, 1);
            if (like.layout() != c10::kStrided || like.device() != device ||
                    !like.has_storage() || like.storage().allocator() != allocator) {
                Py_DECREF(m);
                Py_RETURN_NONE;  // parts that one allocation cannot hold: separate makers
            }
            Part& p = m->parts[i];
            p.scalar_type = static_cast<int8_t>(like.scalar_type());
            p.keys = c10::DispatchKeySet(c10::computeDispatchKey(like.scalar_type(),
                                                                 c10::kStrided, device))
                         .raw_repr();
            p.ndim = static_cast<int32_t>(PyTuple_GET_SIZE(shape));
            int64_t elements = 1;
            for (int32_t d = 0; d < p.ndim; d++) {
                p.sizes[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, d));
                if (p.sizes[d] < 0) {
                    Py_DECREF(m);
                    if (!PyErr_Occurred())
                        PyErr_SetString(PyExc_ValueError, "joint_maker: a negative size");
                    return nullptr;
                }
                elements *= p.sizes[d];
            }
            int64_t itemsize = static_cast<int64_t>(like.dtype().itemsize());
            bytes = (bytes + PART_ALIGN - 1) / PART_ALIGN * PART_ALIGN;
            p.offset = bytes / itemsize;
            bytes += elements * itemsize;
        }
        m->nbytes = bytes;
        return reinterpret_cast<PyObject*>(m);
    } catch (const std::exception& err) {
        return raise_from(err, false);
    }
}

// --- tensor guards -------------------------------------------------------------------------

// What a guard compares of one tensor: everything a plan key holds (type, shape, strides,
// dtype, device) and the dispatch keys (a conjugate, negative or functional tensor differs).
struct Expected {
    PyTypeObject* type;
    uint64_t keys;
    caffe2::TypeMeta dtype;
    int64_t sizes[MAX_DIMS], strides[MAX_DIMS];
    int32_t ndim;
    int8_t device_type, device_index;
};

struct Guard {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    Py_ssize_t count;
    Expected* expected;
};

// 1 when obj is laid out as e expects, 0 when not (also for what the guard cannot read).
int matches(const Expected& e, PyObject* obj)
{
    if (Py_TYPE(obj) != e.type)
        return 0;
    const c10::TensorImpl* t = unpack(obj).unsafeGetTensorImpl();
    if (t->key_set().raw_repr() != e.keys || t->dtype() != e.dtype || t->dim() != e.ndim)
        return 0;
    c10::Device device = t->device();
    if (static_cast<int8_t>(device.type()) != e.device_type || device.index() != e.device_index)
        return 0;
    c10::IntArrayRef sizes = t->sizes(), strides = t->strides();
    return std::memcmp(sizes.data(), e.sizes, sizeof(int64_t) * e.ndim) == 0 &&
           std::memcmp(strides.data(), e.strides, sizeof(int64_t) * e.ndim) == 0;
}

PyObject* guard_call(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames)
{
    Guard* g = reinterpret_cast<Guard*>(self);
    if (PyVectorcall_NARGS(nargsf) != g->count || (kwnames && PyTuple_GET_SIZE(kwnames)))
        Py_RETURN_FALSE;
    try {
        for (Py_ssize_t i = 0; i < g->count; i++)
            if (!matches(g->expected[i], args[i]))
                Py_RETURN_FALSE;
    } catch (const std::exception&) {  // sizes a tensor cannot give plainly (symbolic)
        Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

void guard_dealloc(PyObject* self)
{
    PyMem_Free(reinterpret_cast<Guard*>(self)->expected);
    PyObject_Free(self);
}

PyTypeObject GuardType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// tensor_guard(tensors): a callable of as many tensors, true when each is laid out as the
// example of its position; None when an example is not a plain strided tensor.
PyObject* tensor_guard(PyObject*, PyObject* tensors)
{
    if (!PyTuple_Check(tensors)) {
        PyErr_SetString(PyExc_TypeError, "tensor_guard(tuple of tensors)");
        return nullptr;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(tensors);
    Expected* expected = static_cast<Expected*>(PyMem_Calloc(n ? n : 1, sizeof(Expected)));
    if (expected == nullptr)
        return PyErr_NoMemory();
    try {
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject* obj = PyTuple_GET_ITEM(tensors, i);
            if (!is_plain_tensor(obj)) {
                PyMem_Free(expected);
                Py_RETURN_NONE;
            }
            const c10::TensorImpl* t = unpack(obj).unsafeGetTensorImpl();
            if (t->layout() != c10::kStrided || t->dim() > MAX_DIMS ||
                    t->has_symbolic_sizes_strides()) {
                PyMem_Free(expected);
                Py_RETURN_NONE;
            }
            Expected& e = expected[i];
            e.type = Py_TYPE(obj);
            e.keys = t->key_set().raw_repr();
            e.dtype = t->dtype();
            e.ndim = static_cast<int32_t>(t->dim());
            e.device_type = static_cast<int8_t>(t->device().type());
            e.device_index = t->device().index();
            std::memcpy(e.sizes, t->sizes().data(), sizeof(int64_t) * e.ndim);
            std::memcpy(e.strides, t->strides().data(), sizeof(int64_t) * e.ndim);
        }
    } catch (const std::exception& err) {
        PyMem_Free(expected);
        return raise_from(err, false);
    }
    Guard* g = PyObject_New(Guard, &GuardType);
    if (g == nullptr) {
        PyMem_Free(expected);
        return nullptr;
    }
    g->vectorcall = guard_call;
    g->count = n;
    g->expected = expected;
    return reinterpret_cast<PyObject*>(g);
}

// --- tensor views for the launch shim (native_launch.h's torch_view) -----------------------

struct View {  // mirrored by kiln_torch_view in native_launch.h
    uint64_t data;
    const int64_t* sizes;
    const int64_t* strides;
    int64_t ndim;
    int32_t scalar_type;
    int32_t device_type;
};

// 1 with the view of a plain strided tensor (its metadata valid while obj lives), else 0.
int torch_view(PyObject* obj, View* view)
{
    if (!is_plain_tensor(obj))
        return 0;
    try {
        const c10::TensorImpl* t = unpack(obj).unsafeGetTensorImpl();
        if (t->layout() != c10::kStrided || t->has_symbolic_sizes_strides())
            return 0;
        view->data = reinterpret_cast<uint64_t>(unpack(obj).const_data_ptr());
        view->sizes = t->sizes().data();
        view->strides = t->strides().data();
        view->ndim = t->dim();
        view->scalar_type = static_cast<int32_t>(c10::typeMetaToScalarType(t->dtype()));
        view->device_type = static_cast<int32_t>(t->device().type());
        return 1;
    } catch (const std::exception&) {
        return 0;
    }
}

// scalar_type(tensor): the code torch_view reports for this tensor's dtype (a guarded launch's
// spec holds it), or -1 for what torch_view does not read.
PyObject* scalar_type(PyObject*, PyObject* obj)
{
    View view;
    return PyLong_FromLong(torch_view(obj, &view) ? view.scalar_type : -1);
}

// --- diagnostics for bench/host_alloc.py ---------------------------------------------------

// alloc_cost(maker, n): ns per allocation of the maker's bytes from its allocator alone and
// released, then per fresh tensor made and released in C++ (no Python object), then per one
// made, wrapped as a Python tensor and released.
PyObject* alloc_cost(PyObject*, PyObject* const* args, Py_ssize_t nargs)
{
    if (nargs != 2 || Py_TYPE(args[0]) != &MakerType) {
        PyErr_SetString(PyExc_TypeError, "alloc_cost(maker, n)");
        return nullptr;
    }
    const Maker* m = reinterpret_cast<Maker*>(args[0]);
    long n = PyLong_AsLong(args[1]);
    if (n <= 0)
        return PyErr_Occurred() ? nullptr : PyTuple_New(0);
    using clock = std::chrono::steady_clock;
    try {
        size_t bytes = c10::elementSize(static_cast<c10::ScalarType>(m->scalar_type));
        for (int32_t i = 0; i < m->ndim; i++)
            bytes *= static_cast<size_t>(m->sizes[i]);
        auto start = clock::now();
        for (long i = 0; i < n; i++)
            m->allocator->allocate(bytes);
        auto allocated = clock::now();
        for (long i = 0; i < n; i++)
            make(m);
        auto middle = clock::now();
        for (long i = 0; i < n; i++) {
            PyObject* obj = THPVariable_Wrap(make(m));
            if (obj == nullptr)
                return nullptr;
            Py_DECREF(obj);
        }
        auto end = clock::now();
        auto per = [n](clock::time_point a, clock::time_point b) {
            return std::chrono::duration<double, std::nano>(b - a).count() / n;
        };
        return Py_BuildValue("(ddd)", per(start, allocated), per(allocated, middle),
                             per(middle, end));
    } catch (const std::exception& err) {
        return raise_from(err, false);
    }
}

PyObject* set_out_of_memory_error(PyObject*, PyObject* error)
{
    Py_XSETREF(out_of_memory, Py_NewRef(error));
    Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"empty_maker", (PyCFunction)(void (*)(void))empty_maker, METH_FASTCALL,
     "empty_maker(template, shape, fallback): a C callable of fresh tensors, or None."},
    {"joint_maker", (PyCFunction)(void (*)(void))joint_maker, METH_FASTCALL,
     "joint_maker(((template, shape), ...), fallback): a C callable of a tuple of fresh "
     "tensors sharing one allocation, or None."},
    {"tensor_guard", tensor_guard, METH_O,
     "tensor_guard(tensors): a C check of tensors laid out as these, or None."},
    {"scalar_type", scalar_type, METH_O,
     "scalar_type(tensor): torch_view's dtype code of the tensor, or -1."},
    {"alloc_cost", (PyCFunction)(void (*)(void))alloc_cost, METH_FASTCALL,
     "alloc_cost(maker, n): ns per (allocator alone, bare tensor, wrapped tensor), released."},
    {"set_out_of_memory_error", set_out_of_memory_error, METH_O,
     "set_out_of_memory_error(cls): what a failed allocation raises."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kiln_torch", "Kiln's torch bridge.", -1, methods};

// The layout check: a tensor made here, wrapped by torch, must be found where unpack looks.
bool layout_matches()
{
    if (THPVariableClass == nullptr)
        return false;
    at::TensorBase t = at::detail::empty_cpu({2}, c10::kFloat);
    PyObject* obj = THPVariable_Wrap(t);
    if (obj == nullptr)
        return false;
    bool ok = is_plain_tensor(obj) && unpack(obj).unsafeGetTensorImpl() == t.unsafeGetTensorImpl();
    Py_DECREF(obj);
    return ok;
}

bool ready_type(PyTypeObject* type, const char* name, Py_ssize_t size, destructor dealloc,
                Py_ssize_t vectorcall_offset)
{
    type->tp_name = name;
    type->tp_basicsize = size;
    type->tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL;
    type->tp_dealloc = dealloc;
    type->tp_call = PyVectorcall_Call;
    type->tp_vectorcall_offset = vectorcall_offset;
    return PyType_Ready(type) == 0;
}

}  // namespace

PyMODINIT_FUNC PyInit__kiln_torch(void)
{
    try {
        if (!layout_matches()) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ImportError, "torch's tensor object is laid out otherwise");
            return nullptr;
        }
    } catch (const std::exception& err) {
        PyErr_Format(PyExc_ImportError, "torch bridge check failed: %s", err.what());
        return nullptr;
    }
    if (!ready_type(&MakerType, "kiln.EmptyMaker", sizeof(Maker), maker_dealloc,
                    offsetof(Maker, vectorcall)) ||
        !ready_type(&JointMakerType, "kiln.JointMaker", sizeof(JointMaker), joint_dealloc,
                    offsetof(JointMaker, vectorcall)) ||
        !ready_type(&GuardType, "kiln.TensorGuard", sizeof(Guard), guard_dealloc,
                    offsetof(Guard, vectorcall)))
        return nullptr;
    PyObject* m = PyModule_Create(&module);
    if (m == nullptr)
        return nullptr;
    PyObject* view = PyCapsule_New(reinterpret_cast<void*>(&torch_view), "kiln.torch_view",
                                   nullptr);
    if (view == nullptr || PyModule_AddObject(m, "TORCH_VIEW", view) < 0 ||
            PyModule_AddIntConstant(m, "VIEW_BYTES", sizeof(View)) < 0) {
        Py_XDECREF(view);
        Py_DECREF(m);
        return nullptr;
    }
    return m;
}
