// RUN: not %kiln-opt %s --pass-pipeline='builtin.module(kiln-verify-waits)' 2>&1 | FileCheck %s

// A DMA into @tile read with no wait at all: rejected at the read, naming the wait that fixes it.
// CHECK: kiln-opt: error: {{.*}}:16{{.*}}memref.load may read before the async rocdl.global.load.lds at {{.*}}:15 lands (vmcnt)
// CHECK: Fix: add s_waitcnt(vmcnt=0) before the read
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    memref.global "private" @tile : memref<64xf32, 3>
    gpu.func @missing(%g: !llvm.ptr<1>, %out: memref<64xf32, 1>, %i: index) kernel attributes {kiln.target = "gfx950", kiln.manual_waits} {
      %t = memref.get_global @tile : memref<64xf32, 3>
      %ti = memref.extract_aligned_pointer_as_index %t : memref<64xf32, 3> -> index
      %t64 = arith.index_cast %ti : index to i64
      %tp = llvm.inttoptr %t64 : i64 to !llvm.ptr<3>
      rocdl.s.waitcnt 3953
      rocdl.global.load.lds %g, %tp, 4, 0, 0
      %x = memref.load %t[%i] : memref<64xf32, 3>
      memref.store %x, %out[%i] : memref<64xf32, 1>
      gpu.return
    }
  }
}
