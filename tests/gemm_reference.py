"""Elementwise GEMM check against a float64 reference, shared by the GEMM tests.

Example:
    >>> a = np.ones((4, 8), np.float32); b = np.ones((8, 3), np.float32)
    >>> assert_matmul_close(a @ b, a, b)
"""

from __future__ import annotations

import numpy as np

UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
# f32 accumulation over k products: at most about k units of 2^-24 of sum |a||b|; x4 leaves
# room for tensor-core accumulation order while one wrong 32x32 block still errs by O(|c|).
ACCUMULATION_SLACK = 4.0


def assert_matmul_close(c, a, b):
    """``c`` (numpy or torch, any dtype) against float64 ``a @ b`` element by element: each
    may err by its own output rounding plus the f32 accumulation bound
    ``4 * k * 2^-24 * (|a| @ |b|)``; reports the first offending element."""
    if hasattr(c, "detach"):  # a torch tensor: compare on the host in float64
        dtype = str(c.dtype).removeprefix("torch.")
        c = c.detach().double().cpu().numpy()
    else:
        dtype = np.asarray(c).dtype.name
        c = np.asarray(c).astype(np.float64)
    a64, b64 = np.asarray(a).astype(np.float64), np.asarray(b).astype(np.float64)
    want = a64 @ b64
    assert c.shape == want.shape, (c.shape, want.shape)
    assert not np.isnan(c).any(), f"{np.isnan(c).sum()} NaN outputs"
    k = a64.shape[1]
    tolerance = UNIT_ROUNDOFF[dtype] * np.abs(want) \
        + ACCUMULATION_SLACK * k * 2.0 ** -24 * (np.abs(a64) @ np.abs(b64))
    assert_within(c, want, tolerance)


def assert_within(c: np.ndarray, want: np.ndarray, tolerance: np.ndarray) -> None:
    """Every ``|c - want| <= tolerance`` (2-D float64 arrays); reports how many elements are
    off and the first of them."""
    bad = np.abs(c - want) > tolerance
    if bad.any():
        i, j = np.argwhere(bad)[0]
        raise AssertionError(f"{bad.sum()} of {bad.size} elements off, first at ({i}, {j}): "
                             f"got {c[i, j]:.6g}, want {want[i, j]:.6g}, tolerance "
                             f"{tolerance[i, j]:.3g}")


def check_config_on_gpu(config, shape, rng) -> None:
    """Run the Hopper GEMM ``config`` on the GPU with fresh random bf16 ``a`` [M, K] and B stored
    N x K, into a NaN-poisoned ``c``, and check it against float64 (needs torch and CUDA)."""
    import ml_dtypes
    import torch

    from kiln.kernels.gemm import run_hopper

    m, n, k = shape
    a = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((n, k)).astype(ml_dtypes.bfloat16)
    a_dev = torch.from_numpy(a.astype(np.float32)).to("cuda", torch.bfloat16)
    b_dev = torch.from_numpy(b.astype(np.float32)).to("cuda", torch.bfloat16)
    c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    run_hopper(a_dev, b_dev, c, m, n, k, dtype="bf16", b_major="k", target="sm_90a",
               config=config)
    assert_matmul_close(c, a, b.T)
