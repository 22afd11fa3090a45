# RUN: %python %s | FileCheck %s
# FP8 WGMMA with A from registers: the accumulator -> e4m3 A conversion (cvt.rn.satfinite pairs
# packed into b32 words, columns in FP8_A_K_ORDER), the k32 inline PTX without a transpose
# immediate in Kiln IR, and the register-A e4m3 wgmma in sm_90a PTX.
import os

os.environ["KILN_PTXAS"] = "none"  # stop at PTX: the checks must not depend on ptxas

import numpy as np  # noqa: E402

import kiln  # noqa: E402
from kiln import wgmma  # noqa: E402
from kiln.shared import dynamic_shared  # noqa: E402


@kiln.kernel
def p_times_vt(out: kiln.Tensor[kiln.f32]):
    vt_s = dynamic_shared((64, 128), kiln.f8e4m3, align=1024)
    s = wgmma.fragment_from_elements([kiln.cast(kiln.thread_id(0), kiln.f32)] * 32)
    p = wgmma.a_fragment_from_accumulator(s, kiln.f8e4m3, k_permuted=True)
    desc = wgmma.smem_descriptor(vt_s, leading_bytes=16, stride_bytes=1024)
    o = wgmma.fragment_zeros(64)
    wgmma.fence()
    o = wgmma.mma_async(o, p.fragment(0, 1), desc + 2, dtype=kiln.f8e4m3)
    wgmma.commit()
    wgmma.wait_group(0)
    out[kiln.thread_id(0)] = o.element(7)


compiled = p_times_vt.compile(np.zeros(128, np.float32), target="sm_90a")
for stage in ("kiln", "ptx"):
    print(f"// STAGE {stage}")
    print(compiled.asm[stage])

# CHECK-LABEL: // STAGE kiln
# Two f32 per cvt (the second operand in the low byte), two cvts per b32 word of four e4m3.
# CHECK: llvm.inline_asm {kiln.op = "nvidia.cvt.f32x2_to_f8x2", kiln.op_args = {dtype = "f8e4m3"}} "cvt.rn.satfinite.e4m3x2.f32 $0, $1, $2;", "=h,f,f"
# CHECK: vector.bitcast %{{.*}} : vector<4xi32> to vector<16xf8E4M3FN>
# CHECK: nvvm.wgmma.fence.aligned
# CHECK: vector.bitcast %{{.*}} : vector<16xf8E4M3FN> to vector<4xi32>
# 32 outputs, 32 inputs tied to them, 4 A registers, the B descriptor, scale-d; no trans-b.
# CHECK: llvm.inline_asm has_side_effects {kiln.op = "nvidia.wgmma.mma_async.rs", kiln.op_args = {dtype = "e4m3", n = 64 : i64, trans_b = 0 : i64}} {{.*}}wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {$0, {{.*}}, $31}, {$64, $65, $66, $67}, $68, p, 1, 1;{{.*}}"{{(=f,)+}}0,1,{{.*}},31,r,r,r,r,l,r"
# CHECK: nvvm.wgmma.commit.group.sync.aligned

# CHECK-LABEL: // STAGE ptx
# CHECK: .target sm_90a
# CHECK: cvt.rn.satfinite.e4m3x2.f32 %rs{{[0-9]+}}, %{{[rf][0-9]+}}, %{{[rf][0-9]+}};
# CHECK: wgmma.fence.sync.aligned;
# CHECK: setp.ne.b32 p, %r{{[0-9]+}}, 0;
# CHECK-NEXT: wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%r{{[0-9]+}}, {{.*}}}, {%r{{[0-9]+}}, %r{{[0-9]+}}, %r{{[0-9]+}}, %r{{[0-9]+}}}, %rd{{[0-9]+}}, p, 1, 1;
# CHECK: wgmma.commit_group.sync.aligned;
# CHECK: wgmma.wait_group.sync.aligned{{[[:space:]]+}}0;
