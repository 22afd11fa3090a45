"""TMA descriptors first needed inside a CUDA-graph capture (``lowering/tensor_map_capture.py``),
checked without a GPU: a driver double refuses ``cuMemAlloc`` and synchronous copies while a
stream captures, as the driver does, records the asynchronous copies a graph would hold, and
performs them when the "graph" is replayed."""

import ctypes
from types import SimpleNamespace

import pytest

from kiln.core.errors import LaunchError
from kiln.runtime import launch as launch_mod
from kiln.runtime.host import HostLauncher, nvidia_kernel_object
from kiln.runtime.launch_fast import specialized_launcher
from kiln.signature import KernelSignature, ScalarParam, TensorMapParam, TensorParam
from kiln.core.targets import get_target
from recording_runtime import RecordingCudaRuntime

PARAM = TensorMapParam("c", "f16", 2, (64, 64), 128)
_ALIVE: list = []  # runtimes outlive the engines that unload their modules through them


class CapturingDriver:
    """Host memory as device memory; streams in ``capturing`` are recording a graph."""

    def __init__(self):
        self.capturing: set[int] = set()
        self.buffers, self.freed, self.graph, self.encoded = {}, [], [], []

    def make_current(self):
        pass

    def _buffer(self, nbytes):
        buffer = ctypes.create_string_buffer(nbytes)
        self.buffers[ctypes.addressof(buffer)] = buffer
        return ctypes.addressof(buffer)

    def mem_alloc(self, nbytes):
        if self.capturing:
            raise LaunchError("cuMemAlloc failed: operation not permitted when stream is "
                              "capturing")
        return self._buffer(nbytes)

    mem_alloc_host = mem_alloc

    def mem_free(self, ptr):
        self.freed.append(ptr)

    mem_free_host = mem_free

    def memcpy_htod(self, dst, src, nbytes):
        if self.capturing:
            raise LaunchError("cuMemcpyHtoD failed: operation not permitted when stream is "
                              "capturing")
        ctypes.memmove(dst, src, nbytes)

    def memcpy_htod_async(self, dst, src, nbytes, stream):
        assert stream in self.capturing  # only capture-time descriptors are copied this way
        self.graph.append((dst, src, nbytes, stream))

    def replay(self):
        for dst, src, nbytes, _ in self.graph:
            ctypes.memmove(dst, src, nbytes)

    def stream_capturing(self, stream):
        return stream in self.capturing

    def tensor_map_encode_tiled(self, data_type, address, *rest):
        self.encoded.append(address)
        return address.to_bytes(8, "little") * 16


def _descriptor(cache, ptr, stream=None):
    return cache.descriptor(PARAM, ptr, (256, 128), (128, 1), stream=stream)


def _read(address):
    return ctypes.string_at(address, 128)


def test_a_descriptor_first_needed_in_a_capture_is_copied_by_the_graph(rng):
    driver = CapturingDriver()
    cache = launch_mod.TensorMapCache(driver, capacity=2)
    warm, fresh = (int(p) * 16 for p in rng.choice(1 << 30, 2, replace=False))
    outside = _descriptor(cache, warm, stream=0x10)  # the warm-up launch
    driver.capturing.add(0x20)
    assert _descriptor(cache, warm, stream=0x20) == outside  # known: cached as before
    inside = _descriptor(cache, fresh, stream=0x20)
    assert _descriptor(cache, fresh, stream=0x20) == inside  # once per capture arena slot
    ((dst, src, nbytes, stream),) = driver.graph
    assert (dst, nbytes, stream) == (inside, 128, 0x20)
    assert _read(src) == fresh.to_bytes(8, "little") * 16
    assert _read(inside) == bytes(128)  # nothing ran yet: a capture only records
    driver.replay()
    assert _read(inside) == fresh.to_bytes(8, "little") * 16
    driver.capturing.clear()
    # Eager launches never read a capture slot (its copy runs only in replays), and no
    # eviction frees one.
    eager = _descriptor(cache, fresh, stream=0x10)
    assert eager != inside and _read(eager) == _read(inside)
    for p in rng.choice(1 << 30, 5, replace=False):
        _descriptor(cache, int(p) * 16 + (1 << 34))
    assert inside not in driver.freed and eager in driver.freed


def test_the_capture_arena_is_bounded_and_made_before_any_capture():
    driver = CapturingDriver()
    cache = launch_mod.TensorMapCache(driver)
    driver.capturing.add(0x20)
    with pytest.raises(LaunchError, match="launch once before capturing"):
        _descriptor(cache, 0x1000, stream=0x20)
    driver.capturing.clear()
    _descriptor(cache, 0x1000)
    driver.capturing.add(0x20)
    addresses = {_descriptor(cache, 0x10000 * (i + 2), stream=0x20)
                 for i in range(launch_mod.CAPTURE_ARENA_SLOTS)}
    assert len(addresses) == launch_mod.CAPTURE_ARENA_SLOTS
    with pytest.raises(LaunchError, match="inside CUDA-graph captures") as err:
        _descriptor(cache, 0x999_0000, stream=0x20)
    assert "Fix:" in str(err.value)


class DeviceArray:
    def __init__(self, ptr, shape, typestr="<f2"):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": shape,
                                         "typestr": typestr, "strides": None, "version": 3}


def _kernel_with_a_tensor_map(driver):
    signature = KernelSignature("gemm_like", (TensorParam("a", "f16", 2), PARAM,
                                              ScalarParam("m", "i32")))
    runtime = RecordingCudaRuntime(signature)
    _ALIVE.append(runtime)
    launcher = HostLauncher(signature, lambda: nvidia_kernel_object(get_target("sm_90a"),
                                                                     ptx="// ptx"),
                            [], runtime_symbols=runtime.symbols())
    plan = launch_mod._LaunchPlan(signature.name, signature, launcher, driver)
    ck = SimpleNamespace(name=signature.name, signature=signature, _launch_plan=plan)
    ck.launch = lambda grid, args, stream=None: launch_mod.launch(ck, grid, args, stream=stream)
    return ck, runtime


@pytest.mark.parametrize("path", ["launch", "bound", "generated"])
def test_every_launch_path_passes_its_stream_to_the_descriptor_cache(path):
    driver = CapturingDriver()
    ck, runtime = _kernel_with_a_tensor_map(driver)
    a = DeviceArray(0x1000, (256, 128))
    warm = [a, DeviceArray(0x20000, (256, 128)), 256]
    ck.launch((1, 1, 1), warm, stream=0x10)
    bound = launch_mod.bind_launch(ck, (1, 1, 1), warm)
    fast = specialized_launcher(ck, tuple(warm), (0, 1, 2))
    driver.capturing.add(0x20)
    fresh = DeviceArray(0x30000, (256, 128))
    if path == "launch":
        ck.launch((1, 1, 1), [a, fresh, 256], stream=0x20)
    elif path == "bound":
        bound(0x1000, 0x30000, stream=0x20)
    else:
        fast((1, 1, 1), (a, fresh, 256), 0x20)
    ((dst, _, _, stream),) = driver.graph
    *_, captured = runtime.launches
    assert stream == 0x20 and captured[4] == 0x20 and captured[5][7] == dst  # a: 7 slots
