"""FP8 conversions on NVIDIA: ``cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32`` (sm_89+, PTX ISA 7.8).

``arith.truncf`` to an 8-bit float has no NVPTX lowering, so the one instruction that packs two
f32 into two FP8 bytes is inline PTX, declared here as ``nvidia.cvt.f32x2_to_f8x2`` (no
effects: registers only). It rounds to nearest even and saturates (``satfinite``): a finite
value past the format's largest (448 for e4m3, 57344 for e5m2) becomes that largest, NaN stays
NaN. The interpreter rounds through ``ml_dtypes`` after the same clamp.

Example (four f32 into one b32 register of e4m3 bytes, ``a`` in the low byte)::

    word = kiln.nvidia.cvt.pack_f8x4([a, b, c, d], kiln.f8e4m3)
"""

from __future__ import annotations

import numpy as np
from mlir import ir
from mlir.dialects import arith

from .. import builder
from ..core import dtypes as dt
from ..core.errors import KilnTypeError, UnsupportedError
from ..core.ops import declare, op_args
from ..values import Value, cast

FP8_MAX = {"f8e4m3": 448.0, "f8e5m2": 57344.0}  # satfinite clamps finite values to these
_PTX_TYPES = {"f8e4m3": "e4m3x2", "f8e5m2": "e5m2x2"}


def _semantics(op, plan):
    """Interpreter semantics of :data:`F32X2_TO_F8X2`: clamp, round to the FP8 dtype, pack
    the first operand into the high byte."""
    hi, lo = plan.operands(op)
    out = plan.result(op)
    name = op_args(op)["dtype"]
    limit, np_type = FP8_MAX[name], dt.dtype(name).numpy

    def byte(x):
        x = np.asarray(x, np.float32)
        return np.clip(x, -limit, limit).astype(np_type).view(np.uint8).astype(np.uint16)

    def run(env, ctx):
        env[out] = ((byte(env[hi]) << 8) | byte(env[lo])).view(np.int16)

    return run


# e4m3x2 conversions need sm_89; every Kiln NVIDIA target with them is sm_90a ("sm90").
F32X2_TO_F8X2 = declare("nvidia.cvt.f32x2_to_f8x2", feature="sm90", interpret=_semantics,
                        doc="cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32: two f32 to two packed FP8")


def f32x2_to_f8x2(hi, lo, dtype) -> Value:
    """Two f32 scalars as the i16 of two ``dtype`` (f8e4m3/f8e5m2) bytes, ``hi`` in the high
    byte (one ``cvt.rn.satfinite``). Example: ``h = f32x2_to_f8x2(b, a, kiln.f8e4m3)``."""
    name = dt.dtype(dtype).name
    if name not in _PTX_TYPES:
        raise UnsupportedError(f"f32x2_to_f8x2 converts to f8e4m3 or f8e5m2, not {name}",
                               fix="pass dtype=kiln.f8e4m3 or kiln.f8e5m2")
    operands = []
    for x in (hi, lo):
        if not isinstance(x, Value) or x.shape or not x.dtype.is_float:
            raise KilnTypeError(f"f32x2_to_f8x2 takes float scalars, got {x!r}",
                                fix="pass kiln.Value scalars (e.g. acc.element(i))")
        operands.append((x if x.dtype is dt.f32 else cast(x, dt.f32)).ir)
    F32X2_TO_F8X2.require(builder.current_target(), "kiln.nvidia.cvt.f32x2_to_f8x2")
    i16 = ir.IntegerType.get_signless(16)
    return Value(F32X2_TO_F8X2.inline_asm(
        i16, operands, f"cvt.rn.satfinite.{_PTX_TYPES[name]}.f32 $0, $1, $2;", "=h,f,f",
        args={"dtype": name}, has_side_effects=False), dt.i16)


def pack_f8x4(values, dtype) -> Value:
    """Four f32 scalars as one i32 of ``dtype`` bytes, ``values[0]`` in the low byte (two
    conversions). Example: ``word = pack_f8x4([a, b, c, d], kiln.f8e4m3)``."""
    if len(values) != 4:
        raise KilnTypeError(f"pack_f8x4 packs 4 values, got {len(values)}",
                            fix="pass a list of four f32 scalars")
    i32 = ir.IntegerType.get_signless(32)
    low, high = (arith.extui(i32, f32x2_to_f8x2(values[i + 1], values[i], dtype).ir)
                 for i in (0, 2))
    return Value(arith.ori(low, arith.shli(high, arith.constant(i32, 16))), dt.i32)
