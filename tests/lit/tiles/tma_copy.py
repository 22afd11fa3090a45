# RUN: %python %s | FileCheck %s
# kiln.copy through TMA on sm_90a, in kiln.pipeline (3 stages, 64 x 128 x 64, one warpgroup):
# the GlobalTiles' masks are the tensors' own extents, so each copy is TMA. The tensor maps are
# derived parameters after the declared ones (A's box 64 x 64, B's 64 x 64 per 64-column chunk,
# C's 64 x 32 f32 for the staged store); each operand tile's mbarrier is created and
# initialised by thread 0 at the entry, before one fence and barrier. A fetch is thread 0's
# arrive.expect_tx (the boxes' bytes) and its boxes; kiln-insert-waits puts each stage's
# mbarrier.try_wait before the step's first WGMMA, at the parity of the loop's group counter,
# and the wgmma.wait_group before the barrier ahead of a refill. C goes through two 128-byte-
# swizzled shared tiles and TMA stores (bulk groups, the last waited for with .read).
import os

os.environ["KILN_PTXAS"] = "none"  # stop at PTX: the checks must not depend on ptxas

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

import kiln  # noqa: E402
from kiln import bf16, f32  # noqa: E402


@kiln.kernel(num_threads=128)
def gemm(a: kiln.Tensor[bf16, 2], b: kiln.Tensor[bf16, 2], c: kiln.Tensor[f32, 2]):
    (m, k), (kb, n) = a.shape, b.shape
    a_s = [kiln.tiles.operand_tile((64, 64), bf16, "a") for _ in range(3)]
    b_s = [kiln.tiles.operand_tile((64, 128), bf16, "b") for _ in range(3)]

    def fetch(k0, s):
        kiln.copy(kiln.GlobalTile(a, (64, 64), (0, k0), row_end=m, col_end=k, align=16), a_s[s])
        kiln.copy(kiln.GlobalTile(b, (64, 128), (k0, 0), row_end=kb, col_end=n, align=16),
                  b_s[s])

    acc = kiln.accumulator(a_s[0], b_s[0])
    for it in kiln.pipeline(0, k, 64, stages=3, fetch=fetch):
        acc = kiln.gemm(a_s[it.stage], b_s[it.stage], acc)
    mc, nc = c.shape
    kiln.copy(acc, kiln.GlobalTile(c, (64, 128), (0, 0), row_end=mc, col_end=nc, align=16),
              staged=True)


x = np.zeros((64, 192), ml_dtypes.bfloat16)
ck = gemm.compile(x, x.reshape(192, 64).repeat(2, 1), np.zeros((64, 128), np.float32),
                  target="sm_90a")
print(ck.signature)
print(ck.asm["gpu"])
print(ck.asm["ptx"])

# CHECK: TensorMapParam(name='a.tma0', dtype='bf16', rank=2, box=(64, 64), swizzle=128, oob_fill_nan=False, source='a')
# CHECK-SAME: TensorMapParam(name='b.tma1', dtype='bf16', rank=2, box=(64, 64), swizzle=128, oob_fill_nan=False, source='b')
# CHECK-SAME: TensorMapParam(name='c.tma2', dtype='f32', rank=2, box=(64, 32), swizzle=128, oob_fill_nan=False, source='c')
# CHECK-LABEL: gpu.func @gemm
# CHECK-SAME: !llvm.ptr{{.*}}!llvm.ptr{{.*}}!llvm.ptr
# CHECK: nvgpu.mbarrier.create
# CHECK: nvgpu.mbarrier.init
# CHECK: nvvm.fence.mbarrier.init
# CHECK-NEXT: gpu.barrier
# CHECK: nvgpu.mbarrier.arrive.expect_tx {{.*}}, %c8192
# CHECK: nvgpu.tma.async.load {{.*}} {kiln.auto_wait} : <tensor = memref<64x64xbf16, 3>, swizzle = swizzle_128b
# CHECK: nvgpu.mbarrier.arrive.expect_tx {{.*}}, %c16384
# CHECK-COUNT-2: nvgpu.tma.async.load
# CHECK: scf.for %[[G:.*]] = %c0_i32 to {{.*}} step %c1_i32
# CHECK: nvvm.wgmma.wait.group.sync.aligned 1
# CHECK-NEXT: gpu.barrier
# CHECK: nvvm.wgmma.fence.aligned
# CHECK: arith.index_cast %[[G]]
# CHECK: nvgpu.mbarrier.try_wait.parity
# CHECK: nvgpu.mbarrier.try_wait.parity
# CHECK-COUNT-4: nvvm.wgmma.mma_async
# CHECK: nvvm.wgmma.commit.group.sync.aligned
# CHECK: nvgpu.mbarrier.arrive.expect_tx
# CHECK: scf.yield
# CHECK: nvvm.wgmma.wait.group.sync.aligned 0
# CHECK: nvvm.fence.proxy {kind = #nvvm.proxy_kind<async.shared>
# CHECK-NEXT: gpu.barrier
# CHECK: nvgpu.tma.async.store
# CHECK: nvvm.cp.async.bulk.commit.group
# CHECK: nvvm.cp.async.bulk.wait_group 0 {read}
# CHECK-LABEL: .entry gemm
# CHECK: cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes
# CHECK: mbarrier.try_wait.parity.shared.b64
# CHECK: wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16
# CHECK: cp.async.bulk.tensor.2d.global.shared::cta.bulk_group
# CHECK: cp.async.bulk.wait_group.read 	0
