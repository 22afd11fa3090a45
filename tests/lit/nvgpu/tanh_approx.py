# RUN: %python %s | FileCheck %s
# kiln.tanh_approx through the sm_90a stages: one inline PTX op carrying its declaration
# (no side effects), then one tanh.approx.f32 per element of a vector<2xf32>.

import os

os.environ["KILN_PTXAS"] = "none"  # stop at PTX: the checks must not depend on ptxas
os.environ["KILN_NO_CACHE"] = "1"

import numpy as np  # noqa: E402

import kiln  # noqa: E402


@kiln.kernel
def capped(x: kiln.Tensor[kiln.f32, 1], out: kiln.Tensor[kiln.f32, 1]):
    lane = kiln.thread_id(0)
    a, b = kiln.unpack(kiln.tanh_approx(kiln.pack([x[lane], x[lane + 128]])))
    out[lane] = 30.0 * a
    out[lane + 128] = 30.0 * b


x = np.zeros(256, np.float32)
compiled = capped.compile(x, x, target="sm_90a", num_warps=4)
for stage in ("nvvm", "ptx"):
    print(f"// STAGE {stage}")
    print(compiled.asm[stage])

# CHECK-LABEL: // STAGE nvvm
# CHECK: llvm.inline_asm {kiln.op = "nvidia.fastmath.tanh_approx"} "tanh.approx.f32 $0, $1;", "=f,f" {{.*}} : (f32) -> f32
# CHECK: llvm.inline_asm {kiln.op = "nvidia.fastmath.tanh_approx"} "tanh.approx.f32 $0, $1;", "=f,f" {{.*}} : (f32) -> f32

# CHECK-LABEL: // STAGE ptx
# CHECK: tanh.approx.f32 {{%[rf][0-9]+}}, {{%[rf][0-9]+}};
# CHECK: tanh.approx.f32 {{%[rf][0-9]+}}, {{%[rf][0-9]+}};
# CHECK-NOT: tanh.approx
