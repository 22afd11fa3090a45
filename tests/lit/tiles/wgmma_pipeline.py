# RUN: %python %s | FileCheck %s
# kiln.gemm on sm_90a through kiln.pipeline (3 stages, 64 x 128 x 64 over one warpgroup): the
# prologue fetches one stage (cp.async groups A and B); before each of the 3 unrolled steps'
# barriers kiln-insert-waits retires the stage's copies (cp.async.wait_group 0, one stage
# ahead) and the WGMMA group that read the stage the step refills (wait_group 1: the previous
# step's stays in flight); the step issues 4 wgmma m64n128k16 from descriptors (B N-major) as
# one commit group (no proxy fence: cp.async copies), and fetches the next stage; the loop ends
# with wait_group 0, before the epilogue reads the accumulator.
import os

os.environ["KILN_PTXAS"] = "none"  # stop at PTX: the checks must not depend on ptxas

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

import kiln  # noqa: E402
from kiln import bf16, f32, i32  # noqa: E402


@kiln.kernel(num_threads=128)
def gemm(a: kiln.Tensor[bf16, 2], b: kiln.Tensor[bf16, 2], c: kiln.Tensor[f32, 2], k: i32):
    a_s = [kiln.tiles.operand_tile((64, 64), bf16, "a") for _ in range(3)]
    b_s = [kiln.tiles.operand_tile((64, 128), bf16, "b") for _ in range(3)]

    def fetch(k0, s):
        kiln.copy(kiln.GlobalTile(a, (64, 64), (0, k0), col_end=k, align=16), a_s[s])
        kiln.copy(kiln.GlobalTile(b, (64, 128), (k0, 0), row_end=k, align=16), b_s[s])

    acc = kiln.accumulator(a_s[0], b_s[0])
    for it in kiln.pipeline(0, k, 64, stages=3, fetch=fetch):
        acc = kiln.gemm(a_s[it.stage], b_s[it.stage], acc)
    kiln.copy(acc, kiln.GlobalTile(c, (64, 128), (0, 0)))


x = np.zeros((64, 192), ml_dtypes.bfloat16)
ck = gemm.compile(x, x.reshape(192, 64).repeat(2, 1), np.zeros((64, 128), np.float32), 192,
                  target="sm_90a")
print(ck.asm["gpu"])
print(ck.asm["ptx"])

# CHECK-LABEL: gpu.func @gemm
# CHECK: nvgpu.device_async_create_group
# CHECK: nvgpu.device_async_create_group
# CHECK: scf.for
# CHECK: nvgpu.device_async_wait {{.*}} {numGroups = 0 : i32}
# CHECK-NEXT: nvvm.wgmma.wait.group.sync.aligned 1
# CHECK-NEXT: gpu.barrier
# CHECK-NOT: nvvm.fence.proxy
# CHECK: nvvm.wgmma.fence.aligned
# CHECK-COUNT-4: nvvm.wgmma.mma_async {{.*}} <m = 64, n = 128, k = 16>, D[<f32>, <one>], A[<bf16>, <one>, <row>], B[<bf16>, <one>, <row>]
# CHECK: nvvm.wgmma.commit.group.sync.aligned
# CHECK: nvgpu.device_async_create_group
# CHECK: scf.yield
# CHECK-NEXT: }
# CHECK-NEXT: nvvm.wgmma.wait.group.sync.aligned 0
# CHECK: cp.async.wait_group 0;
# CHECK-NEXT: wgmma.wait_group.sync.aligned 1;
# CHECK-NEXT: bar.sync 0;
# CHECK: wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16
# CHECK: wgmma.commit_group.sync.aligned;
# CHECK: wgmma.wait_group.sync.aligned 0;
