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

// -----

// Register data movement forwards "pending": the shuffle joining two transposed LDS reads is
// not a use, so nothing separates the reads; the MFMA is, and waits for both (lgkmcnt(0)).
// CHECK-LABEL: gpu.func @shuffle_forwards
// CHECK: amdgpu.transpose_load
// CHECK-NEXT: amdgpu.transpose_load
// CHECK-NEXT: vector.shuffle
// CHECK-NEXT: rocdl.s.waitcnt 49279
// CHECK-NEXT: amdgpu.mfma
// CHECK-NOT: rocdl.s.waitcnt
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    memref.global "private" @v : memref<4096xbf16, 3>
    gpu.func @shuffle_forwards(%a: vector<8xbf16>, %c: vector<16xf32>, %i: index, %j: index, %out: memref<16xf32, 1>) kernel attributes {kiln.target = "gfx950"} {
      %v = memref.get_global @v : memref<4096xbf16, 3>
      %lo = amdgpu.transpose_load %v[%i] {kiln.async = "lgkmcnt"} : memref<4096xbf16, 3> -> vector<4xbf16>
      %hi = amdgpu.transpose_load %v[%j] {kiln.async = "lgkmcnt"} : memref<4096xbf16, 3> -> vector<4xbf16>
      %b = vector.shuffle %lo, %hi [0, 1, 2, 3, 4, 5, 6, 7] : vector<4xbf16>, vector<4xbf16>
      %d = amdgpu.mfma 32x32x16 %a * %b + %c blgp = none : vector<8xbf16>, vector<8xbf16>, vector<16xf32>
      %c0 = arith.constant 0 : index
      vector.store %d, %out[%c0] : memref<16xf32, 1>, vector<16xf32>
      gpu.return
    }
  }
}

// -----

// A staircase: each MFMA waits only for the pair of reads its operand was shuffled from, so
// the first waits with two reads still in flight (lgkmcnt(2), 49791), the second for none.
// CHECK-LABEL: gpu.func @staircase
// CHECK-COUNT-4: amdgpu.transpose_load
// CHECK: vector.shuffle
// CHECK-NEXT: vector.shuffle
// CHECK-NEXT: rocdl.s.waitcnt 49791
// CHECK-NEXT: amdgpu.mfma
// CHECK-NEXT: rocdl.s.waitcnt 49279
// CHECK-NEXT: amdgpu.mfma
// CHECK-NOT: rocdl.s.waitcnt
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    memref.global "private" @v : memref<4096xbf16, 3>
    gpu.func @staircase(%a: vector<8xbf16>, %c: vector<16xf32>, %i: index, %out: memref<16xf32, 1>) kernel attributes {kiln.target = "gfx950"} {
      %v = memref.get_global @v : memref<4096xbf16, 3>
      %r0 = amdgpu.transpose_load %v[%i] {kiln.async = "lgkmcnt"} : memref<4096xbf16, 3> -> vector<4xbf16>
      %r1 = amdgpu.transpose_load %v[%i] {kiln.async = "lgkmcnt"} : memref<4096xbf16, 3> -> vector<4xbf16>
      %r2 = amdgpu.transpose_load %v[%i] {kiln.async = "lgkmcnt"} : memref<4096xbf16, 3> -> vector<4xbf16>
      %r3 = amdgpu.transpose_load %v[%i] {kiln.async = "lgkmcnt"} : memref<4096xbf16, 3> -> vector<4xbf16>
      %b0 = vector.shuffle %r0, %r1 [0, 1, 2, 3, 4, 5, 6, 7] : vector<4xbf16>, vector<4xbf16>
      %b1 = vector.shuffle %r2, %r3 [0, 1, 2, 3, 4, 5, 6, 7] : vector<4xbf16>, vector<4xbf16>
      %d0 = amdgpu.mfma 32x32x16 %a * %b0 + %c blgp = none : vector<8xbf16>, vector<8xbf16>, vector<16xf32>
      %d1 = amdgpu.mfma 32x32x16 %a * %b1 + %d0 blgp = none : vector<8xbf16>, vector<8xbf16>, vector<16xf32>
      %c0 = arith.constant 0 : index
      vector.store %d1, %out[%c0] : memref<16xf32, 1>, vector<16xf32>
      gpu.return
    }
  }
}

// -----

// Extracts and bitcasts forward too: the wait goes before the arith.addf that consumes the
// element, not before the vector.extract or the arith.bitcast.
// CHECK-LABEL: gpu.func @extract_bitcast_forward
// CHECK: amdgpu.transpose_load
// CHECK-NEXT: vector.extract
// CHECK-NEXT: arith.bitcast
// CHECK-NEXT: rocdl.s.waitcnt 49279
// CHECK-NEXT: arith.addf
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    memref.global "private" @v : memref<4096xbf16, 3>
    gpu.func @extract_bitcast_forward(%i: index, %x: f16, %out: memref<4xf16, 1>) kernel attributes {kiln.target = "gfx950"} {
      %v = memref.get_global @v : memref<4096xbf16, 3>
      %r = amdgpu.transpose_load %v[%i] {kiln.async = "lgkmcnt"} : memref<4096xbf16, 3> -> vector<4xbf16>
      %e = vector.extract %r[1] : bf16 from vector<4xbf16>
      %h = arith.bitcast %e : bf16 to f16
      %s = arith.addf %h, %x : f16
      memref.store %s, %out[%i] : memref<4xf16, 1>
      gpu.return
    }
  }
}

// -----

// A pending value carried across the back-edge: the read at the bottom of one iteration is
// consumed at the top of the next. scf.yield only forwards it, so the wait sits before the
// consumer, and after the loop before the store of the result.
// CHECK-LABEL: gpu.func @carried
// CHECK: scf.for
// CHECK-NEXT: rocdl.s.waitcnt 49279
// CHECK-NEXT: arith.addf
// CHECK-NEXT: amdgpu.transpose_load
// CHECK-NEXT: scf.yield
// CHECK: rocdl.s.waitcnt 49279
// CHECK-NEXT: vector.store
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    memref.global "private" @v : memref<4096xbf16, 3>
    gpu.func @carried(%i: index, %n: index, %out: memref<4xbf16, 1>) kernel attributes {kiln.target = "gfx950"} {
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %v = memref.get_global @v : memref<4096xbf16, 3>
      %first = amdgpu.transpose_load %v[%i] {kiln.async = "lgkmcnt"} : memref<4096xbf16, 3> -> vector<4xbf16>
      %last = scf.for %j = %c0 to %n step %c1 iter_args(%prev = %first) -> (vector<4xbf16>) {
        %sum = arith.addf %prev, %prev : vector<4xbf16>
        %next = amdgpu.transpose_load %v[%j] {kiln.async = "lgkmcnt"} : memref<4096xbf16, 3> -> vector<4xbf16>
        scf.yield %next : vector<4xbf16>
      }
      vector.store %last, %out[%c0] : memref<4xbf16, 1>, vector<4xbf16>
      gpu.return
    }
  }
}

// -----

// A DMA issued after the barrier does not count toward the wait placed before it: at the
// barrier the DMA into @tile is the youngest, so the wait there is vmcnt(0) (3952), not
// vmcnt(1). A view (memref.collapse_shape) of the buffer is not a read.
// CHECK-LABEL: gpu.func @count_at_barrier
// CHECK: rocdl.global.load.lds
// CHECK-NEXT: rocdl.s.waitcnt 3952
// CHECK-NEXT: rocdl.s.barrier
// CHECK-NEXT: rocdl.global.load.lds
// CHECK-NEXT: memref.collapse_shape
// CHECK-NEXT: memref.load
// CHECK-NOT: rocdl.s.waitcnt
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    memref.global "private" @tile : memref<8x8xf32, 3>
    memref.global "private" @other : memref<64xf32, 3>
    gpu.func @count_at_barrier(%g: !llvm.ptr<1>, %out: memref<64xf32, 1>, %i: index) kernel attributes {kiln.target = "gfx950"} {
      %t = memref.get_global @tile : memref<8x8xf32, 3>
      %ti = memref.extract_aligned_pointer_as_index %t : memref<8x8xf32, 3> -> index
      %t64 = arith.index_cast %ti : index to i64
      %tp = llvm.inttoptr %t64 : i64 to !llvm.ptr<3>
      %o = memref.get_global @other : memref<64xf32, 3>
      %oi = memref.extract_aligned_pointer_as_index %o : memref<64xf32, 3> -> index
      %o64 = arith.index_cast %oi : index to i64
      %op = llvm.inttoptr %o64 : i64 to !llvm.ptr<3>
      rocdl.global.load.lds %g, %tp, 4, 0, 0
      rocdl.s.barrier
      rocdl.global.load.lds %g, %op, 4, 0, 0
      %flat = memref.collapse_shape %t [[0, 1]] : memref<8x8xf32, 3> into memref<64xf32, 3>
      %x = memref.load %flat[%i] : memref<64xf32, 3>
      memref.store %x, %out[%i] : memref<64xf32, 1>
      gpu.return
    }
  }
}
