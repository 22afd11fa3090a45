"""Swizzles, checked against bit-by-bit references and the documented hardware patterns."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kiln
from kiln.core.errors import KilnValueError
from kiln.layout import Layout, make_layout
from kiln.swizzle import AMD_LDS_TWO_XOR, ComposedSwizzle, Swizzle, SwizzledLayout

FAST = settings(max_examples=80, deadline=None)


def bitwise_reference(sw: Swizzle, offset: int) -> int:
    """Bit k of the result's field at ``base`` is XORed with bit k of the field at base+shift."""
    out = offset
    for k in range(sw.bits):
        source_bit = (offset >> (sw.base + sw.shift + k)) & 1
        out ^= source_bit << (sw.base + k)
    return out


@st.composite
def swizzles(draw):
    bits = draw(st.integers(0, 3))
    return Swizzle(bits, draw(st.integers(0, 4)), draw(st.integers(bits, bits + 3)))


class BitExpr:
    """A stand-in for a traced kiln.Value offering only the operators a swizzle may use."""

    def __init__(self, text):
        self.text = text

    def __rshift__(self, k): return BitExpr(f"({self.text} >> {k})")
    def __and__(self, k): return BitExpr(f"({self.text} & {k})")

    def __xor__(self, other):
        return BitExpr(f"({self.text} ^ {other.text if isinstance(other, BitExpr) else other})")


@FAST
@given(swizzles(), st.integers(0, 1 << 16))
def test_formula_matches_bitwise_reference(sw, offset):
    assert sw(offset) == bitwise_reference(sw, offset)


@FAST
@given(swizzles())
def test_swizzle_permutes_each_aligned_block_and_is_an_involution(sw):
    offsets = np.arange(4 * sw.span)
    table = sw.table(4 * sw.span)
    assert np.array_equal(table // sw.span, offsets // sw.span)  # stays in its block
    assert np.array_equal(np.sort(table), offsets)                # a bijection
    assert np.array_equal(sw.inverse()(table), offsets)
    assert np.array_equal(sw(table), offsets)


def test_vectorised_and_traced_evaluation_agree_with_scalars():
    sw = Swizzle(3, 4, 3)
    offsets = np.arange(2048, dtype=np.int32)
    assert np.array_equal(sw(offsets), [sw(int(i)) for i in offsets])
    assert sw(BitExpr("x")).text == "(x ^ ((x >> 3) & 112))"
    assert Swizzle(0, 4, 3)(BitExpr("x")).text == "x"  # identity swizzle emits no ops


@pytest.mark.parametrize("swizzle_bytes, chunk_bits", [(128, 3), (64, 2), (32, 1)])
def test_tma_swizzle_modes_match_documented_pattern(swizzle_bytes, chunk_bits):
    # 16-byte chunk index (its low chunk_bits) XOR the 128-byte row index mod 2**chunk_bits.
    byte = np.arange(8192)
    chunk, row = (byte >> 4) & ((1 << chunk_bits) - 1), (byte >> 7) & ((1 << chunk_bits) - 1)
    expected = (byte & ~(((1 << chunk_bits) - 1) << 4)) | ((chunk ^ row) << 4)
    assert np.array_equal(Swizzle.tma(swizzle_bytes, 1).table(8192), expected)
    for elem_bytes in (2, 4, 8, 16):  # element-unit swizzles agree on element-aligned bytes
        sw = Swizzle.tma(swizzle_bytes, elem_bytes)
        aligned = byte[::elem_bytes]
        assert np.array_equal(sw(aligned // elem_bytes) * elem_bytes, expected[::elem_bytes])


def test_sw128b_is_chunk_xor_row_mod_8():
    sw = Swizzle.sw128b(1)
    for row in range(16):
        for chunk in range(8):
            assert sw(row * 128 + chunk * 16 + 5) == row * 128 + (chunk ^ (row % 8)) * 16 + 5


def test_named_constructors():
    assert Swizzle.sw128b(2) == Swizzle(3, 3, 3) == Swizzle.tma(128, kiln.f16)
    assert Swizzle.sw64b(4) == Swizzle(2, 2, 3)
    assert Swizzle.sw32b(kiln.f8e4m3) == Swizzle(1, 4, 3)
    assert Swizzle(3, 4, 3).to_elements(16) == Swizzle(3, 0, 3)


def amd_two_xor_reference(byte: int) -> int:
    byte ^= ((byte >> 9) & 1) << 5
    byte ^= ((byte >> 10) & 1) << 4
    return byte


def test_amd_two_xor_matches_bit_twiddling():
    offsets = np.arange(1 << 13)
    expected = np.array([amd_two_xor_reference(int(b)) for b in offsets])
    assert np.array_equal(AMD_LDS_TWO_XOR.table(1 << 13), expected)
    assert np.array_equal(AMD_LDS_TWO_XOR.inverse()(expected), offsets)
    # f16 elements: bits 4/5 of the byte offset are bits 3/4 of the element offset.
    f16 = AMD_LDS_TWO_XOR.to_elements(2)
    assert np.array_equal(f16(offsets[::2] // 2) * 2, expected[::2])


def test_no_single_swizzle_expresses_the_two_xor_pattern():
    target = AMD_LDS_TWO_XOR.table(1 << 11)
    for bits in range(4):
        for base in range(8):
            for shift in range(bits, 8):
                assert not np.array_equal(Swizzle(bits, base, shift).table(1 << 11), target)


def test_composition_order_and_inverse():
    first, second = Swizzle(2, 0, 2), Swizzle(2, 2, 2)  # second rewrites what first read
    composed = first.then(second)
    offsets = np.arange(composed.span)
    assert np.array_equal(composed(offsets), second(first(offsets)))
    assert not np.array_equal(composed(offsets), first(second(offsets)))
    assert np.array_equal(composed.inverse()(composed(offsets)), offsets)
    assert np.array_equal(np.sort(composed.table()), offsets)
    three = composed.then(Swizzle(1, 5, 1))
    assert isinstance(three, ComposedSwizzle)
    assert np.array_equal(three.inverse()(three.table()), np.arange(three.span))


def test_swizzled_layout_applies_swizzle_after_layout():
    smem = SwizzledLayout(make_layout((64, 64)), Swizzle.sw128b(2))
    rows, cols = np.meshgrid(np.arange(64), np.arange(64), indexing="ij")
    expected = rows * 64 + ((cols // 8) ^ (rows % 8)) * 8 + cols % 8
    assert np.array_equal(smem((rows, cols)), expected)
    assert np.array_equal(np.sort(smem.offsets()), np.arange(64 * 64))
    assert smem.size() == 4096


@pytest.mark.parametrize("make, needle", [
    (lambda: Swizzle(3, 4, 2), "shift < bits"),
    (lambda: Swizzle(-1, 4, 3), "non-negative"),
    (lambda: Swizzle(2.0, 4, 3), "integer"),
    (lambda: Swizzle(3, 40, 30), "past bit"),
    (lambda: Swizzle.tma(256, 2), "TMA swizzle mode"),
    (lambda: Swizzle.sw128b(3), "power of two"),
    (lambda: Swizzle.sw128b(32), "power of two"),
    (lambda: Swizzle(3, 1, 3).to_elements(4), "inside a 4-byte element"),
    (lambda: ComposedSwizzle(Swizzle(1, 4, 3), 7), "must be a swizzle"),
    (lambda: SwizzledLayout(Layout(8), "sw128"), "must be a swizzle"),
])
def test_invalid_swizzles_raise_with_fix(make, needle):
    with pytest.raises(KilnValueError, match=needle) as err:
        make()
    assert "Fix:" in str(err.value) and "test_swizzle.py" in str(err.value)


def test_docstring_examples():
    import doctest

    import kiln.swizzle

    results = doctest.testmod(kiln.swizzle, extraglobs={"make_layout": make_layout})
    assert results.failed == 0
