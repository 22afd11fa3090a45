# RUN: %python %s | FileCheck %s
# kiln.nvidia_asm.sched_barrier, kiln.shuffle.any_lane and kiln.nvidia_asm.named_barrier_any
# through the sm_90a stages: the clock read stored to the thread's scratch word (one wrapped
# inline PTX, after the exp2 it fences), the warp vote as one vote.sync, then the warp-group
# vote as one bar.red.or (the flag as a predicate, the answer back as 0/1).

import os

os.environ["KILN_PTXAS"] = "none"  # stop at PTX: the checks must not depend on ptxas
os.environ["KILN_NO_CACHE"] = "1"

import numpy as np  # noqa: E402

import kiln  # noqa: E402


@kiln.kernel
def fenced_exp(x: kiln.Tensor[kiln.f32, 1], out: kiln.Tensor[kiln.f32, 1]):
    scratch = kiln.shared((128,), kiln.i32)
    lane = kiln.thread_id(0)
    y = kiln.exp2(x[lane])
    kiln.nvidia_asm.sched_barrier(scratch, lane)
    if kiln.shuffle.any_lane(y > 4.0):
        y = y * 0.5
    if kiln.nvidia_asm.named_barrier_any(7, 128, y > 8.0):
        y = y * 0.25
    out[lane] = y


x = np.zeros(128, np.float32)
compiled = fenced_exp.compile(x, x, target="sm_90a", num_warps=4)
for stage in ("nvvm", "ptx"):
    print(f"// STAGE {stage}")
    print(compiled.asm[stage])

# CHECK-LABEL: // STAGE nvvm
# CHECK: llvm.inline_asm has_side_effects {kiln.op = "nvidia.sync.sched_barrier"} "{\0A.reg .u32 t;\0Amov.u32 t, %clock;\0Ast.shared.u32 [$0], t;\0A}", "l"
# CHECK: nvvm.vote.sync {{ *}}any
# CHECK: llvm.inline_asm has_side_effects {kiln.op = "nvidia.sync.named_barrier_any"} "{\0A.reg .pred p, q;\0Asetp.ne.b32 q, $1, 0;\0Abar.red.or.pred p, $2, $3, q;\0Aselp.u32 $0, 1, 0, p;\0A}", "=r,r,r,r"

# CHECK-LABEL: // STAGE ptx
# CHECK: ex2.approx
# CHECK: mov.u32 t, %clock;
# CHECK-NEXT: st.shared.u32 [{{%rd[0-9]+}}], t;
# CHECK: vote.sync.any.pred {{%p[0-9]+}}, {{%p[0-9]+}}, -1;
# CHECK: setp.ne.b32 q, {{%r[0-9]+}}, 0;
# CHECK-NEXT: bar.red.or.pred p, {{%r[0-9]+}}, {{%r[0-9]+}}, q;
# CHECK-NEXT: selp.u32 {{%r[0-9]+}}, 1, 0, p;
