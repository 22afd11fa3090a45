// RUN: %kiln-opt %s --pass-pipeline='builtin.module(kiln-amdgpu-native-math)' -split-input-file | FileCheck %s

// exp2 and log2 of f32 become the native instructions, no device-library call.
// CHECK-LABEL: gpu.func @exp2_log2
// CHECK: rocdl.exp2 %{{.*}} f32 -> f32
// CHECK: rocdl.log %{{.*}} f32 -> f32
// CHECK-NOT: math.
gpu.module @m {
  gpu.func @exp2_log2(%x: f32) -> f32 {
    %a = math.exp2 %x : f32
    %b = math.log2 %a : f32
    gpu.return %b : f32
  }
}

// -----

// Natural exp/log fold the base change into one multiply; rsqrt is rcp(sqrt).
// CHECK-LABEL: gpu.func @exp_log_rsqrt
// CHECK: %[[E:.*]] = arith.constant 1.44269{{.*}} : f32
// CHECK: arith.mulf %{{.*}}, %[[E]] : f32
// CHECK: rocdl.exp2
// CHECK: rocdl.log
// CHECK: arith.constant 0.69314{{.*}} : f32
// CHECK: rocdl.sqrt
// CHECK: rocdl.rcp
// CHECK-NOT: math.
gpu.module @m {
  gpu.func @exp_log_rsqrt(%x: f32) -> f32 {
    %a = math.exp %x : f32
    %b = math.log %a : f32
    %c = math.rsqrt %b : f32
    gpu.return %c : f32
  }
}

// -----

// Vectors are rewritten lane by lane; f64 has no native instruction and is left alone.
// CHECK-LABEL: gpu.func @vector_and_f64
// CHECK-COUNT-2: rocdl.exp2 %{{.*}} f16 -> f16
// CHECK: vector.from_elements
// CHECK: math.exp2 %{{.*}} : f64
gpu.module @m {
  gpu.func @vector_and_f64(%v: vector<2xf16>, %d: f64) -> (vector<2xf16>, f64) {
    %a = math.exp2 %v : vector<2xf16>
    %b = math.exp2 %d : f64
    gpu.return %a, %b : vector<2xf16>, f64
  }
}
