# RUN: %python %s | FileCheck %s
# kiln.ldmatrix.stmatrix (declared in kiln.nvidia.ldmatrix): one inline PTX stmatrix per call,
# carrying its declaration (kiln.op) and parameters (kiln.op_args) in Kiln IR, then the PTX
# instruction with the lane's row address and its packed b32 registers.

import os

os.environ["KILN_PTXAS"] = "none"  # stop at PTX: the checks must not depend on ptxas
os.environ["KILN_NO_CACHE"] = "1"

import numpy as np  # noqa: E402

import kiln  # noqa: E402
import kiln.ldmatrix as ldm  # noqa: E402
import kiln.tiles as tiles  # noqa: E402


@kiln.kernel(num_threads=32)
def store_fragments(inp: kiln.Tensor[kiln.bf16, 1], out: kiln.Tensor[kiln.bf16, 1]):
    tile = tiles.SharedTile((16, 16), kiln.bf16)
    lane = kiln.lane_id()
    frag = kiln.pack([inp[8 * lane + i] for i in range(8)])
    ldm.stmatrix(tile, (0, 0), [(0, 0), (8, 0), (0, 8), (8, 8)], frag)
    ldm.stmatrix(tile, (0, 0), [(0, 0), (8, 0)], kiln.vector_slice(frag, 0, 4), trans=True)
    kiln.barrier()
    out[lane] = tile.load(lane // 16, lane % 16)


x = np.zeros(256, kiln.bf16.numpy)
compiled = store_fragments.compile(x, x, target="sm_90a")
for stage in ("kiln", "ptx"):
    print(f"// STAGE {stage}")
    print(compiled.asm[stage])

# CHECK-LABEL: // STAGE kiln
# CHECK: llvm.inline_asm has_side_effects {kiln.op = "nvidia.ldmatrix.stmatrix", kiln.op_args = {num = 4 : i64, trans = 0 : i64}} "stmatrix.sync.aligned.m8n8.x4.shared.b16 [$0], {$1, $2, $3, $4};", "l,r,r,r,r"
# CHECK: llvm.inline_asm has_side_effects {kiln.op = "nvidia.ldmatrix.stmatrix", kiln.op_args = {num = 2 : i64, trans = 1 : i64}} "stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [$0], {$1, $2};", "l,r,r"

# CHECK-LABEL: // STAGE ptx
# CHECK: stmatrix.sync.aligned.m8n8.x4.shared.b16 [{{%rd[0-9]+}}], {{{%r[0-9]+}}, {{%r[0-9]+}}, {{%r[0-9]+}}, {{%r[0-9]+}}};
# CHECK: stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [{{%rd[0-9]+}}], {{{%r[0-9]+}}, {{%r[0-9]+}}};
