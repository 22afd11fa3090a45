"""A launch's arguments as flat C arguments: tensors (device arrays zero-copy, numpy arrays
staged through the device) checked against the kernel's specialisation, scalars converted to
their declared dtype.

:mod:`kiln.runtime.launch` builds one converter per parameter from these, and the launchers
generated per specialisation (:mod:`kiln.runtime.launch_fast`) call them on their slow paths.
A tensor is ``(allocated pointer, aligned pointer, offset, *shape, *strides)``, the memref's
flat form; a bf16/f16/fp8 scalar is its bit pattern.

Example::

    flat = []
    convert_tensor(param, torch_x, flat, None)    # param: a kiln.signature.TensorParam
    scalar_converter(n_param)(1024, flat, None)
"""

from __future__ import annotations

from typing import Any, Callable

import ml_dtypes
import numpy as np

from kiln.arrays import describe_array
from kiln.core.dtypes import dtype as to_dtype
from kiln.core.errors import KilnTypeError, KilnValueError
from kiln.launch_args import check_float_argument, check_int_argument
from kiln.runtime.host import scalar_carrier
from kiln.signature import ScalarParam, TensorParam

_BIT_PATTERN_DTYPES = {"f16": np.float16, "bf16": ml_dtypes.bfloat16,
                       "f8e4m3": ml_dtypes.float8_e4m3fn, "f8e5m2": ml_dtypes.float8_e5m2}


class Staging:
    """Device copies of numpy arguments for one launch; copied back and freed afterwards."""

    def __init__(self, driver):
        self.driver = driver
        driver.make_current()  # launch may be called from a thread other than the first one
        self.copies: list[tuple[np.ndarray, np.ndarray, int]] = []  # (user, contiguous, dev ptr)
        self.allocations: list[int] = []

    def upload(self, array: np.ndarray) -> tuple[int, np.ndarray]:
        for user, host, device_ptr in self.copies:
            if user is array:  # one array in two parameters (a tensor map and a tensor) aliases
                return device_ptr, host
        host = np.ascontiguousarray(array)
        device_ptr = self.allocate(host.nbytes)
        self.driver.memcpy_htod(device_ptr, host.ctypes.data, host.nbytes)
        self.copies.append((array, host, device_ptr))
        return device_ptr, host

    def allocate(self, nbytes: int) -> int:
        ptr = self.driver.mem_alloc(nbytes)
        self.allocations.append(ptr)
        return ptr

    def download(self) -> None:
        for user, host, device_ptr in self.copies:
            if user.flags.writeable:
                self.driver.memcpy_dtoh(host.ctypes.data, device_ptr, host.nbytes)
                if host is not user:
                    user[...] = host

    def free(self) -> None:
        for ptr in self.allocations:
            self.driver.mem_free(ptr)


def convert_tensor(param: TensorParam, value, flat: list, staging) -> None:
    """Append tensor ``value``'s memref words to ``flat`` (a numpy array is uploaded through
    ``staging``, a :class:`Staging`; None where the caller takes device arrays only)."""
    ptr, shape, strides = device_view(param, value, staging)
    if param.contiguous and strides[-1] != 1 and shape[-1] > 1:
        raise KilnValueError(f"argument {param.name!r} has innermost stride {strides[-1]} but "
                             f"the kernel was specialised for stride 1",
                             fix="pass a contiguous tensor (.contiguous()) or recompile")
    flat += (ptr, ptr, 0, *shape, *strides)


def device_view(param, value, staging) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """(device pointer, shape, element strides) of a tensor argument, uploading numpy arrays."""
    if isinstance(value, np.ndarray):
        _check_tensor(param, value.ndim, _dtype_name(value.dtype))
        ptr, host = staging.upload(value)
        itemsize = host.dtype.itemsize
        return ptr, host.shape, tuple(s // itemsize for s in host.strides)
    if type(value).__module__.startswith("torch") and hasattr(value, "data_ptr"):
        # torch fast path: describe_array would also work but costs more per launch.
        if not value.is_cuda:
            raise KilnTypeError(f"argument {param.name!r} is a CPU torch tensor",
                                fix="move it to the GPU (.cuda()) or pass tensor.numpy()")
        _check_tensor(param, value.dim(), _dtype_name(value.dtype))
        return value.data_ptr(), tuple(value.shape), tuple(value.stride())
    if not (hasattr(value, "__cuda_array_interface__") or hasattr(value, "__dlpack__")):
        raise KilnTypeError(f"argument {param.name!r} must be a tensor, got {type(value).__name__}",
                            fix="pass a numpy array or a torch/cupy/JAX device array")
    info = describe_array(value)
    if not info.on_device:
        raise KilnTypeError(f"argument {param.name!r} is a {type(value).__name__} in host memory",
                            fix="pass np.asarray(x) (copied to the device per launch) or a "
                                "device array")
    _check_tensor(param, info.rank, info.dtype.name)
    return info.data_ptr, info.shape, info.strides


_dtype_names: dict[Any, str] = {}


def _dtype_name(library_dtype) -> str:
    name = _dtype_names.get(library_dtype)
    if name is None:
        name = _dtype_names[library_dtype] = to_dtype(library_dtype).name
    return name


def _check_tensor(param, rank: int, dtype_name: str) -> None:
    if rank != param.rank:
        raise KilnValueError(f"argument {param.name!r} has rank {rank}; the kernel was compiled "
                             f"for rank {param.rank}", fix="pass a tensor of the compiled rank")
    if dtype_name != param.dtype:  # signatures hold canonical Kiln dtype names
        raise KilnTypeError(f"argument {param.name!r} has dtype {dtype_name}; the kernel was "
                            f"compiled for {param.dtype}",
                            fix=f"convert it first, e.g. x.astype('{param.dtype}') / x.to(...)")


def scalar_converter(param: ScalarParam) -> Callable[..., None]:
    """``convert(value, flat, staging, stream=None)`` appending scalar ``value`` checked and
    converted to ``param``'s dtype (its bit pattern for 16- and 8-bit floats)."""
    name = to_dtype(param.dtype).name
    carrier, bits = scalar_carrier(name)
    if bits is not None:
        np_type = _BIT_PATTERN_DTYPES[name]
        view = np.uint16 if bits == 16 else np.uint8

        def to_bits(value, flat, staging, stream=None):
            number = check_float_argument(param.name, value, name)
            flat.append(int(np.asarray(number, dtype=np_type).view(view)))

        return to_bits
    if name in ("f32", "f64"):
        return lambda value, flat, staging, stream=None: flat.append(
            check_float_argument(param.name, value, name))

    def to_int(value, flat, staging, stream=None):
        flat.append(check_int_argument(param.name, value, name))

    return to_int
