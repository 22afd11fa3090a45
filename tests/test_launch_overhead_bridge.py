"""``bench/launch_overhead.py``'s report of the torch bridge per library row: what the
library's last plans use (the bridge's C++ makers and tensor guards, or torch's Python paths),
read off the plans themselves, so a run whose rows took the Python paths says so."""

import importlib
import pathlib
import shutil

import numpy as np
import pytest

from kiln.kernels import runtime
from kiln.kernels.attention import decode, decode_attention
from kiln.runtime import native_torch

from decode_problems import torch_paged


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent.parent / "bench"))
    return importlib.import_module("launch_overhead")


def test_with_no_plan_the_report_is_off(bench):
    runtime.clear_plans()
    state = bench.bridge_state()
    assert state.startswith("off (") and "'c++': 0" in state


def test_the_report_reads_the_plans_makers_and_guards(bench):
    """decode's plan (three makers, one guard) with the bridge, then without it; and
    decode_attention's (two makers once a call made its outputs)."""
    torch = pytest.importorskip("torch")
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    bridge = native_torch.load_bridge("c++")
    assert bridge is not None  # a real torch and a compiler: the bridge must build and load
    rng = np.random.default_rng(7)
    previous = native_torch._LOADED[:]
    try:
        with runtime.use_runtime(runtime.DryRuntime()):
            native_torch.use_bridge(bridge)
            decode(*torch_paged(torch, rng), target="sm_90a")
            counts = bench.bridge_counts()  # decode: 3 partials, its combine plan 2 (twice)
            assert counts["loaded"] and counts["makers"] == {"c++": 7, "python": 0, "joint": 3}
            assert counts["guards"] == {"c++": 2, "python": 0}
            assert bench.bridge_state().startswith("on (loaded True")
            runtime.clear_plans()
            decode_attention(*torch_paged(torch, rng), target="sm_90a")  # o and lse
            assert bench.bridge_counts()["makers"] == {"c++": 2, "python": 0, "joint": 1}
            native_torch.use_bridge(None)
            runtime.clear_plans()
            decode(*torch_paged(torch, rng), target="sm_90a")
            counts = bench.bridge_counts()
            assert not counts["loaded"] and counts["makers"] == {"c++": 0, "python": 7, "joint": 0}
            assert bench.bridge_state().startswith("off (loaded False")
    finally:  # the process's bridge as it was (none loaded yet: none, and look again later)
        native_torch.use_bridge(previous[0] if previous else None)
        if not previous:
            native_torch._LOADED.clear()


def test_why_not_loaded_names_the_cause(monkeypatch):
    """The reason the bench prints beside a run without the bridge: KILN_CXX=none, an
    unusable cache, or none at all once loaded."""
    pytest.importorskip("torch")
    previous = native_torch._LOADED[:]
    try:
        native_torch._LOADED.clear()
        monkeypatch.setenv("KILN_CXX", "none")
        assert "KILN_CXX=none" in native_torch.why_not_loaded()
        monkeypatch.delenv("KILN_CXX")
        monkeypatch.setenv("KILN_NO_CACHE", "1")
        assert "no usable compile cache" in native_torch.why_not_loaded()
        monkeypatch.delenv("KILN_NO_CACHE")
        native_torch._LOADED[:] = [object()]
        assert native_torch.why_not_loaded() is None
    finally:
        native_torch._LOADED[:] = previous
