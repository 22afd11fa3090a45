"""Parameter annotations of ``@kiln.kernel`` functions and how each parameter is classified.

``kiln.constexpr`` (a Python value baked into the kernel), ``kiln.TensorMap[dtype, box,
swizzle]`` (a TMA descriptor), ``kiln.Tensor[dtype, rank]`` (:mod:`kiln.tensor`) and scalar
dtypes. Example::

    @kiln.kernel
    def copy(a: kiln.TensorMap[kiln.f16, (64, 64), 128], n: kiln.i32, BLOCK: kiln.constexpr): ...
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

from .core import dtypes as dt
from .core.errors import KilnTypeError, KilnValueError, SourceLoc
from .fingerprint import closure_values
from .tensor import TensorSpec


class constexpr:
    """Annotation for compile-time parameters: ``BLOCK: kiln.constexpr``.

    Inside the kernel the parameter is the plain Python value (usable in ``range``, shapes,
    ``if``); each distinct value compiles its own kernel.
    """


@dataclass(frozen=True)
class TensorMapSpec:
    dtype: dt.DType
    box: tuple[int, ...]
    swizzle: int
    oob_fill_nan: bool = False  # boxes outside the tensor read NaN, not zeros


class TensorMap:
    """Annotation for a TMA descriptor parameter: ``a: kiln.TensorMap[f16, (64, 64), 128]``;
    a fourth entry ``"nan"`` makes out-of-bounds parts of a box read NaN instead of zeros
    (``kiln.TensorMap[bf16, (64, 64), 128, "nan"]``).

    The launch argument is the tensor; the host builds the descriptor and passes its device
    address (an ``!llvm.ptr`` in the ``gpu.func``). In the body the parameter is a
    :class:`kiln.tma.TensorMapDescriptor` whose ``.ir`` is ``!nvgpu.tensormap.descriptor<...>``.
    """

    def __class_getitem__(cls, params) -> TensorMapSpec:
        if not isinstance(params, tuple) or len(params) not in (2, 3, 4):
            raise KilnTypeError("kiln.TensorMap needs [dtype, box], [dtype, box, swizzle] or "
                                "[dtype, box, swizzle, oob_fill]",
                                fix="e.g. kiln.TensorMap[kiln.f16, (64, 64), 128]")
        fill = params[3] if len(params) == 4 else "zero"
        if fill not in ("zero", "nan"):
            raise KilnValueError(f"TensorMap out-of-bounds fill {fill!r} is not 'zero' or 'nan'",
                                 fix='use "zero" (the default) or "nan"')
        box = tuple(params[1]) if isinstance(params[1], (tuple, list)) else (params[1],)
        swizzle = params[2] if len(params) >= 3 else 0
        if swizzle not in (0, 32, 64, 128):
            raise KilnValueError(f"TensorMap swizzle {swizzle!r} is not 0, 32, 64 or 128 bytes",
                                 fix="use one of 0, 32, 64, 128")
        if not box or any(not isinstance(b, int) or not 0 < b <= 256 for b in box):
            raise KilnValueError(f"TensorMap box {box!r} needs 1..256 elements per dimension",
                                 fix="use a box such as (64, 64)")
        return TensorMapSpec(dt.dtype(params[0]), box, swizzle, fill == "nan")


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # "tensor" | "scalar" | "constexpr" | "tensormap" | "infer"
    spec: Any  # TensorSpec | DType | TensorMapSpec | None


def resolve_annotation(fn: Callable, annotation: Any) -> Any:
    """Evaluate string annotations (``from __future__ import annotations``) in fn's scope."""
    if not isinstance(annotation, str):
        return annotation
    scope = closure_values(fn)
    try:
        return eval(annotation, fn.__globals__, scope)  # noqa: S307 - the user's own annotation
    except NameError as err:
        try:
            return dt.dtype(annotation)  # a dtype name such as "f32"
        except KilnTypeError:
            pass
        code = fn.__code__
        raise KilnTypeError(
            f"cannot resolve the annotation {annotation!r} of {fn.__name__}: {err}",
            fix="define the names it uses at module level (string annotations from `from "
                "__future__ import annotations` cannot see a function's local variables)",
            loc=SourceLoc(code.co_filename, code.co_firstlineno)) from None


def classify(name: str, annotation: Any) -> Param:
    if annotation is inspect.Parameter.empty:
        return Param(name, "infer", None)
    if annotation is constexpr:
        return Param(name, "constexpr", None)
    if isinstance(annotation, TensorSpec):
        return Param(name, "tensor", annotation)
    if isinstance(annotation, TensorMapSpec):
        return Param(name, "tensormap", annotation)
    return Param(name, "scalar", dt.dtype(annotation))
