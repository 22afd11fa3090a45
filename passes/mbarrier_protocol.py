"""Warp-specialised TMA pipelines: reads of a buffer that *another thread* TMA-loads.

:class:`~kiln.passes.wait_analysis.WaitAnalysis` follows one thread's path, so a load issued by
a producer warp group (one arm of an ``scf.if``) never reaches the state of the consumer (the
other arm) that reads its buffer, and deleting the consumer's ``mbarrier.try_wait`` went
unnoticed. This module checks the handshake instead, over the same op tree:

- a consumer *acquires* mbarrier group G by waiting on it (``effects.mbarrier``, no counter);
- it *releases* the buffers of the loads signalling G by arriving on G's "empty" group E
  (``effects.arrives``), which ends the acquisition; E is the group the producer waits on just
  before issuing those loads (the nearest wait before the load in its block);
- a read (``Step.reads``) of a buffer TMA-loaded in another arm of an ``scf.if`` must find the
  load's G acquired on every path (a must-analysis: paths join by intersection; loops run to a
  fixed point).

A read that does not is a :class:`~kiln.passes.wait_analysis.Gap` on the load (counter
``mbarrier``). The producer's side of the hand-over is checked by shape: a TMA load in a loop
whose buffer another warp group reads must follow, in its block and with no load on another mbarrier
group in between, a wait on an "empty" barrier (one that threads arrive on and no TMA load
completes): it refills the buffer only once the readers gave it back. Else it is a Gap with
``overwrite``. Barrier indices are not
told apart (stages of one group are one group); the ``wgmma.wait_group`` before an arrive (the
MMA must be done reading before the release) is checked by the wait analysis where the arrive
declares ``wgmma_pending`` (:meth:`kiln.mbarrier.MBarrierGroup.arrive`).
"""

from __future__ import annotations

from kiln.core.ops import MBARRIER


def _arms(steps, path, out):
    """Record every step's arm path: ``((if step, arm index), ...)`` from the function down."""
    for step in steps:
        out[step] = path
        for i, block in enumerate(step.blocks):
            _arms(block, path + ((step, i),) if step.kind == "if" else path, out)


def _pairs(steps, out):
    """``out[G]``: the groups producers wait on right before issuing loads that signal G."""
    last_wait = None
    for step in steps:
        if step.signal is not None and step.counter is None:
            last_wait = step.signal[0]
        if step.counter == MBARRIER and last_wait is not None:
            out.setdefault(step.signal[0], set()).add(last_wait)
        for block in step.blocks:
            _pairs(block, out)


def _cross(a: tuple, b: tuple) -> bool:
    """Whether two arm paths part in different arms of one ``scf.if``."""
    arms = dict(a)
    return any(step in arms and arms[step] != arm for step, arm in b)


class _Walk:
    def __init__(self, body, make_gap):
        self.make_gap = make_gap
        self.arms = {}
        _arms(body, (), self.arms)
        self.released = {}  # E -> groups G whose buffers an arrive on E hands back
        pairs = {}
        _pairs(body, pairs)
        for group, empties in pairs.items():
            for empty in empties:
                self.released.setdefault(empty, set()).add(group)
        self.record = False
        self.gaps = []
        self.seen = set()

    def walk(self, steps, state: frozenset) -> frozenset:
        for step in steps:
            state = self.step(step, state)
        return state

    def step(self, step, state: frozenset) -> frozenset:
        if self.record:
            self.check(step, state)
        if step.kind == "for":
            record, self.record = self.record, False
            header = state
            for _ in range(64):  # a finite lattice: the bound is never reached
                nxt = state & self.walk(step.blocks[0], header)
                if nxt == header:
                    break
                header = nxt
            self.record = record
            return state & self.walk(step.blocks[0], header)
        if step.kind == "if":
            arms = [self.walk(b, state) for b in step.blocks]
            return frozenset.intersection(*arms, *([state] if len(arms) == 1 else []))
        if step.signal is not None and step.counter is None:
            state = state | {step.signal[0]}
        if step.arrive is not None:
            state = state - self.released.get(step.arrive, set())
        for block in step.blocks:
            state = state & self.walk(block, state)
        return state

    def check(self, step, state: frozenset) -> None:
        for event in step.reads:
            if event.counter != MBARRIER or event.signal[0] in state:
                continue
            key = (step.op, event.signal[0])
            if key in self.seen or not _cross(self.arms[event], self.arms[step]):
                continue
            self.seen.add(key)
            self.gaps.append(self.make_gap(step.op, event.op, MBARRIER, 0, step.op))


def _producer_gaps(body, arms: dict, make_gap) -> list:
    """The overwrite gaps of the producers' loads (module docstring)."""
    readers, arrived, signalled = {}, set(), set()

    def index(steps):
        for step in steps:
            for event in step.reads:
                if event.counter == MBARRIER and _cross(arms[event], arms[step]):
                    readers.setdefault(event, step)
            if step.arrive is not None:
                arrived.add(step.arrive)
            if step.counter == MBARRIER:
                signalled.add(step.signal[0])
            for block in step.blocks:
                index(block)

    index(body)
    empty = arrived - signalled  # barriers readers hand buffers back on (no TMA completes them)
    gaps = []

    def visit(steps, in_loop: bool, last_wait, loaded: set):
        for step in steps:
            if step.signal is not None and step.counter is None:
                last_wait, loaded = step.signal[0], set()
            elif step.counter == MBARRIER:
                reader = readers.get(step)
                if in_loop and reader is not None and not (
                        last_wait in empty and loaded <= {step.signal[0]}):
                    gaps.append(make_gap(step.op, reader.op, MBARRIER, 0, step.op, overwrite=True))
                loaded = loaded | {step.signal[0]}
            for block in step.blocks:  # a loop body starts afresh each iteration
                fresh = step.kind == "for"
                visit(block, in_loop or fresh, None if fresh else last_wait,
                      set() if fresh else loaded)

    visit(body, False, None, set())
    return gaps


def cross_thread_gaps(body, make_gap) -> list:
    """The reads in ``body`` (a WaitAnalysis op tree) of buffers TMA-loaded by another thread
    with no acquisition of the load's mbarrier on every path (module docstring), each made by
    ``make_gap`` (the analysis's Gap class, passed in so this module need not import it)."""
    def has_load(steps) -> bool:
        return any(s.counter == MBARRIER or any(has_load(b) for b in s.blocks) for s in steps)

    if not has_load(body):
        return []
    walk = _Walk(body, make_gap)
    walk.record = True
    walk.walk(body, frozenset())
    return walk.gaps + _producer_gaps(body, walk.arms, make_gap)
