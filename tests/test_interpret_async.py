"""Interpreter semantics of async copies: TMA boxes (out-of-bounds fill, swizzle), mbarrier
phases, TMA stores and their bulk groups — and the races they allow."""

import numpy as np
import pytest

import kiln
from kiln import f32, mbarrier, tma
from kiln.nvidia.sync import fence_mbarrier_init, fence_proxy_async
from kiln.layout import wgmma_m64_accumulator
from kiln.swizzle import Swizzle

ROWS, COLS = 8, 32  # one f32 box: 8 rows of 128 bytes


def tma_box_reference(x: np.ndarray, row0: int, col0: int) -> np.ndarray:
    """The box TMA reads at (row0, col0): zero outside the tensor."""
    padded = np.zeros((row0 + ROWS + x.shape[0], col0 + COLS + x.shape[1]), np.float32)
    padded[:x.shape[0], :x.shape[1]] = x
    return padded[row0:row0 + ROWS, col0:col0 + COLS]


def make_box_reader(swizzle: int, eviction_policy: str | None = None):
    @kiln.kernel
    def read_box(x_map: kiln.TensorMap[f32, (ROWS, COLS), swizzle], out: kiln.Tensor[f32, 2],
                 row0: kiln.i32, col0: kiln.i32):
        """One TMA box into shared memory, then each thread reads one element back through
        the map's swizzle (the same Swizzle the lowering's address arithmetic uses)."""
        tile = kiln.shared((ROWS, COLS), f32, align=1024)
        t = kiln.thread_id(0)
        leader = t == 0
        bars = mbarrier.group(num_barriers=1)
        bars.init(0, count=1, predicate=leader)
        fence_mbarrier_init()
        kiln.barrier()
        bars.arrive_expect_tx(0, tma.box_bytes(x_map), predicate=leader)
        tma.load(x_map, tile, (col0, row0), bars, 0, predicate=leader,
                 eviction_policy=eviction_policy)
        bars.try_wait(0, phase=0)
        r = t // COLS
        c = t % COLS
        if swizzle:
            s = Swizzle.tma(swizzle, 4)(r * COLS + c)
            out[r, c] = tile[s // COLS, s % COLS]
        else:
            out[r, c] = tile[r, c]

    return read_box


@pytest.mark.parametrize("swizzle, eviction_policy", [(0, None), (128, None),
                                                      (128, "evict_first")])
def test_tma_box_with_out_of_bounds_fill_and_swizzle(swizzle, eviction_policy):
    """An L2 eviction policy changes where lines go in L2, not the box that lands."""
    rng = np.random.default_rng()
    x = rng.standard_normal((11, 45)).astype(np.float32)
    out = np.full((ROWS, COLS), np.nan, np.float32)
    make_box_reader(swizzle, eviction_policy).interpret[(1,)](x, out, 6, 20, num_warps=8)
    np.testing.assert_array_equal(out, tma_box_reference(x, 6, 20))


def test_an_unknown_eviction_policy_is_rejected_at_the_load(marker_line):
    @kiln.kernel
    def hinted(x_map: kiln.TensorMap[f32, (ROWS, COLS)], out: kiln.Tensor[f32]):
        tile = kiln.shared((ROWS, COLS), f32, align=128)
        bars = mbarrier.group(num_barriers=1)
        tma.load(x_map, tile, (0, 0), bars, 0, eviction_policy="evict_later")  # @bad-policy

    with pytest.raises(kiln.KilnValueError) as info:
        hinted.trace(np.zeros((ROWS, COLS), np.float32), np.zeros(1, np.float32),
                     target="sm_90a")
    assert "'evict_later'" in info.value.message and "evict_first" in info.value.fix
    assert info.value.loc.line == marker_line("@bad-policy")


def test_swizzled_tile_read_without_the_swizzle_is_permuted():
    rng = np.random.default_rng()
    x = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    out = np.full((ROWS, COLS), np.nan, np.float32)

    @kiln.kernel
    def read_raw(x_map: kiln.TensorMap[f32, (ROWS, COLS), 128], out: kiln.Tensor[f32, 2]):
        tile = kiln.shared((ROWS, COLS), f32, align=1024)
        t = kiln.thread_id(0)
        bars = mbarrier.group(num_barriers=1)
        bars.init(0, count=1, predicate=t == 0)
        kiln.barrier()
        bars.arrive_expect_tx(0, tma.box_bytes(x_map), predicate=t == 0)
        tma.load(x_map, tile, (0, 0), bars, 0, predicate=t == 0)
        bars.try_wait(0, phase=0)
        out[t // COLS, t % COLS] = tile[t // COLS, t % COLS]

    read_raw.interpret[(1,)](x, out, num_warps=8)
    assert not np.array_equal(out, x)
    assert np.array_equal(out[0], x[0])  # row 0 XORs with 0: unchanged
    np.testing.assert_array_equal(np.sort(out, axis=1), np.sort(x, axis=1))  # rows permuted


@kiln.kernel
def read_before_wait(x_map: kiln.TensorMap[f32, (ROWS, COLS)], out: kiln.Tensor[f32]):
    tile = kiln.shared((ROWS, COLS), f32, align=128)
    t = kiln.thread_id(0)
    leader = t == 0
    bars = mbarrier.group(num_barriers=1)
    bars.init(0, count=1, predicate=leader)
    kiln.barrier()
    bars.arrive_expect_tx(0, tma.box_bytes(x_map), predicate=leader)
    tma.load(x_map, tile, (0, 0), bars, 0, predicate=leader)  # @tma-load
    early = tile[0, t % COLS]  # @early-read
    bars.try_wait(0, phase=0)
    out[t] = early


def test_reading_a_tma_destination_before_the_wait_is_a_race(marker_line):
    x = np.random.default_rng().standard_normal((ROWS, COLS)).astype(np.float32)
    with pytest.raises(kiln.core.errors.RaceError) as info:
        read_before_wait.interpret[(1,)](x, np.zeros(128, np.float32))
    err = info.value
    assert err.loc.line == marker_line("@early-read")
    assert f":{marker_line('@tma-load')}" in err.message and "TMA load" in err.message
    assert "Fix:" in str(err) and "early = tile[0, t % COLS]" in str(err)


def make_store_kernel(wait_before_overwrite: bool):
    @kiln.kernel
    def store_tile(y_map: kiln.TensorMap[f32, (ROWS, COLS)], x: kiln.Tensor[f32, 2]):
        tile = kiln.shared((ROWS, COLS), f32, align=128)
        t = kiln.thread_id(0)
        tile[t // COLS, t % COLS] = x[t // COLS, t % COLS] * 2.0
        fence_proxy_async()
        kiln.barrier()
        tma.store(tile, y_map, (0, 0), predicate=t == 0)  # @tma-store
        tma.commit_group()
        if wait_before_overwrite:
            tma.wait_group(0, read=True)
        tile[t // COLS, t % COLS] = 0.0  # @overwrite

    return store_tile


def test_tma_store_then_overwrite_after_wait_group():
    rng = np.random.default_rng()
    x = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    y = np.full((ROWS + 3, COLS + 5), np.nan, np.float32)
    make_store_kernel(True).interpret[(1,)](y, x, num_warps=8)
    np.testing.assert_array_equal(y[:ROWS, :COLS], x * 2)
    assert np.isnan(y[ROWS:]).all() and np.isnan(y[:, COLS:]).all()


def test_overwriting_a_tma_store_source_in_flight_is_a_race(marker_line):
    x = np.random.default_rng().standard_normal((ROWS, COLS)).astype(np.float32)
    y = np.zeros((ROWS, COLS), np.float32)
    with pytest.raises(kiln.core.errors.RaceError) as info:
        make_store_kernel(False).interpret[(1,)](y, x, num_warps=8)
    err = info.value
    assert err.loc.line == marker_line("@overwrite")
    assert f":{marker_line('@tma-store')}" in err.message and "still reading" in err.message


def make_phase_kernel(extra_bytes: int):
    @kiln.kernel
    def two_phases(x_map: kiln.TensorMap[f32, (ROWS, COLS)], out: kiln.Tensor[f32, 2]):
        """Two TMA loads through one mbarrier: phase 0 then phase 1, reusing the tile."""
        tile = kiln.shared((ROWS, COLS), f32, align=128)
        t = kiln.thread_id(0)
        leader = t == 0
        bars = mbarrier.group(num_barriers=1)
        bars.init(0, count=1, predicate=leader)
        kiln.barrier()
        for k in kiln.static_range(2):
            bars.arrive_expect_tx(0, tma.box_bytes(x_map) + extra_bytes, predicate=leader)
            tma.load(x_map, tile, (k * COLS, 0), bars, 0, predicate=leader)
            bars.try_wait(0, phase=k % 2)  # @phase-wait
            out[t // COLS, k * COLS + t % COLS] = tile[t // COLS, t % COLS]
            kiln.barrier()

    return two_phases


def test_mbarrier_phases_alternate():
    x = np.random.default_rng().standard_normal((ROWS, 2 * COLS)).astype(np.float32)
    out = np.full_like(x, np.nan)
    make_phase_kernel(0).interpret[(1,)](x, out, num_warps=8)
    np.testing.assert_array_equal(out, x)


def test_wrong_expect_tx_bytes_is_a_deadlock(marker_line):
    x = np.random.default_rng().standard_normal((ROWS, 2 * COLS)).astype(np.float32)
    with pytest.raises(kiln.core.errors.DeadlockError) as info:
        make_phase_kernel(4).interpret[(1,)](x, np.zeros_like(x), num_warps=8)
    err = info.value
    assert err.loc.line == marker_line("@phase-wait")
    assert "mbarrier 0 phase parity 0" in err.message
    assert f":{marker_line('@phase-wait')}" in err.message


def make_wgmma_kernel(wait_before_overwrite: bool):
    from kiln import bf16, wgmma

    @kiln.kernel
    def raw_wgmma(a_map: kiln.TensorMap[bf16, (64, 64), 128],
                  b_map: kiln.TensorMap[bf16, (64, 64), 128], c: kiln.Tensor[f32, 2]):
        """C = A @ B from raw descriptors: 4 async m64n64k16 steps, one commit group."""
        a_smem = kiln.shared((64, 64), bf16, align=1024)
        b_smem = kiln.shared((64, 64), bf16, align=1024)
        t = kiln.thread_id(0)
        leader = t == 0
        bars = mbarrier.group(num_barriers=1)
        bars.init(0, count=1, predicate=leader)
        kiln.barrier()
        bars.arrive_expect_tx(0, tma.box_bytes(a_map) + tma.box_bytes(b_map), predicate=leader)
        tma.load(a_map, a_smem, (0, 0), bars, 0, predicate=leader)
        tma.load(b_map, b_smem, (0, 0), bars, 0, predicate=leader)
        bars.try_wait(0, phase=0)
        a_desc = wgmma.smem_descriptor(a_smem, leading_bytes=16, stride_bytes=1024)
        b_desc = wgmma.smem_descriptor(b_smem, leading_bytes=8192, stride_bytes=1024)
        acc = wgmma.fragment_zeros(64)
        wgmma.fence()
        for k in kiln.static_range(4):
            acc = wgmma.mma_async(acc, a_desc + 2 * k, b_desc + 128 * k, dtype=bf16,
                                  b_major="mn")  # @mma-async
        wgmma.commit()
        if wait_before_overwrite:
            wgmma.wait_group(0)
        b_smem[t // 64, t % 64] = kiln.cast(0.0, bf16)  # @overwrite-operand
        wgmma.wait_group(0)
        tv = wgmma_m64_accumulator(64)  # register i of thread t holds C[tv(t, i)]
        for i in kiln.static_range(32):
            row, col = tv(t, i)
            c[row, col] = acc.element(i)

    return raw_wgmma


def test_raw_wgmma_descriptors_compute_the_product():
    import ml_dtypes

    rng = np.random.default_rng()
    a = rng.standard_normal((64, 64)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((64, 64)).astype(ml_dtypes.bfloat16)
    c = np.full((64, 64), np.nan, np.float32)
    make_wgmma_kernel(True).interpret[(1,)](a, b, c, num_warps=4)
    np.testing.assert_allclose(c, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-5,
                               atol=1e-4)


def test_overwriting_an_operand_of_an_in_flight_wgmma_is_a_race(marker_line):
    import ml_dtypes

    a = np.ones((64, 64), ml_dtypes.bfloat16)
    with pytest.raises(kiln.core.errors.RaceError) as info:
        make_wgmma_kernel(False).interpret[(1,)](a, a, np.zeros((64, 64), np.float32),
                                                 num_warps=4)
    err = info.value
    assert err.loc.line == marker_line("@overwrite-operand")
    assert "wgmma" in err.message and "still reading" in err.message
