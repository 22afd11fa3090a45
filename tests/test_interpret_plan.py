"""The plan's speed-ups keep the semantics: launch-invariant ops are hoisted (computed once per
launch, read-only after), and ``mma.sync`` reads the vectors its registers were extracted from
while the extracts and the insert chain of its result are dropped, unless something else
reads them. The MLIR below is what ``kiln.gemm`` emits around one ``mma.sync`` (registers
extracted from loaded vectors, the result's fields inserted back into the C vector); the
``shared`` variant also stores one A register and a half-built result vector, which must keep
their ops."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kiln import layout as L
from kiln.core.targets import get_target
from kiln.interpreter import interpret_kernel
from kiln.interpreter import plan as interpreter_plan
from kiln.kernel import TracedKernel
from kiln.signature import KernelSignature, TensorParam

MEM = "memref<?x{}, strided<[1], offset: ?>, 1>"
I32, F32 = MEM.format("i32"), MEM.format("f32")
STRUCT = "!llvm.struct<(f32, f32, f32, f32)>"


def mma_module(shared: bool) -> str:
    def extracts(name, vector, n, kind):
        return "\n".join(f"%{name}{i} = vector.extract %{vector}[{i}] : {kind} from "
                         f"vector<{n}x{kind}>" for i in range(n))

    fields = "\n".join(f"%e{i} = llvm.extractvalue %d[{i}] : {STRUCT}" for i in range(4))
    chain = "\n".join(f"%r{i + 1} = vector.insert %e{i}, %r{i} [{i}] : f32 into vector<4xf32>"
                      for i in range(4))
    also = (f"memref.store %a2, %spill[%t] : {I32}\n"
            f"vector.store %r2, %half[%c4t] : {F32}, vector<4xf32>") if shared else ""
    return f"""
module attributes {{gpu.container_module}} {{
  gpu.module @kiln_kernels {{
    gpu.func @k(%a: {I32}, %b: {I32}, %c: {F32}, %out: {F32}, %spill: {I32}, %half: {F32}) kernel {{
      %t = gpu.thread_id x
      %c2 = arith.constant 2 : index
      %c4 = arith.constant 4 : index
      %c4t = arith.muli %t, %c4 : index
      %c2t = arith.muli %t, %c2 : index
      %av = vector.load %a[%c4t] : {I32}, vector<4xi32>
      %bv = vector.load %b[%c2t] : {I32}, vector<2xi32>
      %r0 = vector.load %c[%c4t] : {F32}, vector<4xf32>
      {extracts("a", "av", 4, "i32")}
      {extracts("b", "bv", 2, "i32")}
      {extracts("k", "r0", 4, "f32")}
      %d = nvvm.mma.sync A[%a0, %a1, %a2, %a3] B[%b0, %b1] C[%k0, %k1, %k2, %k3] {{layoutA = #nvvm.mma_layout<row>, layoutB = #nvvm.mma_layout<col>, multiplicandAPtxType = #nvvm.mma_type<bf16>, multiplicandBPtxType = #nvvm.mma_type<bf16>, shape = #nvvm.shape<m = 16, n = 8, k = 16>}} : (i32, i32, f32) -> {STRUCT}
      {fields}
      {chain}
      vector.store %r4, %out[%c4t] : {F32}, vector<4xf32>
      {also}
      gpu.return
    }}
  }}
}}
"""


def run_mma(shared: bool, warps: int, rng):
    """Each warp multiplies its own random 16x16 @ 16x8 + 16x8 through the fragment layouts;
    returns what the kernel wrote and the float64 product in the same fragment order."""
    (ar, ac), (br, bc), (cr, cc) = (f().coords() for f in (L.mma_m16n8k16_a, L.mma_m16n8k16_b,
                                                           L.mma_m16n8_accumulator))
    a = rng.standard_normal((warps, 16, 16)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((warps, 16, 8)).astype(ml_dtypes.bfloat16)
    c = rng.standard_normal((warps, 16, 8)).astype(np.float32)
    a_regs = np.ascontiguousarray(a[:, ar, ac]).view(np.int32).reshape(-1)  # [warps, 32, 4]
    b_regs = np.ascontiguousarray(b[:, br, bc]).view(np.int32).reshape(-1)  # [warps, 32, 2]
    c_regs = np.ascontiguousarray(c[:, cr, cc]).reshape(-1)
    threads = 32 * warps
    out, spill = np.full(threads * 4, np.nan, np.float32), np.full(threads, -1, np.int32)
    half = np.full(threads * 4, np.nan, np.float32)
    sig = KernelSignature("k", tuple(TensorParam(n, t, 1) for n, t in (
        ("a", "i32"), ("b", "i32"), ("c", "f32"), ("out", "f32"), ("spill", "i32"),
        ("half", "f32"))), block=(threads, 1, 1))
    traced = TracedKernel("k", mma_module(shared), sig, 0)
    interpret_kernel(traced, 1, [a_regs, b_regs, c_regs, out, spill, half], get_target("sm_80"))
    want = a.astype(np.float64) @ b.astype(np.float64) + c
    return out, spill, half, want[:, cr, cc].reshape(-1), a_regs, c_regs


@pytest.mark.parametrize("shared", [False, True])
def test_fused_mma_operands_and_result_give_the_product(shared, monkeypatch):
    runs = []
    block_run = interpreter_plan.Block.run
    monkeypatch.setattr(interpreter_plan.Block, "run",
                        lambda block, env, ctx: (runs.append(len(block.runs)),
                                                 block_run(block, env, ctx)))
    out, spill, half, want, a_regs, c_regs = run_mma(shared, warps=2,
                                                     rng=np.random.default_rng())
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-5)
    if shared:  # the stored A register and half-built vector were computed, not dropped
        np.testing.assert_array_equal(spill, a_regs.reshape(-1, 4)[:, 2])
        halves = half.reshape(-1, 4)  # D's first two fields, then C's last two
        np.testing.assert_allclose(halves[:, :2], want.reshape(-1, 4)[:, :2], rtol=1e-6,
                                   atol=1e-5)
        np.testing.assert_array_equal(halves[:, 2:], c_regs.reshape(-1, 4)[:, 2:])
    # fused: 3 loads, the mma, one insert step, the store (the thread-id arithmetic is hoisted,
    # the 10 register extracts, 4 extractvalues and 3 inner inserts dropped); shared: the
    # extract of a2 stays, the chain runs link by link (4 inserts, 4 extractvalues), 2 stores
    assert runs == [16 if shared else 6], runs


def test_hoisted_values_are_shared_read_only():
    """Two CTAs of one launch get the same (read-only) thread-id arithmetic; a closure
    writing into it would raise rather than corrupt the next CTA."""
    cache: dict = {}
    sig_asm = mma_module(False)
    sig = KernelSignature("k", tuple(TensorParam(n, t, 1) for n, t in (
        ("a", "i32"), ("b", "i32"), ("c", "f32"), ("out", "f32"), ("spill", "i32"),
        ("half", "f32"))), block=(32, 1, 1))
    from kiln.interpreter.run import _compile_plan

    plan = _compile_plan(TracedKernel("k", sig_asm, sig, 0).module_asm, "k").plan
    assert len(plan.hoisted) == 5  # thread id, two constants, two products

    class Ctx:
        thread_ids = np.arange(32)
        size = 32
        cta = type("CTA", (), {"block": (32, 1, 1)})()

    envs = [[None] * plan.num_slots for _ in range(2)]
    for env in envs:
        plan.start(env, Ctx(), cache)
    first, second = ([env[s] for s in plan.hoisted_slots] for env in envs)
    assert all(x is y and not x.flags.writeable for x, y in zip(first, second))
