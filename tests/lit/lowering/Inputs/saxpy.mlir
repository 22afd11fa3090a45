module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    gpu.func @saxpy(%x: memref<?xf32, strided<[1], offset: ?>, 1>, %y: memref<?xf32, strided<[1], offset: ?>, 1>, %n: i32, %a: f32) kernel attributes {known_block_size = array<i32: 128, 1, 1>} {
      %bid = gpu.block_id x loc("saxpy.py":5:8)
      %bdim = gpu.block_dim x loc("saxpy.py":5:8)
      %tid = gpu.thread_id x loc("saxpy.py":5:8)
      %t0 = arith.muli %bid, %bdim : index loc("saxpy.py":5:8)
      %i = arith.addi %t0, %tid : index loc("saxpy.py":5:8)
      %nn = arith.index_cast %n : i32 to index loc("saxpy.py":6:4)
      %ok = arith.cmpi slt, %i, %nn : index loc("saxpy.py":6:4)
      scf.if %ok {
        %xv = memref.load %x[%i] : memref<?xf32, strided<[1], offset: ?>, 1> loc("saxpy.py":7:8)
        %yv = memref.load %y[%i] : memref<?xf32, strided<[1], offset: ?>, 1> loc("saxpy.py":7:8)
        %ax = arith.mulf %a, %xv : f32 loc("saxpy.py":7:8)
        %r = arith.addf %ax, %yv : f32 loc("saxpy.py":7:8)
        memref.store %r, %y[%i] : memref<?xf32, strided<[1], offset: ?>, 1> loc("saxpy.py":7:8)
      } loc("saxpy.py":6:4)
      gpu.return loc("saxpy.py":8:4)
    } loc("saxpy.py":3:0)
  } loc("saxpy.py":1:0)
}
