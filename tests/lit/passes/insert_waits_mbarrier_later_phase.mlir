// RUN: not %kiln-opt %s --pass-pipeline='builtin.module(kiln-insert-waits)' 2>&1 | FileCheck %s

// A TMA load before a loop whose own loads complete later phases of the same mbarrier, read
// only after the loop: which use of the barrier the read needs depends on the loop's trip
// count, which the ring count does not know (a wait for a fixed parity there could wait for a
// phase that never comes), so the pass refuses, naming the load.
// CHECK: kiln-opt: error: {{.*}}:28{{.*}}cannot derive the mbarrier wait for the nvgpu.tma.async.load at {{.*}}:19: the reading thread's uses of its ring are not counted
// CHECK: Fix: wait for it by hand before the read
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    memref.global "private" @first : memref<64x64xbf16, 3>
    memref.global "private" @ring : memref<64x64xbf16, 3>
    gpu.func @later_phase(%map: !nvgpu.tensormap.descriptor<tensor = memref<64x64xbf16, 3>, swizzle = none, l2promo = none, oob = zero, interleave = none>, %n: index, %parity: i1, %ticks: index, %out: memref<1xbf16, 1>) kernel attributes {kiln.target = "sm_90a"} {
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %bars = nvgpu.mbarrier.create -> <memorySpace = #gpu.address_space<workgroup>, num_barriers = 1>
      %a = memref.get_global @first : memref<64x64xbf16, 3>
      %r = memref.get_global @ring : memref<64x64xbf16, 3>
      nvgpu.tma.async.load %map[%c0, %c0], %bars[%c0] to %a : <tensor = memref<64x64xbf16, 3>, swizzle = none, l2promo = none, oob = zero, interleave = none>, <memorySpace = #gpu.address_space<workgroup>, num_barriers = 1> -> memref<64x64xbf16, 3>
      scf.for %j = %c0 to %n step %c1 {
        %jj = arith.addi %j, %c1 : index
        // A later phase of mbarrier 0, waited on with a run-time parity.
        nvgpu.tma.async.load %map[%jj, %jj], %bars[%c0] to %r : <tensor = memref<64x64xbf16, 3>, swizzle = none, l2promo = none, oob = zero, interleave = none>, <memorySpace = #gpu.address_space<workgroup>, num_barriers = 1> -> memref<64x64xbf16, 3>
        nvgpu.mbarrier.try_wait.parity %bars[%c0], %parity, %ticks : <memorySpace = #gpu.address_space<workgroup>, num_barriers = 1>
        %x = memref.load %r[%j, %j] : memref<64x64xbf16, 3>
        memref.store %x, %out[%c0] : memref<1xbf16, 1>
      }
      %y = memref.load %a[%c0, %c0] : memref<64x64xbf16, 3>
      memref.store %y, %out[%c0] : memref<1xbf16, 1>
      gpu.return
    }
  }
}
