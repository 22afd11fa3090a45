# RUN: %python %s | FileCheck %s
# The gfx950 GEMM: 16 MFMAs per K step for the default 128x128x64 tile on 2x2 waves, no scratch.
import re

from kiln.kernels.gemm.gfx950 import GemmConfig, compile_gfx950

asm = compile_gfx950("bf16", config=GemmConfig()).asm["amdgcn"]
# .loc/.file are line-table directives between instructions, not code.
lines = [line for line in asm.splitlines() if not line.lstrip().startswith((".loc", ".file"))]
labels = {line[:-1]: n for n, line in enumerate(lines) if re.fullmatch(r"\.LBB\d+_\d+:", line)}
for n, line in enumerate(lines):  # print every loop: a label up to the branch back to it
    back = re.search(r"s_c?branch\w* (\.LBB\d+_\d+)$", line)
    if back and labels.get(back.group(1), n) < n:
        print("LOOP", back.group(1))
        print("\n".join(lines[labels[back.group(1)]:n + 1]))
        print("END LOOP")
print("AFTER")
print("\n".join(line for line in lines if "private_segment_fixed_size" in line or "v_mfma" in line
                or "s_endpgm" in line))

# One loop: global prefetch of the next K step into registers, barrier, 4 k-substeps of
# (2 A + 2 B) ds_read_b128 and 4 MFMAs at raised priority, then the prefetched step's LDS writes.
# CHECK: LOOP
# CHECK-COUNT-8: buffer_load_dwordx4
# CHECK: s_waitcnt lgkmcnt(0)
# CHECK-NEXT: s_barrier
# CHECK-COUNT-4: ds_read_b128
# CHECK: s_setprio 1
# CHECK-COUNT-16: v_mfma_f32_32x32x16_bf16
# CHECK: s_setprio 0
# CHECK-COUNT-8: ds_write_b128
# CHECK: END LOOP
# CHECK-NOT: LOOP
# Every MFMA of the kernel is one of those 16: none outside the loop.
# CHECK: AFTER
# CHECK-COUNT-16: v_mfma_f32_32x32x16_bf16
# CHECK-NOT: v_mfma
# CHECK: s_endpgm
# CHECK: .amdhsa_private_segment_fixed_size 0
# CHECK: .private_segment_fixed_size: 0
