"""Layout algebra and thread-value fragments, checked against brute-force numpy enumeration."""

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kiln.core.errors import KilnValueError
from kiln.layout import (Layout, ThreadValueLayout, blocked_product, coalesce, complement,
                         composition, concat_modes, flatten, left_inverse, logical_divide,
                         logical_product, make_layout, mfma_16x16_accumulator,
                         mfma_32x32_accumulator, mma_m16n8_accumulator, partition_tile,
                         raked_product, right_inverse, wgmma_m64_accumulator, zipped_divide)

FAST = settings(max_examples=60, deadline=None)


def reference_offsets(layout: Layout) -> np.ndarray:
    """Offsets of every linear index, enumerated independently of ``Layout.__call__``."""
    shape, stride = flatten(layout.shape), flatten(layout.stride)
    coords = np.unravel_index(np.arange(layout.size()), shape, order="F")  # first mode fastest
    return sum(c * d for c, d in zip(coords, stride)).astype(np.int64)


class Sym:
    """A stand-in for a traced kiln.Value: records the expression built by integer operators."""

    def __init__(self, text):
        self.text = text

    def _op(self, sym, other):
        other_text = other.text if isinstance(other, Sym) else str(other)
        return Sym(f"({self.text} {sym} {other_text})")

    def __add__(self, o): return self._op("+", o)
    def __mul__(self, o): return self._op("*", o)
    def __floordiv__(self, o): return self._op("//", o)
    def __mod__(self, o): return self._op("%", o)


# ----------------------------------------------------------------------------- strategies

pow2 = st.sampled_from([1, 2, 4])


@st.composite
def layouts(draw, max_modes=4):
    """Layouts with power-of-two extents and strides (always composable), possibly nested."""
    n = draw(st.integers(1, max_modes))
    shapes = [draw(pow2) for _ in range(n)]
    strides = [draw(st.sampled_from([0, 1, 2, 4, 8, 16])) for _ in range(n)]
    if n >= 3 and draw(st.booleans()):  # nest the first two modes
        return Layout(((shapes[0], shapes[1]), *shapes[2:]), ((strides[0], strides[1]), *strides[2:]))
    return Layout(tuple(shapes), tuple(strides))


@st.composite
def bijections(draw, max_modes=4):
    """Compact layouts (a permutation of range(size)) with the modes in a random stride order."""
    n = draw(st.integers(1, max_modes))
    shapes = [draw(st.sampled_from([2, 3, 4])) for _ in range(n)]
    order = draw(st.permutations(range(n)))
    strides = [0] * n
    current = 1
    for i in order:
        strides[i] = current
        current *= shapes[i]
    return Layout(tuple(shapes), tuple(strides))


# ----------------------------------------------------------------------------- evaluation


@pytest.mark.parametrize("layout", [
    Layout((4, 8), (8, 1)), Layout(((2, 2), 8), ((1, 16), 2)), Layout((3, (2, 5)), (10, (0, 1))),
    Layout(7, 3), Layout((2, 3, 4)),
])
def test_offsets_match_enumeration(layout):
    assert np.array_equal(layout.offsets(), reference_offsets(layout))
    assert layout.cosize() == reference_offsets(layout).max() + 1


def test_coordinates_and_linear_indices_agree():
    layout = Layout(((2, 2), 8), ((1, 16), 2))
    for i in range(layout.size()):
        a, b, c = np.unravel_index(i, (2, 2, 8), order="F")
        assert layout(i) == layout(((int(a), int(b)), int(c))) == layout((int(a + 2 * b), int(c)))


def test_make_layout_orders():
    rows, cols = np.meshgrid(np.arange(4), np.arange(8), indexing="ij")
    assert np.array_equal(make_layout((4, 8))((rows, cols)), rows * 8 + cols)
    assert np.array_equal(make_layout((4, 8), "col")((rows, cols)), rows + cols * 4)
    assert Layout((4, 8)) == make_layout((4, 8), "col")


def test_last_mode_counts_past_size():
    layout = Layout((2, 3), (1, 2))
    assert [layout(i) for i in range(10)] == list(range(10))


def test_generic_evaluation_builds_operator_expression():
    expr = Layout((4, 8), (8, 1))(Sym("i")).text
    assert expr == "(((i % 4) * 8) + (i // 4))"
    # Stride-0 and size-1 modes contribute no ops at all.
    assert Layout((4, 1, 3), (1, 5, 0))(Sym("i")).text == "(i % 4)"
    assert Layout((4, 8), (0, 0))(7) == 0


def test_mode_access():
    layout = Layout(((2, 2), 8), ((1, 16), 2))
    assert layout.rank == 2 and len(layout) == 2
    assert layout[0] == Layout((2, 2), (1, 16)) and layout[1] == Layout(8, 2)
    assert concat_modes(*layout.modes()) == layout


@pytest.mark.parametrize("shape, stride, needle", [
    ((4, 8), (1,), "same nesting"),
    ((4, 0), (1, 4), "positive"),
    ((4, 8), (1, -4), "non-negative"),
    ((4, 2.5), (1, 4), "integers"),
    ((4, ()), (1, ()), "empty tuple"),
    ((True, 2), (1, 1), "integers"),
])
def test_invalid_layouts_raise_with_fix(shape, stride, needle):
    with pytest.raises(KilnValueError, match=needle) as err:
        Layout(shape, stride)
    assert "Fix:" in str(err.value) and "test_layout.py" in str(err.value)


def test_invalid_calls_raise():
    with pytest.raises(KilnValueError, match="does not match"):
        Layout((4, 8), (8, 1))((1, 2, 3))
    with pytest.raises(KilnValueError, match="order"):
        make_layout((4, 8), "diagonal")


# ----------------------------------------------------------------------------- coalesce


@FAST
@given(layouts())
def test_coalesce_preserves_function_and_is_minimal(layout):
    flat = coalesce(layout)
    assert flat.size() == layout.size()
    assert np.array_equal(flat.offsets(), reference_offsets(layout))
    shapes, strides = flatten(flat.shape), flatten(flat.stride)
    assert all(s > 1 for s in shapes) or flat == Layout(1, 0)
    assert all(strides[i + 1] != shapes[i] * strides[i] for i in range(len(shapes) - 1))


def test_coalesce_examples():
    assert coalesce(Layout((2, (1, 4)), (1, (7, 2)))) == Layout(8, 1)
    assert coalesce(Layout((4, 8), (8, 1))) == Layout((4, 8), (8, 1))
    assert coalesce(Layout((1, 1), (3, 5))) == Layout(1, 0)


# ----------------------------------------------------------------------------- composition


@FAST
@given(layouts(), layouts(max_modes=3))
def test_composition_is_function_composition(a, b):
    # Composition distributes over b's modes, which needs them to address disjoint digits.
    assume(b.cosize() <= a.size() and b.is_injective())
    c = composition(a, b)
    a_table = reference_offsets(a)
    assert c.size() == b.size()
    assert np.array_equal(reference_offsets(c), a_table[reference_offsets(b)])


def test_composition_examples():
    # CuTe's worked example: (6,2):(8,2) o (4,3):(3,1) == ((2,2),3):((24,2),8)
    c = composition(Layout((6, 2), (8, 2)), Layout((4, 3), (3, 1)))
    assert c == Layout(((2, 2), 3), ((24, 2), 8))
    a, b = Layout((6, 2), (8, 2)), Layout((4, 3), (3, 1))
    assert [c(i) for i in range(12)] == [a(b(i)) for i in range(12)]


def test_composition_with_tuple_tiler_is_per_mode():
    a = make_layout((4, 8))
    c = composition(a, (Layout(2, 2), Layout(4, 2)))   # rows 0,2 x columns 0,2,4,6
    rows, cols = np.meshgrid(np.arange(2), np.arange(4), indexing="ij")
    assert np.array_equal(c((rows, cols)), (2 * rows) * 8 + 2 * cols)
    assert composition(a, (2,)) == Layout((2, 8), (8, 1))


def test_composition_rejects_incompatible_strides():
    with pytest.raises(KilnValueError, match="divide"):
        composition(Layout((3, 5), (1, 4)), Layout(2, 2))
    with pytest.raises(KilnValueError, match="multiple"):
        composition(Layout((3, 4), (1, 10)), Layout(4, 1))
    with pytest.raises(KilnValueError, match="more modes"):
        composition(Layout(8), (2, 2))


# ----------------------------------------------------------------------------- complement


@FAST
@given(layouts(), st.integers(0, 3))
def test_complement_fills_the_gaps(a, extra_bits):
    assume(a.is_injective())
    cotarget = 1 << max(a.cosize() - 1, 0).bit_length() + extra_bits
    c = complement(a, cotarget)
    whole = concat_modes(a, c)
    offsets = reference_offsets(whole)
    assert whole.size() >= cotarget
    assert np.array_equal(np.sort(offsets), np.arange(whole.size()))  # a bijection


def test_complement_examples_and_errors():
    assert complement(Layout(4, 2), 16) == Layout((2, 2), (1, 8))
    assert complement(Layout((2, 2), (1, 6)), 24) == Layout((3, 2), (2, 12))
    assert complement(Layout(4, 2), 20) == Layout((2, 3), (1, 8))  # rounds the cotarget up
    with pytest.raises(KilnValueError, match="no complement"):
        complement(Layout((2, 2), (4, 6)))


# ----------------------------------------------------------------------------- divide / product


@FAST
@given(bijections(), st.sampled_from([Layout(2), Layout(2, 2), Layout((2, 2), (1, 4)), Layout(3)]))
def test_logical_divide_is_composition_with_tile_and_rest(a, tile):
    try:
        divided = logical_divide(a, tile)
    except KilnValueError:
        assume(False)
    rest = complement(tile, a.size())
    tiled = concat_modes(tile, rest)
    assert divided.rank == 2 and divided[0].size() == tile.size()
    for i in range(divided.size()):
        assert divided(i) == a(tiled(i))
    if a.size() % tiled.cosize() == 0:  # tiles partition a's domain
        assert np.array_equal(np.sort(divided.offsets()), np.sort(a.offsets()))


def test_logical_divide_examples():
    assert logical_divide(Layout(16), 4) == Layout((4, 4), (1, 4))
    # CuTe's worked example: (4,2,3):(2,1,8) / 4:2 == ((2,2),(2,3)):((4,1),(2,8))
    assert logical_divide(Layout((4, 2, 3), (2, 1, 8)), Layout(4, 2)) == \
        Layout(((2, 2), (2, 3)), ((4, 1), (2, 8)))


def test_zipped_divide_indexes_tiles():
    z = zipped_divide(make_layout((8, 12)), (4, 3))
    assert z[0].size() == 12 and z[1].size() == 8
    for i in range(4):
        for j in range(3):
            for ti in range(2):
                for tj in range(4):
                    assert z(((i, j), (ti, tj))) == (4 * ti + i) * 12 + 3 * tj + j


def test_zipped_divide_with_strided_tile():
    z = zipped_divide(make_layout((8, 8)), (Layout(2, 4), 8))  # rows {r, r+4}, all columns
    assert z(((1, 5), (3, 0))) == (4 + 3) * 8 + 5


def test_logical_product_examples():
    # CuTe's worked example: (2,2):(4,1) x 6:1 == ((2,2),(2,3)):((4,1),(2,8))
    assert logical_product(Layout((2, 2), (4, 1)), Layout(6)) == \
        Layout(((2, 2), (2, 3)), ((4, 1), (2, 8)))
    assert logical_product(Layout(2), Layout(3)) == Layout((2, 3), (1, 2))
    # The repeats are spaced by b's cosize, not its size, so a strided b stays injective.
    assert logical_product(Layout(2, 2), Layout(2, 2)) == Layout((2, 2), (2, 4))


@FAST
@given(bijections(max_modes=3), bijections(max_modes=3))
def test_logical_product_repeats_compact_block(a, b):
    prod = logical_product(a, b)
    assert prod.size() == a.size() * b.size()
    a_table, b_table = reference_offsets(a), reference_offsets(b)
    expected = a_table[:, None] + a.size() * b_table[None, :]  # block i of b at b(i)*size(a)
    assert np.array_equal(prod.offsets(), expected.reshape(-1, order="F"))


@pytest.mark.parametrize("product, block_first", [(blocked_product, True), (raked_product, False)])
def test_blocked_and_raked_products(product, block_first):
    block, grid = make_layout((2, 3)), make_layout((4, 5))
    result = product(block, grid)
    assert result.size() == 120
    for r in range(2):
        for c in range(3):
            for tr in range(4):
                for tc in range(5):
                    coord = ((r, tr), (c, tc)) if block_first else ((tr, r), (tc, c))
                    assert result(coord) == block((r, c)) + 6 * grid((tr, tc))
    with pytest.raises(KilnValueError, match="ranks"):
        product(block, Layout(4))


def test_rank_one_products():
    assert blocked_product(Layout(2), Layout(3)) == Layout((2, 3), (1, 2))
    assert raked_product(Layout(2), Layout(3)) == Layout((3, 2), (2, 1))


# ----------------------------------------------------------------------------- inverses


@FAST
@given(bijections())
def test_inverses_of_bijections(layout):
    right, left = right_inverse(layout), left_inverse(layout)
    assert right.size() == layout.size()
    offsets = reference_offsets(layout)
    assert np.array_equal(offsets[right.offsets()], np.arange(layout.size()))
    assert np.array_equal(left(offsets), np.arange(layout.size()))


def test_right_inverse_skips_broadcast_modes():
    assert right_inverse(Layout((2, 4), (0, 1))) == Layout(4, 2)


@FAST
@given(layouts())
def test_right_inverse_of_any_layout(layout):
    right = right_inverse(layout)
    indices = np.arange(right.size())
    assert np.array_equal(layout(right(indices)), indices)


# ----------------------------------------------------------------------------- thread-value layouts


def assert_covers_once(tv: ThreadValueLayout):
    rows, cols = tv.coords()
    seen = np.zeros(tv.tile, dtype=np.int64)
    np.add.at(seen, (rows, cols), 1)
    assert np.all(seen == 1)


def test_mma_m16n8_accumulator_matches_ptx_figure():
    tv = mma_m16n8_accumulator()
    lane, v = np.arange(32)[:, None], np.arange(4)[None, :]
    rows, cols = tv.coords()
    assert (tv.num_threads, tv.num_values) == (32, 4)
    assert np.array_equal(rows, np.broadcast_to(lane // 4 + 8 * (v // 2), rows.shape))
    assert np.array_equal(cols, np.broadcast_to(2 * (lane % 4) + v % 2, cols.shape))
    assert [tv(5, i) for i in range(4)] == [(1, 2), (1, 3), (9, 2), (9, 3)]
    assert_covers_once(tv)


@pytest.mark.parametrize("n", [8, 16, 64, 128, 256])
def test_wgmma_accumulator_matches_ptx_figure(n):
    tv = wgmma_m64_accumulator(n)
    thread, v = np.arange(128)[:, None], np.arange(n // 2)[None, :]
    warp, lane = thread // 32, thread % 32
    rows, cols = tv.coords()
    assert np.array_equal(rows, np.broadcast_to(16 * warp + lane // 4 + 8 * (v // 2 % 2), rows.shape))
    assert np.array_equal(cols, np.broadcast_to(8 * (v // 4) + 2 * (lane % 4) + v % 2, cols.shape))
    assert_covers_once(tv)


def test_wgmma_rejects_bad_n():
    with pytest.raises(KilnValueError, match="multiple of 8"):
        wgmma_m64_accumulator(20)


def test_mfma_32x32_accumulator_matches_amd_calculator():
    tv = mfma_32x32_accumulator()
    lane, v = np.arange(64)[:, None], np.arange(16)[None, :]
    rows, cols = tv.coords()
    assert np.array_equal(rows, np.broadcast_to(8 * (v // 4) + 4 * (lane // 32) + v % 4, rows.shape))
    assert np.array_equal(cols, np.broadcast_to(lane % 32, cols.shape))
    assert_covers_once(tv)


def test_mfma_16x16_accumulator_matches_amd_calculator():
    tv = mfma_16x16_accumulator()
    lane, v = np.arange(64)[:, None], np.arange(4)[None, :]
    rows, cols = tv.coords()
    assert np.array_equal(rows, np.broadcast_to(4 * (lane // 16) + v, rows.shape))
    assert np.array_equal(cols, np.broadcast_to(lane % 16, cols.shape))
    assert_covers_once(tv)


@pytest.mark.parametrize("tile, threads, values", [
    ((64, 64), (8, 16), (1, 4)), ((16, 16), (4, 8), (2, 2)), ((32, 8), (32, 1), (1, 8)),
    ((12, 10), (3, 5), (1, 1)),
])
def test_partition_tile_covers_tile(tile, threads, values):
    tv = partition_tile(tile, threads, values)
    assert tv.num_threads == threads[0] * threads[1]
    assert tv.num_values * tv.num_threads == tile[0] * tile[1]
    assert_covers_once(tv)
    rows, cols = tv.coords()
    # value 0 of thread t sits at the origin of t's block in the first repeat
    t = np.arange(tv.num_threads)
    assert np.array_equal(rows[:, 0], (t // threads[1]) * values[0])
    assert np.array_equal(cols[:, 0], (t % threads[1]) * values[1])
    # consecutive values walk along a row inside the block
    if values[1] > 1:
        assert np.array_equal(cols[:, 1], cols[:, 0] + 1)


def test_partition_tile_rejects_uneven_split():
    with pytest.raises(KilnValueError, match="evenly"):
        partition_tile((64, 64), threads=(3, 16))
    with pytest.raises(KilnValueError, match="pair"):
        partition_tile((64, 64, 2), threads=(8, 16))


def test_thread_value_layout_rejects_double_coverage():
    with pytest.raises(KilnValueError, match="exactly once"):
        ThreadValueLayout(Layout((4, 4), (1, 2)), (4, 4))
    with pytest.raises(KilnValueError, match="thread, value"):
        ThreadValueLayout(Layout(16), (4, 4))


def test_thread_value_call_is_generic():
    row, col = mma_m16n8_accumulator()(Sym("lane"), Sym("v"))
    assert "lane" in row.text and "v" in col.text and "%" in col.text


def test_docstring_examples():
    import doctest

    import kiln.layout
    import kiln.layout_algebra

    for module in (kiln.layout, kiln.layout_algebra):
        assert doctest.testmod(module).failed == 0
