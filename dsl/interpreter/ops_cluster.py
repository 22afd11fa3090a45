"""Thread-block clusters (sm_90): CTA ranks, the cluster barrier, remote mbarrier arrivals.

The CTAs of one cluster run together (``run.py``), each with its own shared memory and
barriers. Semantics:

- ``nvvm.read.ptx.sreg.cluster.*``: the CTA's rank and position in its cluster, the cluster's
  shape and its position in the grid.
- ``nvvm.cluster.arrive`` / ``nvvm.cluster.wait``: a barrier over every thread of every CTA of
  the cluster (arrive counts the context's active threads; wait blocks until all arrived).
- ``nvgpu.mbarrier.get``: the barrier's address is an opaque handle (the create op's key and the
  barrier index), not a byte offset: the interpreter keeps mbarriers outside the shared arena.
  ``llvm.inttoptr`` passes it through; ``nvvm.mapa`` tags it with the target CTA's rank.
- ``nvvm.mbarrier.arrive`` on such a handle: each active thread arrives once on that barrier of
  that CTA (its own CTA when the pointer was not mapped).
"""

from __future__ import annotations

import numpy as np

from kiln.core.errors import UnsupportedError

from .plan import location, semantics

_INDEX_BITS = 12  # barrier index within a group
_RANK_SHIFT = 40  # nvvm.mapa stores the target rank + 1 here (0: this CTA)


def _uniform_int(value_of):
    def build(op, p):
        out = p.result(op)

        def run(env, ctx):
            env[out] = np.array([value_of(ctx.cta)], np.int32)

        return run

    return build


_SREGS = {"ctarank": lambda cta: cta.rank, "nctarank": lambda cta: len(cta.cluster.ctas)}
for _axis, _name in enumerate("xyz"):
    _SREGS[f"ctaid.{_name}"] = lambda cta, a=_axis: cta.block_id[a] % cta.cluster.shape[a]
    _SREGS[f"nctaid.{_name}"] = lambda cta, a=_axis: cta.cluster.shape[a]
for _sreg, _fn in _SREGS.items():
    semantics(f"nvvm.read.ptx.sreg.cluster.{_sreg}")(_uniform_int(_fn))
for _axis, _name in enumerate("xyz"):
    semantics(f"nvvm.read.ptx.sreg.clusterid.{_name}")(_uniform_int(
        lambda cta, a=_axis: cta.block_id[a] // cta.cluster.shape[a]))


@semantics("nvvm.cluster.arrive", "nvvm.cluster.arrive.relaxed")
def _cluster_arrive(op, p):
    def run(env, ctx):
        ctx.cta.cluster.arrive(ctx)

    return run


@semantics("nvvm.cluster.wait")
def _cluster_wait(op, p):
    loc = location(op)

    def run(env, ctx):
        ctx.cta.cluster.wait(ctx, loc)

    return run


@semantics("nvgpu.mbarrier.get")
def _mbarrier_get(op, p):
    group, index = p.operands(op)
    out = p.result(op)

    def run(env, ctx):
        env[out] = (np.int64(env[group].key) << _INDEX_BITS) | env[index].astype(np.int64)

    return run


@semantics("llvm.inttoptr", "llvm.ptrtoint")
def _pointer_cast(op, p):
    src, = p.operands(op)
    out = p.result(op)

    def run(env, ctx):
        env[out] = env[src].astype(np.int64)

    return run


@semantics("nvvm.mapa")
def _mapa(op, p):
    address, rank = p.operands(op)
    out = p.result(op)
    loc = location(op)

    def run(env, ctx):
        r = env[rank].astype(np.int64)
        size = len(ctx.cta.cluster.ctas)
        if ((r < 0) | (r >= size)).any():
            bad = int(r[(r < 0) | (r >= size)][0])
            raise UnsupportedError(f"mapa to CTA rank {bad}, but the cluster has {size} CTAs",
                                   fix=f"use a rank in 0..{size - 1}", loc=loc)
        local = env[address].astype(np.int64) & ((1 << _RANK_SHIFT) - 1)
        env[out] = local | ((r + 1) << _RANK_SHIFT)

    return run


@semantics("nvvm.mbarrier.arrive")
def _mbarrier_arrive(op, p):
    address, *count = p.operands(op)
    outs = p.results(op)
    loc = location(op)

    def run(env, ctx):
        active = ctx.active()
        handles = np.broadcast_to(env[address], active.shape)[active]
        rows = ctx.cta.cluster.clock.rows(ctx, np.flatnonzero(active))
        arrivals = int(env[count[0]][0]) if count else 1
        for handle, threads in zip(*np.unique(handles, return_counts=True)):
            mine = rows[handles == handle]
            handle = int(handle)
            rank = (handle >> _RANK_SHIFT) - 1
            cta = ctx.cta if rank < 0 else ctx.cta.cluster.ctas[rank]
            local = handle & ((1 << _RANK_SHIFT) - 1)
            key, index = local >> _INDEX_BITS, local & ((1 << _INDEX_BITS) - 1)
            group = cta.objects.get(key)
            if group is None:
                raise UnsupportedError("mbarrier.arrive on an address that is not an mbarrier "
                                       "of kiln.mbarrier.group (or whose CTA has not created "
                                       "it yet)", fix="arrive through MBarrierGroup.arrive / "
                                                      "arrive_cluster after a cluster_sync()",
                                       loc=loc)
            group.arrive(cta, index, int(threads) * arrivals, 0, loc, mine)
        for out in outs:
            env[out] = np.zeros(1, np.int64)  # the state token: waits use the phase parity

    return run
