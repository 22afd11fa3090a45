# RUN: %python %s | FileCheck %s
# The one WGMMA op, kiln.wgmma.mma_async, in each form the instruction has: A from a shared-memory
# descriptor (nvvm.wgmma.mma_async, majors as NVVM layouts: K-major A "row", K-major B "col") or
# from registers (inline PTX, B's major as imm-trans-b), and the same forms in sm_90a PTX.
import os

os.environ["KILN_PTXAS"] = "none"  # stop at PTX: the checks must not depend on ptxas

import numpy as np  # noqa: E402

import kiln  # noqa: E402
from kiln import wgmma  # noqa: E402
from kiln.shared import dynamic_shared  # noqa: E402


@kiln.kernel
def one_issue(out: kiln.Tensor[kiln.f32], A_LOC: kiln.constexpr, A_MAJOR: kiln.constexpr,
              B_MAJOR: kiln.constexpr):
    tile = dynamic_shared((64, 64), kiln.bf16, align=1024)
    desc = wgmma.smem_descriptor(tile, leading_bytes=16, stride_bytes=1024)
    acc = wgmma.fragment_zeros(64)
    a = desc if A_LOC == "shared" else wgmma.a_fragment_from_accumulator(acc, kiln.bf16)[0]
    wgmma.fence()
    acc = wgmma.mma_async(acc, a, desc, dtype=kiln.bf16, a_major=A_MAJOR, b_major=B_MAJOR)
    wgmma.commit()
    wgmma.wait_group(0)
    out[kiln.thread_id(0)] = acc.element(3)


for form in [("shared", "k", "k"), ("shared", "k", "mn"), ("shared", "mn", "k"),
             ("shared", "mn", "mn"), ("registers", "k", "k"), ("registers", "k", "mn")]:
    compiled = one_issue.compile(np.zeros(128, np.float32), *form, target="sm_90a")
    kiln_ir = [line for line in compiled.asm["kiln"].splitlines() if "mma_async" in line]
    ptx = [line for line in compiled.asm["ptx"].splitlines() if "wgmma.mma_async" in line]
    print(f"// FORM {' '.join(form)}")
    print("\n".join(kiln_ir + ptx))

# CHECK-LABEL: // FORM shared k k
# CHECK: nvvm.wgmma.mma_async {{.*}}<m = 64, n = 64, k = 16>, D[<f32>, <one>], A[<bf16>, <one>, <row>], B[<bf16>, <one>, <col>]
# CHECK-NOT: llvm.inline_asm
# CHECK: wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {{.*}}, 1, 1, 0, 0;
# CHECK-LABEL: // FORM shared k mn
# CHECK: A[<bf16>, <one>, <row>], B[<bf16>, <one>, <row>]
# CHECK: wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {{.*}}, 1, 1, 0, 1;
# CHECK-LABEL: // FORM shared mn k
# CHECK: A[<bf16>, <one>, <col>], B[<bf16>, <one>, <col>]
# CHECK: wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {{.*}}, 1, 1, 1, 0;
# CHECK-LABEL: // FORM shared mn mn
# CHECK: A[<bf16>, <one>, <col>], B[<bf16>, <one>, <row>]
# CHECK: wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {{.*}}, 1, 1, 1, 1;
# CHECK-LABEL: // FORM registers k k
# CHECK-NOT: nvvm.wgmma.mma_async
# CHECK: llvm.inline_asm has_side_effects {{.*}}wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {$0, {{.*}}, $31}, {$64, $65, $66, $67}, $68, p, 1, 1, 0;
# CHECK: wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%r{{[0-9]+}}, {{.*}}}, {%r{{[0-9]+}}, %r{{[0-9]+}}, %r{{[0-9]+}}, %r{{[0-9]+}}}, %rd{{[0-9]+}}, p, 1, 1, 0;
# CHECK-LABEL: // FORM registers k mn
# CHECK: llvm.inline_asm has_side_effects {{.*}}, $68, p, 1, 1, 1;
# CHECK: wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {{.*}}, p, 1, 1, 1;
