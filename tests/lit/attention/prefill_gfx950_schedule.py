# RUN: %python %s | FileCheck %s
# The gfx950 prefill's cluster structure in the final assembly (head_dim 64, causal): the
# prologue P0-P3 (clusters 8-11), one main loop holding exactly C0-C7 in order, then the
# 13-cluster epilogue E0-E12 (clusters 12-24). Every cluster ends in s_barrier; the MFMA clusters
# run at s_setprio 1; the PV clusters interleave their 8 MFMAs with the 32 exp2 of the next
# tile's scores, 2 MFMAs then 8 v_exp_f32 per strip; in the loop the mask runs behind a scalar
# branch in C1/C5 (interior tiles skip it), the only branches of the loop's clusters; no scratch.
import re

from kiln.kernels.attention.prefill_gfx950 import compile_prefill_gfx950
from kiln.lowering.isa_amdgpu import class_counts, cluster_instances, parse

asm = compile_prefill_gfx950(head_dim=64, causal=True).asm["amdgcn"]
program = parse(asm, "prefill_gfx950")


def reaches(source, target):
    seen, stack = set(), list(program.blocks[source][2])
    while stack:
        n = stack.pop()
        if n == target:
            return True
        if n not in seen:
            seen.add(n)
            stack += program.blocks[n][2]
    return False


in_loop = {n for n in range(len(program.blocks)) if reaches(n, n)}
loop_start = min(program.blocks[n][0] for n in in_loop)


def block_of(position):
    return max(n for n, (start, _, _) in enumerate(program.blocks) if start <= position)


def describe(marker, instrs):
    counts = class_counts(instrs)
    mnemonics = [i.mnemonic for i in instrs]
    order = "".join({"mfma": "M", "trans": "e"}.get(i.work_class(), "") for i in instrs)
    prios = [i.text.strip() for i in instrs if i.mnemonic == "s_setprio"]
    return (f"c{marker.cluster} mfma={counts.get('mfma', 0)} dma={counts.get('dma', 0)} "
            f"ds_read={counts.get('ds_read', 0)} setprio={','.join(prios) or '-'} "
            f"branch={sum(m.startswith('s_cbranch') for m in mnemonics)} "
            f"barrier_last={[m for m in mnemonics if m != 's_nop'][-1] == 's_barrier'} {order}")


instances = cluster_instances(program)
loop = [(m, i) for m, i in instances if block_of(m.position) in in_loop]
print("LOOP BLOCKS", len(in_loop) > 0)
for marker, instrs in instances:
    if marker.position < loop_start:
        print("prologue", describe(marker, instrs))
for marker, instrs in sorted(loop, key=lambda pair: pair[0].cluster):
    print("loop", describe(marker, instrs))
for marker, instrs in instances:
    if marker.position > loop_start and (marker, instrs) not in loop:
        print("epilogue", describe(marker, instrs))
print("\n".join(re.findall(r"\.amdhsa_private_segment_fixed_size \d+", asm)))

# CHECK: LOOP BLOCKS True
# CHECK-NEXT: prologue c8 mfma=0 dma=3 ds_read=0 setprio=- branch=0 barrier_last=True
# CHECK-NEXT: prologue c9 mfma=8 dma=0 ds_read=8 setprio=1,0 branch=0 barrier_last=True MMMMMMMM{{$}}
# CHECK-NEXT: prologue c10 mfma=0 dma=1 ds_read=0 setprio=- branch=0 barrier_last=True eeeeeeeeeeeeeeeeeeeeeeeeeeeeeeee{{$}}
# CHECK-NEXT: prologue c11 mfma=0 dma=1 ds_read=8 setprio=- branch=0 barrier_last=True
# CHECK-NEXT: loop c0 mfma=8 dma=0 ds_read=0 setprio=1,0 branch=0 barrier_last=True MMMMMMMM{{$}}
# CHECK-NEXT: loop c1 mfma=0 dma=1 ds_read=16 setprio=- branch={{[1-9]}} barrier_last=True
# CHECK-NEXT: loop c2 mfma=8 dma=0 ds_read=0 setprio=1,0 branch=0 barrier_last=True MMeeeeeeeeMMeeeeeeeeMMeeeeeeeeMMeeeeeeee{{$}}
# CHECK-NEXT: loop c3 mfma=0 dma=1 ds_read=8 setprio=- branch=0 barrier_last=True
# CHECK-NEXT: loop c4 mfma=8 dma=0 ds_read=0 setprio=1,0 branch=0 barrier_last=True MMMMMMMM{{$}}
# CHECK-NEXT: loop c5 mfma=0 dma=1 ds_read=16 setprio=- branch={{[1-9]}} barrier_last=True
# CHECK-NEXT: loop c6 mfma=8 dma=0 ds_read=0 setprio=1,0 branch=0 barrier_last=True MMeeeeeeeeMMeeeeeeeeMMeeeeeeeeMMeeeeeeee{{$}}
# CHECK-NEXT: loop c7 mfma=0 dma=1 ds_read=8 setprio=- branch=0 barrier_last=True
# CHECK-NEXT: epilogue c12 mfma=8 {{.*}} setprio=1,0 branch=0 barrier_last=True MMMMMMMM{{$}}
# CHECK-NEXT: epilogue c13 mfma=0 dma=1 ds_read=16 setprio=- branch=0 barrier_last=True
# CHECK-NEXT: epilogue c14 mfma=8 {{.*}} barrier_last=True MMeeeeeeeeMMeeeeeeeeMMeeeeeeeeMMeeeeeeee{{$}}
# CHECK-NEXT: epilogue c15 mfma=0 dma=1 ds_read=8 {{.*}} barrier_last=True
# CHECK-NEXT: epilogue c16 mfma=8 {{.*}} barrier_last=True MMMMMMMM{{$}}
# CHECK-NEXT: epilogue c17 mfma=0 dma=0 ds_read=16 {{.*}} barrier_last=True
# CHECK-NEXT: epilogue c18 mfma=8 {{.*}} barrier_last=True MMeeeeeeeeMMeeeeeeeeMMeeeeeeeeMMeeeeeeee{{$}}
# CHECK-NEXT: epilogue c19 mfma=0 dma=1 ds_read=8 {{.*}} barrier_last=True
# CHECK-NEXT: epilogue c20 mfma=8 {{.*}} barrier_last=True MMMMMMMM{{$}}
# CHECK-NEXT: epilogue c21 mfma=0 dma=0 ds_read=16 {{.*}} barrier_last=True
# CHECK-NEXT: epilogue c22 mfma=8 {{.*}} barrier_last=True MMeeeeeeeeMMeeeeeeeeMMeeeeeeeeMMeeeeeeee{{$}}
# CHECK-NEXT: epilogue c23 mfma=0 dma=0 ds_read=16 {{.*}} barrier_last=True
# CHECK-NEXT: epilogue c24 mfma=8 {{.*}} barrier_last=True
# CHECK-NEXT: .amdhsa_private_segment_fixed_size 0
