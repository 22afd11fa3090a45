"""GlobalTile ``col_multiple``: with ``col_end`` a promised multiple of the access width (and
``align`` keeping accesses aligned), a chunk is wholly inside or wholly masked, so loads and
stores need no per-element mask (no ``vector.maskedload``/``maskedstore``); results match
numpy at ragged sizes."""

from __future__ import annotations

import numpy as np
import pytest

import kiln
from kiln import f32, i32
from kiln.layout import blocked


@kiln.kernel(num_threads=128)
def scale_rows(x: kiln.Tensor[f32, 2], y: kiln.Tensor[f32, 2], m: i32, n: i32,
               ALIGN: kiln.constexpr, MULTIPLE: kiln.constexpr):
    tv = blocked((4, 256), 128, vec=4)
    r0 = kiln.block_id(0) * 4
    t = kiln.load(kiln.GlobalTile(x, (4, 256), (r0, 0), row_end=m, col_end=n, align=ALIGN,
                                  col_multiple=MULTIPLE, fill=5.0), tv)
    kiln.copy(t * 2.0, kiln.GlobalTile(y, (4, 256), (r0, 0), row_end=m, col_end=n,
                                       align=ALIGN, col_multiple=MULTIPLE))


@pytest.mark.parametrize("target", ("sm_90a", "gfx950"))
@pytest.mark.parametrize("n,align,multiple,masked", [(200, 16, 4, False), (200, 16, 1, True),
                                                     (200, 4, 4, True), (197, 4, 1, True)])
def test_whole_chunks_need_no_element_masks(target, n, align, multiple, masked):
    rng = np.random.default_rng()
    x = rng.standard_normal((7, n)).astype(np.float32)
    y = np.full((7, n), np.nan, np.float32)
    scale_rows.interpret[(2,)](x, y, 7, n, ALIGN=align, MULTIPLE=multiple, target=target)
    np.testing.assert_array_equal(y, x * 2)
    text = scale_rows.trace(x, y, 7, n, ALIGN=align, MULTIPLE=multiple,
                            target=target).module_asm
    assert ("vector.maskedload" in text) == masked and ("vector.maskedstore" in text) == masked
