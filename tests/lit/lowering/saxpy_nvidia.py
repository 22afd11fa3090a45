# RUN: %python %S/Inputs/print_stages.py sm_90a | FileCheck %s

# CHECK-LABEL: // STAGE sm_90a kiln
# CHECK: gpu.block_dim x
# CHECK-LABEL: // STAGE sm_90a gpu
# CHECK-NOT: gpu.block_dim
# CHECK: arith.constant 128 : index
# CHECK-LABEL: // STAGE sm_90a nvvm
# CHECK: gpu.module @kiln_kernels [#nvvm.target<O = 3, chip = "sm_90a", features = "+ptx80">]
# CHECK: llvm.func @saxpy(%{{.*}}: !llvm.ptr<1>
# CHECK-SAME: nvvm.kernel
# CHECK: nvvm.read.ptx.sreg.ctaid.x
# CHECK: llvm.load %{{.*}} : !llvm.ptr<1> -> f32
# CHECK-LABEL: // STAGE sm_90a llvm
# CHECK: target triple = "nvptx64-nvidia-cuda"
# CHECK: define ptx_kernel void @saxpy(ptr addrspace(1)
# CHECK: load float, ptr addrspace(1)
# CHECK-LABEL: // STAGE sm_90a ptx
# CHECK: .version 8.0
# CHECK: .target sm_90a
# CHECK: .visible .entry saxpy(
# CHECK: .maxntid 128, 1, 1
# CHECK: ld.global.b32
# CHECK: st.global.b32
# CHECK-LABEL: // METADATA sm_90a
# CHECK-SAME: num_warps=4
# CHECK-SAME: registers=
# CHECK-SAME: shared_bytes=
# CHECK-SAME: spill_bytes=
# CHECK-SAME: stack_bytes=
# CHECK-SAME: target=sm_90a
# CHECK-SAME: stages=gpu,nvvm,llvm,ptx,cubin
