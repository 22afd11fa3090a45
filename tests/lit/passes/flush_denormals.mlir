// RUN: %kiln-opt %s --pass-pipeline='builtin.module(kiln-flush-f32-denormals)' --split-input-file | FileCheck %s

// Functions flush f32 denormals and libdevice is told to (nvvm-reflect-ftz), so __nv_exp2f
// becomes ex2.approx.ftz.f32.
// CHECK-LABEL: gpu.module @kiln_kernels
// CHECK: llvm.module_flags [#llvm.mlir.module_flag<override, "nvvm-reflect-ftz", 1 : i32>]
// CHECK: llvm.func @__nv_exp2f(f32) -> f32 attributes {denormal_fp_math_f32 = "preserve-sign"}
// CHECK: llvm.func @k(%{{.*}}: f32) -> f32 attributes {denormal_fp_math_f32 = "preserve-sign"
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    llvm.func @__nv_exp2f(f32) -> f32
    llvm.func @k(%x: f32) -> f32 attributes {nvvm.kernel} {
      %y = llvm.call @__nv_exp2f(%x) : (f32) -> f32
      llvm.return %y : f32
    }
  }
}

// -----

// A module that already has flags keeps them and gains the reflect flag once.
// CHECK-LABEL: gpu.module @flagged
// CHECK: llvm.module_flags [#llvm.mlir.module_flag<max, "PIC Level", 2 : i32>, #llvm.mlir.module_flag<override, "nvvm-reflect-ftz", 1 : i32>]
// CHECK-NOT: llvm.module_flags
module attributes {gpu.container_module} {
  gpu.module @flagged {
    llvm.module_flags [#llvm.mlir.module_flag<max, "PIC Level", 2 : i32>]
    llvm.func @k() {
      llvm.return
    }
  }
}
