"""``gpu`` ops (ids, barrier, shuffle) and the ``nvvm`` ops that only order memory.

Fences order memory between proxies on the GPU; the interpreter performs every access in program
order and applies async copies at their completion point, one CTA (or cluster) at a time, so
fences (proxy fences, and `llvm.fence` of `kiln.fence`) have nothing to do.
"""

from __future__ import annotations

import sys

import numpy as np
from mlir import ir

from kiln.core.errors import UnsupportedError
from kiln.nvidia.sync import NAMED_BARRIER_ANY, WAIT_FOR_COUNT

from .plan import location, semantics

_AXES = {"x": 0, "y": 1, "z": 2}


def _axis(op) -> int:
    return _AXES[str(op.attributes["dimension"]).rstrip(">").split()[-1]]


@semantics("gpu.thread_id")
def _thread_id(op, p):
    out, axis = p.result(op), _axis(op)

    def run(env, ctx):
        bx, by, _ = ctx.cta.block
        t = ctx.thread_ids
        env[out] = (t % bx if axis == 0 else (t // bx) % by if axis == 1 else t // (bx * by))

    return run


def _uniform_id(field):
    def build(op, p):
        out, axis = p.result(op), _axis(op)

        def run(env, ctx):
            env[out] = np.array([getattr(ctx.cta, field)[axis]], np.int64)

        return run
    return build


for _name, _field in (("gpu.block_id", "block_id"), ("gpu.block_dim", "block"),
                      ("gpu.grid_dim", "grid")):
    semantics(_name)(_uniform_id(_field))


@semantics("gpu.lane_id")
def _lane_id(op, p):
    out = p.result(op)

    def run(env, ctx):
        env[out] = ctx.thread_ids % ctx.cta.warp_size

    return run


@semantics("gpu.barrier")
def _barrier(op, p):
    loc = location(op)

    def run(env, ctx):
        ctx.cta.barrier(ctx, loc)

    return run


@semantics("llvm.inline_asm")
def _inline_asm(op, p):
    """Inline asm the DSL emits carries its declaration (``kiln.op``), whose semantics the plan
    runs instead; any other inline asm is opaque."""
    text = ir.StringAttr(op.attributes["asm_string"]).value
    raise UnsupportedError(f"the interpreter has no semantics for inline asm {text!r} yet",
                           fix="emit it through a declared op (kiln.core.ops)", loc=location(op))


@semantics(NAMED_BARRIER_ANY.name)
def _named_barrier_any(op, p):
    flag, barrier_id, count = p.operands(op)
    loc = location(op)
    out = p.result(op)

    def run(env, ctx):
        flags = np.broadcast_to(env[flag], (ctx.size,)) != 0
        vote = ctx.cta.named_barrier_any(ctx, int(env[barrier_id][0]), int(env[count][0]),
                                         flags, loc)
        env[out] = np.full(ctx.size, int(vote), np.int32)

    return run


def _counters_of(address):
    """The memref whose aligned pointer the i64 ``address`` of
    :meth:`kiln.tensor.TensorRef.element_address` was computed from (through index arithmetic)."""
    pending = [address]
    while pending:
        owner = pending.pop().owner
        name = getattr(owner, "name", None)
        if name == "memref.extract_aligned_pointer_as_index":
            return owner.operands[0]
        if name is not None and name.startswith("arith."):
            pending.extend(owner.operands)
    raise UnsupportedError("wait_for_count's address does not come from a tensor's "
                           "element_address", fix="pass the counters as a kiln.Tensor")


@semantics(WAIT_FOR_COUNT.name)
def _wait_for_count(op, p):
    """The wait of :func:`kiln.nvidia_asm.wait_for_count`: CTAs run one at a time here, so a
    counter short of its target would never grow; the wait passes when the CTAs run before
    this one already brought the counter there, and raises otherwise."""
    address, target = p.operands(op)
    counters = p.slot(_counters_of(op.operands[0]))
    loc = location(op)

    def wait(env, ctx):
        storage = env[counters].storage
        where = np.broadcast_to(env[address], (ctx.size,)) // storage.itemsize
        goal = np.broadcast_to(env[target], (ctx.size,))
        ctx.cta.globals.atomic(env[counters], where[ctx.active().reshape(-1)], ctx)
        for t in np.flatnonzero(ctx.active().reshape(-1)):
            if int(storage[where[t]]) < int(goal[t]):
                raise UnsupportedError(
                    f"kiln.nvidia_asm.wait_for_count waits for the counter to reach "
                    f"{int(goal[t])}, but it is {int(storage[where[t]])} and the interpreter "
                    "runs CTAs one at a time: the CTAs that would add to it run after this one",
                    fix="run the kernel on the GPU, or wait only for CTAs earlier in block "
                        "order under the interpreter", loc=loc)

    return wait


@semantics("gpu.shuffle")
def _shuffle(op, p):
    """Lanes form segments of ``width`` (a power of two up to the warp size), as PTX ``shfl``'s
    segment mask and AMD's ``ds_bpermute`` lowering make them: a source lane outside the
    reader's segment is invalid and the reader keeps its own value."""
    value, offset, width = p.operands(op)
    out, valid = p.results(op)
    mode = str(op.attributes["mode"]).rstrip(">").split()[-1]
    loc = location(op)

    def run(env, ctx):
        ws = ctx.cta.warp_size
        n = ctx.size
        v = np.broadcast_to(env[value], (n,) + env[value].shape[1:])
        w = int(env[width][0])
        if not 1 <= w <= ws or w & (w - 1):
            raise UnsupportedError(f"the interpreter supports gpu.shuffle widths that are powers "
                                   f"of two up to the warp size ({ws}), got width {w}",
                                   fix=f"use a width of 1, 2, 4, ... {ws}", loc=loc)
        lane = ctx.thread_ids % ws
        segment = lane - lane % w
        off = np.broadcast_to(env[offset], (n,)).astype(np.int64)
        src = {"xor": lane ^ off, "down": lane + off, "up": lane - off,
               "idx": segment + off}[mode]
        ok = (src >= segment) & (src < segment + w)
        src = np.where(ok, src, lane)
        env[out] = v[(np.arange(n) - lane) + src]
        env[valid] = ok

    return run


@semantics("nvvm.elect.sync")
def _elect_sync(op, p):
    out = p.result(op)

    def run(env, ctx):
        ws = ctx.cta.warp_size
        active = ctx.active().reshape(-1, ws)
        first = np.zeros_like(active)
        first[np.arange(active.shape[0]), np.argmax(active, axis=1)] = True
        env[out] = (first & active).reshape(-1)

    return run


@semantics("nvvm.vote.sync")
def _vote_sync(op, p):
    """``vote.sync.any`` over the warp's active lanes (``kiln.shuffle.any_lane``, the only
    vote the DSL emits)."""
    _, pred = p.operands(op)
    out = p.result(op)
    kind = str(op.attributes["kind"]).rstrip(">").split()[-1]
    if kind != "any":
        raise UnsupportedError(f"the interpreter supports vote.sync any, not {kind}",
                               fix="use kiln.shuffle.any_lane", loc=location(op))

    def run(env, ctx):
        ws = ctx.cta.warp_size
        flags = np.broadcast_to(env[pred], (ctx.size,)).reshape(-1, ws).astype(bool)
        active = ctx.active().reshape(-1, ws)
        env[out] = np.repeat((flags & active).any(axis=1), ws)

    return run


@semantics("nvvm.fence.mbarrier.init", "nvvm.fence.proxy", "nvvm.setmaxregister",
           "nvgpu.tma.prefetch.descriptor", "nvvm.cp.async.bulk.tensor.prefetch",
           "nvvm.fence.proxy.acquire",
           "nvvm.fence.proxy.release", "rocdl.sched.barrier", "rocdl.s.setprio", "llvm.fence",
           "nvvm.griddepcontrol")  # one grid at a time: every prior grid has completed
def _no_effect(op, p):
    return None


@semantics("gpu.subgroup_broadcast")
def _subgroup_broadcast(op, p):
    """Every lane gets the value of its warp's first active lane (``first_active_lane``) or of
    the lane operand (``specific_lane``)."""
    value, *lane_operand = p.operands(op)
    out = p.result(op)

    def run(env, ctx):
        ws = ctx.cta.warp_size
        v = np.broadcast_to(env[value], (ctx.size,) + env[value].shape[1:])
        warp_base = np.arange(ctx.size) - ctx.thread_ids % ws
        if lane_operand:
            src = np.broadcast_to(env[lane_operand[0]], (ctx.size,)).astype(np.int64)
        else:
            src = np.argmax(ctx.active().reshape(-1, ws), axis=1).repeat(ws)
        env[out] = v[warp_base + src]

    return run


@semantics("gpu.printf")
def _printf(op, p):
    """``kiln.print``: one line per active thread, prefixed like ``[block (0, 0, 0) thread 5]``.
    The format's conversions are ``%d``, ``%lld`` and ``%g`` (kiln.printing), which Python's
    ``%`` operator reads once ``%lld`` is spelled ``%d``."""
    fmt = ir.StringAttr(op.attributes["format"]).value.replace("%lld", "%d")
    args = p.operands(op)

    def run(env, ctx):
        n = ctx.size
        columns = [np.broadcast_to(env[a], (n,)) for a in args]
        block = tuple(int(b) for b in ctx.cta.block_id)
        for k in np.flatnonzero(ctx.active()):
            values = tuple(c[k].item() for c in columns)
            sys.stdout.write(f"[block {block} thread {int(ctx.thread_ids[k])}] " + fmt % values)

    return run
