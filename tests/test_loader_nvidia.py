"""TiledMmaLoader on NVIDIA: ldmatrix lane addresses modelled with numpy against the mma.sync
m16n8k16 B layout, the PTX, the interpreter on a swizzled shared tile, and errors."""

import re

import ml_dtypes
import numpy as np
import pytest

import kiln
from kiln import layout as L
from kiln.amd.loader import TiledMmaLoader
from kiln.interpreter import interpret_kernel
from kiln.swizzle import Swizzle

LANES = np.arange(32)
SHAPE = (16, 8, 16)
# Element-unit swizzles of 16-bit data that keep 8-element (16-byte) rows whole.
SWIZZLES = [None, Swizzle(3, 3, 3), Swizzle(2, 3, 4)]


@pytest.fixture(autouse=True)
def _no_disk_cache(monkeypatch):
    """The kernels differ only in the loaders they close over, which the cache key cannot see."""
    monkeypatch.setenv("KILN_NO_CACHE", "1")


def _smem_holding(stored: np.ndarray, loader: TiledMmaLoader) -> np.ndarray:
    """Flat shared memory where stored element ``(r, c)`` sits at ``swizzled(r * cols + c)``."""
    smem = np.full(stored.size, np.nan)
    smem[loader.swizzled(np.arange(stored.size))] = stored.reshape(-1)
    return smem


def _ldmatrix_model(smem, row_offsets, blocks, trans):
    """PTX ldmatrix: lanes ``8i..8i+7`` address block ``i``'s rows; ``[32, 2 * blocks]``."""
    out = np.empty((32, 2 * blocks))
    for i in range(blocks):
        block = np.stack([smem[row_offsets[8 * i + r] + np.arange(8)] for r in range(8)])
        if trans:
            block = block.T
        for e in range(2):
            out[:, 2 * i + e] = block[LANES // 4, 2 * (LANES % 4) + e]
    return out


@pytest.mark.parametrize("swizzle", SWIZZLES, ids=str)
@pytest.mark.parametrize("blocks", [2, 4])
def test_load_b_addresses_give_the_mma_b_fragments(swizzle, blocks):
    loader = TiledMmaLoader(kiln.bf16, SHAPE, swizzle=swizzle)
    stored = np.random.default_rng().standard_normal((32, 64))  # N x K, K contiguous
    smem = _smem_holding(stored, loader)
    n0, k0 = 8, 16
    offsets = np.asarray(loader.ldmatrix_b_offsets(LANES, 64, n0, k0, blocks=blocks))
    got = _ldmatrix_model(smem, offsets, blocks, trans=False)
    k_rows, n_cols = L.mma_m16n8k16_b().coords()
    for f in range(blocks // 2):  # fragment f: the next 16 K columns
        np.testing.assert_array_equal(got[:, 4 * f:4 * f + 4],
                                      stored[n0 + n_cols, k0 + 16 * f + k_rows])


@pytest.mark.parametrize("swizzle", SWIZZLES, ids=str)
def test_load_b_tr_addresses_give_the_mma_b_fragment(swizzle):
    loader = TiledMmaLoader(kiln.f16, SHAPE, swizzle=swizzle, swizzle2=Swizzle(1, 4, 5))
    stored = np.random.default_rng().standard_normal((64, 64))  # K x N, N contiguous
    smem = _smem_holding(stored, loader)
    k0, n0 = 32, 24
    offsets = np.asarray(loader.ldmatrix_b_tr_offsets(LANES, 64, k0, n0))
    got = _ldmatrix_model(smem, offsets, 2, trans=True)
    k_rows, n_cols = L.mma_m16n8k16_b().coords()
    np.testing.assert_array_equal(got, stored[k0 + k_rows, n0 + n_cols])


def _loader_kernel(loader, rows, cols, transposed):
    """Stage ``x`` (rows x cols) into a shared tile through the loader's swizzles, then write
    each lane's B fragments: ``load_b(n_tiles=2, k_tiles=3)`` or one ``load_b_tr``. The
    immediate offset (added after the swizzle) is 8 rows, which the swizzles leave unchanged."""
    dtype = loader.dtype

    @kiln.kernel
    def k(x: kiln.Tensor[dtype, 2], out: kiln.Tensor[dtype, 2]):
        lane = kiln.lane_id()
        tile = kiln.shared((rows, cols), dtype)
        for i in kiln.static_range(rows * cols // 32):
            logical = 32 * i + lane
            flat = loader.swizzled(logical)
            tile[flat // cols, flat % cols] = x[logical // cols, logical % cols]
        kiln.barrier()
        if transposed:
            frags = [loader.load_b_tr(tile, k0=16, n0=8, imm_offset_bytes=2 * 8 * cols)]
        else:
            frags = loader.load_b(tile, n_tiles=2, k_tiles=3, n0=8, k0=0,
                                  imm_offset_bytes=2 * 8 * cols)
        for f, frag in enumerate(frags):
            out.store(lane, 4 * f, frag)

    return k


def _run(kernel, x, fragments, dtype):
    out = np.full((32, 4 * fragments), np.nan, dtype)
    traced = kernel.trace(x, out, target="sm_90a", num_warps=1)
    interpret_kernel(traced, (1, 1, 1), [x, out], "sm_90a")
    return out.astype(np.float64), traced


def test_interpreter_load_b_on_swizzled_tile():
    loader = TiledMmaLoader(kiln.bf16, SHAPE, swizzle=Swizzle(3, 3, 3))
    x = np.random.default_rng().standard_normal((32, 64)).astype(ml_dtypes.bfloat16)
    out, traced = _run(_loader_kernel(loader, 32, 64, False), x, 6, ml_dtypes.bfloat16)
    assert traced.module_asm.count("nvgpu.ldmatrix") == 4  # per N tile: one x4 and one x2
    k_rows, n_cols = L.mma_m16n8k16_b().coords()
    x64 = x.astype(np.float64)
    for nt in range(2):
        for kt in range(3):
            f = 3 * nt + kt
            # n0=8 plus imm_offset_bytes of 8 rows: N rows from 16.
            np.testing.assert_array_equal(out[:, 4 * f:4 * f + 4],
                                          x64[16 + 8 * nt + n_cols, 16 * kt + k_rows])


def test_interpreter_load_b_tr_on_swizzled_tile():
    loader = TiledMmaLoader(kiln.f16, SHAPE, swizzle=Swizzle(3, 3, 3))
    x = np.random.default_rng().standard_normal((48, 64)).astype(np.float16)
    out, _ = _run(_loader_kernel(loader, 48, 64, True), x, 1, np.float16)
    k_rows, n_cols = L.mma_m16n8k16_b().coords()
    # k0=16 plus imm_offset_bytes of 8 rows: K rows 24..39.
    np.testing.assert_array_equal(out, x.astype(np.float64)[24 + k_rows, 8 + n_cols])


@pytest.mark.lower
def test_ldmatrix_instructions_in_ptx():
    x = np.zeros((32, 64), ml_dtypes.bfloat16)
    out = np.zeros((32, 24), ml_dtypes.bfloat16)
    loader = TiledMmaLoader(kiln.bf16, SHAPE, swizzle=Swizzle(3, 3, 3))
    ptx = _loader_kernel(loader, 32, 64, False).compile(x, out, target="sm_90a",
                                                        num_warps=1).asm["ptx"]
    assert len(re.findall(r"ldmatrix\.sync\.aligned\.m8n8\.x4\.shared\.b16", ptx)) == 2
    assert len(re.findall(r"ldmatrix\.sync\.aligned\.m8n8\.x2\.shared\.b16", ptx)) == 2
    x = np.zeros((48, 64), ml_dtypes.bfloat16)
    out = np.zeros((32, 4), ml_dtypes.bfloat16)
    ptx = _loader_kernel(loader, 48, 64, True).compile(x, out, target="sm_90a",
                                                       num_warps=1).asm["ptx"]
    # The compile-time offset (8 rows of 128 bytes) folds into the address.
    assert re.search(r"ldmatrix\.sync\.aligned\.m8n8\.x2\.trans\.shared\.b16 \{[^}]*\}, "
                     r"\[%rd?\d+\+1024\];", ptx)


def test_unsupported_combinations_name_the_supported_ones():
    with pytest.raises(kiln.UnsupportedError, match=r"NVIDIA sm_80\+: bf16/f16 \(16, 8, 16\)"):
        TiledMmaLoader(kiln.f8e4m3, SHAPE)
    nvidia = TiledMmaLoader(kiln.bf16, SHAPE)
    amd = TiledMmaLoader(kiln.bf16, (32, 32, 16))
    x = np.zeros((32, 64), ml_dtypes.bfloat16)
    out = np.zeros((32, 24), ml_dtypes.bfloat16)
    with pytest.raises(kiln.UnsupportedError, match=r"\(32, 32, 16\) is not supported on sm_90a"):
        _loader_kernel(amd, 32, 64, False).trace(x, out, target="sm_90a", num_warps=1)
    with pytest.raises(kiln.UnsupportedError, match=r"\(16, 8, 16\) is not supported on gfx950"):
        _loader_kernel(nvidia, 32, 64, False).trace(x, out, target="gfx950", num_warps=1)
    # A swizzle that splits the 8-element rows ldmatrix reads.
    split = TiledMmaLoader(kiln.bf16, SHAPE, swizzle=Swizzle(3, 2, 3))
    with pytest.raises(kiln.UnsupportedError, match="permutes inside such runs"):
        _loader_kernel(split, 32, 64, False).trace(x, out, target="sm_90a", num_warps=1)
