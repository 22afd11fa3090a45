# RUN: %python %s | FileCheck %s
# kiln.gemm on sm_90a with A from registers (FlashAttention-3's P V): S = Q K^T reads K through
# k_s.T (an operand_tile "a" read as a K-major B), starts from zero with scale-d 0 (no register
# is zeroed), and P = cast(S, bf16) is the register A of O += P V (values 8j..8j+7 of the cast
# accumulator are K step j's fragment: one truncf, shuffles, no shared stage). Each operand's
# descriptor is made once per gemm (a fresh mov.b64) and the k steps add constants to it.
import os

os.environ["KILN_PTXAS"] = "none"  # stop at PTX: the checks must not depend on ptxas

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

import kiln  # noqa: E402
from kiln import bf16, f32  # noqa: E402


@kiln.kernel(num_threads=128)
def pv(q: kiln.Tensor[bf16, 2], k: kiln.Tensor[bf16, 2], v: kiln.Tensor[bf16, 2],
       o: kiln.Tensor[f32, 2]):
    q_s = kiln.tiles.operand_tile((64, 64), bf16, "a")
    k_s = kiln.tiles.operand_tile((64, 64), bf16, "a")
    v_s = kiln.tiles.operand_tile((64, 128), bf16, "b")
    kiln.copy(kiln.GlobalTile(q, (64, 64), (0, 0), align=16), q_s)
    kiln.copy(kiln.GlobalTile(k, (64, 64), (0, 0), align=16), k_s)
    kiln.copy(kiln.GlobalTile(v, (64, 128), (0, 0), align=16), v_s)
    kiln.barrier()
    s = kiln.gemm(q_s, k_s.T, kiln.accumulator(q_s, k_s.T))
    p = kiln.cast(s, bf16)
    acc = kiln.gemm(p, v_s, kiln.accumulator(p, v_s))
    kiln.copy(acc, kiln.GlobalTile(o, (64, 128), (0, 0)))


x = np.zeros((64, 64), ml_dtypes.bfloat16)
ck = pv.compile(x, x, np.zeros((64, 128), ml_dtypes.bfloat16), np.zeros((64, 128), np.float32),
                target="sm_90a")
print(ck.asm["gpu"])
print(ck.asm["ptx"])

# CHECK-LABEL: gpu.func @pv
# CHECK: nvvm.wgmma.fence.aligned
# CHECK: nvvm.wgmma.mma_async {{.*}} <m = 64, n = 64, k = 16>, D[<f32>, <zero>], A[<bf16>, <one>, <row>], B[<bf16>, <one>, <col>]
# CHECK-COUNT-3: nvvm.wgmma.mma_async {{.*}} <m = 64, n = 64, k = 16>, D[<f32>, <one>], A[<bf16>, <one>, <row>], B[<bf16>, <one>, <col>]
# CHECK: nvvm.wgmma.commit.group.sync.aligned
# CHECK: nvvm.wgmma.wait.group.sync.aligned 0
# CHECK: arith.truncf %{{.*}} : vector<32xf32> to vector<32xbf16>
# CHECK-NOT: memref.store
# CHECK: nvvm.wgmma.fence.aligned
# CHECK-COUNT-4: kiln.op = "nvidia.wgmma.mma_async.rs", kiln.op_args = {dtype = "bf16", n = 128 : i64, trans_b = 1 : i64}
# CHECK: nvvm.wgmma.commit.group.sync.aligned

# CHECK-LABEL: .entry pv
# CHECK: mov.b64 %rd{{[0-9]+}}, %rd{{[0-9]+}};
# CHECK: mov.b64 %rd{{[0-9]+}}, %rd{{[0-9]+}};
# CHECK: wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16
# CHECK: wgmma.commit_group.sync.aligned;
# CHECK: wgmma.wait_group.sync.aligned{{[[:space:]]+}}0;
# CHECK-NOT: st.shared
# CHECK: wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {{{.*}}}, {%r{{[0-9]+}}, %r{{[0-9]+}}, %r{{[0-9]+}}, %r{{[0-9]+}}}, %rd{{[0-9]+}}, p, 1, 1, 1;
