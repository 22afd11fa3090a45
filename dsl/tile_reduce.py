"""``kiln.reduce(tile, op, axis)``: reduce a register tile along rows or columns, across
registers, lanes, warps and the block, with no shuffle or shared-memory code from the user.

The layout says which threads share a row (for ``axis=1``; columns for ``axis=0``): the values
of one thread in the same row are combined in registers (a balanced tree), then the threads
whose index differs in a bit that keeps the row (a "row mask"):

=================  ==========================================================================
mask < warp size   XOR shuffles (:func:`kiln.shuffle.xor_shuffle`: ``shfl.sync.bfly`` on
                   NVIDIA; DPP, ``ds_swizzle`` or ``v_permlane32_swap`` on AMD). The warp is
                   32 threads on NVIDIA and 64 on gfx9, read from the target.
mask >= warp size  one shared-memory stage: every thread stores its warp's partial, a
                   ``barrier``, each thread combines the partials of the warps sharing its row
                   in warp order (so every thread gets the bitwise same result), a ``barrier``
                   (the buffer may be reused by the next iteration of a loop)
=================  ==========================================================================

``op`` is ``"sum"``, ``"max"``, ``"min"`` or any associative, commutative function of two
scalars (a lambda or a ``@kiln.func``). The result is a :class:`~kiln.reg_tile.TileVector` that
broadcasts back onto tiles of the same layout (``x - kiln.reduce(x, "max", 1)``). Values are
32-bit (f32 or i32): cast narrower tiles first.

Example (row softmax)::

    m = kiln.reduce(x, "max", axis=1)
    p = kiln.exp(x - m)
    p = p / kiln.reduce(p, "sum", axis=1)
"""

from __future__ import annotations

from typing import Any, Callable

from mlir.dialects import vector

from . import builder, ops
from .core import dtypes as dt
from .core.errors import KilnTypeError, KilnValueError
from .reg_tile import RegTile, TileVector, _pairwise, _row_keys, _row_structure
from .shared import shared
from .shuffle import butterfly_reduce
from .values import Value

COMBINES: dict[str, Callable[[Any, Any], Any]] = {
    "sum": lambda a, b: a + b,
    "max": ops.maximum,
    "min": ops.minimum,
}


def _combine_of(op: Any) -> Callable[[Value, Value], Value]:
    if isinstance(op, str):
        if op not in COMBINES:
            raise KilnValueError(f"kiln.reduce op {op!r} is not one of {sorted(COMBINES)}",
                                 fix="pass 'sum', 'max', 'min' or a function of two values")
        return COMBINES[op]
    if callable(op):
        return op
    raise KilnTypeError(f"kiln.reduce op must be a name or a function, got {op!r}",
                        fix="e.g. kiln.reduce(x, lambda a, b: a * b, axis=1)")


def _spans(masks: tuple[int, ...]) -> list[int]:
    """Every XOR of a subset of ``masks``, ascending: the offsets of a thread's row-mates."""
    offsets = [0]
    for m in masks:
        offsets = offsets + [o | m for o in offsets]
    return sorted(offsets)


def _across_warps(values: list[list[Value]], masks: tuple[int, ...], combine, threads: int,
                  dtype: dt.DType) -> list[list[Value]]:
    """Combine each scalar over the threads ``t ^ m`` for ``m`` in the span of ``masks``
    (all multiples of the warp size) through one shared buffer, ``[slots, threads]``."""
    if threads & (threads - 1):
        raise KilnValueError(f"kiln.reduce across warps needs a power-of-two thread count, the "
                             f"layout has {threads}", fix="use 64, 128, 256, 512 or 1024 threads")
    flat = [x for line in values for x in line]
    buf = shared((len(flat), threads), dtype, align=16)
    tid = ops.thread_id(0) % threads
    for k, x in enumerate(flat):
        buf[k, tid] = x
    ops.barrier()
    clear = ~sum(masks) & (threads - 1)
    base = tid & clear
    combined = [_pairwise([buf[k, base | o] for o in _spans(masks)], combine)
                for k in range(len(flat))]
    ops.barrier()
    per = len(values[0])
    return [combined[i * per:(i + 1) * per] for i in range(len(values))]


def reduce(tile: RegTile, op: Any = "sum", axis: int = 1) -> TileVector:
    """Reduce ``tile`` along ``axis`` (1: each row over its columns; 0: each column) with
    ``op`` (see the module docs), across every thread of its layout.

    Example: ``mean = kiln.reduce(x, "sum", axis=1) * (1.0 / n)``.
    """
    if not isinstance(tile, RegTile):
        raise KilnTypeError(f"kiln.reduce reduces a register tile, got {type(tile).__name__}",
                            fix="load it first: x = kiln.load(global_tile, layout)")
    if axis not in (0, 1):
        raise KilnValueError(f"kiln.reduce axis must be 0 (columns) or 1 (rows), got {axis!r}",
                             fix="axis=1 reduces each row, axis=0 each column")
    if tile.dtype not in (dt.f32, dt.i32):
        raise KilnTypeError(f"kiln.reduce reduces 32-bit tiles (f32, i32), got {tile.dtype}",
                            fix="kiln.cast(tile, kiln.f32) first")
    combine = _combine_of(op)
    source = tile if axis == 1 else tile.T
    layout = source.layout
    group_of, masks = _row_structure(layout)
    warp = builder.current_target().warp_size
    lane_masks = tuple(m for m in masks if m < warp)
    warp_masks = tuple(m for m in masks if m >= warp)
    gm, gn = source.grid
    lines = []
    for i in range(gm):
        members: list[list[Value]] = [[] for _ in range(max(group_of) + 1)]
        for j in range(gn):
            scalars = source.fragment(i, j)
            for v, g in enumerate(group_of):
                members[g].append(Value(vector.extract(scalars.ir, [], [v]), tile.dtype))
        lines.append([butterfly_reduce(_pairwise(m, combine), lane_masks, combine)
                      for m in members])
    if warp_masks:
        lines = _across_warps(lines, warp_masks, combine, layout.num_threads, tile.dtype)
    return TileVector(lines, group_of, "row" if axis == 1 else "col", _row_keys(layout))
