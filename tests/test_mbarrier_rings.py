"""Ring proofs (passes/mbarrier_rings.py, passes/mbarrier_protocol.py) on small kernels: the
stage count a PhaseTracker records, and a first-iteration TMA load that a same-path read before
it in the loop body races with."""

import numpy as np
import pytest

import kiln
from kiln import f32, mbarrier, tma
from kiln.core.errors import WaitError
from kiln.nvidia.sync import fence_mbarrier_init

ROWS, COLS = 8, 32  # one f32 box: 8 rows of 128 bytes


def make_first_iteration_kernel(read_first: bool):
    @kiln.kernel
    def first_load(x_map: kiln.TensorMap[f32, (ROWS, COLS)], out: kiln.Tensor[f32, 2],
                   n: kiln.i32):
        """Loads one tile in the loop's first iteration; every iteration reads it."""
        tile = kiln.shared((ROWS, COLS), f32, align=128)
        t = kiln.thread_id(0)
        bars = mbarrier.group(num_barriers=1)
        bars.init(0, count=1, predicate=t == 0)
        fence_mbarrier_init()
        kiln.barrier()
        acc = kiln.cast(0.0, f32)
        for it in kiln.range(0, n):
            if read_first:
                acc = acc + tile[t // COLS, t % COLS]  # @early-read
            if it == 0:
                bars.arrive_expect_tx(0, tma.box_bytes(x_map), predicate=t == 0)
                tma.load(x_map, tile, (0, 0), bars, 0, predicate=t == 0)
                bars.try_wait(0, phase=0)
            if not read_first:
                acc = acc + tile[t // COLS, t % COLS]
        out[t // COLS, t % COLS] = acc

    return first_load


def _compile(kernel):
    x = np.zeros((ROWS, COLS), np.float32)
    return kernel.compile(x, np.zeros_like(x), 3, target="sm_90a")


def test_first_iteration_load_read_after_it_is_accepted():
    assert "nvgpu.tma.async.load" in _compile(make_first_iteration_kernel(False)).asm["kiln"]


def test_first_iteration_load_read_before_it_races(marker_line):
    """Before, the reads earlier in that first iteration were not checked."""
    with pytest.raises(WaitError, match="may overwrite the buffer"):
        _compile(make_first_iteration_kernel(True))


def test_phase_tracker_records_its_stage_count():
    @kiln.kernel
    def tracked(out: kiln.Tensor[f32, 1], n: kiln.i32):
        """A 2-stage ring on a group of 3 barriers: the passes must use 2."""
        bars = mbarrier.group(num_barriers=3)
        ring = mbarrier.PhaseTracker(bars, stages=2)
        bars.init(0, count=1, predicate=kiln.thread_id(0) == 0)
        kiln.barrier()
        for it in kiln.range(0, n):
            ring.wait(it)
        out[kiln.thread_id(0)] = 0.0

    text = tracked.compile(np.zeros(4, np.float32), 1, target="sm_90a").asm["kiln"]
    assert "kiln.ring_stages = 2" in text


def make_store_filled_ring(fills: bool):
    @kiln.kernel
    def store_filled(out: kiln.Tensor[f32, 1], n: kiln.i32):
        """Warp 0 fills a 2-stage ring with plain stores and arrives; warp 1 waits for each use
        (a full ring's parity) and reads it."""
        tiles = kiln.shared((2, 32), f32)
        t = kiln.thread_id(0)
        full = mbarrier.group(num_barriers=2)
        for s in kiln.static_range(2):
            full.init(s, count=32, predicate=t == 0)
        fence_mbarrier_init()
        kiln.barrier()
        acc = kiln.cast(0.0, f32)
        if t < 32:
            for use in kiln.range(0, 2):  # two uses: no slot is refilled
                tiles[use, t] = kiln.cast(use, f32)
                full.arrive(use, fills=fills)
        else:
            for use in kiln.range(0, 2):
                full.try_wait(use % 2, (use // 2) % 2)
                acc = acc + tiles[use, t % 32]
        out[t] = acc

    return store_filled


def test_a_store_filled_ring_is_a_full_ring():
    """``arrive(fills=True)`` makes the ring full: its waits take a full ring's parity; a plain
    arrive makes it an empty ring, whose waits that parity flips."""
    args = (np.zeros(64, np.float32), 2)
    assert "fill" in make_store_filled_ring(True).compile(*args, target="sm_90a",
                                                          num_warps=2).asm["kiln"]
    with pytest.raises(WaitError, match="parity is flipped"):
        make_store_filled_ring(False).compile(*args, target="sm_90a", num_warps=2)
