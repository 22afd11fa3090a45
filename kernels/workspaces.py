"""Device memory of a library plan's calls: fresh outputs (:class:`TorchOutputs`) and the
internal buffers reused per stream (:class:`StreamWorkspaces`).

Some entry points need device memory that never leaves the call: ``decode_attention``'s
split-KV partials and ticket counters, split-K GEMM's partial sums. Allocating them per call
costs host time (a ``torch.empty`` is 1.5-3 µs), so a plan keeps one set per stream: calls on
one stream run in order, so each call may reuse the last one's buffers; calls that may run at
once are on different streams and get different sets.

A CUDA-graph capture is the exception. A graph's kernels may replay at any later time, on any
stream, beside eager calls on the stream it was captured on (or on a new stream that reuses
that handle), so a captured call never takes an eagerly kept set: each capture gets its own,
allocated inside it at its first call (from the graph's private memory pool, which keeps it
for the replays; a zero fill becomes a memset node that every replay runs first) and shared
by the calls it records, which run in order on its stream. Another graph, even one captured
on the same stream, gets another set, so graphs may replay side by side.

Example::

    spaces = StreamWorkspaces(lambda: torch.zeros(4, dtype=torch.int64, device="cuda"),
                              runtime.capture_id)
    tickets = spaces.get(stream)        # the same tensor for every eager call on `stream`
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable


class StreamWorkspaces:
    """Buffers made by ``make()`` (any object holding device tensors and their addresses),
    one kept per stream handle for eager calls (with ``keep=False``, made per call: sets too
    large to keep), and one per CUDA-graph capture for the calls it records (see the module
    docs). ``capture_id(stream)``: the id of the capture under way on ``stream``, or None;
    ``capturing()``: whether the current torch stream captures (default: torch's check), the
    cheap test every call makes first (``capturing`` and ``keep`` are public: a one-call
    object, :mod:`kiln.kernels.one_call`, makes the same choice in C).

    The caller must hold what :meth:`get` returns until its launches are queued: a set made
    for a capture is owned by nothing else once the capture is over, and memory freed inside
    a capture may back the next allocation of the same capture.
    """

    CAPTURES_KEPT = 4  # sets of the latest captures held (captures may run in several threads)

    def __init__(self, make: Callable[[], Any], capture_id: Callable[[Any], Any],
                 keep: bool = True, capturing: Callable[[], bool] | None = None):
        self._make = make
        self._kept: dict = {}
        self._captured: dict = {}  # capture id -> its set, the latest CAPTURES_KEPT
        self.keep = keep  # False: sets too large to keep are made per call
        self._capture_id = capture_id
        # Whether the current stream captures: torch's check unless a test passes its own.
        self.capturing = capturing or _capture_check()
        # torch's check of the current stream: a one C call may ask the driver instead
        self.native_check = capturing is None

    def get(self, stream: int | None) -> Any:
        """The set for a call on ``stream`` (the current torch stream's handle)."""
        kept = self._kept.get(stream)
        if kept is not None and not self.capturing():
            return kept
        if self.capturing():
            return self._for_capture(self._capture_id(stream))
        if not self.keep:
            return self._make()
        kept = self._kept[stream] = self._make()
        return kept

    def __len__(self) -> int:
        """Sets kept for eager calls (one per stream seen outside captures)."""
        return len(self._kept)

    def _for_capture(self, capture) -> Any:
        """One set per capture: its calls are ordered on the capture stream, as eager calls on
        one stream (a zero fill made once, a memset node that each replay runs first)."""
        made = self._captured.get(capture)
        if made is None:
            while len(self._captured) >= self.CAPTURES_KEPT:
                self._captured.pop(next(iter(self._captured)))
            made = self._captured[capture] = self._make()
        return made


class TorchOutputs:
    """Fresh contiguous torch tensors of fixed shapes and dtypes on ``like``'s device, for a
    plan's repeat calls. Each maker is the torch bridge's C maker where the bridge was built
    (:mod:`kiln.runtime.native_torch`: ATen's allocation from C++, no argument parsing), else
    ``torch.empty_like`` of a one-element expanded template (no shape or dtype to parse; on an
    H200 host 3.8 µs a tensor, allocation and release, against 5.1 for
    ``like.new_empty(shape, dtype=...)`` and 6.5 for ``torch.empty``).

    ``makers`` is the tuple of C callables, one a tensor, that a bound launch's
    ``launch_outputs`` calls itself (:func:`kiln.runtime.launch.launch_with_outputs`).
    ``fast`` is what an entry point hands ``launch_outputs`` outside a torch custom op
    (:func:`separate_outputs`): with the bridge and several outputs (``KILN_JOINT_OUTPUTS``
    on, the default) one maker of them all, carved from one allocation (one allocator call
    a call instead of one a tensor; the tensors then share a storage, which a custom op's
    outputs may not), else ``makers``.

    Example: ``fresh = TorchOutputs(q, ((2, 3), torch.bfloat16), ((2,), torch.float32))``;
    ``o, lse = fresh()``.
    """

    def __init__(self, like, *specs):
        import torch

        from kiln.core import env

        from .runtime import torch_bridge

        bridge = torch_bridge()
        makers, parts = [], []
        for shape, dtype in specs:
            template = like.new_empty((), dtype=dtype)
            fallback = _maker(torch, template.expand(shape))
            shape = tuple(int(n) for n in shape)
            made = None if bridge is None else bridge.empty_maker(template, shape, fallback)
            makers.append(fallback if made is None else made)
            parts.append((template, shape))
        self.makers = tuple(makers)
        joint = None
        if bridge is not None and len(specs) > 1 and env.joint_outputs():
            joint = bridge.joint_maker(tuple(parts), functools.partial(_each, self.makers))
        self.fast = self.makers if joint is None else (joint,)

    def __call__(self) -> tuple:
        return tuple(make() for make in self.makers)

    def one(self, index: int = 0):
        """A fresh tensor of the ``index``-th shape alone."""
        return self.makers[index]()


def _each(makers: tuple) -> tuple:
    """One fresh tensor from each maker (a joint maker's fallback)."""
    return tuple(make() for make in makers)


class _Separate(threading.local):
    depth = 0  # separate_outputs blocks open on this thread


SEPARATE = _Separate()


@contextlib.contextmanager
def separate_outputs():
    """Inside the block, library calls on this thread give each fresh output its own
    allocation (:attr:`TorchOutputs.makers`, not ``fast``): what a ``torch.library`` custom
    op's implementation needs, whose outputs may not share a storage.

    Example: ``with separate_outputs(): o, lse = decode_attention(...)``."""
    SEPARATE.depth += 1
    try:
        yield
    finally:
        SEPARATE.depth -= 1


def _maker(torch, template) -> Callable:
    """``torch.empty_like`` of ``template`` as a C callable: without a memory format (torch
    then parses no keyword) where that already gives a contiguous tensor of its shape, else
    asking for the contiguous format."""
    probe = torch.empty_like(template)
    if probe.is_contiguous() and probe.shape == template.shape:
        return functools.partial(torch.empty_like, template)
    return functools.partial(torch.empty_like, template, memory_format=torch.contiguous_format)


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
