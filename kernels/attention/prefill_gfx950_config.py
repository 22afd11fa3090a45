"""Compile-time shape of the gfx950 prefill kernel (:mod:`.prefill_gfx950`):
``PrefillGfx950Config``, its cluster recipes and the head dims it serves.

Head dims: Q/K and V each run at the next of 64 / 128 / 256 columns (``qk_width``,
``v_width``); any multiple of 8 up to 256 is served, and V's head dim may differ from Q/K's
(DeepSeek's 192/128). Columns past the real head dim read zeros (Q loads and K/V DMAs are
redirected past the tensor's end, which buffer views read as 0) and are never stored.
Widths up to 128 keep the 8-wave block (two waves per SIMD, 256 registers each); a 256-wide
operand takes a 4-wave block (one wave per SIMD: the 512 unified VGPR + AGPR registers), so
Q, a whole K tile, the O^T accumulator and a V strip fit without scratch.

Example: ``PrefillGfx950Config(head_dim=192, head_dim_v=128).waves == 4``.
"""

from __future__ import annotations

from dataclasses import dataclass

import kiln
from kiln.cluster import ClusterRecipe

MMA_SHAPE = (32, 32, 16)
WAVE = 64
STRIPE = 32  # Q rows per wave: one MFMA column block
KEY_BLOCK = MMA_SHAPE[0]  # keys per score fragment (S^T rows)
STRIP_KEYS = 8  # score values of one strip per lane (16 keys over the two half-waves)
DMA_ELEMS = 8  # 16 bytes of a 2-byte dtype per lane per DMA
WIDTHS = (64, 128, 256)  # the column widths the kernel's tiles take
SUPPORTED_HEAD_DIMS = WIDTHS  # native widths; every multiple of 8 up to 256 runs padded
HEAD_DIM_MULTIPLE = 8
MAX_HEAD_DIM = 256
EIGHT_WAVE_WIDTH = 128  # wider operands take the 4-wave block (module docs)
SUPPORTED_DTYPES = ("bf16", "f16")

# Cluster numbers: C0-C7 the main loop, then the prologue and the epilogue.
PROLOGUE = tuple(range(8, 12))
EPILOGUE = tuple(range(12, 25))


def _check_dim(name: str, d) -> None:
    if not isinstance(d, int) or isinstance(d, bool) or not 0 < d <= MAX_HEAD_DIM \
            or d % HEAD_DIM_MULTIPLE:
        raise kiln.UnsupportedError(f"gfx950 prefill {name}={d!r} is not supported",
                                    fix=f"use a multiple of {HEAD_DIM_MULTIPLE} up to "
                                        f"{MAX_HEAD_DIM}")


def _width(d: int) -> int:
    return min(w for w in WIDTHS if w >= d)


@dataclass(frozen=True)
class PrefillGfx950Config:
    """Compile-time shape of the gfx950 prefill kernel: Q/K's ``head_dim``, V's
    ``head_dim_v`` (None: the same), the input dtype, which masks exist, sinks, the
    ``softcap`` (0.0: off; the kernel is specialised on its value) and ``att_bf16_full`` (the
    seed's kernel-scope P cache: P cast to the input dtype in the softmax cluster and carried
    so to the PV; off, the default, P crosses in f32 and each PV k-step casts its strip).

    Example: ``PrefillGfx950Config(head_dim=128).mfmas_per_tile == (8, 8)`` (QK, PV).
    """

    head_dim: int = 128
    dtype: str = "bf16"
    causal: bool = False
    window: bool = False
    chunk: bool = False
    sinks: bool = False
    head_dim_v: int | None = None
    softcap: float = 0.0
    att_bf16_full: bool = False

    def __post_init__(self):
        _check_dim("head_dim", self.head_dim)
        if self.head_dim_v is not None:
            _check_dim("head_dim_v", self.head_dim_v)
        if kiln.dtype(self.dtype).name not in SUPPORTED_DTYPES:
            raise kiln.UnsupportedError(f"gfx950 prefill does not support {self.dtype} inputs",
                                        fix=f"use one of {', '.join(SUPPORTED_DTYPES)}")

    @property
    def dv(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def qk_width(self) -> int:
        """Q/K columns in registers and LDS (``head_dim`` rounded up to 64 / 128 / 256)."""
        return self._operand_width(self.head_dim)

    @property
    def v_width(self) -> int:
        """V columns in LDS and O^T rows in registers."""
        return self._operand_width(self.dv)

    def _operand_width(self, d: int) -> int:
        # 8 waves split a 32-key tile's DMAs: a 64-wide operand would leave half a DMA per
        # wave, so next to a 128-wide one it is read 128 wide.
        widest = max(_width(self.head_dim), _width(self.dv))
        return max(_width(d), widest if widest <= EIGHT_WAVE_WIDTH else 0)

    @property
    def waves(self) -> int:
        """Waves per block: 8 (two per SIMD) up to 128-wide operands, else 4."""
        return 8 if max(_width(self.head_dim), _width(self.dv)) <= EIGHT_WAVE_WIDTH else 4

    @property
    def block_q(self) -> int:
        """Query rows per block: one 32-row stripe per wave."""
        return self.waves * STRIPE

    @property
    def block_kv(self) -> int:
        """Keys per K/V tile: 64 when both operands are 64 wide, else 32 (registers)."""
        return 64 if max(self.qk_width, self.v_width) == 64 else 32

    @property
    def strips(self) -> int:
        """PV k-steps per tile = softmax strips (16 keys each)."""
        return self.block_kv // MMA_SHAPE[2]

    @property
    def mfmas_per_tile(self) -> tuple[int, int]:
        """(QK, PV) MFMAs one wave issues per K/V tile."""
        return (self.block_kv // KEY_BLOCK * self.qk_width // MMA_SHAPE[2],
                self.v_width // MMA_SHAPE[0] * self.strips)

    def dmas(self, width: int) -> int:
        """``buffer_load_dwordx4 ... lds`` one wave issues per K or V tile ``width`` wide."""
        return self.block_kv * width // (WAVE * DMA_ELEMS * self.waves)

    @property
    def dmas_per_tile(self) -> tuple[int, int]:
        """(K, V) DMAs one wave issues per tile."""
        return self.dmas(self.qk_width), self.dmas(self.v_width)

    @property
    def lds_bytes(self) -> int:
        return 2 * self.block_kv * (self.qk_width + self.v_width) * 2  # two slots each

    def recipes(self) -> dict[int, ClusterRecipe]:
        """Cluster number -> recipe: the schedule tables of the kernel's docs as data."""
        qk, pv = self.mfmas_per_tile
        dma_k, dma_v = self.dmas_per_tile
        d_tiles = self.v_width // MMA_SHAPE[0]
        v_reads = 2 * pv  # two transposed reads per V fragment
        k_reads = qk  # one ds_read_b128 per K fragment
        exps = self.strips * STRIP_KEYS
        qk_only = ClusterRecipe(work=(("mfma", qk),), priority=1)
        load_v_vote = ClusterRecipe(work=(("dma", dma_k), ("ds_read", v_reads)))
        pv_partial = ClusterRecipe(work=(("mfma", pv), ("trans", exps)),
                                   interleave=(("mfma", d_tiles), ("trans", STRIP_KEYS)),
                                   priority=1)
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


def swap_bits_2_3(r):
    """The key held by K's LDS row ``r`` (an involution): swapping row bits 2 and 3 makes the
    score accumulator's rows line up with the K-groups of the PV MFMA's P operand."""
    return r - (r % 16) + (r % 4) + ((r // 4) % 2) * 8 + ((r // 8) % 2) * 4


def tr_depth(r):
    """The depth held by row ``r`` of an O^T accumulator whose V^T operand came from
    ``ds_read_b64_tr_b16`` (its rows are permuted inside 16-row blocks)."""
    return r - (r % 16) + (r % 4) * 4 + (r % 16) // 4
