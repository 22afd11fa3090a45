"""kiln.ldmatrix: lane addresses modelled with numpy against the mma.sync fragment layouts,
and the nvgpu.ldmatrix / PTX it emits."""

from __future__ import annotations

import numpy as np
import pytest

import kiln
import kiln.ldmatrix as ldm
import kiln.tiles as tiles
from kiln import layout as L
from kiln.swizzle import Swizzle

LANES = np.arange(32)


def capture_tile(shape, swizzle):
    captured = {}

    @kiln.kernel
    def k(out: kiln.Tensor[kiln.bf16]):
        captured["tile"] = tiles.SharedTile(shape, kiln.bf16, swizzle=swizzle)
        out.store(0, ldm.load_a(captured["tile"], (0, 0)))

    k.trace(np.zeros(8, kiln.bf16.numpy), target="sm_80")
    return captured["tile"]


def simulate_ldmatrix(tile, memory, origin, blocks, trans):
    """PTX ldmatrix semantics on numpy: ``[lanes, 2 * num]`` values each lane receives."""
    num = len(blocks)
    row_addr = np.asarray(ldm.row_offset(tile, origin, blocks, LANES))      # per lane
    out = np.empty((32, 2 * num))
    for i in range(num):
        block = np.stack([memory[row_addr[8 * i + r] + np.arange(8)] for r in range(8)])
        if trans:
            block = block.T
        out[:, 2 * i] = block[LANES // 4, 2 * (LANES % 4)]
        out[:, 2 * i + 1] = block[LANES // 4, 2 * (LANES % 4) + 1]
    return out


@pytest.mark.parametrize("swizzle", [None, Swizzle(3, 3, 3)], ids=["plain", "sw128b"])
def test_load_a_yields_the_mma_a_fragment(swizzle):
    tile = capture_tile((64, 64), swizzle)
    matrix = np.random.default_rng().standard_normal((64, 64))
    memory = np.full(tile.offsets().max() + 1, np.nan)
    memory[tile.offsets()] = matrix
    origin = (16, 48)
    got = simulate_ldmatrix(tile, memory, origin, ldm.A_BLOCKS, trans=False)
    rows, cols = L.mma_m16n8k16_a().coords()
    np.testing.assert_array_equal(got, matrix[origin[0] + rows, origin[1] + cols])


@pytest.mark.parametrize("trans", [False, True])
def test_load_b_yields_the_mma_b_fragment(trans):
    tile = capture_tile((32, 64), Swizzle(3, 3, 3))
    stored = np.random.default_rng().standard_normal((32, 64))
    memory = np.full(tile.offsets().max() + 1, np.nan)
    memory[tile.offsets()] = stored
    origin = (16, 8)
    blocks = ((0, 0), (8, 0)) if trans else ((0, 0), (0, 8))
    got = simulate_ldmatrix(tile, memory, origin, blocks, trans)
    k_rows, n_cols = L.mma_m16n8k16_b().coords()
    if trans:   # stored K x N: element (k, n) at stored[k0 + k, n0 + n]
        want = stored[origin[0] + k_rows, origin[1] + n_cols]
    else:       # stored N x K: element (k, n) at stored[n0 + n, k0 + k]
        want = stored[origin[0] + n_cols, origin[1] + k_rows]
    np.testing.assert_array_equal(got, want)


@pytest.mark.lower
def test_ldmatrix_ir_and_ptx():
    @kiln.kernel
    def k(out: kiln.Tensor[kiln.bf16]):
        s = tiles.SharedTile((32, 64), kiln.bf16, swizzle=Swizzle(3, 3, 3))
        out.store(kiln.lane_id() * 12, ldm.load_a(s, (0, 0)))
        out.store(kiln.lane_id() * 12 + 8, ldm.load_b(s, (16, 8), trans=True))

    args = (np.zeros(512, kiln.bf16.numpy),)
    text = k.trace(*args, target="sm_80").module_asm
    assert "nvgpu.ldmatrix" in text and "numTiles = 4 : i32, transpose = false" in text
    assert "numTiles = 2 : i32, transpose = true" in text
    ptx = k.compile(*args, target="sm_80").asm["ptx"]
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in ptx
    assert "ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16" in ptx


def test_ldmatrix_errors():
    @kiln.kernel
    def on_amd(out: kiln.Tensor[kiln.bf16]):
        s = tiles.SharedTile((16, 16), kiln.bf16)
        out.store(0, ldm.load_a(s, (0, 0)))

    with pytest.raises(kiln.TargetError, match="NVIDIA instruction"):
        on_amd.trace(np.zeros(8, kiln.bf16.numpy), target="gfx950")

    @kiln.kernel
    def split_rows(out: kiln.Tensor[kiln.bf16]):
        s = tiles.SharedTile((16, 64), kiln.bf16, swizzle=Swizzle(3, 2, 3))
        out.store(0, ldm.load_a(s, (0, 0)))

    with pytest.raises(kiln.KilnValueError, match="8-element rows contiguous"):
        split_rows.trace(np.zeros(8, kiln.bf16.numpy), target="sm_80")
