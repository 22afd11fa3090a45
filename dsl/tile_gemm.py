"""``kiln.gemm(a, b, acc)``: a block-tile matrix multiply with the instruction and the
accumulator's register layout chosen for the target.

``a`` (``BM x BK``) and ``b`` (``BK x BN``) are SharedTiles; the block's warps split the
``BM x BN`` product, each running a grid of MMA atoms:

=========  =======================================================================
sm_90a     ``wgmma.mma_async.m64nNk16`` for tiles from :func:`kiln.tiles.operand_tile`
           (:mod:`kiln.tile_gemm_wgmma`: one 64-row slab per warpgroup, in flight)
NVIDIA     ``mma.sync.m16n8k16`` (bf16/f16 -> f32), sm_80 and up
gfx950     ``v_mfma_f32_32x32x16`` (the double-rate bf16/f16 MFMA), ``32x32x64`` fp8;
           16x16 atoms where a 32x32 grid does not fit the tile
gfx942     ``v_mfma_f32_32x32x8`` / ``16x16x16`` bf16/f16
=========  =======================================================================

The biggest atom that tiles the block over its warps wins; the warps form the most square grid
that divides the tile. Operands reach the registers with ``ldmatrix`` on NVIDIA (16-bit tiles
whose 16-byte chunks stay whole) and per-lane vector loads elsewhere; :func:`operand_swizzle`
gives the SharedTile swizzle that keeps those reads free of bank conflicts. The accumulator is a
:class:`~kiln.reg_tile.RegTile` whose layout is *derived*: the atom's C fragment layout, stamped
over the warps and the atom repeats, as one block-wide :class:`~kiln.layout.ThreadValueLayout`
of the whole ``BM x BN`` tile. So the epilogue is tile code: ``kiln.copy(acc, c_tile)`` stores
it, ``acc + bias``, ``kiln.exp``, ``kiln.reduce(acc, "max", 1)`` work on it as on any register
tile.

Example (one K step; see examples/tutorials/matmul.py)::

    acc = kiln.accumulator(a_s, b_s)            # zeros, f32, the derived layout
    acc = kiln.gemm(a_s, b_s, acc)              # acc += a_s @ b_s
"""

from __future__ import annotations

from typing import Any

from mlir.dialects import vector

from . import builder
from .core import dtypes as dt
from .core.errors import KilnTypeError, KilnValueError, UnsupportedError
from .layout import Layout, ThreadValueLayout, concat_modes
from .layout_algebra import flatten
from .mma import TiledMma, atoms_for
from .reg_tile import RegTile, _concat
from .nvidia import ldmatrix
from .shared_tile import SharedTile
from .swizzle import Swizzle
from .values import Value
from . import tile_gemm_wgmma


def _warp_grids(warps: int, tile_m: int, tile_n: int, m: int, n: int):
    """``(warps_m, warps_n)`` splits of ``warps`` that tile ``tile_m x tile_n`` with ``m x n``
    atoms, most square per-warp block first."""
    grids = [(wm, warps // wm) for wm in range(1, warps + 1) if warps % wm == 0
             and tile_m % (wm * m) == 0 and tile_n % ((warps // wm) * n) == 0]
    return sorted(grids, key=lambda g: abs(tile_m // g[0] - tile_n // g[1]))


def tiled_mma(shape: tuple[int, int, int], dtype: Any) -> TiledMma:
    """The :class:`~kiln.mma.TiledMma` :func:`gemm` uses for a ``(BM, BN, BK)`` block tile of
    ``dtype`` on the kernel's target and block size."""
    tile_m, tile_n, tile_k = shape
    dtype = dt.dtype(dtype)
    target = builder.current_target()
    warps = builder.current().block[0] // target.warp_size
    candidates = [a for a in atoms_for(target)
                  if a.spec.a_dtype is dtype and a.spec.b_dtype is dtype
                  and a.spec.acc_dtype is dt.f32 and a.spec.a_layout is not None
                  and a.spec.b_layout is not None and a.spec.threads == target.warp_size]
    candidates.sort(key=lambda a: -a.spec.m * a.spec.n * a.spec.k)
    for atom in candidates:
        s = atom.spec
        grids = _warp_grids(warps, tile_m, tile_n, s.m, s.n)
        if grids and tile_k % s.k == 0:
            return TiledMma(atom, grids[0][0], grids[0][1], tile_m, tile_n, tile_k)
    have = ", ".join(sorted({f"{a.spec.m}x{a.spec.n}x{a.spec.k}" for a in candidates})) or "none"
    raise UnsupportedError(f"no {dtype} MMA atom of {target.name} ({have}) tiles a {tile_m}x"
                           f"{tile_n}x{tile_k} block over {warps} warps",
                           fix="use tile sizes that are multiples of 32 (64 x 64 x 32 works "
                               "everywhere) and a power-of-two warp count")


def accumulator_layout(tm: TiledMma) -> ThreadValueLayout:
    """The block-wide layout of ``tm``'s accumulator: the atom's C layout (each leaf stride a
    move along rows or columns of the atom) rescaled to the block tile, then the warps
    (``warps_n`` fastest, as :meth:`TiledMma.warp_origin`) and the repeats (row-major grid of
    fragments, as :meth:`TiledMma.accumulator`)."""
    s = tm.atom.spec
    width = tm.tile_n

    def rescale(shape: int, stride: int) -> int:
        if stride % s.n == 0:
            return stride // s.n * width
        return stride

    lanes, values = s.c_layout.layout[0], s.c_layout.layout[1]
    lane_shape, lane_stride = flatten(lanes.shape), flatten(lanes.stride)
    value_shape, value_stride = flatten(values.shape), flatten(values.stride)
    threads = Layout(tuple(lane_shape) + (tm.warps_n, tm.warps_m),
                     tuple(rescale(a, b) for a, b in zip(lane_shape, lane_stride))
                     + (tm.warp_n, tm.warp_m * width))
    regs = Layout(tuple(value_shape) + (tm.rep_n, tm.rep_m),
                  tuple(rescale(a, b) for a, b in zip(value_shape, value_stride))
                  + (s.n, s.m * width))
    return ThreadValueLayout(concat_modes(threads, regs), (tm.tile_m, tm.tile_n))


def operand_swizzle(shape: tuple[int, int], dtype: Any) -> Swizzle | None:
    """The XOR swizzle that keeps a row-major ``shape`` SharedTile of ``dtype`` free of bank
    conflicts when eight lanes read one 16-byte chunk of eight consecutive rows (``ldmatrix``,
    16-byte fragment loads): each row's chunks are XORed with the index of the 128-byte line
    the row sits in, so the eight rows' chunks land in eight different 16-byte bank groups.

    ``None`` when a row holds a single chunk. Example: ``SharedTile((128, 32), kiln.bf16,
    swizzle=kiln.tiles.operand_swizzle((128, 32), kiln.bf16))`` (64-byte rows: ``Swizzle(2, 3,
    3)``)."""
    dtype = dt.dtype(dtype)
    chunk = max(16 // dtype.itemsize, 1)              # elements per 16-byte chunk
    chunks = shape[1] // chunk                         # chunks per row
    if chunks < 2 or chunks & (chunks - 1) or shape[1] % chunk:
        return None
    bits = min(chunks.bit_length() - 1, 3)
    # rows shorter than 128 bytes: XOR with the 128-byte line index (skip the row bits inside
    # one line); longer rows: with the row index itself
    shift = 3 if chunks < 8 else chunks.bit_length() - 1
    return Swizzle(bits, chunk.bit_length() - 1, shift)


def _fragments(tm: TiledMma, a: SharedTile, b: SharedTile, row: Any, col: Any):
    """A and B operand RegTiles of this warp: ``ldmatrix`` (x4 for A, x2.trans for B) on
    NVIDIA where the tiles keep 16-byte rows together, else per-lane vector loads."""
    s = tm.atom.spec
    if builder.current_target().is_nvidia and s.m == 16 and a.dtype.bits == 16 \
            and a.contiguous_width(8) and b.contiguous_width(8):
        a_frags = [ldmatrix.load_a(a, (row + i * 16, kk * 16))
                   for i in range(tm.rep_m) for kk in range(tm.rep_k)]
        b_frags = [ldmatrix.load_b(b, (kk * 16, col + j * 8), trans=True)
                   for kk in range(tm.rep_k) for j in range(tm.rep_n)]
        return (RegTile(a_frags, s.a_layout, (tm.rep_m, tm.rep_k)),
                RegTile(b_frags, s.b_layout, (tm.rep_k, tm.rep_n)))
    return (a.load_fragments(s.a_layout, (tm.rep_m, tm.rep_k), (row, 0)),
            b.load_fragments(s.b_layout, (tm.rep_k, tm.rep_n), (0, col)))


def _check(a: Any, b: Any) -> tuple[int, int, int]:
    if not isinstance(a, SharedTile) or not isinstance(b, SharedTile):
        raise KilnTypeError(f"kiln.gemm multiplies SharedTiles, got {type(a).__name__} and "
                            f"{type(b).__name__}", fix="kiln.copy the operands into SharedTiles")
    if a.shape[1] != b.shape[0] or a.dtype is not b.dtype:
        raise KilnValueError(f"kiln.gemm needs a (M x K) @ (K x N) of one dtype, got "
                             f"{a.shape} {a.dtype} @ {b.shape} {b.dtype}",
                             fix="make a's columns match b's rows, in one dtype")
    return a.shape[0], b.shape[1], a.shape[1]


def _check_accumulator(acc: Any, layout: ThreadValueLayout) -> None:
    if not isinstance(acc, RegTile) or acc.layout != layout or acc.dtype is not dt.f32:
        raise KilnTypeError("kiln.gemm's accumulator must come from kiln.accumulator(a, b) or "
                            "an earlier kiln.gemm of the same tiles",
                            fix="acc = kiln.accumulator(a_s, b_s) before the loop")


def accumulator(a: SharedTile, b: SharedTile, value: float = 0.0) -> RegTile:
    """A ``BM x BN`` f32 tile of ``value`` in the layout :func:`gemm` gives ``a @ b``.

    Example: ``acc = kiln.accumulator(a_s, b_s)`` before the K loop."""
    shape = _check(a, b)
    if tile_gemm_wgmma.applies(a, b):
        return tile_gemm_wgmma.accumulator(a, b, value)
    tm = tiled_mma(shape, a.dtype)
    return RegTile.full(accumulator_layout(tm), (1, 1), value, dt.f32)


def gemm(a: SharedTile, b: SharedTile, acc: RegTile | None = None) -> RegTile:
    """``acc + a @ b`` (``acc`` defaults to zeros) with the block's warps: see the module docs.

    Example: ``acc = kiln.gemm(a_s, b_s, acc)`` after a ``kiln.barrier()`` that follows the
    copies into ``a_s`` and ``b_s``."""
    shape = _check(a, b)
    if tile_gemm_wgmma.applies(a, b):
        layout = tile_gemm_wgmma.accumulator_layout(shape[0], shape[1])
        acc = tile_gemm_wgmma.accumulator(a, b) if acc is None else acc
        _check_accumulator(acc, layout)
        return tile_gemm_wgmma.gemm(a, b, acc)
    tm = tiled_mma(shape, a.dtype)
    layout = accumulator_layout(tm)
    if acc is None:
        acc = RegTile.full(layout, (1, 1), 0.0, dt.f32)
    _check_accumulator(acc, layout)
    s = tm.atom.spec
    row, col = tm.warp_origin()
    a_frags, b_frags = _fragments(tm, a, b, row, col)
    whole, per = acc.fragment(0, 0), s.c_layout.num_values
    frags = [Value(vector.shuffle(whole.ir, whole.ir, list(range(f * per, (f + 1) * per))),
                   dt.f32) for f in range(tm.rep_m * tm.rep_n)]
    out = tm.mma(RegTile(frags, s.c_layout, (tm.rep_m, tm.rep_n)), a_frags, b_frags)
    return RegTile([Value(_concat([f.ir for f in out.fragments]), dt.f32)], layout, (1, 1))
