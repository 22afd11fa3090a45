"""XOR swizzles: bank-conflict-avoiding permutations of shared-memory offsets, CuTe style.

``Swizzle(bits, base, shift)`` XORs the ``bits``-wide bit field that starts at bit
``base + shift`` into the field that starts at bit ``base``::

    offset ^ ((offset >> shift) & (((1 << bits) - 1) << base))

Example: ``Swizzle(3, 4, 3)`` on byte offsets is the NVIDIA 128-byte swizzle: the 16-byte chunk
index (bits 4..6) is XORed with the 128-byte row index modulo 8 (bits 7..9)::

    >>> Swizzle(3, 4, 3)(1 * 128 + 2 * 16)      # row 1, chunk 2 -> chunk 3
    176

``shift >= bits`` is required: the field read and the field written then do not overlap, the
read field is left unchanged, and so every swizzle is an involution (its own inverse) and a
permutation of each aligned block of ``span`` offsets. Patterns that need two XORs (AMD's LDS
layout ``bit5 ^= bit9`` then ``bit4 ^= bit10``) are chained with :meth:`Swizzle.then`.

Evaluation uses only ``>> & ^``, so a swizzle applies to Python ints, numpy integer arrays and
traced Kiln values alike.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Union

import numpy as np

from .core.errors import KilnValueError
from .layout import Layout

_MAX_BIT = 62  # offsets must stay representable in int64 (numpy evaluation)


def _checked_int(value: Any, what: str) -> int:
    if isinstance(value, bool):
        raise KilnValueError(f"swizzle {what} must be an integer, got {value!r}",
                             fix="use plain Python integers")
    try:
        value = operator.index(value)
    except TypeError:
        raise KilnValueError(f"swizzle {what} must be an integer, got {value!r}",
                             fix="use plain Python integers") from None
    if value < 0:
        raise KilnValueError(f"swizzle {what} must be non-negative, got {value}",
                             fix=f"use a {what} >= 0")
    return value


def _log2_elem_bytes(elem_bytes: Any) -> int:
    """log2 of an element size given in bytes or as a dtype (anything with ``itemsize``)."""
    size = getattr(elem_bytes, "itemsize", elem_bytes)
    size = _checked_int(size, "element size")
    if size == 0 or size & (size - 1) or size > 16:
        raise KilnValueError(f"element size must be a power of two from 1 to 16 bytes, got {size}",
                             fix="pass the element size in bytes, e.g. 2 for f16, or a kiln dtype")
    return size.bit_length() - 1


@dataclass(frozen=True)
class Swizzle:
    """``offset ^= ((offset >> (base + shift)) & mask(bits)) << base`` (see the module docstring).

    Example: the 128-byte swizzle of a row-major f16 tile in element units::

        >>> sw = Swizzle.sw128b(2)          # Swizzle(3, 3, 3)
        >>> sw(64 + 8)                      # row 1, chunk 1 -> chunk 0
        64
    """

    bits: int
    base: int
    shift: int

    def __post_init__(self):
        bits = _checked_int(self.bits, "bits")
        base = _checked_int(self.base, "base")
        shift = _checked_int(self.shift, "shift")
        if shift < bits:
            raise KilnValueError(
                f"Swizzle(bits={bits}, base={base}, shift={shift}) reads bits it also writes "
                "(shift < bits), so it would not be an involution",
                fix="use shift >= bits, or chain two swizzles with .then()")
        if base + shift + bits > _MAX_BIT:
            raise KilnValueError(f"Swizzle(bits={bits}, base={base}, shift={shift}) reaches past "
                                 f"bit {_MAX_BIT}", fix="use smaller base/shift values")
        object.__setattr__(self, "bits", bits)
        object.__setattr__(self, "base", base)
        object.__setattr__(self, "shift", shift)

    @classmethod
    def tma(cls, swizzle_bytes: int, elem_bytes: Any) -> "Swizzle":
        """The NVIDIA TMA/WGMMA swizzle mode of ``swizzle_bytes`` (32, 64 or 128), in units of
        ``elem_bytes``-sized elements (an int or a kiln dtype).

        On byte offsets the modes are ``Swizzle(1, 4, 3)`` (32B), ``Swizzle(2, 4, 3)`` (64B) and
        ``Swizzle(3, 4, 3)`` (128B): 16-byte chunk bits XORed with the bits 3 higher. See
        CUtensorMapSwizzle in the CUDA driver API and PTX "Shared Memory Matrix Layout" for wgmma.

        Example: ``Swizzle.tma(128, kiln.f16) == Swizzle(3, 3, 3)``.
        """
        modes = {32: 1, 64: 2, 128: 3}
        if swizzle_bytes not in modes:
            raise KilnValueError(f"unknown TMA swizzle mode {swizzle_bytes!r}",
                                 fix="use 32, 64 or 128 (bytes)")
        return cls(modes[swizzle_bytes], 4, 3).to_elements(elem_bytes)

    @classmethod
    def sw128b(cls, elem_bytes: Any) -> "Swizzle":
        """The TMA/WGMMA 128-byte swizzle in element units: ``Swizzle.tma(128, elem_bytes)``."""
        return cls.tma(128, elem_bytes)

    @classmethod
    def sw64b(cls, elem_bytes: Any) -> "Swizzle":
        """The TMA/WGMMA 64-byte swizzle in element units: ``Swizzle.tma(64, elem_bytes)``."""
        return cls.tma(64, elem_bytes)

    @classmethod
    def sw32b(cls, elem_bytes: Any) -> "Swizzle":
        """The TMA/WGMMA 32-byte swizzle in element units: ``Swizzle.tma(32, elem_bytes)``."""
        return cls.tma(32, elem_bytes)

    @property
    def span(self) -> int:
        """Size of the aligned blocks the swizzle permutes (it never moves an offset out of its
        block): ``1 << (base + shift + bits)``."""
        return 1 << (self.base + self.shift + self.bits)

    def __call__(self, offset: Any) -> Any:
        """The swizzled offset (int, numpy integer array or traced value)."""
        if self.bits == 0:
            return offset
        write_mask = ((1 << self.bits) - 1) << self.base
        return offset ^ ((offset >> self.shift) & write_mask)

    def inverse(self) -> "Swizzle":
        """The inverse permutation: the swizzle itself (it is an involution)."""
        return self

    def then(self, other: "AnySwizzle") -> "ComposedSwizzle":
        """Apply ``self`` first, then ``other``: ``self.then(other)(x) == other(self(x))``."""
        return ComposedSwizzle(self, other)

    def to_elements(self, elem_bytes: Any) -> "Swizzle":
        """This byte-offset swizzle re-expressed on offsets counted in ``elem_bytes`` elements.

        Example: ``Swizzle(3, 4, 3).to_elements(4) == Swizzle(3, 2, 3)``.
        """
        log2 = _log2_elem_bytes(elem_bytes)
        if self.bits and self.base < log2:
            raise KilnValueError(
                f"{self} permutes bytes inside a {1 << log2}-byte element",
                fix="keep the swizzle on byte offsets, or use a smaller element size")
        return Swizzle(self.bits, max(self.base - log2, 0), self.shift)

    def table(self, n: int | None = None) -> np.ndarray:
        """``[self(i) for i in range(n)]`` as an int64 array (``n`` defaults to ``span``)."""
        return np.asarray(self(np.arange(self.span if n is None else n, dtype=np.int64)))


@dataclass(frozen=True)
class ComposedSwizzle:
    """Two swizzles applied in order: ``first``, then ``second``.

    Needed where one XOR field is not enough, e.g. :data:`AMD_LDS_TWO_XOR`.

    Example::

        >>> both = Swizzle(1, 5, 4).then(Swizzle(1, 4, 6))
        >>> both(1 << 9), both(1 << 10)      # bit 9 sets bit 5, bit 10 sets bit 4
        (544, 1040)
    """

    first: "AnySwizzle"
    second: "AnySwizzle"

    def __post_init__(self):
        for name in ("first", "second"):
            if not isinstance(getattr(self, name), (Swizzle, ComposedSwizzle)):
                raise KilnValueError(f"ComposedSwizzle.{name} must be a swizzle, got "
                                     f"{getattr(self, name)!r}", fix="pass Swizzle objects")

    @property
    def span(self) -> int:
        """Size of the aligned blocks both swizzles keep offsets inside."""
        return max(self.first.span, self.second.span)

    def __call__(self, offset: Any) -> Any:
        return self.second(self.first(offset))

    def inverse(self) -> "ComposedSwizzle":
        """Undo ``second``, then undo ``first``."""
        return ComposedSwizzle(self.second.inverse(), self.first.inverse())

    def then(self, other: "AnySwizzle") -> "ComposedSwizzle":
        """Apply ``self`` first, then ``other``."""
        return ComposedSwizzle(self, other)

    def to_elements(self, elem_bytes: Any) -> "ComposedSwizzle":
        """Both stages re-expressed on element offsets (see :meth:`Swizzle.to_elements`)."""
        return ComposedSwizzle(self.first.to_elements(elem_bytes),
                               self.second.to_elements(elem_bytes))

    def table(self, n: int | None = None) -> np.ndarray:
        """``[self(i) for i in range(n)]`` as an int64 array (``n`` defaults to ``span``)."""
        return np.asarray(self(np.arange(self.span if n is None else n, dtype=np.int64)))


AnySwizzle = Union[Swizzle, ComposedSwizzle]

#: AMD LDS two-XOR pattern on byte offsets: ``bit5 ^= bit9``, then ``bit4 ^= bit10``. No single
#: Swizzle expresses it: one Swizzle moves a contiguous field by one fixed distance, and here the
#: distances differ (9 - 5 = 4, 10 - 4 = 6). Use ``AMD_LDS_TWO_XOR.to_elements(2)`` for f16.
AMD_LDS_TWO_XOR = Swizzle(1, 5, 4).then(Swizzle(1, 4, 6))


@dataclass(frozen=True)
class SwizzledLayout:
    """A layout whose offsets are then swizzled: ``offset = swizzle(layout(coord))``.

    Example: a 64x64 f16 shared-memory tile in the TMA 128-byte swizzle, viewed as 8-row
    by 64-column row-major atoms::

        >>> smem = SwizzledLayout(make_layout((64, 64)), Swizzle.sw128b(2))
        >>> smem((1, 0))                     # row 1, chunk 0 -> chunk 1
        72
    """

    layout: Layout
    swizzle: AnySwizzle

    def __post_init__(self):
        if not isinstance(self.layout, Layout):
            raise KilnValueError(f"SwizzledLayout.layout must be a Layout, got {self.layout!r}",
                                 fix="pass kiln.layout.Layout(shape, stride)")
        if not isinstance(self.swizzle, (Swizzle, ComposedSwizzle)):
            raise KilnValueError(f"SwizzledLayout.swizzle must be a swizzle, got {self.swizzle!r}",
                                 fix="pass a Swizzle or ComposedSwizzle")

    def size(self) -> int:
        return self.layout.size()

    def __call__(self, coord: Any) -> Any:
        return self.swizzle(self.layout(coord))

    def offsets(self) -> np.ndarray:
        """Swizzled offsets of every linear index, as an int64 array."""
        return np.asarray(self.swizzle(self.layout.offsets()), dtype=np.int64)
