"""kiln.copy global -> shared on gfx942/gfx950 as buffer -> LDS DMA (kiln.amd.tile_dma).

Interpreter runs on fresh random inputs with ragged rows and columns against numpy (masked
elements must read 0, NaN-poisoned outputs), the fallbacks to vector loads and stores, and the
gfx950/gfx942 assembly: the DMA instruction present, no scratch, a vmcnt wait before LDS reads."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import kiln
from kiln import bf16, f32, i32
from kiln.layout import blocked
from kiln.swizzle import Swizzle

from sample_kernels import two_stage_sum


def dma_copy(dtype):
    @kiln.kernel(num_threads="THREADS")
    def k(x: kiln.Tensor[dtype, 2], y: kiln.Tensor[dtype, 2], m: i32, n: i32,
          BM: kiln.constexpr, BN: kiln.constexpr, THREADS: kiln.constexpr,
          ALIGN: kiln.constexpr, MULTIPLE: kiln.constexpr, FILL: kiln.constexpr,
          SWIZZLE: kiln.constexpr):
        s = kiln.SharedTile((BM, BN), dtype,
                            swizzle=Swizzle.sw128b(dtype.itemsize) if SWIZZLE else None)
        r0, c0 = kiln.block_id(0) * BM, kiln.block_id(1) * BN
        kiln.copy(kiln.GlobalTile(x, (BM, BN), (r0, c0), row_end=m, col_end=n, align=ALIGN,
                                  col_multiple=MULTIPLE, fill=FILL), s)
        kiln.barrier()
        kiln.copy(kiln.load(s, blocked((BM, BN), THREADS)), kiln.GlobalTile(y, (BM, BN),
                                                                            (r0, c0)))
    return k


COPY = {"f32": dma_copy(f32), "bf16": dma_copy(bf16)}
NUMPY = {"f32": np.float32, "bf16": ml_dtypes.bfloat16}


def _run(dtype, shape, m, n, target, *, bm, bn, threads, align, multiple, fill=0):
    rng = np.random.default_rng()
    x = rng.standard_normal(shape).astype(NUMPY[dtype])
    grid = (-(-shape[0] // bm), -(-shape[1] // bn))
    y = np.full((grid[0] * bm, grid[1] * bn), np.nan, NUMPY[dtype])
    params = dict(BM=bm, BN=bn, THREADS=threads, ALIGN=align, MULTIPLE=multiple, FILL=fill,
                  SWIZZLE=False)
    COPY[dtype].interpret[grid](x, y, m, n, **params, target=target)
    want = np.full(y.shape, fill, np.float64)
    want[:m, :n] = x[:m, :n].astype(np.float64)
    np.testing.assert_array_equal(y.astype(np.float64), want)
    return COPY[dtype].trace(x, y, m, n, **params, target=target).module_asm


@pytest.mark.parametrize("target", ("gfx950", "gfx942"))
@pytest.mark.parametrize("dtype,shape,m,n,bm,bn,threads,align,multiple", [
    ("f32", (37, 100), 37, 100, 16, 64, 128, 16, 4),    # 16-byte chunks on gfx950
    ("f32", (37, 99), 30, 97, 16, 64, 128, 4, 1),       # 4-byte chunks: any col_end
    ("bf16", (40, 136), 33, 120, 32, 64, 256, 16, 8),   # 8 bf16 a lane
    ("bf16", (40, 130), 40, 126, 32, 64, 64, 4, 2),     # 2 bf16 a lane, one wave
])
def test_dma_copy_masks_rows_and_columns(target, dtype, shape, m, n, bm, bn, threads, align,
                                         multiple):
    text = _run(dtype, shape, m, n, target, bm=bm, bn=bn, threads=threads, align=align,
                multiple=multiple)
    assert "amdgpu.gather_to_lds" in text
    wide = "vector<4xf32>" if dtype == "f32" else "vector<8xbf16>"
    assert (wide in text.split("amdgpu.gather_to_lds", 1)[1].splitlines()[0]) == \
        (target == "gfx950" and align == 16 and multiple * (4 if dtype == "f32" else 2) >= 16)


@kiln.kernel(num_threads=128)
def dma_partial_wave(x: kiln.Tensor[f32, 2], y: kiln.Tensor[f32, 2], m: i32, n: i32):
    s = kiln.SharedTile((4, 48), f32)
    # 48 16-byte chunks over 128 threads: lanes 48.. of wave 0 and all of wave 1 copy nothing
    kiln.copy(kiln.GlobalTile(x, (4, 48), (1, 0), row_end=m, col_end=n, align=16,
                              col_multiple=4), s)
    kiln.barrier()
    for i in kiln.static_range(2):
        e = kiln.thread_id(0) + i * 128
        if e < 192:
            y[e // 48, e % 48] = s.load(e // 48, e % 48)


@pytest.mark.parametrize("target", ("gfx950", "gfx942"))
def test_dma_copy_of_a_partial_wave(target):
    x = np.random.default_rng().standard_normal((5, 52)).astype(np.float32)
    y = np.full((4, 48), np.nan, np.float32)
    dma_partial_wave.interpret[(1,)](x, y, 4, 44, target=target)
    want = np.zeros((4, 48))
    want[:3, :44] = x[1:4, :44]
    np.testing.assert_array_equal(y, want)
    assert "amdgpu.gather_to_lds" in dma_partial_wave.trace(x, y, 4, 44,
                                                            target=target).module_asm


@pytest.mark.parametrize("case", ["fill", "no_align", "swizzle", "narrow", "nvidia"])
def test_dma_falls_back_to_vector_copies(case):
    """A fill other than 0, no alignment promise, a swizzled tile (a wave's chunks are not
    contiguous in LDS), bf16 rows promising only 2-byte alignment (no DMA size) and NVIDIA
    keep the other paths, still correct."""
    dtype, threads, align, multiple, fill, target = "f32", 128, 16, 4, 0, "gfx950"
    swizzle = False
    if case == "fill":
        fill = -3.0
    elif case == "no_align":
        align = None
    elif case == "swizzle":
        swizzle = True
    elif case == "narrow":
        dtype, align, multiple = "bf16", 2, 1
    else:
        target = "sm_90a"
    rng = np.random.default_rng()
    x = rng.standard_normal((40, 72)).astype(NUMPY[dtype])
    y = np.full((64, 128), np.nan, NUMPY[dtype])
    params = dict(BM=32, BN=64, THREADS=threads, ALIGN=align, MULTIPLE=multiple, FILL=fill,
                  SWIZZLE=swizzle)
    if align is None:
        del params["ALIGN"]
        kernel = _no_align_copy
    else:
        kernel = COPY[dtype]
    kernel.interpret[(2, 2)](x, y, 40, 68, **params, target=target)
    want = np.full(y.shape, fill, np.float64)
    want[:40, :68] = x[:, :68].astype(np.float64)
    np.testing.assert_array_equal(y.astype(np.float64), want)
    assert "amdgpu.gather_to_lds" not in kernel.trace(x, y, 40, 68, **params,
                                                      target=target).module_asm


@kiln.kernel(num_threads="THREADS")
def _no_align_copy(x: kiln.Tensor[f32, 2], y: kiln.Tensor[f32, 2], m: i32, n: i32,
                   BM: kiln.constexpr, BN: kiln.constexpr, THREADS: kiln.constexpr,
                   MULTIPLE: kiln.constexpr, FILL: kiln.constexpr, SWIZZLE: kiln.constexpr):
    s = kiln.SharedTile((BM, BN), f32)
    r0, c0 = kiln.block_id(0) * BM, kiln.block_id(1) * BN
    kiln.copy(kiln.GlobalTile(x, (BM, BN), (r0, c0), row_end=m, col_end=n,
                              col_multiple=MULTIPLE, fill=FILL), s)
    kiln.barrier()
    kiln.copy(kiln.load(s, blocked((BM, BN), THREADS)), kiln.GlobalTile(y, (BM, BN), (r0, c0)))


@kiln.kernel(num_threads=128)
def dma_no_barrier(x: kiln.Tensor[f32, 2], y: kiln.Tensor[f32, 2]):
    s = kiln.SharedTile((32, 32), f32)
    kiln.copy(kiln.GlobalTile(x, (32, 32), align=16), s)
    # no kiln.barrier(): waves read chunks other waves copied (the vmcnt wait is per wave)
    kiln.copy(kiln.load(s, blocked((32, 32), 128, vec=1)), kiln.GlobalTile(y, (32, 32)))


def test_interpreter_catches_a_missing_barrier_after_a_dma_copy():
    x = np.ones((32, 32), np.float32)
    assert "amdgpu.gather_to_lds" in dma_no_barrier.trace(x, x, target="gfx950").module_asm
    with pytest.raises(kiln.RaceError):
        dma_no_barrier.interpret[(1,)](x, np.zeros_like(x), target="gfx950")


@pytest.mark.lower
@pytest.mark.parametrize("target,instruction", [("gfx950", "buffer_load_dwordx4"),
                                                ("gfx942", "buffer_load_dword ")])
def test_dma_copy_compiles_to_buffer_loads_into_lds_without_scratch(target, instruction):
    x = np.zeros((64, 128), np.float32)
    ck = COPY["f32"].compile(x, x, 64, 128, BM=32, BN=64, THREADS=128, ALIGN=16, MULTIPLE=4,
                             FILL=0, SWIZZLE=False, target=target)
    asm = ck.asm["amdgcn"]
    assert ck.metadata["scratch_bytes"] == 0
    dma = [line for line in asm.splitlines() if "buffer_load" in line]
    # 32 x 64 f32 over 128 threads: 4 (16-byte) or 16 (4-byte) DMAs a thread, all into LDS
    assert len(dma) == (4 if target == "gfx950" else 16)
    assert all(instruction in line and line.rstrip().endswith("lds") for line in dma)
    first_read = asm.index("ds_read")
    wait = asm.rfind("s_waitcnt vmcnt(0)", 0, first_read)
    assert asm.rfind("buffer_load", 0, first_read) < wait < first_read
    assert "global_load" not in asm


def test_double_buffered_dma_copies_are_waited_for_one_stage_at_a_time():
    rng = np.random.default_rng()
    x = rng.standard_normal((200, 32)).astype(np.float32)
    y = np.zeros((32, 32), np.float32)
    two_stage_sum.interpret[(1,)](x, y, 200, target="gfx950")
    padded = np.zeros((256, 32))
    padded[:200] = x
    np.testing.assert_allclose(y, padded.reshape(-1, 32, 32).sum(axis=0), rtol=1e-5, atol=1e-5)
    text = two_stage_sum.trace(x, y, 200, target="gfx950").module_asm
    assert text.count("amdgpu.gather_to_lds") == 6   # 2 a thread per slab: before, 2 in the loop


@pytest.mark.lower
def test_double_buffered_dma_keeps_the_next_stage_in_flight():
    x = np.zeros((200, 32), np.float32)
    ck = two_stage_sum.compile(x, x[:32], 200, target="gfx950")
    # each slab is 2 DMAs a thread: reading slab i waits for all but slab i + 1's two
    assert "s_waitcnt vmcnt(2)" in ck.asm["amdgcn"] and ck.metadata["scratch_bytes"] == 0
