"""Stream-K for the Hopper GEMM (``HopperGemmConfig(stream_k=True)``): equal K work per CTA.

A persistent grid of ``G`` CTAs over ``T`` output tiles of ``K`` steps each runs whole tiles
("data-parallel") while every CTA has one, and shares the rest out by K steps:

| tiles | data-parallel tiles | stream-K tiles |
| --- | --- | --- |
| ``T <= G`` | none | all ``T``: the GPU is filled by splitting K |
| ``T % G == 0`` | all | none |
| otherwise | the first ``(T // G - 1) * G`` | the last ``G + T % G`` (one wave and the remainder) |

The stream-K tiles' ``S = tiles * K`` steps are cut into ``G`` equal ranges, CTA ``c`` taking
``[c * S // G, (c + 1) * S // G)``: a run of whole tiles with a partial tile at either end.
A tile run by one CTA from its first to its last step is stored directly; the pieces of a
split tile are fixed up through an f32 workspace like split-K's ``fused_reduce``
(:func:`.epilogue.finish_fused`): each piece's CTA publishes its partial, draws a ticket of
the tile, and the last to arrive sums the pieces in CTA order (bitwise reproducible).

A CTA publishes at most two pieces (the tiles its range starts and ends in), so the workspace
has ``2 * G`` slots per consumer warp group: slot ``2 c`` for the piece of the tile where
``c``'s range starts, ``2 c + 1`` for the piece where it ends. The piece of tile ``t`` from
CTA ``c`` is in slot ``2 c`` unless ``c``'s range started in an earlier tile. The host grid
has ``G <= S`` so every CTA has at least one step. Example::

    matmul_config(a, b, HopperGemmConfig(stream_k=True))   # 4096^3: 3.9 waves -> 1 + SK
"""

import kiln
from kiln import nvidia_asm, wgmma

from .epilogue import WARP_GROUP_THREADS, add_partial, publish_partial, store_tile, \
    store_transposed

SLOTS_PER_CTA = 2  # pieces a CTA may publish: where its range starts and where it ends


def stream_k_tiles(tiles: int, ctas: int) -> int:
    """How many of ``tiles`` output tiles a grid of ``ctas`` shares out by K steps (the rest
    run whole, data-parallel): the host's mirror of :func:`schedule`."""
    if tiles % ctas == 0:
        return 0
    return tiles if tiles < ctas else ctas + tiles % ctas


def grid_size(tiles: int, k_steps: int, sms: int) -> int:
    """One CTA per SM, at most one per K step of the work (every CTA gets a step)."""
    return max(1, min(sms, tiles * k_steps))


@kiln.func
def schedule(tiles, k_tiles):
    """This CTA's work: ``(units, dp_tiles, n_dp, steps, start, end, first)`` -- how many work
    units it runs (its data-parallel tiles ``cta, cta + G, ..`` below ``dp_tiles``, ``n_dp`` of
    them, then the stream-K tiles its range ``[start, end)`` of the ``steps`` stream-K steps
    touches, ``first`` the first of them, counted from ``dp_tiles``)."""
    cta = kiln.block_id(0)
    ctas = kiln.num_blocks(0)
    rem = tiles % ctas
    dp_tiles = kiln.where(rem == 0, tiles, kiln.maximum(tiles // ctas - 1, 0) * ctas)
    steps = (tiles - dp_tiles) * k_tiles
    start = cta * steps // ctas
    end = (cta + 1) * steps // ctas
    n_dp = (dp_tiles - cta + ctas - 1) // ctas
    first = start // k_tiles
    stop = kiln.where(end > start, (end - 1) // k_tiles + 1, first)
    return n_dp + stop - first, dp_tiles, n_dp, steps, start, end, first


@kiln.func
def unit(u, k_tiles, dp_tiles, n_dp, start, end, first):
    """Work unit ``u`` of this CTA: ``(tile, k_first, k_end, sk_tile)``, ``sk_tile`` the
    tile's index among the stream-K tiles (negative for a data-parallel tile)."""
    cta = kiln.block_id(0)
    ctas = kiln.num_blocks(0)
    dp = u < n_dp
    sk_tile = kiln.where(dp, -1, first + u - n_dp)
    tile = kiln.where(dp, cta + u * ctas, dp_tiles + sk_tile)
    origin = sk_tile * k_tiles
    k_first = kiln.where(dp, 0, kiln.maximum(start, origin) - origin)
    k_end = kiln.where(dp, k_tiles, kiln.minimum(end, origin + k_tiles) - origin)
    return tile, k_first, k_end, sk_tile


@kiln.func
def finish(acc, c_map, c_tiles, work, tickets, c_out, owners, consumer, row0, col0, sk_tile,
           k_first, k_end, k_tiles, steps, start, m, n, first_thread, rounds, tiles_per_round,
           tile_cols, SWAP, CONSUMERS):
    """Store one consumer's part of a work unit: directly when the unit is a whole tile, else
    publish it (its slot: see the module docs), take a ticket of (``sk_tile``, consumer) and,
    if last of the tile's pieces, sum them in CTA order and store the tile. ``steps`` and
    ``start`` are those of :func:`schedule`."""
    lane = kiln.thread_id(0) % WARP_GROUP_THREADS
    part = 64 * acc.shape[1]  # floats of one slot
    ctas = kiln.num_blocks(0)
    origin = sk_tile * k_tiles
    split = (k_first > 0) | (k_end < k_tiles)
    # CTAs whose ranges hold the tile's first and last steps: the pieces, in order (steps
    # is 0 when every tile is data-parallel: nothing is split then)
    first_cta = ((origin + 1) * ctas - 1) // kiln.maximum(steps, 1)
    pieces = ((origin + k_tiles) * ctas - 1) // kiln.maximum(steps, 1) - first_cta + 1
    if split:
        own = 2 * kiln.block_id(0) + kiln.where(origin > start, 1, 0)
        publish_partial(acc, work, (own * CONSUMERS + consumer) * part + lane, row0, col0, m, n)
        nvidia_asm.named_barrier(1 + consumer, WARP_GROUP_THREADS)
    if first_thread:
        owner = kiln.cast(1, kiln.i32)
        if split:
            kiln.fence("gpu")  # this piece's stores (seen through the barrier), then the ticket
            ticket = tickets.atomic_add(sk_tile * CONSUMERS + consumer, 1)
            last = ticket % kiln.cast(pieces, kiln.i64) == kiln.cast(pieces - 1, kiln.i64)
            if last:
                kiln.fence("gpu")  # acquire: the other pieces published before their tickets
            owner = kiln.cast(last, kiln.i32)
        owners[consumer] = owner
    nvidia_asm.named_barrier(1 + consumer, WARP_GROUP_THREADS)
    if owners[consumer] == 1:
        total = acc
        if split:
            total = wgmma.fragment_zeros(acc.shape[1])
            for p in kiln.range(0, pieces):
                cta = first_cta + p
                # only the first piece's CTA may have started in an earlier tile
                later = (p == 0) & (cta * steps // ctas < origin)
                slot = 2 * cta + kiln.where(later, 1, 0)
                total = add_partial(total, work, (slot * CONSUMERS + consumer) * part + lane,
                                    row0, col0, m, n, acc.shape[1] // 2)
        if SWAP:
            store_transposed(total, c_out, row0, col0, m, n)
        else:
            store_tile(total, c_map, c_tiles, consumer, row0, col0, first_thread, rounds,
                       tiles_per_round, tile_cols)
