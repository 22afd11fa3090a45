"""Ampere warp-level ops: ``cp.async`` copies, ``ldmatrix`` and ``mma.sync``.

- ``nvgpu.device_async_copy`` reads its source when issued and lands in shared memory when a
  ``nvgpu.device_async_wait`` retires its group (``create_group`` closes the group of the
  copies issued since the last one); touching the destination before is a race.
- ``nvgpu.ldmatrix``: lanes ``8i .. 8i+7`` give the row addresses of 8x8 matrix ``i``; lane
  ``l`` receives elements ``(l // 4, 2 (l % 4) + v)`` of each matrix (transposed with
  ``transpose``), as PTX ``ldmatrix.sync.aligned.m8n8`` defines.
- ``nvvm.mma.sync`` gathers the 32 lanes' A, B and C registers into tiles through the fragment
  layouts of ``kiln.layout`` (``mma_m16n8k16_a``/``_b``, ``mma_m16n8_accumulator``), multiplies
  in float64 and scatters D back.
"""

from __future__ import annotations

import re

import numpy as np
from mlir import ir

from kiln import layout as L
from kiln.core.errors import KilnValueError, UnsupportedError

from .ops_memory import flat_offsets
from .ops_mbarrier import operand_segments
from .ops_hopper import commit_group, retire_groups
from .plan import attr_int, defining_op, location, np_dtype, semantics
from .state import bounds_error, element_bytes
from kiln.core.dtypes import dtype as kiln_dtype


_LANES: dict[tuple[int, int], np.ndarray] = {}  # (threads, warp size) -> [warps, lanes]


def _warps(ctx, loc, what: str) -> np.ndarray:
    """Lane indices of each warp of the context, ``[warps, warp_size]``; ``what`` needs the
    whole warp active."""
    ws = ctx.cta.warp_size
    if ctx.size % ws:
        raise UnsupportedError(f"{what} needs whole warps", loc=loc)
    lanes = _LANES.get((ctx.size, ws))
    if lanes is None:
        lanes = _LANES[ctx.size, ws] = np.arange(ctx.size).reshape(-1, ws)
        lanes.flags.writeable = False
    if ctx.mask is not None:
        per_warp = ctx.mask.reshape(-1, ws)
        if np.any(per_warp.any(axis=1) & ~per_warp.all(axis=1)):
            raise UnsupportedError(f"{what} is warp-synchronous: every lane of a warp must "
                                   "execute it", fix="branch on warp-uniform values", loc=loc)
        return lanes[per_warp.all(axis=1)]
    return lanes


@semantics("nvgpu.device_async_copy")
def _cp_async(op, p):
    (dst,), dst_index, (src,), src_index, src_elements = operand_segments(op, p)
    out = p.result(op)
    count = attr_int(op, "dstElements")
    loc = location(op)

    def run(env, ctx):
        d_mem, s_mem = env[dst], env[src]
        n = ctx.size
        active = ctx.active()
        lanes = np.flatnonzero(active)
        valid = (np.broadcast_to(env[src_elements[0]], (n,)).astype(np.int64) if src_elements
                 else np.full(n, count))[lanes]
        d_flat = flat_offsets(d_mem, [env[i] for i in dst_index], ctx, loc, count)
        s_idx = [np.broadcast_to(env[i], (n,))[lanes] for i in src_index]
        s_flat = np.broadcast_to(flat_offsets(s_mem, [env[i] for i in src_index], ctx, loc,
                                              check=False), (n,))[lanes]
        reading = valid > 0
        nbytes = count * s_mem.storage.itemsize
        misaligned = reading & ((s_flat * s_mem.storage.itemsize) % nbytes != 0)
        if misaligned.any():  # the GPU faults (misaligned address) or copies garbage
            t = int(np.argmax(misaligned))
            raise KilnValueError(
                f"cp.async of {nbytes} bytes reads {s_mem.name} at element "
                f"{tuple(int(j[t]) for j in s_idx)}, which is not {nbytes}-byte aligned "
                f"(thread {int(ctx.thread_ids[lanes[t]])} of block {ctx.cta.block_id})",
                fix="copy from rows whose start is aligned (a row length that is a multiple of "
                    "the copy width), or copy synchronously", loc=loc)
        if ctx.cta.check_bounds and reading.any():
            for dim, (i, size) in enumerate(zip(s_idx, s_mem.sizes)):
                last = size - valid if dim == len(s_idx) - 1 else size - 1
                bad = reading & ((i < 0) | (i > last))
                if bad.any():
                    t = int(np.argmax(bad))
                    raise bounds_error(s_mem, tuple(j[t] for j in s_idx),
                                       int(ctx.thread_ids[lanes[t]]), ctx, loc)
        cols = np.arange(count)
        src_cols = s_flat[:, None] + cols * s_mem.strides[-1]
        keep = cols[None, :] < valid[:, None]
        # lanes reading nothing gather a harmless in-storage element (their address may be
        # anywhere: cp.async with src-size 0 does not dereference it)
        data = np.where(keep, s_mem.storage[np.where(keep, src_cols, 0)], 0)
        data = data.astype(d_mem.storage.dtype)
        d_cols = np.broadcast_to(d_flat, (n,))[lanes][:, None] + cols * d_mem.strides[-1]
        d_bytes = element_bytes(d_mem, d_cols.reshape(-1))
        shared, threads = ctx.cta.shared, ctx.thread_ids[lanes]

        def land(storage=d_mem.storage, d_cols=d_cols, data=data):
            storage[d_cols] = data
            shared.record_store(d_bytes.reshape(threads.size, -1), threads, loc,
                                "copied there with cp.async")

        op_id = shared.begin("cp.async copy", loc, write_bytes=d_bytes, land=land)
        ctx.pending_cp_async.append(op_id)
        env[out] = np.zeros(1, np.int64)  # the token; groups are tracked per context

    return run


@semantics("nvgpu.device_async_create_group")
def _create_group(op, p):
    out = p.result(op)

    def run(env, ctx):
        commit_group(ctx, "cp.async", ctx.pending_cp_async)
        env[out] = np.zeros(1, np.int64)

    return run


@semantics("nvgpu.device_async_wait")
def _wait(op, p):
    keep = attr_int(op, "numGroups", 0)

    def run(env, ctx):
        retire_groups(ctx, "cp.async", keep)

    return run


@semantics("nvgpu.ldmatrix")
def _ldmatrix(op, p):
    src, *index = p.operands(op)
    out = p.result(op)
    tiles = attr_int(op, "numTiles")
    transpose = ir.BoolAttr(op.attributes["transpose"]).value
    vtype = ir.VectorType(op.results[0].type)
    per_lane = vtype.shape[-1]
    row_elems = 16 // np_dtype(vtype).itemsize  # each matrix row is 16 bytes
    loc = location(op)

    lane = np.arange(32)[:, None]
    r, c = lane // 4, (lane % 4) * per_lane + np.arange(per_lane)[None, :]

    def run(env, ctx):
        mem = env[src]
        n = ctx.size
        result = np.zeros((n, tiles, per_lane), mem.storage.dtype)
        warps = _warps(ctx, loc, "nvgpu.ldmatrix")
        if not warps.size:
            env[out] = result
            return
        # every warp at once: lanes 8i .. 8i+7 of each warp give matrix i's row addresses
        providers = warps[:, :8 * tiles]
        if ctx.cta.check_bounds:
            _check_rows(mem, [np.broadcast_to(env[i], (n,))[providers] for i in index],
                        providers, row_elems, ctx, loc)
        flat = np.broadcast_to(flat_offsets(mem, [env[i] for i in index], ctx, loc, check=False),
                               (n,))
        rows = flat[providers][..., None] + np.arange(row_elems) * mem.strides[-1]
        shared = ctx.cta.shared
        if mem.is_shared:
            if shared.in_flight:  # bytes an async copy has yet to write
                shared.check(element_bytes(mem, rows.reshape(-1)), False, "this ldmatrix", loc)
            if shared.tma_loads:  # every lane receives data from every row of its warp
                for w, lanes in enumerate(warps):
                    shared.check_observed(element_bytes(mem, rows[w].reshape(-1))[None, :],
                                          ctx.thread_ids[lanes], ctx.cta.cluster.clock,
                                          ctx.cta.rank, "reads (ldmatrix)", loc)
        matrices = mem.storage[rows].reshape(len(warps), tiles, 8, row_elems)
        picked = matrices[:, :, c, r] if transpose else matrices[:, :, r, c]  # [w, tiles, 32, v]
        result[warps] = picked.transpose(0, 2, 1, 3)
        env[out] = result

    return run


def _groups(op) -> list[list]:
    """The op's operand values split by its ``operandSegmentSizes``."""
    values, groups = list(op.operands), []
    for n in ir.DenseI32ArrayAttr(op.attributes["operandSegmentSizes"]):
        groups.append(values[:n])
        values = values[n:]
    return groups


def _operand_reader(op, p, values: list, dtype: np.dtype):
    """A function of ``env`` giving the registers ``values`` side by side, ``[threads, n]``:
    the vector they were extracted from when they are all of one (its extracts are dropped),
    or the ``dtype`` elements that vector was bitcast from."""
    source = p.whole_vector(values)
    if source is not None:
        p.drop_unused(values, [op])
        cast = defining_op(source)
        if cast is not None and cast.name == "vector.bitcast" and \
                np_dtype(cast.operands[0].type) == dtype:  # read the halves, not the i32s
            p.drop_unused([source], [op] + [v.owner.operation for v in values])
            source = cast.operands[0]
        slot = p.slot(source)
        return lambda env: env[slot]
    slots = [p.slot(v) for v in values]
    return lambda env: _registers(env, slots)


def _registers(env, slots) -> np.ndarray:
    """The registers ``slots`` side by side, ``[threads, elements]``: scalars, or small vectors
    (f16 operands come as ``vector<2xf16>`` registers) laid out element by element."""
    values = [env[s] for s in slots]
    threads = max(v.shape[0] for v in values)
    return np.concatenate([np.broadcast_to(v.reshape(v.shape[0], -1),
                                           (threads, v.size // v.shape[0])) for v in values],
                          axis=1)


def _check_rows(mem, index: list, providers: np.ndarray, row_elems: int, ctx, loc) -> None:
    """Bounds of the row addresses ``index`` (``[warps, rows]`` per dimension); the first warp
    with a bad row is reported, at its first bad dimension, as a warp-by-warp check would."""
    last = [size - row_elems if dim == len(index) - 1 else size - 1
            for dim, size in enumerate(mem.sizes)]
    if all(i.min() >= 0 and i.max() <= end for i, end in zip(index, last)):
        return  # the common case, in two reductions a dimension
    bad = [(i < 0) | (i > end) for i, end in zip(index, last)]
    per_warp = np.stack([b.any(axis=1) for b in bad])  # [dims, warps]
    w = int(np.argmax(per_warp.any(axis=0)))
    dim = int(np.argmax(per_warp[:, w]))
    j = int(np.argmax(bad[dim][w]))
    raise bounds_error(mem, tuple(i[w, j] for i in index), int(ctx.thread_ids[providers[w, j]]),
                       ctx, loc)


_MMA_LAYOUTS = {(16, 8, 16): (L.mma_m16n8k16_a, L.mma_m16n8k16_b, L.mma_m16n8_accumulator)}


@semantics("nvvm.mma.sync")
def _mma_sync(op, p):
    out = p.result(op)
    loc = location(op)
    shape = tuple(int(v) for v in re.findall(r"=\s*(\d+)", str(op.attributes["shape"])))
    if shape not in _MMA_LAYOUTS or "row" not in str(op.attributes["layoutA"]) \
            or "col" not in str(op.attributes["layoutB"]):
        raise UnsupportedError(f"the interpreter runs mma.sync m16n8k16 row.col only, not "
                               f"m{shape[0]}n{shape[1]}k{shape[2]}", loc=loc)
    ptx_type = re.search(r"<(\w+)>", str(op.attributes["multiplicandAPtxType"])).group(1)

    operand_dtype = np.dtype(kiln_dtype(ptx_type).numpy)
    a_regs, b_regs, c_regs = (_operand_reader(op, p, group, dtype) for group, dtype in
                              zip(_groups(op), (operand_dtype, operand_dtype, np.float32)))
    m, n, k = shape
    (a_rows, a_cols), (b_rows, b_cols), (c_rows, c_cols) = (f().coords()
                                                             for f in _MMA_LAYOUTS[shape])

    # each layout is a bijection of (lane, register) onto the tile: gather through its inverse
    a_from, b_from, c_from = (np.argsort((rows * cols_of + cols).reshape(-1))
                              for rows, cols, cols_of in ((a_rows, a_cols, k), (b_rows, b_cols, n),
                                                          (c_rows, c_cols, n)))
    c_to = (c_rows * n + c_cols).reshape(-1)

    def unpack(read, env):
        """Registers (i32 holding packed halves, or plain values) as [threads, values]."""
        regs = read(env)
        if regs.dtype.itemsize != operand_dtype.itemsize:
            regs = np.ascontiguousarray(regs).view(operand_dtype)
        return regs.reshape(regs.shape[0], -1)

    def run(env, ctx):
        size = ctx.size
        warps = _warps(ctx, loc, "nvvm.mma.sync")
        whole = ctx.mask is None  # warps are then all the threads, in order
        if not warps.size:
            env[out] = np.zeros((size, c_rows.shape[1]), np.float32)
            return
        w = len(warps)
        a, b, c = unpack(a_regs, env), unpack(b_regs, env), c_regs(env)
        a, b, c = (x.reshape(w, -1) if whole and x.shape[0] == size else
                   np.broadcast_to(x, (size, x.shape[1]))[warps].reshape(w, -1)
                   for x in (a, b, c))
        # every warp's m x n x k product at once, in float64: one rounding, to f32
        ta = a[:, a_from].reshape(w, m, k).astype(np.float64)
        tb = b[:, b_from].reshape(w, k, n).astype(np.float64)
        tc = c[:, c_from].reshape(w, m, n)
        d = np.matmul(ta, tb).reshape(w, m * n)[:, c_to].reshape(w * 32, -1)
        d += tc.reshape(w, m * n)[:, c_to].reshape(w * 32, -1)
        if whole:
            env[out] = d.astype(np.float32)
            return
        result = np.zeros((size, c_rows.shape[1]), np.float32)
        result[warps.reshape(-1)] = d
        env[out] = result

    return run
