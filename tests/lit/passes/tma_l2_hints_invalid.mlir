// RUN: not %kiln-opt %s --pass-pipeline='builtin.module(kiln-tma-l2-hints)' 2>&1 | FileCheck %s

// A location naming a policy PTX's createpolicy does not have is rejected, not dropped.
// CHECK: kiln-opt: error: L2 eviction priority 'evict_sometimes' is not evict_first, evict_last or evict_normal
// CHECK: Fix: use one of those three
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    llvm.func @k(%map: !llvm.ptr, %dst: !llvm.ptr<7>, %bar: !llvm.ptr<3>, %x: i32, %y: i32) attributes {nvvm.kernel} {
      nvvm.cp.async.bulk.tensor.shared.cluster.global %dst, %map, %bar, box[%x, %y] : !llvm.ptr<7>, !llvm.ptr loc("kiln.l2.evict_sometimes"("k.py":12:5))
      llvm.return
    }
  }
}
