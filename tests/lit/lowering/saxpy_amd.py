# RUN: %python %S/Inputs/print_stages.py gfx950 gfx942 | FileCheck %s

# CHECK-LABEL: // STAGE gfx950 gpu
# CHECK-NOT: gpu.block_dim
# CHECK-LABEL: // STAGE gfx950 rocdl
# CHECK: gpu.module @kiln_kernels [#rocdl.target<O = 3, chip = "gfx950">]
# CHECK: llvm.func @saxpy(%{{.*}}: !llvm.ptr<1>
# CHECK-SAME: rocdl.kernel
# CHECK-NOT: __ockl_get_local_size
# CHECK: rocdl.workgroup.id.x
# CHECK-LABEL: // STAGE gfx950 llvm
# CHECK: target triple = "amdgcn-amd-amdhsa"
# CHECK: define amdgpu_kernel void @saxpy(ptr addrspace(1)
# CHECK-LABEL: // STAGE gfx950 amdgcn
# CHECK: .amdgcn_target "amdgcn-amd-amdhsa--gfx950"
# Address space 1 memrefs give global (not flat) memory instructions.
# CHECK-NOT: flat_load
# CHECK: global_load_dword
# CHECK: global_store_dword
# CHECK: s_endpgm
# CHECK-LABEL: // STAGE gfx950 obj
# CHECK-NEXT: <{{[0-9]+}} bytes>
# CHECK-LABEL: // METADATA gfx950
# CHECK-SAME: agpr_count=0
# CHECK-SAME: lds_bytes=0
# CHECK-SAME: num_warps=2
# CHECK-SAME: scratch_bytes=0
# CHECK-SAME: sgpr_count={{[1-9][0-9]*}}
# CHECK-SAME: target=gfx950
# CHECK-SAME: vgpr_count={{[1-9][0-9]*}}
# CHECK-SAME: stages=gpu,rocdl,llvm,amdgcn,obj,hsaco
# CHECK-LABEL: // STAGE gfx942 amdgcn
# CHECK: .amdgcn_target "amdgcn-amd-amdhsa--gfx942"
# CHECK: global_load_dword
