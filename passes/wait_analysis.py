"""The analysis behind ``kiln-insert-waits`` and ``kiln-verify-waits``: which async reads a
counter wait covers, over every path of a ``gpu.func``.

It is a forward dataflow. Its state maps every *tracked* asynchronous operation ("event") that
may still be outstanding to a :class:`Pending`: the number of same-counter events issued after
it ("younger", minimised over paths) and the last barrier it crossed. A wait ``counter(N)``
retires every event with ``younger >= N`` (the counters retire in order); N is at most the
counter's maximum minus one (``vmcnt(63)`` waits for nothing).

Tracked events are the ops whose declaration (:mod:`kiln.core.ops`, found by
:func:`kiln.core.ops.lookup`) gives an async ``counter`` -- each is exactly one hardware
instruction, so counts are exact -- and ops tagged ``kiln.async = "<counter>"``
(:func:`kiln.amd.sched.mark_async`). The declared effects say the rest: which shared buffers an
event writes (``writes``), which ops read shared memory through descriptors, which commit
(``commits``: WGMMA events are uncommitted until the next commit group and then counted in
groups), which wait (``waits``: counter -> N) or wait on an mbarrier (``mbarrier``; a TMA load
is retired only by a wait on its barrier), and which are block-wide barriers. Nothing here
names an op: a new async op is covered once its family module declares it.

Plain ``memref``/``vector`` loads and stores also use the counters but LLVM may merge, split or
scalarise them, so they are *not counted*: leaving them out only makes a computed wait stricter.

Which events an op reads does not depend on the path, so it is computed once per op
(:attr:`Step.reads`) before the walk:

- the events whose *register result* reaches an operand. Register data movement
  (:data:`DATA_MOVES`: ``vector.shuffle``, ``vector.extract``, bitcasts, ...), ``scf.yield``,
  ``scf.for`` iter_args and ``scf.if``/``scf.for`` results forward "pending" from their
  operands to their results instead of consuming it; any other op (arithmetic, MMA, store,
  an ``scf.if`` condition, loop bounds) is a consumer;
- the events that write an LDS buffer the op accesses (global->LDS DMA, ``cp.async``). Buffers
  are told apart by their root (``memref.get_global`` symbol, kernel argument, ``memref.alloc``,
  a ``kiln.dynamic_shared`` allocation by its ``kiln.buffer`` offset; an unknown root aliases
  every buffer); view ops (``memref.collapse_shape``, ...) and ops that touch only mbarriers
  (``Effects.data``) access nothing; descriptor readers (``Effects.indirect_shared``) access
  the buffers their descriptors are computed from;
- the events named by ``kiln.waits_for = [tokens]`` (``kiln.token`` ids).

The ops that then read no event and touch no counter, barrier or mbarrier are dropped from the
op tree: the walks below pass them by (:meth:`Step.inert`).

A release arrive declaring ``releases`` (``{wgmma: N}``: the buffer it hands back was read by
WGMMA groups older than the newest N) is checked against the count of committed WGMMA groups
that may be in flight (the state's :data:`GROUPS` entry): more than N is a Gap on the WGMMA,
whose ``wgmma.wait_group(N)`` goes before the ``scf.if`` ops around the arrive.

A read whose event is still in the state is a :class:`Gap`. Its wait goes before the last
barrier between the event and the read when the event writes LDS (other waves read it only after
that barrier), with the event's count *at that barrier*; else right before the read.
``scf.for`` bodies run to a fixed point (steady state across the back-edge) and are then walked
once more to record gaps; ``scf.if`` joins both arms; other region ops are walked once and joined.

Reads of a buffer that another warp group TMA-loads (the other arm of an ``scf.if``) never see
the load in their state; :mod:`kiln.passes.mbarrier_protocol` checks their mbarrier hand-over
and adds its gaps to the same list.

With ``place=True`` each gap is closed as it is found: the wait is built in the IR and applied
to the state, so later reads see it. A loop's fixed point was computed before that walk, so a
wait placed in a body is not seen across the back-edge until the next analysis: the state is
then a superset of the true one and every placed wait stays sufficient.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from mlir import ir

# The GFX9 s_waitcnt immediate, under the names the passes and their tests use.
from kiln.amd.sched import decode_waitcnt as decode_gfx9_waitcnt  # noqa: F401
from kiln.amd.sched import GFX9_WAITCNT_FIELDS
from kiln.amd.sched import encode_waitcnt as encode_gfx9_waitcnt  # noqa: F401
from kiln.core.ops import CP_ASYNC  # noqa: F401 - the passes' counter names live in kiln.core.ops
from kiln.core.ops import AUTO_WAIT_ATTR, MBARRIER, NO_EFFECTS, WGMMA, Effects, is_shared
from kiln.nvidia.mbarrier import RING_PAIR_ATTR
from kiln.passes.mbarrier_protocol import cross_thread_gaps
from kiln.passes.op_queries import (NO_ACCESS, NOT_SHARED, BufferRoots, aliases_any,
                                    buffer_root, effects, is_exact_root, named_effects,
                                    same_mbarrier, written_roots)
from kiln.passes.reaching_events import DATA_MOVES, ReachingEvents

GFX9_MAX = {name: limit for name, limit, _ in GFX9_WAITCNT_FIELDS}  # counter(max) waits for nothing
UNCOMMITTED = -1  # ``younger`` of an mma_async not yet in a commit group: no wait retires it


@dataclass(eq=False, slots=True)
class Step:
    """One op as the analysis sees it (compared by identity; events are Steps too)."""

    op: ir.Operation
    kind: str                    # "op" | "for" | "if"
    counter: str | None = None   # set for tracked events
    roots: tuple | None = None   # LDS buffers an event writes (None: registers only)
    limits: dict = field(default_factory=dict)
    barrier: bool = False
    commit: bool = False         # wgmma.commit_group: uncommitted mma_async ops form a group
    descriptors: bool = False    # reads shared memory through matrix descriptors
    accumulates: bool = False    # a same-counter event's result chained in is no read
    arrive: object = None        # the mbarrier group an arrive hands back (mbarrier_protocol)
    releases: dict = field(default_factory=dict)  # counter -> N groups a release may leave
    data: bool = True            # touches shared data (not only mbarriers)
    signal: tuple | None = None  # the mbarrier a TMA load signals / a try_wait waits on
    blocks: Sequence = ()       # nested blocks, each a list of Steps
    reads: tuple = ()            # events this op consumes (filled after all events are known)
    shared_reads: tuple = ()     # buffers a WGMMA event reads through its descriptors
    refills: tuple = ()          # buffers a cp.async group, TMA load or shared store (re)writes
    tokens: tuple = ()           # the kiln.token ids its kiln.waits_for names

    def inert(self) -> bool:
        """Whether the walks pass it by: a plain op that reads no event and does nothing to
        the counters, barriers or mbarriers."""
        return self.kind == "op" and not (
            self.reads or self.blocks or self.counter or self.limits or self.barrier
            or self.commit or self.signal is not None or self.arrive is not None
            or self.releases or self.refills)


@dataclass(frozen=True)
class Pending:
    """One outstanding event: younger same-counter events, the last barrier since it issued
    (a Step, or None when none or the paths disagree) and the younger count at that barrier."""

    younger: int
    barrier: object = None
    at_barrier: int = 0


@dataclass
class Gap:
    """A read that no wait covers: the read, the event, and where the wait should go. With
    ``overwrite``, ``reader`` is a TMA load that may overwrite the buffer ``event`` (in another
    warp group) reads before that warp group released it. With ``release``, ``reader`` is an
    arrive handing back a buffer that WGMMA groups older than the newest ``count`` read."""

    reader: ir.Operation
    event: ir.Operation
    counter: str
    count: int
    place_before: ir.Operation
    overwrite: bool = False
    release: bool = False
    rewrite: bool = False  # reader: a cp.async group refilling a buffer the WGMMA event reads


State = dict  # event Step -> Pending
# The state's key for the count of committed WGMMA groups not known retired (its ``younger``,
# maximised over paths): a re-issued mma_async replaces its older instance in the state, so
# releases count groups instead. Saturates at MAX_GROUPS to keep loop fixed points finite.
# Synchronous writes of shared memory a WGMMA in flight may still read (_check_rewrites): those
# tile copies (kiln.copy) mark with AUTO_WAIT_ATTR, as their cp.async groups. Hand-written
# kernels' writes are not checked: stages of one ring buffer are not told apart.
SHARED_STORES = frozenset(("vector.store", "vector.maskedstore", "memref.store"))
GROUPS = Step(None, "groups")
_PLAIN = Step(None, "op")  # what a plain op (a bare ir.Operation in the op tree) declares
MAX_GROUPS = 8


def _registers_only(name: str) -> bool:
    """Whether an op's operands are never buffers: ``arith`` and ``math`` ops take integers,
    floats, indices and vectors of them (but ``arith.select``, any type), so their operands
    are not asked whether they are shared memory."""
    return name.startswith(("arith.", "math.")) and name != "arith.select"


def _join(a: State, b: State) -> State:
    out = dict(a)
    for key, pend in b.items():
        other = out.get(key)
        if other is None:
            out[key] = pend
        elif other != pend:
            same = pend.barrier is other.barrier
            out[key] = Pending(min(pend.younger, other.younger), pend.barrier if same else None,
                               min(pend.at_barrier, other.at_barrier) if same else 0)
    if GROUPS in a or GROUPS in b:  # absent: no group committed on that path
        out[GROUPS] = Pending(max(a.get(GROUPS, Pending(0)).younger,
                                  b.get(GROUPS, Pending(0)).younger))
    return out


def _retire(state: State, counter: str, count: int, barrier=None) -> State:
    """``state`` after ``counter(count)``; with ``barrier``, the wait sits right before it."""
    if barrier is None:
        out = {k: p for k, p in state.items() if not (k.counter == counter and p.younger >= count)}
        if counter == WGMMA and GROUPS in out:
            out[GROUPS] = Pending(min(out[GROUPS].younger, count))
        return out
    return {k: p for k, p in state.items() if not (
        k.counter == counter and p.barrier is barrier and p.at_barrier >= count)}


def _retire_mbarrier(state: State, signal: tuple) -> State:
    """``state`` after a completed wait on the mbarrier ``signal``: its TMA loads have landed."""
    return {k: p for k, p in state.items()
            if not (k.counter == MBARRIER and same_mbarrier(k.signal, signal))}




def _ring_pair(group) -> int | None:
    """The ``kiln.ring_pair`` id on an mbarrier group's create (kiln.tile_tma), else None."""
    owner = getattr(group, "owner", None)
    if owner is None or isinstance(owner, ir.Block) \
            or RING_PAIR_ATTR not in owner.operation.attributes:
        return None
    return ir.IntegerAttr(owner.operation.attributes[RING_PAIR_ATTR]).value


def _touches_wgmma(op: ir.Operation) -> bool:
    """Whether ``op`` or an op nested in it issues, commits or waits on WGMMA groups."""
    found = []

    def visit(inner):
        declared = effects(inner.operation)
        if WGMMA in (declared.counter, declared.commits) or (
                declared.waits is not None and WGMMA in declared.waits(inner.operation)):
            found.append(inner)
            return ir.WalkResult.INTERRUPT
        return ir.WalkResult.ADVANCE

    op.walk(visit)
    return bool(found)


def release_point(op: ir.Operation) -> ir.Operation:
    """Where the wait a release ``op`` lacks goes: before the ``scf.if`` ops around it
    (``wgmma.wait_group`` is warp-group aligned; the arrive often runs on one thread), as long
    as nothing ahead of it in their arms touches WGMMA groups (the count is the same there)."""
    point = op
    while point.parent is not None and point.parent.operation.name == "scf.if":
        ahead = []
        for view in point.block.operations:
            if view.operation == point:
                break
            ahead.append(view.operation)
        if any(_touches_wgmma(o) for o in ahead):
            break
        point = point.parent.operation
    return point


class WaitAnalysis:
    """Forward dataflow over one ``gpu.func``.

    ``gaps`` lists the uncovered reads in walk order. ``place`` is None, or a callable
    ``place(gap) -> None`` that builds the wait for a gap: the analysis then applies that wait
    and goes on (``placed`` counts them). Example::

        gaps = WaitAnalysis(func).gaps          # kiln-verify-waits
        WaitAnalysis(func, place=build_wait)    # kiln-insert-waits
    """

    def __init__(self, func: ir.Operation, *, place=None):
        self.gaps: list[Gap] = []
        self.placed = 0
        self._place = place
        self._record = True
        self._steps: dict = {}    # ir.Operation -> Step, for events
        self._tokens: dict = {}   # kiln.token id -> event Step
        self._buffers = BufferRoots()
        body = self._build(func.regions[0].blocks[0])
        # events whose register result is the data (LDS writes are found by buffer instead)
        self._value_events = ReachingEvents({op: s for op, s in self._steps.items()
                                             if s.roots is None}, body)
        self._resolve_reads(body)
        self._walk(body, {})
        for gap in cross_thread_gaps(body, Gap, placing=self._place is not None):
            if self._close(gap) and not gap.overwrite:
                break  # a reader's wait may cover later reads: one per walk

    def _close(self, gap: Gap) -> bool:
        """Record ``gap``; when inserting, place its wait. True when placed (the caller retires
        what the wait covers), False when only verifying."""
        self.gaps.append(gap)
        if self._place is None:
            return False
        self._place(gap)
        self.placed += 1
        return True

    # -- the op tree -------------------------------------------------------------------------
    def _build(self, block: ir.Block) -> list:
        """``block``'s op tree: a Step per op, but a plain op (no declared effect, no region)
        stays a bare ir.Operation until _resolve_block finds what it reads."""
        steps = []
        for view in block.operations:
            op = view.operation
            name = op.name
            attrs = op.attributes  # read once: each access builds a new dictionary view
            found = named_effects(op, name, attrs)
            regions = len(op.regions)  # listing an op's regions costs ten times their number
            refills = name in SHARED_STORES and AUTO_WAIT_ATTR in attrs
            if found is NO_EFFECTS and not (regions or refills or "kiln.waits_for" in attrs):
                steps.append(op)  # most ops: a Step only if they read an event (_resolve_block)
                continue
            if found is NO_EFFECTS:
                step = Step(op, "for" if name == "scf.for" else "if" if name == "scf.if" else "op")
            else:
                step = self._declared_step(op, name, found)
            if refills:
                step.refills = tuple(buffer_root(v) for v in op.operands if is_shared(v))
            step.counter = found.counter
            if step.counter is not None:
                step.roots = written_roots(op)
                if step.counter == WGMMA and step.descriptors:
                    step.shared_reads = tuple(r for v in op.operands
                                              for r in self._buffers.descriptors(v))
                if step.counter in (CP_ASYNC, MBARRIER) and AUTO_WAIT_ATTR in attrs:
                    step.refills = step.roots or ()  # a tile copy's cp.async group / TMA load
                self._steps[op] = step
                if "kiln.token" in attrs:
                    self._tokens[ir.IntegerAttr(attrs["kiln.token"]).value] = step
            if "kiln.waits_for" in attrs:
                step.tokens = tuple(ir.IntegerAttr(t).value
                                    for t in ir.ArrayAttr(attrs["kiln.waits_for"]))
            if regions:
                step.blocks = [self._build(b) for r in op.regions for b in r.blocks]
            steps.append(step)
        return steps

    @staticmethod
    def _declared_step(op: ir.Operation, name: str, found: Effects) -> Step:
        kind = "for" if name == "scf.for" else "if" if name == "scf.if" else "op"
        return Step(op, kind, limits=found.waits(op) if found.waits else {},
                    barrier=found.barrier, commit=found.commits == WGMMA,
                    signal=found.mbarrier(op) if found.mbarrier else None,
                    descriptors=found.indirect_shared,
                    accumulates=found.accumulates,
                    arrive=found.arrives(op) if found.arrives else None,
                    releases=found.releases(op) if found.releases else {},
                    data=found.data)

    def _resolve_reads(self, steps: list[Step]) -> None:
        # events in IR order: a read's waits for events of equal age go in that order, not in
        # the order a set of Steps (hashed by address) happens to give
        self._order = {s: i for i, s in enumerate(self._steps.values())}
        lds_events = [s for s in self._steps.values() if s.roots is not None]
        writers: dict = {}  # buffer root -> the LDS events that may write it
        self._resolve_block(steps, lds_events, writers)

    def _resolve_block(self, steps: list[Step], lds_events: list, writers: dict) -> None:
        def written(root) -> set:
            found = writers.get(root)
            if found is None:
                found = writers[root] = {e for e in lds_events if aliases_any(root, e.roots)}
            return found

        reaching, buffers = self._value_events, self._buffers
        kept = []
        for item in steps:
            plain = isinstance(item, ir.Operation)
            step = _PLAIN if plain else item
            op = item if plain else step.op
            name = op.name
            needed = set()
            if name == "scf.for":
                operands = list(op.operands)[:3]  # bounds; the iter_args inits are forwarded
            elif name in DATA_MOVES or name == "scf.yield":
                operands = ()
            else:
                operands = op.operands
            # whether an operand's buffer (direct, or behind a descriptor) is read: asked once
            indirect = bool(lds_events) and step.descriptors
            direct = (bool(lds_events) and step.roots is None and step.data
                      and name not in NO_ACCESS and not _registers_only(name))
            for operand in operands:
                found = reaching(operand)
                if found and step.accumulates:  # a chained accumulator is no read
                    found = {e for e in found if e.counter != step.counter}
                needed |= found
                if not (indirect or direct):
                    continue
                root = buffers.shared(operand)
                if indirect and root is NOT_SHARED:
                    for behind in buffers.descriptors(operand):
                        needed |= written(behind)
                if direct and root is not NOT_SHARED:
                    needed |= written(root)
            for token in step.tokens:
                event = self._tokens.get(token)
                if event is not None:
                    needed.add(event)
            reads = tuple(sorted(needed, key=self._order.__getitem__)) if needed else ()
            if plain:
                if reads:
                    kept.append(Step(op, "op", reads=reads))
                continue
            step.reads = reads
            for block in step.blocks:
                self._resolve_block(block, lds_events, writers)
            if not step.inert():  # the walks pass inert steps by
                kept.append(step)
        steps[:] = kept

    # -- transfer functions ------------------------------------------------------------------
    def _walk(self, steps: list[Step], state: State) -> State:
        for step in steps:
            state = self._transfer(step, state)
        return state

    def _transfer(self, step: Step, state: State) -> State:
        if step.reads and self._record:
            state = self._check_reads(step, state)
        if step.refills and self._record:
            state = self._check_rewrites(step, state)
        if WGMMA in step.releases and self._record:
            state = self._check_release(step, state)
        if step.kind == "for":
            return self._loop(step, state)
        if step.kind == "if":
            arms = [self._walk(b, dict(state)) for b in step.blocks]
            if len(arms) == 1:
                arms.append(state)  # no else arm: the condition may skip the then arm
            return _join(arms[0], arms[1])
        for counter, count in step.limits.items():
            state = _retire(state, counter, count)
        if step.commit:
            state = {k: (Pending(p.younger + 1, p.barrier, p.at_barrier) if k.counter == WGMMA
                         else p) for k, p in state.items()}
            state[GROUPS] = Pending(min(state.get(GROUPS, Pending(0)).younger + 1, MAX_GROUPS))
        if step.signal is not None and step.counter is None:
            state = _retire_mbarrier(state, step.signal)
        if step.barrier:
            state = {k: Pending(p.younger, step, p.younger) for k, p in state.items()}
        if step.counter is not None:
            state = self._issue(step, state)
        for block in step.blocks:  # unknown region ops: walk once from the current state
            state = _join(state, self._walk(block, dict(state)))
        return state

    def _loop(self, step: Step, state: State) -> State:
        body = step.blocks[0]
        record, self._record = self._record, False
        header = dict(state)
        for _ in range(64):  # the state lattice is finite; this bound is never reached in practice
            nxt = _join(state, self._walk(body, dict(header)))
            if nxt == header:
                break
            header = nxt
        self._record = record
        return _join(state, self._walk(body, dict(header)))

    def _issue(self, step: Step, state: State) -> State:
        counter = step.counter
        if counter in (WGMMA, MBARRIER):  # counted at commit / never counted: each waits alone
            out = {k: p for k, p in state.items() if k is not step}
            out[step] = Pending(UNCOMMITTED if counter == WGMMA else 0)
            return out
        out = {k: (Pending(p.younger + 1, p.barrier, p.at_barrier) if k.counter == counter else p)
               for k, p in state.items() if k is not step}
        out[step] = Pending(0)
        return out

    # -- reads -------------------------------------------------------------------------------
    def _check_release(self, step: Step, state: State) -> State:
        """A release arrive needs every WGMMA group but the newest N retired (N declared), and
        every group that reads a buffer it hands back (kiln.release: the newest may not)."""
        count = step.releases[WGMMA]
        back = self._handed_back(step)
        readers = [e for e, p in state.items() if e.counter == WGMMA and p.younger < count
                   and any(aliases_any(r, e.shared_reads) for r in back)]
        if readers:  # retire the youngest reader: wait_group(its younger count)
            event = min(readers, key=lambda e: state[e].younger)
            count = max(state[event].younger, 0)
            if not self._close(Gap(step.op, event.op, WGMMA, count, release_point(step.op),
                                   release=True)):
                return state
            return _retire(state, WGMMA, count)
        groups = state.get(GROUPS, Pending(0)).younger
        if groups <= count and groups < MAX_GROUPS:  # a saturated count may be any larger one
            return state
        mmas = [e for e in state if e.counter == WGMMA]
        event = max(mmas, key=lambda e: state[e].younger).op if mmas else step.op
        if not self._close(Gap(step.op, event, WGMMA, count, release_point(step.op),
                               release=True)):
            return state
        return _retire(state, WGMMA, count)

    def _handed_back(self, step: Step) -> tuple:
        """The shared buffers a release arrive hands back: what the TMA loads on the full ring
        paired with its empty ring (one ``kiln.ring_pair`` id on both creates) write; () when
        the ring is unpaired (hand-written rings: only the declared count is checked)."""
        pair = _ring_pair(step.arrive)
        if pair is None:
            return ()
        return tuple(r for s in self._steps.values()
                     if s.counter == MBARRIER and s.signal is not None
                     and _ring_pair(s.signal[0]) == pair for r in s.roots or ())

    def _check_rewrites(self, step: Step, state: State) -> State:
        """A cp.async group or shared store refilling a buffer that a WGMMA in flight reads
        (a pipeline stage overwritten too early): the WGMMA must be retired before the last
        barrier since its issue, so that every warpgroup's is, or before the write when there
        is none."""
        # exact buffers only: a descriptor whose root is unknown is left to the kernel's own
        # waits (the hand-written kernels' hand-overs), not taken to read every buffer
        hits = [e for e in state if e.counter == WGMMA
                and any(r in step.refills for r in e.shared_reads if is_exact_root(r))]
        for event in sorted(hits, key=lambda e: state[e].younger):
            pend = state.get(event)
            if pend is None:  # a wait placed for an earlier WGMMA retired it
                continue
            before_barrier = pend.barrier is not None
            count = pend.at_barrier if before_barrier else pend.younger
            first_copy = (step.op.operands[0].owner if step.counter == CP_ASYNC
                          and len(step.op.operands) else step.op)
            if not self._close(Gap(step.op, event.op, WGMMA, count,
                                   pend.barrier.op if before_barrier else first_copy,
                                   rewrite=True)):
                continue
            state = _retire(state, WGMMA, count, pend.barrier if before_barrier else None)
        return state

    def _check_reads(self, step: Step, state: State) -> State:
        needed = [e for e in step.reads if e in state]
        for event in sorted(needed, key=lambda e: state[e].younger):
            pend = state.get(event)
            if pend is None:  # a wait placed for an earlier event of this read retired it
                continue
            before_barrier = (event.roots is not None and pend.barrier is not None
                              and event.counter != MBARRIER)
            count = pend.at_barrier if before_barrier else pend.younger
            if event.counter in GFX9_MAX:  # counter(max) waits for nothing; LLVM clamps alike
                count = min(count, GFX9_MAX[event.counter] - 1)
            if not self._close(Gap(step.op, event.op, event.counter, count,
                                   pend.barrier.op if before_barrier else step.op)):
                continue
            if event.counter == MBARRIER:  # a ring wait: the read's use, whichever slot
                state = _retire_mbarrier(state, (event.signal[0], None))
            else:
                state = _retire(state, event.counter, count,
                                pend.barrier if before_barrier else None)
        return state
