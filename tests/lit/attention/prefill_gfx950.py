# RUN: %python %s | FileCheck %s
# The gfx950 prefill's cluster structure on the traced IR (head_dim 64, causal): the recipes of
# C0-C7, the prologue P0-P3 (c8-c11) and the epilogue E0-E12 (c12-c24); the prologue DMAs K0 K1
# V0, QKs tile 0, DMAs K2 and takes tile 0's exps, DMAs V1; one scf.for holding C0 QK (MFMAs only),
# C1 DMA K + transposed V reads + the boundary-tile mask behind an scf.if + the vote, C2 PV strips
# of 2 MFMAs each followed by one strip's exp2, C3 DMA V + K reads, and C4-C7 the same again;
# then the 13 epilogue clusters.

import os

os.environ["KILN_NO_CACHE"] = "1"

from kiln.kernels.attention.prefill_gfx950 import (PrefillGfx950Config,  # noqa: E402
                                                   _placeholders, make_kernel)

config = PrefillGfx950Config(head_dim=64, causal=True)
traced = make_kernel(config).trace(*_placeholders(config), target="gfx950", num_warps=8)
print(traced.module_asm)

# CHECK-LABEL: gpu.func @prefill_gfx950
# CHECK-SAME: kiln.cluster_recipes = {c0 = "mfma=8; barrier; setprio=1", c1 = "dma=1 ds_read=16; barrier", c10 = "dma=1 trans=32; barrier", c11 = "dma=1 ds_read=8; barrier", c12 = "mfma=8; barrier; setprio=1", c13 = "dma=1 ds_read=16; barrier", c14 = "mfma=8 trans=32; interleave mfma=2 trans=8; barrier; setprio=1", c15 = "dma=1 ds_read=8; barrier", c16 = "mfma=8; barrier; setprio=1", c17 = "ds_read=16; barrier", c18 = "mfma=8 trans=32; interleave mfma=2 trans=8; barrier; setprio=1", c19 = "dma=1 ds_read=8; barrier", c2 = "mfma=8 trans=32; interleave mfma=2 trans=8; barrier; setprio=1", c20 = "mfma=8; barrier; setprio=1", c21 = "ds_read=16; barrier", c22 = "mfma=8 trans=32; interleave mfma=2 trans=8; barrier; setprio=1", c23 = "ds_read=16; barrier", c24 = "mfma=8; barrier; setprio=1", c3 = "dma=1 ds_read=8; barrier", c4 = "mfma=8; barrier; setprio=1", c5 = "dma=1 ds_read=16; barrier", c6 = "mfma=8 trans=32; interleave mfma=2 trans=8; barrier; setprio=1", c7 = "dma=1 ds_read=8; barrier", c8 = "dma=3; barrier", c9 = "ds_read=8 mfma=8; barrier; setprio=1"}
# CHECK-COUNT-3: amdgpu.gather_to_lds {{.*}}kiln.cluster = 8
# CHECK-COUNT-8: amdgpu.mfma {{.*}}kiln.cluster = 9
# CHECK: amdgpu.gather_to_lds {{.*}}kiln.cluster = 10
# CHECK: math.exp2 {{.*}}kiln.cluster = 10
# CHECK: amdgpu.gather_to_lds {{.*}}kiln.cluster = 11
# CHECK: scf.for
# CHECK-COUNT-8: amdgpu.mfma {{.*}}kiln.cluster = 0
# CHECK: amdgpu.gather_to_lds {{.*}}kiln.cluster = 1
# CHECK-COUNT-16: amdgpu.transpose_load {{.*}}kiln.cluster = 1
# CHECK: scf.if
# CHECK: scf.yield {{.*}}kiln.cluster = 1
# CHECK: amdgpu.mfma {{.*}}kiln.cluster = 2
# CHECK: amdgpu.mfma {{.*}}kiln.cluster = 2
# CHECK: math.exp2 {{.*}}kiln.cluster = 2
# CHECK: amdgpu.mfma {{.*}}kiln.cluster = 2
# CHECK: amdgpu.mfma {{.*}}kiln.cluster = 2
# CHECK: math.exp2 {{.*}}kiln.cluster = 2
# CHECK: amdgpu.mfma {{.*}}kiln.cluster = 2
# CHECK: amdgpu.mfma {{.*}}kiln.cluster = 2
# CHECK: math.exp2 {{.*}}kiln.cluster = 2
# CHECK: amdgpu.mfma {{.*}}kiln.cluster = 2
# CHECK: amdgpu.mfma {{.*}}kiln.cluster = 2
# CHECK: math.exp2 {{.*}}kiln.cluster = 2
# CHECK: amdgpu.gather_to_lds {{.*}}kiln.cluster = 3
# CHECK-COUNT-8: amdgpu.mfma {{.*}}kiln.cluster = 4
# CHECK: amdgpu.gather_to_lds {{.*}}kiln.cluster = 5
# CHECK: scf.if
# CHECK: scf.yield {{.*}}kiln.cluster = 5
# CHECK: amdgpu.mfma {{.*}}kiln.cluster = 6
# CHECK: amdgpu.gather_to_lds {{.*}}kiln.cluster = 7
# CHECK: scf.yield
# CHECK-NEXT: }
# CHECK-NOT: scf.for
# CHECK: amdgpu.mfma {{.*}}kiln.cluster = 12
# CHECK: amdgpu.mfma {{.*}}kiln.cluster = 24
