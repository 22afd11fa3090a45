// RUN: %kiln-opt %s --pass-pipeline='builtin.module(kiln-insert-waits)' -split-input-file | FileCheck %s

// Two DMAs, the read needs only the first: vmcnt(1) (3953) right before the read.
// CHECK-LABEL: gpu.func @fewest
// CHECK: rocdl.global.load.lds
// CHECK-NEXT: rocdl.global.load.lds
// CHECK-NEXT: rocdl.s.waitcnt 3953
// CHECK-NEXT: memref.load
// CHECK-NOT: rocdl.s.waitcnt
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    memref.global "private" @tile : memref<64xf32, 3>
    memref.global "private" @other : memref<64xf32, 3>
    gpu.func @fewest(%g: !llvm.ptr<1>, %out: memref<64xf32, 1>, %i: index) kernel attributes {kiln.target = "gfx950"} {
      %t = memref.get_global @tile : memref<64xf32, 3>
      %ti = memref.extract_aligned_pointer_as_index %t : memref<64xf32, 3> -> index
      %t64 = arith.index_cast %ti : index to i64
      %tp = llvm.inttoptr %t64 : i64 to !llvm.ptr<3>
      %o = memref.get_global @other : memref<64xf32, 3>
      %oi = memref.extract_aligned_pointer_as_index %o : memref<64xf32, 3> -> index
      %o64 = arith.index_cast %oi : index to i64
      %op = llvm.inttoptr %o64 : i64 to !llvm.ptr<3>
      rocdl.global.load.lds %g, %tp, 4, 0, 0
      rocdl.global.load.lds %g, %op, 4, 0, 0
      %x = memref.load %t[%i] : memref<64xf32, 3>
      memref.store %x, %out[%i] : memref<64xf32, 1>
      gpu.return
    }
  }
}

// -----

// A user's explicit vmcnt(0) already covers the read: it is kept and nothing is added.
// CHECK-LABEL: gpu.func @explicit_kept
// CHECK: rocdl.global.load.lds
// CHECK-NEXT: rocdl.s.waitcnt 3952
// CHECK-NEXT: memref.load
// CHECK-NOT: rocdl.s.waitcnt
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    memref.global "private" @tile : memref<64xf32, 3>
    gpu.func @explicit_kept(%g: !llvm.ptr<1>, %out: memref<64xf32, 1>, %i: index) kernel attributes {kiln.target = "gfx950"} {
      %t = memref.get_global @tile : memref<64xf32, 3>
      %ti = memref.extract_aligned_pointer_as_index %t : memref<64xf32, 3> -> index
      %t64 = arith.index_cast %ti : index to i64
      %tp = llvm.inttoptr %t64 : i64 to !llvm.ptr<3>
      rocdl.global.load.lds %g, %tp, 4, 0, 0
      rocdl.s.waitcnt 3952
      %x = memref.load %t[%i] : memref<64xf32, 3>
      memref.store %x, %out[%i] : memref<64xf32, 1>
      gpu.return
    }
  }
}

// -----

// Steady state across the back-edge: the DMA issued at the end of one iteration is read at the
// top of the next, so the loop body opens with vmcnt(0); nothing is needed after the loop.
// CHECK-LABEL: gpu.func @pipelined
// CHECK: rocdl.global.load.lds
// CHECK: scf.for
// CHECK-NEXT: rocdl.s.waitcnt 3952
// CHECK-NEXT: memref.load
// CHECK: rocdl.global.load.lds
// CHECK: scf.yield
// CHECK-NOT: rocdl.s.waitcnt
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    memref.global "private" @tile : memref<64xf32, 3>
    gpu.func @pipelined(%g: !llvm.ptr<1>, %out: memref<64xf32, 1>, %i: index, %n: index) kernel attributes {kiln.target = "gfx950"} {
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %zero = arith.constant 0.0 : f32
      %t = memref.get_global @tile : memref<64xf32, 3>
      %ti = memref.extract_aligned_pointer_as_index %t : memref<64xf32, 3> -> index
      %t64 = arith.index_cast %ti : index to i64
      %tp = llvm.inttoptr %t64 : i64 to !llvm.ptr<3>
      rocdl.global.load.lds %g, %tp, 4, 0, 0
      %sum = scf.for %j = %c0 to %n step %c1 iter_args(%acc = %zero) -> (f32) {
        %x = memref.load %t[%i] : memref<64xf32, 3>
        %next = arith.addf %acc, %x : f32
        rocdl.global.load.lds %g, %tp, 4, 0, 0
        scf.yield %next : f32
      }
      memref.store %sum, %out[%i] : memref<64xf32, 1>
      gpu.return
    }
  }
}

// -----

// Consumer-side drain: the cluster holding the MFMA opens with lgkmcnt(0) (49279); the
// cluster without one does not.
// CHECK-LABEL: gpu.func @drain
// CHECK: arith.addf
// CHECK-NOT: rocdl.s.waitcnt
// CHECK: rocdl.s.waitcnt {kiln.cluster = 1 : i64} 49279
// CHECK-NEXT: amdgpu.mfma
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    gpu.func @drain(%a: vector<4xf16>, %c: vector<16xf32>, %f: f32, %out: memref<16xf32, 1>) kernel attributes {kiln.target = "gfx950", kiln.consumer_drain, kiln.cluster_recipes = {c0 = "valu=1", c1 = "mfma=1"}} {
      %s = arith.addf %f, %f {kiln.cluster = 0 : i64} : f32
      %d = amdgpu.mfma 32x32x8 %a * %a + %c {kiln.cluster = 1 : i64} blgp = none : vector<4xf16>, vector<4xf16>, vector<16xf32>
      %c0 = arith.constant 0 : index
      %e = vector.extract %d[0] : f32 from vector<16xf32>
      %r = arith.addf %e, %s : f32
      memref.store %r, %out[%c0] : memref<16xf32, 1>
      gpu.return
    }
  }
}

// -----

// NVIDIA cp.async: reading the destination waits for its group (numGroups = 0).
// CHECK-LABEL: gpu.func @cp_async
// CHECK: nvgpu.device_async_create_group
// CHECK-NEXT: nvgpu.device_async_wait %{{.*}} {numGroups = 0 : i32}
// CHECK-NEXT: memref.load
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    memref.global "private" @tile : memref<64xf32, 3>
    gpu.func @cp_async(%src: memref<64xf32, 1>, %out: memref<64xf32, 1>, %i: index) kernel attributes {kiln.target = "sm_90a"} {
      %t = memref.get_global @tile : memref<64xf32, 3>
      %tok = nvgpu.device_async_copy %src[%i], %t[%i], 1 : memref<64xf32, 1> to memref<64xf32, 3>
      %grp = nvgpu.device_async_create_group %tok
      %x = memref.load %t[%i] : memref<64xf32, 3>
      memref.store %x, %out[%i] : memref<64xf32, 1>
      gpu.return
    }
  }
}
