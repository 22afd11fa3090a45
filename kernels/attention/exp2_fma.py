"""``exp2`` of some softmax elements on the FMA pipe, the rest on the MUFU (FlashAttention-4's
split, here for the FP8 prefill, whose k32 WGMMAs leave the 16-per-clock ``ex2`` unit as busy
as the tensor cores: 128 x 128 exponentials per 2 x 64 x 128 x 128 x 2 FLOPs of FP8 WGMMA).

``2**x = 2**j * 2**f`` with ``j = round(x)`` (adding ``1.5 * 2**23`` rounds an f32 to an
integer held in the low mantissa bits), ``f = x - j`` in ``[-1/2, 1/2]``, ``2**f`` a cubic
(Horner, three FMAs; ``p(0) = 1``, so whole powers of two stay exact) and ``2**j`` added to
the exponent field by an integer add of ``j << 23``. ``x`` is clamped to ``[-125, 64]`` first:
below, the result is ``2**-125`` instead of 0 (below e4m3's smallest subnormal, and
``2**-125`` of a row sum that holds at least one 1); above, ``2**64`` still passes the lazy
rescale's ``2**8`` vote, which recomputes the tile on the MUFU. Relative error at most
``2**-13.2`` (``EXP2_FMA_REL_ERROR``), far below e4m3's ``2**-4`` rounding of P.

Example::

    probs = exp2_mixed(softmax.sub_max_scaled(raw, scale_log2), emulated=8)  # 8 of every 64
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import arith

import kiln

# 2**f ~ 1 + f (C1 + f (C2 + f C3)) on [-1/2, 1/2]: a relative-error minimax fit with p(0) = 1.
C1, C2, C3 = 0.6932829273211774, 0.24221095962347083, 0.0550089299968952
EXP2_FMA_REL_ERROR = 2.0 ** -13.2
ROUND = 12582912.0  # 1.5 * 2**23
LOW, HIGH = -125.0, 64.0


def exp2_fma(x: kiln.Value) -> kiln.Value:
    """``2**x`` of an f32 scalar from FMA-pipe instructions (module docstring)."""
    x = kiln.minimum(kiln.maximum(x, LOW), HIGH)
    shifted = x + ROUND
    f = x - (shifted - ROUND)
    poly = kiln.fma(kiln.fma(kiln.fma(f, C3, C2), f, C1), f, 1.0)
    i32 = ir.IntegerType.get_signless(32)
    bits = arith.addi(arith.bitcast(i32, poly.ir),
                      arith.shli(arith.bitcast(i32, shifted.ir),
                                 arith.constant(i32, 23)))
    return kiln.Value(arith.bitcast(ir.F32Type.get(), bits), kiln.f32)


def exp2_mixed(tile, emulated: int):
    """``tile.exp2()`` with ``emulated`` of every 64 elements (spread evenly over a thread's
    registers) from :func:`exp2_fma`; 0 is ``tile.exp2()`` itself."""
    if not emulated:
        return tile.exp2()
    period = 64 // emulated
    counter = [0]

    def fragment(values):
        scalars = kiln.unpack(values) if values.shape else [values]
        out = []
        for x in scalars:
            counter[0] += 1
            out.append(exp2_fma(x) if counter[0] % period == 0 else kiln.exp2(x))
        return kiln.pack(out) if values.shape else out[0]

    return tile.map(fragment)
