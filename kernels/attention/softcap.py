"""Gemma-2 score soft-capping, ``s = softcap * tanh(s / softcap)``, as the prefill kernels
apply it to the scaled scores (FlashAttention's ``softcap``), before masking and the softmax.

On NVIDIA ``tanh`` is one ``tanh.approx.f32`` (:func:`kiln.tanh_approx`, one MUFU op per score,
as in FlashAttention-3): the softmax's ``exp2`` already keeps the special function unit busy,
and the two-op form below made it the bottleneck. Its relative error is at most ``2**-11``
(``kiln.nvidia.fastmath.TANH_APPROX_REL_ERROR``), and it is relative to the capped score
``c``: ``softcap * tanh`` errs by at most ``|c| * 2**-11``, in log2 units too (both sides scale
by ``log2 e``), 8x under the ``|c| * 2**-8`` a bf16 rounding of that score would cost.
Near 0 the error shrinks with ``c``; large ``|y|`` saturates to exactly ``+-1``.

Elsewhere (gfx950) ``tanh(y) = 1 - 2 / (exp2(2 y log2 e) + 1)`` from ``exp2`` and ``rcp``, the
two transcendental ops every target runs for the softmax: large ``|y|`` saturates to ``+-1``
exactly (``exp2`` reaches ``inf`` or 0), and near 0 the absolute error stays at f32's unit
roundoff, which ``softcap`` scales to far below a bf16 score's rounding.

The interpreter runs the exact ``tanh`` on both paths.

Example::

    pre, cap_log2 = soft_cap_constants(scale, softcap)    # inside the kernel trace
    s_log2 = soft_cap(raw_score, pre, cap_log2)           # softcap * tanh(scale * s) * log2 e
"""

from __future__ import annotations

import math

import kiln
from kiln.nvidia.fastmath import TANH_APPROX

LOG2E = 1.0 / math.log(2.0)


def check_softcap(softcap) -> float:
    """``softcap`` as a float: 0.0 (off) for None or 0, else it must be positive and finite
    (a KilnError naming the argument). Example: ``check_softcap(None) == 0.0``."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or \
            not math.isfinite(softcap) or softcap < 0:
        raise kiln.KilnValueError(f"softcap must be a non-negative finite number, got "
                                  f"{softcap!r}", fix="pass e.g. softcap=50.0, or 0.0 / None "
                                                      "for no soft-capping")
    return float(softcap)


def _hardware_tanh() -> bool:
    """Whether the traced kernel's target has ``tanh.approx.f32`` (every NVIDIA chip Kiln has)."""
    return kiln.current_target().has(TANH_APPROX.feature)


def soft_cap_constants(scale_log2, softcap: float):
    """``(pre, cap_log2)`` for :func:`soft_cap` from the softmax scale times ``log2 e`` (a
    Python float or a traced f32), inside the kernel trace: with a hardware tanh ``pre``
    scales a raw score to ``y = scale * s / softcap``, else to ``2 y log2 e`` (the ``exp2``
    argument); the capped score in log2 units is ``cap_log2 * tanh(y)``."""
    cap_log2 = softcap * LOG2E
    return scale_log2 * (1.0 / cap_log2 if _hardware_tanh() else 2.0 / softcap), cap_log2


def soft_cap(raw, pre, cap_log2):
    """The soft-capped score in log2 units (``softcap * tanh(scale * raw / softcap) * log2 e``)
    of an f32 scalar or vector ``raw``; softmax it with a log2 scale of 1."""
    if _hardware_tanh():
        return cap_log2 * kiln.tanh_approx(raw * pre)
    return cap_log2 - (2.0 * cap_log2) * kiln.rcp(kiln.exp2(raw * pre) + 1.0)
