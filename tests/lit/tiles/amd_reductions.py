# RUN: %python %s | FileCheck %s
# RegTile reductions on gfx950: the XOR shuffles become DPP quad_perm (masks 1, 2), ds_swizzle
# (masks 4..16, bit mode) and, for mask 32, gpu.shuffle (v_permlane32_swap on gfx950).

import os

import numpy as np

os.environ["KILN_NO_CACHE"] = "1"

import kiln  # noqa: E402
from kiln import layout, tiles  # noqa: E402


@kiln.kernel
def reductions(out: kiln.Tensor[kiln.f32]):
    s = tiles.RegTile.full(layout.mfma_32x32_accumulator(), (1, 1), 1.0)
    s = s * kiln.cast(kiln.lane_id(), kiln.f32)
    rows = s.row_max()      # lanes sharing a row differ in lane bits 0..4
    cols = s.col_sum()      # lanes sharing a column differ in lane bit 5
    out[kiln.lane_id()] = rows.values[0][0] + cols.values[0][0]


ck = reductions.compile(np.zeros(64, np.float32), target="gfx950")
print(ck.asm["gpu"])
print(ck.asm["amdgcn"])

# CHECK: amdgpu.dpp {{.*}} quad_perm([1 : i32, 0 : i32, 3 : i32, 2 : i32])
# CHECK: amdgpu.dpp {{.*}} quad_perm([2 : i32, 3 : i32, 0 : i32, 1 : i32])
# CHECK: rocdl.ds_swizzle {{.*}} : (i32, i32) -> i32
# CHECK: gpu.shuffle  xor {{.*}}, %c32_i32, %c64_i32 : f32
# CHECK: v_mov_b32_dpp {{.*}} quad_perm:[1,0,3,2]
# CHECK: v_mov_b32_dpp {{.*}} quad_perm:[2,3,0,1]
# CHECK-DAG: ds_swizzle_b32 {{.*}} offset:swizzle(SWAP,4)
# CHECK-DAG: ds_swizzle_b32 {{.*}} offset:swizzle(SWAP,8)
# CHECK-DAG: ds_swizzle_b32 {{.*}} offset:swizzle(SWAP,16)
# CHECK-DAG: v_permlane32_swap_b32
