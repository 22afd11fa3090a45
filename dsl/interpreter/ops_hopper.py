"""Hopper async ops: TMA loads/stores (``nvgpu.tma.*``) and bulk-copy groups.

Shared memory is addressed exactly as the hardware does: a TMA box is written row-major at the
destination's byte address with the tensor map's swizzle applied to the absolute shared address
(``kiln.swizzle.Swizzle.tma``), and WGMMA (``ops_wgmma``) reads its operands back through the
same swizzle. A TMA load lands when its mbarrier's phase completes (a multicast one in every
masked CTA of the cluster, counting its bytes on each one's barrier at the same offset); a TMA
store keeps its source "being read" until ``cp.async.bulk.wait_group``. Touching those bytes
meanwhile raises ``RaceError``.
"""

from __future__ import annotations

import numpy as np

from kiln.core.errors import OutOfBoundsError
from kiln.swizzle import Swizzle

from .ops_mbarrier import operand_segments
from .plan import attr_int, location, semantics
from .state import MemRef


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
