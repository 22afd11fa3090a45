// RUN: not %kiln-opt %s --pass-pipeline='builtin.module(kiln-cluster-schedule)' 2>&1 | FileCheck %s

// A cluster whose recipe was never declared is rejected at its first op.
// CHECK: kiln-opt: error: {{.*}}:10{{.*}}cluster 3 has no recipe in kiln.cluster_recipes
// CHECK: Fix: open it with kiln.cluster(k, recipe)
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    gpu.func @no_recipe(%f: f32) kernel attributes {kiln.target = "gfx950", kiln.cluster_recipes = {c0 = "valu=1"}} {
      %a = arith.addf %f, %f {kiln.cluster = 0 : i64} : f32
      %b = arith.addf %f, %f {kiln.cluster = 3 : i64} : f32
      gpu.return
    }
  }
}
