"""FP8 GEMM test helpers: random quantised operands with each scale kind, and the float64
reference on the dequantised values.

Example:
    >>> a, sa = quantized(np.random.default_rng(0), 3, 200, "row", "f8e4m3")
    >>> dequantized(a, sa, "row").shape
    (3, 200)
"""

from __future__ import annotations

import numpy as np

import kiln

BLOCK = 128
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8}


def quantized(rng, rows: int, k: int, mode: str, dtype: str, *, rows_per_block: int = 1):
    """A ``rows x k`` FP8 operand of values ``x / s`` with a fresh random scale ``s`` of
    ``mode`` ("tensor": a python float, "row"/"col": ``[rows]``, "block": one per
    ``rows_per_block x 128``), so the dequantised values are ``O(1)`` but not the raw ones."""
    fp8 = kiln.dtype(dtype).numpy
    x = rng.standard_normal((rows, k))
    if mode == "tensor":
        scale = float(rng.uniform(0.01, 0.1))
    elif mode in ("row", "col"):
        scale = rng.uniform(0.01, 0.1, rows).astype(np.float32)
    else:
        scale = rng.uniform(0.01, 0.1, (-(-rows // rows_per_block), -(-k // BLOCK))
                            ).astype(np.float32)
    return (x / _expand(scale, mode, rows, k, rows_per_block)).astype(fp8), scale


def dequantized(x, scale, mode: str, *, rows_per_block: int = 1) -> np.ndarray:
    """``x * scale`` in float64 (``x`` numpy or torch; the scale of :func:`quantized`)."""
    x = _host(x).astype(np.float64)
    return x * _expand(_host(scale), mode, *x.shape, rows_per_block)


def assert_fp8_close(c, a64: np.ndarray, b64: np.ndarray) -> None:
    """``c`` against float64 ``a64 @ b64.T`` (dequantised operands): its output rounding plus
    an f32 accumulation bound ``8 k 2^-24 (|A| @ |B|^T)`` (block promotion adds one rounding
    per 128-K block); reports the first offending element."""
    dtype = str(c.dtype).removeprefix("torch.") if hasattr(c, "detach") else np.dtype(c.dtype).name
    c = _host(c).astype(np.float64)
    want = a64 @ b64.T
    assert c.shape == want.shape, (c.shape, want.shape)
    assert not np.isnan(c).any(), f"{np.isnan(c).sum()} NaN outputs"
    k = a64.shape[1]
    tolerance = UNIT_ROUNDOFF[dtype] * np.abs(want) + 8 * k * 2.0 ** -24 * (np.abs(a64) @
                                                                           np.abs(b64).T)
    bad = np.abs(c - want) > tolerance
    if bad.any():
        i, j = np.argwhere(bad)[0]
        raise AssertionError(f"{bad.sum()} of {bad.size} elements off, first at ({i}, {j}): "
                             f"got {c[i, j]:.6g}, want {want[i, j]:.6g}, tolerance "
                             f"{tolerance[i, j]:.3g}")


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
