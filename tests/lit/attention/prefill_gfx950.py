# RUN: %python %s | FileCheck %s
# The gfx950 prefill's cluster structure on the traced IR: recipes of C0-C7 and the prologue /
# epilogue clusters on the kernel, then in the main loop C0 QK (MFMAs), C1 DMA K + transposed V
# reads + lazy-rescale vote, C2 PV, C3 DMA V + K reads, and again C4-C7 for the second tile.

import os

import numpy as np

os.environ["KILN_NO_CACHE"] = "1"

from kiln.kernels.attention.prefill_gfx950 import (PrefillGfx950Config,  # noqa: E402
                                                   _placeholders, make_kernel)

config = PrefillGfx950Config(head_dim=64, causal=True)
traced = make_kernel(config).trace(*_placeholders(config), target="gfx950", num_warps=8)
print(traced.module_asm)

# CHECK-LABEL: gpu.func @prefill_gfx950
# CHECK-SAME: kiln.cluster_recipes = {c0 = "mfma=8; barrier; setprio=1", c1 = "dma=1 ds_read=16; barrier", c10 = "empty; barrier", c2 = "mfma=8; barrier; setprio=1", c3 = "dma=1 ds_read=8; barrier", c4 = "mfma=8; barrier; setprio=1", c5 = "dma=1 ds_read=16; barrier", c6 = "mfma=8; barrier; setprio=1", c7 = "dma=1 ds_read=8; barrier", c8 = "empty; barrier", c9 = "empty; barrier"}
# CHECK: amdgpu.gather_to_lds {{.*}}kiln.cluster = 8
# CHECK: scf.for
# CHECK: amdgpu.mfma {{.*}}kiln.cluster = 0
# CHECK: amdgpu.gather_to_lds {{.*}}kiln.cluster = 1
# CHECK: amdgpu.transpose_load {{.*}}kiln.cluster = 1
# CHECK: scf.if {{.*}}
# CHECK: amdgpu.mfma {{.*}}kiln.cluster = 2
# CHECK: amdgpu.gather_to_lds {{.*}}kiln.cluster = 3
# CHECK: amdgpu.mfma {{.*}}kiln.cluster = 4
# CHECK: amdgpu.mfma {{.*}}kiln.cluster = 6
# CHECK: amdgpu.gather_to_lds {{.*}}kiln.cluster = 7
# CHECK: scf.yield
