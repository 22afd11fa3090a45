"""SharedTiles past PTX's 48 KB static ``.shared`` cap come from dynamic shared memory on
NVIDIA (the launch requests it); smaller ones and AMD's stay static."""

from __future__ import annotations

import numpy as np
import pytest

import kiln
from kiln import f32, i32
from kiln.layout import blocked


@kiln.kernel(num_threads=256)
def row_through_shared(x: kiln.Tensor[f32, 2], y: kiln.Tensor[f32, 2], n: i32,
                       BLOCK: kiln.constexpr):
    small = kiln.SharedTile((1, 1024), f32)   # static: the big tile is carved after it
    s = kiln.SharedTile((1, BLOCK), f32)
    row = kiln.block_id(0)
    kiln.copy(kiln.GlobalTile(x, (1, 1024), (row, 0), col_end=n, align=4), small)
    kiln.copy(kiln.GlobalTile(x, (1, BLOCK), (row, 0), col_end=n, align=4), s)
    kiln.barrier()
    t = kiln.load(s, blocked((1, BLOCK), 256))
    head = kiln.load(small, blocked((1, 1024), 256))
    kiln.copy(t * 2.0, kiln.GlobalTile(y, (1, BLOCK), (row, 0), col_end=n))
    kiln.copy(head, kiln.GlobalTile(y, (1, 1024), (row, BLOCK), col_end=n + BLOCK))


@pytest.mark.parametrize("target", ("sm_80", "gfx950"))
def test_a_tile_past_48_kb_runs_in_the_interpreter(target):
    rng = np.random.default_rng()
    n = 16000   # a 16384-column f32 tile: 64 KB
    x = rng.standard_normal((3, n)).astype(np.float32)
    y = np.full((3, 16384 + 1024), np.nan, np.float32)
    row_through_shared.interpret[(3,)](x, y, n, BLOCK=16384, target=target)
    np.testing.assert_array_equal(y[:, :n], x * 2)
    np.testing.assert_array_equal(y[:, 16384:], x[:, :1024])


@pytest.mark.lower
@pytest.mark.parametrize("block,dynamic", [(8192, False), (16384, True)])
def test_a_tile_past_48_kb_is_dynamic_shared_memory_on_sm80(block, dynamic):
    x = np.zeros((3, block), np.float32)
    ck = row_through_shared.compile(x, x, block, BLOCK=block, target="sm_80")
    assert (ck.signature.dynamic_shared_bytes >= block * 4) == dynamic
    assert (".extern .shared" in ck.asm["ptx"]) == dynamic
    assert ck.metadata["spill_bytes"] == 0
