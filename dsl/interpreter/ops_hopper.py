"""Hopper async ops: TMA loads/stores (``nvgpu.tma.*``) and warp-group MMA (``nvgpu.warpgroup.*``).

Shared memory is addressed exactly as the hardware does: a TMA box is written row-major at the
destination's byte address with the tensor map's swizzle applied to the absolute shared address
(``kiln.swizzle.Swizzle.tma``), and WGMMA reads its operand tiles back through the same swizzle.
A TMA load lands when its mbarrier's phase completes (a multicast one in every masked CTA of
the cluster, counting its bytes on each one's barrier at the same offset); a TMA store keeps its
source "being read" until ``cp.async.bulk.wait_group``; an MMA issued with ``waitGroup > 0``
keeps its operand tiles "being read" until ``wgmma.wait.group``. Touching those bytes meanwhile
raises ``RaceError``.
"""

from __future__ import annotations

import numpy as np

from kiln.core.errors import OutOfBoundsError, UnsupportedError
from kiln.swizzle import Swizzle

from .ops_mbarrier import operand_segments
from .plan import attr_int, has_attr, location, semantics
from .state import MemRef, element_bytes


def _swizzle(swizzle_bytes: int):
    return Swizzle.tma(swizzle_bytes, 1) if swizzle_bytes else (lambda b: b)


def _base_byte(mem: MemRef) -> int:
    return int(np.asarray(mem.offset).reshape(-1)[0]) * mem.storage.itemsize


def _box_bytes(mem: MemRef, nbytes: int, swizzle_bytes: int) -> np.ndarray:
    """Physical shared byte addresses of a box of ``nbytes`` written row-major at ``mem``."""
    return _swizzle(swizzle_bytes)(_base_byte(mem) + np.arange(nbytes, dtype=np.int64))


def _global_box(tmap, coords: list[int], loc) -> np.ndarray:
    """The box at ``coords`` (innermost first, like the op) of the tensor map's array; parts
    outside the tensor read as zero (or NaN), like TMA's out-of-bounds fill."""
    array, box = tmap.array, tmap.box
    start = coords[::-1]
    fill = np.nan if tmap.oob_fill_nan else 0
    out = np.full(box, fill, dtype=np.float64 if array.dtype.kind == "f" else array.dtype)
    out = out.astype(array.dtype)
    src, dst = [], []
    for s, b, n in zip(start, box, array.shape):
        lo, hi = max(s, 0), min(s + b, n)
        if hi <= lo:
            return out
        src.append(slice(lo, hi))
        dst.append(slice(lo - s, hi - s))
    out[tuple(dst)] = array[tuple(src)]
    return out


@semantics("nvgpu.tma.async.load")
def _tma_load(op, p):
    (dst,), (bars,), (desc,), coords, (index,), multicast, pred = operand_segments(op, p)
    loc = location(op)

    def run(env, ctx):
        tmap, mem, group = env[desc], env[dst], env[bars]
        active = ctx.active()
        if pred:
            active = active & np.broadcast_to(env[pred[0]], active.shape)
        lanes = np.flatnonzero(active)
        n = active.shape[0]
        for lane in lanes:  # normally one elected thread
            c = [int(np.broadcast_to(env[s], (n,))[lane]) for s in coords]
            i = int(np.broadcast_to(env[index], (n,))[lane])
            data = _global_box(tmap, c, loc).reshape(-1).view(np.uint8)
            phys = _box_bytes(mem, data.size, tmap.swizzle)
            targets = [ctx.cta]
            if multicast:
                targets = _multicast_targets(
                    ctx.cta, int(np.broadcast_to(env[multicast[0]], (n,))[lane]), loc)
            issuer = f"thread {int(ctx.thread_ids[lane])}"
            if multicast:
                issuer += f" of cluster CTA rank {ctx.cta.rank}"
            for cta in targets:
                _land_box(cta, group.in_cta(cta), i, phys, data, _base_byte(mem), loc, issuer)

    return run


def _multicast_targets(cta, mask: int, loc) -> list:
    """The CTAs of ``cta``'s cluster whose bit (by rank) is set in the 16-bit ``mask``."""
    ctas = cta.cluster.ctas
    mask &= 0xFFFF
    if mask >> len(ctas):
        raise OutOfBoundsError(f"TMA multicast mask {mask:#x} names CTA ranks past the "
                               f"cluster's {len(ctas)} CTAs",
                               fix=f"use a mask below {1 << len(ctas):#x}", loc=loc)
    return [c for rank, c in enumerate(ctas) if mask >> rank & 1]


def _land_box(cta, group, i: int, phys: np.ndarray, data: np.ndarray, base: int,
              loc, issuer: str) -> None:
    """Start the copy of ``data`` into ``cta``'s shared bytes ``phys``: it lands, and its bytes
    count on barrier ``i`` of ``group``, with that barrier's phase; a thread may touch them
    once it observed that phase (``PhaseClock``)."""
    shared = cta.shared
    if phys.max(initial=0) >= shared.arena.size:
        raise OutOfBoundsError(f"TMA box of {data.size} bytes at shared byte {base} "
                               f"overruns shared memory ({shared.arena.size} bytes)", loc=loc)

    bar = group.get(i, loc)

    def land(arena=shared.arena, phys=phys, data=data):
        arena[phys] = data
        shared.tma_landed(phys, cta.cluster.clock.slot(bar), bar.phase + 1,  # before the flip
                          f"the TMA load issued at {loc} by {issuer} wrote (landing with phase "
                          f"{bar.phase} of mbarrier {i} of the {group.name})")

    op_id = shared.begin("TMA load", loc, write_bytes=phys, land=land)
    group.complete_tx(cta, bar, data.size, lambda shared=shared, op_id=op_id: shared.end(op_id))


@semantics("nvgpu.tma.async.store")
def _tma_store(op, p):
    (src,), (desc,), coords, pred = operand_segments(op, p)
    loc = location(op)

    def run(env, ctx):
        tmap, mem = env[desc], env[src]
        active = ctx.active()
        if pred:
            active = active & np.broadcast_to(env[pred[0]], active.shape)
        n = active.shape[0]
        for lane in np.flatnonzero(active):
            c = [int(np.broadcast_to(env[s], (n,))[lane]) for s in coords][::-1]
            nbytes = int(np.prod(tmap.box)) * tmap.array.itemsize
            phys = _box_bytes(mem, nbytes, tmap.swizzle)
            shared = ctx.cta.shared
            shared.check(phys, False, "this TMA store", loc)
            box = shared.arena[phys].view(tmap.array.dtype).reshape(tmap.box)
            dst, part = [], []
            for s, b, size in zip(c, tmap.box, tmap.array.shape):
                lo, hi = max(s, 0), min(s + b, size)
                dst.append(slice(lo, max(hi, lo)))
                part.append(slice(lo - s, max(hi, lo) - s))
            tmap.array[tuple(dst)] = box[tuple(part)]  # out-of-bounds parts are dropped
            ctx.pending_async.append(shared.begin("TMA store", loc, read_bytes=phys))

    return run


@semantics("nvvm.cp.async.bulk.commit.group")
def _bulk_commit(op, p):
    def run(env, ctx):
        commit_group(ctx, "bulk", ctx.pending_async)

    return run


def commit_group(ctx, kind: str, pending: list) -> None:
    """Close the ``pending`` async op ids into one committed group of ``kind``."""
    ctx.async_groups.append((kind, list(pending)))
    pending.clear()


def retire_groups(ctx, kind: str, keep: int) -> None:
    """Complete all but the ``keep`` most recent committed groups of ``kind``."""
    mine = [g for g in ctx.async_groups if g[0] == kind]
    for group in mine[:max(len(mine) - keep, 0)]:
        ctx.async_groups.remove(group)
        for op_id in group[1]:
            ctx.cta.shared.end(op_id)


@semantics("nvvm.cp.async.bulk.wait_group")
def _bulk_wait(op, p):
    keep = attr_int(op, "group", 0)

    def run(env, ctx):
        retire_groups(ctx, "bulk", keep)

    return run


class WarpGroupAccumulator:
    """A warp group's ``M x N`` accumulator as one tile (the fragment layout is the lowering's
    business; ``nvgpu.warpgroup.mma.store`` writes the tile)."""

    def __init__(self, tile: np.ndarray):
        self.tile = tile

    def merge(self, cond: np.ndarray, other) -> "WarpGroupAccumulator":
        if cond.all():
            return self
        if not cond.any():
            return other
        raise UnsupportedError("a warp-group accumulator differs between threads of one warp "
                               "group (a branch on a thread id around wgmma?)",
                               fix="branch on warp-group-uniform values around WGMMA")


class WarpGroupDescriptor:
    def __init__(self, mem: MemRef, swizzle: int, shape: tuple[int, int]):
        self.mem, self.swizzle, self.shape = mem, swizzle, shape


@semantics("nvgpu.warpgroup.mma.init.accumulator")
def _init_acc(op, p):
    out = p.result(op)
    shape = _fragment_shape(op.results[0].type)

    def run(env, ctx):
        env[out] = WarpGroupAccumulator(np.zeros(shape, np.float32))

    return run


def _fragment_shape(t) -> tuple[int, int]:
    text = str(t)
    dims = text.split("vector<")[1].split("x")
    return int(dims[0]), int(dims[1])


@semantics("nvgpu.warpgroup.generate.descriptor")
def _descriptor(op, p):
    tile, tmap = p.operands(op)
    out = p.result(op)
    shape = tuple(op.operands[0].type.shape)

    def run(env, ctx):
        env[out] = WarpGroupDescriptor(env[tile], env[tmap].swizzle, shape)

    return run


def read_operand(desc: WarpGroupDescriptor, contiguous_rows: bool, ctx, loc) -> tuple:
    """The tile of ``desc`` as a matrix of its memref shape, plus the shared bytes it reads.

    ``contiguous_rows``: the memref's last dimension is the contiguous one in shared memory
    (else the tile is stored transposed). Rows wider than the swizzle span are stored as
    consecutive swizzle-wide column blocks, as TMA boxes of swizzle width fill them.
    """
    mem, swizzle = desc.mem, desc.swizzle
    rows, cols = desc.shape if contiguous_rows else desc.shape[::-1]
    item = mem.storage.itemsize
    if not swizzle:
        raise UnsupportedError("the interpreter reads WGMMA operands loaded with a 32/64/128-byte "
                               "swizzle only", fix="load the tiles with a swizzled TMA map",
                               loc=loc)
    chunk = swizzle // item
    r = np.arange(rows)[:, None]
    c = np.arange(cols)[None, :]
    logical = (c // chunk) * rows * swizzle + r * swizzle + (c % chunk) * item
    phys = _swizzle(swizzle)(_base_byte(mem) + logical)
    addrs = (phys[..., None] + np.arange(item)).reshape(-1)
    shared = ctx.cta.shared
    shared.check(addrs, False, "this WGMMA", loc)
    if shared.tma_loads:  # the warp group's MMA reads the tile for all of its threads
        active = ctx.thread_ids if ctx.mask is None else ctx.thread_ids[ctx.mask]
        shared.check_observed(addrs[None, :], active, ctx.cta.cluster.clock, ctx.cta.rank,
                              "reads (WGMMA operand)", loc)
    values = ctx.cta.shared.arena[addrs].view(mem.storage.dtype).reshape(rows, cols)
    return (values if contiguous_rows else values.T), addrs


@semantics("nvgpu.warpgroup.mma")
def _mma(op, p):
    a_slot, b_slot, c_slot = p.operands(op)
    out = p.result(op)
    trans_a, trans_b = has_attr(op, "transposeA"), has_attr(op, "transposeB")
    wait_group = attr_int(op, "waitGroup", 0)
    loc = location(op)

    def run(env, ctx):
        a, a_bytes = read_operand(env[a_slot], not trans_a, ctx, loc)
        b, b_bytes = read_operand(env[b_slot], trans_b, ctx, loc)
        acc = env[c_slot].tile
        env[out] = WarpGroupAccumulator(
            (acc.astype(np.float64) + a.astype(np.float64) @ b.astype(np.float64))
            .astype(np.float32))
        if wait_group:
            shared = ctx.cta.shared
            ids = [shared.begin("WGMMA", loc, read_bytes=np.concatenate([a_bytes, b_bytes]))]
            ctx.async_groups.append(("wgmma", ids))
            retire_groups(ctx, "wgmma", wait_group)

    return run


@semantics("nvgpu.warpgroup.mma.store")
def _mma_store(op, p):
    acc_slot, dst = p.operands(op)
    loc = location(op)

    def run(env, ctx):
        tile, mem = env[acc_slot].tile, env[dst]
        rows, cols = tile.shape
        flat = (np.asarray(mem.offset).reshape(-1)[0] + np.arange(rows)[:, None] * mem.strides[0]
                + np.arange(cols)[None, :] * mem.strides[1]).reshape(-1)
        if mem.is_shared:
            ctx.cta.shared.check(element_bytes(mem, flat), True, "this WGMMA store", loc)
        mem.storage[flat] = tile.reshape(-1).astype(mem.storage.dtype)

    return run

