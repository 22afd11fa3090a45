"""Encoded TMA descriptors of a kernel's tensor-map parameters, kept in device memory:
:class:`TensorMapCache` (one per launch plan, see :mod:`kiln.runtime.launch`).

Example::

    cache = TensorMapCache(cuda.driver())
    address = cache.descriptor(param, x.data_ptr(), tuple(x.shape), tuple(x.stride()))
"""

from __future__ import annotations

import ctypes
import weakref
from collections import OrderedDict

import numpy as np

from kiln.core.dtypes import dtype as to_dtype
from kiln.core.errors import KilnValueError, LaunchError
from kiln.runtime.tensor_map_capture import CaptureArena
from kiln.signature import TensorMapParam

TENSOR_MAP_CACHE_CAPACITY = 256  # encoded TMA descriptors kept in device memory per kernel
CAPTURE_ARENA_SLOTS = 64  # descriptors a kernel may first need inside CUDA-graph captures

# CUtensorMapDataType and CUtensorMapSwizzle enumerators (cuda.h).
_TMA_DATA_TYPES = {"i8": 0, "f8e4m3": 0, "f8e5m2": 0, "i16": 1, "i32": 3, "i64": 5, "f16": 6,
                   "f32": 7, "f64": 8, "bf16": 9}
_TMA_SWIZZLES = {0: 0, 32: 1, 64: 2, 128: 3}


class TensorMapCache:
    """Encoded TMA descriptors in device memory, one per (dtype, box, swizzle, fill, address,
    shape, strides), at most ``capacity`` of them: the least recently used is freed first, and
    all are freed when the cache is collected or the interpreter exits.

    A freed descriptor may still be read by a queued kernel only if ``cuMemFree`` returned
    before that kernel ran, and it does not: like ``cudaFree`` it waits for the device first.
    Eviction therefore costs a synchronisation, which the capacity keeps rare.

    Example: ``cache.descriptor(param, x.data_ptr(), tuple(x.shape), tuple(x.stride()))``.
    """

    def __init__(self, driver, capacity: int = TENSOR_MAP_CACHE_CAPACITY):
        self._driver = driver
        self.capacity = capacity
        self._entries: OrderedDict[tuple, int] = OrderedDict()
        self.addresses: set[int] = set()  # of the cached descriptors (not the captured ones)
        # Descriptors freed so far: memos of addresses check it (the native shim's through
        # evictions_address).
        self._evictions = ctypes.c_uint64(0)
        self.evictions_address = ctypes.addressof(self._evictions)
        # Descriptors first needed inside a CUDA-graph capture (kiln.lowering.tensor_map_capture):
        # the arena is made with the first descriptor, before any capture can need it.
        self._arena: CaptureArena | None = None
        self._captured: dict[tuple, int] = {}
        weakref.finalize(self, _free_descriptors, driver, self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def evictions(self) -> int:
        return self._evictions.value

    def descriptor(self, param: TensorMapParam, ptr: int, shape: tuple, strides: tuple,
                   staging=None, stream: int | None = None) -> int:
        """Device address of the descriptor of tensor (``ptr``, ``shape``, ``strides``) for
        ``param``, for a launch on ``stream``. With ``staging`` (a temporary copy of a numpy
        array) the descriptor lives in the staging memory and is not cached. A new descriptor
        while ``stream`` captures a CUDA graph goes to the capture arena, written by a copy
        the graph records."""
        key = (param.dtype, param.box, param.swizzle, param.oob_fill_nan, ptr, shape, strides)
        if staging is None:
            cached = self._entries.get(key)
            if cached is not None:
                self._entries.move_to_end(key)
                return cached
            if stream and self._driver.stream_capturing(stream):
                return self._captured_descriptor(key, param, ptr, shape, strides, stream)
        encoded = self._encode(param, ptr, shape, strides)
        if staging is not None:
            device_ptr = staging.allocate(len(encoded))
        else:
            if self._arena is None:
                self._arena = CaptureArena(self._driver, CAPTURE_ARENA_SLOTS)
            device_ptr = self._driver.mem_alloc(len(encoded))
            self._entries[key] = device_ptr
            self.addresses.add(device_ptr)
            while len(self._entries) > self.capacity:
                self._evictions.value += 1
                evicted = self._entries.popitem(last=False)[1]
                self.addresses.discard(evicted)
                self._driver.mem_free(evicted)
        self._driver.memcpy_htod(device_ptr, np.frombuffer(encoded, np.uint8).ctypes.data,
                                 len(encoded))
        return device_ptr

    def _captured_descriptor(self, key: tuple, param: TensorMapParam, ptr: int, shape: tuple,
                             strides: tuple, stream: int) -> int:
        # Only captured launches read these slots: each replay writes them before its kernel.
        captured = self._captured.get(key)
        if captured is None:
            if self._arena is None:
                raise LaunchError("a TMA descriptor was needed inside a CUDA-graph capture "
                                  "before the kernel ever launched outside one",
                                  fix="launch once before capturing (it also compiles)")
            captured = self._captured[key] = self._arena.put(
                self._encode(param, ptr, shape, strides), stream)
        return captured

    def _encode(self, param: TensorMapParam, ptr: int, shape: tuple, strides: tuple) -> bytes:
        if strides[-1] != 1:
            raise KilnValueError(f"TMA argument {param.name!r} needs innermost stride 1, got "
                                 f"{strides[-1]}", fix="pass a contiguous tensor (.contiguous())")
        itemsize = to_dtype(param.dtype).itemsize
        misaligned = [s * itemsize for s in strides[:-1] if s * itemsize % 16]
        if misaligned or ptr % 16:
            # cuTensorMapEncodeTiled would only say "invalid argument".
            raise KilnValueError(f"TMA argument {param.name!r} needs a 16-byte aligned address "
                                 f"and row strides that are multiples of 16 bytes; it has "
                                 f"strides of {[s * itemsize for s in strides]} bytes",
                                 fix=f"pad the innermost dimension to a multiple of "
                                     f"{16 // itemsize if itemsize < 16 else 1} elements")
        self._driver.make_current()
        return self._driver.tensor_map_encode_tiled(
            _TMA_DATA_TYPES[to_dtype(param.dtype).name], ptr, list(reversed(shape)),
            [s * itemsize for s in reversed(strides[:-1])], list(reversed(param.box)),
            _TMA_SWIZZLES[param.swizzle], 1 if param.oob_fill_nan else 0)


def _free_descriptors(driver, entries: OrderedDict) -> None:
    """Free every cached descriptor (at collection or interpreter exit, so errors of a driver
    that is already shutting down are ignored)."""
    while entries:
        try:
            driver.mem_free(entries.popitem()[1])
        except LaunchError:
            pass
