// RUN: %kiln-opt %s --pass-pipeline='builtin.module(kiln-tma-l2-hints)' | FileCheck %s

// A TMA load whose location names an L2 policy (kiln.tma.load(..., eviction_policy=...))
// gets that policy as its cache-hint operand; its predicate stays. A load with a plain
// location is left alone.
// CHECK-LABEL: llvm.func @k(
// CHECK: %[[POLICY:.*]] = llvm.inline_asm {kiln.op = "nvidia.sync.l2_cache_policy"} "createpolicy.fractional.L2::evict_first.b64 $0, 1.0;", "=l"
// CHECK-NEXT: nvvm.cp.async.bulk.tensor.shared.cluster.global %arg1, %arg0, %arg2, box[%arg3, %arg4] l2_cache_hint = %[[POLICY]] predicate = %arg5
// CHECK: %[[LAST:.*]] = llvm.inline_asm {kiln.op = "nvidia.sync.l2_cache_policy"} "createpolicy.fractional.L2::evict_last.b64 $0, 1.0;", "=l"
// CHECK-NEXT: nvvm.cp.async.bulk.tensor.shared.cluster.global %arg1, %arg0, %arg2, box[%arg3, %arg4] multicast_mask = %arg6 l2_cache_hint = %[[LAST]] :
// CHECK-NEXT: nvvm.cp.async.bulk.tensor.shared.cluster.global %arg1, %arg0, %arg2, box[%arg3, %arg4] :
// CHECK-NOT: l2_cache_hint
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    llvm.func @k(%map: !llvm.ptr, %dst: !llvm.ptr<7>, %bar: !llvm.ptr<3>, %x: i32, %y: i32,
                 %p: i1, %mask: i16) attributes {nvvm.kernel} {
      nvvm.cp.async.bulk.tensor.shared.cluster.global %dst, %map, %bar, box[%x, %y] predicate = %p : !llvm.ptr<7>, !llvm.ptr loc("kiln.l2.evict_first"("k.py":12:5))
      nvvm.cp.async.bulk.tensor.shared.cluster.global %dst, %map, %bar, box[%x, %y] multicast_mask = %mask : !llvm.ptr<7>, !llvm.ptr loc("kiln.l2.evict_last"("k.py":13:5))
      nvvm.cp.async.bulk.tensor.shared.cluster.global %dst, %map, %bar, box[%x, %y] : !llvm.ptr<7>, !llvm.ptr loc("k.py":14:5)
      llvm.return
    }
  }
}
