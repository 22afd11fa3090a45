// RUN: not %kiln-opt %s --pass-pipeline='builtin.module(kiln-verify-waits)' 2>&1 | FileCheck %s

// Pending flows through the shuffle to its real consumer: the MFMA is the read that is
// rejected (not the shuffle), naming the loosest wait that covers it.
// CHECK: kiln-opt: error: {{.*}}:16{{.*}}this amdgpu.mfma may read before the async amdgpu.transpose_load at {{.*}}:13 lands (lgkmcnt)
// CHECK: Fix: add s_waitcnt(lgkmcnt=0) before the read
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    memref.global "private" @v : memref<4096xbf16, 3>
    gpu.func @missing(%a: vector<8xbf16>, %c: vector<16xf32>, %i: index, %out: memref<16xf32, 1>) kernel attributes {kiln.target = "gfx950", kiln.manual_waits} {
      %v = memref.get_global @v : memref<4096xbf16, 3>
      %lo = amdgpu.transpose_load %v[%i] {kiln.async = "lgkmcnt"} : memref<4096xbf16, 3> -> vector<4xbf16>
      %hi = amdgpu.transpose_load %v[%i] {kiln.async = "lgkmcnt"} : memref<4096xbf16, 3> -> vector<4xbf16>
      rocdl.s.waitcnt 49535
      %b = vector.shuffle %lo, %hi [0, 1, 2, 3, 4, 5, 6, 7] : vector<4xbf16>, vector<4xbf16>
      %d = amdgpu.mfma 32x32x16 %a * %b + %c blgp = none : vector<8xbf16>, vector<8xbf16>, vector<16xf32>
      %c0 = arith.constant 0 : index
      vector.store %d, %out[%c0] : memref<16xf32, 1>, vector<16xf32>
      gpu.return
    }
  }
}
