# RUN: %python %s | FileCheck %s
# The Hopper smoke kernel (examples/hopper_tma_wgmma_smoke.py) through every sm_90a stage.
# TensorMap parameters arrive as !llvm.ptr, viewed as descriptors by kiln.tma.descriptor_from_pointer.

import importlib.util
import os
from pathlib import Path

os.environ["KILN_PTXAS"] = "none"  # stop at PTX: the checks must not depend on ptxas
os.environ["KILN_NO_CACHE"] = "1"

example = Path(__file__).resolve().parents[3] / "examples" / "hopper_tma_wgmma_smoke.py"
spec = importlib.util.spec_from_file_location("smoke", example)
smoke = importlib.util.module_from_spec(spec)
spec.loader.exec_module(smoke)

compiled = smoke.tma_wgmma_smoke.compile(*smoke.reference_inputs(), target="sm_90a")
for stage in ("kiln", "nvvm", "ptx"):
    print(f"// STAGE {stage}")
    print(compiled.asm[stage])

# CHECK-LABEL: // STAGE kiln
# CHECK: gpu.func @tma_wgmma_smoke(%{{.*}}: !llvm.ptr {{.*}}, %{{.*}}: !llvm.ptr {{.*}}, %{{.*}}: memref<?x?xf32, strided<[?, 1], offset: ?>, 1>
# CHECK-COUNT-2: builtin.unrealized_conversion_cast %arg{{[01]}} : !llvm.ptr to !nvgpu.tensormap.descriptor
# CHECK: nvgpu.mbarrier.create
# CHECK: nvgpu.mbarrier.init
# CHECK: nvgpu.mbarrier.arrive.expect_tx %{{.*}}[%{{.*}}], %c16384
# CHECK-COUNT-2: nvgpu.tma.async.load {{.*}}swizzle = swizzle_128b
# CHECK: nvgpu.mbarrier.try_wait.parity
# CHECK: nvvm.wgmma.fence.aligned
# CHECK-COUNT-4: nvvm.wgmma.mma_async {{.*}} <m = 64, n = 64, k = 16>, D[<f32>, <one>], A[<bf16>, <one>, <row>], B[<bf16>, <one>, <row>]
# CHECK: nvvm.wgmma.commit.group.sync.aligned
# CHECK: nvvm.wgmma.wait.group.sync.aligned 0
# CHECK-NOT: nvgpu.warpgroup
# CHECK: memref.store {{.*}} : memref<?x?xf32, strided<[?, 1], offset: ?>, 1>

# CHECK-LABEL: // STAGE nvvm
# CHECK: llvm.func @tma_wgmma_smoke(
# CHECK: nvvm.fence.mbarrier.init
# CHECK-COUNT-2: cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes
# CHECK: mbarrier.try_wait.parity.shared.b64
# CHECK: nvvm.wgmma.fence.aligned
# CHECK-COUNT-4: wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16
# CHECK: nvvm.wgmma.commit.group.sync.aligned
# CHECK: nvvm.wgmma.wait.group.sync.aligned 0

# CHECK-LABEL: // STAGE ptx
# CHECK: .target sm_90a
# CHECK: mbarrier.init.shared.b64
# CHECK: mbarrier.arrive.expect_tx.shared.b64
# CHECK-COUNT-2: cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes
# CHECK: mbarrier.try_wait.parity.shared.b64
# CHECK-COUNT-4: wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16
# CHECK: wgmma.wait_group.sync.aligned{{[[:space:]]+}}0;
# CHECK: st.global.b32
