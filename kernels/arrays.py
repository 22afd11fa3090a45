"""Arrays of the caller's library for the kernel library's entry points: allocation and
conversion in numpy, torch (on the caller's device) or cupy (:class:`ArrayLib`), torch dtypes
of Kiln dtypes. Re-exported by :mod:`kiln.kernels.runtime`, which the entry points import.

Example: ``empty_like(q, (2, 3), kiln.f32)`` is a torch tensor on q's device for a torch ``q``
and a numpy array for a numpy one.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

import kiln
from kiln.arrays import is_torch_tensor as is_torch


def empty_like(like, shape: tuple, dtype: kiln.DType, fill: float | None = None):
    """A new array of ``like``'s kind (numpy, torch on its device, cupy), filled if asked."""
    return ArrayLib(like).empty(shape, dtype, fill)


_TORCH_DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "i32": "int32",
                 "i64": "int64", "i16": "int16", "i8": "int8"}


def torch_dtype(dtype):
    """The torch dtype of a Kiln dtype (or name). Example: ``torch_dtype("bf16")``."""
    import torch

    return getattr(torch, _TORCH_DTYPES[kiln.dtype(dtype).name])


def is_cupy(x: Any) -> bool:
    return type(x).__module__.startswith("cupy")


class ArrayLib:
    """Allocation and conversion in the caller's array library: numpy, torch on ``like``'s
    device, or cupy on its current device.

    Example: ``ArrayLib(q).empty((2, 3), kiln.f32)`` is a torch tensor on q's device for a
    torch ``q`` and a numpy array for a numpy one."""

    def __init__(self, like):
        self.torch = is_torch(like)
        self.cupy = not self.torch and is_cupy(like)
        self.device = like.device if self.torch else None

    def empty(self, shape, dtype, fill=None):
        """A new ``dtype`` array of ``shape`` (uninitialised unless ``fill``)."""
        name = kiln.dtype(dtype).name
        if self.torch:
            import torch

            if fill is None:
                return torch.empty(shape, dtype=torch_dtype(name), device=self.device)
            return torch.full(shape, fill, dtype=torch_dtype(name), device=self.device)
        if self.cupy:
            import cupy

            if name == "bf16":
                raise kiln.KilnTypeError("cupy has no bfloat16 arrays for this output",
                                         fix="pass torch tensors (or numpy arrays) instead")
            numpy_dtype = kiln.dtype(name).numpy
            return cupy.empty(shape, numpy_dtype) if fill is None else \
                cupy.full(shape, fill, numpy_dtype)
        if fill is None:
            return np.empty(shape, kiln.dtype(name).numpy)
        return np.full(shape, fill, kiln.dtype(name).numpy)

    def full(self, shape, value, dtype):
        return self.empty(shape, dtype, fill=value)

    def asarray(self, x, dtype):
        """``x`` (an array or a sequence) as a contiguous ``dtype`` array of this library."""
        if self.torch:
            import torch

            return torch.as_tensor(x, device=self.device).to(torch_dtype(dtype)).contiguous()
        return np.ascontiguousarray(self.numpy(x), kiln.dtype(dtype).numpy)

    @staticmethod
    def numpy(x):
        """A host numpy copy of ``x`` (bf16 and FP8 bits kept exactly); numpy arrays and
        scalars as they are, sequences as numpy arrays."""
        if is_torch(x):
            import torch

            x = x.detach().cpu()
            if x.dtype == torch.bfloat16:
                return x.view(torch.int16).numpy().view(kiln.bf16.numpy)
            if x.element_size() == 1 and x.is_floating_point():  # FP8: .numpy() refuses it
                return x.view(torch.uint8).numpy().view(kiln.dtype(x.dtype).numpy)
            return x.numpy()
        if is_cupy(x):
            return x.get()
        return x if isinstance(x, numbers.Number) else np.asarray(x)

    def like(self, array: np.ndarray):
        """A numpy result as an array of this library (on its device)."""
        if self.torch:
            import torch

            array = np.ascontiguousarray(array)
            if array.dtype == kiln.bf16.numpy:
                return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16).to(
                    self.device)
            return torch.from_numpy(array).to(self.device)
        if self.cupy:
            import cupy

            return cupy.asarray(array)
        return array

    def copy_into(self, template, array: np.ndarray):
        """Write a numpy result into ``template`` (an array of this library) and return it."""
        if self.torch or self.cupy:
            template[...] = self.like(array)
        else:
            template[...] = array
        return template


def contiguous(x):
    """``x`` itself when contiguous, else a contiguous copy of the same kind."""
    return x.contiguous() if is_torch(x) else np.ascontiguousarray(x)
