"""Internal device buffers of a library plan, reused per stream: :class:`StreamWorkspaces`.

Some entry points need device memory that never leaves the call: ``decode_attention``'s
split-KV partials and ticket counters, split-K GEMM's partial sums. Allocating them per call
costs host time (a ``torch.empty`` is 1.5-3 µs), so a plan keeps one set per stream: calls on
one stream run in order, so each call may reuse the last one's buffers; calls that may run at
once are on different streams and get different sets.

A CUDA-graph capture is the exception. A graph's kernels may replay at any later time, on any
stream, beside eager calls on the stream it was captured on (or on a new stream that reuses
that handle), so a captured call never takes a kept set, and never keeps the one it gets: it
allocates a fresh one inside the capture (from the graph's private memory pool, which keeps it
for the replays; a zero fill becomes a memset node that every replay runs first).

Example::

    spaces = StreamWorkspaces(lambda: torch.zeros(4, dtype=torch.int64, device="cuda"))
    tickets = spaces.get(stream)        # the same tensor for every eager call on `stream`
"""

from __future__ import annotations

from typing import Any, Callable


class StreamWorkspaces:
    """Buffers made by ``make()`` (any object holding device tensors and their addresses),
    one kept per stream handle for eager calls (with ``keep=False``, made per call: sets too
    large to keep), a fresh one per call while ``capturing()`` (default: the current torch
    stream captures a CUDA graph; see the module docs).

    The caller must hold what :meth:`get` returns until its launches are queued: a captured
    set is owned by nothing else, and memory freed inside a capture may back the next
    allocation of the same capture.
    """

    def __init__(self, make: Callable[[], Any], keep: bool = True,
                 capturing: Callable[[], bool] | None = None):
        self._make = make
        self._kept: dict = {}
        self._keep = keep  # False: sets too large to keep are made per call
        # Whether the current stream captures: torch's check unless a test passes its own.
        self._capturing = capturing or _capture_check()

    def get(self, stream: int | None) -> Any:
        """The set for a call on ``stream`` (the current torch stream's handle)."""
        kept = self._kept.get(stream)
        if kept is not None and not self._capturing():
            return kept
        if not self._keep or self._capturing():
            return self._make()
        kept = self._kept[stream] = self._make()
        return kept

    def __len__(self) -> int:
        """Sets kept for eager calls (one per stream seen outside captures)."""
        return len(self._kept)


def _capture_check() -> Callable[[], bool]:
    """Whether the current torch stream captures a CUDA graph: torch's C function (no Python
    frame: ~0.1 µs), its public wrapper where the private one is missing, or always False
    without CUDA torch (a test double's CPU tensors)."""
    import torch

    check = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
    if check is None or not torch.cuda.is_available():
        return torch.cuda.is_current_stream_capturing if torch.cuda.is_available() else \
            _never
    return check


def _never() -> bool:
    return False
