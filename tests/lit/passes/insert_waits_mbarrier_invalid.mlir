// RUN: not %kiln-opt %s --pass-pipeline='builtin.module(kiln-insert-waits)' 2>&1 | FileCheck %s

// A TMA load in a loop read with no wait: the phase of its mbarrier changes every iteration,
// so kiln-insert-waits cannot pick one and names the barrier to wait on instead.
// CHECK: kiln-opt: error: {{.*}}:18{{.*}}memref.load may read before the nvgpu.tma.async.load at {{.*}}:17 lands, and the phase of its mbarrier is not known statically
// CHECK: Fix: wait on mbarrier 0 of its group before the read
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    memref.global "private" @tile : memref<64x64xbf16, 3>
    gpu.func @loop_phase(%map: !nvgpu.tensormap.descriptor<tensor = memref<64x64xbf16, 3>, swizzle = none, l2promo = none, oob = zero, interleave = none>, %n: index, %out: memref<1xbf16, 1>) kernel attributes {kiln.target = "sm_90a"} {
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %bars = nvgpu.mbarrier.create -> <memorySpace = #gpu.address_space<workgroup>, num_barriers = 1>
      %t = memref.get_global @tile : memref<64x64xbf16, 3>
      scf.for %j = %c0 to %n step %c1 {
        %jj = arith.addi %j, %c1 : index
        nvgpu.tma.async.load %map[%jj, %jj], %bars[%c0] to %t : <tensor = memref<64x64xbf16, 3>, swizzle = none, l2promo = none, oob = zero, interleave = none>, <memorySpace = #gpu.address_space<workgroup>, num_barriers = 1> -> memref<64x64xbf16, 3>
        %x = memref.load %t[%j, %j] : memref<64x64xbf16, 3>
        memref.store %x, %out[%c0] : memref<1xbf16, 1>
      }
      gpu.return
    }
  }
}
