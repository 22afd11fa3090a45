"""Epilogues of the Hopper GEMM (:mod:`.hopper`): the TMA store of a tile, and the in-kernel
reduction of f32 partials (split-K's ``fused_reduce``; stream-K's fix-up in :mod:`.streamk`
reuses :func:`publish_partial`, :func:`add_partial` and :func:`store_transposed`).

Every helper runs in one consumer warp group holding a ``64 x BN`` WGMMA accumulator.
"""

import kiln
from kiln import nvidia_asm, tma, wgmma

WARP_GROUP_THREADS = 128


@kiln.func
def store_tile(acc, c_map, c_tiles, consumer, row0, col0, first_thread, rounds,
               tiles_per_round, tile_cols):
    """Epilogue of one consumer: stage ``acc`` in swizzled shared tiles and TMA-store them,
    ``rounds`` slices of columns in turn (TMA clips rows and columns outside C). The stores run
    on while the warp group starts its next tile; only the next reuse of the staging tiles
    waits for them to have been read."""
    columns = tiles_per_round * tile_cols
    for r in kiln.static_range(rounds):
        if first_thread:
            tma.wait_group(0, read=True)
        nvidia_asm.named_barrier(1 + consumer, WARP_GROUP_THREADS)
        wgmma.store_fragment_swizzled(acc, c_tiles, consumer * tiles_per_round,
                                      columns=(r * columns, (r + 1) * columns))
        nvidia_asm.fence_proxy_async()  # generic-proxy writes before the async-proxy TMA read
        nvidia_asm.named_barrier(1 + consumer, WARP_GROUP_THREADS)
        if first_thread:
            for j in kiln.static_range(tiles_per_round):
                tma.store(c_tiles.tile(consumer * tiles_per_round + j), c_map,
                          (col0 + r * columns + j * tile_cols, row0))
            tma.commit_group()


@kiln.func
def finish_fused(acc, c_map, c_tiles, work, tickets, c_out, owners, consumer, row0, col0,
                 slot, piece, slices, m, n, first_thread, rounds, tiles_per_round, tile_cols,
                 SWAP):
    """In-kernel split-K reduction of one consumer's 64-row part of a work unit (the CUTLASS
    split-K semaphore pattern): store ``acc`` to its slice's slot of ``work`` (register ``j``
    of thread ``t`` at ``j * 128 + t``: every store instruction writes 512 contiguous bytes);
    barrier, then one thread fences (gpu scope) and draws a ticket for the (tile, consumer)
    ``slot``. Tickets only grow (each launch adds ``slices``), so ``ticket % slices`` is the
    arrival order; the last to arrive fences again (acquire) and its warp group sums the
    slices' slots in slice order (bitwise reproducible whoever arrives last) into ``C``: a
    TMA store, or with ``SWAP`` (``acc`` holds C.T) masked stores of ``c_out`` transposed."""
    n_half = acc.shape[1] // 2
    lane = kiln.thread_id(0) % WARP_GROUP_THREADS
    part = 64 * acc.shape[1]  # floats of one slot
    publish_partial(acc, work, (slot * slices + piece) * part + lane, row0, col0, m, n)
    nvidia_asm.named_barrier(1 + consumer, WARP_GROUP_THREADS)
    if first_thread:
        kiln.fence("gpu")  # this slice's stores (seen through the barrier), then the ticket
        ticket = tickets.atomic_add(slot, 1)
        last = ticket % kiln.cast(slices, kiln.i64) == kiln.cast(slices - 1, kiln.i64)
        if last:
            kiln.fence("gpu")  # acquire: the other slices published before their tickets
        owners[consumer] = kiln.cast(last, kiln.i32)
    nvidia_asm.named_barrier(1 + consumer, WARP_GROUP_THREADS)
    if owners[consumer] == 1:
        total = wgmma.fragment_zeros(acc.shape[1])
        for s in kiln.range(0, slices):
            total = add_partial(total, work, (slot * slices + s) * part + lane, row0, col0, m,
                                n, n_half)
        if SWAP:
            store_transposed(total, c_out, row0, col0, m, n)
        else:
            store_tile(total, c_map, c_tiles, consumer, row0, col0, first_thread, rounds,
                       tiles_per_round, tile_cols)


@kiln.func
def publish_partial(acc, work, base, row0, col0, m, n):
    """``work[base + j * 128] = acc.element(j)`` for every register ``j`` of this thread whose
    element lies inside the ``m x n`` problem: at decode sizes most of a swap-AB tile's
    columns (or a 64-row tile's rows) are padding, and are neither written nor read."""
    for j in kiln.static_range(acc.shape[1] // 2):
        if inside(j, row0, col0, m, n):
            work.store(base + j * WARP_GROUP_THREADS, acc.element(j))


def add_partial(total, work, base, row0, col0, m, n, n_half):
    """``total`` plus the slot written by :func:`publish_partial` at ``base`` (zeros where
    it wrote nothing)."""
    return wgmma.fragment_from_elements([
        total.element(j) + work.load(base + j * WARP_GROUP_THREADS,
                                     mask=inside(j, row0, col0, m, n), other=0.0)
        for j in range(n_half)])


def inside(e, row0, col0, m, n):
    """Whether register ``e`` of this thread, in the 64-row tile at (``row0``, ``col0``), is
    an element of the ``m x n`` result (layout: :func:`store_transposed`)."""
    lane = kiln.thread_id(0) % WARP_GROUP_THREADS
    row = row0 + 16 * (lane // 32) + (lane % 32) // 4 + 8 * ((e // 2) % 2)
    col = col0 + 8 * (e // 4) + 2 * (lane % 4) + e % 2
    return (row < m) & (col < n)


@kiln.func
def store_transposed(total, c_out, row0, col0, m, n):
    """``c_out[col, row] = total[row, col]`` for the tile at (``row0``, ``col0``) of C.T (an
    ``m x n`` problem), inside C only. Register ``e`` of lane ``l`` holds row
    ``16 * (l // 32) + (l % 32) // 4 + 8 * ((e // 2) % 2)``, column
    ``8 * (e // 4) + 2 * (l % 4) + e % 2`` (:func:`kiln.layout.wgmma_m64_accumulator`)."""
    lane = kiln.thread_id(0) % WARP_GROUP_THREADS
    row_base = row0 + 16 * (lane // 32) + (lane % 32) // 4
    col_base = col0 + 2 * (lane % 4)
    for e in kiln.static_range(total.shape[1] // 2):
        row = row_base + 8 * ((e // 2) % 2)
        col = col_base + 8 * (e // 4) + e % 2
        if (row < m) & (col < n):
            c_out.store(col, row, kiln.cast(total.element(e), c_out.dtype))
