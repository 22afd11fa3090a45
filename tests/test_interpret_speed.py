"""The interpreter is fast enough to develop in: the tutorials' 512^3 tile GEMM runs in about a
second. The bound that cannot flake is the number of op closures the plan runs (a count, not a
time: 476k before the plan hoisted launch-invariant ops and fused MMA register traffic); the
CPU-time bound is generous, for a loaded 2-core machine."""

from __future__ import annotations

import time

import ml_dtypes
import numpy as np
import pytest

from kiln.interpreter import plan as interpreter_plan
from source_modules import EXAMPLES, load_module

matmul = load_module(EXAMPLES / "tutorials" / "matmul.py", "kiln_tutorial_matmul_speed")


@pytest.fixture
def dispatches(monkeypatch):
    """Counts the closures every planned block runs (the interpreter's per-op Python calls)."""
    count = [0]
    run = interpreter_plan.Block.run

    def counted(block, env, ctx):
        count[0] += len(block.runs)
        run(block, env, ctx)

    monkeypatch.setattr(interpreter_plan.Block, "run", counted)
    return count


@pytest.mark.slow  # a 512^3 GEMM per target, 2-3 s each (CI runs the slow tier)
@pytest.mark.parametrize("target, most", [("sm_90a", 100_000), ("gfx950", 90_000)])
def test_tile_gemm_512_interprets_in_few_dispatches(dispatches, target, most):
    rng = np.random.default_rng()
    a = rng.standard_normal((512, 512)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((512, 512)).astype(ml_dtypes.bfloat16)
    bias = rng.standard_normal(512).astype(np.float32)
    c = np.full((512, 512), np.nan, ml_dtypes.bfloat16)
    matmul.matmul(a[:8, :8].copy(), b[:8, :8].copy(), bias[:8].copy(), c[:8, :8].copy(),
                  backend="interpret", target=target)  # trace and plan: not what is measured
    dispatches[0] = 0
    start = time.process_time()
    matmul.matmul(a, b, bias, c, backend="interpret", target=target)
    cpu = time.process_time() - start
    want = matmul.reference(a, b, bias)
    np.testing.assert_allclose(c.astype(np.float64), want, rtol=1e-2,
                               atol=1e-2 * np.abs(want).max())
    assert dispatches[0] <= most, f"{dispatches[0]} op dispatches for a 512^3 tile GEMM"
    assert cpu < 10.0, f"the 512^3 tile GEMM took {cpu:.1f} s of CPU in the interpreter"
