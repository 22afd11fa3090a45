"""gfx950 (CDNA4) attention prefill after the ``MhaPrefillV2`` design (compile-only here).

``O = softmax(scale * Q K^T + mask) V`` per (sequence, query head), bf16/f16 inputs, f32
accumulation, the conventions of ``kiln.kernels.attention.prefill`` (masks, sinks, GQA, ragged
batches, LSE; see ``tests/attention_reference.py``).

Work split: one block of 8 waves per (query head, 256-row Q block, sequence); wave ``w`` owns
the 32-row Q stripe ``w``. Scores are computed transposed, ``S^T = K Q^T`` on
``v_mfma_f32_32x32x16``, so in the accumulator's ``col_l`` view a lane owns one query row and
the online-softmax state (``OnlineSoftmax``, ``q_axis="col"``) is one f32 per lane. PV is
``O^T = V^T P^T``: the bf16 P tile is the B operand straight from the score registers and V^T
comes from ``ds_read_b64_tr_b16`` transposed LDS reads. K/V tiles hold 64 keys; each reaches
LDS by global->LDS DMA (``buffer_load_dwordx4 ... lds``) two tiles ahead, double buffered.

Cluster schedule of the main loop: one iteration advances two K/V tiles ``t`` (clusters C0-C3,
LDS slot 0) and ``t + 1`` (C4-C7, slot 1); every cluster ends in ``s_barrier``:

| cluster | work (tile ``t``; C4-C7 the same for ``t + 1``) |
| --- | --- |
| C0 | QK[t] from the pre-loaded whole-tile ``k_reg`` (MFMAs only) |
| C1 | DMA K[t+2] + LDS->register V[t] + mask(t) + running max + lazy-rescale vote |
| C2 | softmax(t) into the persistent bf16 P tile + PV[t] |
| C3 | DMA V[t+2] + LDS->register K[t+1] (whole tile, consumed by the next QK cluster) |

The prologue (P0, P1) DMAs K/V of the first two tiles and pre-loads K[0]; the epilogue
(E0) normalises O in place and stores it through a zero-cost ``col_l -> row_l`` re-tag,
and the LSE. Lazy rescale uses threshold 8 (log2 units): O and the denominator are rescaled only
when some row's max grew by more than 8, so P stays below 2**8. GQA head remap: block
``x`` serves query head ``(x % GROUP) * NUM_KV_HEADS + x // GROUP``. Only key tiles that the
mask leaves visible to some row of the block are visited; padding past them is masked.

Edges: Q, K, V and O go through buffer views; rows past a sequence are redirected past the
tensor's end, so they read zeros and their stores are dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from mlir import ir
from mlir.dialects import arith, vector

import kiln
from kiln import amd_asm, amd_buffer, mma
from kiln.cluster import ClusterRecipe
from kiln.layout import mfma_32x32_accumulator
from kiln.loader import TiledMmaLoader
from kiln.tiles import RegTile

from .online_softmax import OnlineSoftmax

MMA_SHAPE = (32, 32, 16)
WAVE = 64
WAVES = 8
STRIPE = 32  # Q rows per wave: one MFMA column block
BLOCK_Q = WAVES * STRIPE
BLOCK_KV = 64  # keys per K/V tile: two 32-key MFMA row blocks
DMA_ELEMS = 8  # 16 bytes of a 2-byte dtype per lane per DMA
RESCALE_THRESHOLD = 8.0
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = ("bf16", "f16")
LOG2E = 1.0 / math.log(2.0)


@dataclass(frozen=True)
class PrefillGfx950Config:
    """Compile-time shape of the gfx950 prefill kernel.

    Example: ``PrefillGfx950Config(head_dim=128).mfmas_per_tile == (16, 16)`` (QK, PV).
    """

    head_dim: int = 128
    dtype: str = "bf16"
    causal: bool = False
    window: bool = False
    chunk: bool = False
    sinks: bool = False

    def __post_init__(self):
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            raise kiln.UnsupportedError(f"gfx950 prefill head_dim={self.head_dim} is not "
                                        "supported", fix=f"use one of {SUPPORTED_HEAD_DIMS}")
        if kiln.dtype(self.dtype).name not in SUPPORTED_DTYPES:
            raise kiln.UnsupportedError(f"gfx950 prefill does not support {self.dtype} inputs",
                                        fix=f"use one of {', '.join(SUPPORTED_DTYPES)}")

    @property
    def mfmas_per_tile(self) -> tuple[int, int]:
        """(QK, PV) MFMAs one wave issues per 64-key tile."""
        d = self.head_dim
        return 2 * d // MMA_SHAPE[2], (d // MMA_SHAPE[0]) * (BLOCK_KV // MMA_SHAPE[2])

    @property
    def dmas_per_tile(self) -> int:
        """``buffer_load_dwordx4 ... lds`` one wave issues per K (or V) tile."""
        return BLOCK_KV * self.head_dim // (WAVE * DMA_ELEMS * WAVES)

    @property
    def lds_bytes(self) -> int:
        return 2 * 2 * BLOCK_KV * self.head_dim * 2  # K and V, two slots each

    def recipes(self) -> dict[int, ClusterRecipe]:
        """Cluster number -> recipe, the schedule table above as data."""
        qk, pv = self.mfmas_per_tile
        dma = self.dmas_per_tile
        d = self.head_dim
        v_reads = 2 * (d // MMA_SHAPE[0]) * (BLOCK_KV // MMA_SHAPE[2])  # two tr reads/fragment
        k_reads = 2 * (d // MMA_SHAPE[2])  # one ds_read_b128 per K fragment
        recipes = {}
        for base in (0, 4):
            recipes[base + 0] = ClusterRecipe(work=(("mfma", qk),), priority=1)
            recipes[base + 1] = ClusterRecipe(work=(("dma", dma), ("ds_read", v_reads)))
            recipes[base + 2] = ClusterRecipe(work=(("mfma", pv),), priority=1)
            recipes[base + 3] = ClusterRecipe(work=(("dma", dma), ("ds_read", k_reads)))
        return recipes


PROLOGUE_DMA, PROLOGUE_K, EPILOGUE = 8, 9, 10


def _swap_bits_2_3(r):
    """The key held by K's LDS row ``r`` (an involution): swapping row bits 2 and 3 makes the
    score accumulator's rows line up with the K-groups of the PV MFMA's P operand."""
    return r - (r % 16) + (r % 4) + ((r // 4) % 2) * 8 + ((r // 8) % 2) * 4


def _tr_depth(r):
    """The depth held by row ``r`` of an O^T accumulator whose V^T operand came from
    ``ds_read_b64_tr_b16`` (its rows are permuted inside 16-row blocks)."""
    return r - (r % 16) + (r % 4) * 4 + (r % 16) // 4


def _int_vector(values) -> kiln.Value:
    vtype = ir.VectorType.get([len(values)], ir.IntegerType.get_signless(32))
    attr = ir.DenseElementsAttr.get(np.asarray(values, np.int32), type=vtype)
    return kiln.Value(arith.constant(vtype, attr), kiln.i32)


def make_kernel(config: PrefillGfx950Config):
    """The ``@kiln.kernel`` for ``config``; arguments ``(q, k, v, o, lse, cu_q, cu_k, sinks,
    hq, hkv, scale_log2, window_left, window_right, chunk)`` with q/o ``[tokens * Hq, D]``,
    k/v ``[tokens * Hkv, D]``, lse ``[Hq, tokens]``; grid ``(Hq, ceil(max Sq / 256), B)``."""
    dtype = kiln.dtype(config.dtype)
    d = config.head_dim
    k_steps = d // MMA_SHAPE[2]
    d_tiles = d // MMA_SHAPE[0]
    pv_steps = BLOCK_KV // MMA_SHAPE[2]
    dmas = config.dmas_per_tile
    CAUSAL, WINDOW, CHUNK, SINKS = config.causal, config.window, config.chunk, config.sinks  # noqa: N806
    recipes = config.recipes()
    loader = TiledMmaLoader(dtype, MMA_SHAPE)
    acc_layout = mfma_32x32_accumulator()
    # Within a 32-key block, accumulator value v of lane l holds key
    # swap(8 * (v // 4) + 4 * (l // 32) + v % 4): a constant vector plus 8 * (l // 32).
    key_of_value = [_swap_bits_2_3(8 * (v // 4) + v % 4) for v in range(16)]

    def dma_tile(src, lds, slot, tile, seq_k0, sk, kv_head, hkv, rows_total, permute, lane,
                 wave):
        """This wave's share of one 64-key tile into LDS slot ``slot``."""
        tokens = []
        for i in kiln.static_range(dmas):
            chunk = wave + i * WAVES
            position = chunk * (WAVE * DMA_ELEMS) + lane * DMA_ELEMS
            row, col = position // d, position % d
            key = tile * BLOCK_KV + (_swap_bits_2_3(row) if permute else row)
            src_row = kiln.where(key < sk, (seq_k0 + key) * hkv + kv_head, rows_total)
            first = chunk * (WAVE * DMA_ELEMS) // d
            tokens.append(amd_buffer.copy_to_lds(src, (src_row, col), lds[slot], (first, 0),
                                                 width=DMA_ELEMS))
        return tokens

    def mask_scores(s, tile, q_pos, sk, window_left, window_right, chunk, lane):
        """-inf where key is past the sequence or hidden by the mask (``q_pos``: this lane's
        query position aligned to the keys, bottom-right)."""
        frags = []
        for f in range(2):
            key = _int_vector(key_of_value) + (tile * BLOCK_KV + f * 32 + 8 * (lane // 32))
            visible = key < sk
            if CAUSAL:
                visible = visible & (key <= q_pos)
            if WINDOW:
                visible = visible & ((window_left < 0) | (key >= q_pos - window_left))
                visible = visible & ((window_right < 0) | (key <= q_pos + window_right))
            if CHUNK:
                same = key // chunk == kiln.maximum(q_pos, 0) // chunk
                visible = visible & same & (q_pos >= 0)
            frags.append(kiln.where(visible, s.fragment(f, 0), -math.inf))
        return RegTile(frags, s.layout, s.grid)

    def half_iteration(base, slot, tile, state):
        """Clusters ``base .. base + 3`` for key tile ``tile`` in LDS slot ``slot``."""
        (sm, o, k_reg, q_reg, k_lds, v_lds, k_buf, v_buf, ctx) = state
        (lane, wave, seq_k0, sk, kv_head, hkv, k_rows, q_pos, scale_log2, wl, wr, chunk,
         atom) = ctx
        with kiln.cluster(base + 0, recipes[base + 0]):
            amd_asm.s_waitcnt(lgkmcnt=0)  # consumer-side drain: k_reg's LDS reads are done
            acc = [kiln.values.constant(0.0, kiln.f32, (16,)) for _ in range(2)]
            for f in kiln.static_range(2):
                for kk in kiln.static_range(k_steps):
                    acc[f] = atom(k_reg[f * k_steps + kk], q_reg[kk], acc[f])
            amd_asm.s_waitcnt(vmcnt=2 * dmas)  # V[t] landed (K[t+1], V[t+1] may be in flight)
        with kiln.cluster(base + 1, recipes[base + 1]):
            dma_tile(k_buf, k_lds, slot, tile + 2, seq_k0, sk, kv_head, hkv, k_rows, True, lane,
                     wave)
            v_frags = [[loader.load_b_tr(v_lds[slot], k0=kk * MMA_SHAPE[2],
                                         n0=dt * MMA_SHAPE[0]) for dt in range(d_tiles)]
                       for kk in range(pv_steps)]
            s = RegTile(acc, acc_layout, (2, 1))
            s = mask_scores(s, tile, q_pos, sk, wl, wr, chunk, lane)
            sm.col_max_acc_scaled(s, scale_log2)
            fired, o = sm.lazy_rescale_decision(o, RESCALE_THRESHOLD)
        with kiln.cluster(base + 2, recipes[base + 2]):
            amd_asm.s_waitcnt(lgkmcnt=0)  # consumer-side drain: V's transposed reads are done
            p = sm.sub_max_scaled(s, scale_log2).exp2()
            sm.apply_norm_rescale_if_pending(fired)
            sm.col_sum_acc(p)
            p16 = p.cast(dtype)  # the persistent P tile: one bulk conversion, read by every PV
            frags = list(o.fragments)
            for kk in kiln.static_range(pv_steps):
                whole = p16.fragment(kk // 2, 0)
                half = kiln.Value(_slice(whole.ir, 8 * (kk % 2), 8), dtype)
                for dt in kiln.static_range(d_tiles):
                    frags[dt] = atom(v_frags[kk][dt], half, frags[dt])
            o = RegTile(frags, o.layout, o.grid)
            amd_asm.s_waitcnt(vmcnt=2 * dmas)  # K[t+1] landed (V[t+1], K[t+2] may be in flight)
        with kiln.cluster(base + 3, recipes[base + 3]):
            dma_tile(v_buf, v_lds, slot, tile + 2, seq_k0, sk, kv_head, hkv, k_rows, False, lane,
                     wave)
            k_reg = loader.load_b(k_lds[1 - slot], n_tiles=2, k_tiles=k_steps)
        return sm, o, k_reg

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
        k_lds = [kiln.shared((BLOCK_KV, d), dtype) for _ in range(2)]
        v_lds = [kiln.shared((BLOCK_KV, d), dtype) for _ in range(2)]
        q_buf, k_buf, v_buf = amd_buffer.buffer(q), amd_buffer.buffer(k), amd_buffer.buffer(v)
        o_buf = amd_buffer.buffer(o)
        atom = mma.atom(*MMA_SHAPE, dtype)
        lane, wave = kiln.lane_id(), kiln.warp_id()
        group = hq // hkv
        head = (kiln.block_id(0) % group) * hkv + kiln.block_id(0) // group  # GQA head remap
        kv_head = head // group
        batch = kiln.block_id(2)
        seq_q0, seq_k0 = cu_q[batch], cu_k[batch]
        sq, sk = cu_q[batch + 1] - seq_q0, cu_k[batch + 1] - seq_k0
        q_rows, k_rows = q.shape[0], k.shape[0]
        block_q0 = kiln.block_id(1) * BLOCK_Q
        q_row = block_q0 + wave * STRIPE + lane % STRIPE  # this lane's query row
        q_pos = q_row + sk - sq  # ... aligned to the keys (bottom-right)

        # Key range any row of the block may see: tiles outside it are not visited.
        first_pos = block_q0 + sk - sq
        last_pos = kiln.minimum(block_q0 + BLOCK_Q, sq) - 1 + sk - sq
        key_lo, key_hi = 0, sk
        if CAUSAL:
            key_hi = kiln.minimum(key_hi, last_pos + 1)
        if WINDOW:
            key_lo = kiln.where(window_left >= 0, kiln.maximum(first_pos - window_left, 0), 0)
            key_hi = kiln.where(window_right >= 0,
                                kiln.minimum(key_hi, last_pos + window_right + 1), key_hi)
        if CHUNK:
            key_lo = kiln.maximum(key_lo, (kiln.maximum(first_pos, 0) // chunk) * chunk)
            key_hi = kiln.minimum(key_hi, (kiln.maximum(last_pos, 0) // chunk + 1) * chunk)
        tile_lo = key_lo // BLOCK_KV
        tiles = kiln.maximum((key_hi + BLOCK_KV - 1) // BLOCK_KV - tile_lo, 0)

        q_reg = []
        q_src = kiln.where(q_row < sq, (seq_q0 + q_row) * hq + head, q_rows)
        for kk in kiln.static_range(k_steps):
            q_reg.append(q_buf.load(q_src, kk * MMA_SHAPE[2] + 8 * (lane // 32), width=8))

        s0 = RegTile.full(acc_layout, (2, 1), 0.0, kiln.f32)
        sm = OnlineSoftmax[kiln.f32].init(s0, q_axis="col")
        if SINKS:
            sm.reseed_with_sink(sinks[head] * LOG2E)
        o_acc = RegTile.full(acc_layout, (d_tiles, 1), 0.0, kiln.f32)

        with kiln.cluster(PROLOGUE_DMA):
            for t in kiln.static_range(2):
                dma_tile(k_buf, k_lds, t, tile_lo + t, seq_k0, sk, kv_head, hkv, k_rows, True,
                         lane, wave)
                dma_tile(v_buf, v_lds, t, tile_lo + t, seq_k0, sk, kv_head, hkv, k_rows, False,
                         lane, wave)
            amd_asm.s_waitcnt(vmcnt=3 * dmas)  # K[0] landed
        with kiln.cluster(PROLOGUE_K):
            k_reg = loader.load_b(k_lds[0], n_tiles=2, k_tiles=k_steps)

        ctx = (lane, wave, seq_k0, sk, kv_head, hkv, k_rows, q_pos, scale_log2, window_left,
               window_right, chunk, atom)
        for pair in kiln.range((tiles + 1) // 2):
            tile = tile_lo + 2 * pair
            sm, o_acc, k_reg = half_iteration(
                0, 0, tile, (sm, o_acc, k_reg, q_reg, k_lds, v_lds, k_buf, v_buf, ctx))
            sm, o_acc, k_reg = half_iteration(
                4, 1, tile + 1, (sm, o_acc, k_reg, q_reg, k_lds, v_lds, k_buf, v_buf, ctx))

        with kiln.cluster(EPILOGUE):
            o_acc = sm.normalize_output(o_acc)
            lse_row = sm.log_sum_exp().values[0][0]
            o_rows = o_acc.T  # row_l view: lane owns query row, values run over depth
            for dt in kiln.static_range(d_tiles):
                frag = kiln.cast(o_rows.fragment(0, dt), dtype)
                for value in kiln.static_range(16):
                    row, col = o_rows.layout(lane, value)
                    depth = dt * MMA_SHAPE[0] + _tr_depth(col)
                    dst = kiln.where(q_row < sq, (seq_q0 + q_row) * hq + head, q_rows)
                    o_buf[dst, depth] = kiln.Value(vector.extract(frag.ir, [], [value]), dtype)
            if (q_row < sq) & (lane < STRIPE):
                lse[head, seq_q0 + q_row] = lse_row

    return kiln.kernel(prefill_gfx950)


def _slice(vec: ir.Value, start: int, width: int) -> ir.Value:
    return vector.shuffle(vec, vec, list(range(start, start + width)))


def _config(head_dim, dtype, *, causal=False, window=None, chunk=None, sinks=None):
    return PrefillGfx950Config(head_dim=head_dim, dtype=kiln.dtype(dtype).name,
                               causal=bool(causal), window=window is not None,
                               chunk=chunk is not None, sinks=sinks is not None)


def _placeholders(config: PrefillGfx950Config):
    """Arrays carrying only dtype and rank: the kernel is specialised on them."""
    x = np.empty((1, config.head_dim), kiln.dtype(config.dtype).numpy)
    i32 = np.zeros(2, np.int32)
    return (x, x, x, x, np.empty((1, 1), np.float32), i32, i32, np.zeros(1, np.float32),
            1, 1, 1.0, -1, -1, 1)


def compile_prefill_gfx950(*, head_dim: int, dtype="bf16", causal=False, window=None,
                           chunk=None, sinks=None, target: str = "gfx950"):
    """Compile (without running) the gfx950 prefill kernel; returns the ``CompiledKernel``
    (``.asm["amdgcn"]``, ``.metadata``) with ``.recipes`` (cluster -> ClusterRecipe) attached
    for ``kiln.passes.verify_schedule``. ``window``/``chunk``/``sinks`` only need to be
    not-None: the kernel is specialised on which masks exist, not on their values.

    Example: ``compile_prefill_gfx950(head_dim=128).metadata["scratch_bytes"] == 0``.
    """
    if str(target) != "gfx950":
        raise kiln.UnsupportedError(f"the MhaPrefillV2 kernel uses gfx950 MFMAs and transposed "
                                    f"LDS reads, which {target} lacks", fix="target='gfx950'")
    config = _config(head_dim, dtype, causal=causal, window=window, chunk=chunk, sinks=sinks)
    compiled = make_kernel(config).compile(*_placeholders(config), target=target,
                                           num_warps=WAVES)
    compiled.recipes = config.recipes()
    return compiled


def run_prefill_gfx950(q, k, v, *, causal=False, window=None, chunk=None, sinks=None,
                       scale=None, cu_seqlens_q=None, cu_seqlens_k=None, return_lse=False,
                       backend=None):
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
    hq, d = q.shape[-2], q.shape[-1]
    hkv = k.shape[-2]
    config = _config(d, kiln.dtype(q.dtype).name, causal=causal, window=window, chunk=chunk,
                     sinks=sinks)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    o = np.full((q_tokens * hq, d), np.nan, q.dtype)
    lse = np.full((hq, q_tokens), np.nan, np.float32)
    sink_logits = np.zeros(hq, np.float32) if sinks is None else np.asarray(sinks, np.float32)
    left, right = window if window is not None else (-1, -1)
    grid = (hq, max(1, -(-max_sq // BLOCK_Q)), batch)
    make_kernel(config).interpret[grid](
        q.reshape(q_tokens * hq, d), k.reshape(k_tokens * hkv, d), v.reshape(k_tokens * hkv, d),
        o, lse, cu_q, cu_k, sink_logits, hq, hkv, scale * LOG2E, int(left), int(right),
        int(chunk or 1), target="gfx950", num_warps=WAVES)
    o = o.reshape(q.shape)
    if not ragged:
        lse = lse.reshape(hq, batch, max_sq).transpose(1, 0, 2)
    return (o, lse) if return_lse else o
