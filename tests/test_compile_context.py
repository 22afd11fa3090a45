"""A kernel's trace and compile run in a context that loads only the dialects Kiln builds ops of
(``kiln.builder.TRACE_DIALECTS``), not every registered one (~18 ms a compile), and each
distinct constant is one op at the top of the kernel (a large kernel asked for ~1500 of ~100
values); kernels compile through every stage and compute the same."""

from __future__ import annotations

import numpy as np
import pytest
from mlir import ir

import kiln
from kiln import builder

pytestmark = pytest.mark.lower


def test_the_trace_context_loads_kilns_dialects_only():
    ctx = builder.trace_context()
    assert all(ctx.is_registered_operation(op) for op in
               ("arith.addi", "scf.for", "nvvm.barrier0", "rocdl.barrier", "gpu.func",
                "llvm.insertvalue", "vector.extract", "memref.load", "math.exp"))
    assert not ctx.is_registered_operation("tosa.add")
    assert ir.Context().is_registered_operation("tosa.add")  # what it saves loading


@kiln.kernel(num_threads=128)
def scaled_exp(x: kiln.Tensor[kiln.f32], y: kiln.Tensor[kiln.f32], n: kiln.i32):
    i = kiln.block_id(0) * 128 + kiln.thread_id(0)
    if i < n:
        y[i] = kiln.exp(x[i]) * 0.5


@pytest.mark.parametrize("target, stages", [("sm_90a", ("kiln", "gpu", "nvvm", "llvm", "ptx")),
                                            ("gfx950", ("kiln", "gpu", "rocdl", "llvm"))])
def test_a_kernel_lowers_through_every_stage_in_it(monkeypatch, target, stages):
    monkeypatch.setenv("KILN_NO_CACHE", "1")
    scaled_exp._compiled.clear()
    x = np.random.default_rng().standard_normal(300).astype(np.float32)
    ck = scaled_exp.compile(x, x, 300, target=target)
    assert all(ck.asm.get(stage) for stage in stages), sorted(ck.asm)
    assert "math.exp" in ck.asm["kiln"] and "llvm.func" in ck.asm[stages[2]]


@kiln.kernel(num_threads=64)
def clamp_steps(x: kiln.Tensor[kiln.f32], y: kiln.Tensor[kiln.f32], n: kiln.i32,
                STEPS: kiln.constexpr):
    i = kiln.block_id(0) * 64 + kiln.thread_id(0)
    if i < n:
        v = x[i]
        for s in kiln.range(0, n % 3 + 1):  # constants asked for inside a loop and an if
            if v > 0.5:
                v = v * 0.5 + 0.25
            else:
                v = kiln.maximum(v, -0.5) + 0.25
        for s in range(STEPS):  # and again in each unrolled step
            v = v * 0.5 + 0.25
        y[i] = v


def _clamp_reference(x: np.ndarray, n: int, steps: int) -> np.ndarray:
    v = x.astype(np.float64)
    for _ in range(n % 3 + 1):
        v = np.where(v > 0.5, v * 0.5 + 0.25, np.maximum(v, -0.5) + 0.25)
    for _ in range(steps):
        v = v * 0.5 + 0.25
    return v


def test_each_constant_is_built_once_at_the_top_of_the_kernel():
    x = np.zeros(100, np.float32)
    text = clamp_steps.trace(x, x, 100, STEPS=4, target="sm_90a").module_asm
    constants = [line.split("=", 1)[1].split("loc(")[0].strip() for line in text.splitlines()
                 if "arith.constant" in line]
    assert constants and len(constants) == len(set(constants)), constants
    for value in ("5.000000e-01 : f32", "2.500000e-01 : f32"):  # once, however many uses
        assert sum(c.startswith("arith.constant " + value) for c in constants) == 1, value


@pytest.mark.parametrize("n, steps", [(97, 3), (130, 0)])
def test_shared_constants_dominate_every_use(n, steps):
    rng = np.random.default_rng()
    x = rng.standard_normal(n).astype(np.float32)
    y = np.full(n, np.nan, np.float32)
    clamp_steps.interpret[(n + 63) // 64](x, y, n, STEPS=steps, target="sm_90a")
    np.testing.assert_allclose(y, _clamp_reference(x, n, steps), rtol=1e-6, atol=1e-6)
