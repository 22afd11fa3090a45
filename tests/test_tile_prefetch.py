"""kiln.prefetch(g): a GlobalTile's bytes into L2 (a hint: no value changes).

A persistent softmax-like kernel that prefetches the row after next matches float64 in the
interpreter as on sm_90a, sm_80 and gfx950 (ragged rows, the prefetch masked past m); the PTX
has one ``cp.async.bulk.prefetch.L2.global`` a tile row on sm_90a (16-byte aligned tiles),
``prefetch.global.L2`` a 128-byte line elsewhere on NVIDIA, and nothing on gfx950; a bad
argument raises a KilnError at the caller's line."""

from __future__ import annotations

import re

import numpy as np
import pytest

import kiln
from kiln import f32, i32
from kiln.core.errors import KilnTypeError


@kiln.kernel(num_threads=128)
def shift_rows(x: kiln.Tensor[f32, 2], y: kiln.Tensor[f32, 2], m: i32, n: i32, grid: i32,
               ALIGN: kiln.constexpr, ROWS: kiln.constexpr):
    """y[row] = x[row] - max(x[row]) over a persistent grid; the row after next (as ROWS-row
    tiles of 256 columns) prefetched into L2 first."""
    tv = kiln.layout.blocked((1, 1024), 128, vec=4)
    for row in kiln.range(kiln.block_id(0), m, grid):
        kiln.prefetch(kiln.GlobalTile(x, (ROWS, 256 * 4 // ROWS), (row + 2 * grid, 0),
                                      row_end=m, col_end=n, align=ALIGN))
        t = kiln.load(kiln.GlobalTile(x, (1, 1024), (row, 0), col_end=n, fill=-float("inf")),
                      tv)
        kiln.copy(t - kiln.reduce(t, "max", axis=1),
                  kiln.GlobalTile(y, (1, 1024), (row, 0), col_end=n))


@pytest.mark.parametrize("target", ("sm_90a", "sm_80", "gfx950"))
@pytest.mark.parametrize("m,n,grid", [(7, 1000, 2), (5, 1021, 3), (1, 4, 1)])
def test_prefetched_rows_match_float64(target, m, n, grid):
    rng = np.random.default_rng()
    x = (rng.standard_normal((m, n)) * 3 - 50).astype(np.float32)
    y = np.full_like(x, np.nan)
    shift_rows.interpret[(grid,)](x, y, m, n, grid, ALIGN=16 if n % 4 == 0 else 4, ROWS=1,
                                  target=target)
    np.testing.assert_allclose(y, x.astype(np.float64) - x.max(axis=1, keepdims=True),
                               rtol=1e-6, atol=1e-6)


def _code(target, align, rows):
    x = np.zeros((64, 1000), np.float32)
    asm = shift_rows.compile(x, x, 64, 1000, 8, ALIGN=align, ROWS=rows, target=target).asm
    return asm.get("ptx") or asm["amdgcn"]


@pytest.mark.lower
@pytest.mark.parametrize("rows", [1, 4])
def test_one_bulk_prefetch_a_row_on_sm90(rows):
    """Each tile row is one bulk prefetch of its bytes inside col_end, rounded down to 16."""
    ptx = _code("sm_90a", 16, rows)
    assert len(re.findall(r"cp\.async\.bulk\.prefetch\.L2\.global", ptx)) == rows
    assert "prefetch.global.L2" not in ptx.replace("bulk.prefetch.L2.global", "")


@pytest.mark.lower
@pytest.mark.parametrize("target,align", [("sm_80", 16), ("sm_90a", 4)])
def test_line_prefetches_elsewhere_on_nvidia(target, align):
    """1024 f32 columns are 32 lines of 128 bytes: over 128 threads, one prefetch each."""
    ptx = _code(target, align, 1)
    assert "cp.async.bulk.prefetch" not in ptx
    assert len(re.findall(r"prefetch\.global\.L2 ", ptx)) == 1


@pytest.mark.lower
def test_nothing_on_gfx950():
    assert not re.search(r"^\s+\w*prefetch", _code("gfx950", 16, 1), re.M)


def test_a_non_tile_is_a_kiln_error_at_the_callers_line():
    @kiln.kernel(num_threads=128)
    def bad(x: kiln.Tensor[f32, 2]):
        kiln.prefetch(x)

    with pytest.raises(KilnTypeError, match="kiln.prefetch takes a GlobalTile") as info:
        bad.compile(np.zeros((4, 4), np.float32), target="sm_90a")
    assert info.value.loc.filename == __file__
