"""``kiln.pipeline(lo, hi, step, stages=N, fetch=fn)``: a software-pipelined ``kiln.range``.

The loop runs the body once per ``step`` from ``lo`` while ``fetch(k, stage)`` — the user's
copies of step ``k``'s tiles into stage ``stage``'s shared tiles — runs ``D`` steps ahead, so
``D`` steps of copies are in flight while the body computes. The loop is an ``scf.for`` over
groups of ``N`` steps, unrolled by ``N`` so every stage index is a Python int (each stage's
tiles are their own allocations, which the wait analysis tells apart):

====================  ==========================================================================
before the loop       ``fetch(lo + j * step, j)`` for ``j < D``
step ``i``            ``kiln.barrier()``; ``body(it)``; ``fetch(k_i + D * step, (i + D) % N)``
after the loop        on sm_90a, when the body issued WGMMA groups, ``wgmma.wait_group(0)``
====================  ==========================================================================

The waits inside are ``kiln-insert-waits``': before step ``i``'s barrier, the
``cp.async.wait_group`` that retires stage ``i % N``'s copies and (WGMMA) the
``wgmma.wait_group`` that retires the group which read the stage the step's fetch refills.
``D = N - 1`` for synchronous MMAs (``mma.sync``, MFMA): after step ``i``'s barrier every warp
is done reading stage ``(i - 1) % N``, which the fetch overwrites. With WGMMA ``D = N - 2``
(``N = 2``: 1): the fetch refills the stage of step ``i - 2``, whose group every warpgroup
retired before step ``i``'s barrier (``wait_group 1``: step ``i - 1``'s group stays in flight
while step ``i``'s is issued). The body sees ``it.k`` (the step's first index, traced) and
``it.stage`` (an int). ``mma_in_flight=0`` keeps no WGMMA group in flight across a step
(``wait_group 0`` before each barrier) and fetches ``N - 1`` ahead, as for a synchronous MMA:
one more stage of copies in flight for a step's tensor work. ``barrier_before_fetch=True``
(WGMMA, one group in flight) adds a second barrier per step, between the body and the fetch:
the wait analysis retires the previous step's group before it (``wait_group 1``, after this
step's group is issued), so the fetch refills that stage and runs ``N - 1`` ahead with a group
still in flight (Triton's Hopper schedule).

``handoff=True`` drops the block barrier a step where a WGMMA group stays in flight and every
copy of the fetch goes by TMA (sm_90a, ``align=16``, masks at the tensors' extents; elsewhere
the barriers stay, so a portable kernel may pass it on every target): after a step's
WGMMA group is issued, every thread arrives on the empty mbarriers of the previous step's tiles
(``kiln-insert-waits`` retires that step's group before, ``wgmma.wait_group 1``), and each TMA
refill first waits for those arrivals (the empty wait, placed by ``kiln-insert-waits``: each
tile's full and empty mbarriers carry one ``kiln.ring_pair`` id). Warps are held only by the
data they read and the releases of a stage two steps back, not by each other every step.

Steps past ``hi`` (up to ``N - 1`` of them, when ``(hi - lo) / step``
is not a multiple of ``N``) and their fetches run too: masks on the fetched GlobalTiles
(``col_end=k``) make them read fill values, zeros that add nothing to a product. On sm_90a
the loop runs at least one group of steps even when ``hi <= lo``, and its last WGMMA group is
retired right after it: a loop exit that may merge in-flight accumulators with the zero-trip
path has ptxas serialise every WGMMA.

Example (the matmul tutorial's main loop)::

    def fetch(k0, s):
        kiln.copy(kiln.GlobalTile(a, (BM, BK), (row0, k0), row_end=m, col_end=k, align=16), a_s[s])
        kiln.copy(kiln.GlobalTile(b, (BK, BN), (k0, col0), row_end=k, col_end=n, align=16), b_s[s])

    for it in kiln.pipeline(0, k, BK, stages=3, fetch=fetch):
        acc = kiln.gemm(a_s[it.stage], b_s[it.stage], acc)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from mlir import ir
from mlir.dialects import arith

from . import builder, ops, tile_tma
from .core.errors import KilnTypeError, KilnValueError
from .tile_gemm_wgmma import GROUPS_ATTR
from .trace_runtime import TracedRange, for_stmt
from .values import Value
from . import wgmma

MAX_STAGES = 8
# ops of a copy that did not go by TMA (handoff=True refuses them: no mbarrier to hand back)
SYNC_COPIES = ("nvgpu.device_async_copy", "vector.store", "vector.maskedstore", "memref.store")


@dataclass(frozen=True)
class Step:
    """One step of a :func:`pipeline` loop: ``k`` (traced) and ``stage`` (a Python int)."""

    k: Any
    stage: int


class Pipeline(TracedRange):
    """The loop object :func:`pipeline` returns; drives a ``for`` statement in a kernel."""

    def __init__(self, lo: Any, hi: Any, step: int, *, stages: int, fetch: Callable,
                 mma_in_flight: int | None = None, barrier_before_fetch: bool = False,
                 handoff: bool = False):
        super().__init__(lo, hi, step)
        if not isinstance(stages, int) or isinstance(stages, bool) \
                or not 2 <= stages <= MAX_STAGES:
            raise KilnValueError(f"kiln.pipeline stages={stages!r} must be an int in "
                                 f"2..{MAX_STAGES}", fix="use 2 to 4 stages")
        if not isinstance(step, int) or isinstance(step, bool):
            raise KilnTypeError(f"kiln.pipeline step must be a Python int, got {step!r}",
                                fix="pass the tile's K extent, a kiln.constexpr")
        if not callable(fetch):
            raise KilnTypeError(f"kiln.pipeline fetch must be a function (k, stage), got "
                                f"{fetch!r}", fix="def fetch(k0, s): kiln.copy(..., a_s[s])")
        self.stages, self.fetch = stages, fetch
        # WGMMA: one group stays in flight across a step, so the fetch goes one stage less ahead
        in_flight = min(1, stages - 2) if builder.current_target().has_wgmma else 0
        if mma_in_flight is not None:
            if mma_in_flight not in (0, 1) or isinstance(mma_in_flight, bool) \
                    or mma_in_flight > in_flight:
                raise KilnValueError(f"kiln.pipeline mma_in_flight={mma_in_flight!r} must be 0 "
                                     f"or, with WGMMA and 3+ stages, 1",
                                     fix="leave it None (1 where allowed) or pass 0")
            in_flight = mma_in_flight
        if barrier_before_fetch not in (False, True) or barrier_before_fetch and not in_flight:
            raise KilnValueError(f"kiln.pipeline barrier_before_fetch={barrier_before_fetch!r} "
                                 "is for a WGMMA group kept in flight (3+ stages)",
                                 fix="pass barrier_before_fetch=False here")
        self.barrier_before_fetch = barrier_before_fetch
        if handoff not in (False, True) or handoff and (mma_in_flight == 0 or
                                                          barrier_before_fetch):
            raise KilnValueError(f"kiln.pipeline handoff={handoff!r} hands stages back by "
                                 "mbarriers behind a WGMMA group kept in flight: not with "
                                 "mma_in_flight=0 or barrier_before_fetch",
                                 fix="pass handoff=False here, or drop mma_in_flight / "
                                     "barrier_before_fetch")
        # where no WGMMA group stays in flight (other targets, 2 stages) the barriers stay
        self.handoff = handoff and in_flight == 1
        # the second barrier lets the fetch refill the stage of the group just retired
        self.ahead = stages - 1 - (0 if barrier_before_fetch else in_flight)

    def __kiln_for__(self, body_fn: Callable, names, initial: list, objects: list) -> tuple:
        """Trace the prologue, then an ``scf.for`` whose body runs the ``stages`` steps (module
        table); returns the values of ``names`` after the loop (as ``for_stmt``)."""
        n, step = self.stages, self.step
        stage_tiles: dict = {}
        for j in range(self.ahead):
            self._fetch(self.lo + j * step, j, stage_tiles, prologue=True)

        def group(g, *args):
            values = list(args)
            k0 = self.lo + g * (n * step)
            marks = []
            for i in range(n):
                k = k0 + i * step
                if not self.handoff:
                    ops.barrier()
                out = list(body_fn(Step(k, i), *values))
                if self.handoff:  # the previous step's stage goes back here (below)
                    marks.append((i, arith.ConstantOp(ir.IntegerType.get_signless(32), 0)))
                if self.barrier_before_fetch:
                    ops.barrier()
                self._fetch(k + self.ahead * step, (i + self.ahead) % n, stage_tiles)
                values = out
            for i, mark in marks:  # every stage's tiles are known once the group is traced
                with ir.InsertionPoint(mark):
                    tile_tma.release(stage_tiles.get((i - 1) % n, []), g > 0 if i == 0 else None)
                mark.operation.erase()
            return tuple(values)

        state = builder.current()
        before = getattr(state, GROUPS_ATTR, 0)
        # at least one group of steps (masked when hi <= lo): a loop that may not run has a
        # zero-trip exit path whose moves into the accumulators make ptxas serialise WGMMA
        # a unit-step loop over groups of N steps: the mbarrier ring proofs count a TMA
        # copy's uses by induction on it (kiln.passes.mbarrier_rings)
        groups = (self.hi - self.lo + (n * step - 1)) // (n * step)
        if builder.current_target().has_wgmma and isinstance(groups, Value):
            groups = ops.maximum(groups, 1)
        results = for_stmt(TracedRange(0, groups, 1), group, names, initial, objects)
        if getattr(state, GROUPS_ATTR, 0) != before:
            # retire the last group right after the loop: with the wait further down (before
            # the epilogue's first read) ptxas serialises every WGMMA
            wgmma.wait_group(0)
        return results

    def _fetch(self, k: Any, stage: int, stage_tiles: dict, prologue: bool = False) -> None:
        """``fetch(k, stage)``; with ``handoff`` its TMA copies' tiles are recorded as the
        stage's. A copy that is not TMA (no mbarrier to hand back) turns ``handoff`` off in the
        prologue (block barriers, as on other targets) and is refused after it."""
        if not self.handoff:
            self.fetch(k, stage)
            return
        state = builder.current()
        state.tma_fetching = fetched = []
        block = ir.InsertionPoint.current.block
        first = len(block.operations)
        try:
            self.fetch(k, stage)
        finally:
            state.tma_fetching = None
        found = []

        def visit(op):
            if op.name in SYNC_COPIES:
                found.append(op)
            return ir.WalkResult.ADVANCE

        for op in list(block.operations)[first:]:
            op.operation.walk(visit)
        if found and prologue:
            self.handoff = False
        elif found:
            raise KilnValueError("kiln.pipeline(handoff=True): a fetch in the loop did not go "
                                 "by TMA where the prologue's did",
                                 fix="make every fetch copy the same kinds of tiles")
        stage_tiles.setdefault(stage, fetched)


def pipeline(*args, stages: int, fetch: Callable, mma_in_flight: int | None = None,
             barrier_before_fetch: bool = False, handoff: bool = False) -> Pipeline:
    """``for it in kiln.pipeline(lo, hi, step, stages=N, fetch=fn)``: a ``kiln.range`` whose
    copies (``fn(k, stage)``) run ahead of the body in ``N`` shared-memory stages (see the
    module docs for the schedule and the waits; ``mma_in_flight``, ``barrier_before_fetch``
    and ``handoff`` choose among the WGMMA schedules).

    Example: ``for it in kiln.pipeline(0, k, BK, stages=3, fetch=fetch): acc =
    kiln.gemm(a_s[it.stage], b_s[it.stage], acc)``.
    """
    if len(args) != 3:
        raise KilnTypeError(f"kiln.pipeline takes (lo, hi, step), got {len(args)} bounds",
                            fix="kiln.pipeline(0, k, BK, stages=3, fetch=fetch)")
    lo, hi, step = args
    return Pipeline(lo, hi, step, stages=stages, fetch=fetch, mma_in_flight=mma_in_flight,
                    barrier_before_fetch=barrier_before_fetch, handoff=handoff)


__all__ = ["pipeline", "Pipeline", "Step"]
