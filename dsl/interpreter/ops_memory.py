"""``memref`` and ``vector`` memory ops: loads, stores, views of global and shared memory.

Every access computes flat element offsets from the memref descriptor (offset + index · stride),
checks bounds per dimension for the active threads (``KILN_INTERPRET_CHECK_BOUNDS``), checks
shared accesses against in-flight async copies, then gathers or scatters with numpy. Masked-off
threads neither load nor store.
"""

from __future__ import annotations

import numpy as np
from mlir import ir
from mlir.dialects import arith

from kiln.core.errors import OutOfBoundsError, UnsupportedError

from .plan import location, np_dtype, semantics
from .state import Context, MemRef, bounds_error, element_bytes

_DYNAMIC = ir.ShapedType.get_dynamic_size()


def flat_offsets(mem: MemRef, index: list, ctx, loc, width: int = 1, check: bool = True):
    """Flat element offsets of ``mem[index]`` (one per thread, or one shared by all)."""
    flat = mem.offset
    for i, stride in zip(index, mem.strides):
        flat = flat + i.astype(np.int64) * stride
    flat = np.asarray(flat, np.int64).reshape(-1)
    if check and mem.buffer is None and ctx.cta.check_bounds:
        _check_bounds(mem, index, ctx, loc, width)
    return flat


def _check_bounds(mem: MemRef, index: list, ctx, loc, width: int) -> None:
    mask = ctx.mask
    for dim, (i, size) in enumerate(zip(index, mem.sizes)):
        last = size - width if dim == len(index) - 1 else size - 1
        bad = (i < 0) | (i > last)
        if i.shape[0] > 1 and mask is not None:
            bad = bad & mask
        if bad.any():
            t = int(np.argmax(bad)) if bad.shape[0] > 1 else int(np.argmax(ctx.active()))
            coords = [int(j[t if j.shape[0] > 1 else 0]) for j in index]
            raise bounds_error(mem, tuple(coords), int(ctx.thread_ids[t]), ctx, loc)


def _active_flat(flat: np.ndarray, ctx) -> np.ndarray:
    return flat if flat.shape[0] == 1 or ctx.mask is None else flat[ctx.mask]


def check_shared(mem: MemRef, flat: np.ndarray, ctx, is_write: bool, what: str, loc,
                 width: int = 1) -> None:
    """Race checks of a plain access. Shared: against in-flight async ops, and (loads) against
    other threads' stores since the last barrier; stores are recorded for the latter. Global:
    against other blocks' accesses of the launch (``global_races``)."""
    if not mem.is_shared:
        ctx.cta.globals.access(mem, flat, ctx, is_write, loc, width)
        return
    shared = ctx.cta.shared
    active = _active_flat(flat, ctx)
    if width > 1:
        active = active[:, None] + np.arange(width) * mem.strides[-1]
    per_thread = element_bytes(mem, active).reshape(active.shape[0], -1)
    if shared.in_flight:
        shared.check(per_thread.reshape(-1), is_write, what, loc)
    threads = ctx.thread_ids if ctx.mask is None else ctx.thread_ids[ctx.mask]
    if shared.tma_loads and threads.shape[0]:
        shared.check_observed(per_thread, threads, ctx.cta.cluster.clock, ctx.cta.rank,
                              "stores to" if is_write else "loads", loc)
    if is_write:
        uniform = per_thread.shape[0] == 1 and threads.shape[0] > 1
        shared.record_store(per_thread, None if uniform else threads, loc)
    elif threads.shape[0]:
        shared.check_load(per_thread, threads, loc)


def in_buffer(mem: MemRef, first: np.ndarray, width: int = 1) -> np.ndarray | None:
    """For an AMD buffer view: which accesses of ``width`` elements at ``first`` are in range."""
    if mem.buffer is None:
        return None
    lo, hi = mem.buffer
    last = first + (width - 1) * (mem.strides[-1] if mem.strides else 1)
    return (first >= lo) & (last < hi)


def gather(mem: MemRef, flat: np.ndarray, ctx) -> np.ndarray:
    if ctx.mask is not None and flat.shape[0] > 1:
        flat = np.where(ctx.mask, flat, flat[np.argmax(ctx.mask)])  # masked lanes read a valid slot
    valid = in_buffer(mem, flat)
    if valid is None:
        return mem.storage[flat]
    values = mem.storage[np.where(valid, flat, mem.buffer[0])]
    return np.where(valid, values, np.zeros((), values.dtype))


def scatter(mem: MemRef, flat: np.ndarray, value: np.ndarray, ctx) -> None:
    n = ctx.size
    keep = ctx.mask
    valid = in_buffer(mem, flat)
    if valid is not None:  # out-of-range buffer stores are dropped
        keep = np.broadcast_to(valid, (n,)) if keep is None else keep & valid
    if keep is None:
        if flat.shape[0] == 1:
            mem.storage[flat[0]] = value[-1]
        else:
            mem.storage[flat] = np.broadcast_to(value, (n,) + value.shape[1:])
        return
    flat = np.broadcast_to(flat, (n,))[keep]
    mem.storage[flat] = np.broadcast_to(value, (n,) + value.shape[1:])[keep]


@semantics("memref.load")
def _load(op, p):
    src, *index = p.operands(op)
    out = p.result(op)
    loc = location(op)

    def run(env, ctx):
        mem = env[src]
        flat = flat_offsets(mem, [env[i] for i in index], ctx, loc)
        check_shared(mem, flat, ctx, False, "this load", loc)
        env[out] = gather(mem, flat, ctx)

    return run


@semantics("memref.store")
def _store(op, p):
    value, dst, *index = p.operands(op)
    loc = location(op)

    def run(env, ctx):
        mem = env[dst]
        flat = flat_offsets(mem, [env[i] for i in index], ctx, loc)
        check_shared(mem, flat, ctx, True, "this store", loc)
        scatter(mem, flat, env[value], ctx)

    return run


# np.maximum/minimum propagate NaN, as arith.maximumf/minimumf do.
_ATOMIC_UPDATES = {
    arith.AtomicRMWKind.addf: np.add, arith.AtomicRMWKind.addi: np.add,
    arith.AtomicRMWKind.maximumf: np.maximum, arith.AtomicRMWKind.maxs: np.maximum,
    arith.AtomicRMWKind.minimumf: np.minimum, arith.AtomicRMWKind.mins: np.minimum,
    arith.AtomicRMWKind.assign: lambda old, new: new,
}


@semantics("memref.atomic_rmw")
def _atomic_rmw(op, p):
    """One thread at a time in thread order (the order the hardware may also pick): each
    active thread reads the element, stores the update and gets the old value. Atomics are
    exempt from the race checks (concurrent atomics are their purpose) and order the blocks
    that did atomics on one element (``GlobalAccesses.atomic``)."""
    value, dst, *index = p.operands(op)
    out = p.result(op)
    loc = location(op)
    kind = ir.IntegerAttr(op.attributes["kind"]).value
    update = next((fn for k, fn in _ATOMIC_UPDATES.items() if int(k) == kind), None)
    if update is None:
        raise UnsupportedError(f"the interpreter has no atomic read-modify-write of kind {kind}",
                               loc=loc)

    def run(env, ctx):
        mem = env[dst]
        flat = np.broadcast_to(flat_offsets(mem, [env[i] for i in index], ctx, loc), (ctx.size,))
        new = np.broadcast_to(env[value], (ctx.size,))
        old = np.zeros(ctx.size, mem.storage.dtype)
        active = ctx.active().reshape(-1)
        ctx.cta.globals.atomic(mem, flat[active], ctx)
        for t in np.flatnonzero(active):
            old[t] = mem.storage[flat[t]]
            mem.storage[flat[t]] = update(old[t], new[t])
        env[out] = old

    return run


@semantics("vector.load")
def _vector_load(op, p):
    src, *index = p.operands(op)
    out = p.result(op)
    width = ir.VectorType(op.results[0].type).shape[-1]
    loc = location(op)

    def run(env, ctx):
        mem = env[src]
        flat = flat_offsets(mem, [env[i] for i in index], ctx, loc, width)
        check_shared(mem, flat, ctx, False, "this vector load", loc, width)
        lanes = flat[:, None] + np.arange(width) * mem.strides[-1]
        if ctx.mask is not None and flat.shape[0] > 1:
            lanes = np.where(ctx.mask[:, None], lanes, lanes[np.argmax(ctx.mask)])
        valid = in_buffer(mem, lanes[:, 0], width)
        if valid is None:
            env[out] = mem.storage[lanes]
        else:
            values = mem.storage[np.where(valid[:, None], lanes, mem.buffer[0])]
            env[out] = np.where(valid[:, None], values, np.zeros((), values.dtype))

    return run


@semantics("vector.store")
def _vector_store(op, p):
    value, dst, *index = p.operands(op)
    width = ir.VectorType(op.operands[0].type).shape[-1]
    loc = location(op)

    def run(env, ctx):
        mem = env[dst]
        flat = flat_offsets(mem, [env[i] for i in index], ctx, loc, width)
        check_shared(mem, flat, ctx, True, "this vector store", loc, width)
        n = ctx.size
        lanes = np.broadcast_to(flat[:, None] + np.arange(width) * mem.strides[-1], (n, width))
        v = np.broadcast_to(env[value], (n, width))
        keep = ctx.mask
        valid = in_buffer(mem, lanes[:, 0], width)
        if valid is not None:  # out-of-range buffer stores are dropped
            keep = valid if keep is None else keep & valid
        if keep is not None:
            lanes, v = lanes[keep], v[keep]
        mem.storage[lanes] = v

    return run


@semantics("memref.alloca")
def _alloca(op, p):
    """A private array per thread: one poisoned storage block per thread of the context, each
    thread's descriptor offset pointing at its own block."""
    out = p.result(op)
    mtype = ir.MemRefType(op.results[0].type)
    shape = tuple(mtype.shape)
    dtype = np_dtype(mtype)
    numel = int(np.prod(shape))
    strides = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    poison = np.frombuffer(np.full(dtype.itemsize, 0xFF, np.uint8).tobytes(), dtype)[0]

    def run(env, ctx):
        storage = np.full(ctx.size * numel, poison, dtype)
        env[out] = MemRef(storage, np.arange(ctx.size, dtype=np.int64) * numel, shape, strides,
                          f"private array memref<{'x'.join(map(str, shape))}>")

    return run


@semantics("memref.get_global")
def _get_global(op, p):
    out = p.result(op)
    name = ir.FlatSymbolRefAttr(op.attributes["name"]).value
    byte_offset, shape, dtype = p.shared_globals[name]
    strides = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    offset = byte_offset // dtype.itemsize

    def run(env, ctx):
        shared = ctx.cta.shared
        env[out] = MemRef(shared.view(dtype), offset, shape, strides, f"shared buffer @{name}",
                          shared.arena, offset)

    return run


@semantics("gpu.dynamic_shared_memory")
def _dynamic_shared(op, p):
    out = p.result(op)

    def run(env, ctx):
        shared = ctx.cta.shared
        base = ctx.cta.dynamic_shared_offset
        env[out] = MemRef(shared.arena, base, (shared.arena.size - base,), (1,),
                          "dynamic shared memory", shared.arena, base)

    return run


@semantics("memref.view")
def _view(op, p):
    src, shift, *sizes = p.operands(op)
    out = p.result(op)
    rtype = ir.MemRefType(op.results[0].type)
    dtype = np_dtype(rtype)
    static = list(rtype.shape)

    def run(env, ctx):
        mem = env[src]
        byte = int(np.asarray(mem.offset).reshape(-1)[0]) + int(env[shift][0])
        dyn = iter(sizes)
        shape = tuple(int(env[next(dyn)][0]) if s == _DYNAMIC else s for s in static)
        strides = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
        env[out] = MemRef(mem.arena.view(dtype), byte // dtype.itemsize, shape, strides,
                          mem.name, mem.arena, byte // dtype.itemsize)

    return run


def _mixed(static, dynamic_slots: list, env) -> list:
    """Static values with the dynamic markers replaced by the next dynamic operand (uniform)."""
    dyn = iter(dynamic_slots)
    out = []
    for s in static:
        if s == _DYNAMIC:
            v = env[next(dyn)]
            out.append(int(v[0]) if v.shape[0] == 1 else v.astype(np.int64))
        else:
            out.append(s)
    return out


def _static_lists(op):
    return [list(ir.DenseI64ArrayAttr(op.attributes[k])) for k in
            ("static_offsets", "static_sizes", "static_strides")]


@semantics("memref.subview")
def _subview(op, p):
    src, *rest = p.operands(op)
    offs, sizes, strides = _static_lists(op)
    counts = [sum(1 for s in lst if s == _DYNAMIC) for lst in (offs, sizes, strides)]
    dyn_offs = rest[:counts[0]]
    dyn_sizes = rest[counts[0]:counts[0] + counts[1]]
    dyn_strides = rest[counts[0] + counts[1]:]
    result_rank = ir.MemRefType(op.results[0].type).rank
    out = p.result(op)
    loc = location(op)

    def run(env, ctx):
        mem = env[src]
        o = _mixed(offs, dyn_offs, env)
        n = _mixed(sizes, dyn_sizes, env)
        s = _mixed(strides, dyn_strides, env)
        offset = mem.offset
        for oi, stride in zip(o, mem.strides):
            offset = offset + oi * stride
        if ctx.cta.check_bounds:
            _check_subview(mem, o, n, s, loc)
        new_sizes = list(n)
        new_strides = [a * b for a, b in zip(mem.strides, s)]
        drop = len(new_sizes) - result_rank
        keep = []
        for dim, size in enumerate(new_sizes):
            if drop and isinstance(size, int) and size == 1:
                drop -= 1
                continue
            keep.append(dim)
        env[out] = MemRef(mem.storage, offset, tuple(new_sizes[d] for d in keep),
                          tuple(new_strides[d] for d in keep), mem.name, mem.arena, mem.pointer,
                          mem.buffer)

    return run


def _check_subview(mem: MemRef, offsets, sizes, steps, loc) -> None:
    """A window reaching past its source is out of bounds even before an access (MLIR: UB)."""
    for dim, (o, n, st, limit) in enumerate(zip(offsets, sizes, steps, mem.sizes)):
        if not all(isinstance(x, int) for x in (o, n, st, limit)) or n == 0:
            continue
        if o < 0 or o + (n - 1) * st >= limit:
            raise OutOfBoundsError(
                f"a window [{o}:{o + (n - 1) * st + 1}] of dimension {dim} is out of bounds for "
                f"{mem.name} of shape {tuple(mem.sizes)}",
                fix="keep tiles inside the tensor (mask the edge tile or pad the tensor)", loc=loc)


@semantics("memref.reinterpret_cast")
def _reinterpret_cast(op, p):
    src, *rest = p.operands(op)
    offs, sizes, strides = _static_lists(op)
    counts = [sum(1 for s in lst if s == _DYNAMIC) for lst in (offs, sizes, strides)]
    dyn = [rest[:counts[0]], rest[counts[0]:counts[0] + counts[1]], rest[counts[0] + counts[1]:]]
    out = p.result(op)

    def run(env, ctx):
        mem = env[src]
        (offset,) = _mixed(offs, dyn[0], env)
        env[out] = MemRef(mem.storage, offset, tuple(_mixed(sizes, dyn[1], env)),
                          tuple(_mixed(strides, dyn[2], env)), mem.name, mem.arena, mem.pointer)

    return run


@semantics("memref.collapse_shape")
def _collapse_shape(op, p):
    (src,) = p.operands(op)
    out = p.result(op)
    groups = [[ir.IntegerAttr(i).value for i in ir.ArrayAttr(g)]
              for g in ir.ArrayAttr(op.attributes["reassociation"])]

    def run(env, ctx):
        mem = env[src]
        sizes = tuple(int(np.prod([mem.sizes[d] for d in g])) for g in groups)
        strides = tuple(mem.strides[g[-1]] for g in groups)
        env[out] = MemRef(mem.storage, mem.offset, sizes, strides, mem.name, mem.arena,
                          mem.pointer, mem.buffer)

    return run


@semantics("memref.cast", "builtin.unrealized_conversion_cast")
def _passthrough(op, p):
    (src,) = p.operands(op)
    out = p.result(op)

    def run(env, ctx):
        env[out] = env[src]

    return run


@semantics("memref.dim")
def _dim(op, p):
    src, index = p.operands(op)
    out = p.result(op)

    def run(env, ctx):
        env[out] = np.array([env[src].sizes[int(env[index][0])]], np.int64)

    return run


@semantics("memref.extract_strided_metadata")
def _strided_metadata(op, p):
    (src,) = p.operands(op)
    base, offset, *rest = p.results(op)
    rank = len(rest) // 2

    def run(env, ctx):
        mem = env[src]
        env[base] = MemRef(mem.storage, mem.pointer, (), (), mem.name, mem.arena, mem.pointer)
        # Relative to the aligned pointer, as MLIR reports it (a memref.view's offset is 0).
        env[offset] = np.asarray(mem.offset, np.int64).reshape(-1) - mem.pointer
        for i in range(rank):
            env[rest[i]] = np.asarray(mem.sizes[i], np.int64).reshape(-1)
            env[rest[rank + i]] = np.asarray(mem.strides[i], np.int64).reshape(-1)

    return run


@semantics("memref.extract_aligned_pointer_as_index")
def _aligned_pointer(op, p):
    (src,) = p.operands(op)
    out = p.result(op)

    def run(env, ctx):
        mem = env[src]
        env[out] = np.array([mem.pointer * mem.storage.itemsize], np.int64)

    return run


def _element_access(env, ctx, index_slots, mask_slot, width):
    """``(mem, flat, ectx, keep)`` for a masked vector access seen as ``threads x width``
    scalar accesses: ``ectx`` has one entry per element, active where the thread is and its
    mask bit is set, so bounds and race checks see only the elements really touched."""
    n = ctx.size
    keep = np.broadcast_to(env[mask_slot], (n, width)) & ctx.active()[:, None]
    idx = [np.broadcast_to(env[i], (n,)) for i in index_slots]
    idx = [np.repeat(i, width) for i in idx[:-1]] + \
          [(idx[-1][:, None] + np.arange(width)).reshape(-1)]
    ectx = Context(ctx.cta, np.repeat(ctx.thread_ids, width), keep.reshape(-1))
    return idx, ectx, keep


@semantics("vector.maskedload")
def _masked_load(op, p):
    """Elements whose mask bit is clear read nothing and give ``pass_thru``."""
    src, *index, mask, passthru = p.operands(op)
    out = p.result(op)
    width = ir.VectorType(op.results[0].type).shape[-1]
    loc = location(op)

    def run(env, ctx):
        mem = env[src]
        idx, ectx, keep = _element_access(env, ctx, index, mask, width)
        fill = np.broadcast_to(env[passthru], (ctx.size, width))
        if not keep.any():
            env[out] = fill
            return
        flat = flat_offsets(mem, idx, ectx, loc)
        check_shared(mem, flat, ectx, False, "this masked vector load", loc)
        env[out] = np.where(keep, gather(mem, flat, ectx).reshape(ctx.size, width), fill)

    return run


@semantics("vector.maskedstore")
def _masked_store(op, p):
    """Only elements whose mask bit is set are written."""
    dst, *index, mask, value = p.operands(op)
    width = ir.VectorType(op.operands[-1].type).shape[-1]
    loc = location(op)

    def run(env, ctx):
        mem = env[dst]
        idx, ectx, keep = _element_access(env, ctx, index, mask, width)
        if not keep.any():
            return
        flat = flat_offsets(mem, idx, ectx, loc)
        check_shared(mem, flat, ectx, True, "this masked vector store", loc)
        scatter(mem, flat, np.broadcast_to(env[value], (ctx.size, width)).reshape(-1), ectx)

    return run
