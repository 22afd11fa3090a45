# RUN: %python %s | FileCheck %s
# Each MFMA atom as amdgpu.mfma in Kiln IR and as its instruction in the final ISA.
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "Inputs"))
from amd_lit import arrays, case, show  # noqa: E402

import kiln  # noqa: E402
from kiln import mma  # noqa: E402
import kiln.mfma  # noqa: E402,F401  (registers the atoms)


def one_mfma(m, n, k, a_dt, b_dt, chip):
    spec = mma.atom(m, n, k, a_dt, b_dtype=b_dt, target=chip).spec
    kpl, acc_n = spec.a_layout.num_values, spec.c_layout.num_values

    @kiln.kernel
    def mfma_kernel(a: kiln.Tensor[a_dt], b: kiln.Tensor[b_dt], c: kiln.Tensor[kiln.f32]):
        lane = kiln.lane_id()
        atom = mma.atom(m, n, k, a_dt, b_dtype=b_dt)
        c.store(lane * acc_n, atom(a.load(lane * kpl, width=kpl), b.load(lane * kpl, width=kpl),
                                   c.load(lane * acc_n, width=acc_n)))

    compiled = mfma_kernel.compile(*arrays((a_dt, 1), (b_dt, 1), ("f32", 1)), target=chip,
                                   num_warps=1)
    show(compiled, kiln_ops=("amdgpu.mfma",), isa=(r"v_mfma",))


# CHECK-LABEL: TEST: gfx950_bf16_32x32x16
# CHECK: KILN: {{.*}} = amdgpu.mfma 32x32x16 {{.*}} : vector<8xbf16>, vector<8xbf16>, vector<16xf32>
# CHECK: ISA: v_mfma_f32_32x32x16_bf16 v[{{[0-9]+}}:{{[0-9]+}}]
# CHECK: SCRATCH: 0
@case
def gfx950_bf16_32x32x16():
    one_mfma(32, 32, 16, kiln.bf16, kiln.bf16, "gfx950")


# CHECK-LABEL: TEST: gfx950_f16_16x16x32
# CHECK: KILN: {{.*}} = amdgpu.mfma 16x16x32 {{.*}} : vector<8xf16>, vector<8xf16>, vector<4xf32>
# CHECK: ISA: v_mfma_f32_16x16x32_f16
@case
def gfx950_f16_16x16x32():
    one_mfma(16, 16, 32, kiln.f16, kiln.f16, "gfx950")


# CHECK-LABEL: TEST: gfx950_fp8_16x16x128
# CHECK: KILN: {{.*}} = amdgpu.mfma 16x16x128 {{.*}} : vector<32xf8E4M3FN>, vector<32xf8E4M3FN>, vector<4xf32>
# CHECK: ISA: v_mfma_f32_16x16x128_f8f6f4
# CHECK-NOT: cbsz
@case
def gfx950_fp8_16x16x128():
    one_mfma(16, 16, 128, kiln.f8e4m3, kiln.f8e4m3, "gfx950")


# The operands' fp8 formats are encoded in cbsz (A) and blgp (B): 1 = bf8 (e5m2).
# CHECK-LABEL: TEST: gfx950_fp8_32x32x64_mixed
# CHECK: KILN: {{.*}} = amdgpu.mfma 32x32x64 {{.*}} : vector<32xf8E5M2>, vector<32xf8E4M3FN>, vector<16xf32>
# CHECK: ISA: v_mfma_f32_32x32x64_f8f6f4 {{.*}} cbsz:1
# CHECK-NOT: blgp
@case
def gfx950_fp8_32x32x64_mixed():
    one_mfma(32, 32, 64, kiln.f8e5m2, kiln.f8e4m3, "gfx950")


# CHECK-LABEL: TEST: gfx942_bf16_32x32x8
# CHECK: KILN: {{.*}} = amdgpu.mfma 32x32x8 {{.*}} : vector<4xbf16>, vector<4xbf16>, vector<16xf32>
# CHECK: ISA: v_mfma_f32_32x32x8_bf16
@case
def gfx942_bf16_32x32x8():
    one_mfma(32, 32, 8, kiln.bf16, kiln.bf16, "gfx942")


# CHECK-LABEL: TEST: gfx942_f16_16x16x16
# CHECK: ISA: v_mfma_f32_16x16x16_f16
@case
def gfx942_f16_16x16x16():
    one_mfma(16, 16, 16, kiln.f16, kiln.f16, "gfx942")
