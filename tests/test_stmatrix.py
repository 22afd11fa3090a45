"""kiln.ldmatrix.stmatrix, the op added through the registry (docs/architecture.md "Adding an
op"): its declaration, the PTX it emits, its chip check, its effects as the wait passes see
them, and its interpreter semantics against numpy."""

from __future__ import annotations

import numpy as np
import pytest
from mlir import ir

import kiln
import kiln.ldmatrix as ldm
import kiln.tiles as tiles
from kiln.core.ops import lookup
from kiln.core.errors import TargetError
from kiln.swizzle import Swizzle

ROWS, COLS = 32, 64
LANES = np.arange(32)


def make_kernel(blocks, trans, swizzle=None, threads=32):
    """Each warp-0 lane gathers its fragment of ``blocks`` at (8, 16) from ``inp`` (as
    ldmatrix would hand it out), stmatrix writes it to a zeroed shared tile, and the tile is
    copied to ``out``."""
    num = len(blocks)

    @kiln.kernel(num_threads=threads)
    def k(inp: kiln.Tensor[kiln.bf16, 2], out: kiln.Tensor[kiln.bf16, 2]):
        tile = tiles.SharedTile((ROWS, COLS), kiln.bf16, swizzle=swizzle)
        lane = kiln.lane_id()
        for r in kiln.static_range(ROWS):
            tile.store(r, lane, kiln.cast(0.0, kiln.bf16))
            tile.store(r, lane + 32, kiln.cast(0.0, kiln.bf16))
        kiln.barrier()
        elements = []
        for i in kiln.static_range(num):
            for half in kiln.static_range(2):
                row, col = lane // 4, 2 * (lane % 4) + half
                if trans:
                    row, col = col, row
                elements.append(inp[8 + blocks[i][0] + row, 16 + blocks[i][1] + col])
        ldm.stmatrix(tile, (8, 16), blocks, kiln.pack(elements), trans=trans)
        kiln.barrier()
        for r in kiln.static_range(ROWS):
            out[r, lane] = tile.load(r, lane)
            out[r, lane + 32] = tile.load(r, lane + 32)

    return k


@pytest.mark.parametrize("blocks,trans", [(((0, 0),), False), (((0, 0), (8, 0)), True),
                                          (((0, 0), (8, 0), (0, 8), (8, 8)), False)],
                         ids=["x1", "x2.trans", "x4"])
def test_interpreter_writes_each_lanes_fragment(blocks, trans):
    rng = np.random.default_rng()
    inp = rng.standard_normal((ROWS, COLS)).astype(kiln.bf16.numpy)
    out = np.full((ROWS, COLS), np.nan, kiln.bf16.numpy)  # poisoned
    make_kernel(blocks, trans, Swizzle(3, 3, 3)).interpret[1](inp, out, target="sm_90a")
    expected = np.zeros((ROWS, COLS), np.float32)
    for br, bc in blocks:
        rows, cols = slice(8 + br, 16 + br), slice(16 + bc, 24 + bc)
        expected[rows, cols] = inp[rows, cols]  # every block lands where it came from
    np.testing.assert_array_equal(out.astype(np.float32), expected)


def test_emits_stmatrix_ptx_and_carries_its_declaration():
    x = np.zeros((ROWS, COLS), kiln.bf16.numpy)
    ck = make_kernel(((0, 0), (8, 0), (0, 8), (8, 8)), False).compile(x, x, target="sm_90a")
    assert 'kiln.op = "nvidia.ldmatrix.stmatrix"' in ck.asm["kiln"]
    assert "stmatrix.sync.aligned.m8n8.x4.shared.b16 [" in ck.asm["ptx"]
    with ir.Context() as ctx:
        ctx.allow_unregistered_dialects = True
        module = ir.Module.parse(ck.asm["kiln"])
        found = []
        module.operation.walk(lambda op: found.append(lookup(op.operation)) or ir.WalkResult.ADVANCE)
        assert ldm.STMATRIX in found


@pytest.mark.parametrize("target", ["sm_80", "gfx950"])
def test_chips_without_stmatrix_are_refused(target):
    x = np.zeros((ROWS, COLS), kiln.bf16.numpy)
    with pytest.raises(TargetError, match="stmatrix"):
        make_kernel(((0, 0),), False, threads=64).trace(x, x, target=target)


def test_declared_effects():
    effects = ldm.STMATRIX.effects
    assert ldm.STMATRIX.feature == "sm90" and effects.counter is None
    assert effects.indirect_shared and ldm.STMATRIX.interpret is not None


def test_wrong_fragment_is_a_type_error():
    @kiln.kernel(num_threads=32)
    def k(out: kiln.Tensor[kiln.bf16, 2]):
        tile = tiles.SharedTile((ROWS, COLS), kiln.bf16)
        ldm.stmatrix(tile, (0, 0), [(0, 0), (8, 0)], kiln.pack([out[0, 0], out[0, 1]]))

    with pytest.raises(kiln.KilnTypeError, match="vector<4 x bf16>"):
        k.trace(np.zeros((ROWS, COLS), kiln.bf16.numpy), target="sm_90a")


def test_lane_offsets_into_a_dynamic_shared_view():
    """``offset=`` gives each lane's row directly (here rows in reverse order) and addresses a
    view of dynamic shared memory placed after another buffer, whose address the interpreter
    must count once (the view's own offset is 0, as MLIR reports it)."""
    @kiln.kernel(num_threads=32)
    def k(inp: kiln.Tensor[kiln.bf16, 2], out: kiln.Tensor[kiln.bf16, 2]):
        kiln.dynamic_shared((3, 64), kiln.bf16, align=1024)  # the view below starts at 1024
        ring = kiln.dynamic_shared((8 * 8,), kiln.bf16, align=1024)
        tile = tiles.SharedTile.view(ring, (8, 8))
        lane = kiln.lane_id()
        for r in kiln.static_range(8):
            tile.store(r, lane % 8, kiln.cast(0.0, kiln.bf16))
        kiln.barrier()
        row, col = lane // 4, 2 * (lane % 4)
        pair = kiln.pack([inp[row, col], inp[row, col + 1]])
        ldm.stmatrix(tile, (0, 0), [(0, 0)], pair, offset=(7 - lane % 8) * 8)
        kiln.barrier()
        for r in kiln.static_range(8):
            out[r, lane % 8] = tile.load(r, lane % 8)

    rng = np.random.default_rng()
    inp = rng.standard_normal((8, 8)).astype(kiln.bf16.numpy)
    out = np.full((8, 8), np.nan, kiln.bf16.numpy)  # poisoned
    k.interpret[1](inp, out, target="sm_90a")
    np.testing.assert_array_equal(out.astype(np.float32), inp[::-1].astype(np.float32))
