"""The memoised fragment layouts: one immutable object per argument, equal to a fresh build,
never another argument's, and bad arguments still rejected every time."""

from __future__ import annotations

import numpy as np
import pytest

import kiln
from kiln import layout as L
from kiln import mfma
from kiln.layout import Layout, ThreadValueLayout, concat_modes


def _fresh_wgmma(n: int) -> ThreadValueLayout:
    """The WGMMA accumulator built without the cache (the PTX ISA formula of the docstring)."""
    threads = Layout((4, 8, 4), (2, n, 16 * n))
    values = Layout((2, 2, n // 8), (1, 8 * n, 8))
    return ThreadValueLayout(concat_modes(threads, values), (64, n))


@pytest.mark.parametrize("n", [8, 16, 64, 96, 128, 256])
def test_wgmma_accumulator_is_shared_per_n_and_equals_a_fresh_build(n):
    cached = L.wgmma_m64_accumulator(n)
    assert L.wgmma_m64_accumulator(np.int64(n)) is cached  # numpy ints hit the same entry
    fresh = _fresh_wgmma(n)
    assert cached == fresh and np.array_equal(cached.offsets(), fresh.offsets())
    assert (cached.num_threads, cached.num_values) == (128, n // 2)
    rng = np.random.default_rng()
    thread, value = int(rng.integers(0, 128)), int(rng.integers(0, n // 2))
    row, col = cached(thread, value)
    warp, lane = divmod(thread, 32)  # the docstring's formula, independently
    assert row == 16 * warp + lane // 4 + 8 * (value // 2 % 2)
    assert col == 8 * (value // 4) + 2 * (lane % 4) + value % 2


def test_wgmma_accumulators_of_different_n_never_alias():
    layouts = {n: L.wgmma_m64_accumulator(n) for n in range(8, 257, 8)}
    assert len({id(tv) for tv in layouts.values()}) == len(layouts)
    assert all(tv.tile == (64, n) for n, tv in layouts.items())


@pytest.mark.parametrize("bad", [0, 12, 264, 64.0, "64"])
def test_bad_wgmma_n_is_rejected_on_every_call(bad):
    for _ in range(2):
        with pytest.raises(kiln.KilnValueError):
            L.wgmma_m64_accumulator(bad)


def test_fixed_fragments_and_mfma_operands_equal_fresh_builds():
    pairs = [
        (L.mma_m16n8_accumulator(), ThreadValueLayout(
            concat_modes(Layout((4, 8), (2, 8)), Layout((2, 2), (1, 64))), (16, 8))),
        (L.mfma_16x16_accumulator(), ThreadValueLayout(
            concat_modes(Layout((16, 4), (1, 64)), Layout(4, 16)), (16, 16))),
    ]
    for cached, fresh in pairs:
        assert cached == fresh and cached is not fresh
    for m, k in ((32, 8), (16, 16), (32, 16), (16, 32)):
        a = mfma.operand_a_layout(m, k)
        assert a is mfma.operand_a_layout(m, k) and a.tile == (m, k)
        assert a.num_values == m * k // 64 and a.num_threads == 64
        b = mfma.operand_b_layout(k, m)
        assert b.tile == (k, m) and b is not a


def test_thread_value_counts_match_the_layout_modes():
    tv = L.partition_tile((32, 64), threads=(4, 32), values=(1, 2))
    assert tv.num_threads == tv.layout[0].size() == 128
    assert tv.num_values == tv.layout[1].size() == 16
