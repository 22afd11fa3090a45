"""Single-instruction approximate math on NVIDIA's special function unit (one MUFU op each).

:func:`tanh_approx` is ``tanh.approx.f32`` (sm_75+, PTX ISA 7.0): one MUFU.TANH where ``tanh``
built from ``exp2`` and ``rcp`` costs two, which is what bounds soft-capped attention's score
loop (FlashAttention-3 uses the same instruction). No ``nvvm`` op emits it in this MLIR, so it
is inline PTX, declared here as ``nvidia.fastmath.tanh_approx`` (no effects: registers only).

Accuracy: the PTX ISA gives a maximum relative error of ``2**-11`` (about 4.9e-4) over the
whole f32 range; results saturate to exactly ``+-1`` for large ``|x|`` and keep the sign of
``x``. The interpreter runs ``np.tanh`` in f32 (the exact function, not the hardware's error).

Example (inside a ``@kiln.kernel`` for an NVIDIA target)::

    capped = softcap * kiln.tanh_approx(s * (1.0 / softcap))   # one MUFU op per score
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mlir import ir

from .. import builder
from ..core import dtypes as dt
from ..core.errors import KilnTypeError, checked_call
from ..core.ops import declare
from ..values import Value, cast, to_value
from ..vectors import pack, unpack

# Relative error bound of tanh.approx.f32 (PTX ISA, "tanh"): what callers' tolerances budget.
TANH_APPROX_REL_ERROR = 2.0 ** -11


def _tanh_semantics(op, plan):
    """Interpreter semantics of :data:`TANH_APPROX`: ``np.tanh`` of the f32 operand."""
    (x,) = plan.operands(op)
    out = plan.result(op)

    def run(env, ctx):
        env[out] = np.tanh(np.asarray(env[x], np.float32)).astype(np.float32)

    return run


# "ptx" is every NVIDIA target Kiln has (sm_80 and newer), all past tanh.approx's sm_75.
TANH_APPROX = declare("nvidia.fastmath.tanh_approx", feature="ptx", interpret=_tanh_semantics,
                      doc="tanh.approx.f32: tanh on the SFU, relative error <= 2**-11")


def _tanh_scalar(x: Value) -> Value:
    f32 = ir.F32Type.get()
    return Value(TANH_APPROX.inline_asm(f32, [x.ir], "tanh.approx.f32 $0, $1;", "=f,f",
                                        has_side_effects=False), dt.f32)


@checked_call
def tanh_approx(x: Any) -> Value:
    """``tanh(x)`` with one ``tanh.approx.f32`` per element (NVIDIA sm_75+; relative error at
    most ``2**-11``, saturating to ``+-1``) of an f32 scalar, 1-D vector or register tile
    (other floats are cast to f32, the result is f32). A TargetError on chips without it
    (AMD): there, build tanh from ``kiln.exp2`` and ``kiln.rcp``.

    Example: ``s = softcap * kiln.tanh_approx(s * (1.0 / softcap))``.
    """
    TANH_APPROX.require(builder.current_target(), "kiln.tanh_approx")
    if hasattr(x, "__kiln_elementwise__"):  # a register tile: per element, like kiln.exp2
        return x.__kiln_elementwise__(tanh_approx)
    v = to_value(x, dt.f32)
    if not v.dtype.is_float:
        raise KilnTypeError(f"kiln.tanh_approx takes floats, got {v.dtype}",
                            fix="cast first, e.g. kiln.tanh_approx(kiln.cast(x, kiln.f32))")
    if v.dtype is not dt.f32:
        v = cast(v, dt.f32)
    if not v.shape:
        return _tanh_scalar(v)
    if len(v.shape) != 1:
        raise KilnTypeError(f"kiln.tanh_approx takes scalars or 1-D vectors, got shape {v.shape}",
                            fix="apply it to each row, or to kiln.unpack'ed elements")
    return pack([_tanh_scalar(e) for e in unpack(v)])
