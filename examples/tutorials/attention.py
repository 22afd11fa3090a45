"""Tutorial 5: fused attention forward, ``O = softmax(scale * Q K^T + mask) V``, causal or not.

Q, K, V and O are bf16 ``[total, heads * D]`` (a packed batch of sequences, ``cu_seqlens`` the
``B + 1`` int32 prefix sums of their lengths; ``[B, S, H, D]`` tensors are this with every
sequence ``S`` long), ``D`` 64 or 128. A block owns ``BM`` query rows of one head of one
sequence, keeps them in shared memory, and walks the keys ``BN`` at a time, never writing the
``BM x S`` scores out. The shared tiles are ``kiln.tiles.operand_tile`` s, so on sm_90a both
products run on WGMMA (one 64-row slab per warpgroup), elsewhere on ``mma.sync`` / MFMA:

1. ``S_j = Q K_j^T``: ``kiln.gemm(q_s, k_s.T, ...)`` (K stored row-major; ``.T`` reads it
   transposed: WGMMA's K-major B). The accumulators are built with ``warps="rows"``: every warp
   owns whole rows, so the row max and sum are a few shuffles inside a quad of lanes.
2. Online softmax in base 2 with the scale folded in: ``m' = max(m, rowmax(S))``,
   ``P = exp2(S * c - m' * c)`` (one ``kiln.fma`` and an ``exp2`` per score), ``alpha =
   exp2((m - m') * c)``, ``l' = l * alpha + rowsum(P)``.
3. ``O = O * alpha + P V`` with P straight from registers: ``kiln.gemm(kiln.cast(p, bf16), v_s,
   o * alpha)``. On sm_90a the cast WGMMA accumulator *is* WGMMA's register A operand
   (FlashAttention-3), on sm_80 the m16n8 accumulator is the m16n8k16 A fragment; on AMD, where
   an MFMA lane holds a column of C but a row of A, P goes through shared memory.

FlashAttention-3's order: step ``j`` issues ``S_j`` and then ``P_j-1 V_j-1``, both in flight;
the softmax of ``S_j`` waits for ``S_j`` only (``kiln-insert-waits`` puts ``wgmma.wait_group 1``
there) and runs while ``P_j-1 V_j-1`` is on the tensor cores. No block barrier holds the two
warpgroups together, so one's softmax runs beside the other's GEMMs as they drift apart (an
H200 timed 599 against 567 TFLOP/s with a barrier a step; making them take turns,
``kiln.Turns``, gave 547): at the end of step ``j`` every thread hands ``K_j`` and ``V_j-1`` back
(``kiln.release``: arrives on the tiles' empty mbarriers, once ``kiln-insert-waits`` retired
``P_j-1 V_j-1``), and thread 0 refills the stages of ``K_j-1`` and ``V_j-2`` by TMA, each copy
waiting for every thread's release of a step ago (``kiln-verify-waits`` proves the waits);
elsewhere (``cp.async``, buffer DMA) ``kiln.release`` is a block barrier. K and V have
``STAGES = 3`` shared stages each (``K_j+1``, ``K_j+2`` and ``V_j``, ``V_j+1`` fly during step
``j``), so the loops take ``STAGES`` steps at a time and the stage indices are Python ints. The
K and V tiles are masked at the tensors' own ends, not the sequence's, so on sm_90a
``kiln.copy`` moves them by TMA; rows past the sequence belong to the next one (or read 0).
Keys past the sequence, and with ``causal`` keys after the query, are masked to ``-inf`` in the
scores, so they add nothing (P is 0 on their V rows, which must be finite): only the last
(ragged or diagonal) key tiles pay for the mask, in a second loop. Causal query tiles run
longest first. No branch depends on a lane's data: the WGMMA waits ``kiln-insert-waits`` places
are ``.aligned`` (a warp must reach each at one address), so O is rescaled every step.

Run: ``python examples/tutorials/attention.py``.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

import kiln
from kiln import bf16, f32, i32
from kiln.kernel import default_target
from kiln.runtime.cuda import cuda_available

LOG2E = 1.4426950408889634


@kiln.kernel(num_threads="THREADS", flush_denormals=True)   # exp2: one MUFU.EX2
def attention_kernel(q: kiln.Tensor[bf16, 2], k: kiln.Tensor[bf16, 2], v: kiln.Tensor[bf16, 2],
                     o: kiln.Tensor[bf16, 2], cu_seqlens: kiln.Tensor[i32], qk_scale: f32,
                     D: kiln.constexpr, BM: kiln.constexpr, BN: kiln.constexpr,
                     STAGES: kiln.constexpr, THREADS: kiln.constexpr, CAUSAL: kiln.constexpr,
                     ALIGN: kiln.constexpr):
    col0 = kiln.block_id(1) * D                       # the head's columns
    start = cu_seqlens[kiln.block_id(2)]
    length = cu_seqlens[kiln.block_id(2) + 1] - start
    tile, tiles = kiln.block_id(0), (length + BM - 1) // BM
    if CAUSAL:                                        # the longest query tiles first
        tile = kiln.where(tile < tiles, tiles - 1 - tile, tile)
    row0 = tile * BM
    # laid out for the target's MMA: WGMMA's swizzled chunks on sm_90a (k_s.T is then a
    # K-major B), row-major with a bank-conflict-free swizzle elsewhere; K and V in STAGES
    q_s = kiln.tiles.operand_tile((BM, D), bf16, "a")
    k_s = [kiln.tiles.operand_tile((BN, D), bf16, "a") for _ in range(STAGES)]
    v_s = [kiln.tiles.operand_tile((BN, D), bf16, "b") for _ in range(STAGES)]

    def rows(t, n, r0):       # masked at the tensor's end, not the sequence's: TMA on sm_90a
        return kiln.GlobalTile(t, (n, D), (start + r0, col0), row_end=t.shape[0], align=ALIGN)

    kiln.copy(kiln.GlobalTile(q, (BM, D), (start + row0, col0), row_end=start + length,
                              align=ALIGN), q_s)      # once: cp.async, its rows masked
    kiln.copy(rows(v, BN, length), v_s[-1])           # finite: the first step's P V is 0 V
    for i in range(STAGES - 1):                       # K runs STAGES - 1 tiles ahead, V one less
        kiln.copy(rows(k, BN, i * BN), k_s[i])
        if i < STAGES - 2:
            kiln.copy(rows(v, BN, i * BN), v_s[i])
    kiln.barrier()                                    # Q landed
    s0 = kiln.accumulator(q_s, k_s[0].T, warps="rows")
    p = kiln.cast(s0, bf16)                           # the P of the step before the first
    acc = kiln.accumulator(p, v_s[-1], warps="rows")
    m = kiln.tiles.TileVector.full(s0.layout, -float("inf"))
    l = kiln.tiles.TileVector.full(s0.layout, 0.0)
    alpha = kiln.tiles.TileVector.full(s0.layout, 1.0)   # O's rescale, due before P V
    # keys [0, full) need no mask (whole groups of STAGES tiles); [full, end) are the ragged
    # tail or the causal diagonal (a group's last tiles may lie past the end: masked, they add
    # nothing)
    end = length
    full = length // BN * BN
    if CAUSAL:
        end = kiln.min(length, row0 + BM)
        full = kiln.min(full, (row0 + 1) // BN * BN)
    end = kiln.where(row0 < length, end, 0)           # a block past the sequence does nothing
    # in groups of STAGES tiles; the kiln.max's prove the trip counts >= 0 (the TMA waits'
    # parities count the loops' trips)
    full = kiln.max(kiln.min(full, end) // (STAGES * BN), 0)
    last = kiln.max((end + STAGES * BN - 1) // (STAGES * BN), full)

    def step(kv0, st, p, alpha, acc, m, l, masked):
        """S_j = Q K_j^T and O += P_j-1 V_j-1 run together (FlashAttention-3's order): the
        softmax of S_j waits for S_j only, while P_j-1 V_j-1 is still on the tensor cores."""
        s = kiln.gemm(q_s, k_s[st].T, s0)
        acc = kiln.gemm(p, v_s[st - 1], acc * alpha)
        if masked:                                    # index tiles, live in this loop only
            q_row, k_col = kiln.tiles.coords(s.layout)
            # keys from lim on are masked; lim is per row even without causal (ptxas
            # serialised the WGMMAs on a mask of columns alone)
            lim = kiln.min(q_row + (row0 + 1 if CAUSAL else length), length)
            s = kiln.where(k_col + kv0 < lim, s, -float("inf"))
        m_new = m.maximum(kiln.reduce(s, "max", axis=1))
        # base 2 with the scale folded in: one FMA and an exp2 per score
        p = kiln.exp2(kiln.fma(s, qk_scale, m_new * -qk_scale))
        alpha = kiln.exp2((m - m_new) * qk_scale)
        # P in bf16 (the next step's A operand) and the running sum of its f32 values
        p, l = kiln.cast(p, bf16), l * alpha + kiln.reduce(p, "sum", axis=1)
        # S_j read K_j, P_j-1 V_j-1 read V_j-1 (kiln-insert-waits retires it here): hand them
        # back. The copies refill the stages of K_j-1 and V_j-2, released a step ago: on
        # sm_90a they wait for every thread's release, no block barrier (the warpgroups run
        # apart)
        kiln.release(k_s[st], v_s[st - 1])
        kiln.copy(rows(k, BN, kv0 + (STAGES - 1) * BN), k_s[st - 1])  # past the end: masked
        kiln.copy(rows(v, BN, kv0 + (STAGES - 2) * BN), v_s[st - 2])
        return p, alpha, acc, m_new, l

    def steps(kv0, p, alpha, acc, m, l, masked):      # a step per stage: Python-int stages
        for st in range(STAGES):
            p, alpha, acc, m, l = step(kv0 + st * BN, st, p, alpha, acc, m, l, masked)
        return p, alpha, acc, m, l

    for g in kiln.range(0, full):                     # unit steps: the TMA waits' parity
        p, alpha, acc, m, l = steps(g * (STAGES * BN), p, alpha, acc, m, l, False)
    for g in kiln.range(full, last):
        p, alpha, acc, m, l = steps(g * (STAGES * BN), p, alpha, acc, m, l, True)
    acc = kiln.gemm(p, v_s[-1], acc * alpha)
    kiln.copy(kiln.cast(acc / l, bf16), kiln.GlobalTile(o, (BM, D), (start + row0, col0),
                                                        row_end=start + length, align=ALIGN))


# (BM, BN, warps, K/V stages) per head dim: sm_90a (WGMMA), other NVIDIA (mma.sync), AMD (4
# wavefronts whatever the warps; P in VGPRs too, no register A: 32 keys a step stay clear of
# scratch). 3 stages: a step's copies refill the stages of the step before it
HOPPER_BLOCKS = {64: (128, 64, 8, 3), 128: (128, 128, 8, 3)}
BLOCKS = {64: (128, 64, 8, 3), 128: (128, 64, 8, 3)}
AMD_BLOCKS = {64: (128, 32, 8, 3), 128: (128, 32, 8, 3)}


def config(d: int, target: str | None, block: tuple[int, ...] | None = None) -> dict:
    """Block sizes (``block = (BM, BN, warps[, stages])`` overrides them): on NVIDIA 128 query
    rows over 8 warps (16 rows each: two warpgroups on sm_90a), 64 keys per step (128 on sm_90a
    at D 128) and K/V in 3 stages (2 is correct too, with no copy running a step ahead); on
    AMD 4 wavefronts of 64 lanes (32 rows each). ``target`` None is Kiln's default."""
    if d not in (64, 128):
        raise kiln.KilnValueError(f"the attention tutorial takes head dim 64 or 128, got {d}",
                                  fix="pad the head dimension to 64 or 128")
    name = target or default_target()
    table = (AMD_BLOCKS if name.startswith("gfx") else
             HOPPER_BLOCKS if name.startswith("sm_90") else BLOCKS)
    bm, bn, warps, *stages = block or table[d]
    return dict(D=d, BM=bm, BN=bn, STAGES=stages[0] if stages else 3,
                THREADS=256 if name.startswith("gfx") else 32 * warps)


def attention(q, k, v, o, cu_seqlens, max_seqlen: int, heads: int, *, causal: bool = False,
              scale: float | None = None, backend: str = "gpu", target: str | None = None,
              block: tuple[int, ...] | None = None):
    """``o = attention(q, k, v)`` for packed bf16 ``[total, heads * D]`` tensors and int32
    ``cu_seqlens`` (``B + 1`` prefix sums); ``scale`` defaults to ``1 / sqrt(D)``; ``block``
    is :func:`config`'s."""
    d = q.shape[1] // heads
    cfg = config(d, target, block)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if not scale > 0:   # the kernel takes row maxima of Q K^T before scaling
        raise kiln.KilnValueError(f"attention scale must be positive, got {scale}",
                                  fix="pass scale > 0 (default 1 / sqrt(D))")
    grid = (-(-max_seqlen // cfg["BM"]), heads, len(cu_seqlens) - 1)
    launch = attention_kernel.interpret[grid] if backend == "interpret" else attention_kernel[grid]
    extra = {"target": target} if target else {}
    pointers = [t.data_ptr() for t in (q, k, v, o) if hasattr(t, "data_ptr")]
    align = 16 if all(p % 16 == 0 for p in pointers) and q.shape[1] % 8 == 0 else 2
    launch(q, k, v, o, cu_seqlens, scale * LOG2E, CAUSAL=causal, ALIGN=align, **cfg, **extra)
    return o


def reference(q, k, v, cu_seqlens, heads: int, causal: bool, scale: float | None = None):
    """float64 attention of every sequence and head."""
    d = q.shape[1] // heads
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = np.zeros(q.shape, np.float64)
    for b in range(len(cu_seqlens) - 1):
        lo, hi = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
        for h in range(heads if hi > lo else 0):
            cols = slice(h * d, (h + 1) * d)
            qh, kh, vh = (t[lo:hi, cols].astype(np.float64) for t in (q, k, v))
            s = qh @ kh.T * scale
            if causal:
                s = np.where(np.tril(np.ones(s.shape, bool)), s, -np.inf)
            p = np.exp(s - s.max(axis=1, keepdims=True))
            out[lo:hi, cols] = (p / p.sum(axis=1, keepdims=True)) @ vh
    return out


if __name__ == "__main__":
    rng = np.random.default_rng(0)
    heads, d, lengths = 2, 64, [100, 37, 200]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    q, k, v = (rng.standard_normal((int(cu[-1]), heads * d)).astype(ml_dtypes.bfloat16)
               for _ in range(3))
    backend = "gpu" if cuda_available() else "interpret"
    for causal in (False, True):
        o = np.full(q.shape, np.nan, ml_dtypes.bfloat16)
        attention(q, k, v, o, cu, max(lengths), heads, causal=causal, backend=backend)
        err = np.abs(o.astype(np.float64) - reference(q, k, v, cu, heads, causal)).max()
        assert err < 2e-2, err
        print(f"attention causal={causal} ({backend}): max error {err:.2e}")
