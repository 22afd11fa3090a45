// RUN: %kiln-opt %s --pass-pipeline='builtin.module(kiln-verify-waits)' -split-input-file | FileCheck %s

// Producer and readers on one path: the first load runs only when it == 0 (no reader before
// it in this loop), the refill waits on the empty barrier the readers arrive on: accepted.
// CHECK-LABEL: gpu.func @same_path_ring
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    memref.global "private" @tile : memref<64x64xbf16, 3>
    gpu.func @same_path_ring(%map: !nvgpu.tensormap.descriptor<tensor = memref<64x64xbf16, 3>, swizzle = none, l2promo = none, oob = zero, interleave = none>, %n: index, %leader: i1, %parity: i1, %ticks: index, %out: memref<1xbf16, 1>) kernel attributes {kiln.target = "sm_90a"} {
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %full = nvgpu.mbarrier.create -> <memorySpace = #gpu.address_space<workgroup>, num_barriers = 1>
      %empty = nvgpu.mbarrier.create -> <memorySpace = #gpu.address_space<workgroup>, num_barriers = 1>
      %t = memref.get_global @tile : memref<64x64xbf16, 3>
      scf.for %it = %c0 to %n step %c1 {
        %first = arith.cmpi eq, %it, %c0 : index
        %go = arith.andi %first, %leader : i1
        scf.if %go {
          nvgpu.tma.async.load %map[%c0, %c0], %full[%c0] to %t : <tensor = memref<64x64xbf16, 3>, swizzle = none, l2promo = none, oob = zero, interleave = none>, <memorySpace = #gpu.address_space<workgroup>, num_barriers = 1> -> memref<64x64xbf16, 3>
        }
        %later = arith.cmpi ugt, %it, %c0 : index
        %refill = arith.andi %later, %leader : i1
        scf.if %refill {
          nvgpu.mbarrier.try_wait.parity %empty[%c0], %parity, %ticks : <memorySpace = #gpu.address_space<workgroup>, num_barriers = 1>
          nvgpu.tma.async.load %map[%it, %c0], %full[%c0] to %t : <tensor = memref<64x64xbf16, 3>, swizzle = none, l2promo = none, oob = zero, interleave = none>, <memorySpace = #gpu.address_space<workgroup>, num_barriers = 1> -> memref<64x64xbf16, 3>
        }
        nvgpu.mbarrier.try_wait.parity %full[%c0], %parity, %ticks : <memorySpace = #gpu.address_space<workgroup>, num_barriers = 1>
        %x = memref.load %t[%c0, %c0] : memref<64x64xbf16, 3>
        memref.store %x, %out[%c0] : memref<1xbf16, 1>
        %tok = nvgpu.mbarrier.arrive %empty[%c0] : <memorySpace = #gpu.address_space<workgroup>, num_barriers = 1> -> !nvgpu.mbarrier.token
      }
      gpu.return
    }
  }
}

// -----

// A TMA loop synchronised with gpu.barrier: every thread is past its read of the tile before
// the next iteration's load is issued: accepted.
// CHECK-LABEL: gpu.func @barrier_loop
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    memref.global "private" @tile : memref<64x64xbf16, 3>
    gpu.func @barrier_loop(%map: !nvgpu.tensormap.descriptor<tensor = memref<64x64xbf16, 3>, swizzle = none, l2promo = none, oob = zero, interleave = none>, %n: index, %leader: i1, %parity: i1, %ticks: index, %out: memref<1xbf16, 1>) kernel attributes {kiln.target = "sm_90a"} {
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %full = nvgpu.mbarrier.create -> <memorySpace = #gpu.address_space<workgroup>, num_barriers = 1>
      %t = memref.get_global @tile : memref<64x64xbf16, 3>
      scf.for %it = %c0 to %n step %c1 {
        scf.if %leader {
          nvgpu.tma.async.load %map[%it, %c0], %full[%c0] to %t : <tensor = memref<64x64xbf16, 3>, swizzle = none, l2promo = none, oob = zero, interleave = none>, <memorySpace = #gpu.address_space<workgroup>, num_barriers = 1> -> memref<64x64xbf16, 3>
        }
        nvgpu.mbarrier.try_wait.parity %full[%c0], %parity, %ticks : <memorySpace = #gpu.address_space<workgroup>, num_barriers = 1>
        %x = memref.load %t[%c0, %c0] : memref<64x64xbf16, 3>
        memref.store %x, %out[%c0] : memref<1xbf16, 1>
        gpu.barrier
      }
      gpu.return
    }
  }
}
