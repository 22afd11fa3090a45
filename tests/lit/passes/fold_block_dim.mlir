// RUN: %kiln-opt %s --pass-pipeline='builtin.module(kiln-fold-block-dim)' --split-input-file | FileCheck %s

// Every dimension folds to its known_block_size entry.
// CHECK-LABEL: gpu.func @all_dims
// CHECK-NOT: gpu.block_dim
// CHECK-DAG: arith.constant 128 : index
// CHECK-DAG: arith.constant 2 : index
// CHECK-DAG: arith.constant 1 : index
// CHECK-NOT: gpu.block_dim
// CHECK: gpu.return
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    gpu.func @all_dims(%out: memref<?xindex, strided<[1], offset: ?>, 1>) kernel attributes {known_block_size = array<i32: 128, 2, 1>} {
      %x = gpu.block_dim x
      %y = gpu.block_dim y
      %z = gpu.block_dim z
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %c2 = arith.constant 2 : index
      memref.store %x, %out[%c0] : memref<?xindex, strided<[1], offset: ?>, 1>
      memref.store %y, %out[%c1] : memref<?xindex, strided<[1], offset: ?>, 1>
      memref.store %z, %out[%c2] : memref<?xindex, strided<[1], offset: ?>, 1>
      gpu.return
    }
  }
}

// -----

// Without known_block_size the size is unknown at compile time: left alone.
// CHECK-LABEL: gpu.func @unknown_size
// CHECK: gpu.block_dim x
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    gpu.func @unknown_size(%out: memref<?xindex, strided<[1], offset: ?>, 1>) kernel {
      %x = gpu.block_dim x
      %c0 = arith.constant 0 : index
      memref.store %x, %out[%c0] : memref<?xindex, strided<[1], offset: ?>, 1>
      gpu.return
    }
  }
}

// -----

// A fold inside nested control flow replaces every use.
// CHECK-LABEL: gpu.func @nested
// CHECK: scf.if
// CHECK: %[[C64:.*]] = arith.constant 64 : index
// CHECK: arith.muli %{{.*}}, %[[C64]] : index
// CHECK-NOT: gpu.block_dim
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    gpu.func @nested(%out: memref<?xindex, strided<[1], offset: ?>, 1>, %flag: i1) kernel attributes {known_block_size = array<i32: 64, 1, 1>} {
      scf.if %flag {
        %bid = gpu.block_id x
        %x = gpu.block_dim x
        %base = arith.muli %bid, %x : index
        memref.store %base, %out[%bid] : memref<?xindex, strided<[1], offset: ?>, 1>
      }
      gpu.return
    }
  }
}
