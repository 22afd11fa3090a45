"""``kiln.reduce(tile, op, axis)``: reduce a register tile along rows or columns, across
registers, lanes, warps and the block, with no shuffle or shared-memory code from the user.

The layout says which threads share a row (for ``axis=1``; columns for ``axis=0``): the values
of one thread in the same row are combined in registers (a balanced tree), then the threads
whose index differs in a bit that keeps the row (a "row mask"):

=================  ==========================================================================
mask < warp size   XOR shuffles (:func:`kiln.shuffle.xor_shuffle`: ``shfl.sync.bfly`` on
                   NVIDIA; DPP, ``ds_swizzle`` or ``v_permlane32_swap`` on AMD). The warp is
                   32 threads on NVIDIA and 64 on gfx9, read from the target.
mask >= warp size  one shared-memory stage: each warp stores its partial of each row (the
                   partials of a row's warps side by side), a ``barrier``, each thread reads
                   its row's partials with broadcast 16-byte loads and combines them in warp
                   order (so every thread gets the bitwise same result), a ``barrier`` (the
                   buffer may be reused by the next iteration of a loop)
=================  ==========================================================================

``op`` is ``"sum"``, ``"max"``, ``"min"`` or any associative, commutative function of two
scalars (a lambda or a ``@kiln.func``). The result is a :class:`~kiln.tile_vector.TileVector` that
broadcasts back onto tiles of the same layout (``x - kiln.reduce(x, "max", 1)``). Values are
32-bit (f32 or i32): cast narrower tiles first.

``cluster=True`` goes on across the CTAs of the kernel's thread-block cluster (sm_90+, declared
by :func:`cluster_rank`): each CTA stores its block's value into slot ``rank`` of every CTA's
shared buffer (:func:`kiln.nvidia.dsmem.store_remote`), a cluster barrier, and each CTA
combines the slots in rank order (every CTA gets the bitwise same result). The barrier is split
so one round trip orders each exchange: ``cluster_rank`` leaves an arrive standing, an exchange
waits on it (the peers have read the previous exchange), stores, arrives and waits (the stores
landed), reads, and arrives again. Every thread of every CTA of the cluster must reach each
``cluster=True`` reduce. Without a cluster (or one of one CTA) it is the block's reduce, so
``kiln.cluster_rank(SPLIT)`` with ``SPLIT = 1`` keeps a kernel portable.

Example (row softmax)::

    m = kiln.reduce(x, "max", axis=1)
    p = kiln.exp(x - m)
    p = p / kiln.reduce(p, "sum", axis=1)

Example (a row split over a cluster of ``SPLIT`` CTAs, each holding ``BLOCK // SPLIT``
columns)::

    part = kiln.cluster_rank(SPLIT) * (BLOCK // SPLIT)
    x = kiln.load(kiln.GlobalTile(x_t, (1, BLOCK // SPLIT), (row, part), col_end=n), tv)
    total = kiln.reduce(x, "sum", axis=1, cluster=True)
"""

from __future__ import annotations

from typing import Any, Callable

from mlir import ir
from mlir.dialects import nvvm, scf, vector

from . import builder, ops
from .core import dtypes as dt
from .core.errors import KilnTypeError, KilnValueError
from .nvidia import sync as nvidia_sync
from .nvidia.dsmem import store_remote
from .reg_tile import RegTile
from .tile_vector import TileVector, pairwise, row_keys, row_structure
from .shared import shared
from .shuffle import butterfly_reduce
from .values import Value, constant

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


def _bits_of(x: Value, bits: int) -> Value:
    """The bits of ``x`` selected by the constant mask ``bits``, packed low (``pext``): a shift
    and an ``and`` per run of consecutive bits."""
    out, packed, b = None, 0, 0
    while bits >> b:
        if not bits >> b & 1:
            b += 1
            continue
        run = b
        while bits >> run & 1:
            run += 1
        part = ((x >> b) if b else x) & ((1 << (run - b)) - 1)
        part = part << packed if packed else part
        out = part if out is None else out | part
        packed, b = packed + run - b, run
    return constant(0, dt.i32) if out is None else out


def _across_warps(values: list[list[Value]], masks: tuple[int, ...],
                  lane_masks: tuple[int, ...], combine, threads: int,
                  dtype: dt.DType) -> list[list[Value]]:
    """Combine each scalar over the threads ``t ^ m`` for ``m`` in the span of ``masks``
    (all multiples of the warp size) through one shared buffer. After the shuffles the lanes
    that differ in ``lane_masks`` hold equal values (``combine`` commutes), so they all store
    it to one slot, the partials of a row's warps side by side; every thread reads its row's
    partials with broadcast vector loads (one access per 4 warps, not one per warp) and
    combines them in warp order (every thread gets the bitwise same result)."""
    if threads & (threads - 1):
        raise KilnValueError(f"kiln.reduce across warps needs a power-of-two thread count, the "
                             f"layout has {threads}", fix="use 64, 128, 256, 512 or 1024 threads")
    flat = [x for line in values for x in line]
    warps = 1 << len(masks)
    lanes = sum(lane_masks)
    rest = (threads - 1) & ~sum(masks) & ~lanes
    buf = shared((len(flat), (threads // warps) // (1 << len(lane_masks)) * warps), dtype,
                 align=16)
    tid = ops.thread_id(0) % threads
    row = _bits_of(tid, rest) * warps
    slot = row + _bits_of(tid, sum(masks))
    for k, x in enumerate(flat):   # the lanes of a warp store one (equal) value
        buf[k, slot] = x
    ops.barrier()
    width = min(warps, 4)
    combined = []
    for k in range(len(flat)):
        parts = []
        for j in range(0, warps, width):
            vec = buf.load(k, row + j, width=width, align=4 * width) if width > 1 \
                else buf[k, row + j]
            parts += [Value(vector.extract(vec.ir, [], [v]), dtype) for v in range(width)] \
                if width > 1 else [vec]
        combined.append(pairwise(parts, combine))
    ops.barrier()
    per = len(values[0])
    return [combined[i * per:(i + 1) * per] for i in range(len(values))]


def cluster_rank(size: int) -> Value:
    """Run the kernel in clusters of ``size`` CTAs along x and return this CTA's rank in its
    cluster (an i32, ``0 .. size - 1``); ``reduce(..., cluster=True)`` then combines across
    them. ``size`` 1 is no cluster on every target (rank 0); more needs sm_90+ and a grid that
    is a multiple of ``size``. Call it once, at the top of the kernel: it leaves a cluster
    barrier arrive pending for the first exchange (``kiln.nvidia_asm.cluster_sync`` keeps that
    so; a hand-written ``barrier.cluster`` must wait first).

    Example: ``part = kiln.cluster_rank(SPLIT) * (BLOCK // SPLIT)`` (this CTA's columns).
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise KilnValueError(f"kiln.cluster_rank size must be a positive int, got {size!r}",
                             fix="pass a compile-time constant, e.g. kiln.cluster_rank(SPLIT)")
    if size == 1:
        return constant(0, dt.i32)
    nvidia_sync.CLUSTER_SYNC.require(builder.current_target(),
                                     f"kiln.cluster_rank({size}) (size 1 runs on every target)")
    nvidia_sync.cluster_dims(size)
    nvvm.cluster_arrive()   # the standing arrive the first cluster exchange waits on
    builder.current().cluster_arrive_standing = True
    return nvidia_sync.cluster_ctarank()


def _across_cluster(values: list[list[Value]], combine, dtype: dt.DType,
                    size: int) -> list[list[Value]]:
    """Combine each scalar (the same in every thread of a CTA) over the ``size`` CTAs of the
    cluster through a ``[slots, size]`` shared buffer in each (see the module docs)."""
    flat = [x for line in values for x in line]
    buf = shared((len(flat), size), dtype, align=16)
    rank = nvidia_sync.cluster_ctarank()
    nvvm.cluster_wait()   # the peers have read the previous exchange's buffers
    peer = ops.thread_id(0)
    send = scf.IfOp((peer < size).ir)
    with ir.InsertionPoint(send.then_block):
        for k, x in enumerate(flat):
            store_remote(buf, (k, rank), x, peer)
        scf.YieldOp([])
    nvvm.cluster_arrive()
    nvvm.cluster_wait()
    combined = [pairwise([buf[k, r] for r in range(size)], combine) for k in range(len(flat))]
    nvvm.cluster_arrive()
    per = len(values[0])
    return [combined[i * per:(i + 1) * per] for i in range(len(values))]


def reduce(tile: RegTile | tuple, op: Any = "sum", axis: int = 1, *,
           cluster: bool = False) -> TileVector | tuple:
    """Reduce ``tile`` along ``axis`` (1: each row over its columns; 0: each column) with
    ``op`` (see the module docs), across every thread of its layout, and with ``cluster=True``
    across the CTAs of the kernel's cluster (:func:`cluster_rank`). A tuple of tiles of one
    layout gives a tuple of results, reduced through one shared-memory stage (and one cluster
    exchange) for all of them.

    Example: ``mean = kiln.reduce(x, "sum", axis=1) * (1.0 / n)``;
    ``s1, s2 = kiln.reduce((d, d * d), "sum", axis=1)`` (a one-pass variance).
    """
    tiles = tile if isinstance(tile, tuple) else (tile,)
    if not tiles or not all(isinstance(t, RegTile) for t in tiles):
        raise KilnTypeError(f"kiln.reduce reduces a register tile (or a tuple of them), got "
                            f"{type(tile).__name__}",
                            fix="load it first: x = kiln.load(global_tile, layout)")
    if axis not in (0, 1):
        raise KilnValueError(f"kiln.reduce axis must be 0 (columns) or 1 (rows), got {axis!r}",
                             fix="axis=1 reduces each row, axis=0 each column")
    dtype = tiles[0].dtype
    if dtype not in (dt.f32, dt.i32) or any(t.dtype is not dtype for t in tiles):
        raise KilnTypeError(f"kiln.reduce reduces 32-bit tiles (f32, i32) of one dtype, got "
                            f"{', '.join(str(t.dtype) for t in tiles)}",
                            fix="kiln.cast(tile, kiln.f32) first")
    if any(t.layout != tiles[0].layout or t.grid != tiles[0].grid for t in tiles):
        raise KilnValueError("kiln.reduce of a tuple needs tiles of one layout",
                             fix="build the tiles with the same layout (e.g. d and d * d)")
    combine = _combine_of(op)
    sources = [t if axis == 1 else t.T for t in tiles]
    layout = sources[0].layout
    group_of, masks = row_structure(layout)
    warp = builder.current_target().warp_size
    lane_masks = tuple(m for m in masks if m < warp)
    warp_masks = tuple(m for m in masks if m >= warp)
    gm, gn = sources[0].grid
    lines = []
    for source in sources:
        for i in range(gm):
            members: list[list[Value]] = [[] for _ in range(max(group_of) + 1)]
            for j in range(gn):
                scalars = source.fragment(i, j)
                for v, g in enumerate(group_of):
                    members[g].append(Value(vector.extract(scalars.ir, [], [v]), dtype))
            lines.append([butterfly_reduce(pairwise(m, combine), lane_masks, combine)
                          for m in members])
    if warp_masks:
        lines = _across_warps(lines, warp_masks, lane_masks, combine, layout.num_threads,
                               dtype)
    shape = builder.current().cluster
    if cluster and shape is not None and shape[0] * shape[1] * shape[2] > 1:
        lines = _across_cluster(lines, combine, dtype, shape[0] * shape[1] * shape[2])
    results = tuple(TileVector(lines[k * gm:(k + 1) * gm], group_of,
                               "row" if axis == 1 else "col", row_keys(layout))
                    for k in range(len(tiles)))
    return results if isinstance(tile, tuple) else results[0]
