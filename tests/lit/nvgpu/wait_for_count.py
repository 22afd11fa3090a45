# RUN: %python %s | FileCheck %s
# kiln.nvidia_asm.wait_for_count through the sm_90a stages: the ticket's atomic, then an
# acquire-load loop on the counter's address (the wrapped inline PTX), then the reads of what
# the other CTAs stored.

import os

os.environ["KILN_PTXAS"] = "none"  # stop at PTX: the checks must not depend on ptxas
os.environ["KILN_NO_CACHE"] = "1"

import numpy as np  # noqa: E402

import kiln  # noqa: E402


@kiln.kernel
def sum_after_wait(x: kiln.Tensor[kiln.f32, 1], stored: kiln.Tensor[kiln.f32, 1],
                   counters: kiln.Tensor[kiln.i64, 1], out: kiln.Tensor[kiln.f32, 1]):
    cta = kiln.block_id(0)
    ctas = kiln.cast(kiln.num_blocks(0), kiln.i64)
    if kiln.thread_id(0) == 0:
        stored[cta] = x[cta] * 2.0
        kiln.fence("gpu")
        ticket = counters.atomic_add(0, 1)
        kiln.nvidia_asm.wait_for_count(counters, 0, target=ticket - ticket % ctas + ctas)
        out[cta] = stored[0] + stored[1]


x = np.zeros(2, np.float32)
compiled = sum_after_wait.compile(x, x, np.zeros(1, np.int64), x, target="sm_90a", num_warps=1)
for stage in ("nvvm", "ptx"):
    print(f"// STAGE {stage}")
    print(compiled.asm[stage])

# CHECK-LABEL: // STAGE nvvm
# CHECK: llvm.atomicrmw add {{.*}} : !llvm.ptr<1>, i64
# CHECK: llvm.inline_asm has_side_effects {kiln.op = "nvidia.sync.wait_for_count"} "{\0A.reg .pred p;\0A.reg .b64 v;\0AKILN_WAIT_FOR_COUNT:\0Ald.acquire.gpu.global.b64 v, [$0];\0Asub.s64 v, v, $1;\0Asetp.lt.s64 p, v, 0;\0A@p bra KILN_WAIT_FOR_COUNT;\0A}", "l,l,~{memory}"
# CHECK: llvm.load

# CHECK-LABEL: // STAGE ptx
# CHECK: fence.acq_rel.gpu;
# CHECK: atom.global.add.u64 {{%rd[0-9]+}}, [{{%rd[0-9]+}}], 1;
# CHECK: KILN_WAIT_FOR_COUNT:
# CHECK-NEXT: ld.acquire.gpu.global.b64 v, [{{%rd[0-9]+}}];
# CHECK-NEXT: sub.s64 v, v, {{%rd[0-9]+}};
# CHECK-NEXT: setp.lt.s64 p, v, 0;
# CHECK-NEXT: @p bra KILN_WAIT_FOR_COUNT;
# CHECK: ld.global.b32
