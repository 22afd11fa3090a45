"""Launching a compiled kernel: argument conversion, staging of host arrays, streams, TMA maps.

``launch(ck, grid, args, stream=...)`` takes the run-time arguments in ``ck.signature.params``
order (constexprs already removed):

- numpy arrays are copied to the device, the kernel runs, the stream is synchronised and every
  writeable array is copied back (convenient, slow);
- torch / cupy CUDA tensors are passed zero-copy and the launch is asynchronous;
- Python / numpy scalars are passed by value (f16/bf16/fp8 as bit patterns);
- a :class:`~kiln.lowering.signature.TensorMapParam` takes the tensor itself: the 128-byte TMA
  descriptor is encoded on the host, copied to device memory and cached per
  (pointer, shape, strides, box, swizzle).

``stream`` is a torch/cupy stream, a raw ``CUstream`` int, or None for the default stream.
The JIT-compiled launcher and the per-parameter converters are built on the first launch and
kept on the CompiledKernel (attribute ``_launch_plan``), so later launches cost a few µs.

Example::

    ck = compile_kernel(kiln_ir, sig, CompileOptions("sm_90a"))
    launch(ck, ((n + 255) // 256, 1, 1), [x, y, n, 2.0])
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Sequence

import ml_dtypes
import numpy as np

from kiln.lowering.arrays import describe_array
from kiln.dtypes import dtype as to_dtype
from kiln.errors import KilnTypeError, KilnValueError, LaunchError
from kiln.lowering.host import scalar_carrier
from kiln.lowering.signature import ScalarParam, TensorMapParam, TensorParam

_PLAN_ATTRIBUTE = "_launch_plan"
_GRID_LIMITS = (2**31 - 1, 65535, 65535)

# CUtensorMapDataType and CUtensorMapSwizzle enumerators (cuda.h).
_TMA_DATA_TYPES = {"i8": 0, "f8e4m3": 0, "f8e5m2": 0, "i16": 1, "i32": 3, "i64": 5, "f16": 6,
                   "f32": 7, "f64": 8, "bf16": 9}
_TMA_SWIZZLES = {0: 0, 32: 1, 64: 2, 128: 3}
_BIT_PATTERN_DTYPES = {"f16": np.float16, "bf16": ml_dtypes.bfloat16,
                       "f8e4m3": ml_dtypes.float8_e4m3fn, "f8e5m2": ml_dtypes.float8_e5m2}


def launch(ck, grid, args: Sequence, *, stream=None) -> None:
    """Run ``ck`` on ``grid`` (1 to 3 ints) with ``args``; see the module docstring.

    Raises KilnValueError/KilnTypeError for bad grids or arguments and LaunchError when the
    driver refuses, no GPU is present or the target cannot be launched here.
    """
    plan = getattr(ck, _PLAN_ATTRIBUTE, None)
    if plan is None:
        plan = _make_plan(ck)
        setattr(ck, _PLAN_ATTRIBUTE, plan)
    plan(grid, args, stream)


def bind_launch(ck, grid, args: Sequence) -> "BoundLaunch":
    """``ck`` on a fixed ``grid`` with ``args`` fixed except for the tensors' device addresses.

    For library entry points that cache one per shape class, so a repeat call skips argument
    conversion (see :class:`BoundLaunch`). ``args`` are example arguments in
    ``ck.signature.params`` order: device tensors (torch/cupy; numpy arrays would need a
    copy per launch) whose shapes, strides and dtypes every later call shares, and the scalars.

    Example::

        bound = bind_launch(ck, (4, 1, 1), [x, y, n, 2.0])
        bound(x2.data_ptr(), y2.data_ptr())   # same shapes as x, y
    """
    return BoundLaunch(ck, grid, args)


class BoundLaunch:
    """A launch prepared by :func:`bind_launch`; call it with one device address per tensor
    parameter (in parameter order) and an optional ``stream``.

    Shapes, strides, dtypes and scalars were checked and converted once; the addresses are
    not checked, so the caller must pass tensors laid out exactly like the example ones.
    """

    def __init__(self, ck, grid, args: Sequence):
        plan = getattr(ck, _PLAN_ATTRIBUTE, None)
        if plan is None:
            plan = _make_plan(ck)
            setattr(ck, _PLAN_ATTRIBUTE, plan)
        params = ck.signature.params
        if len(args) != len(params):
            raise KilnValueError(f"{ck.name} takes {len(params)} run-time arguments, got "
                                 f"{len(args)}", fix="pass one value per kernel parameter")
        self._grid = normalize_grid(grid)
        self._launcher = plan.launcher
        self._flat: list = []
        self._pointer_slots: list[int] = []  # index of each tensor's allocated pointer
        for param, convert, value in zip(params, plan.converters, args):
            if isinstance(value, np.ndarray) or isinstance(param, TensorMapParam):
                raise KilnTypeError(f"bind_launch cannot bind {param.name!r}: numpy arrays and "
                                    "tensor maps are converted per launch",
                                    fix="use ck.launch(...) for these arguments")
            if isinstance(param, TensorParam):
                self._pointer_slots.append(len(self._flat))
            convert(value, self._flat, None)

    def __call__(self, *pointers: int, stream=None) -> None:
        if len(pointers) != len(self._pointer_slots):
            raise KilnValueError(f"this launch binds {len(self._pointer_slots)} tensors, got "
                                 f"{len(pointers)} addresses", fix="pass one per tensor parameter")
        flat = self._flat.copy()
        for slot, pointer in zip(self._pointer_slots, pointers):
            flat[slot] = flat[slot + 1] = pointer  # memref allocated and aligned pointers
        self._launcher(flat, self._grid, stream_handle(stream))


def normalize_grid(grid) -> tuple[int, int, int]:
    """``grid`` as three ints >= 1 within the hardware limits, else KilnValueError."""
    dims = (grid,) if isinstance(grid, (int, np.integer)) else tuple(grid)
    if not 1 <= len(dims) <= 3:
        raise KilnValueError(f"grid must have 1 to 3 dimensions, got {grid!r}",
                             fix="pass grid=(gx,), (gx, gy) or (gx, gy, gz)")
    out = []
    for axis, (value, limit) in enumerate(zip(dims + (1,) * (3 - len(dims)), _GRID_LIMITS)):
        try:
            value = operator.index(value)
        except TypeError:
            raise KilnTypeError(f"grid dimension {axis} is {type(value).__name__}, not an int",
                                fix="compute the grid with integer arithmetic, e.g. (n + 255) // 256")
        if not 1 <= value <= limit:
            raise KilnValueError(f"grid dimension {axis} is {value}; it must be in 1..{limit}",
                                 fix="make every grid dimension at least 1 (skip the launch "
                                     "when there is no work)")
        out.append(value)
    return out[0], out[1], out[2]


def stream_handle(stream) -> int | None:
    """The raw ``CUstream`` of a torch/cupy stream, an int handle, or None (default stream)."""
    if stream is None:
        return None
    if isinstance(stream, (int, np.integer)):
        return int(stream) or None
    for attribute in ("cuda_stream", "ptr", "handle"):  # torch, cupy, cuda-python
        value = getattr(stream, attribute, None)
        if isinstance(value, (int, np.integer)):
            return int(value) or None
    raise KilnTypeError(f"cannot use a {type(stream).__name__} as a CUDA stream",
                        fix="pass a torch.cuda.Stream, a cupy stream, a raw int handle or None")


class _Staging:
    """Device copies of numpy arguments for one launch; copied back and freed afterwards."""

    def __init__(self, driver):
        self.driver = driver
        driver.make_current()  # launch may be called from a thread other than the first one
        self.copies: list[tuple[np.ndarray, np.ndarray, int]] = []  # (user, contiguous, dev ptr)
        self.allocations: list[int] = []

    def upload(self, array: np.ndarray) -> tuple[int, np.ndarray]:
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


def _make_plan(ck) -> "_LaunchPlan":
    """Build the launcher for ``ck``'s target (raises LaunchError where launching is impossible)."""
    target = ck.target
    if target.ptx_only:
        raise LaunchError(f"{target.name} kernels cannot be launched by Kiln (PTX only)",
                          fix="inspect kernel.asm['ptx'], or compile for sm_80/sm_90a to run")
    if target.is_amd:
        from kiln.lowering.amd_host import build_amd_launcher

        if "hsaco" not in ck.asm:
            raise LaunchError(f"{ck.name} has no linked code object (hsaco) to launch",
                              fix="install ld.lld or set KILN_LD_LLD so Kiln can link it")
        return _LaunchPlan(ck.name, ck.signature,
                           build_amd_launcher(ck.signature, target, ck.asm["hsaco"]), None)
    from kiln.lowering.cuda import driver
    from kiln.lowering.host import build_nvidia_launcher

    cuda_driver = driver()  # raises LaunchError without a GPU, before the JIT could abort
    launcher = build_nvidia_launcher(ck.signature, target, cubin=ck.asm.get("cubin"),
                                     ptx=ck.asm.get("ptx"))
    return _LaunchPlan(ck.name, ck.signature, launcher, cuda_driver)


class _LaunchPlan:
    """A kernel's launcher plus one converter per parameter, built once.

    ``launcher(flat_args, grid, stream)`` performs the launch; ``driver`` (None on AMD) stages
    numpy arrays and encodes tensor maps.
    """

    def __init__(self, name: str, signature, launcher, driver):
        self.name = name
        self.signature = signature
        self.launcher = launcher
        self.driver = driver
        self.converters = [self._converter(p) for p in signature.params]
        self.tensor_maps: dict[tuple, int] = {}

    def __call__(self, grid, args: Sequence, stream) -> None:
        grid = normalize_grid(grid)
        params = self.signature.params
        if len(args) != len(params):
            names = ", ".join(p.name for p in params)
            raise KilnValueError(f"{self.name} takes {len(params)} run-time arguments ({names}), "
                                 f"got {len(args)}", fix="pass one value per kernel parameter")
        handle = stream_handle(stream)
        staging = None
        flat: list = []
        try:
            for convert, value in zip(self.converters, args):
                if isinstance(value, np.ndarray) and staging is None:
                    staging = self._new_staging()
                convert(value, flat, staging)
            self.launcher(flat, grid, handle)
            if staging is not None:
                self.driver.stream_synchronize(handle)
                staging.download()
        finally:
            if staging is not None:
                staging.free()

    def _new_staging(self) -> _Staging:
        if self.driver is None:
            raise KilnTypeError("numpy arrays cannot be passed to AMD kernels yet",
                                fix="pass torch (ROCm) device tensors")
        return _Staging(self.driver)

    def _converter(self, param) -> Callable[[Any, list, Any], None]:
        if isinstance(param, TensorParam):
            return lambda value, flat, staging: self._tensor(param, value, flat, staging)
        if isinstance(param, TensorMapParam):
            return lambda value, flat, staging: flat.append(
                self._tensor_map(param, value, staging))
        return _scalar_converter(param)

    def _tensor(self, param: TensorParam, value, flat: list, staging) -> None:
        ptr, shape, strides = _device_view(param, value, staging)
        if param.contiguous and strides[-1] != 1 and shape[-1] > 1:
            raise KilnValueError(f"argument {param.name!r} has innermost stride {strides[-1]} but "
                                 f"the kernel was specialised for stride 1",
                                 fix="pass a contiguous tensor (.contiguous()) or recompile")
        flat += (ptr, ptr, 0, *shape, *strides)

    def _tensor_map(self, param: TensorMapParam, value, staging) -> int:
        ptr, shape, strides = _device_view(param, value, staging)
        key = (param, ptr, shape, strides)
        cached = self.tensor_maps.get(key)
        if cached is not None and staging is None:
            return cached
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
        self.driver.make_current()
        encoded = self.driver.tensor_map_encode_tiled(
            _TMA_DATA_TYPES[to_dtype(param.dtype).name], ptr, list(reversed(shape)),
            [s * itemsize for s in reversed(strides[:-1])], list(reversed(param.box)),
            _TMA_SWIZZLES[param.swizzle], 1 if param.oob_fill_nan else 0)
        host = np.frombuffer(encoded, dtype=np.uint8)
        if staging is not None:  # the tensor itself is a temporary copy: do not cache
            device_ptr = staging.allocate(len(encoded))
        else:
            device_ptr = self.driver.mem_alloc(len(encoded))
            self.tensor_maps[key] = device_ptr
        self.driver.memcpy_htod(device_ptr, host.ctypes.data, len(encoded))
        return device_ptr


def _device_view(param, value, staging) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
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
    if not hasattr(value, "__cuda_array_interface__"):
        raise KilnTypeError(f"argument {param.name!r} must be a tensor, got {type(value).__name__}",
                            fix="pass a numpy array or a torch/cupy CUDA tensor")
    info = describe_array(value)
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


def _scalar_converter(param: ScalarParam) -> Callable[[Any, list, Any], None]:
    name = to_dtype(param.dtype).name
    carrier, bits = scalar_carrier(name)
    if bits is not None:
        np_type = _BIT_PATTERN_DTYPES[name]
        view = np.uint16 if bits == 16 else np.uint8

        def to_bits(value, flat, staging):
            flat.append(int(np.asarray(_as_float(param, value), dtype=np_type).view(view)))

        return to_bits
    if name in ("f32", "f64"):
        return lambda value, flat, staging: flat.append(_as_float(param, value))

    def to_int(value, flat, staging):
        try:
            flat.append(operator.index(value))
        except TypeError:
            raise KilnTypeError(f"argument {param.name!r} must be an integer ({name}), got "
                                f"{type(value).__name__}", fix=f"pass int({param.name})")

    return to_int


def _as_float(param, value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise KilnTypeError(f"argument {param.name!r} must be a number ({param.dtype}), got "
                            f"{type(value).__name__}", fix="pass a Python or numpy float")
