"""The torch bridge's report for ``bench/launch_overhead.py``: built before anything is timed,
and per library row whether the plans' fresh outputs and guards went through it.
Example: ``bridge, report = load_bridge(); print(bridge_state())``."""

from __future__ import annotations

import functools
import sys
import time


def load_bridge() -> tuple:
    """``(bridge or None, report)``: the torch bridge built or found in the cache now, before
    anything is timed, and how long that took or why there is none (its warnings)."""
    import warnings

    from kiln.runtime.native_torch import torch_bridge, why_not_loaded

    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bridge = torch_bridge()
    report = {"loaded": bridge is not None, "seconds": round(time.perf_counter() - start, 3)}
    if bridge is None:
        report["why"] = why_not_loaded()
    if caught:
        report["warnings"] = [str(w.message)[:300] for w in caught]
    print(f"  torch bridge: {report}", file=sys.stderr, flush=True)
    return bridge, report


def bridge_state() -> str:
    """What the library's last plans use: ``on`` when the torch bridge is loaded and every
    fresh output comes from its C++ makers and every tensor guard is its C++ check, ``off``
    when none does, else ``partial``; the counts of :func:`bridge_counts` follow."""
    counts = bridge_counts()
    makers, guards = counts["makers"], counts["guards"]
    native = makers["c++"] + guards["c++"]
    state = "on" if counts["loaded"] and native and not makers["python"] + guards["python"] \
        else "off" if not native else "partial"
    return f"{state} (loaded {counts['loaded']}, makers {makers}, guards {guards})"


def bridge_counts() -> dict:
    """Whether the torch bridge is loaded, and the fresh-output makers and tensor guards of
    the library's last plans (one per plan cache) by kind: ``c++`` (the bridge's),
    ``python`` (torch's Python paths) and ``joint`` (the bridge's makers of a call's outputs
    from one allocation, beside their one-a-tensor makers)."""
    from kiln.kernels import runtime
    from kiln.runtime import native_torch

    makers = {"c++": 0, "python": 0, "joint": 0}
    guards = {"c++": 0, "python": 0}
    kinds = {"EmptyMaker": "c++", "JointMaker": "joint"}
    for cache in runtime._CACHES:
        guard, plan = cache.last
        if plan is None:
            continue
        checker = guard.args[1] if isinstance(guard, functools.partial) and \
            len(guard.args) == 2 else None
        guards["c++" if type(checker).__name__ == "TensorGuard" else "python"] += 1
        for maker in _makers_of(plan):
            makers[kinds.get(type(maker).__name__, "python")] += 1
    loaded = bool(native_torch._LOADED) and native_torch._LOADED[0] is not None
    return {"loaded": loaded, "makers": makers, "guards": guards}


def _makers_of(obj, depth: int = 0):
    """The fresh-output makers a plan holds (TorchOutputs' and tuples of makers), searched in
    its attributes a few levels down."""
    from kiln.kernels.workspaces import TorchOutputs

    if isinstance(obj, TorchOutputs):
        yield from obj.makers
        if obj.fast is not obj.makers:
            yield from obj.fast  # the joint maker of them all
        return
    if depth > 3:
        return
    if type(obj) is tuple:
        for item in obj:
            if type(item).__name__ == "EmptyMaker" or (
                    isinstance(item, functools.partial) and
                    getattr(item.func, "__name__", "") == "empty_like"):
                yield item
            elif type(item) is tuple or hasattr(item, "__dict__"):
                yield from _makers_of(item, depth + 1)
        return
    if hasattr(obj, "__dict__") and not type(obj).__module__.startswith(("torch", "kiln.runtime")):
        for value in vars(obj).values():
            if type(value) is tuple or isinstance(value, TorchOutputs) or \
                    (hasattr(value, "__dict__") and not callable(value)):
                yield from _makers_of(value, depth + 1)
