"""Host launcher generation and argument conversion, checked without a GPU.

The MLIR host module is built, lowered and translated to LLVM IR for NVIDIA and AMD; the
launch path's argument conversion runs against a host-memory fake driver and a fake launcher
that performs saxpy through the flat C arguments it receives.
"""

import ctypes
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest
from mlir import ir
from mlir.dialects import llvm

from kiln.core.errors import KilnTypeError, KilnValueError, LaunchError
from kiln.launch_args import check_int_argument
from recording_runtime import RecordingCudaRuntime
from kiln.runtime import launch as launch_mod
from kiln.runtime.amd_host import amd_host_llvm_ir, rocm_runtime_library
from kiln.runtime.cuda import cuda_available
from kiln.runtime.host import (HostLauncher, build_host_module, flat_c_argtypes, lower_host_module,
                               nvidia_kernel_object)
from kiln.signature import KernelSignature, ScalarParam, TensorMapParam, TensorParam
from kiln.core.targets import get_target

SAXPY = KernelSignature("saxpy", (TensorParam("x", "f32", 1), TensorParam("y", "f32", 1),
                                  ScalarParam("n", "i32"), ScalarParam("a", "f32")),
                        block=(256, 1, 1))
MIXED = KernelSignature("mixed", (TensorParam("x", "f32", 1), TensorParam("m", "f16", 2, False),
                                  ScalarParam("n", "i32"), ScalarParam("s", "bf16"),
                                  TensorMapParam("t", "f16", 2, (64, 64), 128)),
                        block=(128, 1, 1), dynamic_shared_bytes=1024)


def _host_llvm_ir(signature, **binary) -> str:
    with ir.Context(), ir.Location.unknown():
        module = build_host_module(signature, nvidia_kernel_object(get_target("sm_90a"), **binary))
        module.operation.verify()
        lower_host_module(module)
        body_ops = {op.operation.name for op in module.body.operations[1].regions[0].blocks[0]}
        assert all(name.startswith("llvm.") or name == "gpu.launch_func" for name in body_ops)
        return llvm.translate_module_to_llvmir(module.operation)


def _launcher_params(llvm_ir: str) -> list[str]:
    (define,) = [line for line in llvm_ir.splitlines() if line.startswith("define void @kiln_launch")]
    return define[define.index("(") + 1:define.rindex(")")].split(", ")


def test_ptx_host_module_loads_with_jit_and_launches_on_the_given_stream():
    text = _host_llvm_ir(MIXED, ptx=".version 8.0\n.target sm_90a\n")
    assert "@llvm.global_ctors" in text
    assert "call ptr @mgpuModuleLoadJIT(ptr @kiln_kernels_binary, i32 3)" in text
    assert ".target sm_90a" in text
    params = _launcher_params(text)
    stream_arg = params[-1].split()[-1]
    launches = [line for line in text.splitlines() if "call void @mgpuLaunchKernel" in line]
    assert len(launches) == 1 and f"ptr {stream_arg}," in launches[0]
    assert "i64 128, i64 1, i64 1, i32" in launches[0]  # block from the signature
    assert "mgpuStreamCreate" not in text and "mgpuStreamSynchronize" not in text


def test_flat_c_argtypes_match_the_lowered_launcher():
    params = _launcher_params(_host_llvm_ir(MIXED, ptx="// ptx"))
    argtypes = flat_c_argtypes(MIXED)
    assert len(params) == len(argtypes) == (3 + 2) + (3 + 4) + 1 + 1 + 1 + 3 + 2
    expected_llvm = {ctypes.c_void_p: "ptr", ctypes.c_int64: "i64", ctypes.c_int32: "i32",
                     ctypes.c_uint16: "i16"}
    for param, argtype in zip(params, argtypes):
        assert param.split()[0].startswith(expected_llvm[argtype]), (param, argtype)
    assert "bitcast i16" in _host_llvm_ir(MIXED, ptx="// ptx")  # bf16 crosses as its bits


def test_cubin_host_module_uses_module_load_and_clusters():
    clustered = KernelSignature("saxpy", SAXPY.params, block=(128, 1, 1), cluster=(2, 1, 1))
    text = _host_llvm_ir(clustered, cubin=b"\x7fELF cubin bytes")
    assert "call ptr @mgpuModuleLoad(ptr @kiln_kernels_binary, i64" in text
    assert "mgpuModuleLoadJIT" not in text
    assert "call void @mgpuLaunchClusterKernel(ptr %" in text
    assert "i64 2, i64 1, i64 1" in text


def test_missing_binary_is_a_launch_error():
    with ir.Context(), pytest.raises(LaunchError, match="no cubin or PTX"):
        nvidia_kernel_object(get_target("sm_90a"))


def test_amd_host_module_verifies_and_embeds_the_code_object():
    text = amd_host_llvm_ir(SAXPY, get_target("gfx950"), b"\x7fELF hsaco")
    assert "@llvm.global_ctors" in text and "call ptr @mgpuModuleLoad(" in text
    assert "call void @mgpuLaunchKernel(" in text
    assert "ELF hsaco" in text


def test_missing_rocm_runtime_names_the_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("KILN_ROCM_RUNTIME", str(tmp_path / "libmlir_rocm_runtime.so"))
    with pytest.raises(LaunchError, match="KILN_ROCM_RUNTIME"):
        rocm_runtime_library()


@pytest.mark.skipif(cuda_available(), reason="checks the behaviour without a GPU")
def test_launch_without_gpu_raises_and_the_process_survives():
    script = textwrap.dedent("""
        import numpy as np
        from types import SimpleNamespace
        from kiln.core.errors import LaunchError
        from kiln.runtime.launch import launch
        from kiln.signature import KernelSignature, TensorParam
        from kiln.core.targets import get_target
        sig = KernelSignature("k", (TensorParam("x", "f32", 1),))
        ck = SimpleNamespace(name="k", target=get_target("sm_90a"), signature=sig,
                             asm={"ptx": "// ptx"})
        try:
            launch(ck, (1, 1, 1), [np.zeros(4, np.float32)])
        except LaunchError as err:
            print("LaunchError:", err)
        print("survived")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "LaunchError:" in result.stdout and "cannot launch a CUDA kernel" in result.stdout
    assert result.stdout.strip().endswith("survived")


def test_ptx_only_target_cannot_launch():
    from types import SimpleNamespace

    ck = SimpleNamespace(name="k", target=get_target("sm_100a"), signature=SAXPY,
                         asm={"ptx": ""})
    with pytest.raises(LaunchError, match="PTX only"):
        launch_mod.launch(ck, (1,), [])


@pytest.mark.parametrize("grid, expected", [(5, (5, 1, 1)), ((2, 3), (2, 3, 1)),
                                            ((np.int64(4), 1, 2), (4, 1, 2))])
def test_grid_normalisation(grid, expected):
    assert launch_mod.normalize_grid(grid) == expected


@pytest.mark.parametrize("grid, error", [((0, 1, 1), KilnValueError), ((1, 70000, 1), KilnValueError),
                                         ((1, 1, 1, 1), KilnValueError), ((2.0,), KilnTypeError)])
def test_bad_grids_are_rejected(grid, error):
    with pytest.raises(error):
        launch_mod.normalize_grid(grid)


def test_numpy_bools_are_i1_arguments_like_bools():
    # Specialisation takes np.bool_ as an i1 (a bool mask's .any()); so must the launch.
    assert check_int_argument("flag", np.True_, "i1") == 1
    assert check_int_argument("flag", np.False_, "i1") == 0
    with pytest.raises(KilnTypeError, match="must be an integer"):
        check_int_argument("n", 2.0, "i32")


def test_stream_handles():
    class TorchLikeStream:
        cuda_stream = 0x1234

    assert launch_mod.stream_handle(None) is None
    assert launch_mod.stream_handle(0) is None
    assert launch_mod.stream_handle(77) == 77
    assert launch_mod.stream_handle(TorchLikeStream()) == 0x1234
    with pytest.raises(KilnTypeError):
        launch_mod.stream_handle("default")


class HostMemoryDriver:
    """Stands in for kiln.runtime.cuda.Driver: "device" memory is host memory."""

    def __init__(self):
        self.buffers, self.freed, self.synced, self.encoded = {}, [], [], []

    def make_current(self):
        pass

    def mem_alloc(self, nbytes):
        buffer = ctypes.create_string_buffer(nbytes)
        self.buffers[ctypes.addressof(buffer)] = buffer
        return ctypes.addressof(buffer)

    def mem_free(self, ptr):
        self.freed.append(ptr)

    def memcpy_htod(self, dst, src, nbytes):
        ctypes.memmove(dst, src, nbytes)

    memcpy_dtoh = memcpy_htod
    mem_alloc_host = mem_alloc  # the capture arena's page-locked block
    mem_free_host = mem_free

    def stream_capturing(self, stream):
        return False

    def stream_synchronize(self, stream):
        self.synced.append(stream)

    def tensor_map_encode_tiled(self, *args):
        self.encoded.append(args)
        return bytes(128)


class SaxpyOnHost:
    """A launcher that runs saxpy on the flat C arguments, like the device kernel would."""

    def __init__(self):
        self.calls = []

    def __call__(self, flat, grid, stream):
        self.calls.append((list(flat), grid, stream))
        x_ptr, _, x_off, x_size, x_stride, y_ptr, _, y_off, y_size, y_stride, n, a = flat
        x = np.ctypeslib.as_array((ctypes.c_float * (x_size * x_stride)).from_address(x_ptr))
        y = np.ctypeslib.as_array((ctypes.c_float * (y_size * y_stride)).from_address(y_ptr))
        y[:n * y_stride:y_stride] += a * x[:n * x_stride:x_stride]


def _plan(signature, launcher):
    driver = HostMemoryDriver()
    return launch_mod._LaunchPlan(signature.name, signature, launcher, driver), driver


def test_numpy_arguments_are_staged_run_and_copied_back():
    launcher = SaxpyOnHost()
    plan, driver = _plan(SAXPY, launcher)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(1000).astype(np.float32)
    y = rng.standard_normal(1000).astype(np.float32)
    expected = 2.5 * x + y
    plan((4, 1, 1), [x, y, 1000, 2.5], 99)
    np.testing.assert_allclose(y, expected, rtol=1e-6)
    flat, grid, stream = launcher.calls[0]
    assert grid == (4, 1, 1) and stream == 99 and driver.synced == [99]
    assert flat[0] != x.ctypes.data  # ran on a staged copy, not on the host array
    assert sorted(driver.freed) == sorted(driver.buffers)


def test_strided_numpy_view_is_copied_back_into_the_view():
    plan, _ = _plan(SAXPY, SaxpyOnHost())
    base = np.zeros(20, np.float32)
    y = base[::2]
    plan((1,), [np.ones(10, np.float32), y, 10, 3.0], None)
    np.testing.assert_array_equal(base[::2], 3.0)
    np.testing.assert_array_equal(base[1::2], 0.0)


class DeviceArray:
    """A CUDA-array-interface object (what cupy/numba expose): passed zero-copy."""

    def __init__(self, ptr, shape, typestr, strides=None):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": shape,
                                         "typestr": typestr, "strides": strides, "version": 3}


def test_device_arrays_pass_descriptor_fields_and_bit_patterns():
    launcher = lambda flat, grid, stream: launcher.calls.append((flat, grid, stream))  # noqa: E731
    launcher.calls = []
    plan, driver = _plan(MIXED, launcher)
    x = DeviceArray(0x1000, (8,), "<f4")
    m = DeviceArray(0x2000, (4, 6), "<f2", strides=(24, 4))  # innermost stride 2 elements
    t = DeviceArray(0x3000, (256, 128), "<f2")
    plan((3, 2), [x, m, np.int32(8), 1.5, t], None)
    plan((3, 2), [x, m, 8, 1.5, t], None)
    flat, grid, stream = launcher.calls[0]
    assert grid == (3, 2, 1) and stream is None and driver.synced == []
    assert flat[:5] == [0x1000, 0x1000, 0, 8, 1]
    assert flat[5:12] == [0x2000, 0x2000, 0, 4, 6, 12, 2]
    assert flat[12] == 8
    assert flat[13] == int(np.array(1.5, ml_dtypes.bfloat16).view(np.uint16)) == 0x3FC0
    assert flat[14] == launcher.calls[1][0][14]  # tensor map encoded once, then cached
    (encode_args,) = driver.encoded
    data_type, address, dims, strides, box, swizzle, oob = encode_args
    assert (data_type, address, dims, strides, box, swizzle, oob) == \
        (6, 0x3000, [128, 256], [256], [64, 64], 3, 0)


def test_argument_mistakes_are_reported():
    plan, _ = _plan(SAXPY, SaxpyOnHost())
    x = np.zeros(4, np.float32)
    with pytest.raises(KilnValueError, match="takes 4 run-time arguments"):
        plan((1,), [x, x, 4], None)
    with pytest.raises(KilnTypeError, match="dtype f64"):
        plan((1,), [x, np.zeros(4), 4, 1.0], None)
    with pytest.raises(KilnValueError, match="rank 2"):
        plan((1,), [x, np.zeros((2, 2), np.float32), 4, 1.0], None)
    with pytest.raises(KilnTypeError, match="must be an integer"):
        plan((1,), [x, x, 4.0, 1.0], None)
    with pytest.raises(KilnTypeError, match="'a' must be a number"):
        plan((1,), [x, x, 4, "1.0"], None)  # float() would have parsed the str
    with pytest.raises(KilnValueError, match="innermost stride"):
        plan((1,), [DeviceArray(0x10, (4,), "<f4", strides=(8,)), x, 4, 1.0], None)


def test_tensor_maps_are_cached_per_parameter():
    two_maps = KernelSignature("two", (TensorMapParam("a", "f32", 1, (32,)),
                                       TensorMapParam("b", "f32", 1, (64,))))
    calls = []
    plan, driver = _plan(two_maps, lambda flat, grid, stream: calls.append(flat))
    tensor = DeviceArray(0x4000, (1024,), "<f4")
    plan((1,), [tensor, tensor], None)
    plan((1,), [tensor, tensor], None)
    assert [args[4] for args in driver.encoded] == [[32], [64]]  # one encode per box
    assert calls[0] == calls[1] and calls[0][0] != calls[0][1]


def test_jit_launcher_calls_the_runtime_with_flat_arguments():
    signature = KernelSignature("scale", (TensorParam("x", "f32", 1), ScalarParam("n", "i32"),
                                          ScalarParam("a", "bf16")),
                                block=(64, 2, 1), dynamic_shared_bytes=512)
    runtime = RecordingCudaRuntime(signature)
    ptx = ".version 8.0\n.target sm_80\n"
    launcher = HostLauncher(signature, lambda: nvidia_kernel_object(get_target("sm_80"), ptx=ptx),
                            [], runtime_symbols=runtime.symbols())
    assert runtime.loaded == [(ptx.encode(), 3)]  # module loaded once, at initialisation
    launcher([0xA000, 0xA040, 16, 100, 1, 100, 0x3FC0], (3, 2, 1), 0x5555)
    launcher([0xB000, 0xB000, 0, 7, 1, 7, 0x4000], (1, 1, 1), None)
    assert runtime.looked_up[0] == (runtime.MODULE, b"scale")
    first, second = runtime.launches
    assert first == (runtime.FUNCTION, (3, 2, 1), (64, 2, 1), 512, 0x5555,
                     [0xA000, 0xA040, 16, 100, 1, 100, 0x3FC0], 7)
    assert second[1] == (1, 1, 1) and second[4] is None and second[5][0] == 0xB000


def _torch_tensor_type():
    """A new stand-in type for a CUDA torch tensor of 8 float32 at 0x1000: a new type, so that
    its stream getter is made with the ``torch`` module a test installed."""
    class TorchTensor:
        __module__ = "torch"
        is_cuda, shape, dtype = True, (8,), np.dtype(np.float32)

        def data_ptr(self):
            return 0x1000

        def dim(self):
            return 1

        def stride(self):
            return (1,)

        def get_device(self):
            return 0

    return TorchTensor


def test_stream_none_is_the_current_stream_of_the_arguments_library(monkeypatch):
    """torch: torch.cuda.current_stream(); cupy: its current stream; otherwise the default."""
    import sys
    from types import SimpleNamespace

    torch_stream, cupy_stream = [0], [0]
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(
        cuda=SimpleNamespace(is_available=lambda: True), _C=SimpleNamespace(
            _cuda_getDevice=lambda: 0, _cuda_getCurrentRawStream=lambda device: torch_stream[0])))
    monkeypatch.setitem(sys.modules, "cupy", SimpleNamespace(cuda=SimpleNamespace(
        get_current_stream=lambda: SimpleNamespace(ptr=cupy_stream[0]))))

    TorchTensor = _torch_tensor_type()

    class CupyArray(DeviceArray):
        __module__ = "cupy"

    calls = []
    plan, _ = _plan(SAXPY, lambda flat, grid, stream: calls.append(stream))
    torch_x, cupy_x = TorchTensor(), CupyArray(0x2000, (8,), "<f4")
    other_x = DeviceArray(0x3000, (8,), "<f4")
    plan((1,), [torch_x, torch_x, 8, 1.0], None)
    torch_stream[0], cupy_stream[0] = 0x7000, 0x8000   # inside `with torch.cuda.stream(s):`
    plan((1,), [torch_x, torch_x, 8, 1.0], None)
    plan((1,), [cupy_x, cupy_x, 8, 1.0], None)
    plan((1,), [other_x, other_x, 8, 1.0], None)
    plan((1,), [torch_x, torch_x, 8, 1.0], 0x9000)      # an explicit stream wins
    assert calls == [None, 0x7000, 0x8000, None, 0x9000]
    assert launch_mod.current_stream(torch_x) == 0x7000
    assert launch_mod.current_stream(np.zeros(2)) is None


def test_a_torch_without_a_usable_gpu_has_no_stream_to_follow(monkeypatch):
    """A CPU-only torch, or one with no driver, raises from its CUDA getters: the launch and
    its bound and generated launchers take the legacy default stream instead of asking."""
    import sys
    from types import SimpleNamespace

    from kiln.runtime import streams

    def no_driver(*args):
        raise RuntimeError("Found no NVIDIA driver on your system")

    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(
        cuda=SimpleNamespace(is_available=lambda: False, current_stream=no_driver),
        _C=SimpleNamespace(_cuda_getDevice=no_driver, _cuda_getCurrentRawStream=no_driver)))

    TorchTensor = _torch_tensor_type()

    calls = []
    plan, _ = _plan(SAXPY, lambda flat, grid, stream: calls.append(stream))
    x = TorchTensor()
    plan((1,), [x, x, 8, 1.0], None)
    plan((1,), [x, x, 8, 1.0], 0x9000)   # an explicit stream still wins
    assert calls == [None, 0x9000]
    assert streams.current_stream(x) is None
    assert streams.bound_stream_source([x, 8])() is None


def test_tensor_map_cache_evicts_the_least_recently_used_and_frees_on_collection():
    import gc

    driver = HostMemoryDriver()
    cache = launch_mod.TensorMapCache(driver, capacity=3)
    param = TensorMapParam("a", "f16", 2, (64, 64), 128)
    rng = np.random.default_rng()
    pointers = [int(p) * 16 for p in rng.choice(1 << 30, 5, replace=False)]

    def descriptor(ptr):
        return cache.descriptor(param, ptr, (256, 128), (128, 1))

    first = [descriptor(p) for p in pointers[:3]]
    assert descriptor(pointers[0]) == first[0] and len(driver.encoded) == 3  # a hit refreshes
    descriptor(pointers[3])   # evicts pointers[1], the least recently used
    assert driver.freed == [first[1]] and len(cache) == 3
    descriptor(pointers[4])   # evicts pointers[2]
    assert driver.freed == [first[1], first[2]]
    assert descriptor(pointers[0]) == first[0] and len(driver.encoded) == 5
    held = set(driver.buffers) - set(driver.freed)
    del cache
    gc.collect()
    # Three descriptors and the capture arena's two blocks (lowering/tensor_map_capture.py).
    assert set(driver.freed) == set(driver.buffers) and len(held) == 3 + 2


class Limits:
    max_threads_per_block, max_block_dims = 1024, (1024, 1024, 64)
    max_shared_bytes_optin, max_registers_per_block = 232448, 65536


@pytest.mark.parametrize("signature, metadata, match", [
    (KernelSignature("k", (), block=(2048, 1, 1)), {}, "2048 threads"),
    (KernelSignature("k", (), block=(1, 1, 128)), {}, "per dimension"),
    (KernelSignature("k", (), dynamic_shared_bytes=200_000), {"shared_bytes": 40_000},
     r"240000 bytes of shared memory per block \(40000 static \+ 200000 dynamic\)"),
    (KernelSignature("k", (), block=(1024, 1, 1)), {"registers": 128}, "131072 per block"),
])
def test_launch_configurations_beyond_the_device_are_resource_errors(signature, metadata, match):
    from kiln.core.errors import ResourceError

    with pytest.raises(ResourceError, match=match) as err:
        launch_mod.check_launch_config("k", signature, metadata, Limits())
    assert "Fix:" in str(err.value) and err.value.loc.filename == __file__
    launch_mod.check_launch_config("k", KernelSignature("k", (), dynamic_shared_bytes=1024),
                                   {"registers": 64, "shared_bytes": 512}, Limits())


def test_cluster_grids_must_be_multiples_of_the_cluster():
    clustered = KernelSignature("c", SAXPY.params, block=(128, 1, 1), cluster=(2, 1, 1))
    plan, _ = _plan(clustered, SaxpyOnHost())
    assert plan.check_grid((4, 3)) == (4, 3, 1)
    with pytest.raises(KilnValueError, match="multiple of its cluster"):
        plan.check_grid((5, 1, 1))


def test_launch_blocking_synchronises_after_each_launch(monkeypatch):
    monkeypatch.setenv("KILN_LAUNCH_BLOCKING", "1")
    driver = HostMemoryDriver()
    driver.synchronize = lambda: driver.synced.append("context")
    plan = launch_mod._LaunchPlan("saxpy", SAXPY, lambda flat, grid, stream: None, driver)
    x = DeviceArray(0x1000, (4,), "<f4")
    plan((1,), [x, x, 4, 1.0], None)
    assert driver.synced == ["context"]


def test_programmatic_launch_shim_passes_the_launch_and_its_attribute_to_the_driver():
    """The shim a kernel that waits on prior grids launches through: one cuLaunchKernelEx with
    the launch's grid, block, shared bytes, stream and arguments, and the programmatic stream
    serialization attribute; the runtime's launch only when the driver refuses it."""
    from kiln.runtime.cuda import _LaunchConfig
    from kiln.runtime.host import ProgrammaticLaunchShim

    max_dynamic_shared_size_bytes = 8  # cuda.h: CUfunction_attribute
    programmatic_stream_serialization = 6  # cuda.h: CUlaunchAttributeID

    calls = {"set": [], "launch_ex": [], "fallback": []}
    status = [0]

    @ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32)
    def set_attribute(function, attribute, value):
        calls["set"].append((function, attribute, value))
        return 0

    @ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                      ctypes.c_void_p, ctypes.c_void_p)
    def launch_ex(config, function, params, extra):
        c = config.contents
        attribute = c.attrs[0]
        calls["launch_ex"].append(((c.grid_x, c.grid_y, c.grid_z),
                                   (c.block_x, c.block_y, c.block_z), c.shared_bytes, c.stream,
                                   c.num_attrs, attribute.id, attribute.value[0], function,
                                   params))
        return status[0]

    @RecordingCudaRuntime._launch
    def fallback(function, gx, gy, gz, bx, by, bz, smem, stream, params, extra, count):
        calls["fallback"].append(((gx, gy, gz), smem, stream))

    callbacks = {"cuFuncSetAttribute": set_attribute, "cuLaunchKernelEx": launch_ex,
                 "mgpuLaunchKernel": fallback}
    shim = ProgrammaticLaunchShim({name: ctypes.cast(cb, ctypes.c_void_p).value
                                   for name, cb in callbacks.items()})
    launch = RecordingCudaRuntime._launch(shim.address)
    params = (ctypes.c_void_p * 1)(0xA000)
    launch(0x2222, 3, 2, 1, 64, 2, 1, 512, 0x5555, params, None, 1)
    assert calls["set"] == [(0x2222, max_dynamic_shared_size_bytes, 512)]
    assert calls["launch_ex"] == [((3, 2, 1), (64, 2, 1), 512, 0x5555, 1,
                                   programmatic_stream_serialization, 1, 0x2222,
                                   ctypes.addressof(params))]
    assert calls["fallback"] == []
    status[0] = 201  # CUDA_ERROR_INVALID_CONTEXT: the runtime's launch takes over
    launch(0x2222, 5, 1, 1, 64, 1, 1, 0, None, params, None, 1)
    assert calls["fallback"] == [((5, 1, 1), 0, None)]
