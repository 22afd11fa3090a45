"""Tiles: global, shared and register views of a matrix, and the copies between them.

=================  ===========================================================================
``GlobalTile``     static-shape window of a 1-D or 2-D ``kiln.Tensor`` at traced offsets, with
                   masked (ragged) rows and columns and a fill value (:mod:`kiln.global_tile`)
``SharedTile``     shared memory / LDS with a layout and swizzle (:mod:`kiln.shared_tile`)
``RegTile``        a tile in registers (MMA fragments or a block-wide layout); elementwise
                   math, row/column reductions, casts (:mod:`kiln.reg_tile`)
=================  ===========================================================================

:func:`copy` moves a GlobalTile into a SharedTile with every thread of the block taking
``width``-element chunks (``width`` derived from the dtype and the shared layout: up to 16 bytes),
synchronously or with ``cp.async`` on sm_80+. ``SharedTile.load_fragments`` and
:mod:`kiln.ldmatrix` take it on into RegTiles. The block-level ops built on these —
``kiln.load``/``kiln.copy`` (:mod:`kiln.tile_copy`), ``kiln.reduce`` (:mod:`kiln.tile_reduce`)
and ``kiln.gemm`` (:mod:`kiln.tile_gemm`) — are described in docs/tiles.md.

Example::

    a_g = kiln.tiles.GlobalTile(a, (64, 32), (row0, k0), row_end=m, col_end=k)
    a_s = kiln.tiles.SharedTile((64, 32), kiln.bf16)
    kiln.tiles.copy(a_g, a_s, threads=128)        # rows past m, columns past k are zero-filled
    kiln.barrier()
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mlir import ir
from mlir.dialects import arith, scf, vector

from . import ops
from .nvidia import cp_async
from .core.errors import KilnTypeError, KilnValueError
from .global_tile import GlobalTile
from .layout import ThreadValueLayout
from .reg_tile import COL_LANES, ROW_LANES, RegTile, where
from .shared_tile import SharedTile
from .tile_vector import TileVector
from .core import dtypes as dt
from .tensor import to_index
from .values import Value, cast
from .tile_gemm import operand_swizzle, register_gather
from .operand_tiles import operand_tile

__all__ = ["GlobalTile", "SharedTile", "RegTile", "TileVector", "where", "copy", "copy_width",
           "store", "row_run_width", "coords", "mask", "operand_swizzle", "operand_tile",
           "register_gather", "ROW_LANES",
           "COL_LANES"]

MAX_COPY_BYTES = 16


def copy_width(dst: SharedTile) -> int:
    """The widest chunk (elements, at most 16 bytes) contiguous in ``dst``'s rows."""
    width = max(MAX_COPY_BYTES // dst.dtype.itemsize, 1)
    while width > 1 and not dst.contiguous_width(width):
        width //= 2
    return width


def copy(src: GlobalTile, dst: SharedTile, *, threads: int, async_copy: bool = False,
         width: int | None = None, dst_origin: tuple[Any, Any] = (0, 0)):
    """Copy ``src`` into ``dst[dst_origin + ...]`` with ``threads`` threads (thread ``t``
    takes chunks ``t, t + threads, ...`` in row-major order); masked elements (rows past
    ``src.row_end``, columns past ``src.col_end``) are written as ``src.fill``.
    ``dst_origin`` selects e.g. one stage of a multi-buffered SharedTile.

    ``async_copy=True`` issues ``cp.async`` and returns the list of tokens (commit them with
    :func:`kiln.cp_async.commit`; ``threads`` must divide the chunks); otherwise loads and
    stores, returning None (threads past the last chunk idle).
    """
    if not isinstance(src, GlobalTile) or not isinstance(dst, SharedTile):
        raise KilnTypeError("kiln.tiles.copy copies a GlobalTile into a SharedTile",
                            fix="wrap the operands in GlobalTile / SharedTile")
    if any(s > d for s, d in zip(src.shape, dst.shape)) or src.dtype is not dst.dtype:
        raise KilnValueError(f"cannot copy a {src.shape} {src.dtype} GlobalTile into a "
                             f"{dst.shape} {dst.dtype} SharedTile",
                             fix="use a SharedTile at least as large, of the same dtype")
    if async_copy and src.fill != 0:
        raise KilnValueError(f"cp.async zero-fills masked elements; this GlobalTile's fill is "
                             f"{src.fill}", fix="copy synchronously (async_copy=False), or "
                                                "fill=0 and apply the fill value in registers")
    width = copy_width(dst) if width is None else width
    rows, cols = src.shape
    chunks_per_row = cols // width
    chunks = rows * chunks_per_row
    if async_copy and chunks % threads:
        raise KilnValueError(f"{chunks} chunks of {width} elements do not split over {threads} "
                             "threads", fix="use a thread count that divides the chunk count")
    tid = ops.thread_id(0) % threads
    tokens = []
    first = None
    for step in range(-(-chunks // threads)):
        chunk = tid + step * threads
        r, c = chunk // chunks_per_row, (chunk % chunks_per_row) * width
        if async_copy:
            # a step a constant offset from the first everywhere (whole swizzle periods of
            # rows apart) adds an immediate to its address: LLVM keeps one register, not one
            # hoisted address per step
            delta = _step_delta(dst, step * threads, threads, chunks_per_row, width) \
                if first is not None and all(type(o) is int and o == 0 for o in dst_origin) \
                else None
            offset = None if delta is None else first + delta
            # whole rows per step: the source row is the first chunk's plus a constant
            src_row = None if first is None or threads % chunks_per_row else \
                arith.addi(first_row, to_index(step * threads // chunks_per_row))
            tokens.append(cp_async.copy(dst, (dst_origin[0] + r, dst_origin[1] + c), src, (r, c),
                                        width=width, dst_offset=offset, src_row=src_row))
            if step == 0:
                first, first_row = dst.offset(r, c), to_index(src.indices(r, c)[0])
        elif (step + 1) * threads > chunks:  # the last, partial step: threads past the end idle
            guard = scf.IfOp((chunk < chunks).ir, [], has_else=False)
            with ir.InsertionPoint(guard.then_block):
                dst.store(dst_origin[0] + r, dst_origin[1] + c, src.load(r, c, width=width))
                scf.YieldOp([])
        else:
            dst.store(dst_origin[0] + r, dst_origin[1] + c, src.load(r, c, width=width))
    return tokens if async_copy else None


def _step_delta(dst: SharedTile, shift: int, threads: int, chunks_per_row: int,
                width: int) -> int | None:
    """``offset(chunk t + shift) - offset(chunk t)`` of ``dst`` when it is one constant for
    every thread ``t``, else None."""
    chunk = np.arange(threads)
    offsets = dst.offsets()

    def at(k):
        return offsets[k // chunks_per_row, k % chunks_per_row * width]

    diff = at(chunk + shift) - at(chunk)
    return int(diff[0]) if np.all(diff == diff[0]) else None


def row_run_width(tv: ThreadValueLayout) -> int:
    """The widest power-of-two run of a lane's values that are consecutive, aligned columns of
    one row (e.g. 2 for the mma.sync accumulator): the vector width of a fragment store."""
    rows, cols = tv.coords()
    width = tv.num_values
    while width > 1:
        if tv.num_values % width == 0:
            r = rows.reshape(rows.shape[0], -1, width)
            c = cols.reshape(cols.shape[0], -1, width)
            if np.all(r == r[..., :1]) and np.all(c == c[..., :1] + np.arange(width)) \
                    and np.all(c[..., 0] % width == 0):
                return width
        width //= 2
    return 1


def store(tile: RegTile, dst: GlobalTile, origin: tuple[Any, Any] = (0, 0), *,
          lane: Any = None) -> None:
    """Write ``tile`` to ``dst`` with its top-left at tile position ``origin`` (masked rows
    and columns are skipped), in vectors of :func:`row_run_width`.
    Example: ``store(acc, c_tile, warp_origin)``.
    """
    if not isinstance(tile, RegTile) or not isinstance(dst, GlobalTile):
        raise KilnTypeError("kiln.tiles.store writes a RegTile into a GlobalTile",
                            fix="wrap the output tensor in kiln.tiles.GlobalTile")
    if tile.dtype is not dst.dtype:
        raise KilnTypeError(f"cannot store a {tile.dtype} RegTile into a {dst.dtype} tensor",
                            fix=f"tile.cast(kiln.{dst.dtype}) first")
    tv = tile.layout
    if lane is None:
        lane = ops.lane_id() % tv.num_threads
    width = row_run_width(tv)
    fr, fc = tv.tile
    for i in range(tile.grid[0]):
        for j in range(tile.grid[1]):
            frag = tile.fragment(i, j)
            for v in range(0, tv.num_values, width):
                r, c = tv(lane, v)
                piece = Value(vector.shuffle(frag.ir, frag.ir, list(range(v, v + width))),
                              frag.dtype)
                dst.store(origin[0] + i * fr + r, origin[1] + j * fc + c, piece)


def coords(layout: ThreadValueLayout) -> tuple[RegTile, RegTile]:
    """i32 register tiles of every element's row and column in a block-wide ``layout`` (thread
    ``t`` holds ``layout(t % num_threads, v)``): masks in registers. Example::

        _, cols = kiln.tiles.coords(tv)
        xc = kiln.where(cols < n, x - mean, 0.0)
    """
    return _coords(layout, 1)


def _coords(layout: ThreadValueLayout, width: int) -> tuple[RegTile, RegTile]:
    """:func:`coords`, every value giving the coordinates of the first value of its run of
    ``width`` (the first element of its vector access)."""
    thread = ops.thread_id(0) % layout.num_threads
    vtype = ir.VectorType.get([layout.num_values], dt.i32.mlir_type())
    every = layout.coords()                           # [threads, values] rows and columns
    firsts = np.arange(layout.num_values) // width * width
    out = []
    for k, first in enumerate(layout(thread, 0)):
        delta = every[k][:, firsts] - every[k][:, :1]
        if np.all(delta == delta[:1]):
            # value v is value 0 plus a constant: one add per use, and `col + k0` adds k0 once
            steps = arith.constant(vtype, ir.DenseElementsAttr.get(
                np.ascontiguousarray(delta[0], np.int32), type=vtype))
            base = vector.broadcast(vtype, cast(first, dt.i32).ir)
            out.append(Value(arith.addi(base, steps), dt.i32))
        else:
            out.append(Value(vector.from_elements(vtype, [cast(layout(thread, v)[k], dt.i32).ir
                                                          for v in firsts]), dt.i32))
    return tuple(RegTile([v], layout, (1, 1)) for v in out)


def mask(tile: GlobalTile, layout: ThreadValueLayout) -> RegTile:
    """The i1 register tile, in ``layout``, of the elements of ``tile`` inside its ``row_end``
    and ``col_end``: those ``kiln.load`` reads rather than fills. Where ``col_multiple`` and
    ``align`` make every vector access wholly inside or wholly past ``col_end``, the columns
    are compared once per access, not per element (fewer registers held across a loop).
    Example (a layer norm's centred row, 0 past the row's end)::

        xc = kiln.where(kiln.tiles.mask(x_g, tv), x - mean, 0.0)
    """
    if not isinstance(tile, GlobalTile) or not isinstance(layout, ThreadValueLayout):
        raise KilnTypeError(f"kiln.tiles.mask takes a GlobalTile and a layout, got "
                            f"{type(tile).__name__} and {type(layout).__name__}",
                            fix="kiln.tiles.mask(kiln.GlobalTile(t, shape, origin, col_end=n), tv)")
    width = min(row_run_width(layout), max(MAX_COPY_BYTES // tile.dtype.itemsize, 1))
    rows, cols = _coords(layout, width if tile.whole_chunks(width) else 1)
    inside = None
    if tile.col_end is not None:
        inside = cols + tile.origin[1] < tile.col_end
    if tile.row_end is not None:
        row_inside = rows + tile.origin[0] < tile.row_end
        inside = row_inside if inside is None else inside & row_inside
    return rows >= 0 if inside is None else inside
