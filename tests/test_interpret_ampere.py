"""Ampere ops in the interpreter: cp.async groups, ldmatrix, mma.sync (sm_80 GEMM example)."""

import numpy as np
import pytest

import kiln
from kiln import bf16, cp_async, tiles

from source_modules import load_example


@pytest.mark.parametrize("m, n, k", [(200, 128, 96), (64, 64, 32), (37, 192, 64)])
def test_mma_sync_gemm_example(m, n, k):
    gemm = load_example("mma_sync_gemm")
    a, b, c = gemm.reference_inputs(m, n, k, seed=int(np.random.default_rng().integers(1 << 30)))
    grid = (-(-m // gemm.BLOCK_M), n // gemm.BLOCK_N, 1)
    gemm.mma_sync_gemm.interpret[grid](a, b, c, m, k, BM=gemm.BLOCK_M, BN=gemm.BLOCK_N,
                                       BK=gemm.BLOCK_K, num_warps=gemm.NUM_WARPS, target="sm_80")
    assert gemm.relative_error(c, a, b) < 1e-6


def make_copy_kernel(wait_first: bool):
    @kiln.kernel
    def copy_rows(x: kiln.Tensor[bf16, 2], out: kiln.Tensor[bf16, 2], rows: kiln.i32):
        """Each of 32 threads cp.asyncs 8 elements of one row (rows past ``rows`` fill zeros)."""
        t = kiln.thread_id(0)
        s = tiles.SharedTile((32, 8), bf16)
        g = tiles.GlobalTile(x, (32, 8), (0, 0), row_end=rows)
        group = cp_async.commit([cp_async.copy(s, (t, 0), g, (t, 0), width=8)])  # @cp-async
        if wait_first:
            cp_async.wait(group)
        v = s.load(t, 0, width=8)  # @read-copy
        out.store(t, 0, v)

    return copy_rows


def test_cp_async_lands_at_the_wait_and_zero_fills_masked_rows():
    x = np.random.default_rng().standard_normal((20, 8)).astype("bfloat16")
    out = np.full((32, 8), np.nan, np.float32).astype("bfloat16")
    make_copy_kernel(True).interpret[(1,)](x, out, 20, num_warps=1, target="sm_80")
    np.testing.assert_array_equal(out[:20], x)
    assert not out[20:].astype(np.float32).any()


def test_reading_a_cp_async_destination_before_the_wait_is_a_race(marker_line):
    x = np.random.default_rng().standard_normal((32, 8)).astype("bfloat16")
    with pytest.raises(kiln.core.errors.RaceError) as info:
        make_copy_kernel(False).interpret[(1,)](x, np.zeros_like(x), 32, num_warps=1,
                                                target="sm_80")
    err = info.value
    assert err.loc.line == marker_line("@read-copy")
    assert f":{marker_line('@cp-async')}" in err.message and "cp.async" in err.message
