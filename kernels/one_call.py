"""One C call a library call: the steady state of every entry point (``prefill``, ``decode``,
``decode_attention``, ``combine``, ``matmul``) as one call into the native launch shim.

A bound plan's repeat call used to run its guard, read the stream, take its per-stream
buffers, make its outputs and launch from Python, a few C calls with Python glue between
them. :func:`one_call` makes, once per plan and entry point, the shim's ``call_plan``
(``native_call.c``): a C callable of the entry point's values that checks them against the
plan (its torch tensors by the torch bridge's C++ tensor guard, other values by type and
``==``), reads the current stream, takes the plan's buffers for it, makes the fresh outputs
(the bridge's joint maker: one allocation), writes each kernel's addresses and launches every
kernel of the call (``decode_attention`` unfused: decode's, then combine's), and returns the
outputs; or returns None, having done nothing, for values that are not the plan's. An entry
point calls its :class:`OneCallSlot`'s ``call`` first and takes its Python path when that
gives None (or when there is none: no shim, ``KILN_CC=none``, a launch without the shim,
inside a custom op, whose outputs may not share an allocation); the Python path then
installs its plan's one-call object in the slot (:meth:`OneCallSlot.install`).

Example::

    call = _ATTENTION.call
    if call is not None and not SEPARATE.depth:
        made = call(q, k_cache, v_cache, page_table, seq_lens, ...)   # the values, in order
        if made is not None:
            return made
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from .plan_guard import _exact
from .runtime import _tensor_check, capture_status_address, is_torch, native_module

_SLOTS: list["OneCallSlot"] = []
_ENABLED = [True]  # use_one_call's switch


def use_one_call(on: bool) -> None:
    """Let plans made from now on build one-call objects (True, the default) or not (their
    entry points' Python paths: for A/B benches and tests); the slots are emptied.
    Example: ``use_one_call(False)``."""
    _ENABLED[0] = bool(on)
    clear_slots()


def one_call_hits() -> int:
    """Calls served so far by the one-call objects in the slots (benches report it)."""
    return sum(slot.call.hits for slot in _SLOTS if slot.call is not None)


class OneCallSlot:
    """An entry point's one-call object of its last plan (see the module docs); emptied with
    the plans (:meth:`kiln.kernels.runtime.PlanCache.clear`).
    Example: ``_MATMUL = OneCallSlot()``; ``_MATMUL.install(plan.calls, "matmul", build)``."""

    __slots__ = ("call",)

    def __init__(self):
        self.call = None
        _SLOTS.append(self)

    def install(self, calls: dict, key: str, build: Callable[[], Any]) -> None:
        """Make ``calls[key]`` (a plan's one-call objects by entry point; ``build()`` makes it
        the first time, None when there can be none) the slot's call."""
        call = calls.get(key, _UNBUILT)
        if call is _UNBUILT:
            call = calls[key] = build()
        self.call = call


_UNBUILT = object()


def clear_slots() -> None:
    """Empty every entry point's slot (the plans they served were dropped)."""
    for slot in _SLOTS:
        slot.call = None


def value(index: int) -> tuple:
    """An item: the address of the call's ``index``-th value (a tensor)."""
    return (1, index)


def output(index: int) -> tuple:
    """An item: the address of the call's ``index``-th fresh output."""
    return (2, index)


def space(index: int) -> tuple:
    """An item: the ``index``-th address of the plan's per-stream buffers."""
    return (3, index)


def address(pointer: int) -> tuple:
    """An item: a fixed address (a placeholder the kernel does not read)."""
    return (0, pointer)


def one_call(values: Sequence, launches: Sequence[tuple], *, stream: Callable,
             makers: tuple | None = None, result: tuple | None = None, workspace=None,
             aligns: Sequence[tuple[int, int]] = ()):
    """The shim's one-call object of a repeat call whose values are laid out as ``values``, or
    None where there is none (no shim, a value no guard compares exactly, a launch without
    the shim's record, no C tensor check).

    ``launches``: ``(bound launch, items)`` in launch order, an item per address the bound
    launch takes (:func:`value`, :func:`output`, :func:`space`, :func:`address`);
    ``stream``: the current stream's getter; ``makers``: the fresh outputs' makers (as
    ``launch_outputs`` takes them); ``result``: None to return the fresh outputs, else the
    indices of the values to return (``out=``); ``workspace``: the plan's
    :class:`~kiln.kernels.workspaces.StreamWorkspaces` (whose capture check becomes the
    driver's, :func:`~kiln.kernels.runtime.capture_status_address`, where it is torch's own
    and the runtime has one); ``aligns``: ``(value index, bytes)``
    of tensors whose address must be a multiple of ``bytes`` (else the Python path runs).

    Example (``matmul``'s: ``c`` fresh, ``a`` and ``b`` the call's first two values)::

        call = one_call((a, b, None, None, False, None, None, None),
                        [(plan.bound, [value(0), value(1), output(0)])],
                        stream=plan.bound.current_stream, makers=plan.fresh_c.makers)
        c = call(a2, b2, None, None, False, None, None, None)   # None: not this plan's
    """
    shim = native_module()
    if not _ENABLED[0] or shim is None or not hasattr(shim, "call_plan"):
        return None
    entries, tensors = [], []
    for v in values:
        if v is None:
            entries.append(None)
        elif is_torch(v):
            entries.append((shim.CALL_TENSOR, type(v)))
            tensors.append(v)
        elif _exact(v):
            entries.append((shim.CALL_VALUE, type(v), v))
        else:
            return None
    checker = _tensor_check(tuple(tensors)) if tensors else None
    specs = []
    for bound, items in launches:
        native = getattr(bound, "native", None)
        if native is None:
            return None
        specs.append((*native, tuple(items), bound))  # the bound launch keeps its module
    if tensors and checker is None:
        return None
    count = 1 + max((i for _, items in launches for kind, i in items if kind == 3), default=-1)
    spaces = None
    if workspace is not None:  # the driver's capture check where the runtime has it
        capturing = capture_status_address() if workspace.native_check else None
        spaces = (workspace.get, workspace.capturing if capturing is None else capturing,
                  workspace.keep, count)
    return shim.call_plan(tuple(entries), checker, tuple(aligns), makers, result, stream,
                          spaces, tuple(specs))
