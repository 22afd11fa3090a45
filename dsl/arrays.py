"""Reading shape, strides, dtype and data pointer off numpy, torch and cupy arrays.

The front end uses :func:`describe_array` to specialise a kernel on its tensor arguments (dtype,
rank, innermost stride 1 or not); launch uses the pointer. Device arrays are recognised through
torch's own attributes, ``__cuda_array_interface__`` (cupy, numba, JAX on one GPU) or DLPack's
``__dlpack__`` (JAX, and any array-API library); nothing is copied.

Example::

    >>> info = describe_array(np.zeros((4, 8), np.float32))
    >>> (info.dtype, info.shape, info.strides, info.on_device)
    (kiln.f32, (4, 8), (8, 1), False)
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.core.dtypes import DType, dtype as to_dtype
from kiln.core.errors import KilnTypeError


@dataclass(frozen=True)
class ArrayInfo:
    """What Kiln needs to know about one tensor argument. Strides are in elements."""

    dtype: DType
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    on_device: bool
    data_ptr: int  # device pointer when on_device, host pointer otherwise

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def contiguous_last(self) -> bool:
        """Innermost stride is 1 (or the innermost dimension has size <= 1)."""
        return self.rank == 0 or self.strides[-1] == 1 or self.shape[-1] <= 1


def is_array(value: Any) -> bool:
    """True for numpy arrays and for device arrays Kiln can pass zero-copy. Torch tensors are
    recognised first: ``hasattr(t, "__cuda_array_interface__")`` raises KeyError for torch
    dtypes without a typestr (float8_e4m3fn, float8_e5m2)."""
    return (isinstance(value, np.ndarray) or is_torch_tensor(value)
            or hasattr(value, "__cuda_array_interface__") or hasattr(value, "__dlpack__"))


def is_torch_tensor(value: Any) -> bool:
    """True for a torch tensor (without importing torch)."""
    return type(value).__module__.startswith("torch") and hasattr(value, "data_ptr")


def describe_array(value: Any) -> ArrayInfo:
    """Shape, element strides, Kiln dtype, device residency and data pointer of ``value``."""
    if isinstance(value, np.ndarray):
        itemsize = value.dtype.itemsize
        return ArrayInfo(to_dtype(value.dtype), tuple(value.shape),
                         tuple(s // itemsize for s in value.strides), False,
                         value.ctypes.data)
    if is_torch_tensor(value):
        on_device = value.device.type == "cuda"
        return ArrayInfo(to_dtype(str(value.dtype)), tuple(value.shape), tuple(value.stride()),
                         on_device, value.data_ptr())
    try:
        cai = getattr(value, "__cuda_array_interface__", None)
    except (AttributeError, TypeError):  # JAX raises for arrays that are not on one GPU
        cai = None
    if cai is None and hasattr(value, "__dlpack__"):
        return _describe_dlpack(value)
    if cai is not None:
        np_dtype = np.dtype(cai["typestr"])
        dt = to_dtype(getattr(value, "dtype", np_dtype))
        shape = tuple(cai["shape"])
        if cai.get("strides") is None:
            strides, acc = [], 1
            for extent in reversed(shape):
                strides.append(acc)
                acc *= extent
            strides = tuple(reversed(strides))
        else:
            strides = tuple(s // np_dtype.itemsize for s in cai["strides"])
        return ArrayInfo(dt, shape, strides, True, int(cai["data"][0]))

    raise KilnTypeError(f"expected a numpy array or a CUDA tensor, got {type(value).__name__}",
                        fix="pass a numpy array, a torch/cupy CUDA tensor, or an object with "
                            "__cuda_array_interface__")


# DLPack's C ABI (dlpack.h, v0.8 and the legacy "dltensor" capsule of v1.x).
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_DL_DEVICE_MEMORY = {2: "CUDA", 10: "ROCm", 13: "CUDA managed"}  # DLDeviceType: kernels read it
# DLDataTypeCode and bits -> Kiln dtype (no unsigned integers: Kiln has none).
_DL_DTYPES = {(0, 8): "int8", (0, 16): "int16", (0, 32): "int32", (0, 64): "int64",
              (2, 16): "float16", (2, 32): "float32", (2, 64): "float64", (4, 16): "bf16",
              (6, 8): "bool", (10, 8): "f8e4m3", (12, 8): "f8e5m2"}
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _describe_dlpack(value: Any) -> ArrayInfo:
    """A device array exported through ``__dlpack__``: the capsule is read, not consumed (its
    destructor returns it to the producer), and ``value`` keeps the memory alive."""
    capsule = value.__dlpack__()
    tensor = _DLTensor.from_address(_capsule_pointer(capsule, b"dltensor"))
    code, bits, lanes = tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes
    name = _DL_DTYPES.get((code, bits)) if lanes == 1 else None
    if name is None:
        raise KilnTypeError(f"a DLPack array of type code {code}, {bits} bits x {lanes} lanes "
                            "has no Kiln dtype", fix="convert it to a float or int dtype first")
    rank = tensor.ndim
    shape = tuple(tensor.shape[i] for i in range(rank))
    if tensor.strides:
        strides = tuple(tensor.strides[i] for i in range(rank))
    else:  # NULL strides: compact row-major
        strides = tuple(int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(rank))
    on_device = tensor.device.device_type in _DL_DEVICE_MEMORY
    return ArrayInfo(to_dtype(name), shape, strides, on_device,
                     (tensor.data or 0) + tensor.byte_offset)
