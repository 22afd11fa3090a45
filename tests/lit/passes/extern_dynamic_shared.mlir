// RUN: %kiln-opt %s --pass-pipeline='builtin.module(kiln-extern-dynamic-shared)' | FileCheck %s

// The lowered gpu.dynamic_shared_memory global becomes an external declaration (placed by the
// driver after all static shared memory); other shared globals keep their linkage.
// CHECK: llvm.mlir.global external @__dynamic_shmem__0() {addr_space = 3 : i32, alignment = 16 : i64} : !llvm.array<0 x i8>
// CHECK: llvm.mlir.global internal @kiln_shared() {addr_space = 3 : i32, alignment = 16 : i64} : !llvm.array<4096 x i8>
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    llvm.mlir.global internal @__dynamic_shmem__0() {addr_space = 3 : i32, alignment = 16 : i64} : !llvm.array<0 x i8>
    llvm.mlir.global internal @kiln_shared() {addr_space = 3 : i32, alignment = 16 : i64} : !llvm.array<4096 x i8>
  }
}
