"""gfx950 (CDNA4) FP8 attention prefill: the ``MhaPrefillV2`` seed's FP8 path (compile-only here).

``O = softmax(scale * dq dk Q K^T + mask) dv V`` per (sequence, query head) for f8e4m3 q/k/v
with FlashAttention-3's descales (``dq`` per (batch, query head), ``dk`` / ``dv`` per (batch, KV
head); 1 when absent), f32 accumulation, bf16 output, and every convention of the bf16 kernel
(:mod:`.prefill_gfx950`: masks, sinks, GQA head remap, ragged batches, LSE, softcap).

The schedule is the bf16 kernel's -- the 8-cluster main loop over two K/V tiles, the 4-cluster
prologue and 13-cluster epilogue, lazy rescale with threshold 8, consumer-side ``lgkmcnt(0)``
drains and the DMA ``vmcnt`` staircase, proven by ``kiln-verify-waits`` -- with FP8 operands:

| step | bf16 kernel | this kernel |
| --- | --- | --- |
| QK ``S^T = K Q^T`` | ``v_mfma_f32_32x32x16_bf16`` | ``v_mfma_f32_32x32x64_f8f6f4`` (32 fp8 a lane) |
| K tile -> registers | ``ds_read_b128``, LDS rows bit-swapped | two ``ds_read_b128`` per fragment, natural rows |
| V strip -> registers | ``ds_read_b64_tr_b16`` x 2 | ``ds_read_b64_tr_b8`` x 4: the loader's 32x32x64 FP8 V strip |
| PV ``O^T = V^T P^T`` | 4 k-steps of 16 keys | one k-step of 64 keys, P cast to fp8 |
| tile | 64 keys at D 64, else 32 | 64 keys (one PV k-step) |
| scale | ``scale * log2(e)`` | ``scale * log2(e) * dq * dk``; ``O *= dv`` before the store |

P in fp8: the lazy rescale keeps P below ``2**8`` (the max rolls back only when no row grew by
more than 8 log2 units), inside e4m3's range (448), so P loses only its rounding (``2**-4``
relative, subnormals below ``2**-6``). The V strip (``TiledMmaLoader.load_v_fp8_strip`` at
32x32x64: ``rel_key``, ``hw_key_shift``, ``depth_base``) hands lane ``l`` the 32 keys that the
two score accumulators of a 64-key tile hold in lane ``l`` (value ``v`` of fragment ``f``: key
``32 f + 8 (v // 4) + 4 (l // 32) + v % 4``), so P is the PV MFMA's B operand as it stands:
no K-row permutation, no cross-lane move. The O^T rows come out in the strip's depth order
(:func:`.prefill_gfx950_fp8_config.strip_depth`), undone by the store's addresses.

``att_bf16_full`` (the seed's kernel-scope P cache, :mod:`.prefill_gfx950_fp8_config`): on, the
softmax cluster casts P to fp8 once into a persistent 8-register tile that crosses to the PV;
off, P crosses in f32 (32 registers) and the PV cluster casts it, ahead of its MFMAs. Found in
the assembly: with the cache, C6's cast stays in C6 (its P crosses the loop back-edge in fp8),
but LLVM's MachineSink moves C2's to C5, behind C5's mask branch (as the bf16 kernel's notes
say of its casts), so P[j-2] still spends C3-C4 in f32; either way no cast precedes a PV MFMA. C2/C6 interleave one
PV MFMA per 32 depths (``v_width / 32`` over 64 keys) with the 8 ``v_exp_f32`` of a strip of
the next tile's scores: ``interleave mfma=v_width/128 trans=8``, four times.

Registers: 8 waves (two per SIMD, 256 VGPR + AGPR each) up to 128-wide operands, 4 waves
(512) for a 256-wide one; a kernel that would spill is refused unless ``allow_scratch=True``.
Head dims: multiples of 16 up to 256 (a 16-byte DMA lane never runs past the head dim's end);
Q/K and V run on 128 or 256 columns, the padding columns read zeros and V's padding rows of O^T
are never stored.
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
from .prefill_gfx950 import LOG2E
from .prefill_gfx950_config import EPILOGUE, PROLOGUE
from .prefill_gfx950_fp8_config import (DMA_ELEMS, MMA_SHAPE, STRIP_KEYS, STRIPE, WAVE,
                                        PrefillGfx950Fp8Config, strip_depth)
from .prefill_gfx950_steps import EPILOGUE_TILES, key_range, make_iteration, make_mask_and_vote
from .softcap import soft_cap_constants

Q_PIECE = 16  # Q columns one padded load reads: head dims are multiples of 16

__all__ = ["PrefillGfx950Fp8Config", "make_fp8_kernel", "compile_prefill_gfx950_fp8",
           "run_prefill_gfx950_fp8", "fp8_descales"]


def make_fp8_kernel(config: PrefillGfx950Fp8Config):
    """The ``@kiln.kernel`` for ``config``; arguments ``(q, k, v, o, lse, cu_q, cu_k, sinks,
    descale_q, descale_k, descale_v, hq, hkv, scale_log2, window_left, window_right, chunk)``
    with q ``[tokens * Hq, D]``, k ``[tokens * Hkv, D]``, v ``[tokens * Hkv, Dv]`` (f8e4m3), o
    ``[tokens * Hq, Dv]`` (bf16), lse ``[Hq, tokens]``, descales f32 ``[B * Hq]`` (q) and
    ``[B * Hkv]`` (k, v); grid ``(Hq, ceil(max Sq / config.block_q), B)``."""
    dtype = kiln.dtype(config.dtype)
    d, dv = config.head_dim, config.dv
    qk_w, v_w = config.qk_width, config.v_width
    k_steps = qk_w // MMA_SHAPE[2]
    d_tiles = v_w // MMA_SHAPE[0]
    dma_k, dma_v = config.dmas_per_tile
    waves, block_kv, key_frags = config.waves, config.block_kv, config.key_frags
    exp_strips = config.exp_strips
    per_strip = d_tiles // exp_strips  # PV MFMAs between two exp strips
    SINKS = config.sinks  # noqa: N806
    CACHE = config.att_bf16_full  # noqa: N806
    recipes = config.recipes()
    loader = TiledMmaLoader(dtype, MMA_SHAPE)
    acc_layout = mfma_32x32_accumulator()
    # Accumulator value v of lane l holds key 8 * (v // 4) + v % 4 + 4 * (l // 32) of its block
    # (K's LDS rows in natural order).
    key_of_value = [8 * (v // 4) + v % 4 for v in range(16)]

    def to_fp8(strips):
        """The PV's B operand: the f32 P strips of a tile (32 values a lane) as fp8; cast in
        quads, which become ``v_cvt_pk_fp8_f32`` pairs (a wider cast has no AMD lowering)."""
        quads = [kiln.cast(kiln.vector_slice(s, 4 * h, 4), dtype) for s in strips
                 for h in range(STRIP_KEYS // 4)]
        return kiln.vector_concat(quads)

    def dma_tile(src, lds, tile, geo, is_k):
        """This wave's share of one K (``is_k``) or V tile (relative index ``tile``) into
        ``lds``; keys past ``Sk`` and chunks wholly past the head dim read zeros."""
        width, real = (qk_w, d) if is_k else (v_w, dv)
        for i in kiln.static_range(dma_k if is_k else dma_v):
            chunk = geo.wave + i * waves
            position = chunk * (WAVE * DMA_ELEMS) + geo.lane * DMA_ELEMS
            row, col = position // width, position % width
            key = (geo.tile_lo + tile) * block_kv + row
            inside = key < geo.sk
            if real != width:
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

    # Fragment corners are immediate byte offsets, folded into each ds_read's offset field.
    def load_v(v_lds):
        return [loader.load_v_fp8_strip(v_lds, imm_offset_bytes=dt * MMA_SHAPE[0])
                for dt in range(d_tiles)]

    def load_k(k_lds):
        return [loader.load_b(k_lds, imm_offset_bytes=nt * MMA_SHAPE[1] * qk_w
                              + kk * MMA_SHAPE[2])[0]
                for nt in range(key_frags) for kk in range(k_steps)]

    def pv_and_partial(o, p, v_frags, sm, s, geo, o_scale):
        """``o * o_scale``, then the previous tile's PV (``p``: its P, fp8 with the cache else
        f32 strips; skipped when None) in ``exp_strips`` groups, each followed by the ``exp2``
        of one strip of ``s`` (skipped when None); then the denominator update. Returns
        ``(o, p)``, ``p`` the new P (cast to fp8 here with the cache)."""
        amd_asm.s_waitcnt(lgkmcnt=0)  # consumer-side drain: V's transposed reads are done
        x = sm.sub_max_scaled(s, geo.scale_log2) if s is not None else None
        if p is not None:
            o = o * o_scale
            p_operand = p if CACHE else to_fp8(p)
        frags, exps = list(o.fragments), []
        for e in kiln.static_range(exp_strips):
            if p is not None:
                for dt in kiln.static_range(e * per_strip, (e + 1) * per_strip):
                    frags[dt] = geo.atom(v_frags[dt], p_operand, frags[dt])
            if x is not None:
                strip = kiln.vector_slice(x.fragment(e // 2, 0), STRIP_KEYS * (e % 2),
                                          STRIP_KEYS)
                exps.append(kiln.exp2(strip))
        new_p = None
        if x is not None:
            sm.apply_unconditional_norm_rescale()  # identity unless this tile's vote fired
            sm.col_sum_acc(RegTile([kiln.pack(kiln.unpack(exps[2 * f])
                                              + kiln.unpack(exps[2 * f + 1]))
                                    for f in range(key_frags)], acc_layout, (key_frags, 1)))
            new_p = to_fp8(exps) if CACHE else exps
        return RegTile(frags, o.layout, o.grid), new_p

    def load_q(q_buf, q_src, q_rows, lane):
        """Q as the QK MFMA's B operand: lane ``l`` holds 32 columns from ``32 (l // 32)`` of
        each 64-column k-step; 16-column pieces past the head dim read zeros (past the end)."""
        q_reg = []
        for kk in kiln.static_range(k_steps):
            col = kk * MMA_SHAPE[2] + 32 * (lane // 32)
            if (kk + 1) * MMA_SHAPE[2] <= d:
                q_reg.append(q_buf.load(q_src, col, width=32))
            else:  # a padded k-step: each 16-column piece past d comes from past the end
                q_reg.append(kiln.vector_concat([
                    q_buf.load(kiln.where(col + c < d, q_src, q_rows), col + c, width=Q_PIECE)
                    for c in range(0, 32, Q_PIECE)]))
        return q_reg

    def store_o(o_acc, o_buf, dst, q_rows, lane):
        """O (normalised, descaled) in bf16 through the zero-cost ``col_l -> row_l`` re-tag;
        O^T row ``r`` of depth tile ``dt`` is depth ``32 dt + strip_depth(r)``."""
        o_rows = o_acc.T
        for dt in kiln.static_range(d_tiles):
            values = kiln.unpack(kiln.cast(o_rows.fragment(0, dt), kiln.bf16))
            for value in kiln.static_range(16):
                _, col = o_rows.layout(lane, value)
                depth = dt * MMA_SHAPE[0] + strip_depth(col)
                if (dt + 1) * MMA_SHAPE[0] > dv:  # padding rows of O^T are dropped
                    o_buf[kiln.where(depth < dv, dst, q_rows), depth] = values[value]
                else:
                    o_buf[dst, depth] = values[value]

    steps = SimpleNamespace(qk=qk, dma_tile=dma_tile, load_v=load_v, load_k=load_k,
                            pv_and_partial=pv_and_partial, mask_and_vote=make_mask_and_vote(
                                config, block_kv=block_kv, key_frags=key_frags,
                                key_of_value=key_of_value, lane_key_shift=4))
    mask_and_vote = steps.mask_and_vote
    iteration, drain_dma = make_iteration(recipes, config.dmas_per_tile, steps)

    def prefill_gfx950_fp8(q: kiln.Tensor[dtype, 2], k: kiln.Tensor[dtype, 2],
                           v: kiln.Tensor[dtype, 2], o: kiln.Tensor[kiln.bf16, 2],
                           lse: kiln.Tensor[kiln.f32, 2], cu_q: kiln.Tensor[kiln.i32, 1],
                           cu_k: kiln.Tensor[kiln.i32, 1], sinks: kiln.Tensor[kiln.f32, 1],
                           descale_q: kiln.Tensor[kiln.f32, 1],
                           descale_k: kiln.Tensor[kiln.f32, 1],
                           descale_v: kiln.Tensor[kiln.f32, 1], hq: kiln.i32, hkv: kiln.i32,
                           scale_log2: kiln.f32, window_left: kiln.i32, window_right: kiln.i32,
                           chunk: kiln.i32):
        # Waits are placed by hand; kiln-verify-waits proves them sufficient.
        kiln.manual_waits()
        bufs = SimpleNamespace(k=amd_buffer.buffer(k), v=amd_buffer.buffer(v),
                               k_lds=[kiln.shared((block_kv, qk_w), dtype) for _ in range(2)],
                               v_lds=[kiln.shared((block_kv, v_w), dtype) for _ in range(2)])
        q_buf, o_buf = amd_buffer.buffer(q), amd_buffer.buffer(o)
        lane, wave = kiln.lane_id(), kiln.warp_id()
        group = hq // hkv
        head = (kiln.block_id(0) % group) * hkv + kiln.block_id(0) // group  # GQA head remap
        kv_head = head // group
        batch = kiln.block_id(2)
        seq_q0, seq_k0 = cu_q[batch], cu_k[batch]
        sq, sk = cu_q[batch + 1] - seq_q0, cu_k[batch + 1] - seq_k0
        q_rows = q.shape[0]
        block_q0 = kiln.block_id(1) * config.block_q
        q_row = block_q0 + wave * STRIPE + lane % STRIPE  # this lane's query row
        # FlashAttention-3's descales: q's and k's fold into the softmax scale, v's into O.
        scale_qk = scale_log2 * descale_q[batch * hq + head] * descale_k[batch * hkv + kv_head]

        keys = key_range(config, block_kv, block_q0, sq, sk, window_left, window_right, chunk)
        first_pos, last_pos, tile_lo, n_tiles = (keys.first_pos, keys.last_pos, keys.tile_lo,
                                                 keys.n_tiles)

        q_src = kiln.where(q_row < sq, (seq_q0 + q_row) * hq + head, q_rows)
        geo = SimpleNamespace(lane=lane, wave=wave, seq_k0=seq_k0, sk=sk, kv_head=kv_head,
                              hkv=hkv, k_rows=k.shape[0], q_pos=q_row + sk - sq,
                              first_pos=first_pos, last_pos=last_pos,
                              scale_log2=1.0 if config.softcap else scale_qk,
                              cap=soft_cap_constants(scale_qk, config.softcap)
                              if config.softcap else None,
                              window_left=window_left, window_right=window_right, chunk=chunk,
                              tile_lo=tile_lo, q_reg=load_q(q_buf, q_src, q_rows, lane),
                              bufs=bufs, atom=mma.atom(*MMA_SHAPE, dtype))

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
            o_acc = sm.normalize_output(o_acc) * descale_v[batch * hkv + kv_head]
            lse_row = sm.log_sum_exp().values[0][0]
            dst = kiln.where(q_row < sq, (seq_q0 + q_row) * hq + head, q_rows)
            store_o(o_acc, o_buf, dst, q_rows, lane)
            if (q_row < sq) & (lane < STRIPE):
                lse[head, seq_q0 + q_row] = lse_row

    return kiln.kernel(prefill_gfx950_fp8)


def _config(head_dim, *, causal=False, window=None, chunk=None, sinks=None, head_dim_v=None,
            softcap=0.0, att_bf16_full=True):
    return PrefillGfx950Fp8Config(head_dim=head_dim, causal=bool(causal),
                                  window=window is not None, chunk=chunk is not None,
                                  sinks=sinks is not None,
                                  head_dim_v=None if head_dim_v == head_dim else head_dim_v,
                                  softcap=float(softcap or 0.0),
                                  att_bf16_full=bool(att_bf16_full))


def _placeholders(config: PrefillGfx950Fp8Config):
    """Arrays carrying only dtype and rank: the kernel is specialised on them."""
    fp8 = kiln.dtype(config.dtype).numpy
    x, xv = np.empty((1, config.head_dim), fp8), np.empty((1, config.dv), fp8)
    o = np.empty((1, config.dv), kiln.bf16.numpy)
    i32, f32 = np.zeros(2, np.int32), np.zeros(1, np.float32)
    return (x, x, xv, o, np.empty((1, 1), np.float32), i32, i32, f32, f32, f32, f32,
            1, 1, 1.0, -1, -1, 1)


def compile_prefill_gfx950_fp8(*, head_dim: int, causal=False, window=None, chunk=None,
                               sinks=None, head_dim_v=None, softcap=0.0, att_bf16_full=True,
                               target: str = "gfx950", allow_scratch: bool = False):
    """Compile (without running) the gfx950 FP8 prefill kernel; returns the ``CompiledKernel``
    with ``.recipes`` attached for ``kiln.lowering.verify_schedule``. ``window`` / ``chunk`` /
    ``sinks`` only need to be not-None (the kernel is specialised on which exist);
    ``att_bf16_full`` selects the persistent P cache. A kernel that would spill to scratch is
    refused unless ``allow_scratch=True``.

    Example: ``compile_prefill_gfx950_fp8(head_dim=128, causal=True).asm["amdgcn"]``.
    """
    if str(target) != "gfx950":
        raise kiln.UnsupportedError(f"the FP8 MhaPrefillV2 kernel uses gfx950's "
                                    f"v_mfma_f32_32x32x64_f8f6f4 and ds_read_b64_tr_b8, which "
                                    f"{target} lacks", fix="target='gfx950'")
    config = _config(head_dim, causal=causal, window=window, chunk=chunk, sinks=sinks,
                     head_dim_v=head_dim_v, softcap=softcap, att_bf16_full=att_bf16_full)
    compiled = make_fp8_kernel(config).compile(*_placeholders(config), target=target,
                                               num_warps=config.waves)
    if compiled.metadata.get("scratch_bytes") and not allow_scratch:
        raise kiln.ResourceError(
            f"gfx950 FP8 prefill head_dim={head_dim}/{config.dv} spills "
            f"{compiled.metadata['scratch_bytes']} bytes to scratch",
            fix="run it on the interpreter, or pass allow_scratch=True to compile it with spills")
    compiled.recipes = config.recipes()
    return compiled


def fp8_descales(batch: int, hq: int, hkv: int, descale_q=None, descale_k=None,
                 descale_v=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FlashAttention-3's descales as the kernel's flat f32 arrays: ``descale_q`` a scalar or
    ``[B, Hq]``, ``descale_k`` / ``descale_v`` a scalar or ``[B, Hkv]`` (None: 1).

    Example: ``dq, dk, dv = fp8_descales(2, 8, 2, descale_q=0.5)`` gives ``dq.shape == (16,)``.
    """
    flat = []
    for name, value, heads in (("descale_q", descale_q, hq), ("descale_k", descale_k, hkv),
                               ("descale_v", descale_v, hkv)):
        if value is None:
            flat.append(np.ones(batch * heads, np.float32))
            continue
        try:
            arr = np.asarray(value, np.float64)
        except (TypeError, ValueError):
            arr = None
        if arr is None or arr.shape not in ((), (1,), (batch, heads)) \
                or not np.isfinite(arr).all():
            shape = None if arr is None else arr.shape
            raise kiln.KilnValueError(f"{name} has shape {shape}; expected a finite scalar or "
                                      f"[B, H] = [{batch}, {heads}]",
                                      fix=f"pass {name} as a float or one value per (batch, "
                                          "head), as FlashAttention-3's descales")
        flat.append(np.broadcast_to(arr.astype(np.float32), (batch, heads)).reshape(-1).copy())
    return tuple(flat)


def run_prefill_gfx950_fp8(q, k, v, *, causal=False, window=None, chunk=None, sinks=None,
                           scale=None, softcap=0.0, cu_seqlens_q=None, cu_seqlens_k=None,
                           return_lse=False, backend=None, descale_q=None, descale_k=None,
                           descale_v=None, att_bf16_full=True):
    """Run the gfx950 FP8 kernel on numpy f8e4m3 inputs (shapes and conventions of
    ``prefill``; descales as :func:`fp8_descales`); returns bf16 ``o`` (and the f32 LSE).
    Only ``backend="interpret"`` exists: no AMD GPU launch path is available.

    Example: ``o = run_prefill_gfx950_fp8(q8, k8, v8, descale_q=sq, backend="interpret")``.
    """
    if backend != "interpret":
        raise kiln.UnsupportedError(f"the gfx950 FP8 prefill runs only on the CPU interpreter, "
                                    f"got backend={backend!r}", fix='pass backend="interpret"')
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
    config = _config(d, causal=causal, window=window, chunk=chunk, sinks=sinks, head_dim_v=dv,
                     softcap=softcap, att_bf16_full=att_bf16_full)
    descales = fp8_descales(batch, hq, hkv, descale_q, descale_k, descale_v)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    o = np.full((q_tokens * hq, dv), np.nan, kiln.bf16.numpy)
    lse = np.full((hq, q_tokens), np.nan, np.float32)
    sink_logits = np.zeros(hq, np.float32) if sinks is None else np.asarray(sinks, np.float32)
    left, right = window if window is not None else (-1, -1)
    grid = (hq, max(1, -(-max_sq // config.block_q)), batch)
    make_fp8_kernel(config).interpret[grid](
        q.reshape(q_tokens * hq, d), k.reshape(k_tokens * hkv, d), v.reshape(k_tokens * hkv, dv),
        o, lse, cu_q, cu_k, sink_logits, *descales, hq, hkv, scale * LOG2E, int(left),
        int(right), int(chunk or 1), target="gfx950", num_warps=config.waves)
    o = o.reshape(*q.shape[:-1], dv)
    if not ragged:
        lse = lse.reshape(hq, batch, max_sq).transpose(1, 0, 2)
    return (o, lse) if return_lse else o
