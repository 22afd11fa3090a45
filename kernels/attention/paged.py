"""Paged KV cache addressing: physical row indices of a BN-row range, and the TMA copies using them.

A paged cache stores keys (or values) as ``[num_pages * page_size, Hkv * D]`` rows; sequence
``b``'s logical row ``r`` lives at physical row
``page_table[b, r // page_size] * page_size + r % page_size``. A BN-row K/V tile therefore
comes from ``BN / eff_page`` separate places, where the *effective page*
``eff_page = kv_sub_tile_rows(BN, page_size)`` is the largest run of rows guaranteed to be
contiguous (``page_size`` when pages are smaller than the tile, else the whole tile).

``PagedRowIndices[BN, page_size, pair_cta, is_leader]`` is a :func:`kiln.struct` holding one
i32 physical row per effective page (``num_pages`` fields ``row_0 ..``). :meth:`populate` reads
the page table once per tile; K and V then reuse the rows (no lazy look-ups), and each TMA copy
(one per page) lands in its own shared-memory slot of ``eff_page`` rows:

=============================  ===================================================================
``tma_copy_k``                 ``k_pages_per_cta`` copies; with ``pair_cta`` the peer CTA of a
                               2-CTA cluster takes the second half of the pages (or, with a single
                               page, the same page ``BN/2`` rows further on)
``tma_copy_v``                 all pages of sub-tile ``v_sub_tile_idx`` of ``num_v_sub_tiles``
                               (sub-tiles smaller than a page read their own page at an
                               intra-page row offset)
``needs_partial=True``         a run-time switch on the number of valid pages whose every branch
                               is the fully unrolled copy sequence of that length
``oob_fill_pages=True`` (V)    also copy an out-of-bounds box into the remaining slots: TMA fills
                               it with zeros, so P·V never multiplies 0 by stale shared memory;
                               the barrier then expects the full tile's bytes
``eviction_policy=``           the L2 priority of every copy (:func:`kiln.tma.load`), e.g.
                               ``"evict_first"`` for a cache that a decode step reads once
=============================  ===================================================================

Every copy is predicated on ``elect`` (e.g. :func:`kiln.nvidia_asm.elect_sync` in the producer
warp): all lanes run the same straight-line code, the elected lane issues.

Example (one BN=64 tile of a cache with 16-row pages)::

    Rows = PagedRowIndices[64, 16]
    rows = Rows.populate(PageTableRow(page_table, b), kv_row=tile * 64, valid_rows=seq_len)
    bars.arrive_expect_tx(0, 2 * Rows.tile_bytes(k_map), predicate=leader)
    rows.tma_copy_k(k_map, k_slots, bars, 0, column=kv_head * D, elect=leader, needs_partial=False)
    rows.tma_copy_v(v_map, v_slots, bars, 0, column=kv_head * D, elect=leader, needs_partial=False)
"""

from __future__ import annotations

import functools

import kiln
from kiln import tma

# A row coordinate past any cache: a box there is entirely out of bounds, which TMA delivers
# as zeros (and still counts as the box's bytes on the barrier).
OOB_ROW = 1 << 30


def kv_sub_tile_rows(BN: int, page_size: int) -> int:
    """Rows one TMA copy can move for a ``BN``-row tile of a cache with ``page_size``-row pages.

    ``page_size == 0`` (not paged) or ``page_size >= BN`` gives ``BN``; smaller pages give
    ``page_size``. Example: ``kv_sub_tile_rows(128, 16) == 16``,
    ``kv_sub_tile_rows(64, 256) == 64``.
    """
    for name, value in (("BN", BN), ("page_size", page_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise kiln.KilnValueError(f"{name}={value!r} must be a non-negative Python int",
                                      fix=f"pass {name} as a compile-time constant")
    if BN <= 0 or BN & (BN - 1):
        raise kiln.KilnValueError(f"BN={BN} must be a power of two",
                                  fix="use a tile of 64 or 128 rows")
    if page_size == 0 or page_size >= BN:
        if page_size % BN:
            raise kiln.UnsupportedError(f"page_size={page_size} is not a multiple of BN={BN}, so "
                                        "a tile could straddle two pages",
                                        fix="use power-of-two page sizes")
        return BN
    if BN % page_size:
        raise kiln.UnsupportedError(f"page_size={page_size} does not divide BN={BN}",
                                    fix="use power-of-two page sizes")
    return page_size


class PageTableRow:
    """``page_table[batch, i]`` as ``row[i]``: the logical-to-physical page map of one sequence,
    the form :meth:`PagedRowIndices.populate` reads. Example: ``PageTableRow(page_table, b)``."""

    def __init__(self, page_table, batch):
        self.page_table, self.batch = page_table, batch

    def __getitem__(self, logical_page):
        return self.page_table[self.batch, logical_page]


class _PagedRowIndicesFactory:
    """``PagedRowIndices[BN, page_size, pair_cta=False, is_leader=True]``: the struct class for
    those compile-time parameters (cached, so equal parameters give the same class)."""

    def __getitem__(self, params):
        params = params if isinstance(params, tuple) else (params,)
        if not 2 <= len(params) <= 4:
            raise kiln.KilnTypeError("PagedRowIndices takes [BN, page_size, pair_cta, is_leader]",
                                     fix="e.g. PagedRowIndices[64, 16]")
        return _make(*params)


PagedRowIndices = _PagedRowIndicesFactory()


@functools.lru_cache(maxsize=None)
def _make(BN: int, page_size: int, pair_cta: bool = False, is_leader: bool = True):
    eff_page = kv_sub_tile_rows(BN, page_size)
    num_pages = BN // eff_page
    namespace = {
        "__annotations__": {f"row_{p}": kiln.i32 for p in range(num_pages)},
        "__module__": __name__,
        "__qualname__": f"PagedRowIndices[{BN}, {page_size}, {pair_cta}, {is_leader}]",
        "__doc__": _make.__doc__,
        "BN": BN, "page_size": page_size, "pair_cta": bool(pair_cta),
        "is_leader": bool(is_leader), "eff_page": eff_page, "num_pages": num_pages,
        "cta_group": 2 if pair_cta else 1,
        # K rows this CTA copies: half the pages on a 2-CTA pair, or half of a single page.
        "k_pages_per_cta": num_pages // 2 if pair_cta and num_pages >= 2 else num_pages,
        "k_tile_rows": eff_page // 2 if pair_cta and num_pages == 1 else eff_page,
        "populate": classmethod(_populate), "get_row": _get_row, "row": _row,
        "tma_copy_k": _tma_copy_k, "tma_copy_v": _tma_copy_v,
    }
    rows_class = kiln.struct(type(namespace["__qualname__"], (), namespace))
    rows_class.v_tile_rows = classmethod(_v_tile_rows)  # compile-time only: not AST-rewritten
    return rows_class


def _v_tile_rows(cls, num_v_sub_tiles: int = 1) -> int:
    """Rows of one V copy when the tile is split over ``num_v_sub_tiles`` shared slots."""
    if num_v_sub_tiles < 1 or cls.BN % num_v_sub_tiles:
        raise kiln.KilnValueError(f"num_v_sub_tiles={num_v_sub_tiles} must divide BN={cls.BN}",
                                  fix="use 1, 2 or 4 sub-tiles")
    return kv_sub_tile_rows(cls.BN // num_v_sub_tiles, cls.page_size)


def _populate(cls, page_table, kv_row, valid_rows=None):
    """Physical rows of the ``BN`` logical rows starting at ``kv_row`` (a multiple of
    ``eff_page``). ``page_table[i]`` maps logical page ``i`` to its physical page (see
    :class:`PageTableRow`). With ``valid_rows``, pages starting at or past it are not looked
    up (the table may end there) and map to an out-of-bounds row, which TMA zero-fills."""
    rows = {}
    for p in kiln.static_range(cls.num_pages):
        logical = kv_row + p * cls.eff_page
        if cls.page_size == 0:
            physical = logical
        else:
            page = logical // cls.page_size
            if valid_rows is not None:
                last_page = kiln.maximum((valid_rows - 1) // cls.page_size, 0)
                page = kiln.minimum(page, last_page)
            physical = page_table[page] * cls.page_size + logical % cls.page_size
        if valid_rows is not None:
            physical = kiln.where(logical < valid_rows, physical, OOB_ROW)
        rows[f"row_{p}"] = kiln.cast(physical, kiln.i32) if isinstance(physical, kiln.Value) \
            else physical
    return cls(**rows)


def _row(self, entry: int):
    """The physical row of effective page ``entry`` (a Python int)."""
    return getattr(self, f"row_{entry}")


def _get_row(self, offset):
    """Physical row of logical offset ``offset`` (int or traced) within the BN range, e.g.
    ``get_row(sub_tile * eff_page)``. A traced offset selects among the entries."""
    if isinstance(offset, int):
        row = self.row(offset // self.eff_page)
        return row + offset % self.eff_page if offset % self.eff_page else row
    entry = offset // self.eff_page
    row = self.row(0)
    for p in kiln.static_range(1, self.num_pages):
        row = kiln.where(entry == p, self.row(p), row)
    return row + offset % self.eff_page


def _check_box(tensor_map, rows: int, what: str):
    if tensor_map.box[0] != rows:
        raise kiln.KilnValueError(f"{what} tensor map box {tensor_map.box} copies "
                                  f"{tensor_map.box[0]} rows, but each page copy moves {rows}",
                                  fix=f"declare the box as ({rows}, D)")


def _tma_copy_k(self, k_map, slots, bars, bar_index, *, column, elect, needs_partial,
                num_valid_pages=None, first_slot=0, num_iters=None, eviction_policy=None):
    """Copy this CTA's K pages into ``slots.tile(first_slot + p)`` (``slots``: a
    ``kiln.dynamic_shared((n, k_tile_rows, D), ...)`` buffer), completing on
    ``bars[bar_index]``. ``column`` is the innermost coordinate (``kv_head * D + depth``).

    ``needs_partial=True`` copies only the first ``num_valid_pages`` (traced, 1..k_pages_per_cta)
    pages, dispatching at run time to the unrolled sequence of that length.
    """
    _check_box(k_map, self.k_tile_rows, "K")
    pages = self.k_pages_per_cta
    if needs_partial:
        for count in kiln.static_range(1, pages):
            if num_valid_pages == count:
                self.tma_copy_k(k_map, slots, bars, bar_index, column=column, elect=elect,
                                needs_partial=False, first_slot=first_slot, num_iters=count,
                                eviction_policy=eviction_policy)
        if num_valid_pages >= pages:
            self.tma_copy_k(k_map, slots, bars, bar_index, column=column, elect=elect,
                            needs_partial=False, first_slot=first_slot,
                            eviction_policy=eviction_policy)
        return
    # The peer of a pair copies the second half: later entries, or the same single page
    # BN/2 rows further on.
    peer = self.pair_cta and not self.is_leader
    entry_shift = self.num_pages // 2 if peer and self.num_pages >= 2 else 0
    row_shift = self.BN // 2 if peer and self.num_pages == 1 else 0
    for p in kiln.static_range(pages if num_iters is None else num_iters):
        tma.load(k_map, slots.tile(first_slot + p),
                 (column, self.row(entry_shift + p) + row_shift), bars, bar_index,
                 predicate=elect, eviction_policy=eviction_policy)


def _tma_copy_v(self, v_map, slots, bars, bar_index, *, column, elect, needs_partial,
                num_v_sub_tiles=1, v_sub_tile_idx=0, num_valid_pages=None,
                oob_fill_pages=False, first_slot=0, num_iters=None, eviction_policy=None):
    """Copy V sub-tile ``v_sub_tile_idx`` of ``num_v_sub_tiles`` (each ``BN / num_v_sub_tiles``
    rows) into ``slots.tile(first_slot + p)``, one copy per page of ``v_tile_rows(n)`` rows.

    ``needs_partial=True`` copies the first ``num_valid_pages`` (traced, 1..pages per sub-tile)
    pages; with ``oob_fill_pages`` the remaining slots get out-of-bounds (zero) boxes too, so
    the barrier must expect the full sub-tile's bytes.
    """
    sub_rows = self.BN // num_v_sub_tiles
    tile_rows = self.v_tile_rows(num_v_sub_tiles)
    pages = sub_rows // tile_rows
    _check_box(v_map, tile_rows, "V")
    if needs_partial:
        for count in kiln.static_range(1, pages):
            if num_valid_pages == count:
                self.tma_copy_v(v_map, slots, bars, bar_index, column=column, elect=elect,
                                needs_partial=False, num_v_sub_tiles=num_v_sub_tiles,
                                v_sub_tile_idx=v_sub_tile_idx, first_slot=first_slot,
                                num_iters=count, eviction_policy=eviction_policy)
                if oob_fill_pages:
                    for p in kiln.static_range(count, pages):
                        tma.load(v_map, slots.tile(first_slot + p), (column, OOB_ROW), bars,
                                 bar_index, predicate=elect, eviction_policy=eviction_policy)
        if num_valid_pages >= pages:
            self.tma_copy_v(v_map, slots, bars, bar_index, column=column, elect=elect,
                            needs_partial=False, num_v_sub_tiles=num_v_sub_tiles,
                            v_sub_tile_idx=v_sub_tile_idx, first_slot=first_slot,
                            eviction_policy=eviction_policy)
        return
    for p in kiln.static_range(pages if num_iters is None else num_iters):
        # The copy's first logical row, resolved to its own page: a sub-tile smaller than a
        # page steps through that page, never past it into the next entry's physical page.
        row = self.get_row(v_sub_tile_idx * sub_rows + p * tile_rows)
        tma.load(v_map, slots.tile(first_slot + p), (column, row), bars, bar_index,
                 predicate=elect, eviction_policy=eviction_policy)
