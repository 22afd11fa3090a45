"""A kernel's trace and compile run in a context that loads only the dialects Kiln builds ops of
(``kiln.builder.TRACE_DIALECTS``), not every registered one (~18 ms a compile); the kernels
compile the same through every stage."""

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
