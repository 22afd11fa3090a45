// RUN: %kiln-opt %s --pass-pipeline='builtin.module(kiln-insert-waits,kiln-verify-waits)' | FileCheck %s

// A release arrive declaring wgmma_pending = 1 gets the wait_group(1) it lacks, before the
// scf.if around it (wgmma.wait_group is warp-group aligned; the arrive runs on one thread).
// The wait_group(1) already before the second loop's arrive is enough: none is added there.
// CHECK-LABEL: gpu.func @release_wait
// CHECK: nvvm.wgmma.commit.group.sync.aligned
// CHECK-NEXT: nvvm.wgmma.wait.group.sync.aligned 1
// CHECK-NEXT: scf.if
// CHECK-NEXT: nvgpu.mbarrier.arrive
// CHECK: nvvm.wgmma.commit.group.sync.aligned
// CHECK-NEXT: nvvm.wgmma.wait.group.sync.aligned 1
// CHECK-NEXT: scf.if
// CHECK-NOT: nvvm.wgmma.wait.group.sync.aligned 1
// CHECK: nvvm.wgmma.wait.group.sync.aligned 0
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    gpu.func @release_wait(%a: i64, %b: i64, %acc: !llvm.struct<(f32, f32, f32, f32)>, %leader: i1, %out: memref<1xf32, 1>) kernel attributes {kiln.target = "sm_90a"} {
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
      %e = scf.for %k = %c0 to %c4 step %c1 iter_args(%e_in = %d) -> (!llvm.struct<(f32, f32, f32, f32)>) {
        nvvm.wgmma.fence.aligned
        %e_out = nvvm.wgmma.mma_async %a, %b, %e_in, <m = 64, n = 8, k = 16>, D[<f32>, <one>], A[<bf16>, <one>, <row>], B[<bf16>, <one>, <row>] : !llvm.struct<(f32, f32, f32, f32)> -> !llvm.struct<(f32, f32, f32, f32)>
        nvvm.wgmma.commit.group.sync.aligned
        nvvm.wgmma.wait.group.sync.aligned 1
        scf.if %leader {
          %t = nvgpu.mbarrier.arrive %empty[%c0] {kiln.wgmma_pending = 1 : i64} : <memorySpace = #gpu.address_space<workgroup>, num_barriers = 1> -> !nvgpu.mbarrier.token
        }
        scf.yield %e_out : !llvm.struct<(f32, f32, f32, f32)>
      }
      %x = llvm.extractvalue %e[0] : !llvm.struct<(f32, f32, f32, f32)>
      memref.store %x, %out[%c0] : memref<1xf32, 1>
      gpu.return
    }
  }
}
