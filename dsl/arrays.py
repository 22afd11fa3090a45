"""Reading shape, strides, dtype and data pointer off numpy, torch and cupy arrays.

The front end uses :func:`describe_array` to specialise a kernel on its tensor arguments (dtype,
rank, innermost stride 1 or not); launch uses the pointer. Device arrays are recognised through
``__cuda_array_interface__`` (cupy, numba, torch) or torch's own attributes; nothing is copied.

Example::

    >>> info = describe_array(np.zeros((4, 8), np.float32))
    >>> (info.dtype, info.shape, info.strides, info.on_device)
    (kiln.f32, (4, 8), (8, 1), False)
"""

from __future__ import annotations

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
    """True for numpy arrays and for device arrays Kiln can pass zero-copy."""
    return (isinstance(value, np.ndarray) or hasattr(value, "__cuda_array_interface__")
            or is_torch_tensor(value))


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
    cai = getattr(value, "__cuda_array_interface__", None)
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
