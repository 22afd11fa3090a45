"""``TiledMmaLoader``: LDS / shared memory -> register loads that produce MMA operand fragments
directly (AMD MFMA on GFX9; NVIDIA ``mma.sync`` m16n8k16 through ``ldmatrix``).

A loader is parameterised (and nothing else: it holds no state) by the operand dtype, the MFMA
shape ``(m, n, k)`` and up to two swizzles applied in order to every element offset it reads::

    loader = TiledMmaLoader(kiln.bf16, (32, 32, 16), swizzle=Swizzle(3, 3, 3))
    b = loader.load_b(b_tile, n_tiles=2, k_tiles=2)     # 4 fragments, vector<8xbf16> each
    bt = loader.load_b_tr(kn_tile)                      # ds_read_b64_tr_b16 x 2 (gfx950)

Offsets are element offsets into the LDS buffer viewed flat (``row * row_stride + col`` for a
2-D ``kiln.shared`` buffer). The address arithmetic (``*_offsets`` methods) is written with
operators only, so tests evaluate exactly the code that builds the kernel's IR on numpy lane
arrays (``np.arange(64)``). An optional compile-time ``imm_offset_bytes`` is added *after* the
swizzle, so LLVM folds it into the instruction's ``offset:N`` field.

The three loads:

- :meth:`TiledMmaLoader.load_b` -- B stored N x K (K contiguous, e.g. a K-major weight or
  attention's K matrix). Lane ``l`` reads ``kpl`` consecutive elements of row ``l % n`` with
  ``ds_read_b64``/``ds_read_b128``; 32-byte fp8 fragments are two 16-byte halves (each half is
  swizzled on its own). The fragment is exactly :func:`kiln.mfma.operand_b_layout`.
- :meth:`TiledMmaLoader.load_b_tr` -- B stored K x N (N contiguous, a row-major B), gfx950
  bf16/f16 32x32x16 and 16x16x32: two ``ds_read_b64_tr_b16`` (K rows ``8g+0..3`` then
  ``8g+4..7`` of each lane's K group) joined into the 8-value fragment.
- :meth:`TiledMmaLoader.load_v_fp8_strip` -- fp8 V stored keys x depth, gfx950 16x16x128 and
  32x32x64: four ``ds_read_b64_tr_b8`` with paired-lane addressing give lane ``l`` 32 keys at
  one depth: the A operand of the ``P V`` MFMA computed as ``O^T = V^T P^T``. At 16x16x128 the
  keys are consecutive; at 32x32x64 (the seed's ``rel_key`` / ``hw_key_shift`` /
  ``depth_base`` addressing, :meth:`TiledMmaLoader.v_fp8_strip_coords`) they follow the
  32x32 accumulator's row pattern, so the scores of ``S^T = K Q^T`` feed the PV MFMA as its
  B operand without any permutation.

On NVIDIA (``mma_shape=(16, 8, 16)``, bf16/f16, sm_80+), the same two methods build
``mma.sync`` m16n8k16 B fragments (``vector<4 x dtype>``, :func:`kiln.layout.mma_m16n8k16_b`)
with ``ldmatrix`` (PTX semantics in :mod:`kiln.ldmatrix`): each lane supplies the address of
one 8-element (16-byte) row of an 8x8 block, so both swizzles must keep such runs whole.

- ``load_b`` (B stored N x K): ``ldmatrix.x4`` loads two K-adjacent fragments at once (blocks at
  columns ``k0 + 8b``, lane ``l`` addressing row ``n0 + l % 8`` of block ``l // 8``), an odd
  last one ``ldmatrix.x2``; see :meth:`TiledMmaLoader.ldmatrix_b_offsets`.
- ``load_b_tr`` (B stored K x N): ``ldmatrix.x2.trans``, lane ``l`` addressing K row
  ``k0 + l % 16`` at column ``n0``; see :meth:`TiledMmaLoader.ldmatrix_b_tr_offsets`.

Transpose-read semantics (:func:`transpose_read_model`, used by the tests and the interpreter):
each 16-lane group forms ``S = 16 / E`` interleaved sub-blocks (``E`` = elements per lane: 4 for
16-bit, 8 for 8-bit), each an ``E x E`` transpose: ``out[i][j] = in[S * j + i % S][i // S]``
for lane ``i`` of the group. For 8-bit data this is the CDNA4 ISA's pair of 8x8 byte transposes
over the even and the odd lanes; 16-bit data is modelled the same way with 4 sub-blocks. The
transposed loads therefore hand lane ``i`` the column ``E * (i % S) + i // S`` of its 16-column
block, not column ``i``: :meth:`TiledMmaLoader.b_tr_layout` and
:meth:`TiledMmaLoader.v_fp8_strip_layout` state the exact lane -> element mapping, and the
MFMA's C columns (rows for V) come out in that order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from mlir import ir
from mlir.dialects import amdgpu, memref, nvgpu, vector

from ..core import dtypes as dt
from ..core.ops import LGKMCNT, VMCNT, Effects, declare
from ..nvidia.sync import current_target as op_target  # honours compiling_for, as require_amd
from .sched import mark_async, require_amd
from ..builder import current_target
from ..core.errors import KilnTypeError, KilnValueError, TargetError, UnsupportedError
from ..layout import Layout, ThreadValueLayout, concat_modes
from ..mfma import WAVE, values_per_lane
from ..shared import SharedTensor
from ..swizzle import ComposedSwizzle, Swizzle
from ..values import Value, cast
from ..ops import lane_id
from ..tensor import to_index

MAX_LDS_READ_BYTES = 16  # ds_read_b128
MAX_IMM_OFFSET = 65535  # the DS instructions' 16-bit unsigned offset field
TR_READ_BYTES = 8  # ds_read_b64_tr_b{8,16}
TR16_SHAPES = ((32, 32, 16), (16, 16, 32))
V_FP8_SHAPES = ((16, 16, 128), (32, 32, 64))
V_FP8_KEYS_PER_READ = 8
V_FP8_KEY_BASE = 16  # 32x32x64: the four reads start 16 keys apart (key_base 0, 16, 32, 48)
MMA_SYNC_SHAPE = (16, 8, 16)  # NVIDIA mma.sync m16n8k16
LDMATRIX_ROW = 8  # elements of one ldmatrix row address (16 bytes of 16-bit data)
SUPPORTED = ("AMD GFX9: MFMA shapes (32, 32, k) / (16, 16, k) (load_b_tr: bf16/f16 (32, 32, 16) "
             "and (16, 16, 32) on gfx950); NVIDIA sm_80+: bf16/f16 (16, 8, 16) via ldmatrix")


def transpose_read_model(loaded: np.ndarray) -> np.ndarray:
    """Semantics of ``ds_read_b64_tr_b{8,16}`` on ``loaded[lane, e]`` (what each of the 64 lanes'
    own 8-byte read fetched): returns what each lane receives (see the module docstring)."""
    lanes, per_lane = loaded.shape
    sub_blocks = 16 // per_lane
    lane = np.arange(lanes)
    group, i = lane // 16, lane % 16
    j = np.arange(per_lane)[None, :]
    source = 16 * group[:, None] + sub_blocks * j + (i % sub_blocks)[:, None]
    return loaded[source, (i // sub_blocks)[:, None]]


def _swizzle_keeps_runs(swizzle, run: int) -> bool:
    """True if ``swizzle`` maps every aligned run of ``run`` offsets to a contiguous run."""
    table = swizzle.table(max(swizzle.span, run))
    runs = table.reshape(-1, run)
    return bool(np.all(runs == runs[:, :1] + np.arange(run)) and np.all(runs[:, 0] % run == 0))


# Transposed reads: LDS ones count on lgkmcnt, global ones on vmcnt; consumers read the result.
DS_READ_TR = declare("amd.loader.ds_read_tr", feature="gfx950",
                     mlir_names=("amdgpu.transpose_load", "rocdl.ds.read.tr4.b64",
                                 "rocdl.ds.read.tr6.b96", "rocdl.ds.read.tr8.b64",
                                 "rocdl.ds.read.tr16.b64"),
                     effects=Effects(counter=LGKMCNT))
GLOBAL_LOAD_TR = declare("amd.loader.global_load_tr", feature="gfx950",
                         mlir_names=("rocdl.global.load.tr4.b64", "rocdl.global.load.tr6.b96",
                                     "rocdl.global.load.tr.b64", "rocdl.global.load.tr.b128"),
                         effects=Effects(counter=VMCNT))
DS_BPERMUTE = declare("amd.loader.ds_bpermute", feature="gfx9", mlir_names=("rocdl.ds_bpermute",),
                      effects=Effects(counter=LGKMCNT))

@dataclass(frozen=True)
class TiledMmaLoader:
    """LDS -> register loader for one dtype, MFMA shape and swizzle pair (module docstring).

    Example::

        loader = TiledMmaLoader(kiln.f8e4m3, (16, 16, 128))
        frags = loader.load_b(k_tile, n_tiles=2)     # two vector<32xf8e4m3>, 2 x ds_read_b128 each
    """
    dtype: dt.DType
    mma_shape: tuple[int, int, int]
    swizzle: Any = None
    swizzle2: Any = None

    def __post_init__(self):
        object.__setattr__(self, "dtype", dt.dtype(self.dtype))
        shape = tuple(self.mma_shape)
        # NVIDIA mma.sync passes here; the target is checked when a load is traced.
        nvidia = shape == MMA_SYNC_SHAPE and self.dtype in (dt.bf16, dt.f16)
        if not nvidia and (len(shape) != 3 or not all(isinstance(s, int) for s in shape)
                           or shape[0] != shape[1] or shape[0] not in (16, 32)
                           or (shape[0] * shape[2]) % WAVE):
            raise UnsupportedError(f"TiledMmaLoader shape {self.mma_shape!r} of {self.dtype} is not "
                                   "a single-block MFMA shape nor bf16/f16 mma.sync m16n8k16",
                                   fix=f"use one of: {SUPPORTED}")
        object.__setattr__(self, "mma_shape", shape)
        for name in ("swizzle", "swizzle2"):
            sw = getattr(self, name)
            if sw is not None and not isinstance(sw, (Swizzle, ComposedSwizzle)):
                raise KilnTypeError(f"TiledMmaLoader {name} must be a kiln.swizzle.Swizzle, got "
                                    f"{sw!r}", fix="pass Swizzle(bits, base, shift) or None")

    # -------------------------------------------------------------------------- address math

    @property
    def values_per_lane(self) -> int:
        m, _, k = self.mma_shape
        return values_per_lane(m, k)

    def swizzled(self, offset: Any) -> Any:
        """``swizzle2(swizzle(offset))`` with absent swizzles skipped (ints, arrays or Values)."""
        for sw in (self.swizzle, self.swizzle2):
            if sw is not None:
                offset = sw(offset)
        return offset

    def _piece_elems(self) -> int:
        return min(self.values_per_lane, MAX_LDS_READ_BYTES // self.dtype.itemsize)

    def b_offsets(self, lane: Any, row_stride: int, n0: Any = 0, k0: Any = 0) -> list:
        """Element offsets of this lane's ``load_b`` reads (one per 16-byte piece) for the MFMA
        tile whose N rows start at ``n0`` and K columns at ``k0``."""
        n = self.mma_shape[1]
        kpl, piece = self.values_per_lane, self._piece_elems()
        row = n0 + lane % n
        col = k0 + (lane // n) * kpl
        return [self.swizzled(row * row_stride + col + p * piece) for p in range(kpl // piece)]

    def b_tr_offsets(self, lane: Any, row_stride: int, k0: Any = 0, n0: Any = 0) -> list:
        """Element offsets of the two ``ds_read_b64_tr_b16`` reads of :meth:`load_b_tr`: lane
        ``L`` of 16-lane group ``g`` reads 4 elements of K row ``8 * (L // n) + 4h + (L % 16) // 4``
        starting at column ``16 * (g % (n // 16)) + 4 * (L % 4)``."""
        n = self.mma_shape[1]
        per = TR_READ_BYTES // self.dtype.itemsize
        group, in_group = lane // 16, lane % 16
        col = n0 + 16 * (group % (n // 16)) + per * (in_group % (16 // per))
        return [self.swizzled((k0 + (lane // n) * 2 * per + h * per + in_group // (16 // per))
                              * row_stride + col) for h in range(2)]

    def v_fp8_strip_coords(self, lane: Any) -> tuple:
        """The seed's per-lane coordinates of the 32x32x64 V strip, lane-only (hoist them out of
        the strip loop): ``rel_key`` -- the key lane ``L`` of its 16-lane row reads within a
        16-key block, ``8 * (L // 8) + (L // 2) % 4``; ``hw_key_shift`` -- +4 in the upper
        half-wave (the accumulator's ``4 * (l // 32)`` row term); ``depth_base`` -- 0, 8, 16 or
        24: ``16 * ((l // 16) % 2) + 8 * (l % 2)``, the first of the 8 depths it reads."""
        in_row = lane % 16
        rel_key = 8 * (in_row // 8) + (in_row // 2) % 4
        hw_key_shift = 4 * (lane // 32)
        depth_base = 16 * ((lane // 16) % 2) + 8 * (lane % 2)
        return rel_key, hw_key_shift, depth_base

    def v_fp8_strip_offsets(self, lane: Any, row_stride: int, key0: Any = 0,
                            depth0: Any = 0) -> list:
        """Element offsets of the four ``ds_read_b64_tr_b8`` reads of :meth:`load_v_fp8_strip`.
        16x16x128: even lane ``2p`` of 16-lane group ``g`` reads depths ``0..7`` of key
        ``32g + 8c + p``, odd lane ``2p + 1`` depths ``8..15`` of the same key (read ``c``).
        32x32x64: lane ``l`` reads depths ``depth_base .. +7`` of key ``16c + rel_key +
        hw_key_shift`` (:meth:`v_fp8_strip_coords`)."""
        if self.mma_shape == V_FP8_SHAPES[1]:
            rel_key, hw_key_shift, depth_base = self.v_fp8_strip_coords(lane)
            return [self.swizzled((key0 + V_FP8_KEY_BASE * c + rel_key + hw_key_shift)
                                  * row_stride + depth0 + depth_base) for c in range(4)]
        group, pair, odd = lane // 16, (lane % 16) // 2, lane % 2
        return [self.swizzled((key0 + 32 * group + V_FP8_KEYS_PER_READ * c + pair) * row_stride
                              + depth0 + 8 * odd) for c in range(4)]

    def ldmatrix_b_offsets(self, lane: Any, row_stride: int, n0: Any = 0, k0: Any = 0,
                           blocks: int = 2) -> Any:
        """Element offset of the row this lane supplies to the ``ldmatrix.x{blocks}`` of
        :meth:`load_b` on NVIDIA (B stored N x K): row ``n0 + lane % 8`` of 8x8 block
        ``b = (lane // 8) % blocks``, which starts at column ``k0 + 8 * b``."""
        block = (lane // LDMATRIX_ROW) % blocks
        return self.swizzled((n0 + lane % LDMATRIX_ROW) * row_stride + k0 + LDMATRIX_ROW * block)

    def ldmatrix_b_tr_offsets(self, lane: Any, row_stride: int, k0: Any = 0, n0: Any = 0) -> Any:
        """Element offset of the row this lane supplies to the ``ldmatrix.x2.trans`` of
        :meth:`load_b_tr` on NVIDIA (B stored K x N): K row ``k0 + lane % 16`` (blocks: K rows
        0-7 and 8-15) from column ``n0``."""
        return self.swizzled((k0 + lane % (2 * LDMATRIX_ROW)) * row_stride + n0)

    # -------------------------------------------------------------------------- layouts

    def b_tr_layout(self) -> ThreadValueLayout:
        """``(lane, value) -> (k, n)`` of :meth:`load_b_tr`'s fragment in the ``k x n`` tile:
        K rows as in :func:`kiln.mfma.operand_b_layout`, column ``16 * b + 4 * (i % 4) + i // 4``
        for lane ``i`` of the ``b``-th 16-lane block of its K group."""
        self._require_tr16("b_tr_layout")
        _, n, k = self.mma_shape
        lanes = Layout((4, 4, n // 16, WAVE // n), (4, 1, 16, 8 * n))
        return ThreadValueLayout(concat_modes(lanes, Layout(8, n)), (k, n))

    def v_fp8_strip_layout(self) -> ThreadValueLayout:
        """``(lane, value) -> (depth, key)`` of :meth:`load_v_fp8_strip`. 16x16x128 (a 16 x 128
        tile): lane ``l`` holds keys ``32 * (l // 16) + v`` at depth ``(l % 16) // 2 + 8 *
        (l % 2)``. 32x32x64 (a 32 x 64 tile): lane ``l`` holds depth ``depth_base + (l % 16) //
        2`` and, for value ``v``, key ``16 * (v // 8) + 8 * ((v % 8) // 4) + 4 * (l // 32) +
        v % 4``: the rows of a 32x32 accumulator's values ``v % 16`` in lane ``l``, two
        accumulators (64 keys) per strip."""
        self._require_v_fp8("v_fp8_strip_layout")
        if self.mma_shape == V_FP8_SHAPES[1]:
            lanes = Layout((2, 8, 2, 2), (8 * 64, 64, 16 * 64, 4))
            values = Layout((4, 2, 4), (1, 8, 16))
            return ThreadValueLayout(concat_modes(lanes, values), (32, 64))
        lanes = Layout((2, 8, 4), (8 * 128, 128, 32))
        return ThreadValueLayout(concat_modes(lanes, Layout(32, 1)), (16, 128))

    # -------------------------------------------------------------------------- loads

    def load_b(self, smem: SharedTensor, *, n_tiles: int = 1, k_tiles: int = 1, n0: Any = 0,
               k0: Any = 0, imm_offset_bytes: int = 0) -> list[Value]:
        """B fragments for an ``n_tiles x k_tiles`` grid of MFMAs from an N x K LDS tile whose
        row ``n0`` / column ``k0`` is the grid's corner; N-outer order (``[nt * k_tiles + kt]``).

        Each fragment is ``vector<kpl x dtype>`` laid out as :func:`kiln.mfma.operand_b_layout`
        (NVIDIA: ``vector<4 x dtype>`` as :func:`kiln.layout.mma_m16n8k16_b`, by ``ldmatrix``).
        Example: ``frags = loader.load_b(b_tile, n_tiles=2, k_tiles=2)``.
        """
        if self._for_nvidia("load_b"):
            return self._load_b_ldmatrix(smem, n_tiles, k_tiles, n0, k0, imm_offset_bytes)
        require_amd("TiledMmaLoader.load_b")
        row_stride = self._check_tile(smem)
        piece = self._piece_elems()
        self._check_swizzle(piece, "load_b")
        imm = self._imm_elems(imm_offset_bytes, piece)
        _, n, k = self.mma_shape
        lane = _lane()
        frags = []
        for nt in range(n_tiles):
            for kt in range(k_tiles):
                offsets = self.b_offsets(lane, row_stride, n0 + nt * n, k0 + kt * k)
                pieces = [_lds_read(smem, off + imm, piece, self.dtype) for off in offsets]
                frags.append(_join(pieces))
        return frags

    def load_b_tr(self, smem: SharedTensor, *, k0: Any = 0, n0: Any = 0,
                  imm_offset_bytes: int = 0) -> Value:
        """One MFMA's B fragment from a K x N LDS tile (N contiguous) by two transposed reads
        (gfx950; bf16/f16; shapes 32x32x16 and 16x16x32). Returns ``vector<8 x dtype>`` laid out
        as :meth:`b_tr_layout`. On NVIDIA: one m16n8k16 B fragment (``vector<4 x dtype>``,
        :func:`kiln.layout.mma_m16n8k16_b`) by ``ldmatrix.x2.trans``.
        Example: ``b = loader.load_b_tr(b_tile, k0=16)``.
        """
        if self._for_nvidia("load_b_tr"):
            row_stride = self._check_tile(smem)
            self._check_swizzle(LDMATRIX_ROW, "load_b_tr")
            imm = self._imm_elems(imm_offset_bytes, LDMATRIX_ROW)
            offset = self.ldmatrix_b_tr_offsets(_lane(), row_stride, k0, n0)
            return _ldmatrix(smem, offset + imm, 1, self.dtype, trans=True)[0]
        DS_READ_TR.require(op_target(), "TiledMmaLoader.load_b_tr")
        self._require_tr16("load_b_tr")
        row_stride = self._check_tile(smem)
        per = TR_READ_BYTES // self.dtype.itemsize
        self._check_swizzle(per, "load_b_tr")
        imm = self._imm_elems(imm_offset_bytes, per)
        halves = [_lds_transpose_read(smem, off + imm, per, self.dtype)
                  for off in self.b_tr_offsets(_lane(), row_stride, k0, n0)]
        return _join(halves)

    def load_v_fp8_strip(self, smem: SharedTensor, *, key0: Any = 0, depth0: Any = 0,
                         imm_offset_bytes: int = 0) -> Value:
        """The fp8 A fragment of one ``P V`` MFMA from a keys x depth LDS tile: 16 (depth) x 128
        (key) at 16x16x128, 32 x 64 at 32x32x64; four ``ds_read_b64_tr_b8``; returns
        ``vector<32 x dtype>`` laid out as :meth:`v_fp8_strip_layout`.
        Example: ``v = loader.load_v_fp8_strip(v_tile, key0=64, depth0=32)``.
        """
        DS_READ_TR.require(op_target(), "TiledMmaLoader.load_v_fp8_strip")
        self._require_v_fp8("load_v_fp8_strip")
        row_stride = self._check_tile(smem)
        self._check_swizzle(TR_READ_BYTES, "load_v_fp8_strip")
        imm = self._imm_elems(imm_offset_bytes, TR_READ_BYTES)
        reads = [_lds_transpose_read(smem, off + imm, TR_READ_BYTES, self.dtype)
                 for off in self.v_fp8_strip_offsets(_lane(), row_stride, key0, depth0)]
        return _join(reads)

    def _load_b_ldmatrix(self, smem, n_tiles, k_tiles, n0, k0, imm_offset_bytes) -> list:
        row_stride = self._check_tile(smem)
        self._check_swizzle(LDMATRIX_ROW, "load_b")
        imm = self._imm_elems(imm_offset_bytes, LDMATRIX_ROW)
        _, n, k = self.mma_shape
        lane = _lane()
        frags = []
        for nt in range(n_tiles):
            for kt in range(0, k_tiles, 2):
                pair = 2 if kt + 1 < k_tiles else 1  # x4 covers two K-adjacent fragments
                offset = self.ldmatrix_b_offsets(lane, row_stride, n0 + nt * n, k0 + kt * k,
                                                 blocks=2 * pair)
                frags += _ldmatrix(smem, offset + imm, pair, self.dtype, trans=False)
        return frags

    # -------------------------------------------------------------------------- checks

    def _for_nvidia(self, what: str) -> bool:
        """True when tracing for NVIDIA (the shape must then be mma.sync's), False for AMD
        (with an MFMA shape); UnsupportedError for a shape of the other vendor."""
        target = current_target()
        nvidia_shape = self.mma_shape == MMA_SYNC_SHAPE
        if target.is_nvidia != nvidia_shape:
            raise UnsupportedError(f"TiledMmaLoader.{what} of {self.dtype} {self.mma_shape} is "
                                   f"not supported on {target.name}",
                                   fix=f"use one of: {SUPPORTED}")
        if target.is_nvidia and target.sm < 80:
            raise TargetError(f"TiledMmaLoader.{what} needs ldmatrix and mma.sync (sm_80+), "
                              f"not {target.name}", fix="compile for sm_80 or newer")
        return target.is_nvidia

    def _require_tr16(self, what: str) -> None:
        if self.dtype not in (dt.bf16, dt.f16) or self.mma_shape not in TR16_SHAPES:
            raise UnsupportedError(f"{what} of {self.dtype} {self.mma_shape} is not supported",
                                   fix="use bf16 or f16 with mma_shape (32, 32, 16) or "
                                       "(16, 16, 32)")

    def _require_v_fp8(self, what: str) -> None:
        if not self.dtype.is_fp8 or self.mma_shape not in V_FP8_SHAPES:
            raise UnsupportedError(f"{what} of {self.dtype} {self.mma_shape} is not supported",
                                   fix="use f8e4m3 or f8e5m2 with (16, 16, 128) or (32, 32, 64)")

    def _check_tile(self, smem: SharedTensor) -> int:
        if not isinstance(smem, SharedTensor) or len(smem.shape) != 2:
            raise KilnTypeError(f"TiledMmaLoader reads a 2-D kiln.shared tile, got {smem!r}",
                                fix="allocate it with kiln.shared((rows, cols), dtype)")
        if smem.dtype is not self.dtype:
            raise KilnTypeError(f"the LDS tile holds {smem.dtype}, the loader reads {self.dtype}",
                                fix=f"use TiledMmaLoader(kiln.{smem.dtype}, ...)")
        return smem.shape[1]

    def _check_swizzle(self, run: int, what: str) -> None:
        for sw in (self.swizzle, self.swizzle2):
            if sw is not None and not _swizzle_keeps_runs(sw, run):
                raise UnsupportedError(f"{what} reads {run} consecutive elements per lane but "
                                       f"{sw} permutes inside such runs",
                                       fix=f"use a swizzle whose base bit is >= log2({run}) "
                                           "(in element units: Swizzle.to_elements)")

    def _imm_elems(self, imm_offset_bytes: int, run: int) -> int:
        size = self.dtype.itemsize
        if isinstance(imm_offset_bytes, bool) or not isinstance(imm_offset_bytes, int) \
                or not 0 <= imm_offset_bytes <= MAX_IMM_OFFSET or imm_offset_bytes % (run * size):
            raise KilnValueError(f"imm_offset_bytes={imm_offset_bytes!r} must be a multiple of "
                                 f"{run * size} in 0..{MAX_IMM_OFFSET}",
                                 fix="pass a compile-time byte offset aligned to the read size")
        return imm_offset_bytes // size


def _lane() -> Value:

    return lane_id()


def _flat(smem: SharedTensor) -> ir.Value:
    """The LDS tile as a 1-D memref (``memref.collapse_shape``), indexed by element offset."""
    mtype = ir.MemRefType(smem.ir.type)
    size = smem.shape[0] * smem.shape[1]
    flat_type = ir.MemRefType.get([size], mtype.element_type, memory_space=mtype.memory_space)
    return memref.collapse_shape(flat_type, smem.ir, [[0, 1]])


def _index(offset: Any) -> ir.Value:

    return to_index(cast(offset, dt.i32) if isinstance(offset, Value) else offset)


def _lds_read(smem: SharedTensor, offset: Any, width: int, dtype: dt.DType) -> Value:
    vtype = ir.VectorType.get([width], dtype.mlir_type())
    return Value(vector.load(vtype, _flat(smem), [_index(offset)]), dtype)


def _lds_transpose_read(smem: SharedTensor, offset: Any, width: int, dtype: dt.DType) -> Value:
    vtype = ir.VectorType.get([width], dtype.mlir_type())
    op = amdgpu.TransposeLoadOp(vtype, _flat(smem), [_index(offset)])
    mark_async(op, "lgkmcnt")
    return Value(op.result, dtype)


def _ldmatrix(smem: SharedTensor, offset: Any, fragments: int, dtype: dt.DType, *,
              trans: bool) -> list[Value]:
    """``fragments`` m16n8k16 B fragments (``vector<4 x dtype>`` each) from one
    ``ldmatrix.x{2 * fragments}``: fragment ``f`` is blocks ``2f`` and ``2f + 1``."""
    blocks = 2 * fragments
    result = nvgpu.ldmatrix(ir.VectorType.get([blocks, 2], dtype.mlir_type()), _flat(smem),
                            [_index(offset)], trans, blocks)
    pairs = [Value(vector.extract(result, [], [b]), dtype) for b in range(blocks)]
    return [_join(pairs[2 * f:2 * f + 2]) for f in range(fragments)]


def _join(parts: list[Value]) -> Value:
    """Concatenate equal-width vectors (``vector.shuffle``), pairwise."""
    while len(parts) > 1:
        joined = []
        for a, b in zip(parts[::2], parts[1::2]):
            width = a.shape[0] + b.shape[0]
            joined.append(Value(vector.shuffle(a.ir, b.ir, list(range(width))), a.dtype))
        parts = joined
    return parts[0]
