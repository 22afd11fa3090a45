"""kiln.tiles: RegTile reductions/re-tagging/casts, SharedTile addressing, GlobalTile masking.

The lane-level algorithms are checked by running them on numpy arrays with the same structure
functions the traced code uses (no GPU here); the IR they emit is checked for shape."""

from __future__ import annotations

import numpy as np
import pytest

import kiln
import kiln.tile_vector as tile_vector
import kiln.tiles as tiles
from kiln import layout as L
from kiln.swizzle import Swizzle

FRAGMENTS = {
    "mma_m16n8_acc": L.mma_m16n8_accumulator(),
    "mma_a": L.mma_m16n8k16_a(),
    "wgmma_acc_64": L.wgmma_m64_accumulator(64),
    "mfma_32x32": L.mfma_32x32_accumulator(),
    "mfma_16x16": L.mfma_16x16_accumulator(),
}


def simulate_row_reduce(tv, tile: np.ndarray, combine) -> np.ndarray:
    """Run RegTile's row reduction on numpy: ``[lanes, groups]`` results per lane."""
    group_of, masks = tile_vector.row_structure(tv)
    rows, cols = tv.coords()
    held = tile[rows, cols]                                        # [lanes, values]
    groups = max(group_of) + 1
    partial = np.stack([combine.reduce(held[:, [v for v, g in enumerate(group_of) if g == k]],
                                       axis=1) for k in range(groups)], axis=1)
    lanes = np.arange(tv.num_threads)
    for mask in masks:                                             # xor_shuffle semantics
        partial = combine(partial, partial[lanes ^ mask])
    return partial


@pytest.mark.parametrize("name", sorted(FRAGMENTS))
@pytest.mark.parametrize("combine", [np.maximum, np.add], ids=["max", "sum"])
def test_row_reduction_matches_numpy(name, combine):
    tv = FRAGMENTS[name]
    rng = np.random.default_rng()
    tile = rng.standard_normal(tv.tile)
    result = simulate_row_reduce(tv, tile, combine)
    group_of, _ = tile_vector.row_structure(tv)
    rows, _ = tv.coords()
    expected_rows = combine.reduce(tile, axis=1)
    for v, g in enumerate(group_of):
        # The shuffle tree sums in another order than numpy: compare with an absolute floor too,
        # or a row whose sum cancels to ~0 fails on rounding alone.
        np.testing.assert_allclose(result[:, g], expected_rows[rows[:, v]], rtol=1e-12,
                                   atol=1e-12)


@pytest.mark.parametrize("name", sorted(FRAGMENTS))
def test_column_reduction_goes_through_the_transpose(name):
    tv = FRAGMENTS[name]
    tile = np.random.default_rng().standard_normal(tv.tile)
    t = L.transpose(tv)
    result = simulate_row_reduce(t, tile.T, np.add)
    group_of, _ = tile_vector.row_structure(t)
    rows_t, _ = t.coords()
    for v, g in enumerate(group_of):
        np.testing.assert_allclose(result[:, g], tile.sum(axis=0)[rows_t[:, v]], rtol=1e-12,
                                   atol=1e-12)


@pytest.mark.parametrize("name", sorted(FRAGMENTS))
def test_transpose_swaps_coordinates(name):
    tv = FRAGMENTS[name]
    rows, cols = tv.coords()
    t_rows, t_cols = L.transpose(tv).coords()
    np.testing.assert_array_equal(t_rows, cols)
    np.testing.assert_array_equal(t_cols, rows)


def test_mfma_views_retag_between_col_l_and_row_l():
    built = {}

    @kiln.kernel
    def k(out: kiln.Tensor[kiln.f32]):
        s = tiles.RegTile.full(L.mfma_32x32_accumulator(), (1, 2), 1.5)
        built["col"] = s
        built["row"] = s.as_view(tiles.ROW_LANES)
        out.store(0, built["row"].fragment(0, 0))

    text = k.trace(np.zeros(64, np.float32), target="gfx950").module_asm
    col, row = built["col"], built["row"]
    assert (col.view, row.view) == ("col_l", "row_l")
    assert row.grid == (2, 1) and row.shape == (64, 32)
    assert row.fragment(1, 0) is col.fragment(0, 1)          # same registers, no new IR
    assert text.count("arith.constant dense<1.5") == 1


def test_row_max_and_cast_emit_shuffles_and_one_truncf():
    @kiln.kernel
    def k(out: kiln.Tensor[kiln.bf16]):
        s = tiles.RegTile.full(L.mma_m16n8_accumulator(), (2, 4), 0.25)
        s = s + kiln.cast(kiln.lane_id(), kiln.f32)
        p = (s - s.row_max()).exp2()
        p = p / p.row_sum()
        out.store(kiln.lane_id() * 4, p.cast(kiln.bf16).fragment(1, 3))

    text = k.trace(np.zeros(128, kiln.bf16.numpy), target="sm_80").module_asm
    assert text.count("arith.truncf") == 1
    assert "vector<32xf32> to vector<32xbf16>" in text
    # two row groups per fragment row, each reduced over lane masks 1 and 2; max and sum
    assert text.count("gpu.shuffle  xor") == 2 * 2 * 2 * 2
    assert text.count("math.exp2") == 8


@kiln.kernel
def _split_row_sum(out: kiln.Tensor[kiln.f32, 1]):
    s = tiles.RegTile.full(L.mma_m16n8_accumulator(), (2, 4), 0.25)
    s = (s + kiln.cast(kiln.lane_id(), kiln.f32)).exp2()
    partial = s.row_reduce(lambda a, b: a + b, across_lanes=False)
    split = s.reduce_lanes(partial, lambda a, b: a + b)
    whole = s.row_sum()
    lane = kiln.lane_id()
    for i, (a, b) in enumerate(zip(split.values, whole.values)):
        for g in range(len(a)):
            out[(2 * i + g) * 64 + lane] = a[g]
            out[(2 * i + g) * 64 + 32 + lane] = b[g]


def test_row_reduction_split_at_the_lanes_matches_the_whole():
    """row_reduce(across_lanes=False) leaves each lane's own registers' result (no shuffles);
    reduce_lanes finishes it to what row_sum gives."""
    text = _split_row_sum.trace(np.zeros(256, np.float32), target="sm_80").module_asm
    assert text.count("gpu.shuffle  xor") == 2 * 2 * 2 * 2  # reduce_lanes and row_sum only
    out = np.full(256, np.nan, np.float32)
    _split_row_sum.interpret[1](out, num_warps=1)
    split, whole = out.reshape(4, 2, 32)[:, 0], out.reshape(4, 2, 32)[:, 1]
    np.testing.assert_allclose(split, whole, rtol=1e-6)
    assert np.isfinite(whole).all() and len(np.unique(whole)) > 4


@kiln.kernel
def _lane_flag(out: kiln.Tensor[kiln.i32, 1]):
    s = tiles.RegTile.full(L.mma_m16n8_accumulator(), (2, 4), 0.25)
    part = (s + kiln.cast(kiln.lane_id(), kiln.f32)).row_reduce(kiln.maximum, across_lanes=False)
    out[kiln.lane_id()] = part.any_greater(20.5)


def test_tile_vector_any_greater_is_one_lane_s_answer():
    out = np.full(32, -1, np.int32)
    _lane_flag.interpret[1](out, num_warps=1)
    np.testing.assert_array_equal(out, (np.arange(32) + 0.25 > 20.5).astype(np.int32))


def test_tile_vector_broadcast_rejects_another_layout():
    @kiln.kernel
    def k(out: kiln.Tensor[kiln.f32]):
        a = tiles.RegTile.full(L.mma_m16n8_accumulator(), (1, 1), 1.0)
        b = tiles.RegTile.full(L.mfma_16x16_accumulator(), (1, 1), 1.0)
        out.store(0, (a - b.row_max()).fragment(0, 0))

    with pytest.raises(kiln.KilnTypeError, match="another layout"):
        k.trace(np.zeros(4, np.float32), target="sm_80")


def _capture_shared_tile(**kwargs):
    captured = {}

    @kiln.kernel
    def k(out: kiln.Tensor[kiln.bf16]):
        captured["tile"] = tiles.SharedTile(**kwargs)
        out[0] = captured["tile"].load(0, 0)

    k.trace(np.zeros(4, kiln.bf16.numpy), target="sm_80")
    return captured["tile"]


@pytest.mark.parametrize("swizzle", [None, Swizzle(2, 3, 3), Swizzle(3, 3, 3)],
                         ids=["plain", "sw64b", "sw128b"])
def test_shared_fragment_load_reads_the_fragment_elements(swizzle):
    tile = _capture_shared_tile(shape=(64, 64), dtype=kiln.bf16, swizzle=swizzle)
    tv = L.mma_m16n8k16_a()
    width = tile.fragment_width(tv)
    assert width == 2
    rng = np.random.default_rng()
    matrix = rng.standard_normal((64, 64))
    memory = np.full(tile.offsets().max() + 1, np.nan)
    memory[tile.offsets()] = matrix                                 # what the tile holds
    lanes = np.arange(32)[:, None]
    origin = (16, 32)
    for v0 in range(0, tv.num_values, width):                       # load_fragments' loop
        r, c = tv(lanes, v0)
        start = tile.offset(origin[0] + r, origin[1] + c)
        got = memory[start + np.arange(width)]
        rows, cols = tv.coords()
        want = matrix[origin[0] + rows[:, v0:v0 + width], origin[1] + cols[:, v0:v0 + width]]
        np.testing.assert_array_equal(got, want)


def test_shared_tile_rejects_vectors_split_by_the_swizzle():
    tile = _capture_shared_tile(shape=(8, 64), dtype=kiln.bf16, swizzle=Swizzle(3, 2, 3))
    assert tile.contiguous_width(4) and not tile.contiguous_width(8)


def test_copy_plan_covers_the_tile_once():
    shape, width, threads = (64, 32), 8, 128
    chunks_per_row = shape[1] // width
    seen = np.zeros(shape, int)
    for tid in range(threads):
        for step in range(shape[0] * chunks_per_row // threads):
            chunk = tid + step * threads
            r, c = chunk // chunks_per_row, (chunk % chunks_per_row) * width
            seen[r, c:c + width] += 1
    assert np.all(seen == 1)


def test_row_run_width_of_fragments():
    assert tiles.row_run_width(L.mma_m16n8_accumulator()) == 2
    assert tiles.row_run_width(L.mfma_32x32_accumulator()) == 1
    assert tiles.row_run_width(L.transpose(L.mfma_32x32_accumulator())) == 4


def test_ragged_global_tile_masks_rows_past_the_end():
    @kiln.kernel
    def k(x: kiln.Tensor[kiln.f32, 2], y: kiln.Tensor[kiln.f32, 2], start: kiln.i32,
          length: kiln.i32):
        src = tiles.GlobalTile.ragged(x, (16, 8), start=start, length=length,
                                      index=kiln.block_id(0))
        dst = tiles.GlobalTile(y, (16, 8), src.origin, row_end=src.row_end)
        r = kiln.thread_id(0) % 16
        dst.store(r, 0, src.load(r, 0, width=8) * 2.0)

    text = k.trace(np.ones((64, 8), np.float32), np.ones((64, 8), np.float32), 3, 40,
                   target="sm_80").module_asm
    assert text.count("scf.if") == 2
    assert "arith.constant dense<0.000000e+00> : vector<8xf32>" in text
    assert text.count("arith.cmpi slt") == 2


def test_sync_copy_uses_vector_loads_of_16_bytes():
    @kiln.kernel
    def k(x: kiln.Tensor[kiln.bf16, 2], out: kiln.Tensor[kiln.bf16]):
        s = tiles.SharedTile((32, 64), kiln.bf16, swizzle=Swizzle(3, 3, 3))
        tiles.copy(tiles.GlobalTile(x, (32, 64), (0, 0)), s, threads=64)
        kiln.barrier()
        out.store(0, s.load(1, 8, width=8))

    text = k.trace(np.ones((32, 64), kiln.bf16.numpy), np.ones(8, kiln.bf16.numpy),
                   target="sm_80", num_warps=2).module_asm
    assert text.count("vector.load %arg0") == 4 and "vector<8xbf16>" in text
    assert text.count("vector.store") == 4 + 1  # four 16-byte chunks per thread, plus out


@pytest.mark.parametrize("stride,ok", [((64, 1), True), ((1, 8), True), ((32, 1), False),
                                       ((0, 1), False), ((1, 1), False)])
def test_a_shared_tile_layout_must_give_each_element_its_own_address(stride, ok):
    """Column-overlapping rows (stride 32 for 64 columns), a broadcast row (stride 0) and a
    diagonal collision are refused; row-major and column-major pass."""
    from kiln.layout_algebra import Layout

    layout = Layout((8, 64), stride)
    if ok:
        assert _capture_shared_tile(shape=(8, 64), dtype=kiln.bf16, layout=layout).layout \
            == layout
        return
    with pytest.raises(kiln.KilnValueError, match="maps two elements to one address"):
        _capture_shared_tile(shape=(8, 64), dtype=kiln.bf16, layout=layout)
