// RUN: %kiln-opt %s --pass-pipeline='builtin.module(kiln-cluster-schedule)' -split-input-file | FileCheck %s

// AMD: fenced begin/end markers, setprio around the work, the interleave as sched groups
// (ds_read = 0x100 = 256, valu = 2), then the cluster-ending s_barrier.
// CHECK-LABEL: gpu.func @amd_cluster
// CHECK: rocdl.sched.barrier 0
// CHECK-NEXT: rocdl.sched.group.barrier 0, 0, 4915201 {{.*}}kiln.cluster_marker = "begin"
// CHECK-NEXT: rocdl.sched.barrier 0
// CHECK-NEXT: rocdl.s.setprio 1
// CHECK-NEXT: memref.load
// CHECK-NEXT: arith.addf
// CHECK-NEXT: memref.load
// CHECK-NEXT: arith.addf
// CHECK-NEXT: rocdl.sched.group.barrier 256, 1, 1
// CHECK-NEXT: rocdl.sched.group.barrier 2, 1, 1
// CHECK-NEXT: rocdl.sched.group.barrier 256, 1, 1
// CHECK-NEXT: rocdl.sched.group.barrier 2, 1, 1
// CHECK-NEXT: rocdl.sched.barrier 0
// CHECK-NEXT: rocdl.s.setprio 0
// CHECK-NEXT: rocdl.s.barrier
// CHECK-NEXT: rocdl.sched.barrier 0
// CHECK-NEXT: rocdl.sched.group.barrier 0, 0, 4947969 {{.*}}kiln.cluster_marker = "end"
// CHECK-NEXT: rocdl.sched.barrier 0
// CHECK-NEXT: memref.store
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    memref.global "private" @tile : memref<64xf32, 3>
    gpu.func @amd_cluster(%out: memref<64xf32, 1>, %i: index, %j: index) kernel attributes {kiln.target = "gfx950", kiln.cluster_recipes = {c1 = "ds_read=2 valu=2; interleave ds_read=1 valu=1; barrier; setprio=1"}} {
      %t = memref.get_global @tile : memref<64xf32, 3>
      %x = memref.load %t[%i] {kiln.cluster = 1 : i64} : memref<64xf32, 3>
      %a = arith.addf %x, %x {kiln.cluster = 1 : i64} : f32
      %y = memref.load %t[%j] {kiln.cluster = 1 : i64} : memref<64xf32, 3>
      %b = arith.addf %a, %y {kiln.cluster = 1 : i64} : f32
      memref.store %b, %out[%i] : memref<64xf32, 1>
      gpu.return
    }
  }
}

// -----

// Two instances of cluster 0 in a loop body and the prologue; iglp instead of an interleave,
// no barrier: each instance gets its markers and the iglp.opt, and no s_barrier appears.
// CHECK-LABEL: gpu.func @instances
// CHECK-NOT: rocdl.s.barrier
// CHECK: rocdl.sched.group.barrier 0, 0, 4915200
// CHECK: rocdl.iglp.opt 0
// CHECK: scf.for
// CHECK: rocdl.sched.group.barrier 0, 0, 4915200
// CHECK: rocdl.iglp.opt 0
// CHECK-NOT: rocdl.s.barrier
// CHECK: gpu.return
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    gpu.func @instances(%f: f32, %n: index) kernel attributes {kiln.target = "gfx942", kiln.cluster_recipes = {c0 = "valu=1; iglp=0"}} {
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %a = arith.addf %f, %f {kiln.cluster = 0 : i64} : f32
      scf.for %k = %c0 to %n step %c1 {
        %b = arith.mulf %f, %f {kiln.cluster = 0 : i64} : f32
      }
      gpu.return
    }
  }
}

// -----

// NVIDIA: the cluster ends in gpu.barrier (bar.sync); no AMD scheduling ops appear.
// CHECK-LABEL: gpu.func @nvidia_cluster
// CHECK-NOT: rocdl.
// CHECK: arith.addf
// CHECK-NEXT: gpu.barrier
// CHECK-NOT: rocdl.
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    gpu.func @nvidia_cluster(%f: f32) kernel attributes {kiln.target = "sm_90a", kiln.cluster_recipes = {c0 = "wgmma=1; barrier"}} {
      %a = arith.addf %f, %f {kiln.cluster = 0 : i64} : f32
      gpu.return
    }
  }
}

// -----

// NVIDIA ping-pong on named barriers 3 and 4: before the loop the odd consumer warp group
// arrives on 3 (the even one goes first); each turn waits on its own barrier before the WGMMA
// issue and arrives on the other's after it, 256 threads (two warp groups) per barrier.
// CHECK-LABEL: gpu.func @pingpong
// CHECK: %[[ODD:.*]] = arith.trunci
// CHECK: scf.if %[[ODD]] {
// CHECK-NEXT: %[[FIRST:.*]] = arith.constant 3 : i32
// CHECK-NEXT: %[[N:.*]] = arith.constant 256 : i32
// CHECK-NEXT: llvm.inline_asm has_side_effects "bar.arrive $0, $1;", "r,r" %[[FIRST]], %[[N]]
// CHECK: scf.for
// CHECK: %[[OWN:.*]] = arith.select %{{.*}}, %c4_i32{{.*}}, %c3_i32
// CHECK-NEXT: %[[OTHER:.*]] = arith.select %{{.*}}, %c3_i32{{.*}}, %c4_i32
// CHECK: llvm.inline_asm has_side_effects {{.*}}kiln.cluster_marker = "begin"} "bar.sync $0, $1;", "r,r" %[[OWN]],
// CHECK-NEXT: nvvm.wgmma.fence.aligned
// CHECK-NEXT: arith.addf
// CHECK-NEXT: nvvm.wgmma.commit.group.sync.aligned
// CHECK-NEXT: arith.constant {{.*}}256 : i32
// CHECK-NEXT: llvm.inline_asm has_side_effects {{.*}}"bar.arrive $0, $1;", "r,r" %[[OTHER]]
// CHECK-NOT: gpu.barrier
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    gpu.func @pingpong(%f: f32, %n: index) kernel attributes {kiln.target = "sm_90a", kiln.cluster_recipes = {c0 = "wgmma=1; pingpong=3,4"}} {
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      scf.for %k = %c0 to %n step %c1 {
        nvvm.wgmma.fence.aligned {kiln.cluster = 0 : i64}
        %a = arith.addf %f, %f {kiln.cluster = 0 : i64} : f32
        nvvm.wgmma.commit.group.sync.aligned {kiln.cluster = 0 : i64}
      }
      gpu.return
    }
  }
}
