# RUN: %python %s | FileCheck %s
# Global -> LDS DMA with async tokens, buffer views, waits, barriers and priorities on gfx950.
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "Inputs"))
from amd_lit import arrays, case, show  # noqa: E402

import kiln  # noqa: E402
from kiln import amd_asm, amd_buffer  # noqa: E402


# CHECK-LABEL: TEST: dma_wait_barrier_setprio
# CHECK: KILN: {{.*}} = amdgpu.fat_raw_buffer_cast
# CHECK: KILN: amdgpu.gather_to_lds {{.*}} {kiln.async = "vmcnt", kiln.token = 0 : i64} : vector<8xbf16>, memref<?x?xbf16, strided<[?, 1]>, #amdgpu.address_space<fat_raw_buffer>>
# CHECK: KILN: amdgpu.gather_to_lds {{.*}} {kiln.async = "vmcnt", kiln.token = 1 : i64} : vector<2xbf16>, memref<?x?xbf16, strided<[?, 1], offset: ?>, 1>
# CHECK: KILN: rocdl.s.waitcnt {kiln.waits_for = [0, 1]} 3952
# CHECK: KILN: rocdl.s.barrier
# CHECK: KILN: rocdl.s.setprio 1
# CHECK: ISA: buffer_load_dwordx4 v{{[0-9]+}}, s[{{[0-9:]+}}], 0 offen lds
# CHECK: ISA: global_load_lds_dword v[{{[0-9:]+}}], off
# CHECK: ISA: s_waitcnt vmcnt(0)
# CHECK-NEXT: ISA: s_barrier
# CHECK-NEXT: ISA: s_setprio 1
@case
def dma_wait_barrier_setprio():
    @kiln.kernel
    def dma(src: kiln.Tensor[kiln.bf16, 2], out: kiln.Tensor[kiln.bf16, 2]):
        tile = kiln.shared((64, 64), kiln.bf16)
        lane = kiln.lane_id()
        view = amd_buffer.buffer(src)
        wide = amd_buffer.copy_to_lds(view, (lane // 8, (lane % 8) * 8), tile, (0, 0), width=8)
        narrow = amd_buffer.copy_to_lds(src, (lane, 0), tile, (8, 0), width=2)
        amd_asm.s_waitcnt(vmcnt=0, waits_for=[wide, narrow])
        amd_asm.s_barrier()
        amd_asm.s_setprio(1)
        out.store(lane, 0, tile.load(lane, 0, width=8))

    compiled = dma.compile(*arrays(("bf16", 2), ("bf16", 2)), target="gfx950", num_warps=2)
    show(compiled, kiln_ops=("amdgpu.", "rocdl."),
         isa=(r" lds$", r"global_load_lds", r"s_waitcnt vmcnt", r"s_barrier", r"s_setprio"))
