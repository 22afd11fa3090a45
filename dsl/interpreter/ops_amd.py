"""AMD ops: buffer views, global -> LDS DMA, ``s_waitcnt``, MFMA, transposed LDS reads, DPP.

Semantics follow the contracts written next to the builders (``kiln.amd_buffer``,
``kiln.amd_asm``, ``kiln.mfma``, ``kiln.loader``, ``kiln.shuffle``):

- ``amdgpu.fat_raw_buffer_cast``: a view whose loads outside ``valid_bytes`` return 0 and whose
  stores there vanish (``ops_memory.in_buffer``).
- ``amdgpu.gather_to_lds`` (``kiln.async = "vmcnt"``): lane ``l`` reads one transfer at its own
  source index; the wave writes them contiguously in lane order from the first active lane's
  LDS index. The data lands when an ``s_waitcnt`` leaves fewer ``vmcnt`` operations of the
  wave outstanding than were issued after it; reading the LDS bytes before is a race.
- ``amdgpu.mfma``: fragments gathered through ``kiln.mfma.operand_a_layout``/``_b`` and the
  accumulator layouts of ``kiln.layout``, ``D = A @ B + C`` in float64, scattered back.
- ``amdgpu.transpose_load``: ``kiln.loader.transpose_read_model`` on what each lane's 8-byte
  read fetched.
"""

from __future__ import annotations

import numpy as np
from mlir import ir

from kiln.core.errors import OutOfBoundsError, UnsupportedError
from kiln.amd.loader import transpose_read_model
from kiln.amd.sched import decode_waitcnt
from kiln.mfma import _accumulator_layout, operand_a_layout, operand_b_layout

from .ops_hopper import retire_groups
from .ops_memory import flat_offsets, in_buffer
from .ops_mbarrier import operand_segments
from .plan import attr_int, has_attr, location, semantics
from .state import MemRef, element_bytes

WAVE = 64


def _waves(ctx) -> list[np.ndarray]:
    """Lane-index arrays of the context's waves that have an active lane."""
    active = ctx.active().reshape(-1, WAVE)
    return [np.arange(w * WAVE, (w + 1) * WAVE) for w in np.flatnonzero(active.any(axis=1))]


def _live_waves(ctx) -> np.ndarray | None:
    """Indices of the context's waves that have an active lane; None when that is all of them
    (the common case: whole-wave ops then run on the arrays as they are)."""
    if ctx.mask is None:
        return None
    live = ctx.mask.reshape(-1, WAVE).any(axis=1)
    return None if live.all() else np.flatnonzero(live)


def _wave_rows(x: np.ndarray, size: int, waves: np.ndarray | None) -> np.ndarray:
    """``x`` (one row per lane, or one for all ``size`` lanes) as ``(waves, WAVE * values)``,
    only the waves ``waves``."""
    if x.shape[0] != size:
        x = np.broadcast_to(x, (size,) + x.shape[1:])
    x = x.reshape(size // WAVE, -1)
    return x if waves is None else x[waves]


@semantics("amdgpu.fat_raw_buffer_cast")
def _buffer_cast(op, p):
    (src,), valid_bytes, _swizzle_stride = operand_segments(op, p)
    out = p.result(op)
    reset = has_attr(op, "resetOffset")

    def run(env, ctx):
        mem = env[src]
        offset = int(np.asarray(mem.offset).reshape(-1)[0])
        base = offset if reset else mem.pointer
        item = mem.storage.itemsize
        if valid_bytes:
            extent = int(env[valid_bytes[0]][0]) // item
        else:
            extent = max((int(n) * int(s) for n, s in zip(mem.sizes, mem.strides)), default=0)
        hi = min(base + extent, mem.storage.size)
        env[out] = MemRef(mem.storage, offset, mem.sizes, mem.strides, f"buffer view of {mem.name}",
                          mem.arena, base, (base, hi))

    return run


@semantics("amdgpu.gather_to_lds")
def _gather_to_lds(op, p):
    (src,), src_index, (dst,), dst_index = operand_segments(op, p)
    ttype = ir.TypeAttr(op.attributes["transferType"]).value
    width = ir.VectorType(ttype).shape[0] if isinstance(ttype, ir.VectorType) else 1
    loc = location(op)

    def run(env, ctx):
        s_mem, d_mem = env[src], env[dst]
        n = ctx.size
        s_flat = np.broadcast_to(flat_offsets(s_mem, [env[i] for i in src_index], ctx, loc,
                                              width), (n,))
        d_first = np.broadcast_to(flat_offsets(d_mem, [env[i] for i in dst_index], ctx, loc,
                                               check=False), (n,))
        cols = s_flat[:, None] + np.arange(width) * s_mem.strides[-1]
        valid = in_buffer(s_mem, s_flat, width)
        if valid is None:
            data = s_mem.storage[cols]
        else:
            data = np.where(valid[:, None], s_mem.storage[np.where(valid[:, None], cols,
                                                                   s_mem.buffer[0])], 0)
        active = ctx.active()
        writes, values, issuers = [], [], []
        for lanes in _waves(ctx):
            on = lanes[active[lanes]]
            base = d_first[on[0]]
            targets = base + (lanes - lanes[0])[:, None] * width + np.arange(width)
            writes.append(targets[active[lanes]])
            values.append(data[on])
            issuers.append(ctx.thread_ids[on])
        threads = np.concatenate(issuers)
        targets = np.concatenate(writes).reshape(-1)
        data = np.concatenate(values).reshape(-1).astype(d_mem.storage.dtype)
        if targets.min(initial=0) < 0 or targets.max(initial=0) >= d_mem.storage.size:
            raise OutOfBoundsError("a global -> LDS DMA writes past the end of LDS", loc=loc)

        d_bytes = element_bytes(d_mem, targets)
        shared = ctx.cta.shared

        def land(storage=d_mem.storage, targets=targets, data=data):
            storage[targets] = data
            shared.record_store(d_bytes.reshape(threads.size, -1), threads, loc,
                                "copied there with a global -> LDS DMA")

        op_id = shared.begin("global -> LDS DMA", loc, write_bytes=d_bytes, land=land)
        ctx.async_groups.append(("vmcnt", [op_id]))

    return run


@semantics("rocdl.s.waitcnt")
def _waitcnt(op, p):
    keep = decode_waitcnt(ir.IntegerAttr(op.attributes["bitfield"]).value)["vmcnt"]

    def run(env, ctx):
        retire_groups(ctx, "vmcnt", keep)

    return run


@semantics("rocdl.s.barrier")
def _s_barrier(op, p):
    loc = location(op)

    def run(env, ctx):
        ctx.cta.barrier(ctx, loc, "s_barrier", WAVE)

    return run


@semantics("rocdl.sched.barrier", "rocdl.sched.group.barrier", "rocdl.iglp.opt",
           "rocdl.s.setprio")
def _scheduling_hint(op, p):
    return None  # steers LLVM's scheduler / issue priority only


@semantics("amdgpu.mfma")
def _mfma(op, p):
    a_slot, b_slot, c_slot = p.operands(op)[:3]
    out = p.result(op)
    loc = location(op)
    m, n, k = (ir.IntegerAttr(op.attributes[x]).value for x in ("m", "n", "k"))
    blocks = attr_int(op, "blocks", 1)
    if blocks != 1 or m != n or m not in (16, 32):
        raise UnsupportedError(f"the interpreter runs single-block 16x16 / 32x32 MFMAs, not "
                               f"{m}x{n}x{k} with {blocks} blocks", loc=loc)
    for name in ("cbsz", "abid"):
        if attr_int(op, name, 0):
            raise UnsupportedError(f"the interpreter has no MFMA {name} broadcast", loc=loc)
    # Which lane value holds each element of the row-major A (m x k) and B (k x n) tiles, and
    # where each lane's accumulator values sit in D (m x n): gathers, no scatters.
    (a_rows, a_cols), (b_rows, b_cols) = operand_a_layout(m, k).coords(), \
        operand_b_layout(k, n).coords()
    c_rows, c_cols = _accumulator_layout(m).coords()
    a_from, b_from = _inverse(a_rows * k + a_cols, m * k), _inverse(b_rows * n + b_cols, k * n)
    c_at = (c_rows * n + c_cols).reshape(-1)
    per_lane = c_rows.shape[1]

    def run(env, ctx):
        size = ctx.size
        waves = _live_waves(ctx)
        a, b, c = (_wave_rows(env[s], size, waves) for s in (a_slot, b_slot, c_slot))
        count = a.shape[0]
        ta = a.take(a_from, axis=1).astype(np.float64).reshape(count, m, k)
        tb = b.take(b_from, axis=1).astype(np.float64).reshape(count, k, n)
        product = (ta @ tb).reshape(count, m * n).take(c_at, axis=1)
        fragments = (product + c.astype(np.float64)).astype(np.float32)
        if waves is None:
            env[out] = fragments.reshape(size, per_lane)
            return
        d = np.zeros((size // WAVE, WAVE * per_lane), np.float32)
        d[waves] = fragments
        env[out] = d.reshape(size, per_lane)

    return run


def _inverse(position: np.ndarray, elements: int) -> np.ndarray:
    """For each of ``elements`` tile elements, the flat (lane, value) index holding it, given
    each (lane, value)'s ``position`` in the tile (a bijection for every MFMA operand layout)."""
    position = position.reshape(-1)
    if position.size != elements or not np.array_equal(np.sort(position), np.arange(elements)):
        raise UnsupportedError("the interpreter needs each MFMA operand element held by exactly "
                               "one lane value")
    return np.argsort(position)


@semantics("amdgpu.transpose_load")
def _transpose_load(op, p):
    src, *index = p.operands(op)
    out = p.result(op)
    per_lane = ir.VectorType(op.results[0].type).shape[0]
    # the model applied to each element's own index: which loaded element each lane receives
    gather = transpose_read_model(np.arange(WAVE * per_lane).reshape(WAVE, per_lane)).reshape(-1)
    loc = location(op)

    def run(env, ctx):
        mem = env[src]
        n = ctx.size
        flat = np.broadcast_to(flat_offsets(mem, [env[i] for i in index], ctx, loc, per_lane),
                               (n,))
        cols = flat[:, None] + np.arange(per_lane) * mem.strides[-1]
        if mem.is_shared:
            ctx.cta.shared.check(element_bytes(mem, cols.reshape(-1)), False,
                                 "this transposed LDS read", loc)
        loaded = mem.storage[cols]
        waves = _live_waves(ctx)
        moved = _wave_rows(loaded, n, waves).take(gather, axis=1).reshape(-1, per_lane)
        if waves is None:
            env[out] = moved
            return
        result = np.array(loaded)
        result.reshape(-1, WAVE, per_lane)[waves] = moved.reshape(-1, WAVE, per_lane)
        env[out] = result

    return run


_DPP_ROW = 16  # DPP row modes act within rows of 16 lanes


def dpp_source_lanes(kind: str, argument, lane: np.ndarray, wave: int) -> np.ndarray:
    """Per lane, the lane it reads for DPP ``kind`` (GCN3/CDNA ISA), or -1 where it reads
    nothing (past a row or wave edge, or a row ``row_bcast`` does not reach).

    Example: ``dpp_source_lanes("row_shr", 1, np.arange(16), 64)`` is ``[-1, 0, 1, ... 14]``.
    """
    in_row = lane % _DPP_ROW
    row_base = lane - in_row
    if kind == "quad_perm":
        return lane - lane % 4 + np.asarray(argument)[lane % 4]
    if kind in ("row_shl", "row_shr"):
        src = in_row + (argument if kind == "row_shl" else -argument)
        return np.where((src >= 0) & (src < _DPP_ROW), row_base + src, -1)
    if kind == "row_ror":
        return row_base + (in_row - argument) % _DPP_ROW
    if kind == "row_mirror":
        return row_base + _DPP_ROW - 1 - in_row
    if kind == "row_half_mirror":
        return lane - lane % 8 + 7 - lane % 8
    if kind in ("wave_shl", "wave_shr", "wave_rol", "wave_ror"):
        base = lane - lane % wave
        step = 1 if kind in ("wave_shl", "wave_rol") else -1
        src = lane % wave + step
        if kind in ("wave_rol", "wave_ror"):
            return base + src % wave
        return np.where((src >= 0) & (src < wave), base + src, -1)
    row = (lane % wave) // _DPP_ROW
    wave_base = lane - lane % wave
    if kind == "row_bcast_15":  # lane 15 of each row feeds the next row
        return np.where(row >= 1, wave_base + row * _DPP_ROW - 1, -1)
    if kind == "row_bcast_31":  # lane 31 feeds rows 2 and 3
        return np.where(row >= 2, wave_base + 31, -1)
    raise UnsupportedError(f"the interpreter has no semantics for DPP {kind} yet")


@semantics("amdgpu.dpp")
def _dpp(op, p):
    """Lanes of a row disabled by ``row_mask``/``bank_mask`` keep ``old``; lanes whose source
    is invalid read 0 with ``bound_ctrl``, else keep ``old``."""
    old, src = p.operands(op)[:2]
    out = p.result(op)
    kind = str(op.attributes["kind"]).rstrip(">").split()[-1]
    argument = None
    if "permArgument" in op.attributes:
        attr = op.attributes["permArgument"]
        argument = [ir.IntegerAttr(x).value for x in ir.ArrayAttr(attr)] \
            if isinstance(attr, ir.ArrayAttr) else ir.IntegerAttr(attr).value
    row_mask = ir.IntegerAttr(op.attributes["row_mask"]).value if "row_mask" in op.attributes \
        else 0xF
    bank_mask = ir.IntegerAttr(op.attributes["bank_mask"]).value \
        if "bank_mask" in op.attributes else 0xF
    bound_ctrl = "bound_ctrl" in op.attributes and ir.BoolAttr(op.attributes["bound_ctrl"]).value
    loc = location(op)
    try:
        dpp_source_lanes(kind, argument, np.arange(64), 64)
    except UnsupportedError as err:
        raise UnsupportedError(err.message, loc=loc) from None

    def run(env, ctx):
        n = ctx.size
        x = np.broadcast_to(env[src], (n,) + env[src].shape[1:])
        prev = np.broadcast_to(env[old], x.shape)
        lane = np.arange(n)
        wave_lane = ctx.thread_ids % ctx.cta.warp_size
        source = lane - wave_lane + dpp_source_lanes(kind, argument, wave_lane,
                                                     ctx.cta.warp_size)
        valid = source >= lane - wave_lane
        picked = x[np.where(valid, source, lane)]
        fill = np.zeros_like(picked) if bound_ctrl else prev
        picked = np.where(_lanes(valid, picked), picked, fill)
        row, bank = (wave_lane // _DPP_ROW) % 4, (wave_lane % _DPP_ROW) // 4
        enabled = ((row_mask >> row) & 1).astype(bool) & ((bank_mask >> bank) & 1).astype(bool)
        env[out] = np.where(_lanes(enabled, picked), picked, prev)

    return run


def _lanes(flags: np.ndarray, like: np.ndarray) -> np.ndarray:
    return flags.reshape(flags.shape + (1,) * (like.ndim - 1))


@semantics("rocdl.ds_swizzle")
def _ds_swizzle(op, p):
    src, pattern = p.operands(op)
    out = p.result(op)

    def run(env, ctx):
        bits = int(env[pattern][0])
        n = ctx.size
        x = np.broadcast_to(env[src], (n,) + env[src].shape[1:])
        lane = np.arange(n)
        if bits & 0x8000:  # quad-permute mode: lane 4q+i reads 4q + bits[2i+1:2i]
            within = lane % 4
            env[out] = x[lane - within + (bits >> (2 * within)) % 4]
            return
        and_mask, or_mask, xor_mask = bits & 0x1F, (bits >> 5) & 0x1F, (bits >> 10) & 0x1F
        within = lane % 32
        source = lane - within + (((within & and_mask) | or_mask) ^ xor_mask)
        env[out] = x[source]

    return run

