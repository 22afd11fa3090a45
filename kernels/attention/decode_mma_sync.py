"""The ``mma.sync`` consumer of the paged decode kernel (``DecodeConfig(consumer="mma_sync")``,
the default below ``WGMMA_MIN_ROWS`` packed rows): the warps of each warp group split every
tile's keys, each keeping its own ``(m, l, O)`` in registers (``mma.sync`` m16n8k16, K and V
fragments by ``ldmatrix`` from the ring), and merge them through shared memory at the end.
The interface :func:`~kiln.kernels.attention.decode_kernel.make_kernel` calls is ``LAG``,
:func:`start`, :func:`step`, :func:`drain` and :func:`store`."""

from __future__ import annotations

import math

import kiln
from kiln import ldmatrix

from .decode_config import LAZY_RESCALE_THRESHOLD
from .decode_rows import advance_row_max, interleaved_columns, row_weights, store_row_lse

LAG = 0  # a tile's ring stage is released in its own iteration
# ldmatrix blocks (row, col offsets of 8x8 blocks) of two B fragments at once:
# K stored key x depth (non-transposed): keys n0.. then n0+8.., each 16 deep.
K_PAIR_BLOCKS = ((0, 0), (0, 8), (8, 0), (8, 8))
# V stored key x depth, read transposed: depth columns n0.. then n0+8.., each 16 keys deep.
V_PAIR_BLOCKS = ((0, 0), (8, 0), (0, 8), (8, 8))


def start(m, l, ring, kv_s, shape):
    """The loop-carried ``(o, m, l)`` (O zeroed: ``[m tile][n8 column block]`` accumulators)
    and the ring as the ``ldmatrix`` tile :func:`step` reads."""
    o = [[kiln.vector_constant([0.0] * 4, kiln.f32) for _ in range(shape.head_dim // 8)]
         for _ in range(shape.m_tiles)]
    return (o, m, l), kv_s


@kiln.func
def step(state, kv_s, it, stage, key0, q_frags, key_limit, seq_len, seq_q, scale_log2, tid,
         lane, key_slice, slots, empty, shape):
    """Tile ``it`` (ring ``stage``, first key ``key0``): this warp's key slice attended, masked
    only where a key of the tile may be past a row's last, then the stage released."""
    o, m, l = state
    config = shape.config
    kv_row = stage * 2 * config.block_n + key_slice * shape.keys
    first_key = key0 + key_slice * shape.keys
    if key0 + config.block_n <= seq_len - seq_q + 1:  # no key of the tile is masked
        m, l, o = _attend(kv_s, q_frags, kv_row, first_key, lane, key_limit,
                          seq_len, scale_log2, m, l, o, shape, False)
    else:
        m, l, o = _attend(kv_s, q_frags, kv_row, first_key, lane, key_limit,
                          seq_len, scale_log2, m, l, o, shape, True)
    empty.arrive(stage)
    return o, m, l


def drain(state, kv_s, num_tiles, empty, shape):
    """Nothing is in flight after the loop: ``(o, m, l)`` as they are."""
    return state


def store(ring, m, l, o, sinks, block_table, o_part, lse_part, counts, split, b, q_first,
          kv_head, row0, warp_row0, key_slice, tid, lane, seq_len, seq_q, tiles_per_split,
          shape, block_sparse, has_sinks):
    """Every warp's ``(m, l, O)`` through shared memory (the ring, reused as f32 once every
    warp's last ``ldmatrix`` is done), then each row's merged partial into O_partial and
    LSE_partial (:func:`_merge_and_store`)."""
    kiln.barrier()  # every warp's last ldmatrix is done: the ring becomes merge scratch
    scratch = ring.reinterpret((shape.merge_floats,), kiln.f32)
    _write_warp_state(scratch, m, l, o, key_slice, warp_row0, lane, shape)
    kiln.barrier()
    _merge_and_store(scratch, sinks, block_table, o_part, lse_part, counts, split, b,
                     q_first, kv_head, row0, tid, seq_len, seq_q, tiles_per_split,
                     shape, block_sparse, has_sinks)


@kiln.func
def _attend(kv_s, q_frags, kv_row, first_key, lane, key_limit, seq_len, scale_log2, m, l,
            o, shape, masked):
    """One tile's slice of this warp (``shape.keys`` keys from ring row ``kv_row``, the
    first being key ``first_key``): S = Q K^T, masked streaming softmax, O += P V. ``masked``
    (Python bool): apply the causal/length mask and zero V rows past the sequence."""
    D, MT = shape.head_dim, shape.m_tiles
    keys = shape.keys
    BN = shape.config.block_n
    atom = kiln.mma.atom(16, 8, 16, kiln.bf16)
    o = [list(row) for row in o]  # a fresh list: both branches of the caller's if trace this
    s = [[kiln.vector_constant([0.0] * 4, kiln.f32) for _ in range(keys // 8)]
         for _ in range(MT)]
    for kk in kiln.static_range(D // 16):
        k_frags = []
        for jj in kiln.static_range(keys // 16):
            pair = ldmatrix.ldmatrix(kv_s, (kv_row + 16 * jj, 16 * kk), K_PAIR_BLOCKS)
            k_frags += [kiln.vector_slice(pair, 0, 4), kiln.vector_slice(pair, 4, 4)]
        for i in kiln.static_range(MT):
            a = q_frags.fragment(i, kk)
            for j in kiln.static_range(keys // 8):
                s[i][j] = atom(a, k_frags[j], s[i][j])

    # Accumulator element e of key atom j: key first_key + 8j + 2(lane % 4) + e % 2, row half
    # e // 2 (rows lane // 4 and lane // 4 + 8). State index 2i + half: m tile i, row half.
    col = first_key + 2 * (lane % 4)
    raw, lane_max = [], []
    for i in kiln.static_range(MT):
        limits = kiln.pack([key_limit[2 * i], key_limit[2 * i],
                            key_limit[2 * i + 1], key_limit[2 * i + 1]])
        raw.append([])
        for j in kiln.static_range(keys // 8):
            x = s[i][j]
            if masked:
                key = kiln.pack([col + 8 * j, col + 8 * j + 1, col + 8 * j, col + 8 * j + 1])
                x = kiln.where(key <= limits, x, -math.inf)
            raw[i].append(x)
        for half in kiln.static_range(2):
            top = kiln.unpack(raw[i][0])[2 * half]
            for x in raw[i]:
                parts = kiln.unpack(x)
                top = kiln.maximum(top, kiln.maximum(parts[2 * half], parts[2 * half + 1]))
            lane_max.append(top * scale_log2)  # the scale is positive: max commutes with it
    if shape.config.lazy_rescale:
        # The row maxima are reduced, and O and l rescaled, only when a score of the warp
        # passed its row's max by LAZY_RESCALE_THRESHOLD: otherwise P = 2^(x - stale max)
        # stays below 2^threshold and the tile costs no shuffle and no O multiply.
        grew = lane_max[0] > m[0] + LAZY_RESCALE_THRESHOLD
        for k in range(1, 2 * MT):
            grew = grew | (lane_max[k] > m[k] + LAZY_RESCALE_THRESHOLD)
        if kiln.shuffle.any_lane(grew):
            m, l, o = _rescale_to_tile_max(m, l, o, lane_max)
    else:
        m, l, o = _rescale_to_tile_max(m, l, o, lane_max)
    # A row with no key yet keeps m = -inf; shifting by 0 instead avoids inf - inf.
    shifts = [kiln.where(x == -math.inf, 0.0, x) for x in m]
    new_l, p16 = [], []
    for i in kiln.static_range(MT):
        shift = kiln.pack([-shifts[2 * i], -shifts[2 * i], -shifts[2 * i + 1],
                           -shifts[2 * i + 1]])
        probs = [kiln.exp2(kiln.fma(x, scale_log2, shift)) for x in raw[i]]
        for half in kiln.static_range(2):
            total = l[2 * i + half]
            for pj in probs:
                parts = kiln.unpack(pj)
                total = total + parts[2 * half] + parts[2 * half + 1]
            new_l.append(total)
        # Two n8 accumulators (keys 16k.., 16k+8..) are one k16 A fragment of P.
        p16.append([kiln.cast(kiln.pack(kiln.unpack(probs[2 * k]) + kiln.unpack(probs[2 * k + 1])),
                              kiln.bf16) for k in range(keys // 16)])

    for k in kiln.static_range(keys // 16):
        if masked:
            # B fragment element e of lane: key 16k + 2(lane % 4) + e % 2 + 8 (e // 2).
            base = first_key + 16 * k + 2 * (lane % 4)
            v_keys = kiln.pack([base, base + 1, base + 8, base + 9])
            v_live = v_keys < seq_len
        for nn in kiln.static_range(D // 16):
            pair = ldmatrix.ldmatrix(kv_s, (kv_row + BN + 16 * k, 16 * nn), V_PAIR_BLOCKS,
                                     trans=True)
            for half in kiln.static_range(2):
                v = kiln.vector_slice(pair, 4 * half, 4)
                if masked:
                    v = kiln.where(v_live, v, 0.0)
                for i in kiln.static_range(MT):
                    o[i][2 * nn + half] = atom(p16[i][k], v, o[i][2 * nn + half])
    return m, new_l, o


@kiln.func
def _rescale_to_tile_max(m, l, o, lane_max):
    """The mma.sync consumer's states moved to the maxima of a tile whose scaled scores each
    lane saw up to ``lane_max[2 i + half]``: every row's max reduced over its thread quad,
    and its ``l`` and O rows rescaled to it. Returns ``(m, l, o)``."""
    new_m, new_l, new_o = [], [], []
    for i in kiln.static_range(len(o)):
        alphas = []
        for half in kiln.static_range(2):
            m_next, _, alpha = advance_row_max(m[2 * i + half], lane_max[2 * i + half])
            new_m.append(m_next)
            new_l.append(l[2 * i + half] * alpha)
            alphas.append(alpha)
        scale_o = kiln.pack([alphas[0], alphas[0], alphas[1], alphas[1]])
        new_o.append([acc * scale_o for acc in o[i]])
    return new_m, new_l, new_o


@kiln.func
def _write_warp_state(scratch, m, l, o, key_slice, warp_row0, lane, shape):
    """This warp's unnormalised O rows and (m, l) into the merge scratch: CTA row ``r`` of key
    slice ``k`` at ``(k * rows + r) * merge_row``, the (m, l) pairs after all O rows."""
    rows, stride = shape.rows, shape.merge_row
    ml_base = shape.group_warps * rows * stride
    for i in kiln.static_range(shape.m_tiles):
        for half in kiln.static_range(2):
            if shape.warp_groups == 1 and 16 * i + 8 * half >= shape.packed:
                continue  # only padding rows, which the merge skips
            r = key_slice * rows + warp_row0 + 16 * i + lane // 4 + 8 * half
            for n in kiln.static_range(shape.head_dim // 8):
                scratch.store(r * stride + 8 * n + 2 * (lane % 4),
                              kiln.vector_slice(o[i][n], 2 * half, 2))
            if lane % 4 == 0:
                scratch[ml_base + 2 * r] = m[2 * i + half]
                scratch[ml_base + 2 * r + 1] = l[2 * i + half]


@kiln.func
def _merge_and_store(scratch, sinks, block_table, o_part, lse_part, counts, split, b, q_first,
                     kv_head, row0, tid, seq_len, seq_q, tiles_per_split, shape, block_sparse,
                     has_sinks):
    """Thread ``tid`` merges the states of one packed row's warps (one per key slice) over
    ``D / (threads / rows)`` columns and writes O_partial; the row's first thread writes LSE
    (and, on split 0, the split count).

    A row's threads take :func:`interleaved_columns`, so each store instruction writes whole
    32-byte sectors with 16-byte stores. Only rows that exist get threads (the m16 padding
    rows get none), so with 8 packed rows each row has 16 threads, not 8."""
    rows, stride, D = shape.rows, shape.merge_row, shape.head_dim
    slices = shape.group_warps  # warps holding parts of each row
    per_row = shape.combine_threads_per_row
    ml_base = slices * rows * stride
    r = tid // per_row
    columns = interleaved_columns(tid, per_row, D)
    row = row0 + r
    if (r < shape.combine_rows) & (row < shape.packed):
        q_index = q_first + row // shape.group
        head = kv_head * shape.group + row % shape.group
        ms = [scratch[ml_base + 2 * (w * rows + r)] for w in range(slices)]
        ls = [scratch[ml_base + 2 * (w * rows + r) + 1] for w in range(slices)]
        m_all, weights, total, inv = row_weights(ms, ls, sinks, head, split, has_sinks)
        for c in columns:
            acc = scratch.load((0 * rows + r) * stride + c, width=4, align=16) * weights[0]
            for w in kiln.static_range(1, slices):
                acc = kiln.fma(scratch.load((w * rows + r) * stride + c, width=4, align=16),
                               weights[w], acc)
            o_part.store(split, b, q_index, head, c, acc * inv, align=16)
        if tid % per_row == 0:
            store_row_lse(m_all, total, block_table, lse_part, counts, split, b, q_index,
                          head, kv_head, seq_len, seq_q, tiles_per_split, shape, block_sparse)

