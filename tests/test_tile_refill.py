"""kiln.load(via=, refill=): a row read through shared tiles, each refilled with the next row's
as soon as every thread has read it (the softmax / layer-norm tutorials' long-row stream).

In the interpreter (which runs kiln-insert-waits and checks races and waits) on ragged shapes
against float64, as on NVIDIA (cp.async) and on gfx950 (buffer -> LDS DMA); the PTX has one
block barrier and one cp.async group a tile, each read waiting only for its own tile; bad
arguments raise KilnErrors naming the argument."""

from __future__ import annotations

import re

import numpy as np
import pytest

import kiln
from kiln import f32, i32
from kiln.core.errors import KilnError


@kiln.kernel(num_threads="THREADS")
def stream_rows(x: kiln.Tensor[f32, 2], y: kiln.Tensor[f32, 2], m: i32, n: i32, grid: i32,
                BLOCK: kiln.constexpr, CHUNK: kiln.constexpr, THREADS: kiln.constexpr,
                ALIGN: kiln.constexpr):
    """y[row] = x[row] - max(x[row]) over a persistent grid, rows streamed through shared."""
    tv = kiln.layout.blocked((1, CHUNK), THREADS, vec=4)
    row_s = [kiln.SharedTile((1, CHUNK), f32) for _ in range(BLOCK // CHUNK)]

    def row_tiles(t, row, fill=0.0, row_end=None):
        return [kiln.GlobalTile(t, (1, CHUNK), (row, c * CHUNK), row_end=row_end, col_end=n,
                                fill=fill, align=ALIGN, col_multiple=ALIGN // 4)
                for c in range(BLOCK // CHUNK)]

    for s, first in zip(row_s, row_tiles(x, kiln.block_id(0))):
        kiln.copy(first, s)
    for row in kiln.range(kiln.block_id(0), m, grid):
        ts = kiln.load(row_tiles(x, row, -float("inf")), tv, via=row_s,
                       refill=row_tiles(x, row + grid, row_end=m))
        top = ts[0]
        for t in ts[1:]:
            top = kiln.maximum(top, t)
        mx = kiln.reduce(top, "max", axis=1)
        for t, g in zip(ts, row_tiles(y, row)):
            kiln.copy(t - mx, g)


@pytest.mark.parametrize("target", ("sm_90a", "sm_80", "gfx950"))
@pytest.mark.parametrize("m,n,grid", [(7, 1000, 3), (5, 1531, 2), (4, 2048, 4), (1, 3, 1)])
def test_streamed_rows_match_float64(target, m, n, grid):
    """Rows past the end read -inf (the GlobalTile's fill put back after the zero-filled copy);
    every block walks several rows, the last refills masked past m."""
    rng = np.random.default_rng()
    x = (rng.standard_normal((m, n)) * 3 - 50).astype(np.float32)   # all negative: 0 ≠ -inf
    y = np.full_like(x, np.nan)
    align = 16 if n % 4 == 0 else 4
    stream_rows.interpret[(grid,)](x, y, m, n, grid, BLOCK=2048, CHUNK=512, THREADS=128,
                                   ALIGN=align, target=target)
    want = x.astype(np.float64) - x.max(axis=1, keepdims=True)
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)


@pytest.mark.lower
def test_each_tile_waits_for_its_own_copy_behind_one_barrier():
    """Four tiles a row: four barriers before the refills plus one for the last, one cp.async
    group a tile, and each read waits only for its own tile: the first with the three after
    it in flight, the others with two (each wait goes before its barrier, the previous tile's
    refill after it)."""
    x = np.zeros((64, 2048), np.float32)
    ptx = stream_rows.compile(x, x, 64, 2048, 8, BLOCK=2048, CHUNK=512, THREADS=128, ALIGN=16,
                              target="sm_90a").asm["ptx"]
    loop = ptx[ptx.index("cp.async.wait_group"):]
    assert re.findall(r"cp\.async\.wait_group\s+(\d+)", loop)[:4] == ["3", "2", "2", "2"]
    assert ptx.count("cp.async.commit_group") == 4 + 4   # the first row's and the refills
    head = loop[:loop.rindex("cp.async.commit_group")]
    assert head.count("bar.sync") == 5


def _trace(**call):
    @kiln.kernel(num_threads=128)
    def bad(x: kiln.Tensor[f32, 2]):
        tv = kiln.layout.blocked((1, 512), 128, vec=4)
        s = [kiln.SharedTile((1, 512), f32) for _ in range(2)]
        g = [kiln.GlobalTile(x, (1, 512), (0, 512 * c), align=16) for c in range(2)]
        kiln.load(g if call.get("src", 1) else s, tv, via=call.get("via", s),
                  refill=call.get("refill", g))

    bad.compile(np.zeros((1, 1024), np.float32), target="sm_90a")


@pytest.mark.parametrize("case,message", [
    ({"via": None}, "no via= is given"),
    ({"refill": []}, "needs a list of 2 GlobalTiles"),
    ({"src": 0}, "reads GlobalTiles through as many"),
])
def test_bad_arguments_name_the_argument(case, message):
    with pytest.raises(KilnError, match=message):
        _trace(**case)
