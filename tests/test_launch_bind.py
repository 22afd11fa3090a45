"""``bind_launch``: a launch converted once, then repeated with new device addresses only.

Checked without a GPU: the bound launch runs through a real JIT-compiled host launcher whose
``mgpu*`` runtime calls are recorded in-process (the kernel arguments are read back from the
``void **params`` array ``mgpuLaunchKernel`` receives), with device arrays described by
``__cuda_array_interface__`` or by a stand-in for torch tensors.
"""

import ctypes
import sys
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from kiln.core.errors import KilnTypeError, KilnValueError
from recording_runtime import RecordingCudaRuntime
from kiln.runtime import launch as launch_mod
from kiln.runtime.host import HostLauncher, flat_c_argtypes, nvidia_kernel_object
from kiln.signature import KernelSignature, ScalarParam, TensorMapParam, TensorParam
from kiln.core.targets import get_target

SIG = KernelSignature("scale_rows", (TensorParam("x", "f32", 2), ScalarParam("n", "i32"),
                                     TensorParam("y", "f16", 1), ScalarParam("a", "f32")),
                      block=(128, 1, 1))


class DeviceArray:
    def __init__(self, ptr, shape, typestr, strides=None):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": shape,
                                         "typestr": typestr, "strides": strides, "version": 3}


def _bound_kernel(signature=SIG, driver=None):
    runtime = RecordingCudaRuntime(signature)
    launcher = HostLauncher(signature, lambda: nvidia_kernel_object(get_target("sm_80"),
                                                                     ptx="// ptx"),
                            [], runtime_symbols=runtime.symbols())
    # The engine's destructor unloads the module through the runtime: keep the callbacks alive.
    launcher.runtime = runtime
    plan = launch_mod._LaunchPlan(signature.name, signature, launcher, driver)
    return SimpleNamespace(name=signature.name, signature=signature, _launch_plan=plan), runtime


def test_bound_launch_replaces_only_the_tensor_addresses():
    ck, runtime = _bound_kernel()
    rng = np.random.default_rng()
    x_ptr, y_ptr = (int(v) * 64 for v in rng.integers(1 << 20, 1 << 34, 2))
    n = int(rng.integers(1, 1 << 30))
    x = DeviceArray(x_ptr, (6, 10), "<f4", strides=(64, 4))  # padded rows
    bound = launch_mod.bind_launch(ck, (5, 2), [x, n, DeviceArray(y_ptr, (7,), "<f2"), 0.25])
    bound(x_ptr + 4096, y_ptr + 64, stream=77)
    bound(x_ptr, y_ptr)
    (_, grid, _, _, stream, first, _), (_, _, _, _, default_stream, second, _) = runtime.launches
    assert grid == (5, 2, 1) and stream == 77 and default_stream is None
    assert first == [x_ptr + 4096, x_ptr + 4096, 0, 6, 10, 16, 1, n,
                     y_ptr + 64, y_ptr + 64, 0, 7, 1, 0.25]
    assert second[:2] == [x_ptr, x_ptr] and second[8:10] == [y_ptr, y_ptr]
    assert first[2:8] == second[2:8] and first[10:] == second[10:]


def test_bind_rejects_what_it_cannot_hold_fixed():
    ck, _ = _bound_kernel()
    y = DeviceArray(0x2000, (7,), "<f2")
    with pytest.raises(KilnTypeError, match="numpy arrays"):
        launch_mod.bind_launch(ck, 1, [np.ones((2, 2), np.float32), 3, y, 1.0])
    with pytest.raises(KilnValueError, match="run-time arguments"):
        launch_mod.bind_launch(ck, 1, [y])
    with pytest.raises(KilnValueError, match="'n' = 2147483648 is outside the range of i32"):
        launch_mod.bind_launch(ck, 1, [DeviceArray(0x1000, (2, 2), "<f4"), 2**31, y, 1.0])
    bound = launch_mod.bind_launch(ck, 1, [DeviceArray(0x1000, (2, 2), "<f4"), 3, y, 1.0])
    with pytest.raises(KilnValueError, match="binds 2 tensors"):
        bound(0x1000)


def test_each_thread_launches_from_its_own_argument_block():
    ck, runtime = _bound_kernel()
    bound = launch_mod.bind_launch(ck, 1, [DeviceArray(0x1000, (2, 2), "<f4"), 3,
                                           DeviceArray(0x2000, (7,), "<f2"), 1.0])
    worker = threading.Thread(target=bound, args=(0x5000, 0x6000))
    worker.start()
    worker.join()
    bound(0x7000, 0x8000)
    (*_, in_thread, _), (*_, in_main, _) = runtime.launches
    assert in_thread[0] == 0x5000 and in_main[0] == 0x7000
    assert bound._arguments is not bound._other_threads[worker.ident]


class CountingDriver:
    """Device memory and TMA encoding stand-ins that count what they did."""

    def __init__(self):
        self.encoded, self.allocated, self.freed = [], [], []
        self._next = 0x9000_0000

    def make_current(self):
        pass

    def mem_alloc(self, nbytes):
        self._next += 256
        self.allocated.append(self._next)
        return self._next

    def mem_free(self, ptr):
        self.freed.append(ptr)

    mem_alloc_host = mem_alloc  # the capture arena's page-locked block
    mem_free_host = mem_free

    def stream_capturing(self, stream):
        return False

    def memcpy_htod(self, dst, src, nbytes):
        assert nbytes == 128

    def tensor_map_encode_tiled(self, data_type, address, *rest):
        self.encoded.append(address)
        return address.to_bytes(8, "little") * 16


def test_tensor_map_parameters_bind_and_reencode_per_new_address():
    sig = KernelSignature("tma", (TensorMapParam("a", "f16", 2, (64, 64), 128),
                                  TensorParam("out", "f32", 1), ScalarParam("k", "i32")))
    driver = CountingDriver()
    ck, runtime = _bound_kernel(sig, driver)
    a0, a1 = 0x10_0000, 0x20_0000
    bound = launch_mod.bind_launch(ck, (2, 1, 1), [DeviceArray(a0, (256, 128), "<f2"),
                                                   DeviceArray(0x3000, (16,), "<f4"), 5])
    bound(a0, 0x3000)
    bound(a1, 0x4000)
    bound(a0, 0x5000)
    assert driver.encoded == [a0, a1]  # one encode per address, then the cache
    descriptors = [launch[5][0] for launch in runtime.launches]
    assert descriptors[0] == descriptors[2] != descriptors[1]
    assert [launch[5][1] for launch in runtime.launches] == [0x3000, 0x4000, 0x5000]
    assert runtime.launches[0][5][-1] == 5


def _fake_torch(monkeypatch, current_stream):
    """A ``torch`` module whose current stream is ``current_stream[0]``, and its tensor type."""
    torch_c = SimpleNamespace(_cuda_getDevice=lambda: 0,
                              _cuda_getCurrentRawStream=lambda device: current_stream[0])
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(
        _C=torch_c, cuda=SimpleNamespace(is_available=lambda: True)))

    class Tensor:
        __module__ = "torch"
        is_cuda = True

        def __init__(self, ptr, shape, dtype):
            self._ptr, self.shape, self.dtype = ptr, shape, np.dtype(dtype)

        def data_ptr(self):
            return self._ptr

        def get_device(self):
            return 0

        def dim(self):
            return len(self.shape)

        def stride(self):
            return tuple(int(np.prod(self.shape[i + 1:])) for i in range(len(self.shape)))

    return Tensor


def test_bound_torch_launch_follows_the_current_stream(monkeypatch):
    current = [0]
    Tensor = _fake_torch(monkeypatch, current)
    ck, runtime = _bound_kernel()
    bound = launch_mod.bind_launch(ck, 1, [Tensor(0x1000, (2, 2), "float32"), 3,
                                           Tensor(0x2000, (7,), "float16"), 1.0])
    bound(0x1000, 0x2000)
    current[0] = 0xABC0  # as inside `with torch.cuda.stream(s):`
    bound(0x1000, 0x2000)
    bound(0x1000, 0x2000, stream=0x5150)
    assert [launch[4] for launch in runtime.launches] == [None, 0xABC0, 0x5150]
