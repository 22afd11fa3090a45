"""Synchronisation blind spots the interpreter reports: a TMA tile read by threads that never
observed its mbarrier phase, a cp.async row read by another warp after only the copier's wait,
``kiln.barrier()`` in divergent control flow, and plain global accesses of one element by two
blocks of a launch (the README saxpy with 512-thread gfx950 blocks)."""

import numpy as np
import pytest

import kiln
from kiln import (amd_asm, amd_buffer, bf16, cp_async, f32, i32, mbarrier, nvidia_asm, tiles,
                  tma)

ROWS, COLS = 4, 32  # one f32 TMA box: 128 elements, one per thread of 4 warps


def make_tma_reader(sync: str):
    """Warp 0 waits for a TMA tile, then every thread reads one element of it. ``sync``:
    "warp0" (the others never observe the phase), "barrier" (kiln.barrier() after warp 0's
    wait), "all" (every thread waits)."""

    @kiln.kernel
    def read_tile(x_map: kiln.TensorMap[f32, (ROWS, COLS)], out: kiln.Tensor[f32]):
        tile = kiln.shared((ROWS, COLS), f32, align=128)
        t = kiln.thread_id(0)
        leader = t == 0
        bars = mbarrier.group(num_barriers=1)
        bars.init(0, count=1, predicate=leader)
        kiln.barrier()
        bars.arrive_expect_tx(0, tma.box_bytes(x_map), predicate=leader)
        tma.load(x_map, tile, (0, 0), bars, 0, predicate=leader)  # @tma-load
        if sync == "all":
            bars.try_wait(0, phase=0)
        else:
            if t < 32:
                bars.try_wait(0, phase=0)
            if sync == "barrier":
                kiln.barrier()
        out[t] = tile[t // COLS, t % COLS]  # @tile-read

    return read_tile


def test_tma_tile_read_by_threads_that_never_waited_is_a_race(marker_line):
    x = np.random.default_rng().standard_normal((ROWS, COLS)).astype(np.float32)
    with pytest.raises(kiln.core.errors.RaceError) as info:
        make_tma_reader("warp0").interpret[(1,)](x, np.zeros(128, np.float32), num_warps=4)
    err = info.value
    assert err.loc.line == marker_line("@tile-read")
    assert "thread 32 loads shared byte" in err.message
    assert f"TMA load issued at" in err.message and f":{marker_line('@tma-load')}" in err.message
    assert "by thread 0" in err.message and "mbarrier 0" in err.message
    assert "Fix:" in str(err)


@pytest.mark.parametrize("sync", ["barrier", "all"])
def test_tma_tile_read_after_own_wait_or_a_barrier_passes(sync):
    x = np.random.default_rng().standard_normal((ROWS, COLS)).astype(np.float32)
    out = np.full(128, np.nan, np.float32)
    make_tma_reader(sync).interpret[(1,)](x, out, num_warps=4)
    np.testing.assert_array_equal(out, x.reshape(-1))


def make_handoff_kernel(arrive_after_wait: bool):
    @kiln.kernel
    def handoff(x_map: kiln.TensorMap[f32, (ROWS, COLS)], out: kiln.Tensor[f32]):
        """Warp 0 waits for the TMA tile (mbarrier 0) and arrives on mbarrier 1; warps 1-3
        wait on mbarrier 1 only, then every thread reads the tile."""
        tile = kiln.shared((ROWS, COLS), f32, align=128)
        t = kiln.thread_id(0)
        bars = mbarrier.group(num_barriers=2)
        bars.init(0, count=1, predicate=t == 0)
        bars.init(1, count=32, predicate=t == 0)
        kiln.barrier()
        bars.arrive_expect_tx(0, tma.box_bytes(x_map), predicate=t == 0)
        tma.load(x_map, tile, (0, 0), bars, 0, predicate=t == 0)  # @handoff-tma
        if t < 32:
            if arrive_after_wait:
                bars.try_wait(0, phase=0)
                bars.arrive(1)
            else:
                bars.arrive(1)
                bars.try_wait(0, phase=0)
        else:
            bars.try_wait(1, phase=0)
        out[t] = tile[t // COLS, t % COLS]  # @handoff-read

    return handoff


def test_tma_tile_read_after_an_mbarrier_its_observer_arrived_on_passes():
    x = np.random.default_rng().standard_normal((ROWS, COLS)).astype(np.float32)
    out = np.full(128, np.nan, np.float32)
    make_handoff_kernel(True).interpret[(1,)](x, out, num_warps=4)
    np.testing.assert_array_equal(out, x.reshape(-1))


def test_an_arrival_before_the_arriver_observed_the_tma_phase_orders_nothing(marker_line):
    x = np.random.default_rng().standard_normal((ROWS, COLS)).astype(np.float32)
    with pytest.raises(kiln.core.errors.RaceError) as info:
        make_handoff_kernel(False).interpret[(1,)](x, np.zeros(128, np.float32), num_warps=4)
    assert info.value.loc.line == marker_line("@handoff-read")
    assert "thread 32 loads" in info.value.message
    assert f":{marker_line('@handoff-tma')}" in info.value.message


def make_cp_async_kernel(with_barrier: bool):
    @kiln.kernel
    def shift_rows(x: kiln.Tensor[bf16, 2], out: kiln.Tensor[bf16, 2]):
        """Each of 64 threads cp.asyncs one row, waits for its own group, then reads the row
        that a thread of the other warp copied."""
        t = kiln.thread_id(0)
        s = tiles.SharedTile((64, 8), bf16)
        g = tiles.GlobalTile(x, (64, 8), (0, 0))
        group = cp_async.commit([cp_async.copy(s, (t, 0), g, (t, 0), width=8)])  # @row-copy
        cp_async.wait(group)
        if with_barrier:
            kiln.barrier()
        out.store(t, 0, s.load((t + 32) % 64, 0, width=8))  # @other-row

    return shift_rows


def test_cp_async_row_of_another_warp_read_after_own_wait_is_a_race(marker_line):
    x = np.random.default_rng().standard_normal((64, 8)).astype("bfloat16")
    with pytest.raises(kiln.core.errors.RaceError) as info:
        make_cp_async_kernel(False).interpret[(1,)](x, np.zeros_like(x), num_warps=2,
                                                    target="sm_80")
    err = info.value
    assert err.loc.line == marker_line("@other-row")
    assert "thread 0 loads shared byte 512 that thread 32 copied there with cp.async" \
        in err.message
    assert f":{marker_line('@row-copy')}" in err.message


def test_cp_async_row_of_another_warp_read_after_a_barrier_passes():
    x = np.random.default_rng().standard_normal((64, 8)).astype("bfloat16")
    out = np.full((64, 8), np.nan, np.float32).astype("bfloat16")
    make_cp_async_kernel(True).interpret[(1,)](x, out, num_warps=2, target="sm_80")
    np.testing.assert_array_equal(out, np.roll(x, -32, axis=0))


def make_dma_kernel(with_barrier: bool):
    @kiln.kernel
    def swap_halves(x: kiln.Tensor[bf16, 2], out: kiln.Tensor[bf16, 2]):
        """Each of 2 waves DMAs 8 rows into LDS, waits for its own DMA, then reads the rows
        the other wave copied."""
        t = kiln.thread_id(0)
        wave, lane = t // 64, t % 64
        tile = kiln.shared((16, 64), bf16)
        row, col = wave * 8 + lane // 8, (lane % 8) * 8
        src = amd_buffer.buffer(x)
        token = amd_buffer.copy_to_lds(src, (row, col), tile, (wave * 8, 0), width=8)  # @dma-rows
        amd_asm.s_waitcnt(vmcnt=0, waits_for=[token])
        if with_barrier:
            amd_asm.s_barrier()
        out.store(row, col, tile.load((row + 8) % 16, col, width=8))  # @other-wave

    return swap_halves


def test_lds_dma_rows_of_another_wave_read_after_own_waitcnt_is_a_race(marker_line):
    x = np.random.default_rng().standard_normal((16, 64)).astype("bfloat16")
    with pytest.raises(kiln.core.errors.RaceError) as info:
        make_dma_kernel(False).interpret[(1,)](x, np.zeros_like(x), num_warps=2,
                                               target="gfx950")
    err = info.value
    assert err.loc.line == marker_line("@other-wave")
    assert "that thread 64 copied there with a global -> LDS DMA" in err.message
    assert f":{marker_line('@dma-rows')}" in err.message


def test_lds_dma_rows_of_another_wave_read_after_s_barrier_passes():
    x = np.random.default_rng().standard_normal((16, 64)).astype("bfloat16")
    out = np.full((16, 64), np.nan, np.float32).astype("bfloat16")
    make_dma_kernel(True).interpret[(1,)](x, out, num_warps=2, target="gfx950")
    np.testing.assert_array_equal(out, np.roll(x, -8, axis=0))


def make_branchy_kernel(divergent: bool):
    @kiln.kernel
    def neighbours(x: kiln.Tensor[f32], y: kiln.Tensor[f32]):
        """Each half of the block takes its own branch, each with a kiln.barrier()."""
        tile = kiln.shared((128,), f32)
        t = kiln.thread_id(0)
        tile[t] = x[t]
        split = 64 if divergent else 128
        if t < split:
            kiln.barrier()  # @then-barrier
            y[t] = tile[(t + 1) % 128]
        else:
            kiln.barrier()
            y[t] = tile[(t + 1) % 128] * 2.0

    return neighbours


def test_barrier_in_divergent_control_flow_is_reported(marker_line):
    x = np.random.default_rng().standard_normal(128).astype(np.float32)
    with pytest.raises(kiln.core.errors.DeadlockError) as info:
        make_branchy_kernel(True).interpret[(1,)](x, np.zeros(128, np.float32), num_warps=4)
    err = info.value
    assert err.loc.line == marker_line("@then-barrier")
    assert "divergent control flow" in err.message
    assert "threads 0-63 of block (0, 0, 0) arrive here, threads 64-127 do not" in err.message


def test_barrier_in_a_branch_every_thread_takes_passes():
    x = np.random.default_rng().standard_normal(128).astype(np.float32)
    y = np.full(128, np.nan, np.float32)
    make_branchy_kernel(False).interpret[(1,)](x, y, num_warps=4)
    np.testing.assert_array_equal(y, np.roll(x, -1))


def make_wave_barrier_kernel(wave_1_skips: bool):
    @kiln.kernel
    def halves(x: kiln.Tensor[f32], y: kiln.Tensor[f32]):
        """Wave 0 only, or lanes 0-31 of both waves, pass an s_barrier between their store and
        their load."""
        tile = kiln.shared((128,), f32)
        t = kiln.thread_id(0)
        tile[t] = x[t]
        if (t < 64) if wave_1_skips else (t % 64 < 32):
            amd_asm.s_barrier()  # @s-barrier
            y[t] = tile[(t + 64) % 128]

    return halves


def test_s_barrier_skipped_by_a_whole_wave_is_reported(marker_line):
    x = np.random.default_rng().standard_normal(128).astype(np.float32)
    with pytest.raises(kiln.core.errors.DeadlockError) as info:
        make_wave_barrier_kernel(True).interpret[(1,)](x, np.zeros(128, np.float32),
                                                       num_warps=2, target="gfx950")
    assert info.value.loc.line == marker_line("@s-barrier")
    assert ("s_barrier in divergent control flow: threads 0-63 of block (0, 0, 0) arrive "
            "here, threads 64-127 do not") in info.value.message


def test_s_barrier_reached_by_some_lanes_of_every_wave_passes():
    """s_barrier is a scalar instruction: a wave executes it when any of its lanes does."""
    x = np.random.default_rng().standard_normal(128).astype(np.float32)
    y = np.full(128, np.nan, np.float32)
    make_wave_barrier_kernel(False).interpret[(1,)](x, y, num_warps=2, target="gfx950")
    lanes = np.arange(128) % 64 < 32
    np.testing.assert_array_equal(y[lanes], np.roll(x, -64)[lanes])


@kiln.kernel
def saxpy(x: kiln.Tensor[f32], y: kiln.Tensor[f32], n: i32, a: f32, BLOCK: kiln.constexpr):
    """The README's saxpy: one element per thread, BLOCK elements per block."""
    i = kiln.block_id(0) * BLOCK + kiln.thread_id(0)
    if i < n:
        y[i] = a * x[i] + y[i]  # @saxpy


def test_blocks_overlapping_in_global_memory_is_a_race(marker_line):
    """gfx950 waves are 64 lanes: num_warps=8 makes 512-thread blocks, each covering its own
    BLOCK=256 elements and the next block's."""
    rng = np.random.default_rng()
    x, y = rng.random(1000, np.float32), rng.random(1000, np.float32)
    with pytest.raises(kiln.core.errors.RaceError) as info:
        saxpy.interpret[(4,)](x, y, 1000, 2.0, BLOCK=256, num_warps=8, target="gfx950")
    err = info.value
    assert err.loc.line == marker_line("@saxpy")
    assert ("thread 0 of block (1, 0, 0) loads element 256 of tensor 'y' that thread 256 of "
            "block (0, 0, 0) stored at") in err.message
    assert f":{marker_line('@saxpy')}" in err.message and "num_warps" in err.fix


@pytest.mark.parametrize("target, num_warps", [("gfx950", 4), ("sm_90a", 8)])
def test_blocks_of_block_threads_pass(target, num_warps):
    rng = np.random.default_rng()
    x, y = rng.random(1000, np.float32), rng.random(1000, np.float32)
    expected = 2.0 * x.astype(np.float64) + y
    saxpy.interpret[(4,)](x, y, 1000, 2.0, BLOCK=256, num_warps=num_warps, target=target)
    np.testing.assert_allclose(y, expected, rtol=1e-6)


@kiln.kernel
def all_blocks_write_the_total(x: kiln.Tensor[f32], out: kiln.Tensor[f32]):
    """Every block's thread 0 writes out[0]: a write-write race between blocks."""
    if kiln.thread_id(0) == 0:
        out[0] = x[kiln.block_id(0)]  # @total


def test_two_blocks_storing_one_element_is_a_race(marker_line):
    x = np.random.default_rng().standard_normal(3).astype(np.float32)
    with pytest.raises(kiln.core.errors.RaceError) as info:
        all_blocks_write_the_total.interpret[(3,)](x, np.zeros(1, np.float32), num_warps=1)
    assert ("thread 0 of block (1, 0, 0) stores to element 0 of tensor 'out' that thread 0 of "
            "block (0, 0, 0) stored at") in info.value.message
    assert info.value.loc.line == marker_line("@total")


@kiln.kernel
def read_then_overwrite(x: kiln.Tensor[f32]):
    """Block 0 reads x[1]; block 1 then overwrites it: a read-write race between blocks."""
    b = kiln.block_id(0)
    if kiln.thread_id(0) == 0:
        v = x[1]  # @read-x1
        x[b] = v + 1.0  # @write-xb


def test_a_store_to_an_element_another_block_loaded_is_a_race(marker_line):
    x = np.random.default_rng().standard_normal(2).astype(np.float32)
    with pytest.raises(kiln.core.errors.RaceError) as info:
        read_then_overwrite.interpret[(2,)](x, num_warps=1)
    err = info.value
    assert err.loc.line == marker_line("@write-xb")
    assert ("thread 0 of block (1, 0, 0) stores to element 1 of tensor 'x' that thread 0 of "
            "block (0, 0, 0) loaded at") in err.message
    assert f":{marker_line('@read-x1')}" in err.message


def make_cluster_handoff(sync: bool):
    @kiln.kernel
    def handoff(x: kiln.Tensor[f32], out: kiln.Tensor[f32]):
        """CTA 1 of a cluster pair stores x[0]; CTA 0 then loads it (after a cluster barrier,
        which releases and acquires, with ``sync``)."""
        nvidia_asm.cluster_dims(2)
        rank = nvidia_asm.cluster_ctarank()
        t = kiln.thread_id(0)
        if (rank == 1) & (t == 0):
            x[0] = 5.0  # @handoff-store
        if sync:
            nvidia_asm.cluster_sync()
        if (rank == 0) & (t == 0):
            out[0] = x[0]  # @handoff-load

    return handoff


def test_global_handoff_between_cluster_ctas_needs_the_cluster_barrier(marker_line):
    """The cluster barrier orders its CTAs' global accesses (it used to be reported as a race);
    without it the CTAs, which run together, race."""
    x, out = np.ones(1, np.float32), np.full(1, np.nan, np.float32)
    make_cluster_handoff(sync=True).interpret[(2,)](x, out, num_warps=1)
    np.testing.assert_array_equal(out, [5.0])
    with pytest.raises(kiln.core.errors.RaceError) as info:
        make_cluster_handoff(sync=False).interpret[(2,)](np.ones(1, np.float32), out,
                                                         num_warps=1)
    assert "element 0 of tensor 'x'" in info.value.message
    assert info.value.loc.line in (marker_line("@handoff-store"), marker_line("@handoff-load"))


def make_ldmatrix_reader(barrier_after_wait: bool):
    @kiln.kernel
    def fragments(x_map: kiln.TensorMap[bf16, (128,)], out: kiln.Tensor[bf16, 2]):
        """Warp 0 waits for a TMA box (an 8 x 16 tile, row-major); both warps ldmatrix its
        left 8x8 block."""
        tile = kiln.shared((128,), bf16, align=128)  # the box, row-major
        t = kiln.thread_id(0)
        bars = mbarrier.group(num_barriers=1)
        bars.init(0, count=1, predicate=t == 0)
        kiln.barrier()
        bars.arrive_expect_tx(0, tma.box_bytes(x_map), predicate=t == 0)
        tma.load(x_map, tile, (0,), bars, 0, predicate=t == 0)  # @ldm-tma
        if t < 32:
            bars.try_wait(0, phase=0)
        if barrier_after_wait:
            kiln.barrier()
        view = tiles.SharedTile.view(tile, (8, 16))
        v = kiln.ldmatrix.ldmatrix(view, (0, 0), [(0, 0)])  # @ldmatrix
        first, second = kiln.vectors.unpack(v)
        out[t, 0] = first
        out[t, 1] = second

    return fragments


def test_ldmatrix_of_a_tma_tile_by_a_warp_that_never_waited_is_a_race(marker_line):
    x = np.random.default_rng().standard_normal((8, 16)).astype("bfloat16")
    with pytest.raises(kiln.core.errors.RaceError) as info:
        make_ldmatrix_reader(False).interpret[(1,)](x.reshape(-1), np.zeros((64, 2), x.dtype),
                                                    num_warps=2)
    err = info.value
    assert err.loc.line == marker_line("@ldmatrix")
    assert "thread 32 reads (ldmatrix) shared byte" in err.message
    assert f":{marker_line('@ldm-tma')}" in err.message


def test_ldmatrix_of_a_tma_tile_after_a_barrier_passes():
    x = np.random.default_rng().standard_normal((8, 16)).astype("bfloat16")
    out = np.full((64, 2), np.nan, np.float32).astype("bfloat16")
    make_ldmatrix_reader(True).interpret[(1,)](x.reshape(-1), out, num_warps=2)
    lane = np.arange(64) % 32
    np.testing.assert_array_equal(out[:, 0], x[lane // 4, 2 * (lane % 4)])
    np.testing.assert_array_equal(out[:, 1], x[lane // 4, 2 * (lane % 4) + 1])
