"""The steps the gfx950 prefill kernels share (bf16/f16 :mod:`.prefill_gfx950`, FP8
:mod:`.prefill_gfx950_fp8`): the key range a block visits, the mask and lazy-rescale vote, the
DMA drains and one main-loop iteration (clusters C0-C7). Each kernel supplies its own operand
steps -- DMA, LDS -> register loads, QK, PV + partial softmax -- and keeps the prologue, the
``kiln.range`` loop and the epilogue in its kernel body (the loop must sit in the rewritten
kernel function).

Example (inside a kernel factory)::

    mask_and_vote = make_mask_and_vote(config, block_kv=64, key_frags=2,
                                       key_of_value=[...], lane_key_shift=4)
    iteration, drain_dma = make_iteration(recipes, (dma_k, dma_v), steps)
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import kiln
from kiln import amd_asm
from kiln.tiles import RegTile, TileVector

from .softcap import soft_cap

RESCALE_THRESHOLD = 8.0
EPILOGUE_TILES = 4  # the epilogue drains four tiles
# At least one main-loop iteration: a loop LLVM sees run at least once has no zero-trip path,
# whose structurized flow block would keep the prologue's P and K registers live across it.
MIN_TILES = EPILOGUE_TILES + 2
KEY_BLOCK = 32  # keys per 32x32 score fragment


def key_range(config, block_kv, block_q0, sq, sk, window_left, window_right, chunk):
    """The keys any row of the block may see, as tiles: ``first_pos`` / ``last_pos`` (the
    block's first and last query positions aligned to the keys), ``tile_lo`` and ``n_tiles``
    (even, at least ``MIN_TILES``; the padding tiles are fully masked)."""
    first_pos = block_q0 + sk - sq
    last_pos = kiln.minimum(block_q0 + config.block_q, sq) - 1 + sk - sq
    key_lo, key_hi = 0, sk
    if config.causal:
        key_hi = kiln.minimum(key_hi, last_pos + 1)
    if config.window:
        key_lo = kiln.where(window_left >= 0, kiln.maximum(first_pos - window_left, 0), 0)
        key_hi = kiln.where(window_right >= 0,
                            kiln.minimum(key_hi, last_pos + window_right + 1), key_hi)
    if config.chunk:
        key_lo = kiln.maximum(key_lo, (kiln.maximum(first_pos, 0) // chunk) * chunk)
        key_hi = kiln.minimum(key_hi, (kiln.maximum(last_pos, 0) // chunk + 1) * chunk)
    tile_lo = key_lo // block_kv
    tiles = kiln.maximum((key_hi + block_kv - 1) // block_kv - tile_lo, 0)
    n_tiles = kiln.maximum(tiles + tiles % 2, MIN_TILES)
    return SimpleNamespace(first_pos=first_pos, last_pos=last_pos, tile_lo=tile_lo,
                           n_tiles=n_tiles)


def make_mask_and_vote(config, *, block_kv, key_frags, key_of_value, lane_key_shift):
    """``mask_and_vote(sm, s, tile, geo, masked)`` for score tiles of ``key_frags`` 32x32
    accumulators whose value ``v`` in lane ``l`` holds key ``key_of_value[v] +
    lane_key_shift * (l // 32)`` of its 32-key block."""
    CAUSAL, WINDOW, CHUNK = config.causal, config.window, config.chunk  # noqa: N806

    def mask_scores(s, tile, geo):
        """-inf where a key is past the sequence or hidden by the mask (``geo.q_pos``: this
        lane's query position aligned to the keys, bottom-right). The visible keys of a row
        are one interval; it is computed per lane relative to the fragment's first key, and
        compared with the constant key offsets: two compares per score and no per-value
        vector that LLVM could hoist out of the loop (and keep live across it)."""
        q_pos, frags = geo.q_pos, []
        offsets = kiln.vector_constant(key_of_value, kiln.i32)
        for f in range(key_frags):
            base = (geo.tile_lo + tile) * block_kv + f * KEY_BLOCK \
                + lane_key_shift * (geo.lane // 32)
            lo, hi = -base, geo.sk - 1 - base
            if CAUSAL:
                hi = kiln.minimum(hi, q_pos - base)
            if WINDOW:
                lo = kiln.where(geo.window_left < 0, lo,
                                kiln.maximum(lo, q_pos - geo.window_left - base))
                hi = kiln.where(geo.window_right < 0, hi,
                                kiln.minimum(hi, q_pos + geo.window_right - base))
            if CHUNK:
                start = (kiln.maximum(q_pos, 0) // geo.chunk) * geo.chunk
                lo = kiln.maximum(lo, start - base)
                hi = kiln.where(q_pos < 0, -1 - block_kv,
                                kiln.minimum(hi, start + geo.chunk - 1 - base))
            visible = (offsets >= lo) & (offsets <= hi)
            frags.append(kiln.where(visible, s.fragment(f, 0), -math.inf))
        return RegTile(frags, s.layout, s.grid)

    def is_boundary(tile, geo):
        """Wave-uniform: some key of ``tile`` is past ``Sk`` or hidden from some row of the
        block, so the tile needs :func:`mask_scores`; interior tiles skip it."""
        first = (geo.tile_lo + tile) * block_kv
        last = first + block_kv - 1
        boundary = last >= geo.sk
        if CAUSAL:
            boundary = boundary | (last > geo.first_pos)
        if WINDOW:
            boundary = boundary | ((geo.window_left >= 0)
                                   & (first < geo.last_pos - geo.window_left))
            boundary = boundary | ((geo.window_right >= 0)
                                   & (last > geo.first_pos + geo.window_right))
        if CHUNK:
            chunk_of_block = geo.first_pos // geo.chunk
            boundary = boundary | (geo.first_pos < 0) \
                | (geo.last_pos // geo.chunk != chunk_of_block) \
                | (first // geo.chunk != chunk_of_block) | (last // geo.chunk != chunk_of_block)
        return boundary

    @kiln.func
    def mask_boundary_tile(s, tile, geo):
        if is_boundary(tile, geo):  # a scalar branch: interior tiles skip the mask's VALU
            s = mask_scores(s, tile, geo)
        return s

    def mask_and_vote(sm, s, tile, geo, masked):
        """Mask (``masked``: always, else on boundary tiles only), running max and the
        lazy-rescale vote of ``s``; returns ``s``. Fired (some row's max grew by more than
        the threshold): ``scale_vec`` = exp2(prev - max), prev = max. Skipped: max rolls back
        to prev (so P stays below 2**8) and ``scale_vec`` = 1, which makes the rescales of
        ``o`` and ``norm`` identities. The vote selects rather than branches: LLVM's
        MachineSink moves pure work past a branch towards its uses, out of its cluster.
        With a softcap the scores are capped first (log2 units, ``geo.scale_log2`` is 1)."""
        if config.softcap:
            s = RegTile([soft_cap(s.fragment(f, 0), *geo.cap) for f in range(key_frags)],
                        s.layout, s.grid)
        s = mask_scores(s, tile, geo) if masked else mask_boundary_tile(s, tile, geo)
        sm.col_max_acc_scaled(s, geo.scale_log2)
        fired = kiln.shuffle.any_lane((sm.max_vec - sm.max_vec_prev).any_greater(
            RESCALE_THRESHOLD))
        sm.max_vec = TileVector([[kiln.where(fired, m, prev) for m, prev in zip(*lines)]
                                 for lines in zip(sm.max_vec.values, sm.max_vec_prev.values)],
                                sm.max_vec.group_of, sm.max_vec.axis)
        sm.scale_vec = (sm.max_vec_prev - sm.max_vec).map(kiln.exp2)  # 1 when skipped
        sm.max_vec_prev = sm.max_vec
        return s

    return mask_and_vote


def make_iteration(recipes, dmas_per_tile, steps):
    """``(iteration, drain_dma)``: clusters C0-C7 of the main loop (the kernels' schedule
    table) over the kernel's ``steps`` -- ``qk(k_reg, geo)``, ``dma_tile(src, lds, tile, geo,
    is_k)``, ``load_v(lds)``, ``load_k(lds)``, ``mask_and_vote(...)`` and
    ``pv_and_partial(o, p, v_frags, sm, s, geo, o_scale)`` -- and the DMA drain."""
    dma_k, dma_v = dmas_per_tile

    def drain_dma(outstanding):
        """Before the cluster's barrier: all but the ``outstanding`` youngest tile DMAs done
        (the youngest is always a V tile, the one before it a K tile)."""
        amd_asm.s_waitcnt(vmcnt=(0, dma_v, dma_v + dma_k)[outstanding])

    def iteration(ids, j, state, geo, last, masked):
        """C0-C7 (cluster numbers ``ids``) for ``j``; ``last``: the epilogue's E0-E7, which
        DMA no K[j+1]; ``masked``: mask every tile (else boundary tiles only)."""
        sm, o, k_reg, p, o_scale = state
        bufs = geo.bufs
        for half in kiln.static_range(2):
            t = j - 2 + half  # the tile whose QK this half runs; j is odd: t % 2 == 1 - half
            base = 4 * half
            same, other = (half + 1) % 2, half % 2  # LDS slots of tiles t (and t + 2), t +- 1
            with kiln.cluster(ids[base + 0], recipes[ids[base + 0]]):
                s = steps.qk(k_reg, geo)
                drain_dma(2)  # V[t-1] landed (read next)
            with kiln.cluster(ids[base + 1], recipes[ids[base + 1]]):
                if not (last and half == 1):
                    steps.dma_tile(bufs.k, bufs.k_lds[same], t + 2, geo, True)
                v_frags = steps.load_v(bufs.v_lds[other])  # V[t-1]
                s = steps.mask_and_vote(sm, s, t, geo, masked)
                scale_t = sm.scale_vec  # o's rescale for tile t, due before PV[t]
            with kiln.cluster(ids[base + 2], recipes[ids[base + 2]]):
                o, p = steps.pv_and_partial(o, p, v_frags, sm, s, geo, o_scale)
                o_scale = scale_t
                drain_dma(1 if last and half == 1 else 2)  # K[t+1] landed (read next)
            with kiln.cluster(ids[base + 3], recipes[ids[base + 3]]):
                steps.dma_tile(bufs.v, bufs.v_lds[other], t + 1, geo, False)  # V[t+1]
                k_reg = steps.load_k(bufs.k_lds[other])  # K[t+1]
        return sm, o, k_reg, p, o_scale

    return iteration, drain_dma
