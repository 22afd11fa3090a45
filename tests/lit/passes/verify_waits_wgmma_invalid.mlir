// RUN: not %kiln-opt %s --pass-pipeline='builtin.module(kiln-verify-waits)' 2>&1 | FileCheck %s

// A committed wgmma group read with no wait_group: rejected at the read (the store; the
// extractvalue only names a register), naming the wait.
// CHECK: kiln-opt: error: {{.*}}:15{{.*}}memref.store may read before the async nvvm.wgmma.mma_async at {{.*}}:12 lands (wgmma)
// CHECK: Fix: add kiln.wgmma.wait_group(0) before the read
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    gpu.func @missing_wait_group(%a: i64, %b: i64, %acc: !llvm.struct<(f32, f32, f32, f32)>, %out: memref<1xf32, 1>) kernel attributes {kiln.target = "sm_90a", kiln.manual_waits} {
      %c0 = arith.constant 0 : index
      nvvm.wgmma.fence.aligned
      %d0 = nvvm.wgmma.mma_async %a, %b, %acc, <m = 64, n = 8, k = 16>, D[<f32>, <one>], A[<bf16>, <one>, <row>], B[<bf16>, <one>, <row>] : !llvm.struct<(f32, f32, f32, f32)> -> !llvm.struct<(f32, f32, f32, f32)>
      nvvm.wgmma.commit.group.sync.aligned
      %x = llvm.extractvalue %d0[0] : !llvm.struct<(f32, f32, f32, f32)>
      memref.store %x, %out[%c0] : memref<1xf32, 1>
      gpu.return
    }
  }
}
