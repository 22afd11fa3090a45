# RUN: %python %s | FileCheck %s
# kiln.fence and TensorRef.atomic_*: the "last CTA finishes" pattern through every stage, on
# both vendors (sm_90a PTX; gfx950 assembly).
import os

os.environ["KILN_PTXAS"] = "none"  # stop at PTX: the checks must not depend on ptxas

import numpy as np  # noqa: E402

import kiln  # noqa: E402


@kiln.kernel
def last_cta_sum(x: kiln.Tensor[kiln.f32, 1], partial: kiln.Tensor[kiln.f32, 1],
                 tickets: kiln.Tensor[kiln.i32, 1], out: kiln.Tensor[kiln.f32, 1], n: kiln.i32):
    cta = kiln.block_id(0)
    last = kiln.shared((1,), kiln.i32)
    if kiln.thread_id(0) == 0:
        partial[cta] = x[cta] * 2.0
        kiln.fence("gpu")
        ticket = tickets.atomic_add(0, 1)
        last[0] = kiln.where(ticket == n - 1, 1, 0)
    kiln.barrier()
    if (last[0] == 1) & (kiln.thread_id(0) == 0):
        kiln.fence("gpu")
        out[0] = partial[0] + partial[1]
        tickets[0] = 0
    out.atomic_max(1, x[cta])


args = (np.ones(2, np.float32), np.zeros(2, np.float32), np.zeros(1, np.int32),
        np.zeros(2, np.float32), 2)
for chip, stages in (("sm_90a", ("kiln", "ptx")), ("gfx950", ("amdgcn",))):
    compiled = last_cta_sum.compile(*args, target=chip, num_warps=1)
    for stage in stages:
        print(f"// STAGE {chip} {stage}")
        print(compiled.asm[stage])

# CHECK-LABEL: // STAGE sm_90a kiln
# CHECK: llvm.fence syncscope("device") acq_rel
# CHECK: memref.atomic_rmw addi
# CHECK: llvm.fence syncscope("device") acq_rel
# CHECK: memref.atomic_rmw maximumf

# CHECK-LABEL: // STAGE sm_90a ptx
# The partial's store, the release fence, then the ticket; the last CTA's fence before it reads.
# CHECK: st.global.b32
# CHECK-NEXT: fence.acq_rel.gpu;
# CHECK: atom.global.add.u32
# CHECK: fence.acq_rel.gpu;
# CHECK: ld.global.b32
# No native f32 max atomic: a compare-and-swap loop.
# CHECK: atom.{{.*}}global.cas.b32

# CHECK-LABEL: // STAGE gfx950 amdgcn
# An agent-scope release is a write-back of L2 (buffer_wbl2) before the atomic.
# CHECK: buffer_wbl2
# CHECK: global_atomic_add
# CHECK: global_atomic_cmpswap
# CHECK: s_endpgm
