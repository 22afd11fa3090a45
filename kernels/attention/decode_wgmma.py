"""The WGMMA consumer of the paged decode kernel (``DecodeConfig(consumer="wgmma")``, the
default from ``WGMMA_MIN_ROWS`` packed rows at D 128): one warp group serves 64 packed rows
with ``wgmma m64nNk16`` (Q from registers, K and V through shared-memory descriptors), every
key of a tile, O in its registers. Tile ``t``'s ``S = Q K^T`` and tile ``t - 1``'s ``P V``
are issued together and ``t``'s softmax runs while ``P V`` does, so a tile holds its ring
stage one iteration longer (``LAG = 1``); each thread quad stores its rows of ``O / l``
straight from the accumulator. The interface
:func:`~kiln.kernels.attention.decode_kernel.make_kernel` calls is ``LAG``, :func:`start`,
:func:`step`, :func:`drain` and :func:`store`."""

from __future__ import annotations

import math

import kiln
from kiln import nvidia_asm, wgmma

from .decode_config import HALF
from .decode_rows import advance_row_max, row_weights, store_row_lse

LAG = 1  # a tile's P V product is issued in the next iteration: it holds its stage that long
ZERO_ROWS_BARRIER = 1  # named barrier: V rows past the sequence zeroed before the PV product


def start(m, l, ring, kv_s, shape):
    """The loop-carried ``(o, m, l, probs, alphas)`` (O zeroed; the previous tile's P, the A
    operands of its P V product, and O's pending rescale) and stage 0's K and V descriptors."""
    config, D = shape.config, shape.head_dim
    o = wgmma.fragment_zeros(D)
    probs = kiln.RegTile.full(wgmma.a_fragment_layout(), (1, config.block_n // 16), 0.0,
                              kiln.bf16)
    alphas = [kiln.cast(1.0, kiln.f32) for _ in range(2)]
    # Stage 0's K (K-major) and V (MN-major: the leading byte offset steps from one
    # 64-column half to the next); stage s is s * tile_bytes further.
    descs = (wgmma.smem_descriptor(ring, leading_bytes=16, stride_bytes=1024),
             wgmma.smem_descriptor(ring, leading_bytes=config.block_n * HALF * 2,
                                   stride_bytes=1024,
                                   byte_offset=config.block_n * D * 2))
    return (o, m, l, probs, alphas), descs


@kiln.func
def step(state, descs, it, stage, key0, q_frags, key_limit, seq_len, seq_q, scale_log2, tid,
         lane, key_slice, slots, empty, shape):
    """Tile ``it`` (ring ``stage``, first key ``key0``): issue its S and the previous tile's
    P V, run its softmax (V rows past the sequence zeroed first in a tile that ends past
    it) while P V runs, then release the previous tile's stage."""
    o, m, l, probs, alphas = state
    config, S = shape.config, shape.config.stages
    # S of this tile and P V of the previous one go to the tensor cores together;
    # this tile's softmax runs while P V does. O is rescaled first: registers a
    # WGMMA reads must not be written while an earlier group is in flight (ptxas
    # would serialise every WGMMA).
    o = wgmma.scale_rows(o, alphas)
    scores = _issue_qk_wgmma(descs, q_frags, stage, shape)
    previous = (it + S - 1) % S
    if it > 0:
        o = _issue_pv_wgmma(descs, o, probs, previous, shape)
        wgmma.wait_group(1)
    else:
        wgmma.wait_group(0)
    if key0 + config.block_n <= seq_len - seq_q + 1:
        m, l, probs, alphas = tile_softmax(scores, m, l, key0, tid, key_limit,
                                           scale_log2, shape.config.block_n, False)
    else:
        _zero_rows_past_end(slots, stage, seq_len - key0, tid, shape)
        m, l, probs, alphas = tile_softmax(scores, m, l, key0, tid, key_limit,
                                           scale_log2, shape.config.block_n, True)
    wgmma.wait_group(0)  # on every path: ptxas then knows O is ready after it
    if it > 0:
        empty.arrive(previous, wgmma_pending=0)
    return o, m, l, probs, alphas


@kiln.func
def drain(state, descs, num_tiles, empty, shape):
    """The last tile's P V product after the loop; returns ``(o, m, l)``."""
    o, m, l, probs, alphas = state
    if num_tiles > 0:
        last_stage = (num_tiles - 1) % shape.config.stages
        o = _issue_pv_wgmma(descs, wgmma.scale_rows(o, alphas), probs, last_stage,
                            shape)
        wgmma.wait_group(0)
        empty.arrive(last_stage, wgmma_pending=0)
    return o, m, l


def store(ring, m, l, o, sinks, block_table, o_part, lse_part, counts, split, b, q_first,
          kv_head, row0, warp_row0, key_slice, tid, lane, seq_len, seq_q, tiles_per_split,
          shape, block_sparse, has_sinks):
    """Each row is one thread quad's: no merge between warps
    (:func:`_store_fragment_rows`)."""
    _store_fragment_rows(m, l, o, sinks, block_table, o_part, lse_part, counts, split,
                         b, q_first, kv_head, row0 + warp_row0, lane, seq_len, seq_q,
                         tiles_per_split, shape, block_sparse, has_sinks)


def _stage_descriptors(descs, stage, shape):
    """K and V descriptors of ring ``stage`` from stage 0's."""
    units = kiln.cast(stage * (shape.tile_bytes // 16), kiln.i64)
    return descs[0] + units, descs[1] + units


def _issue_qk_wgmma(descs, q_frags, stage, shape):
    """Issue ``S = Q K^T`` for ring ``stage`` as one WGMMA group (``consumer='wgmma'``:
    ``m64nBNk16``, Q's A fragments from registers, K K-major: a 16-deep step moves 32 bytes
    inside a 64-column half, every 4 steps the next half)."""
    BN, D = shape.config.block_n, shape.head_dim
    half_units = BN * HALF * 2 // 16  # one 64-column half of a tile, in descriptor units
    k, _ = _stage_descriptors(descs, stage, shape)
    scores = wgmma.fragment_zeros(BN)
    wgmma.fence()
    for kk in kiln.static_range(D // 16):
        scores = wgmma.mma_async(scores, q_frags.fragment(0, kk),
                                 k + (kk // 4) * half_units + (kk % 4) * 2, dtype=kiln.bf16,
                                 b_major="k")
    wgmma.commit()
    return scores


def _issue_pv_wgmma(descs, o, probs, stage, shape):
    """Issue ``O += P V`` for ring ``stage`` as one WGMMA group: P from registers (one A
    operand per 16 keys), V MN-major (16 keys further is 16 rows of 128 bytes; the
    descriptor's leading byte offset steps over the 64-column halves)."""
    _, v = _stage_descriptors(descs, stage, shape)
    wgmma.fence()  # orders O's rescale and P's registers before the asynchronous reads
    for kk in kiln.static_range(shape.config.block_n // 16):
        o = wgmma.mma_async(o, probs.fragment(0, kk), v + kk * 16 * HALF * 2 // 16,
                            dtype=kiln.bf16, b_major="mn")
    wgmma.commit()
    return o


@kiln.func
def tile_softmax(scores, m, l, key0, tid, key_limit, scale_log2, block_n: int, masked):
    """The streaming softmax of one tile's scores (a ``64 x block_n`` accumulator; each row
    is a thread quad's): new ``(m, l)`` (base 2; ``l`` per lane until the end), P as the bf16
    A operands of the P V product, and the factors O must be rescaled by before it.
    ``masked`` (Python bool): scores past each row's last key (``key_limit``) become -inf.
    Decode's WGMMA consumer and MLA's page loop both use it."""
    BN = block_n
    # Register i: row half (i // 2) % 2, key key0 + 8 (i // 4) + 2 (lane % 4) + i % 2.
    col = key0 + 2 * (tid % 4)
    x = []
    for i in kiln.static_range(BN // 2):
        xi = scores.element(i) * scale_log2
        if masked:
            xi = kiln.where(col + 8 * (i // 4) + i % 2 <= key_limit[(i // 2) % 2], xi,
                            -math.inf)
        x.append(xi)
    alphas, safes, new_m, new_l = [], [], [], []
    for half in kiln.static_range(2):
        mine = [x[i] for i in range(BN // 2) if (i // 2) % 2 == half]
        row_max = mine[0]
        for xi in mine[1:]:
            row_max = kiln.maximum(row_max, xi)
        m_next, m_safe, alpha = advance_row_max(m[half], row_max)
        alphas.append(alpha)
        safes.append(m_safe)
        new_m.append(m_next)
    probs = [kiln.exp2(x[i] - safes[(i // 2) % 2]) for i in range(BN // 2)]
    for half in kiln.static_range(2):
        total = l[half] * alphas[half]
        for i in kiln.static_range(BN // 2):
            if (i // 2) % 2 == half:
                total = total + probs[i]
        new_l.append(total)
    p = wgmma.a_fragment_from_accumulator(wgmma.fragment_from_elements(probs), kiln.bf16)
    return new_m, new_l, p, alphas


@kiln.func
def _zero_rows_past_end(slots, stage, valid_keys, tid, shape):
    """Zero the V rows of ring ``stage`` from key ``valid_keys`` of the tile on (keys past the
    sequence), 16 bytes a store, then make the writes visible to the tensor core's reads
    (async proxy) and to the whole warp group."""
    BN, eff = shape.config.block_n, shape.eff
    units = BN * shape.halves * HALF // 8  # 16-byte units of the tile's V
    zeros = kiln.vector_constant([0.0] * 8, kiln.bf16)
    for step in kiln.static_range(-(-units // shape.threads)):
        index = step * shape.threads + tid
        key = index // (HALF // 8) % BN
        half = index // (HALF // 8) // BN
        if (index < units) & (key >= valid_keys):
            slots.store(shape.first_slot(stage, 1, half) + key // eff, key % eff,
                        index % (HALF // 8) * 8, zeros, align=16)
    nvidia_asm.fence_proxy_async()
    nvidia_asm.named_barrier(ZERO_ROWS_BARRIER, shape.threads)


@kiln.func
def _store_fragment_rows(m, l, o, sinks, block_table, o_part, lse_part, counts, split, b,
                         q_first, kv_head, warp_row0, lane, seq_len, seq_q, tiles_per_split,
                         shape, block_sparse, has_sinks):
    """``consumer='wgmma'``: this thread's two rows of the warp group's O (packed rows
    ``warp_row0 + lane // 4`` and ``+ 8``; each row is one quad's), normalised, straight from
    the accumulator into O_partial: a quad's 8-byte stores fill 32-byte sectors. The quad's
    first lane writes LSE (and, on split 0, the split count)."""
    for half in kiln.static_range(2):
        row = warp_row0 + lane // 4 + 8 * half
        if row < shape.packed:
            q_index = q_first + row // shape.group
            head = kv_head * shape.group + row % shape.group
            m_all, weights, total, inv = row_weights([m[half]], [l[half]], sinks, head,
                                                     split, has_sinks)
            scale = weights[0] * inv
            for n in kiln.static_range(shape.head_dim // 8):
                pair = kiln.pack([o.element(4 * n + 2 * half), o.element(4 * n + 2 * half + 1)])
                o_part.store(split, b, q_index, head, 8 * n + 2 * (lane % 4), pair * scale,
                             align=8)
            if lane % 4 == 0:
                store_row_lse(m_all, total, block_table, lse_part, counts, split, b, q_index,
                              head, kv_head, seq_len, seq_q, tiles_per_split, shape,
                              block_sparse)

