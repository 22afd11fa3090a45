// RUN: not %kiln-opt %s --pass-pipeline='builtin.module(kiln-verify-waits)' 2>&1 | FileCheck %s

// No loop: every thread reads the tile, then one thread reloads it with no block-wide barrier
// (or empty wait) in between, so other threads may still be reading: rejected at the reload.
// CHECK: kiln-opt: error: {{.*}}:20{{.*}}this nvgpu.tma.async.load may overwrite the buffer that the memref.load at {{.*}}:17 reads in other threads
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    memref.global "private" @tile : memref<64x64xbf16, 3>
    gpu.func @reload(%map: !nvgpu.tensormap.descriptor<tensor = memref<64x64xbf16, 3>, swizzle = none, l2promo = none, oob = zero, interleave = none>, %leader: i1, %ticks: index, %out: memref<1xbf16, 1>) kernel attributes {kiln.target = "sm_90a"} {
      %c0 = arith.constant 0 : index
      %false = arith.constant false
      %true = arith.constant true
      %full = nvgpu.mbarrier.create -> <memorySpace = #gpu.address_space<workgroup>, num_barriers = 1>
      %t = memref.get_global @tile : memref<64x64xbf16, 3>
      nvgpu.tma.async.load %map[%c0, %c0], %full[%c0] to %t : <tensor = memref<64x64xbf16, 3>, swizzle = none, l2promo = none, oob = zero, interleave = none>, <memorySpace = #gpu.address_space<workgroup>, num_barriers = 1> -> memref<64x64xbf16, 3>
      nvgpu.mbarrier.try_wait.parity %full[%c0], %false, %ticks : <memorySpace = #gpu.address_space<workgroup>, num_barriers = 1>
      %x = memref.load %t[%c0, %c0] : memref<64x64xbf16, 3>
      memref.store %x, %out[%c0] : memref<1xbf16, 1>
      scf.if %leader {
        nvgpu.tma.async.load %map[%c0, %c0], %full[%c0] to %t : <tensor = memref<64x64xbf16, 3>, swizzle = none, l2promo = none, oob = zero, interleave = none>, <memorySpace = #gpu.address_space<workgroup>, num_barriers = 1> -> memref<64x64xbf16, 3>
      }
      nvgpu.mbarrier.try_wait.parity %full[%c0], %true, %ticks : <memorySpace = #gpu.address_space<workgroup>, num_barriers = 1>
      %y = memref.load %t[%c0, %c0] : memref<64x64xbf16, 3>
      memref.store %y, %out[%c0] : memref<1xbf16, 1>
      gpu.return
    }
  }
}
