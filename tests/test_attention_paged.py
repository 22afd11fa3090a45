"""PagedRowIndices: row mapping, partial pages, pair-CTA halves, V sub-tiles and OOB fill,
run through the CPU interpreter against numpy."""

import functools

import ml_dtypes
import numpy as np
import pytest

import kiln
from kiln import mbarrier, nvidia_asm
from kiln.kernels.attention.paged import (OOB_ROW, PagedRowIndices, PageTableRow,
                                          kv_sub_tile_rows)
from kiln.shared import dynamic_shared

D = 16  # narrow rows keep the interpreter fast; 32 bytes per row is TMA-aligned
HKV = 2
TARGET = "sm_90a"


def test_kv_sub_tile_rows():
    assert kv_sub_tile_rows(64, 0) == 64
    assert kv_sub_tile_rows(128, 16) == 16
    assert kv_sub_tile_rows(64, 256) == 64
    assert kv_sub_tile_rows(64, 1) == 1
    with pytest.raises(kiln.UnsupportedError):
        kv_sub_tile_rows(64, 48)
    with pytest.raises(kiln.KilnValueError):
        kv_sub_tile_rows(96, 16)


def test_struct_parameters():
    rows = PagedRowIndices[128, 16]
    assert (rows.eff_page, rows.num_pages, rows.k_pages_per_cta) == (16, 8, 8)
    assert PagedRowIndices[128, 16] is rows
    peer = PagedRowIndices[64, 256, True, False]
    assert (peer.num_pages, peer.k_pages_per_cta, peer.k_tile_rows, peer.cta_group) == (1, 1, 32, 2)
    assert PagedRowIndices[128, 16, True].k_pages_per_cta == 4
    assert PagedRowIndices[64, 0].v_tile_rows(2) == 32
    with pytest.raises(kiln.KilnTypeError):
        PagedRowIndices[64]


@functools.lru_cache(maxsize=None)
def _copy_kernel(BN, page_size, side, pair_cta=False, is_leader=True, needs_partial=False,
                 num_v_sub_tiles=1, v_sub_tile_idx=0, oob_fill=False):
    """A one-warp kernel: populate the rows of the tile at ``kv_row``, copy K (or one V
    sub-tile) of kv head 1 into shared slots, write the slots to ``out``."""
    Rows = PagedRowIndices[BN, page_size, pair_cta, is_leader]
    copy_rows = Rows.k_tile_rows if side == "k" else Rows.v_tile_rows(num_v_sub_tiles)
    slots_n = Rows.k_pages_per_cta if side == "k" else BN // num_v_sub_tiles // copy_rows
    box_bytes = copy_rows * D * 2

    @kiln.kernel
    def copy_pages(cache: kiln.TensorMap[kiln.bf16, (copy_rows, D), 0],
                   page_table: kiln.Tensor[kiln.i32, 2], out: kiln.Tensor[kiln.bf16, 3],
                   kv_row: kiln.i32, valid_rows: kiln.i32, num_valid: kiln.i32):
        slots = dynamic_shared((slots_n, copy_rows, D), kiln.bf16, align=128)
        bars = mbarrier.group(num_barriers=1)
        tid = kiln.thread_id(0)
        bars.init(0, count=1, predicate=tid == 0)
        nvidia_asm.fence_mbarrier_init()
        kiln.barrier()
        rows = Rows.populate(PageTableRow(page_table, 0), kv_row, valid_rows)
        elect = nvidia_asm.elect_sync()
        issued = num_valid if needs_partial and not oob_fill else slots_n
        bars.arrive_expect_tx(0, issued * box_bytes, predicate=tid == 0)
        if side == "k":
            rows.tma_copy_k(cache, slots, bars, 0, column=D, elect=elect,
                            needs_partial=needs_partial, num_valid_pages=num_valid)
        else:
            rows.tma_copy_v(cache, slots, bars, 0, column=D, elect=elect,
                            needs_partial=needs_partial, num_v_sub_tiles=num_v_sub_tiles,
                            v_sub_tile_idx=v_sub_tile_idx, num_valid_pages=num_valid,
                            oob_fill_pages=oob_fill)
        bars.try_wait(0, phase=0)
        for i in kiln.range(tid, slots_n * copy_rows * D, 32):
            slot = i // (copy_rows * D)
            out[slot, i // D % copy_rows, i % D] = slots[slot, i // D % copy_rows, i % D]

    return copy_pages, slots_n, copy_rows


def _cache(rng, num_phys_pages, page_size):
    rows = num_phys_pages * max(page_size, 1)
    return rng.standard_normal((rows, HKV * D)).astype(ml_dtypes.bfloat16)


def _physical_row(table, page_size, logical):
    if page_size == 0:
        return logical
    return table[logical // page_size] * page_size + logical % page_size


def _run(kernel, slots_n, copy_rows, cache, table, kv_row, valid_rows, num_valid):
    poison = np.full((slots_n, copy_rows, D), np.nan, ml_dtypes.bfloat16)
    out = poison.copy()
    kernel.interpret[(1, 1, 1)](cache, table[None, :].astype(np.int32), out, kv_row,
                                valid_rows, num_valid, num_warps=1, target=TARGET)
    return out


def _expected_rows(cache, table, page_size, logical_rows):
    """The head-1 slice of the cache at the physical rows of ``logical_rows``."""
    phys = [_physical_row(table, page_size, r) for r in logical_rows]
    return cache[phys, D:2 * D].astype(np.float32)


@pytest.mark.parametrize("BN", [64, 128])
@pytest.mark.parametrize("page_size", [0, 1, 16, 64, 128, 256])
def test_row_mapping_full_tile(BN, page_size, rng):
    eff = kv_sub_tile_rows(BN, page_size)
    tile = 1 if page_size == 0 or page_size >= 2 * BN else 0  # second tile where it fits a page
    kv_row = tile * BN
    table_len = (kv_row + BN) // page_size + 1 if page_size else 1
    num_phys = table_len + 3 if page_size else 1
    table = rng.permutation(num_phys)[:table_len].astype(np.int32)
    cache = _cache(rng, num_phys if page_size else 1, page_size or (kv_row + BN))
    kernel, slots_n, copy_rows = _copy_kernel(BN, page_size, "k")
    out = _run(kernel, slots_n, copy_rows, cache, table, kv_row, kv_row + BN, slots_n)
    got = out.astype(np.float32).reshape(BN, D)
    assert slots_n * copy_rows == BN and copy_rows == eff
    np.testing.assert_array_equal(got, _expected_rows(cache, table, page_size,
                                                      range(kv_row, kv_row + BN)))


@pytest.mark.parametrize("page_size", [1, 16])
def test_partial_pages_copy_only_valid_pages(page_size, rng):
    BN = 64
    table = rng.permutation(80).astype(np.int32)
    cache = _cache(rng, 80, page_size)
    kernel, slots_n, copy_rows = _copy_kernel(BN, page_size, "k", needs_partial=True)
    for num_valid in (1, slots_n // 2 + 1, slots_n):
        out = _run(kernel, slots_n, copy_rows, cache, table, 0, num_valid * page_size, num_valid)
        got = out.astype(np.float32).reshape(BN, D)
        rows = num_valid * copy_rows
        np.testing.assert_array_equal(got[:rows], _expected_rows(cache, table, page_size,
                                                                 range(rows)))
        assert np.isnan(got[rows:]).all()  # the untouched slots keep their poison


@pytest.mark.parametrize("page_size", [16, 256])
@pytest.mark.parametrize("is_leader", [True, False])
def test_pair_cta_k_halves(page_size, is_leader, rng):
    """The leader copies the first BN/2 rows, the peer the second half (index arithmetic of a
    2-CTA pair, run as one CTA: the interpreter has no clusters)."""
    BN = 64
    table = rng.permutation(40).astype(np.int32)
    cache = _cache(rng, 40, page_size)
    kv_row = BN if page_size > BN else 2 * BN
    kernel, slots_n, copy_rows = _copy_kernel(BN, page_size, "k", pair_cta=True,
                                              is_leader=is_leader)
    out = _run(kernel, slots_n, copy_rows, cache, table, kv_row, 10 ** 6, slots_n)
    half = kv_row + (0 if is_leader else BN // 2)
    np.testing.assert_array_equal(out.astype(np.float32).reshape(BN // 2, D),
                                  _expected_rows(cache, table, page_size,
                                                 range(half, half + BN // 2)))


# Every page / sub-tile ratio of a 64-row tile: pages smaller than, equal to and larger than
# a sub-tile, including 1 < num_pages < num_v_sub_tiles (page 32, 4 sub-tiles).
V_SUB_TILE_CASES = [(page_size, subs, idx) for page_size in (0, 8, 16, 32, 64, 128)
                    for subs in (1, 2, 4) for idx in range(subs)]


@pytest.mark.parametrize("page_size,num_subs,sub_tile", V_SUB_TILE_CASES,
                         ids=[f"page{p}-subs{n}-idx{i}" for p, n, i in V_SUB_TILE_CASES])
def test_v_sub_tiles_read_their_own_pages(page_size, num_subs, sub_tile, rng):
    """Each V sub-tile's rows come from the physical pages of its own logical rows (the table
    is a random permutation, so a row of the neighbouring physical page is caught)."""
    BN = 64
    kv_row = BN if page_size == 0 or page_size >= 2 * BN else 2 * BN
    num_phys = 40
    table = rng.permutation(num_phys).astype(np.int32)
    cache = _cache(rng, num_phys, page_size or (kv_row + BN))
    kernel, slots_n, copy_rows = _copy_kernel(BN, page_size, "v", num_v_sub_tiles=num_subs,
                                              v_sub_tile_idx=sub_tile)
    out = _run(kernel, slots_n, copy_rows, cache, table, kv_row, 10 ** 6, slots_n)
    sub_rows = BN // num_subs
    assert slots_n * copy_rows == sub_rows
    first = kv_row + sub_tile * sub_rows
    np.testing.assert_array_equal(out.astype(np.float32).reshape(sub_rows, D),
                                  _expected_rows(cache, table, page_size,
                                                 range(first, first + sub_rows)))


def test_v_oob_fill_pages_zero_the_rest(rng):
    BN, page_size = 64, 16
    table = rng.permutation(8)[:2].astype(np.int32)  # the table ends after the valid pages
    cache = _cache(rng, 8, page_size)
    kernel, slots_n, copy_rows = _copy_kernel(BN, page_size, "v", needs_partial=True,
                                              oob_fill=True)
    out = _run(kernel, slots_n, copy_rows, cache, table, 0, 2 * page_size, 2)
    got = out.astype(np.float32).reshape(BN, D)
    np.testing.assert_array_equal(got[:32], _expected_rows(cache, table, page_size, range(32)))
    np.testing.assert_array_equal(got[32:], 0.0)


def test_populate_marks_pages_past_valid_rows_out_of_bounds(rng):
    """Pages past ``valid_rows`` are never looked up (the table may be shorter) and read as
    zeros through TMA's out-of-bounds fill."""
    BN, page_size = 64, 16
    table = rng.permutation(6)[:1].astype(np.int32)
    cache = _cache(rng, 6, page_size)
    kernel, slots_n, copy_rows = _copy_kernel(BN, page_size, "k")
    out = _run(kernel, slots_n, copy_rows, cache, table, 0, 5, slots_n)
    got = out.astype(np.float32).reshape(BN, D)
    np.testing.assert_array_equal(got[:16], _expected_rows(cache, table, page_size, range(16)))
    np.testing.assert_array_equal(got[16:], 0.0)
    assert OOB_ROW > cache.shape[0]
