// RUN: %kiln-opt %s --pass-pipeline='builtin.module(kiln-insert-waits,kiln-verify-waits)' -split-input-file | FileCheck %s

// Two wgmma commit groups: reading the older accumulator leaves the younger group in flight
// (wait_group 1); reading the younger then needs wait_group 0. Chaining an accumulator into
// the next mma_async is not a read, nor is llvm.extractvalue (it only names a register): each
// wait goes before the store that reads the value.
// CHECK-LABEL: gpu.func @wgmma_groups
// CHECK: nvvm.wgmma.mma_async
// CHECK-NEXT: nvvm.wgmma.mma_async
// CHECK-NEXT: nvvm.wgmma.commit.group.sync.aligned
// CHECK-NEXT: nvvm.wgmma.mma_async
// CHECK-NEXT: nvvm.wgmma.commit.group.sync.aligned
// CHECK-NEXT: llvm.extractvalue
// CHECK-NEXT: llvm.extractvalue
// CHECK: nvvm.wgmma.wait.group.sync.aligned 1
// CHECK-NEXT: memref.store
// CHECK-NEXT: nvvm.wgmma.wait.group.sync.aligned 0
// CHECK-NEXT: memref.store
// CHECK-NOT: nvvm.wgmma.wait.group
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    gpu.func @wgmma_groups(%a: i64, %b: i64, %acc: !llvm.struct<(f32, f32, f32, f32)>, %out: memref<2xf32, 1>) kernel attributes {kiln.target = "sm_90a"} {
      %d0 = nvvm.wgmma.mma_async %a, %b, %acc, <m = 64, n = 8, k = 16>, D[<f32>, <one>], A[<bf16>, <one>, <row>], B[<bf16>, <one>, <row>] : !llvm.struct<(f32, f32, f32, f32)> -> !llvm.struct<(f32, f32, f32, f32)>
      %d1 = nvvm.wgmma.mma_async %a, %b, %d0, <m = 64, n = 8, k = 16>, D[<f32>, <one>], A[<bf16>, <one>, <row>], B[<bf16>, <one>, <row>] : !llvm.struct<(f32, f32, f32, f32)> -> !llvm.struct<(f32, f32, f32, f32)>
      nvvm.wgmma.commit.group.sync.aligned
      %e0 = nvvm.wgmma.mma_async %a, %b, %acc, <m = 64, n = 8, k = 16>, D[<f32>, <one>], A[<bf16>, <one>, <row>], B[<bf16>, <one>, <row>] : !llvm.struct<(f32, f32, f32, f32)> -> !llvm.struct<(f32, f32, f32, f32)>
      nvvm.wgmma.commit.group.sync.aligned
      %x = llvm.extractvalue %d1[0] : !llvm.struct<(f32, f32, f32, f32)>
      %y = llvm.extractvalue %e0[0] : !llvm.struct<(f32, f32, f32, f32)>
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      memref.store %x, %out[%c0] : memref<2xf32, 1>
      memref.store %y, %out[%c1] : memref<2xf32, 1>
      gpu.return
    }
  }
}

// -----

// The user's wait_group 0 is kept and counted: nothing is added.
// CHECK-LABEL: gpu.func @wgmma_user_wait
// CHECK: nvvm.wgmma.commit.group.sync.aligned
// CHECK-NEXT: nvvm.wgmma.wait.group.sync.aligned 0
// CHECK-NEXT: llvm.extractvalue
// CHECK-NOT: nvvm.wgmma.wait.group
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    gpu.func @wgmma_user_wait(%a: i64, %b: i64, %acc: !llvm.struct<(f32, f32, f32, f32)>, %out: memref<1xf32, 1>) kernel attributes {kiln.target = "sm_90a"} {
      %d0 = nvvm.wgmma.mma_async %a, %b, %acc, <m = 64, n = 8, k = 16>, D[<f32>, <one>], A[<bf16>, <one>, <row>], B[<bf16>, <one>, <row>] : !llvm.struct<(f32, f32, f32, f32)> -> !llvm.struct<(f32, f32, f32, f32)>
      nvvm.wgmma.commit.group.sync.aligned
      nvvm.wgmma.wait.group.sync.aligned 0
      %x = llvm.extractvalue %d0[0] : !llvm.struct<(f32, f32, f32, f32)>
      %c0 = arith.constant 0 : index
      memref.store %x, %out[%c0] : memref<1xf32, 1>
      gpu.return
    }
  }
}

// -----

// A TMA load into @tile on mbarrier 1, read with no wait: the pass inserts the try_wait on that
// barrier with the phase the program fixes (parity 1: one earlier wait on it completed phase 0).
// The load into @other on barrier 0 is not waited for by the read of @tile.
// CHECK-LABEL: gpu.func @tma_read
// CHECK: nvgpu.mbarrier.try_wait.parity %[[BAR:.*]][%c1{{.*}}], %false
// CHECK: nvgpu.tma.async.load
// CHECK-NEXT: nvgpu.tma.async.load
// CHECK-NEXT: %[[PHASE:.*]] = arith.constant true
// CHECK: %[[ONE:.*]] = arith.constant 1 : index
// CHECK-NEXT: nvgpu.mbarrier.try_wait.parity %[[BAR]][%[[ONE]]], %[[PHASE]]
// CHECK-NEXT: memref.load
// CHECK-NOT: nvgpu.mbarrier.try_wait
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    memref.global "private" @tile : memref<64x64xbf16, 3>
    memref.global "private" @other : memref<64x64xbf16, 3>
    gpu.func @tma_read(%map: !nvgpu.tensormap.descriptor<tensor = memref<64x64xbf16, 3>, swizzle = none, l2promo = none, oob = zero, interleave = none>, %i: index, %out: memref<1xbf16, 1>) kernel attributes {kiln.target = "sm_90a"} {
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %ticks = arith.constant 1000 : index
      %false = arith.constant false
      %bars = nvgpu.mbarrier.create -> <memorySpace = #gpu.address_space<workgroup>, num_barriers = 2>
      nvgpu.mbarrier.try_wait.parity %bars[%c1], %false, %ticks : <memorySpace = #gpu.address_space<workgroup>, num_barriers = 2>
      %t = memref.get_global @tile : memref<64x64xbf16, 3>
      %o = memref.get_global @other : memref<64x64xbf16, 3>
      nvgpu.tma.async.load %map[%c0, %c0], %bars[%c1] to %t : <tensor = memref<64x64xbf16, 3>, swizzle = none, l2promo = none, oob = zero, interleave = none>, <memorySpace = #gpu.address_space<workgroup>, num_barriers = 2> -> memref<64x64xbf16, 3>
      nvgpu.tma.async.load %map[%c0, %c0], %bars[%c0] to %o : <tensor = memref<64x64xbf16, 3>, swizzle = none, l2promo = none, oob = zero, interleave = none>, <memorySpace = #gpu.address_space<workgroup>, num_barriers = 2> -> memref<64x64xbf16, 3>
      %x = memref.load %t[%i, %i] : memref<64x64xbf16, 3>
      memref.store %x, %out[%c0] : memref<1xbf16, 1>
      gpu.return
    }
  }
}

// -----

// The kernel's own try_wait on the load's barrier covers the read: nothing is added.
// CHECK-LABEL: gpu.func @tma_waited
// CHECK: nvgpu.tma.async.load
// CHECK-NEXT: nvgpu.mbarrier.try_wait.parity
// CHECK-NEXT: memref.load
// CHECK-NOT: nvgpu.mbarrier.try_wait
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    memref.global "private" @tile : memref<64x64xbf16, 3>
    gpu.func @tma_waited(%map: !nvgpu.tensormap.descriptor<tensor = memref<64x64xbf16, 3>, swizzle = none, l2promo = none, oob = zero, interleave = none>, %i: index, %out: memref<1xbf16, 1>) kernel attributes {kiln.target = "sm_90a"} {
      %c0 = arith.constant 0 : index
      %ticks = arith.constant 1000 : index
      %false = arith.constant false
      %bars = nvgpu.mbarrier.create -> <memorySpace = #gpu.address_space<workgroup>, num_barriers = 1>
      %t = memref.get_global @tile : memref<64x64xbf16, 3>
      nvgpu.tma.async.load %map[%c0, %c0], %bars[%c0] to %t : <tensor = memref<64x64xbf16, 3>, swizzle = none, l2promo = none, oob = zero, interleave = none>, <memorySpace = #gpu.address_space<workgroup>, num_barriers = 1> -> memref<64x64xbf16, 3>
      nvgpu.mbarrier.try_wait.parity %bars[%c0], %false, %ticks : <memorySpace = #gpu.address_space<workgroup>, num_barriers = 1>
      %x = memref.load %t[%i, %i] : memref<64x64xbf16, 3>
      memref.store %x, %out[%c0] : memref<1xbf16, 1>
      gpu.return
    }
  }
}
