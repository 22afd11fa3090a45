"""``kiln.print``: printf from every thread at run time (``gpu.printf``).

Python's ``print`` runs while the kernel is traced, when a traced value has no value yet;
``kiln.print`` prints on the device instead, once per thread that reaches it::

    if kiln.thread_id(0) == 0:
        kiln.print("block", kiln.block_id(0), "row max", m)

Arguments are joined with ``sep`` and followed by ``end`` like Python's ``print``. Strings and
Python numbers become text of the format; traced scalars become ``%d`` (i1..i32), ``%lld``
(i64, index) or ``%g`` (floats, passed as f64 as C varargs promote them). Where it prints:

- NVIDIA: ``gpu.printf`` lowers to CUDA's ``vprintf``; the output appears when the host
  synchronises with the GPU.
- The interpreter (``kernel.interpret``, any target): each active thread prints one line to
  ``sys.stdout``, prefixed ``[block (x, y, z) thread t]``.
- AMD: not supported (ROCm's printf needs the device libraries, which Kiln does not link);
  compiling for gfx9xx raises :class:`~kiln.core.errors.UnsupportedError` at the ``kiln.print``
  line.
"""

from __future__ import annotations

from typing import Any

from mlir.dialects import gpu

from .core import dtypes as dt
from .core.errors import KilnTypeError, checked_call
from .values import Value, cast, check_defined, is_literal


def _conversion(v: Value) -> tuple[str, Value]:
    """The printf conversion of a traced scalar and the value passed for it."""
    if v.is_vector:
        raise KilnTypeError(f"kiln.print takes scalars, got a vector of {v.shape[0]} {v.dtype}",
                            fix="print its elements, e.g. kiln.print(*kiln.unpack(v))")
    if v.dtype.is_float:
        return "%g", cast(v, dt.f64)
    if v.dtype.kind == "index" or v.dtype.bits == 64:
        return "%lld", cast(v, dt.i64)
    return "%d", (v if v.dtype is dt.i32 else cast(v, dt.i32))


@checked_call
def print(*args: Any, sep: str = " ", end: str = "\n") -> None:  # noqa: A001 - kiln.print
    """Print ``args`` from every thread that runs this line (see the module docs).

    Example: ``kiln.print("i =", i, "x[i] =", x[i])`` prints ``i = 3 x[i] = 0.25``.
    """
    if not isinstance(sep, str) or not isinstance(end, str):
        raise KilnTypeError("kiln.print's sep= and end= must be Python strings",
                            fix='e.g. kiln.print(a, b, sep=", ")')
    pieces, operands = [], []
    for a in args:
        check_defined(a)
        if isinstance(a, Value):
            conversion, passed = _conversion(a)
            pieces.append(conversion)
            operands.append(passed.ir)
        elif isinstance(a, str) or is_literal(a):
            pieces.append(str(a).replace("%", "%%"))
        else:
            raise KilnTypeError(f"kiln.print cannot print a {type(a).__name__}",
                                fix="print traced scalars, strings and Python numbers")
    fmt = sep.replace("%", "%%").join(pieces) + end.replace("%", "%%")
    gpu.printf(fmt, *operands)
