# RUN: %python %s | FileCheck %s
# WGMMA with A from registers: the accumulator -> A conversion (one bulk cast), the inline PTX
# with tied accumulators in Kiln IR, and the register-A wgmma in sm_90a PTX.
import os

os.environ["KILN_PTXAS"] = "none"  # stop at PTX: the checks must not depend on ptxas

import numpy as np  # noqa: E402

import kiln  # noqa: E402
from kiln import wgmma  # noqa: E402
from kiln.shared import dynamic_shared  # noqa: E402


@kiln.kernel
def p_times_v(out: kiln.Tensor[kiln.f32]):
    v_s = dynamic_shared((64, 64), kiln.bf16, align=1024)
    s = wgmma.fragment_from_elements([kiln.cast(kiln.thread_id(0), kiln.f32)] * 32)
    p = wgmma.a_fragment_from_accumulator(s, kiln.bf16)
    desc = wgmma.smem_descriptor(v_s, leading_bytes=8192, stride_bytes=1024)
    o = wgmma.fragment_zeros(64)
    wgmma.fence()
    o = wgmma.mma_async_regs(o, p[1], desc, dtype=kiln.bf16, b_major="mn")
    wgmma.commit()
    wgmma.wait_group(0)
    out[kiln.thread_id(0)] = o.element(7)


compiled = p_times_v.compile(np.zeros(128, np.float32), target="sm_90a")
for stage in ("kiln", "ptx"):
    print(f"// STAGE {stage}")
    print(compiled.asm[stage])

# CHECK-LABEL: // STAGE kiln
# One truncf of all 32 accumulator registers; operand j is elements 8j..8j+7, packed to 4 x i32.
# CHECK: arith.truncf %{{.*}} : vector<32xf32> to vector<32xbf16>
# CHECK: vector.shuffle {{.*}} [8, 9, 10, 11, 12, 13, 14, 15] : vector<32xbf16>, vector<32xbf16>
# CHECK: nvvm.wgmma.fence.aligned
# CHECK: vector.bitcast %{{.*}} : vector<8xbf16> to vector<4xi32>
# 32 outputs, 32 inputs tied to them, 4 A registers, the B descriptor, scale-d.
# CHECK: llvm.inline_asm has_side_effects {kiln.op = "nvidia.wgmma.mma_async.rs", kiln.op_args = {dtype = "bf16", n = 64 : i64, trans_b = 1 : i64}} {{.*}}wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {$0, {{.*}}, $31}, {$64, $65, $66, $67}, $68, p, 1, 1, 1;{{.*}}"{{(=f,)+}}0,1,{{.*}},31,r,r,r,r,l,r" {{.*}} -> !llvm.struct<(f32, {{.*}})>
# CHECK: nvvm.wgmma.commit.group.sync.aligned

# CHECK-LABEL: // STAGE ptx
# CHECK: .target sm_90a
# CHECK: wgmma.fence.sync.aligned;
# CHECK: setp.ne.b32 p, %r{{[0-9]+}}, 0;
# CHECK-NEXT: wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%r{{[0-9]+}}, {{.*}}}, {%r{{[0-9]+}}, %r{{[0-9]+}}, %r{{[0-9]+}}, %r{{[0-9]+}}}, %rd{{[0-9]+}}, p, 1, 1, 1;
# CHECK: wgmma.commit_group.sync.aligned;
# CHECK: wgmma.wait_group.sync.aligned{{[[:space:]]+}}0;
