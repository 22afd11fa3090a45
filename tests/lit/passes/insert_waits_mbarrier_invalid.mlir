// RUN: not %kiln-opt %s --pass-pipeline='builtin.module(kiln-insert-waits)' 2>&1 | FileCheck %s

// A TMA load in a loop of a run-time step read with no wait: the reading thread's uses of the
// ring are counted only in loops of a constant step, so kiln-insert-waits cannot derive the
// phase and names the load instead.
// CHECK: kiln-opt: error: {{.*}}:19{{.*}}cannot derive the mbarrier wait for the nvgpu.tma.async.load at {{.*}}:18: the reading thread's uses of its ring are not counted
// CHECK: Fix: wait for it by hand before the read
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    memref.global "private" @tile : memref<64x64xbf16, 3>
    gpu.func @loop_phase(%map: !nvgpu.tensormap.descriptor<tensor = memref<64x64xbf16, 3>, swizzle = none, l2promo = none, oob = zero, interleave = none>, %n: index, %s: index, %out: memref<1xbf16, 1>) kernel attributes {kiln.target = "sm_90a"} {
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %bars = nvgpu.mbarrier.create -> <memorySpace = #gpu.address_space<workgroup>, num_barriers = 1>
      %t = memref.get_global @tile : memref<64x64xbf16, 3>
      scf.for %j = %c0 to %n step %s {
        %jj = arith.addi %j, %c1 : index
        nvgpu.tma.async.load %map[%jj, %jj], %bars[%c0] to %t : <tensor = memref<64x64xbf16, 3>, swizzle = none, l2promo = none, oob = zero, interleave = none>, <memorySpace = #gpu.address_space<workgroup>, num_barriers = 1> -> memref<64x64xbf16, 3>
        %x = memref.load %t[%j, %j] : memref<64x64xbf16, 3>
        memref.store %x, %out[%c0] : memref<1xbf16, 1>
      }
      gpu.return
    }
  }
}
