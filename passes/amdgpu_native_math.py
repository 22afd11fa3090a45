"""``kiln-amdgpu-native-math``: lower f32/f16 ``math`` ops to AMDGPU's native transcendentals.

``convert-gpu-to-rocdl`` turns ``math.exp2``/``math.log2``/... into calls to the ROCm device
library (``__ocml_exp2_f32``...), which Kiln does not link: the code object would have undefined
symbols, and the calls spill registers. Attention kernels want the hardware instructions anyway
(``v_exp_f32``, ``v_log_f32``, ``v_sqrt_f32``, ``v_rcp_f32``: about 1 ulp, denormal inputs
flushed), so this pass rewrites, for f32 and f16 scalars and vectors (vectors element by element):

============  ==========================================
``exp2(x)``   ``rocdl.exp2(x)``
``log2(x)``   ``rocdl.log(x)`` (``v_log`` is base 2)
``exp(x)``    ``rocdl.exp2(x * log2(e))``
``log(x)``    ``rocdl.log(x) * ln(2)``
``sqrt(x)``   ``rocdl.sqrt(x)``
``rsqrt(x)``  ``rocdl.rcp(rocdl.sqrt(x))``
============  ==========================================

Example (``kiln-opt k.mlir --pass-pipeline='builtin.module(kiln-amdgpu-native-math)'``)::

    %y = math.exp2 %x : f32          // becomes: %y = rocdl.exp2 %x : f32
"""

from __future__ import annotations

import math

from mlir import ir
from mlir.dialects import arith, rocdl, vector

from kiln.passes import register_pass

NAME = "kiln-amdgpu-native-math"


def _scale(value: ir.Value, factor: float) -> ir.Value:
    constant = arith.ConstantOp(value.type, ir.FloatAttr.get(value.type, factor)).result
    return arith.mulf(value, constant)


# op name -> function(scalar f16/f32 value) -> replacement value
_LOWERINGS = {
    "math.exp2": lambda x: rocdl.exp2(x.type, x),
    "math.log2": lambda x: rocdl.log(x.type, x),
    "math.exp": lambda x: rocdl.exp2(x.type, _scale(x, math.log2(math.e))),
    "math.log": lambda x: _scale(rocdl.log(x.type, x), math.log(2.0)),
    "math.sqrt": lambda x: rocdl.sqrt(x.type, x),
    "math.rsqrt": lambda x: rocdl.rcp(x.type, rocdl.sqrt(x.type, x)),
}


def _is_native_float(t: ir.Type) -> bool:
    return isinstance(t, (ir.F32Type, ir.F16Type))


def _lower(name: str, value: ir.Value) -> ir.Value:
    if not isinstance(value.type, ir.VectorType):
        return _LOWERINGS[name](value)
    vector_type = value.type
    lanes = [_LOWERINGS[name](vector.extract(value, [], [i]))
             for i in range(vector_type.shape[0])]
    return vector.from_elements(vector_type, lanes)


def _lowerable(op: ir.Operation) -> bool:
    if op.name not in _LOWERINGS or len(op.operands) != 1:
        return False
    t = op.operands[0].type
    if isinstance(t, ir.VectorType):
        return t.rank == 1 and _is_native_float(t.element_type)
    return _is_native_float(t)


def native_math(op: ir.Operation, pass_=None) -> None:
    """Rewrite every lowerable ``math`` op under ``op`` (see the module table)."""
    found: list[ir.Operation] = []

    def collect(candidate: ir.Operation):
        if _lowerable(candidate):
            found.append(candidate)
        return ir.WalkResult.ADVANCE

    op.walk(collect, ir.WalkOrder.PRE_ORDER)
    for math_op in found:  # rewritten after the walk: erasing while walking is unsafe
        with ir.InsertionPoint(math_op), math_op.location:
            replacement = _lower(math_op.name, math_op.operands[0])
        math_op.result.replace_all_uses_with(replacement)
        math_op.erase()


register_pass(NAME, native_math,
              "Lower f32/f16 math.exp2/log2/exp/log/sqrt/rsqrt to AMDGPU native instructions "
              "instead of ROCm device-library calls")
