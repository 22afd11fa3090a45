"""``kernel[grid](...)``'s steady state: the launcher generated per specialisation
(``kiln.runtime.launch_fast``), checked without a GPU.

Kernels are traced and compiled for real; the NVIDIA backend's launcher is a real JIT-compiled
host launcher whose ``mgpu*`` calls go to a recording runtime (one per compiled kernel), so a
test sees which binary every launch reached, on which stream, with which flat arguments.
Device arrays are stand-ins: torch tensors (attributes like torch's), objects with
``__cuda_array_interface__`` and objects exporting a DLPack capsule.
"""

import ctypes
import sys
import threading
from types import SimpleNamespace

import numpy as np
import pytest

import kiln
from kiln.core.errors import KilnTypeError, KilnValueError
from kiln.runtime import launch as launch_mod
from kiln.arrays import describe_array, is_array
from kiln.runtime.driver_launch import DriverFunctions, DriverLauncher
from kiln.runtime.host import HostLauncher, nvidia_kernel_object
from kiln.runtime.launch_fast import specialized_launcher
from kiln.runtime.native import native_module
from recording_runtime import RecordingCudaRuntime, RecordingDriver


@kiln.kernel(num_threads="BLOCK")
def axpy(x, y, n: kiln.i32, a: kiln.f32, BLOCK: kiln.constexpr):
    i = kiln.block_id(0) * kiln.block_dim(0) + kiln.thread_id(0)
    if i < n:
        y[i] = x[i] + x[i]


@kiln.kernel(num_threads=64)
def touch(x, n: kiln.i32, FLAG: kiln.constexpr):
    if kiln.thread_id(0) < n:
        kiln.thread_id(0)


class Tensor:
    """A CUDA torch tensor as the launch path sees one (module, methods, attributes)."""

    __module__ = "torch"
    device = SimpleNamespace(type="cuda")
    is_cuda = True

    def __init__(self, ptr, shape, dtype="float32", strides=None):
        self._ptr, self.shape, self.dtype = ptr, tuple(shape), np.dtype(dtype)
        self._strides = strides or tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))

    def data_ptr(self):
        return self._ptr

    def dim(self):
        return len(self.shape)

    def stride(self, dim=None):
        return self._strides if dim is None else self._strides[dim]


class CpuTensor(Tensor):
    __module__ = "torch"
    device = SimpleNamespace(type="cpu")
    is_cuda = False


class CudaArray:
    def __init__(self, ptr, shape, typestr="<f4", strides=None):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": shape,
                                         "typestr": typestr, "strides": strides, "version": 3}


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_DLTENSOR = b"dltensor"


class DLPackArray:
    """Exports a DLPack capsule (``DLManagedTensor`` without a deleter) like JAX's arrays."""

    def __init__(self, ptr, shape, code_bits=(2, 32), strides=None, device_type=2,
                 byte_offset=0):
        from kiln.arrays import _DLDataType, _DLDevice, _DLTensor

        rank = len(shape)
        self._shape = (ctypes.c_int64 * max(rank, 1))(*shape)
        self._strides = None if strides is None else (ctypes.c_int64 * rank)(*strides)
        self._tensor = _DLTensor(ptr, _DLDevice(device_type, 0), rank, _DLDataType(*code_bits, 1),
                                 self._shape, self._strides, byte_offset)
        self.exports = 0

    def __dlpack__(self, stream=None):
        self.exports += 1
        return _capsule_new(ctypes.addressof(self._tensor), _DLTENSOR, None)


# Every recording runtime outlives the launchers calling it: an engine being collected unloads
# its module through the runtime's callbacks, in whatever order a collected cycle goes.
_RUNTIMES_ALIVE: list = []


@pytest.fixture(params=["mlir", "native", "ctypes"])
def runtimes(request, monkeypatch, tmp_path):
    """Compiled kernel -> the recording runtime its launcher calls: the ExecutionEngine's
    host module, or the driver launcher through the native shim or ctypes."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    made = {}
    shim = native_module() if request.param == "native" else None
    if request.param == "native" and shim is None:
        pytest.skip("no C compiler to build the native launch shim")

    def launcher(ck):
        if request.param == "mlir":
            runtime = RecordingCudaRuntime(ck.signature)
            host = HostLauncher(ck.signature,
                                lambda: nvidia_kernel_object(ck.target, ptx=ck.asm["ptx"]), [],
                                runtime_symbols=runtime.symbols())
        else:
            runtime = RecordingDriver(ck.signature)
            host = DriverLauncher(ck.signature, RecordingDriver.FUNCTION,
                                  DriverFunctions(runtime.symbols(), None), shim)
        _RUNTIMES_ALIVE.append(runtime)
        made[ck] = runtime
        return host, None

    monkeypatch.setitem(launch_mod.LAUNCHERS, "nvidia", launcher)
    for kernel in (axpy, touch):
        monkeypatch.setattr(kernel, "_compiled", {})
        monkeypatch.setattr(kernel, "_launches", {})
        monkeypatch.setattr(kernel, "_last_launch", None)
    return made


def _entry(kernel):
    (entry,) = set(kernel._launches.values())
    return entry


def test_repeat_launches_pass_what_the_checked_launch_passes(runtimes, rng):
    ptrs = [int(p) * 256 for p in rng.integers(1, 1 << 36, 6)]
    sizes = [int(s) for s in rng.integers(1, 1 << 20, 3)]
    calls = [(Tensor(ptrs[2 * i], (sizes[i],)), Tensor(ptrs[2 * i + 1], (sizes[i],)),
              sizes[i], float(rng.standard_normal())) for i in range(3)]
    for args in calls:
        axpy[(sizes[0] + 127) // 128](*args, BLOCK=128)
    assert _entry(axpy).fast  # the first launch made it, the others took it
    (runtime,) = runtimes.values()
    assert len(runtime.launches) == 3
    for (x, y, n, a), launch in zip(calls, runtime.launches):
        function, grid, block, smem, stream, flat, _ = launch
        assert grid == ((sizes[0] + 127) // 128, 1, 1) and block == (128, 1, 1)
        assert stream is None and smem == 0
        assert flat[:5] == [x.data_ptr(), x.data_ptr(), 0, n, 1]
        assert flat[5:10] == [y.data_ptr(), y.data_ptr(), 0, n, 1]
        assert flat[10] == n and flat[11] == pytest.approx(a, rel=1e-7)


def _specialisations():
    """(name, args, constexpr) launching different binaries of ``touch``."""
    return [
        ("f32", lambda p: Tensor(p, (64,)), 0),
        ("f16", lambda p: Tensor(p, (64,), "float16"), 0),
        ("rank2", lambda p: Tensor(p, (8, 8)), 0),
        ("strided", lambda p: Tensor(p, (64,), strides=(2,)), 0),
        ("flag", lambda p: Tensor(p, (64,)), 1),
        ("flag-true", lambda p: Tensor(p, (64,)), True),
        ("cuda-array", lambda p: CudaArray(p, (64,)), 0),
        ("dlpack", lambda p: DLPackArray(p, (64,)), 0),
    ]


def test_a_hit_never_launches_another_specialisations_binary(runtimes, rng):
    cases = _specialisations()
    expected = []
    for step in rng.permutation(np.repeat(np.arange(len(cases)), 4)):
        name, make, flag = cases[step]
        x = make(int(rng.integers(1, 1 << 30)) * 256)
        n = int(rng.integers(1, 64))
        touch[1](x, n, FLAG=flag)
        ck = touch.compile(x, n, FLAG=flag)
        expected.append((name, ck, describe_array(x).data_ptr, n))
    cks = {name: ck for name, ck, _, _ in expected}
    # Same dtype, rank and layout from three libraries: one binary, three launchers.
    assert cks["f32"] is cks["cuda-array"] is cks["dlpack"]
    assert len(set(map(id, cks.values()))) == len(cases) - 2
    assert cks["f16"].signature.params[0].dtype == "f16"
    assert cks["rank2"].signature.params[0].rank == 2
    assert not cks["strided"].signature.params[0].contiguous
    seen = {ck: iter(runtimes[ck].launches) for ck in cks.values()}
    for name, ck, ptr, n in expected:
        launch = next(seen[ck])  # this launch reached its own binary, in order
        assert launch[5][0] == ptr and launch[5][-1] == n, name
    assert all(next(it, None) is None for it in seen.values())  # and no other launch did
    assert all(entry.fast for entry in touch._launches.values())


def test_streams_reach_the_launch(runtimes, monkeypatch):
    current = [0]
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(
        cuda=SimpleNamespace(is_available=lambda: True), _C=SimpleNamespace(
            _cuda_getDevice=lambda: 0, _cuda_getCurrentRawStream=lambda device: current[0])))

    class StreamTensor(Tensor):  # a new type: its stream getter is made with this torch
        __module__ = "torch"

    x, y = StreamTensor(0x1000, (256,)), StreamTensor(0x2000, (256,))
    torch_stream = SimpleNamespace(cuda_stream=0x7100)
    cupy_stream = SimpleNamespace(ptr=0x7200)
    for stream in (None, None, 0x7300, torch_stream, cupy_stream, 0):
        if stream is None:
            current[0] += 0x10  # as inside `with torch.cuda.stream(s):`
        axpy[2](x, y, 256, 1.0, BLOCK=128, stream=stream)
    (runtime,) = runtimes.values()
    assert [launch[4] for launch in runtime.launches] == [0x10, 0x20, 0x7300, 0x7100, 0x7200,
                                                          None]
    # Device arrays of other libraries: the legacy default stream unless one is given.
    a = CudaArray(0x3000, (256,))
    axpy[2](a, a, 256, 1.0, BLOCK=128)
    axpy[2](a, a, 256, 1.0, BLOCK=128, stream=0x7400)
    assert [launch[4] for launch in runtime.launches[-2:]] == [None, 0x7400]


def test_bad_values_on_the_fast_path_raise_what_the_checked_launch_raises(runtimes):
    x, y = Tensor(0x1000, (256,)), Tensor(0x2000, (256,))
    axpy[2](x, y, 256, 1.0, BLOCK=128)
    axpy[2](x, y, 256, 1.0, BLOCK=128)
    assert _entry(axpy).fast
    with pytest.raises(KilnValueError, match=r"'n' = 2147483648 is outside the range of i32"):
        axpy[2](x, y, 2**31, 1.0, BLOCK=128)
    with pytest.raises(KilnValueError, match="grid dimension 0 is 0"):
        axpy[0](x, y, 256, 1.0, BLOCK=128)
    with pytest.raises(KilnTypeError, match="not an int"):
        axpy[(2.0,)](x, y, 256, 1.0, BLOCK=128)
    with pytest.raises(KilnTypeError, match="CPU torch tensor"):
        axpy[2](CpuTensor(0x1000, (256,)), y, 256, 1.0, BLOCK=128)
    with pytest.raises(KilnTypeError, match="in host memory"):
        axpy[2](DLPackArray(0x1000, (256,), device_type=1), y, 256, 1.0, BLOCK=128)
    (runtime,) = runtimes.values()
    assert len(runtime.launches) == 2


class Fp8Tensor(Tensor):
    """A torch float8 tensor: torch's ``__cuda_array_interface__`` raises KeyError for it."""

    __module__ = "torch"

    @property
    def __cuda_array_interface__(self):
        raise KeyError("torch.float8_e4m3fn")


def test_torch_fp8_tensors_are_arrays():
    x = Fp8Tensor(0x1000, (4, 8), dtype=kiln.f8e4m3.numpy)
    assert is_array(x)
    info = describe_array(x)
    assert (info.dtype, info.shape, info.data_ptr) == (kiln.f8e4m3, (4, 8), 0x1000)


def test_dlpack_arrays_pass_their_address_shape_and_strides(runtimes):
    x = DLPackArray(0x10000, (6, 10), strides=(16, 1), byte_offset=64)
    info = describe_array(x)
    assert (info.dtype, info.shape, info.strides, info.on_device, info.data_ptr) == \
        (kiln.f32, (6, 10), (16, 1), True, 0x10040)
    compact = describe_array(DLPackArray(0x20000, (3, 4, 5), code_bits=(4, 16)))
    assert compact.dtype is kiln.bf16 and compact.strides == (20, 5, 1)
    with pytest.raises(KilnTypeError, match="no Kiln dtype"):
        describe_array(DLPackArray(0x20000, (3,), code_bits=(1, 8)))
    y = DLPackArray(0x30000, (128,), code_bits=(2, 32))
    for _ in range(3):
        touch[1](y, 100, FLAG=0)
    (runtime,) = runtimes.values()
    assert [launch[5] for launch in runtime.launches] == [[0x30000, 0x30000, 0, 128, 1, 100]] * 3
    assert y.exports >= 3  # described at every launch: the capsule is read, never kept


def test_bound_launches_take_dlpack_arrays(runtimes):
    x = DLPackArray(0x40000, (256,))
    axpy[2](x, x, 256, 1.0, BLOCK=128)
    (ck,) = runtimes
    bound = launch_mod.bind_launch(ck, (2, 1, 1), [x, x, 256, 1.0])
    bound(0x50000, 0x60000, stream=0x99)
    *_, last = runtimes[ck].launches
    assert last[4] == 0x99 and last[5][:2] == [0x50000, 0x50000] and last[5][5] == 0x60000


def test_other_threads_launch_from_their_own_argument_blocks(runtimes):
    x = Tensor(0x1000, (256,))
    axpy[2](x, x, 256, 1.0, BLOCK=128)
    done = []

    def worker(ptr):
        axpy[2](Tensor(ptr, (256,)), x, 256, 1.0, BLOCK=128)
        done.append(ptr)

    threads = [threading.Thread(target=worker, args=(0x10000 * (i + 2),)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (runtime,) = runtimes.values()
    assert sorted(launch[5][0] for launch in runtime.launches[1:]) == sorted(done)
    (ck,) = runtimes
    assert len(ck._launch_plan.launcher.thread_blocks) >= 2


def test_launch_blocking_waits_after_fast_launches(runtimes, monkeypatch):
    monkeypatch.setenv("KILN_LAUNCH_BLOCKING", "1")
    waits = []
    original = launch_mod.LAUNCHERS["nvidia"]

    def with_driver(ck):
        host, _ = original(ck)
        return host, SimpleNamespace(synchronize=lambda: waits.append(ck.name))

    monkeypatch.setitem(launch_mod.LAUNCHERS, "nvidia", with_driver)
    x = Tensor(0x1000, (256,))
    for _ in range(3):
        axpy[2](x, x, 256, 1.0, BLOCK=128)
    assert _entry(axpy).fast and waits == ["axpy"] * 3


def test_numpy_arguments_and_launcher_doubles_keep_the_checked_path(runtimes):
    x = Tensor(0x1000, (256,))
    axpy[2](x, x, 256, 1.0, BLOCK=128)
    (ck,) = runtimes
    assert specialized_launcher(ck, (np.zeros(256, np.float32), x, 256, 1.0), (0, 1, 2, 3)) \
        is None
    stand_in = SimpleNamespace(name="k", signature=ck.signature,
                               _launch_plan=SimpleNamespace(launcher=lambda *a: None))
    assert specialized_launcher(stand_in, (x, x, 256, 1.0), (0, 1, 2, 3)) is None
    assert specialized_launcher(SimpleNamespace(), (x,), (0,)) is None  # never launched


def test_the_last_launch_is_reused_only_under_the_same_default_target(runtimes, monkeypatch):
    x = Tensor(0x1000, (256,))
    for _ in range(3):
        axpy[2](x, x, 256, 1.0, BLOCK=128)
    (entry,) = set(axpy._launches.values())
    assert axpy._last_launch is entry and entry.guarded
    monkeypatch.setattr(sys.modules["kiln.kernel"], "_default_target", "sm_80")
    axpy[2](x, x, 256, 1.0, BLOCK=128)
    launches = {ck.target.name: len(runtime.launches) for ck, runtime in runtimes.items()}
    assert launches == {"sm_90a": 3, "sm_80": 1}
