"""``nvgpu.mbarrier.*``: arrival counts, transaction bytes, phases and blocking waits.

An mbarrier completes its current phase when every expected arrival has arrived and the pending
transaction byte count is back to zero. The interpreter makes that completion as late as the
hardware may: it happens when a thread waits on the barrier (or the barrier is used for the next
phase), and async copies attached to the phase (TMA loads) land in shared memory only then, so a
read of their destination before the wait meets the race checker, never early data.
``try_wait.parity p`` blocks until the phase of parity ``p`` completed.
"""

from __future__ import annotations

import re

from mlir import ir
import numpy as np

from kiln.core.errors import KilnValueError

from .plan import location, semantics

_NUM_BARRIERS = re.compile(r"num_barriers\s*=\s*(\d+)")


def operand_segments(op, p) -> list[list[int]]:
    """Operand slots split by the op's ``operandSegmentSizes``."""
    sizes = list(ir.DenseI32ArrayAttr(op.attributes["operandSegmentSizes"]))
    slots = p.operands(op)
    out, start = [], 0
    for n in sizes:
        out.append(slots[start:start + n])
        start += n
    return out


class MBarrier:
    """One mbarrier's state; ``landing`` holds async copies that complete with the phase."""

    __slots__ = ("count", "pending", "tx", "phase", "landing", "initialised", "ready", "slot",
                 "heard", "known")

    def __init__(self):
        self.count = self.pending = self.tx = self.phase = 0
        self.landing: list = []
        self.initialised = False
        self.ready = False  # the phase's arrivals and bytes are all in; completion is pending
        self.slot = None  # column in the cluster's PhaseClock
        self.heard = self.known = None  # PhaseClock knowledge of arrivers / of the last phase

    def settle(self, cta) -> None:
        """Complete a ready phase: land its copies, flip the phase, re-arm the arrival count."""
        if not self.ready:
            return
        self.ready = False
        for land in self.landing:
            land()
        self.landing.clear()
        self.phase += 1
        self.pending = self.count
        cta.cluster.clock.complete(self)
        cta.notify()


class MBarrierGroup:
    """The barriers of one ``nvgpu.mbarrier.create`` in one CTA; ``key`` identifies the create
    op, so a peer CTA's group at the same shared offset is ``group.in_cta(peer)``."""

    def __init__(self, n: int, name: str, key: int):
        self.barriers = [MBarrier() for _ in range(n)]
        self.name = name
        self.key = key

    def in_cta(self, cta) -> "MBarrierGroup":
        """The same group in ``cta`` (a CTA of this cluster), created there if it has not run
        its ``mbarrier.create`` yet."""
        return cta.object(self.key, lambda: MBarrierGroup(len(self.barriers), self.name,
                                                          self.key))

    def get(self, i: int, loc) -> MBarrier:
        if not 0 <= i < len(self.barriers):
            raise KilnValueError(f"mbarrier index {i} is out of range for a group of "
                                 f"{len(self.barriers)}", fix="index within the group", loc=loc)
        return self.barriers[i]

    def arrive(self, cta, i: int, arrivals: int, tx_bytes: int, loc, rows=None) -> None:
        """``arrivals`` arrive on barrier ``i`` (from the threads at PhaseClock ``rows``)."""
        bar = self.get(i, loc)
        bar.settle(cta)
        if rows is not None:
            cta.cluster.clock.arrive(bar, rows)
        bar.tx += tx_bytes
        bar.pending -= arrivals
        self.maybe_complete(cta, bar)

    def complete_tx(self, cta, bar: MBarrier, nbytes: int, landing) -> None:
        bar.settle(cta)
        bar.tx -= nbytes
        bar.landing.append(landing)
        self.maybe_complete(cta, bar)

    @staticmethod
    def maybe_complete(cta, bar: MBarrier) -> None:
        if bar.initialised and bar.pending <= 0 and bar.tx == 0:
            bar.ready = True
            cta.shared.synchronised()
            cta.notify()


def active_per_index(index: np.ndarray, predicate, ctx) -> list[tuple[int, int, np.ndarray]]:
    """``(barrier index, number of active predicated threads, their PhaseClock rows)`` for an
    mbarrier op."""
    active = ctx.active()
    if predicate is not None:
        active = active & np.broadcast_to(predicate, active.shape)
    if not active.any():
        return []
    idx = np.broadcast_to(index, active.shape)[active]
    rows = ctx.cta.cluster.clock.rows(ctx, np.flatnonzero(active))
    values, counts = np.unique(idx, return_counts=True)
    return [(v, c, rows[idx == v]) for v, c in zip(values.tolist(), counts.tolist())]


@semantics("nvgpu.mbarrier.create")
def _create(op, p):
    out = p.result(op)
    match = _NUM_BARRIERS.search(str(op.results[0].type))
    n = int(match.group(1)) if match else 1
    key = out  # one group per create op per CTA, shared by all its contexts
    loc = location(op)

    def run(env, ctx):
        env[out] = ctx.cta.object(key, lambda: MBarrierGroup(n, f"mbarrier group at {loc}", key))

    return run


@semantics("nvgpu.mbarrier.init")
def _init(op, p):
    group, count, index, *pred = p.operands(op)
    loc = location(op)

    def run(env, ctx):
        g = env[group]
        for i, _, _ in active_per_index(env[index], env[pred[0]] if pred else None, ctx):
            bar = g.get(i, loc)
            bar.slot = bar.heard = bar.known = None  # phases count from 0 again: a new clock slot
            bar.count = bar.pending = int(env[count][0])
            bar.tx = bar.phase = 0
            bar.landing.clear()
            bar.ready = False
            bar.initialised = True

    return run


@semantics("nvgpu.mbarrier.arrive")
def _arrive(op, p):
    group, index = p.operands(op)
    out = p.result(op)
    loc = location(op)

    def run(env, ctx):
        g = env[group]
        for i, k, rows in active_per_index(env[index], None, ctx):
            g.arrive(ctx.cta, i, k, 0, loc, rows)
        env[out] = np.zeros(1, np.int64)  # the token: waits here use the phase parity instead

    return run


@semantics("nvgpu.mbarrier.arrive.expect_tx")
def _arrive_expect_tx(op, p):
    group, tx, index, *pred = p.operands(op)
    loc = location(op)

    def run(env, ctx):
        g = env[group]
        nbytes = int(env[tx][0])
        for i, k, rows in active_per_index(env[index], env[pred[0]] if pred else None, ctx):
            g.arrive(ctx.cta, i, k, k * nbytes, loc, rows)

    return run


@semantics("nvgpu.mbarrier.try_wait.parity")
def _try_wait_parity(op, p):
    group, parity, _ticks, index = p.operands(op)
    loc = location(op)

    def run(env, ctx):
        g = env[group]
        active = ctx.active()
        indices = np.broadcast_to(env[index], active.shape)[active]
        parities = np.broadcast_to(env[parity], active.shape)[active]
        pairs = set(zip(indices.tolist(), parities.tolist()))
        cta = ctx.cta
        rows = cta.cluster.clock.rows(ctx, np.flatnonzero(active))
        for i, par in sorted(pairs):
            bar = g.get(i, loc)

            def done(bar=bar, par=int(par)) -> bool:
                bar.settle(cta)
                return bar.phase % 2 != par

            def what(i=i, bar=bar, par=int(par)) -> str:
                return (f"mbarrier {i} phase parity {par} ({g.name}; still expecting "
                        f"{max(bar.pending, 0)} arrivals and {bar.tx} transaction bytes)")

            cta.block_until(ctx, done, what, loc)
            cta.cluster.clock.observe(bar, rows[(indices == i) & (parities == par)])

    return run
