// RUN: %kiln-opt %s --pass-pipeline='builtin.module(kiln-scalarize-structs)' | FileCheck %s

// A 128-register struct that a loop rebuilds (insertvalue) is carried as 128 f32: the loop's
// iter_args and results, taken apart before the loop and at the yield, packed again where the
// body and the code after the loop read it (canonicalize folds those extracts later).
!acc = !llvm.struct<(f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32)>
// CHECK-LABEL: func.func @rescale
// CHECK: scf.for {{.*}} -> (f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32) {
// CHECK: scf.yield {{.*}} : f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32, f32
// CHECK: llvm.mlir.undef : !llvm.struct
// CHECK: return {{.*}} : !llvm.struct
func.func @rescale(%init: !acc, %x: f32, %n: index) -> !acc {
  %c0 = arith.constant 0 : index
  %c1 = arith.constant 1 : index
  %r = scf.for %k = %c0 to %n step %c1 iter_args(%a = %init) -> (!acc) {
    %e = llvm.extractvalue %a[0] : !acc
    %m = arith.mulf %e, %x : f32
    %b = llvm.insertvalue %m, %a[0] : !acc
    scf.yield %b : !acc
  }
  return %r : !acc
}

// The same struct passed through unchanged (a WGMMA result fed to the next one) stays whole.
// CHECK-LABEL: func.func @pass_through
// CHECK: scf.for {{.*}} -> (!llvm.struct
func.func @pass_through(%init: !acc, %n: index) -> !acc {
  %c0 = arith.constant 0 : index
  %c1 = arith.constant 1 : index
  %r = scf.for %k = %c0 to %n step %c1 iter_args(%a = %init) -> (!acc) {
    scf.yield %a : !acc
  }
  return %r : !acc
}
