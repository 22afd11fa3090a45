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
that divides the tile, or the grid ``kiln.accumulator(..., warps=)`` asks for (``"rows"``: each
warp owns whole rows). ``a`` may also be a register tile (:func:`register_gather`: a register
renaming for the ``mma.sync`` accumulator of a ``"rows"`` gemm, FlashAttention-2's P, else a
shared-memory stage), and ``b`` a transposed view (``k_s.T``). Operands reach the registers
with ``ldmatrix`` on NVIDIA (16-bit tiles whose 16-byte chunks stay whole) and per-lane vector
loads elsewhere; :func:`operand_swizzle` gives the SharedTile swizzle that keeps those reads
free of bank conflicts. The accumulator is a
:class:`~kiln.reg_tile.RegTile` whose layout is *derived*: the atom's C fragment layout, stamped
over the warps and the atom repeats, as one block-wide :class:`~kiln.layout.ThreadValueLayout`
of the whole ``BM x BN`` tile. So the epilogue is tile code: ``kiln.copy(acc, c_tile)`` stores
it, ``acc + bias``, ``kiln.exp``, ``kiln.reduce(acc, "max", 1)`` work on it as on any register
tile.

Example (one K step; see examples/tutorials/matmul.py)::

    acc = kiln.accumulator(a_s, b_s)            # zeros, f32, the derived layout
    acc = kiln.gemm(a_s, b_s, acc)              # acc += a_s @ b_s

Attention (examples/tutorials/attention.py)::

    s = kiln.gemm(q_s, k_s.T, kiln.accumulator(q_s, k_s.T, warps="rows"))
    o = kiln.gemm(kiln.cast(p, kiln.bf16), v_s, o)       # p: s's layout, o: warps="rows"
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mlir.dialects import vector

from . import builder, ops
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


def _candidates(shape: tuple[int, int, int], dtype: Any) -> list[TiledMma]:
    """Every :class:`~kiln.mma.TiledMma` of a ``(BM, BN, BK)`` block tile of ``dtype`` on the
    kernel's target and block size, preferred first: the biggest atom, the most square grid."""
    tile_m, tile_n, tile_k = shape
    target = builder.current_target()
    warps = builder.current().block[0] // target.warp_size
    atoms = [a for a in atoms_for(target)
             if a.spec.a_dtype is dtype and a.spec.b_dtype is dtype
             and a.spec.acc_dtype is dt.f32 and a.spec.a_layout is not None
             and a.spec.b_layout is not None and a.spec.threads == target.warp_size]
    atoms.sort(key=lambda a: -a.spec.m * a.spec.n * a.spec.k)
    return [TiledMma(atom, wm, wn, tile_m, tile_n, tile_k) for atom in atoms
            if tile_k % atom.spec.k == 0
            for wm, wn in _warp_grids(warps, tile_m, tile_n, atom.spec.m, atom.spec.n)]


def _check_warps(warps: Any) -> tuple[int, int] | None:
    if warps is None:
        return None
    block = builder.current().block[0] // builder.current_target().warp_size
    if warps == "rows":
        return block, 1
    if (not isinstance(warps, tuple) or len(warps) != 2
            or any(not isinstance(w, int) or w <= 0 for w in warps)
            or warps[0] * warps[1] != block):
        raise KilnValueError(f"warps must be \"rows\" or (warps_m, warps_n) with warps_m * "
                             f"warps_n = {block} (the block's warps), got {warps!r}",
                             fix=f"e.g. warps=({block}, 1): each warp owns whole rows")
    return warps


def tiled_mma(shape: tuple[int, int, int], dtype: Any,
              warps: tuple[int, int] | None = None) -> TiledMma:
    """The :class:`~kiln.mma.TiledMma` :func:`gemm` uses for a ``(BM, BN, BK)`` block tile of
    ``dtype`` on the kernel's target and block size (``warps``: that warp grid only)."""
    tile_m, tile_n, tile_k = shape
    dtype = dt.dtype(dtype)
    tms = [tm for tm in _candidates(shape, dtype)
           if warps is None or (tm.warps_m, tm.warps_n) == warps]
    if tms:
        return tms[0]
    target = builder.current_target()
    count = builder.current().block[0] // target.warp_size
    have = ", ".join(sorted({f"{a.spec.m}x{a.spec.n}x{a.spec.k}" for a in atoms_for(target)
                             if a.spec.a_dtype is dtype})) or "none"
    grid = f" in a {warps[0]} x {warps[1]} warp grid" if warps else ""
    raise UnsupportedError(f"no {dtype} MMA atom of {target.name} ({have}) tiles a {tile_m}x"
                           f"{tile_n}x{tile_k} block over {count} warps{grid}",
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


def register_gather(tm: TiledMma, layout: ThreadValueLayout) -> list[list[int]] | None:
    """For each A fragment of ``tm`` (row-major over ``rep_m x rep_k``), the indices of a
    thread's registers in ``layout`` (a block-wide ``BM x BK`` layout) that hold its values,
    the same for every thread; None when some thread does not hold its own A elements.

    The ``mma.sync`` m16n8 accumulator of a ``(warps, 1)`` grid gives one: its fragments
    ``(i, 2kk)`` and ``(i, 2kk + 1)`` side by side are the m16n8k16 A fragment ``(i, kk)``
    (FlashAttention-2's P), so the conversion is a register renaming. MFMA accumulators give
    none (a lane holds a column of C but a row of A)."""
    s = tm.atom.spec
    if layout.num_threads != tm.threads or tuple(layout.tile) != (tm.tile_m, tm.tile_k):
        return None
    rows, cols = layout.coords()
    owner = np.empty(tm.tile_m * tm.tile_k, np.int64)
    slot = np.empty_like(owner)
    owner[rows * tm.tile_k + cols] = np.arange(layout.num_threads)[:, None]
    slot[rows * tm.tile_k + cols] = np.arange(layout.num_values)[None, :]
    thread = np.arange(tm.threads)
    row0 = (thread // s.threads // tm.warps_n * tm.warp_m)[:, None]
    a_rows, a_cols = s.a_layout.coords()
    a_rows, a_cols = a_rows[thread % s.threads], a_cols[thread % s.threads]
    gather = []
    for i in range(tm.rep_m):
        for kk in range(tm.rep_k):
            where = (row0 + i * s.m + a_rows) * tm.tile_k + kk * s.k + a_cols
            if not np.all(owner[where] == thread[:, None]) or \
                    not np.all(slot[where] == slot[where][:1]):
                return None
            gather.append([int(x) for x in slot[where][0]])
    return gather


def _a_from_registers(tm: TiledMma, a: RegTile, row: Any) -> RegTile:
    """The A fragments of this warp from the register tile ``a``: a register renaming where
    :func:`register_gather` finds one, else through a shared-memory stage."""
    s = tm.atom.spec
    gather = register_gather(tm, a.layout) if a.grid == (1, 1) else None
    if gather is not None:
        whole = a.fragment(0, 0)
        return RegTile([Value(vector.shuffle(whole.ir, whole.ir, g), a.dtype) for g in gather],
                       s.a_layout, (tm.rep_m, tm.rep_k))
    stage = SharedTile(a.shape, a.dtype, swizzle=operand_swizzle(a.shape, a.dtype))
    ops.barrier()                  # the stage is reused by the next call in a loop
    _store_stage(a, stage)
    ops.barrier()
    return _a_from_shared(tm, stage, row)


def _store_stage(a: RegTile, stage: SharedTile) -> None:
    """Every thread stores its registers of ``a`` into ``stage``, in runs of up to 16 bytes of
    consecutive columns."""
    layout = a.layout
    if layout.num_threads != builder.current().block[0]:
        raise KilnValueError(f"kiln.gemm takes A from a block-wide register tile; this one is "
                             f"held by {layout.num_threads} threads",
                             fix="pass an accumulator of kiln.gemm (cast), or kiln.load it in "
                                 "a kiln.layout.blocked layout of the block's threads")
    rows, cols = layout.coords()
    width = max(16 // a.dtype.itemsize, 1)
    while width > 1:
        if layout.num_values % width == 0:
            r = rows.reshape(rows.shape[0], -1, width)
            c = cols.reshape(cols.shape[0], -1, width)
            if np.all(r == r[..., :1]) and np.all(c == c[..., :1] + np.arange(width)) and \
                    np.all(c[..., 0] % width == 0) and stage.contiguous_width(width):
                break
        width //= 2
    thread = ops.thread_id(0) % layout.num_threads
    fr, fc = layout.tile
    for i in range(a.grid[0]):
        for j in range(a.grid[1]):
            frag = a.fragment(i, j)
            for v in range(0, layout.num_values, width):
                r, c = layout(thread, v)
                stage.store(i * fr + r, j * fc + c,
                            Value(vector.shuffle(frag.ir, frag.ir, list(range(v, v + width))),
                                  a.dtype))


def _constant_delta(offsets: np.ndarray, dr: int, dc: int) -> int | None:
    """``offset(r + dr, c + dc) - offset(r, c)`` when it is one constant over the whole tile
    (e.g. whole swizzle periods of rows apart), else None."""
    rows, cols = offsets.shape
    if abs(dr) >= rows or abs(dc) >= cols:
        return None
    here = offsets[max(0, -dr):rows - max(0, dr), max(0, -dc):cols - max(0, dc)]
    there = offsets[max(0, dr):rows - max(0, -dr), max(0, dc):cols - max(0, -dc)]
    diff = there - here
    return int(diff.flat[0]) if np.all(diff == diff.flat[0]) else None


def _ldmatrix_grid(tile: SharedTile, origin: tuple[Any, Any], steps: list[tuple[int, int]],
                   blocks: Any, trans: bool) -> list[Value]:
    """``ldmatrix`` at ``origin + step`` for every step. A step a constant offset away from an
    earlier one everywhere in the tile reuses its address plus an immediate: LLVM hoists every
    distinct address out of the K/V loop, where each would hold a register."""
    offsets = tile.offsets()
    bases: list[tuple[tuple[int, int], Any]] = []
    out = []
    for step in steps:
        for (r, c), base in bases:
            delta = _constant_delta(offsets, step[0] - r, step[1] - c)
            if delta is not None:
                offset = base + delta
                break
        else:
            offset = ldmatrix.row_offset(tile, (origin[0] + step[0], origin[1] + step[1]),
                                         blocks, ops.lane_id())
            bases.append((step, offset))
        out.append(ldmatrix.ldmatrix(tile, None, blocks, trans=trans, offset=offset))
    return out


def _a_from_shared(tm: TiledMma, a: SharedTile, row: Any) -> RegTile:
    s = tm.atom.spec
    if _ldmatrix(tm, a) and a.contiguous_width(8):
        steps = [(i * 16, kk * 16) for i in range(tm.rep_m) for kk in range(tm.rep_k)]
        return RegTile(_ldmatrix_grid(a, (row, 0), steps, ldmatrix.A_BLOCKS, False),
                       s.a_layout, (tm.rep_m, tm.rep_k))
    return a.load_fragments(s.a_layout, (tm.rep_m, tm.rep_k), (row, 0))


def _ldmatrix(tm: TiledMma, tile: SharedTile) -> bool:
    return builder.current_target().is_nvidia and tm.atom.spec.m == 16 and tile.dtype.bits == 16


# ldmatrix.x4 blocks of B fragments j and j + 1, and x2 of one: stored K x N (.trans) / N x K
PAIR_BLOCKS = {True: ((0, 0), (8, 0), (0, 8), (8, 8)), False: ((0, 0), (0, 8), (8, 0), (8, 8))}
ONE_BLOCKS = {True: ((0, 0), (8, 0)), False: ((0, 0), (0, 8))}


def _fragments(tm: TiledMma, a: SharedTile | RegTile, b: SharedTile, row: Any, col: Any):
    """A and B operand RegTiles of this warp: A from registers (:func:`_a_from_registers`) or
    shared memory; ``ldmatrix`` on NVIDIA where the tiles keep 16-byte rows together (B stored
    K x N: ``.trans``; stored N x K, a ``k_s.T`` view: plain; two B fragments per
    ``ldmatrix.x4``), else per-lane vector loads."""
    s = tm.atom.spec
    a_frags = (_a_from_registers(tm, a, row) if isinstance(a, RegTile)
               else _a_from_shared(tm, a, row))
    if not _ldmatrix(tm, b) or not (b.contiguous_width(8) or b.T.contiguous_width(8)):
        return a_frags, b.load_fragments(s.b_layout, (tm.rep_k, tm.rep_n), (0, col))
    trans = b.contiguous_width(8)
    src = b if trans else b.T
    origin = (0, col) if trans else (col, 0)
    def step(kk, j):
        return (kk * 16, j * 8) if trans else (j * 8, kk * 16)

    pairs = [(kk, j) for kk in range(tm.rep_k) for j in range(0, tm.rep_n - 1, 2)]
    loaded = dict(zip(pairs, _ldmatrix_grid(src, origin, [step(*p) for p in pairs],
                                            PAIR_BLOCKS[trans], trans)))
    singles = [(kk, tm.rep_n - 1) for kk in range(tm.rep_k)] if tm.rep_n % 2 else []
    loaded.update(zip(singles, _ldmatrix_grid(src, origin, [step(*p) for p in singles],
                                              ONE_BLOCKS[trans], trans)))
    b_frags = []
    for kk in range(tm.rep_k):
        for j in range(0, tm.rep_n, 2):
            x = loaded[kk, j]
            if j + 1 == tm.rep_n:
                b_frags.append(x)
                continue
            b_frags += [Value(vector.shuffle(x.ir, x.ir, list(range(h, h + 4))), b.dtype)
                        for h in (0, 4)]
    return a_frags, RegTile(b_frags, s.b_layout, (tm.rep_k, tm.rep_n))


def _check(a: Any, b: Any) -> tuple[int, int, int]:
    if not isinstance(a, (SharedTile, RegTile)) or not isinstance(b, SharedTile):
        raise KilnTypeError(f"kiln.gemm multiplies a SharedTile or RegTile by a SharedTile, got "
                            f"{type(a).__name__} and {type(b).__name__}",
                            fix="kiln.copy the operands into SharedTiles")
    if a.shape[1] != b.shape[0] or a.dtype is not b.dtype:
        raise KilnValueError(f"kiln.gemm needs a (M x K) @ (K x N) of one dtype, got "
                             f"{a.shape} {a.dtype} @ {b.shape} {b.dtype}",
                             fix="make a's columns match b's rows, in one dtype "
                                 "(kiln.cast a register tile to the SharedTile's dtype)")
    return a.shape[0], b.shape[1], a.shape[1]


def _foreign_accumulator() -> KilnTypeError:
    return KilnTypeError("kiln.gemm's accumulator must come from kiln.accumulator(a, b) or an "
                         "earlier kiln.gemm of the same tiles",
                         fix="acc = kiln.accumulator(a_s, b_s) before the loop")


def _choose(a: SharedTile | RegTile, b: SharedTile, warps: Any = None,
            layout: ThreadValueLayout | None = None) -> TiledMma:
    """The TiledMma for ``a @ b``: with ``layout``, the one whose accumulator it is; with a
    register ``a``, one that takes A from its registers without moving data if any does."""
    shape = _check(a, b)
    warps = _check_warps(warps)
    if layout is None and not isinstance(a, RegTile):
        return tiled_mma(shape, a.dtype, warps)
    tms = [tm for tm in _candidates(shape, a.dtype)
           if (warps is None or (tm.warps_m, tm.warps_n) == warps)
           and (layout is None or accumulator_layout(tm) == layout)]
    if isinstance(a, RegTile):
        tms.sort(key=lambda tm: register_gather(tm, a.layout) is None)
    if not tms:
        if layout is None:
            return tiled_mma(shape, a.dtype, warps)
        raise _foreign_accumulator()
    return tms[0]


def accumulator(a: SharedTile | RegTile, b: SharedTile, value: float = 0.0, *,
                warps: tuple[int, int] | None = None) -> RegTile:
    """A ``BM x BN`` f32 tile of ``value`` in the layout :func:`gemm` gives ``a @ b``.

    ``warps=(warps_m, warps_n)`` picks the warp grid (default: the most square one);
    ``warps="rows"`` is ``(num_warps, 1)``: each warp owns whole rows, so row reductions stay
    inside a warp and the accumulator, cast, is the A operand of the next gemm (attention).

    Example: ``acc = kiln.accumulator(a_s, b_s)`` before the K loop.
    """
    # WGMMA's warps already own whole rows (16 each): "rows" is its layout too
    if warps in (None, "rows") and tile_gemm_wgmma.applies(a, b):
        _check(a, b)
        return tile_gemm_wgmma.accumulator(a, b, value)
    tm = _choose(a, b, warps)
    return RegTile.full(accumulator_layout(tm), (1, 1), value, dt.f32)


def gemm(a: SharedTile | RegTile, b: SharedTile, acc: RegTile | None = None) -> RegTile:
    """``acc + a @ b`` (``acc`` defaults to zeros) with the block's warps: see the module docs.
    ``a`` may be a register tile (e.g. softmax probabilities cast to bf16); ``b`` may be a
    transposed view (``k_s.T``).

    Example: ``acc = kiln.gemm(a_s, b_s, acc)`` after a ``kiln.barrier()`` that follows the
    copies into ``a_s`` and ``b_s``."""
    if acc is not None and (not isinstance(acc, RegTile) or acc.dtype is not dt.f32):
        raise _foreign_accumulator()
    if tile_gemm_wgmma.applies(a, b) and (acc is None or acc.layout == tile_gemm_wgmma
                                          .accumulator_layout(a.shape[0], b.shape[1])):
        _check(a, b)
        acc = tile_gemm_wgmma.accumulator(a, b) if acc is None else acc
        return tile_gemm_wgmma.gemm(a, b, acc)
    tm = _choose(a, b, layout=None if acc is None else acc.layout)
    layout = accumulator_layout(tm)
    if acc is None:
        acc = RegTile.full(layout, (1, 1), 0.0, dt.f32)
    s = tm.atom.spec
    row, col = tm.warp_origin()
    a_frags, b_frags = _fragments(tm, a, b, row, col)
    whole, per = acc.fragment(0, 0), s.c_layout.num_values
    frags = [Value(vector.shuffle(whole.ir, whole.ir, list(range(f * per, (f + 1) * per))),
                   dt.f32) for f in range(tm.rep_m * tm.rep_n)]
    out = tm.mma(RegTile(frags, s.c_layout, (tm.rep_m, tm.rep_n)), a_frags, b_frags)
    return RegTile([Value(_concat([f.ir for f in out.fragments]), dt.f32)], layout, (1, 1))
