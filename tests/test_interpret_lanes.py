"""Interpreter semantics of lane exchanges and private memory that the DSL's wrappers do not
all emit today: ``gpu.shuffle`` over segments narrower than a warp, every ``amdgpu.dpp`` mode,
``ds_swizzle`` quad-permute mode and ``memref.alloca`` — each checked against a numpy model of
the ISA's definition on random data, through hand-written kernels."""

import numpy as np
import pytest

from kiln.kernel import TracedKernel
from kiln.interpreter import interpret_kernel
from kiln.interpreter.ops_amd import dpp_source_lanes
from kiln.signature import KernelSignature, TensorParam

MEMREF = "memref<?xf32, strided<[1], offset: ?>, 1>"


def run_lane_kernel(body: str, target: str, lanes: int, name: str = "k"):
    """Run ``body`` (MLIR reading ``%v`` = x[tid], leaving ``%r``, stored to y[tid])."""
    asm = f"""
module attributes {{gpu.container_module}} {{
  gpu.module @kiln_kernels {{
    gpu.func @{name}(%x: {MEMREF}, %y: {MEMREF}) kernel {{
      %tid = gpu.thread_id x
      %v = memref.load %x[%tid] : {MEMREF}
{body}
      memref.store %r, %y[%tid] : {MEMREF}
      gpu.return
    }}
  }}
}}
"""
    sig = KernelSignature(name, (TensorParam("x", "f32", 1), TensorParam("y", "f32", 1)),
                          block=(lanes, 1, 1))
    x = np.random.default_rng().standard_normal(lanes).astype(np.float32)
    y = np.full(lanes, np.nan, np.float32)
    interpret_kernel(TracedKernel(name, asm, sig, 0), 1, [x, y], target)
    return x, y


@pytest.mark.parametrize("mode", ["xor", "down", "up", "idx"])
@pytest.mark.parametrize("width", [4, 16])
def test_shuffle_narrower_than_a_warp_stays_in_its_segment(mode, width):
    offset = 3 if mode != "xor" else 2
    x, y = run_lane_kernel(f"""
      %off = arith.constant {offset} : i32
      %w = arith.constant {width} : i32
      %r, %ok = gpu.shuffle {mode} %v, %off, %w : f32""", "sm_90a", 64)
    lane = np.arange(64) % 32
    segment = lane - lane % width
    src = {"xor": lane ^ offset, "down": lane + offset, "up": lane - offset,
           "idx": segment + offset}[mode]
    valid = (src >= segment) & (src < segment + width)
    expected = x[np.where(valid, np.arange(64) - lane + src, np.arange(64))]
    np.testing.assert_array_equal(y, expected)


DPP_CASES = [("row_shl", "1 : i32"), ("row_shr", "3 : i32"), ("row_ror", "5 : i32"),
             ("row_mirror", None), ("row_half_mirror", None), ("wave_shl", None),
             ("wave_ror", None), ("row_bcast_15", None), ("row_bcast_31", None)]


@pytest.mark.parametrize("kind,argument", DPP_CASES)
@pytest.mark.parametrize("bound_ctrl", [False, True])
def test_dpp_modes_follow_the_isa(kind, argument, bound_ctrl):
    arg = f"({argument})" if argument else ""
    masks = f"row_mask = 0xd : i32, bank_mask = 0xb : i32, bound_ctrl = {str(bound_ctrl).lower()}"
    x, y = run_lane_kernel(f"""
      %old = arith.constant 7.5 : f32
      %r = amdgpu.dpp %old %v {kind}{arg} {{{masks}}} : f32""", "gfx950", 64)
    lane = np.arange(64)
    src = dpp_source_lanes(kind, int(argument.split()[0]) if argument else None, lane, 64)
    picked = np.where(src >= 0, x[np.maximum(src, 0)], 0.0 if bound_ctrl else 7.5)
    row_on, bank_on = (0xD >> (lane // 16)) & 1, (0xB >> (lane % 16 // 4)) & 1
    enabled = (row_on & bank_on).astype(bool)
    np.testing.assert_array_equal(y, np.where(enabled, picked, 7.5).astype(np.float32))


def test_dpp_source_lane_models():
    lane = np.arange(64)
    assert list(dpp_source_lanes("row_shr", 1, lane, 64)[:4]) == [-1, 0, 1, 2]
    assert list(dpp_source_lanes("row_ror", 1, lane, 64)[:2]) == [15, 0]
    assert list(dpp_source_lanes("wave_shl", None, lane, 64)[62:]) == [63, -1]
    assert list(dpp_source_lanes("row_bcast_15", None, lane, 64)[[0, 16, 47]]) == [-1, 15, 31]
    assert list(dpp_source_lanes("row_bcast_31", None, lane, 64)[[16, 32, 63]]) == [-1, 31, 31]


def test_ds_swizzle_quad_permute_mode():
    perm = [2, 0, 3, 1]
    pattern = 0x8000 | sum(p << (2 * i) for i, p in enumerate(perm))
    x, y = run_lane_kernel(f"""
      %bits = arith.bitcast %v : f32 to i32
      %pattern = arith.constant {pattern} : i32
      %s = rocdl.ds_swizzle %bits, %pattern : (i32, i32) -> i32
      %r = arith.bitcast %s : i32 to f32""", "gfx950", 64)
    lane = np.arange(64)
    np.testing.assert_array_equal(y, x[lane - lane % 4 + np.asarray(perm)[lane % 4]])


def test_alloca_is_private_per_thread():
    """Each thread fills its own 4-element array with v * j, then reads it back reversed."""
    x, y = run_lane_kernel("""
      %arr = memref.alloca() : memref<4xf32>
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %c3 = arith.constant 3 : index
      %c4 = arith.constant 4 : index
      scf.for %j = %c0 to %c4 step %c1 {
        %ji = arith.index_cast %j : index to i32
        %jf = arith.sitofp %ji : i32 to f32
        %w = arith.mulf %v, %jf : f32
        memref.store %w, %arr[%j] : memref<4xf32>
      }
      %a = memref.load %arr[%c3] : memref<4xf32>
      %b = memref.load %arr[%c1] : memref<4xf32>
      %r = arith.subf %a, %b : f32""", "sm_90a", 96)
    np.testing.assert_allclose(y, x * 3 - x * 1, rtol=1e-6)
