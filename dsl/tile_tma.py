"""``kiln.copy`` through TMA on sm_90a: global -> shared loads and staged shared -> global stores.

A :class:`~kiln.global_tile.GlobalTile` qualifies when it views a 2-D tensor *parameter* with
a unit last stride, ``align=`` promises 16-byte rows (TMA's stride rule), the fill is 0 and each
mask is absent or the tensor's own extent (``row_end=a.shape[0]``): TMA clips a box at the
tensor's edges, reading zeros (loads) and dropping elements (stores) past them, which is then
exactly the GlobalTile's masking. A mask at any other value (a ragged sequence's rows) keeps
the ``cp.async`` path.

The descriptor is a *derived* parameter (:class:`~kiln.signature.TensorMapParam` with a
``source``): the trace appends an ``!llvm.ptr`` argument per (tensor, box, swizzle), and the
launcher builds the ``CUtensorMap`` from the source tensor's argument with the same
``TensorMapCache`` as the Hopper GEMM's declared ``kiln.TensorMap`` parameters; callers pass
nothing more. In the interpreter the map is the tensor itself (``TensorMapArg``).

=====================  ===========================================================================
shared tile            boxes
=====================  ===========================================================================
``operand_tile`` on    one box ``rows x 64`` (bf16/f16) per 128-byte-swizzled chunk, TMA
sm_90a (WGMMA)         swizzle 128: the layout WGMMA's descriptors read (``kiln.tile_gemm_wgmma``)
row-major, no swizzle  one box of the whole tile (rows and columns at most 256, 16-byte rows)
=====================  ===========================================================================

A load: thread 0 arrives on the shared tile's own mbarrier expecting the boxes' bytes and issues the
boxes (``cp.async.bulk.tensor``); the mbarrier is created and initialised once at the kernel's
entry. No wait is written: ``kiln-insert-waits`` puts the ``mbarrier.try_wait.parity`` of the
use the reading thread acquires next before the first read of the tile (the parity derived by
counting the barrier's uses, :mod:`kiln.passes.mbarrier_rings`) and, before the barrier ahead
of a load that refills a tile a WGMMA in flight reads, the ``wgmma.wait_group``;
``kiln-verify-waits`` proves both. The loads are marked ``kiln.auto_wait`` like ``cp.async``
groups.

``kiln.copy(shared_tile, g)`` (either of the shared tiles above): ``fence.proxy.async`` and a
block barrier, thread 0's TMA stores, its wait until they have read the tile, a block barrier.

A staged store (``kiln.copy(acc, g, staged=True)``): per 64-column chunk of the tile, every
thread writes its registers of the chunk into one of two ``rows x 64`` 128-byte-swizzled
shared tiles, ``fence.proxy.async``, a block barrier, and thread 0 issues the TMA store
(``cp.async.bulk.tensor`` shared -> global) and commits it; before a buffer is rewritten
thread 0 waits until the store two chunks back has read it (``cp.async.bulk.wait_group.read``).

Example::

    m, k = a.shape
    kiln.copy(kiln.GlobalTile(a, (128, 64), (m0, k0), row_end=m, col_end=k, align=16), a_s)
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mlir import ir
from mlir.dialects import llvm, scf, vector

from . import builder, ops
from .core.ops import AUTO_WAIT_ATTR, constant_int
from .global_tile import GlobalTile
from .nvidia import mbarrier, tma
from .nvidia.sync import fence_mbarrier_init, fence_proxy_async
from .shared import DynamicSharedTensor, dynamic_shared
from .shared_tile import SharedTile
from .signature import TensorMapParam
from .swizzle import Swizzle
from .tile_gemm_wgmma import ATOM_BYTES, CHUNK_BYTES, chunked_layout
from .tiles import row_run_width
from .values import Value, to_value

ROW_BYTES = 16   # TMA: global strides and box rows are multiples of 16 bytes
STORE_BUFFERS = 2  # staged store: a chunk is written while the one before is still being stored


def _is_extent(bound: Any, tensor, dim: int) -> bool:
    """Whether ``bound`` is ``tensor.shape[dim]`` (a ``memref.dim`` of the tensor, cast)."""
    value = getattr(bound, "ir", None)
    for _ in range(3):
        if not isinstance(value, ir.Value) or isinstance(value.owner, ir.Block):
            return False
        op = value.owner.operation
        if op.name == "memref.dim":
            return op.operands[0] == tensor.ir and constant_int(op.operands[1]) == dim
        if op.name not in ("arith.index_cast", "arith.index_castui"):
            return False
        value = op.operands[0]
    return False


def _parameter(g: GlobalTile) -> int | None:
    """The entry-block argument number of the tensor ``g`` views, when it is a parameter."""
    value = g.tensor.ir
    entry = builder.current().entry_block
    if not isinstance(value.owner, ir.Block) or value.owner != entry:
        return None
    return ir.BlockArgument(value).arg_number


def qualifies(g: GlobalTile) -> bool:
    """Whether ``g`` can be moved by TMA on this target (see the module docs)."""
    if not builder.current_target().has_tma or g.tensor.rank != 2 or g.fill != 0 \
            or g.align is None or g.align < ROW_BYTES or g.dtype.kind == "bool" \
            or g.dtype.itemsize not in (1, 2, 4):
        return False
    layout = ir.MemRefType(g.tensor.ir.type).layout
    if isinstance(layout, ir.StridedLayoutAttr) and layout.strides[-1] != 1:
        return False
    if _parameter(g) is None or g.tensor.name not in builder.current().param_names:
        return False
    return all(end is None or _is_extent(end, g.tensor, d)
               for d, end in enumerate((g.row_end, g.col_end)))


def boxes(tile: SharedTile) -> tuple[tuple[int, int], int, int] | None:
    """``(box, swizzle bytes, boxes)`` of a TMA copy into ``tile``, else None (the table)."""
    rows, cols = tile.shape
    item = tile.dtype.itemsize
    if rows > tma.MAX_BOX_DIM or not isinstance(tile.buffer, DynamicSharedTensor):
        return None
    if getattr(tile, "wgmma_operand", None) in ("a", "b"):
        chunk = CHUNK_BYTES // item
        return (rows, chunk), CHUNK_BYTES, cols // chunk
    row_major = tile.swizzle is None and np.array_equal(
        tile.offsets().ravel(), np.arange(rows * cols))
    if row_major and cols <= tma.MAX_BOX_DIM and cols * item % ROW_BYTES == 0:
        return (rows, cols), 0, 1
    return None


def _descriptor(g: GlobalTile, box: tuple[int, int], swizzle: int) -> tma.TensorMapDescriptor:
    """The derived tensor map of ``g``'s tensor for ``box``: one parameter per (tensor, box,
    swizzle), appended to the entry block and cast to a descriptor there."""
    state = builder.current()
    number = _parameter(g)
    key = (number, box, swizzle)
    found = state.derived_maps.get(key)
    if found is not None:
        return found[1]
    source = state.param_names[number]
    param = TensorMapParam(f"{source}.tma{len(state.derived_maps)}", g.dtype.name, 2, box,
                           swizzle, source=source)
    entry = state.entry_block
    arg = entry.add_argument(llvm.PointerType.get(), ir.Location.current)
    with builder.entry_point(state):
        desc = tma.descriptor_from_pointer(arg, g.dtype, box, swizzle)
    state.derived_maps[key] = (param, desc)
    return desc


def _barrier(tile: SharedTile) -> mbarrier.MBarrierGroup:
    """The mbarrier of ``tile``'s TMA loads (arrival count 1): made on the first load into the
    tile, initialised by thread 0 at the kernel's entry; the first of the kernel also adds the
    init fence and the block barrier every later init goes before."""
    bars = getattr(tile, "_tma_barrier", None)
    if bars is not None:
        return bars
    state = builder.current()
    first = state.tma_setup is None
    point = builder.entry_point(state) if first else ir.InsertionPoint(state.tma_setup)
    with point:
        bars = mbarrier.group(1)
        bars.init(0, count=1, predicate=ops.thread_id(0) == 0)
        if first:
            fence_mbarrier_init()
            state.tma_setup = _last_op()
            ops.barrier()
    tile._tma_barrier = bars
    return bars


def _empty(tile: SharedTile) -> mbarrier.MBarrierGroup:
    """The mbarrier every thread of the block arrives on (after its WGMMA group that read
    ``tile`` retired) to hand ``tile`` back to the next TMA load; its create and the tile's
    full barrier's carry one ``kiln.ring_pair`` id, so kiln-insert-waits waits on it before
    the load's arm."""
    bars = getattr(tile, "_tma_empty", None)
    if bars is not None:
        return bars
    state = builder.current()
    full = _barrier(tile)
    with ir.InsertionPoint(state.tma_setup):
        bars = mbarrier.group(1)
        bars.init(0, count=state.block[0], predicate=ops.thread_id(0) == 0)
    state.tma_pairs += 1
    pair = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), state.tma_pairs)
    for group in (full, bars):
        group.ir.owner.attributes[mbarrier.RING_PAIR_ATTR] = pair
    tile._tma_empty = bars
    return bars


def release(tiles: list, condition: Any = None) -> None:
    """Hand ``tiles`` back (kiln.pipeline without a block barrier per step): every thread
    arrives on each tile's empty mbarrier, declaring that the newest WGMMA group may
    still be in flight (kiln-insert-waits retires the older one before); under ``condition``
    when given (a step with no previous use)."""
    if condition is None:
        for tile in tiles:
            _empty(tile).arrive(0, wgmma_pending=1)
        return
    branch = scf.IfOp(to_value(condition).ir)
    with ir.InsertionPoint(branch.then_block):
        for tile in tiles:
            _empty(tile).arrive(0, wgmma_pending=1)
        scf.YieldOp([])


def _last_op() -> ir.Operation:
    point = ir.InsertionPoint.current
    if point.ref_operation is not None:  # inserting before an op: the one just built precedes it
        ops_ = list(point.block.operations)
        return ops_[[o.operation for o in ops_].index(point.ref_operation) - 1].operation
    return point.block.operations[len(point.block.operations) - 1].operation


def _chunk(tile: SharedTile, box: tuple[int, int], count: int, j: int) -> Any:
    """Box ``j`` of ``tile`` as a ``box``-shaped shared memref (chunks lie back to back)."""
    return tile.buffer.reinterpret((count,) + box, tile.dtype).tile(j)


def load(g: GlobalTile, dst: SharedTile) -> bool:
    """Copy ``g`` into ``dst`` with TMA when both qualify (returns False otherwise)."""
    found = boxes(dst)
    if found is None or not qualifies(g) or g.dtype is not dst.dtype:
        return False
    box, swizzle, count = found
    desc = _descriptor(g, box, swizzle)
    bars = _barrier(dst)
    fetching = builder.current().tma_fetching
    if fetching is not None:   # a kiln.pipeline stage handed back by mbarriers
        _empty(dst)
        fetching.append(dst)
    leader = ops.thread_id(0) == 0
    bars.arrive_expect_tx(0, count * tma.box_bytes(desc), predicate=leader)
    for j in range(count):
        tma.load(desc, _chunk(dst, box, count, j), (g.origin[1] + j * box[1], g.origin[0]),
                 bars, 0, predicate=leader)
        _last_op().attributes[AUTO_WAIT_ATTR] = ir.UnitAttr.get()
    return True


def store_shared(src: SharedTile, g: GlobalTile) -> bool:
    """``src`` into ``g`` by TMA stores when both qualify (returns False otherwise): every
    thread's ``fence.proxy.async`` (its earlier ``st.shared`` are generic-proxy writes), a block
    barrier, thread 0's boxes and its wait until they have read ``src``, and a block barrier
    (no thread overwrites ``src`` before that). The whole block makes the call."""
    found = boxes(src)
    if found is None or not qualifies(g) or g.dtype is not src.dtype \
            or tuple(src.shape) != tuple(g.shape):
        return False
    box, swizzle, count = found
    desc = _descriptor(g, box, swizzle)
    leader = ops.thread_id(0) == 0
    fence_proxy_async()
    ops.barrier()
    for j in range(count):
        tma.store(_chunk(src, box, count, j), desc, (g.origin[1] + j * box[1], g.origin[0]),
                  predicate=leader)
    tma.commit_group()
    tma.wait_group(0, read=True)
    ops.barrier()
    return True


def _chunk_runs(layout, width: int, chunk: int) -> list[list[int]] | None:
    """Per 64-column chunk, the value runs (``width`` at a time) whose columns lie in it for
    every thread; None when a run's chunk depends on the thread."""
    cols = layout.coords()[1] // chunk
    runs: list[list[int]] = [[] for _ in range(int(cols.max()) + 1)]
    for v in range(0, layout.num_values, width):
        which = np.unique(cols[:, v:v + width])
        if which.size != 1:
            return None
        runs[int(which[0])].append(v)
    return runs


def store(tile, g: GlobalTile) -> bool:
    """The staged store of register tile ``tile`` into ``g`` through TMA (module docs), when
    ``g`` qualifies and the tile's layout keeps each value run in one 64-column chunk."""
    rows, cols = tile.shape
    item = tile.dtype.itemsize
    chunk = CHUNK_BYTES // item
    layout = tile.layout
    if not qualifies(g) or tile.grid != (1, 1) or cols % chunk or rows % 8 \
            or rows > tma.MAX_BOX_DIM or layout.num_threads != builder.current().block[0]:
        return False
    shape, swizzle = (rows, chunk), Swizzle.sw128b(item)
    probe = SharedTile.__new__(SharedTile)   # the staging tiles' offsets, nothing allocated
    probe._describe(shape, tile.dtype, chunked_layout(rows, chunk, tile.dtype), swizzle)
    width = min(row_run_width(layout), ROW_BYTES // item)
    while width > 1 and not probe.contiguous_width(width):
        width //= 2
    runs = _chunk_runs(layout, width, chunk)
    if runs is None:
        return False
    count = cols // chunk
    buffers = min(STORE_BUFFERS, count)
    flat = dynamic_shared((buffers * rows * chunk,), tile.dtype, align=ATOM_BYTES)
    stages = [SharedTile.view(flat.reinterpret((buffers, rows * chunk), tile.dtype).tile(i),
                              shape, probe.layout, swizzle) for i in range(buffers)]
    boxes_ = flat.reinterpret((buffers, rows, chunk), tile.dtype)
    desc = _descriptor(g, (rows, chunk), CHUNK_BYTES)
    leader = ops.thread_id(0) == 0
    thread = ops.thread_id(0) % layout.num_threads
    frag = tile.fragment(0, 0).ir
    ops.barrier()   # threads may still read the buffers' last use (a copy in a loop)
    for j in range(count):
        stage = stages[j % buffers]
        if j >= buffers:  # the store from this buffer has read it
            tma.wait_group(buffers - 1, read=True)
            ops.barrier()
        for v in runs[j]:
            row, col = layout(thread, v)
            piece = vector.shuffle(frag, frag, list(range(v, v + width)))
            stage.store(row, col - j * chunk, Value(piece, tile.dtype))
        fence_proxy_async()   # st.shared is a generic-proxy write; the TMA store reads async
        ops.barrier()
        tma.store(boxes_.tile(j % buffers), desc, (g.origin[1] + j * chunk, g.origin[0]),
                  predicate=leader)
        tma.commit_group()
    tma.wait_group(0, read=True)  # shared memory outlives the stores' reads
    return True


__all__ = ["qualifies", "boxes", "load", "store", "store_shared", "release"]
