"""gfx950 (CDNA4) attention prefill after the ``MhaPrefillV2`` design (compile-only here).

``O = softmax(scale * Q K^T + mask) V`` per (sequence, query head), bf16/f16 inputs, f32
accumulation, the conventions of ``kiln.kernels.attention.prefill`` (masks, sinks, GQA, ragged
batches, LSE; see ``tests/attention_reference.py``).

Head dims (:mod:`.prefill_gfx950_config`): Q/K and V each run on the next of 64 / 128 / 256
columns (any multiple of 8 up to 256, V's may differ from Q/K's); padding columns read zeros
and are not stored. ``softcap`` caps the scores first (:mod:`.softcap`; the softmax then runs
at a log2 scale of 1).

Work split: one block of 8 waves (4 when an operand is 256 wide: registers, below) per
(query head, ``32 * waves``-row Q block, sequence); wave ``w`` owns the 32-row Q stripe ``w``. Scores are computed transposed, ``S^T = K Q^T`` on
``v_mfma_f32_32x32x16``, so in the accumulator's ``col_l`` view a lane owns one query row and
the online-softmax state (``OnlineSoftmax``, ``q_axis="col"``) is one f32 per lane. PV is
``O^T = V^T P^T``: P is the B operand straight from the score registers and V^T comes from
``ds_read_b64_tr_b16`` transposed LDS reads. A K/V tile holds 64 keys at head_dim 64 and 32
keys above (registers, below); tiles reach LDS by global->LDS DMA (``buffer_load_dwordx4 ...
lds``) into two slots per operand (even / odd tiles).

Software pipeline
-----------------
A key tile ``t`` passes five stages, each in its own cluster: QK (MFMAs only: the previous
cluster loaded the whole K tile into registers); mask + running max + lazy-rescale vote;
*partial* softmax, ``P = exp2(scale * S - max)`` in 8-value strips, then the denominator
``norm = norm * scale_vec + sum(P)``; PV. The main loop advances ``j`` by 2 and runs 8 clusters,
each ending in ``s_barrier``; its first half works on tile ``j - 2``, its second on ``j - 1``:

| cluster | work |
| --- | --- |
| C0 | QK[j-2] |
| C1 | DMA K[j] + LDS->register V[j-3] + mask(j-2) on boundary tiles + max / vote(j-2) |
| C2 | O rescale(j-3), PV[j-3] strip-interleaved with softmax(j-2), norm update(j-2) |
| C3 | DMA V[j-1] + LDS->register K[j-1] |
| C4 | QK[j-1] |
| C5 | DMA K[j+1] + LDS->register V[j-2] + mask(j-1) on boundary tiles + max / vote(j-1) |
| C6 | O rescale(j-2), PV[j-2] strip-interleaved with softmax(j-1), norm update(j-1) |
| C7 | DMA V[j] + LDS->register K[j] |

MFMA clusters run at ``s_setprio 1`` and open with a consumer-side ``lgkmcnt(0)`` drain. C2/C6
interleave one PV k-step (``head_dim / 32`` MFMAs over 16 keys) with the 8 ``v_exp_f32`` of one
strip of the next tile's scores, four times (two at 32-key tiles): ``interleave mfma=D/32
trans=8`` in the recipe, lowered to ``sched_group_barrier`` and checked by
``kiln-verify-schedule``. Each P strip is cast to the input dtype once, at the PV k-step that
reads it.

Masks: a wave-uniform scalar test skips the mask in C1/C5 when every key of the tile is below
``Sk`` and visible to every row of the block (causal: every tile left of the block's first
diagonal), so interior tiles pay one scalar branch for it; boundary tiles (for a causal mask
the tiles crossing the block's 256-row diagonal band, and the padding) and the prologue /
epilogue tiles are masked.

The max starts empty (``OnlineSoftmax.reseed_empty``; a sink seeds it otherwise): tile 0's vote
fires, as ``seed_tile0``, so rows are taken against their own max however negative the scores.
Lazy rescale, threshold 8 (log2 units): when no row's max grew by more than 8 the max rolls back
(P stays below ``2**8``) and ``scale_vec`` is 1; the vote is an OR over the wave, decided with
selects. ``norm *= scale_vec`` and ``O *= scale`` then multiply by 1: both run every tile
(``O``: ``head_dim / 4`` ``v_pk_mul_f32`` per lane, in C2/C6 ahead of the MFMAs) instead of
behind a branch (below). ``O`` is rescaled for tile ``t`` right before PV[t], one cluster pair
after the vote, so every PV adds ``P V`` at the scale ``O`` is expressed in: exact.

Prologue P0-P3 (clusters 8-11): DMA K[0], K[1], V[0]; load K[0] + QK[0]; DMA K[2] + mask /
vote(0) + softmax(0); DMA V[1] + load K[1] (DMAs in the steady state's age order). Epilogue,
13 clusters E0-E12 (12-24) draining the last four tiles ``N-4 .. N-1``: E0-E7 are C0-C7 with
``j = N - 1`` and no K[N] DMA; E8 QK[N-1]; E9 V[N-2] + mask / vote(N-1); E10 PV[N-2] +
softmax(N-1); E11 V[N-1]; E12 PV[N-1], ``O / norm``, the O store through a zero-cost ``col_l ->
row_l`` re-tag, and the LSE. ``N``, the tiles some row of the block may see, is padded to an
even count of at least 6 with fully masked tiles: at least one main-loop iteration, so LLVM sees
no zero-trip path (whose structurized flow block would keep the prologue's P and K live across
the loop). Waits: ``vmcnt(2 * DMAs per tile)`` before the barrier of every even cluster retires
the DMA the next cluster reads (``vmcnt(DMAs)``, ``vmcnt(0)`` at the end of the epilogue).

How LLVM shaped it (each found in the assembly): the seed's tail softmax in C0 (the bf16 cast
of P[j-3] and its row sum) and its persistent bf16 P tile are not here. The row sum stays next
to the exps it reads: moved to C0, it leaves the prologue's exps without a use in their cluster,
and LLVM sinks them out of it to the loop entry. P crosses the loop back-edge in f32
(a loop-carried bf16 vector makes LLVM split the latch and copy every carried register each
iteration), and MachineSink moves a pure value computed before a branch to its uses after it:
a cast done early lands next to the PV anyway (seen with the cast in C2 and C5's mask branch).
The vote selects instead of branching for the same reason. K/V fragment offsets are immediates
(``imm_offset_bytes``), folded into the ``ds_read`` offset field.

Registers: 8 waves of 64 lanes per block put two waves on each SIMD, so a wave gets 256 of the
512 unified VGPR+AGPR registers (LLVM enforces it; no AGPR is used). Measured for every mask
kind: head_dim 64 uses 182-189 VGPRs, 128 uses 199-209, no scratch. A 256-wide operand does not
fit there (at head_dim 256 the O^T accumulator, Q and one PV cluster's V tile already need 256),
so those head dims run 4 waves per block: one wave per SIMD and all 512 registers. Measured
(causal): 256 and 192 use 376 VGPRs + 120 AGPRs, 192/128 272 + 16, no scratch; a kernel that
would still spill is refused unless ``allow_scratch=True``. GQA head remap: block ``x`` serves
query head ``(x % GROUP) * NUM_KV_HEADS + x // GROUP``.

The key range, the mask and vote, the DMA drains and the C0-C7 iteration live in
:mod:`.prefill_gfx950_steps`, shared with the FP8 kernel (:mod:`.prefill_gfx950_fp8`).

Edges: Q, K, V and O go through buffer views; rows past a sequence, and the padding columns of
a head dim narrower than its tile, are redirected past the tensor's end, so they read zeros and
their stores are dropped.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

import kiln
from kiln import amd_asm, amd_buffer, mma
from kiln.layout import mfma_32x32_accumulator
from kiln.amd.loader import TiledMmaLoader
from kiln.tiles import RegTile

from .online_softmax import OnlineSoftmax
from .prefill_gfx950_config import (DMA_ELEMS, EPILOGUE, KEY_BLOCK, MMA_SHAPE, PROLOGUE,
                                    STRIP_KEYS, STRIPE, SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS,
                                    WAVE, PrefillGfx950Config)
from .prefill_gfx950_config import swap_bits_2_3 as _swap_bits_2_3
from .prefill_gfx950_config import tr_depth as _tr_depth
from .prefill_gfx950_steps import EPILOGUE_TILES, key_range, make_iteration, make_mask_and_vote
from .softcap import soft_cap_constants

LOG2E = 1.0 / math.log(2.0)

__all__ = ["PrefillGfx950Config", "make_kernel", "compile_prefill_gfx950", "run_prefill_gfx950",
           "SUPPORTED_HEAD_DIMS", "SUPPORTED_DTYPES"]


def make_kernel(config: PrefillGfx950Config):
    """The ``@kiln.kernel`` for ``config``; arguments ``(q, k, v, o, lse, cu_q, cu_k, sinks,
    hq, hkv, scale_log2, window_left, window_right, chunk)`` with q ``[tokens * Hq, D]``,
    k ``[tokens * Hkv, D]``, v ``[tokens * Hkv, Dv]``, o ``[tokens * Hq, Dv]``, lse
    ``[Hq, tokens]``; grid ``(Hq, ceil(max Sq / config.block_q), B)``."""
    dtype = kiln.dtype(config.dtype)
    d, dv = config.head_dim, config.dv  # the real head dims
    qk_w, v_w = config.qk_width, config.v_width  # the tiles' widths (module docs)
    k_steps = qk_w // MMA_SHAPE[2]
    d_tiles = v_w // MMA_SHAPE[0]
    dma_k, dma_v = config.dmas_per_tile
    waves = config.waves
    block_kv, strips = config.block_kv, config.strips
    key_frags = block_kv // KEY_BLOCK  # score fragments per tile
    SINKS, CACHE = config.sinks, config.att_bf16_full  # noqa: N806
    recipes = config.recipes()
    loader = TiledMmaLoader(dtype, MMA_SHAPE)
    acc_layout = mfma_32x32_accumulator()
    # Within a 32-key block, accumulator value v of lane l holds key
    # swap(8 * (v // 4) + 4 * (l // 32) + v % 4): a constant vector plus 8 * (l // 32).
    key_of_value = [_swap_bits_2_3(8 * (v // 4) + v % 4) for v in range(16)]

    def dma_tile(src, lds, tile, geo, permute):
        """This wave's share of one K (``permute``) or V tile (relative index ``tile``) into
        ``lds``; keys past ``Sk`` and columns past the head dim read zeros."""
        width, real = (qk_w, d) if permute else (v_w, dv)
        for i in kiln.static_range(dma_k if permute else dma_v):
            chunk = geo.wave + i * waves
            position = chunk * (WAVE * DMA_ELEMS) + geo.lane * DMA_ELEMS
            row, col = position // width, position % width
            key = (geo.tile_lo + tile) * block_kv + (_swap_bits_2_3(row) if permute else row)
            inside = key < geo.sk
            if real != width:  # a padded head dim: its extra columns come from past the end
                inside = inside & (col < real)
            src_row = kiln.where(inside, (geo.seq_k0 + key) * geo.hkv + geo.kv_head,
                                 geo.k_rows)
            first = chunk * (WAVE * DMA_ELEMS) // width
            amd_buffer.copy_to_lds(src, (src_row, col), lds, (first, 0), width=DMA_ELEMS)

    def qk(k_reg, geo):
        """``S^T = K Q^T`` for one tile from the whole-tile ``k_reg`` (MFMAs only)."""
        amd_asm.s_waitcnt(lgkmcnt=0)  # consumer-side drain: k_reg's LDS reads are done
        acc = [kiln.values.constant(0.0, kiln.f32, (16,)) for _ in range(key_frags)]
        for f in kiln.static_range(key_frags):
            for kk in kiln.static_range(k_steps):
                acc[f] = geo.atom(k_reg[f * k_steps + kk], geo.q_reg[kk], acc[f])
        return RegTile(acc, acc_layout, (key_frags, 1))

    # Fragment corners go in as immediate byte offsets, not into the lane arithmetic: LLVM then
    # folds them into each ds_read's offset field instead of keeping one loop-invariant address
    # register per fragment and slot live across the main loop.
    def load_v(v_lds):
        return [[loader.load_b_tr(v_lds, imm_offset_bytes=2 * (kk * MMA_SHAPE[2] * v_w
                                                                + dt * MMA_SHAPE[0]))
                 for dt in range(d_tiles)] for kk in range(strips)]

    def load_k(k_lds):
        return [loader.load_b(k_lds, imm_offset_bytes=2 * (nt * MMA_SHAPE[1] * qk_w
                                                           + kk * MMA_SHAPE[2]))[0]
                for nt in range(key_frags) for kk in range(k_steps)]

    def pv_and_partial(o, p, v_frags, sm, s, geo, o_scale):
        """``o * o_scale`` (the previous tile's lazy rescale: 1 unless its vote fired), then
        the PV of the previous tile (``p``: its f32 P strips, ``v_frags``; skipped when None)
        strip by strip, each strip followed by the ``exp2`` of one strip of ``s`` (skipped
        when None); then the denominator update. Returns ``(o, p)``, ``p`` the new P strips.

        Each P strip is cast to bf16 once, at the PV k-step that reads it. P crosses the loop
        back-edge in f32: a loop-carried bf16 vector makes LLVM split the latch and shuffle
        every carried register through copies each iteration. ``att_bf16_full`` (the seed's
        kernel-scope P cache, off by default) casts the strips here instead, after the exps,
        and P crosses to the PV in bf16."""
        amd_asm.s_waitcnt(lgkmcnt=0)  # consumer-side drain: V's transposed reads are done
        x = sm.sub_max_scaled(s, geo.scale_log2) if s is not None else None
        if p is not None:
            o = o * o_scale
        frags, exps = list(o.fragments), []
        for kk in kiln.static_range(strips):
            if p is not None:
                p_operand = p[kk] if CACHE else kiln.cast(p[kk], dtype)
                for dt in kiln.static_range(d_tiles):
                    frags[dt] = geo.atom(v_frags[kk][dt], p_operand, frags[dt])
            if x is not None:
                strip = kiln.vector_slice(x.fragment(kk // 2, 0), STRIP_KEYS * (kk % 2),
                                          STRIP_KEYS)
                exps.append(kiln.exp2(strip))
        if x is not None:
            sm.apply_unconditional_norm_rescale()  # identity unless this tile's vote fired
            sm.col_sum_acc(RegTile([kiln.pack(kiln.unpack(exps[2 * f])
                                              + kiln.unpack(exps[2 * f + 1]))
                                    for f in range(key_frags)], acc_layout, (key_frags, 1)))
        if x is not None and CACHE:
            exps = [kiln.cast(e, dtype) for e in exps]
        return RegTile(frags, o.layout, o.grid), (exps if x is not None else None)

    steps = SimpleNamespace(qk=qk, dma_tile=dma_tile, load_v=load_v, load_k=load_k,
                            pv_and_partial=pv_and_partial, mask_and_vote=make_mask_and_vote(
                                config, block_kv=block_kv, key_frags=key_frags,
                                key_of_value=key_of_value, lane_key_shift=8))
    mask_and_vote = steps.mask_and_vote
    iteration, drain_dma = make_iteration(recipes, config.dmas_per_tile, steps)

    def prefill_gfx950(q: kiln.Tensor[dtype, 2], k: kiln.Tensor[dtype, 2],
                       v: kiln.Tensor[dtype, 2], o: kiln.Tensor[dtype, 2],
                       lse: kiln.Tensor[kiln.f32, 2], cu_q: kiln.Tensor[kiln.i32, 1],
                       cu_k: kiln.Tensor[kiln.i32, 1], sinks: kiln.Tensor[kiln.f32, 1],
                       hq: kiln.i32, hkv: kiln.i32, scale_log2: kiln.f32, window_left: kiln.i32,
                       window_right: kiln.i32, chunk: kiln.i32):
        # Waits are placed by hand (consumer-side drains, DMA staircases); kiln-verify-waits
        # proves them sufficient.
        kiln.manual_waits()
        # One LDS buffer per slot, so the wait verifier tells the slots apart.
        bufs = SimpleNamespace(k=amd_buffer.buffer(k), v=amd_buffer.buffer(v),
                               k_lds=[kiln.shared((block_kv, qk_w), dtype) for _ in range(2)],
                               v_lds=[kiln.shared((block_kv, v_w), dtype) for _ in range(2)])
        q_buf, o_buf = amd_buffer.buffer(q), amd_buffer.buffer(o)
        lane, wave = kiln.lane_id(), kiln.warp_id()
        group = hq // hkv
        head = (kiln.block_id(0) % group) * hkv + kiln.block_id(0) // group  # GQA head remap
        batch = kiln.block_id(2)
        seq_q0, seq_k0 = cu_q[batch], cu_k[batch]
        sq, sk = cu_q[batch + 1] - seq_q0, cu_k[batch + 1] - seq_k0
        q_rows = q.shape[0]
        block_q0 = kiln.block_id(1) * config.block_q
        q_row = block_q0 + wave * STRIPE + lane % STRIPE  # this lane's query row

        # Key range any row of the block may see: tiles outside it are not visited.
        keys = key_range(config, block_kv, block_q0, sq, sk, window_left, window_right, chunk)
        first_pos, last_pos, tile_lo, n_tiles = (keys.first_pos, keys.last_pos, keys.tile_lo,
                                                 keys.n_tiles)

        q_reg = []
        q_src = kiln.where(q_row < sq, (seq_q0 + q_row) * hq + head, q_rows)
        for kk in kiln.static_range(k_steps):
            col = kk * MMA_SHAPE[2] + 8 * (lane // 32)
            src = q_src
            if (kk + 1) * MMA_SHAPE[2] > d:  # padding columns: read from past the end, zeros
                src = kiln.where(col < d, q_src, q_rows)
            q_reg.append(q_buf.load(src, col, width=8))
        geo = SimpleNamespace(lane=lane, wave=wave, seq_k0=seq_k0, sk=sk, kv_head=head // group,
                              hkv=hkv, k_rows=k.shape[0], q_pos=q_row + sk - sq,
                              first_pos=first_pos, last_pos=last_pos,
                              # capped scores leave soft_cap in log2 units: a softmax scale of 1
                              scale_log2=1.0 if config.softcap else scale_log2,
                              cap=soft_cap_constants(scale_log2, config.softcap)
                              if config.softcap else None,
                              window_left=window_left, window_right=window_right, chunk=chunk,
                              tile_lo=tile_lo, q_reg=q_reg, bufs=bufs,
                              atom=mma.atom(*MMA_SHAPE, dtype))

        s0 = RegTile.full(acc_layout, (key_frags, 1), 0.0, kiln.f32)
        sm = OnlineSoftmax[kiln.f32].init(s0, q_axis="col")
        if SINKS:
            sm.reseed_with_sink(sinks[head] * LOG2E)
        else:  # seed_tile0's role: tile 0's vote fires, its scores taken against their own max
            sm.reseed_empty()
        o_acc = RegTile.full(acc_layout, (d_tiles, 1), 0.0, kiln.f32)

        # Prologue: DMA ordered K0 K1 V0 K2 V1, the steady state's age order at the loop head.
        with kiln.cluster(PROLOGUE[0], recipes[PROLOGUE[0]]):
            dma_tile(bufs.k, bufs.k_lds[0], 0, geo, True)
            dma_tile(bufs.k, bufs.k_lds[1], 1, geo, True)
            dma_tile(bufs.v, bufs.v_lds[0], 0, geo, False)
            drain_dma(2)  # K[0] landed
        with kiln.cluster(PROLOGUE[1], recipes[PROLOGUE[1]]):
            s = qk(load_k(bufs.k_lds[0]), geo)
        with kiln.cluster(PROLOGUE[2], recipes[PROLOGUE[2]]):
            dma_tile(bufs.k, bufs.k_lds[0], 2, geo, True)
            s = mask_and_vote(sm, s, 0, geo, True)  # o is still 0: nothing to rescale
            _, p = pv_and_partial(o_acc, None, None, sm, s, geo, None)
            o_scale = sm.scale_vec
            drain_dma(2)  # K[1] landed
        with kiln.cluster(PROLOGUE[3], recipes[PROLOGUE[3]]):
            dma_tile(bufs.v, bufs.v_lds[1], 1, geo, False)
            k_reg = load_k(bufs.k_lds[1])

        # Main loop, iteration i on tiles 2i+1 and 2i+2 (at least one iteration).
        for i in kiln.range(kiln.maximum((n_tiles - EPILOGUE_TILES) // 2, 1)):
            sm, o_acc, k_reg, p, o_scale = iteration(
                range(8), 3 + 2 * i, (sm, o_acc, k_reg, p, o_scale), geo, False, False)

        # Epilogue: E0-E7 are one more iteration with j = N - 1 (no K[N]), then the last tile.
        sm, o_acc, k_reg, p, o_scale = iteration(
            EPILOGUE[:8], n_tiles - 1, (sm, o_acc, k_reg, p, o_scale), geo, True, True)
        e8, e9, e10, e11, e12 = EPILOGUE[8:]
        with kiln.cluster(e8, recipes[e8]):
            s = qk(k_reg, geo)  # QK[N-1]
            drain_dma(1)  # V[N-2] landed
        with kiln.cluster(e9, recipes[e9]):
            v_frags = load_v(bufs.v_lds[0])  # V[N-2]
            s = mask_and_vote(sm, s, n_tiles - 1, geo, True)
            scale_t = sm.scale_vec
        with kiln.cluster(e10, recipes[e10]):
            o_acc, p = pv_and_partial(o_acc, p, v_frags, sm, s, geo, o_scale)
            drain_dma(0)  # V[N-1] landed
        with kiln.cluster(e11, recipes[e11]):
            v_frags = load_v(bufs.v_lds[1])  # V[N-1]
        with kiln.cluster(e12, recipes[e12]):
            o_acc, _ = pv_and_partial(o_acc, p, v_frags, sm, None, geo, scale_t)
            o_acc = sm.normalize_output(o_acc)
            lse_row = sm.log_sum_exp().values[0][0]
            o_rows = o_acc.T  # row_l view: lane owns query row, values run over depth
            dst = kiln.where(q_row < sq, (seq_q0 + q_row) * hq + head, q_rows)
            for dt in kiln.static_range(d_tiles):
                values = kiln.unpack(kiln.cast(o_rows.fragment(0, dt), dtype))
                for value in kiln.static_range(16):
                    row, col = o_rows.layout(lane, value)
                    depth = dt * MMA_SHAPE[0] + _tr_depth(col)
                    if (dt + 1) * MMA_SHAPE[0] > dv:  # padding rows of O^T are dropped
                        o_buf[kiln.where(depth < dv, dst, q_rows), depth] = values[value]
                    else:
                        o_buf[dst, depth] = values[value]
            if (q_row < sq) & (lane < STRIPE):
                lse[head, seq_q0 + q_row] = lse_row

    return kiln.kernel(prefill_gfx950)


def _config(head_dim, dtype, *, causal=False, window=None, chunk=None, sinks=None,
            head_dim_v=None, softcap=0.0, att_bf16_full=False):
    return PrefillGfx950Config(head_dim=head_dim, dtype=kiln.dtype(dtype).name,
                               causal=bool(causal), window=window is not None,
                               chunk=chunk is not None, sinks=sinks is not None,
                               head_dim_v=None if head_dim_v == head_dim else head_dim_v,
                               softcap=float(softcap or 0.0),
                               att_bf16_full=bool(att_bf16_full))


def _placeholders(config: PrefillGfx950Config):
    """Arrays carrying only dtype and rank: the kernel is specialised on them."""
    x = np.empty((1, config.head_dim), kiln.dtype(config.dtype).numpy)
    xv = np.empty((1, config.dv), x.dtype)
    i32 = np.zeros(2, np.int32)
    return (x, x, xv, xv, np.empty((1, 1), np.float32), i32, i32, np.zeros(1, np.float32),
            1, 1, 1.0, -1, -1, 1)


def compile_prefill_gfx950(*, head_dim: int, dtype="bf16", causal=False, window=None,
                           chunk=None, sinks=None, head_dim_v=None, softcap=0.0,
                           att_bf16_full=False, target: str = "gfx950",
                           allow_scratch: bool = False):
    """Compile (without running) the gfx950 prefill kernel; returns the ``CompiledKernel``
    (``.asm["amdgcn"]``, ``.metadata``) with ``.recipes`` (cluster -> ClusterRecipe) attached
    for ``kiln.lowering.verify_schedule``. ``window``/``chunk``/``sinks`` only need to be
    not-None: the kernel is specialised on which masks exist, not on their values;
    ``head_dim_v`` is V's head dim (None: ``head_dim``), ``softcap`` > 0 caps the scores,
    ``att_bf16_full`` selects the seed's persistent P cache. A kernel that would spill to scratch is refused unless ``allow_scratch=True``.

    Example: ``compile_prefill_gfx950(head_dim=192, head_dim_v=128).metadata["scratch_bytes"]``.
    """
    if str(target) != "gfx950":
        raise kiln.UnsupportedError(f"the MhaPrefillV2 kernel uses gfx950 MFMAs and transposed "
                                    f"LDS reads, which {target} lacks", fix="target='gfx950'")
    config = _config(head_dim, dtype, causal=causal, window=window, chunk=chunk, sinks=sinks,
                     head_dim_v=head_dim_v, softcap=softcap, att_bf16_full=att_bf16_full)
    compiled = make_kernel(config).compile(*_placeholders(config), target=target,
                                           num_warps=config.waves)
    if compiled.metadata.get("scratch_bytes") and not allow_scratch:
        raise kiln.ResourceError(
            f"gfx950 prefill head_dim={head_dim}/{config.dv} spills "
            f"{compiled.metadata['scratch_bytes']} bytes to scratch",
            fix="run it on the interpreter, or pass allow_scratch=True to compile it with spills")
    compiled.recipes = config.recipes()
    return compiled


def run_prefill_gfx950(q, k, v, *, causal=False, window=None, chunk=None, sinks=None,
                       scale=None, softcap=0.0, cu_seqlens_q=None, cu_seqlens_k=None,
                       return_lse=False, backend=None, att_bf16_full=False):
    """Run the gfx950 kernel on numpy inputs (shapes and conventions of ``prefill``).
    Only ``backend="interpret"`` exists: no AMD GPU launch path is available.

    Example: ``o = run_prefill_gfx950(q, k, v, causal=True, backend="interpret")``.
    """
    if backend != "interpret":
        raise kiln.UnsupportedError(f"the gfx950 prefill runs only on the CPU interpreter, got "
                                    f"backend={backend!r}", fix='pass backend="interpret"')
    q, k, v = (np.asarray(x) for x in (q, k, v))
    ragged = cu_seqlens_q is not None
    if ragged:
        cu_q = np.asarray(cu_seqlens_q, np.int32)
        cu_k = np.asarray(cu_seqlens_k, np.int32)
        batch, max_sq = len(cu_q) - 1, int(np.max(np.diff(cu_q)))
        q_tokens, k_tokens = q.shape[0], k.shape[0]
    else:
        batch, max_sq, sk = q.shape[0], q.shape[1], k.shape[1]
        cu_q = (np.arange(batch + 1) * max_sq).astype(np.int32)
        cu_k = (np.arange(batch + 1) * sk).astype(np.int32)
        q_tokens, k_tokens = batch * max_sq, batch * sk
    hq, d, dv = q.shape[-2], q.shape[-1], v.shape[-1]
    hkv = k.shape[-2]
    config = _config(d, kiln.dtype(q.dtype).name, causal=causal, window=window, chunk=chunk,
                     sinks=sinks, head_dim_v=dv, softcap=softcap, att_bf16_full=att_bf16_full)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    o = np.full((q_tokens * hq, dv), np.nan, q.dtype)
    lse = np.full((hq, q_tokens), np.nan, np.float32)
    sink_logits = np.zeros(hq, np.float32) if sinks is None else np.asarray(sinks, np.float32)
    left, right = window if window is not None else (-1, -1)
    grid = (hq, max(1, -(-max_sq // config.block_q)), batch)
    make_kernel(config).interpret[grid](
        q.reshape(q_tokens * hq, d), k.reshape(k_tokens * hkv, d), v.reshape(k_tokens * hkv, dv),
        o, lse, cu_q, cu_k, sink_logits, hq, hkv, scale * LOG2E, int(left), int(right),
        int(chunk or 1), target="gfx950", num_warps=config.waves)
    o = o.reshape(*q.shape[:-1], dv)
    if not ragged:
        lse = lse.reshape(hq, batch, max_sq).transpose(1, 0, 2)
    return (o, lse) if return_lse else o
