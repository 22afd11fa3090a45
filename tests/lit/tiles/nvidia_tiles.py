# RUN: %python %s | FileCheck %s
# kiln.tiles on sm_80: the mma.sync GEMM example (cp.async + ldmatrix + mma.sync) and a RegTile
# row reduction, at the nvgpu/nvvm level and in PTX.

import importlib.util
import os
from pathlib import Path

import numpy as np

os.environ["KILN_PTXAS"] = "none"  # stop at PTX: the checks must not depend on ptxas
os.environ["KILN_NO_CACHE"] = "1"

import kiln  # noqa: E402
from kiln import layout, tiles  # noqa: E402


def run(name, fn):
    print(f"TEST: {name}")
    fn()


def gemm():
    path = Path(__file__).resolve().parents[3] / "examples" / "mma_sync_gemm.py"
    spec = importlib.util.spec_from_file_location("mma_sync_gemm", path)
    gemm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gemm)
    a, b, c = gemm.reference_inputs(100, 64, 64)
    ck = gemm.mma_sync_gemm.compile(a, b, c, 100, 64, BM=64, BN=64, BK=32, num_warps=4,
                                    target="sm_80")
    print(ck.asm["kiln"])
    print(ck.asm["ptx"])


# CHECK-LABEL: TEST: gemm
# CHECK: nvgpu.device_async_copy {{.*}} {bypassL1}
# CHECK: nvgpu.device_async_create_group
# CHECK: scf.for
# CHECK: nvgpu.device_async_wait {{.*}} {numGroups = 1 : i32}
# CHECK: nvgpu.ldmatrix {{.*}} {numTiles = 4 : i32, transpose = false}
# CHECK: nvgpu.ldmatrix {{.*}} {numTiles = 2 : i32, transpose = true}
# CHECK: nvvm.mma.sync
# CHECK-SAME: multiplicandAPtxType = #nvvm.mma_type<bf16>
# CHECK-SAME: shape = #nvvm.shape<m = 16, n = 8, k = 16>
# CHECK: cp.async.cg.shared.global
# CHECK: cp.async.commit_group
# CHECK: cp.async.wait_group 1
# CHECK: ldmatrix.sync.aligned.m8n8.x4.shared.b16
# CHECK: ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16
# CHECK: mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32
run("gemm", gemm)


@kiln.kernel
def row_softmax(out: kiln.Tensor[kiln.bf16]):
    s = tiles.RegTile.full(layout.mma_m16n8_accumulator(), (1, 2), 0.5)
    s = s * kiln.cast(kiln.lane_id(), kiln.f32)
    p = (s - s.row_max()).exp2()
    out.store(kiln.lane_id() * 4, p.cast(kiln.bf16).fragment(0, 1))


def reduction():
    ck = row_softmax.compile(np.zeros(128, kiln.bf16.numpy), target="sm_80")
    print(ck.asm["kiln"])
    print(ck.asm["ptx"])


# CHECK-LABEL: TEST: reduction
# CHECK: gpu.shuffle xor {{.*}}, %c1_i32, %c32_i32{{.*}} : f32
# CHECK: gpu.shuffle xor {{.*}}, %c2_i32, %c32_i32{{.*}} : f32
# CHECK: math.exp2 {{.*}} : vector<4xf32>
# CHECK: arith.truncf {{.*}} : vector<8xf32> to vector<8xbf16>
# CHECK: shfl.sync.bfly.b32 {{.*}}, 1, 31, -1;
# CHECK: shfl.sync.bfly.b32 {{.*}}, 2, 31, -1;
run("reduction", reduction)
