# RUN: %python %s | FileCheck %s
# TiledMmaLoader's LDS reads in Kiln IR and gfx950 ISA, with the immediate offset folded.
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "Inputs"))
from amd_lit import arrays, case, show  # noqa: E402

import kiln  # noqa: E402
from kiln.amd.loader import TiledMmaLoader  # noqa: E402
from kiln.swizzle import Swizzle  # noqa: E402


def compile_load(dtype, shape, load):
    @kiln.kernel
    def loads(x: kiln.Tensor[dtype], out: kiln.Tensor[dtype]):
        tile = kiln.shared(shape, dtype)
        tile.store(kiln.thread_id(0), 0, x.load(kiln.thread_id(0), width=8))
        kiln.barrier()
        frag = load(tile)
        out.store(kiln.lane_id() * frag.shape[0], frag)

    compiled = loads.compile(*arrays((dtype, 1), (dtype, 1)), target="gfx950", num_warps=1)
    show(compiled, kiln_ops=("amdgpu.transpose_load", "vector.load %", "vector.shuffle"),
         isa=(r"ds_read",))


# One ds_read_b128 per bf16 fragment; the swizzle is address arithmetic before it.
# CHECK-LABEL: TEST: load_b_bf16_32x32x16
# CHECK: KILN: {{.*}} = vector.load {{.*}} : memref<4096xbf16, 3>, vector<8xbf16>
# CHECK: ISA: ds_read_b128 v[{{[0-9:]+}}], v{{[0-9]+}} offset:512
@case
def load_b_bf16_32x32x16():
    loader = TiledMmaLoader(kiln.bf16, (32, 32, 16), swizzle=Swizzle(3, 3, 3))
    compile_load(kiln.bf16, (64, 64), lambda t: loader.load_b(t, imm_offset_bytes=512)[0])


# fp8 32-byte fragments: two 16-byte halves, joined.
# CHECK-LABEL: TEST: load_b_fp8_16x16x128
# CHECK-COUNT-2: KILN: {{.*}} = vector.load {{.*}} vector<16xf8E4M3FN>
# CHECK: KILN: {{.*}} = vector.shuffle {{.*}} : vector<16xf8E4M3FN>, vector<16xf8E4M3FN>
# CHECK-COUNT-2: ISA: ds_read_b128
@case
def load_b_fp8_16x16x128():
    loader = TiledMmaLoader(kiln.f8e4m3, (16, 16, 128))
    compile_load(kiln.f8e4m3, (64, 128), lambda t: loader.load_b(t)[0])


# CHECK-LABEL: TEST: load_b_tr_bf16_32x32x16
# CHECK-COUNT-2: KILN: {{.*}} = amdgpu.transpose_load {{.*}} {kiln.async = "lgkmcnt", kiln.token = {{[0-9]+}} : i64} : memref<4096xbf16, 3> -> vector<4xbf16>
# CHECK: KILN: {{.*}} = vector.shuffle {{.*}} : vector<4xbf16>, vector<4xbf16>
# CHECK: ISA: ds_read_b64_tr_b16 v[{{[0-9:]+}}], v{{[0-9]+}} offset:128
# CHECK: ISA: ds_read_b64_tr_b16 v[{{[0-9:]+}}], v{{[0-9]+}} offset:640
@case
def load_b_tr_bf16_32x32x16():
    loader = TiledMmaLoader(kiln.bf16, (32, 32, 16))
    compile_load(kiln.bf16, (64, 64), lambda t: loader.load_b_tr(t, imm_offset_bytes=128))


# Four 8x8 byte transposes give each lane 32 consecutive keys.
# CHECK-LABEL: TEST: load_v_fp8_strip
# CHECK-COUNT-4: KILN: {{.*}} = amdgpu.transpose_load {{.*}} -> vector<8xf8E4M3FN>
# CHECK-COUNT-4: ISA: ds_read_b64_tr_b8
@case
def load_v_fp8_strip():
    loader = TiledMmaLoader(kiln.f8e4m3, (16, 16, 128))
    compile_load(kiln.f8e4m3, (128, 64), lambda t: loader.load_v_fp8_strip(t, depth0=16))
