"""FP8 GEMM test helpers: random quantised operands with each scale kind, and the float64
reference on the dequantised values.

Example:
    >>> a, sa = quantized(np.random.default_rng(0), 3, 200, "row", "f8e4m3")
    >>> dequantized(a, sa, "row").shape
    (3, 200)
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

import kiln
from gemm_reference import assert_within

BLOCK = 128
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8}


def quantized(rng, rows: int, k: int, mode: str, dtype: str, *, rows_per_block: int = 1):
    """A ``rows x k`` FP8 operand of values ``x / s`` with a fresh random scale ``s`` of
    ``mode`` ("tensor": a python float, "row"/"col": ``[rows]``, "block": one per
    ``rows_per_block x 128``), so the dequantised values are ``O(1)`` but not the raw ones.
    ``x / s`` saturates at the format's largest finite value, as a quantiser does: e4m3 has no
    infinity, so a plain cast of ``|x / s| > 448`` (a 4.5-sigma ``x`` at ``s = 0.01``, a few
    per million elements) gives NaN, which the GEMM rightly spreads over a row of C."""
    fp8 = kiln.dtype(dtype).numpy
    finite = float(ml_dtypes.finfo(fp8).max)
    x = rng.standard_normal((rows, k))
    if mode == "tensor":
        scale = float(rng.uniform(0.01, 0.1))
    elif mode in ("row", "col"):
        scale = rng.uniform(0.01, 0.1, rows).astype(np.float32)
    else:
        scale = rng.uniform(0.01, 0.1, (-(-rows // rows_per_block), -(-k // BLOCK))
                            ).astype(np.float32)
    x = np.clip(x / _expand(scale, mode, rows, k, rows_per_block), -finite, finite)
    return x.astype(fp8), scale


def dequantized(x, scale, mode: str, *, rows_per_block: int = 1) -> np.ndarray:
    """``x * scale`` in float64 (``x`` numpy or torch; the scale of :func:`quantized`)."""
    x = _host(x).astype(np.float64)
    return x * _expand(_host(scale), mode, *x.shape, rows_per_block)


def fp8_tolerance(want: np.ndarray, a64: np.ndarray, b64: np.ndarray, dtype: str) -> np.ndarray:
    """Per-element error bound of an FP8 GEMM ``want = a64 @ b64.T`` written as ``dtype``.

    With ``S = |A| @ |B|^T`` (and ``S_b`` its part in K block ``b`` of 128):

    * inside one 128-K block the tensor core adds each ``k32`` instruction's 32 exact products
      to its accumulator with ~14 mantissa bits (DeepSeek-V3 §3.3.2; H100/H200 runs of the
      unpromoted kernel erred by up to ~2^-13.5 S): we allow 2^-12 of the instruction's
      magnitude bound ``S_b`` per instruction, 4 per block, so ``sum_b 4 * 2^-12 S_b =
      2^-10 S``;
    * the kernel promotes each block into an f32 total (one rounding each) and scales it (two
      or three more): ``2 (blocks + 3) 2^-24 S``;
    * the output rounds once: ``u(dtype) |want|``.

    It still catches a wrong scale, a dropped K block (``~sqrt(128) >> 2^-10 S``) or a tile off
    by one; the interpreter's WGMMA (f64 products and sums, one f32 rounding per instruction)
    stays far inside it.
    """
    blocks = -(-a64.shape[1] // BLOCK)
    s = np.abs(a64) @ np.abs(b64).T
    return UNIT_ROUNDOFF[dtype] * np.abs(want) + (2.0 ** -10 + 2 * (blocks + 3) * 2.0 ** -24) * s


def assert_fp8_close(c, a64: np.ndarray, b64: np.ndarray) -> np.ndarray:
    """``c`` against float64 ``a64 @ b64.T`` (dequantised operands) within
    :func:`fp8_tolerance`; reports the first offending element. Returns ``c`` in float64."""
    dtype = str(c.dtype).removeprefix("torch.") if hasattr(c, "detach") else np.dtype(c.dtype).name
    c = _host(c).astype(np.float64)
    want = a64 @ b64.T
    assert c.shape == want.shape, (c.shape, want.shape)
    assert not np.isnan(a64).any() and not np.isnan(b64).any(), "NaN operands"
    assert not np.isnan(c).any(), f"{np.isnan(c).sum()} NaN outputs"
    tolerance = fp8_tolerance(want, a64, b64, dtype)
    assert_within(c, want, tolerance)
    return c


def _expand(scale, mode: str, rows: int, k: int, rows_per_block: int) -> np.ndarray:
    scale = np.asarray(scale, np.float64)
    if mode == "tensor":
        return scale.reshape(-1)[0]
    if mode in ("row", "col"):
        return scale.reshape(-1)[:, None]
    full = np.repeat(np.repeat(scale, rows_per_block, 0), BLOCK, 1)
    return full[:rows, :k]


def _host(x):
    if hasattr(x, "detach"):
        import torch

        x = x.detach().cpu()
        if x.element_size() == 1 and x.is_floating_point():
            return x.view(torch.uint8).numpy().view(kiln.dtype(x.dtype).numpy)
        return x.double().numpy()
    return np.asarray(x)
