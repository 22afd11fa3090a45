// RUN: not %kiln-opt %s --pass-pipeline='builtin.module(kiln-verify-waits)' 2>&1 | FileCheck %s

// A pipelined K loop whose wait_group(1) was deleted: each iteration's release arrive declares
// that WGMMA groups but the newest one are done with the stage it hands back. The previous
// iteration's group (the same mma_async op) is still in flight: rejected at the arrive, naming
// the WGMMA and the wait.
// CHECK: kiln-opt: error: {{.*}}:21{{.*}}nvgpu.mbarrier.arrive hands back a buffer before the async nvvm.wgmma.mma_async at {{.*}}:18 that may read it is retired (wgmma)
// CHECK: Fix: add kiln.wgmma.wait_group(1) before the arrive
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    gpu.func @missing_release_wait(%a: i64, %b: i64, %acc: !llvm.struct<(f32, f32, f32, f32)>, %leader: i1) kernel attributes {kiln.target = "sm_90a", kiln.manual_waits} {
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %c4 = arith.constant 4 : index
      %empty = nvgpu.mbarrier.create -> <memorySpace = #gpu.address_space<workgroup>, num_barriers = 1>
      %d = scf.for %k = %c0 to %c4 step %c1 iter_args(%d_in = %acc) -> (!llvm.struct<(f32, f32, f32, f32)>) {
        nvvm.wgmma.fence.aligned
        %d_out = nvvm.wgmma.mma_async %a, %b, %d_in, <m = 64, n = 8, k = 16>, D[<f32>, <one>], A[<bf16>, <one>, <row>], B[<bf16>, <one>, <row>] : !llvm.struct<(f32, f32, f32, f32)> -> !llvm.struct<(f32, f32, f32, f32)>
        nvvm.wgmma.commit.group.sync.aligned
        scf.if %leader {
          %t = nvgpu.mbarrier.arrive %empty[%c0] {kiln.wgmma_pending = 1 : i64} : <memorySpace = #gpu.address_space<workgroup>, num_barriers = 1> -> !nvgpu.mbarrier.token
        }
        scf.yield %d_out : !llvm.struct<(f32, f32, f32, f32)>
      }
      nvvm.wgmma.wait.group.sync.aligned 0
      gpu.return
    }
  }
}
