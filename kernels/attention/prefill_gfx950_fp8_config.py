"""Compile-time shape of the gfx950 FP8 prefill kernel (:mod:`.prefill_gfx950_fp8`):
``PrefillGfx950Fp8Config``, its cluster recipes and the O^T row -> depth map of its V strip.

FP8 K/V run on ``v_mfma_f32_32x32x64_f8f6f4``: a K/V tile holds 64 keys (one PV k-step). Head
dims are multiples of 16 up to 256; Q/K and V each run at the next of 128 / 256 columns (an
MFMA's K is 64 fp8 values and a 16-byte DMA lane moves 16 of them, so eight waves share a
64-key tile evenly only from 128 columns: head dims up to 128 run on the 128-wide tile, their
extra columns read zeros and are never stored). Up to 128 columns the block has 8 waves (256 VGPR + AGPR registers each), a 256-wide
operand takes 4 waves (all 512), as in the bf16 kernel.

``att_bf16_full`` is the seed's kernel-scope P cache (named after its bf16 path): on, each
softmax bulk-casts its P strips into one persistent register tile of the PV operand's dtype
(fp8 here: 8 VGPRs instead of 32) that the next PV reads; off, P crosses to the PV in f32 and
each k-step casts its own operand (the shipped bf16 kernel's choice).

Example: ``PrefillGfx950Fp8Config(head_dim=128).mfmas_per_tile == (4, 4)`` (QK, PV).
"""

from __future__ import annotations

from dataclasses import dataclass

import kiln
from kiln.cluster import ClusterRecipe

from .prefill_gfx950_config import EPILOGUE, PROLOGUE

MMA_SHAPE = (32, 32, 64)
WAVE = 64
STRIPE = 32  # Q rows per wave: one MFMA column block
KEY_BLOCK = MMA_SHAPE[0]  # keys per score fragment (S^T rows)
BLOCK_KV = MMA_SHAPE[2]  # keys per K/V tile: one PV k-step
STRIP_KEYS = 8  # score values of one softmax strip per lane
DMA_ELEMS = 16  # 16 bytes of fp8 per lane per DMA
WIDTHS = (128, 256)
# A 16-byte DMA lane must not run past the head dim's end: at the tensor's last row the buffer
# range check would drop the whole access, real columns included.
HEAD_DIM_MULTIPLE = DMA_ELEMS
MAX_HEAD_DIM = 256
EIGHT_WAVE_WIDTH = 128
SUPPORTED_DTYPES = ("f8e4m3",)


def _check_dim(name: str, d) -> None:
    if not isinstance(d, int) or isinstance(d, bool) or not 0 < d <= MAX_HEAD_DIM \
            or d % HEAD_DIM_MULTIPLE:
        raise kiln.UnsupportedError(f"gfx950 FP8 prefill {name}={d!r} is not supported",
                                    fix=f"use a multiple of {HEAD_DIM_MULTIPLE} up to "
                                        f"{MAX_HEAD_DIM}")


def _width(d: int) -> int:
    return min(w for w in WIDTHS if w >= d)


@dataclass(frozen=True)
class PrefillGfx950Fp8Config:
    """Compile-time shape of the gfx950 FP8 prefill kernel: Q/K's ``head_dim``, V's
    ``head_dim_v`` (None: the same), which masks exist, sinks, the ``softcap`` (0.0: off) and
    ``att_bf16_full`` (the persistent P cache; module docs).

    Example: ``PrefillGfx950Fp8Config(head_dim=256).waves == 4``.
    """

    head_dim: int = 128
    dtype: str = "f8e4m3"
    causal: bool = False
    window: bool = False
    chunk: bool = False
    sinks: bool = False
    head_dim_v: int | None = None
    softcap: float = 0.0
    att_bf16_full: bool = True

    def __post_init__(self):
        _check_dim("head_dim", self.head_dim)
        if self.head_dim_v is not None:
            _check_dim("head_dim_v", self.head_dim_v)
        if kiln.dtype(self.dtype).name not in SUPPORTED_DTYPES:
            raise kiln.UnsupportedError(f"gfx950 FP8 prefill does not support {self.dtype} "
                                        "inputs", fix=f"use one of {', '.join(SUPPORTED_DTYPES)}")

    @property
    def dv(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def qk_width(self) -> int:
        return _width(self.head_dim)

    @property
    def v_width(self) -> int:
        return _width(self.dv)

    @property
    def waves(self) -> int:
        """Waves per block: 8 (two per SIMD) up to 128-wide operands, else 4."""
        return 8 if max(self.qk_width, self.v_width) <= EIGHT_WAVE_WIDTH else 4

    @property
    def block_q(self) -> int:
        return self.waves * STRIPE

    @property
    def block_kv(self) -> int:
        return BLOCK_KV

    @property
    def key_frags(self) -> int:
        """32-key score fragments per tile."""
        return BLOCK_KV // KEY_BLOCK

    @property
    def exp_strips(self) -> int:
        """Softmax strips of ``STRIP_KEYS`` values per lane per tile."""
        return self.key_frags * 16 // STRIP_KEYS

    @property
    def mfmas_per_tile(self) -> tuple[int, int]:
        """(QK, PV) MFMAs one wave issues per K/V tile."""
        return self.key_frags * self.qk_width // MMA_SHAPE[2], self.v_width // MMA_SHAPE[0]

    def dmas(self, width: int) -> int:
        """``buffer_load_dwordx4 ... lds`` one wave issues per K or V tile ``width`` wide."""
        return BLOCK_KV * width // (WAVE * DMA_ELEMS * self.waves)

    @property
    def dmas_per_tile(self) -> tuple[int, int]:
        return self.dmas(self.qk_width), self.dmas(self.v_width)

    @property
    def lds_bytes(self) -> int:
        return 2 * BLOCK_KV * (self.qk_width + self.v_width)  # two slots each, 1-byte values

    def recipes(self) -> dict[int, ClusterRecipe]:
        """Cluster number -> recipe (the bf16 kernel's cluster numbering and roles)."""
        qk, pv = self.mfmas_per_tile
        dma_k, dma_v = self.dmas_per_tile
        v_reads = 4 * pv  # four ds_read_b64_tr_b8 per V strip
        k_reads = 2 * qk  # two ds_read_b128 per 32-byte K fragment
        exps = self.exp_strips * STRIP_KEYS
        qk_only = ClusterRecipe(work=(("mfma", qk),), priority=1)
        load_v_vote = ClusterRecipe(work=(("dma", dma_k), ("ds_read", v_reads)))
        pv_partial = ClusterRecipe(work=(("mfma", pv), ("trans", exps)),
                                   interleave=(("mfma", pv // self.exp_strips),
                                               ("trans", STRIP_KEYS)), priority=1)
        load_k = ClusterRecipe(work=(("dma", dma_v), ("ds_read", k_reads)))
        v_only = ClusterRecipe(work=(("ds_read", v_reads),))
        loop = [qk_only, load_v_vote, pv_partial, load_k]
        prologue = [ClusterRecipe(work=(("dma", 2 * dma_k + dma_v),)),
                    ClusterRecipe(work=(("ds_read", k_reads), ("mfma", qk)), priority=1),
                    ClusterRecipe(work=(("dma", dma_k), ("trans", exps))),
                    load_k]
        epilogue = loop + [qk_only, v_only, pv_partial, load_k,
                           qk_only, v_only, pv_partial, v_only,
                           ClusterRecipe(work=(("mfma", pv),), priority=1)]
        return dict(enumerate(loop + loop)) | dict(zip(PROLOGUE, prologue)) | \
            dict(zip(EPILOGUE, epilogue))


def strip_depth(r):
    """The depth held by row ``r`` of an O^T accumulator whose V^T operand came from the
    32x32x64 FP8 V strip (``depth_base + (l % 16) // 2`` for lane ``l`` feeding row ``r``)."""
    return r - (r % 16) + 8 * (r % 2) + (r % 16) // 2
