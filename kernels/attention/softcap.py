"""Gemma-2 score soft-capping, ``s = softcap * tanh(s / softcap)``, as the prefill kernels
apply it to the scaled scores (FlashAttention's ``softcap``), before masking and the softmax.

``tanh(y) = 1 - 2 / (exp2(2 y log2 e) + 1)`` from ``exp2`` and ``rcp``, the two transcendental
ops every target already runs for the softmax: large ``|y|`` saturates to ``+-1`` exactly
(``exp2`` reaches ``inf`` or 0), and near 0 the absolute error stays at f32's unit roundoff,
which ``softcap`` scales to far below a bf16 score's rounding.

Example::

    pre2, cap_log2 = soft_cap_constants(scale, softcap)   # Python floats
    s_log2 = soft_cap(raw_score, pre2, cap_log2)          # softcap * tanh(scale * s) * log2 e
"""

from __future__ import annotations

import math

import kiln

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


def soft_cap_constants(scale_log2, softcap: float):
    """``(pre2, cap_log2)`` for :func:`soft_cap` from the softmax scale times ``log2 e`` (a
    Python float or a traced f32): ``tanh(scale * s / softcap)`` is
    ``1 - 2 / (exp2(s * pre2) + 1)``, and the capped score in log2 units is ``cap_log2 * tanh``."""
    return scale_log2 * (2.0 / softcap), softcap * LOG2E


def soft_cap(raw, pre2, cap_log2):
    """The soft-capped score in log2 units (``softcap * tanh(scale * raw / softcap) * log2 e``)
    of an f32 scalar or vector ``raw``; softmax it with a log2 scale of 1."""
    return cap_log2 - (2.0 * cap_log2) * kiln.rcp(kiln.exp2(raw * pre2) + 1.0)
