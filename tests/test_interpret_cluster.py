"""Interpreter semantics of thread-block clusters: the CTAs of a cluster run together, TMA
multicast lands in every masked CTA, remote mbarrier arrivals (mapa), the cluster barrier —
and the Hopper GEMM's 2-CTA cluster configuration against numpy float64."""

import ml_dtypes
import numpy as np
import pytest

import kiln
from kiln import f32, mbarrier, nvidia_asm, tma
from kiln.interpreter import interpret_kernel

ROWS, COLS = 8, 32  # one f32 box: 8 rows of 128 bytes
PAIR = 2


def make_multicast_kernel(mask: int, arrivals: int):
    @kiln.kernel
    def multicast_pair(x_map: kiln.TensorMap[f32, (ROWS, COLS)], out: kiln.Tensor[f32, 3]):
        """CTA ``r`` of a pair loads rows ``8r..8r+7`` and multicasts them into slot ``r`` of
        both CTAs; both CTAs release the slot on both barriers, then copy both slots out."""
        nvidia_asm.cluster_dims(PAIR)
        tile0 = kiln.shared((ROWS, COLS), f32, align=128)
        tile1 = kiln.shared((ROWS, COLS), f32, align=128)
        t = kiln.thread_id(0)
        leader = t == 0
        full = mbarrier.group(num_barriers=1)
        done = mbarrier.group(num_barriers=1)
        full.init(0, count=1, predicate=leader)
        done.init(0, count=arrivals, predicate=leader)
        nvidia_asm.fence_mbarrier_init()
        nvidia_asm.cluster_sync()
        rank = nvidia_asm.cluster_ctarank()
        full.arrive_expect_tx(0, 2 * tma.box_bytes(x_map), predicate=leader)
        at = (0, ROWS)
        tma.load(x_map, tile0, (0, 0), full, 0, multicast_mask=mask,
                 predicate=leader & (rank == 0))
        mine = leader & (rank == 1)
        tma.load(x_map, tile1, at, full, 0, multicast_mask=mask, predicate=mine)  # @multicast
        full.try_wait(0, phase=0)
        block = kiln.block_id(0)
        out[block, t // COLS, t % COLS] = tile0[t // COLS, t % COLS]
        out[block, ROWS + t // COLS, t % COLS] = tile1[t // COLS, t % COLS]
        if leader:
            for r in kiln.static_range(PAIR):
                done.arrive_cluster(0, r)
        done.try_wait(0, phase=0)  # @done-wait
        nvidia_asm.cluster_sync()

    return multicast_pair


def test_multicast_lands_in_both_ctas_and_remote_arrivals_release_them():
    x = np.random.default_rng().standard_normal((2 * ROWS, COLS)).astype(np.float32)
    out = np.full((4, 2 * ROWS, COLS), np.nan, np.float32)
    make_multicast_kernel(0b11, PAIR).interpret[(4,)](x, out, num_warps=8)
    np.testing.assert_array_equal(out, np.broadcast_to(x, out.shape))


def test_missing_remote_arrival_is_a_deadlock_naming_the_wait(marker_line):
    x = np.random.default_rng().standard_normal((2 * ROWS, COLS)).astype(np.float32)
    with pytest.raises(kiln.core.errors.DeadlockError) as info:
        make_multicast_kernel(0b11, PAIR + 1).interpret[(2,)](
            x, np.zeros((2, 2 * ROWS, COLS), np.float32), num_warps=8)
    err = info.value
    assert f":{marker_line('@done-wait')}" in err.message and "Fix:" in str(err)


def test_multicast_mask_past_the_cluster_is_out_of_bounds(marker_line):
    x = np.random.default_rng().standard_normal((2 * ROWS, COLS)).astype(np.float32)
    with pytest.raises(kiln.core.errors.OutOfBoundsError) as info:
        make_multicast_kernel(0b101, PAIR).interpret[(2,)](
            x, np.zeros((2, 2 * ROWS, COLS), np.float32), num_warps=8)
    err = info.value
    assert err.loc.line == marker_line("@multicast")
    assert "mask 0x5" in err.message and "2 CTAs" in err.message


def test_grid_must_be_whole_clusters():
    x = np.random.default_rng().standard_normal((2 * ROWS, COLS)).astype(np.float32)
    with pytest.raises(kiln.KilnValueError, match="not a multiple of the kernel's cluster"):
        make_multicast_kernel(0b11, PAIR).interpret[(3,)](
            x, np.zeros((3, 2 * ROWS, COLS), np.float32), num_warps=8)


@pytest.mark.parametrize("b_major", ["mn", "k"])
def test_hopper_gemm_cluster_pair_matches_float64(b_major):
    """Ragged M, N and K; two pair tiles over a persistent grid of one cluster, so the pipeline
    wraps its stages and flips barrier phases across tiles."""
    from kiln.kernels.gemm import _constexprs
    from kiln.kernels.gemm.hopper import HopperGemmConfig, make_kernel

    config = HopperGemmConfig(cluster_m=2)
    rng = np.random.default_rng()
    m, n, k = 300, 136, 264
    a = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((k, n) if b_major == "mn" else (n, k)).astype(ml_dtypes.bfloat16)
    c = np.full((m, n), np.nan, np.float32)
    kernel = make_kernel("bf16", "f32", b_major, config)
    args = [a, b, c, m, n, k]
    traced = kernel.trace(*args, target="sm_90a", num_warps=config.num_warps,
                          **_constexprs(config))
    interpret_kernel(traced, (PAIR, 1, 1), args, "sm_90a")
    b64 = b.astype(np.float64)
    expected = a.astype(np.float64) @ (b64 if b_major == "mn" else b64.T)
    np.testing.assert_allclose(c, expected, rtol=1e-4, atol=1e-3)
