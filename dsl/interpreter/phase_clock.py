"""Which mbarrier phase completions each thread has observed: a vector clock over mbarriers.

A TMA load's data is visible to a thread only once that thread has observed the completion of
the mbarrier phase the copy counted on: by waiting on that phase itself
(``mbarrier.try_wait``), or through a chain of synchronisations from a thread that did (a CTA
barrier, a named barrier, the cluster barrier, or an mbarrier phase it waited on that the
observer arrived on). The interpreter lands the copy when *some* thread waits, so without this
clock a thread that never waited reads the right data and the race stays hidden.

``seen[row, slot]`` is the number of completed phases of mbarrier ``slot`` that the thread of
``row`` (``rank * threads_per_cta + thread id`` within the cluster) is ordered after. An
mbarrier collects what its arriving threads knew (``heard``); when its phase completes that
knowledge, plus the phase itself, becomes what a waiter learns (``known``). Barriers join the
knowledge of the threads they release.
"""

from __future__ import annotations

import numpy as np


def _widen(v: np.ndarray | None, width: int) -> np.ndarray:
    if v is None:
        return np.zeros(width, np.int32)
    return v if v.size == width else np.pad(v, (0, width - v.size))


class PhaseClock:
    """The observed-phases matrix of one cluster (or lone CTA)."""

    def __init__(self, threads_per_cta: int, ctas: int):
        self.per_cta = threads_per_cta
        self.seen = np.zeros((threads_per_cta * ctas, 0), np.int32)

    def rows(self, ctx, lanes: np.ndarray | None = None) -> np.ndarray:
        """Clock rows of ``ctx``'s active threads (or of its threads at ``lanes``)."""
        if lanes is not None:
            ids = ctx.thread_ids[lanes]
        else:
            ids = ctx.thread_ids if ctx.mask is None else ctx.thread_ids[ctx.mask]
        return ctx.cta.rank * self.per_cta + ids

    def slot(self, bar) -> int:
        if bar.slot is None:
            bar.slot = self.seen.shape[1]
            self.seen = np.pad(self.seen, ((0, 0), (0, 1)))
        return bar.slot

    def arrive(self, bar, rows: np.ndarray) -> None:
        """Threads ``rows`` arrive on ``bar``'s current phase: its waiters will know what they
        knew."""
        if self.seen.shape[1] and rows.size:
            width = self.seen.shape[1]
            bar.heard = np.maximum(_widen(bar.heard, width), self.seen[rows].max(axis=0))

    def complete(self, bar) -> None:
        """``bar``'s phase completed (``bar.phase`` counts it)."""
        slot = self.slot(bar)
        known = _widen(bar.heard, self.seen.shape[1]).copy()
        known[slot] = bar.phase
        bar.known, bar.heard = known, None

    def observe(self, bar, rows: np.ndarray) -> None:
        """Threads ``rows`` saw ``bar``'s last completed phase (their wait returned)."""
        if bar.known is not None and rows.size:
            known = _widen(bar.known, self.seen.shape[1])
            self.seen[rows] = np.maximum(self.seen[rows], known)

    def join(self, rows: np.ndarray | None = None) -> None:
        """A barrier released threads ``rows`` (``None``: every thread of the clock)."""
        if not self.seen.shape[1]:
            return
        if rows is None:
            self.seen[:] = self.seen.max(axis=0)
        elif rows.size:
            self.seen[rows] = self.seen[rows].max(axis=0)
