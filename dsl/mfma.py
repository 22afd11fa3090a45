"""AMD MFMA atoms (CDNA3 ``gfx942``, CDNA4 ``gfx950``): one wave's ``C += A @ B`` in registers.

Each atom wraps upstream ``amdgpu.mfma`` (lowered by ``convert-amdgpu-to-rocdl{chipset=...}``
to the ``rocdl.mfma.*`` intrinsic of the chip) and is registered with :mod:`kiln.mma`, so
``kiln.mma.atom(32, 32, 16, kiln.bf16)`` finds it when tracing for gfx950::

    atom = kiln.mma.atom(32, 32, 16, kiln.bf16)      # v_mfma_f32_32x32x16_bf16
    c = atom(a_frag, b_frag, c_frag)   # vector<8xbf16>, vector<8xbf16>, vector<16xf32>

Supported (single-block MFMAs, wave64, f32 accumulators):

========  =====================================  ==========================================
chip      bf16 / f16                             fp8 (f8e4m3 / f8e5m2, A and B may differ)
========  =====================================  ==========================================
gfx942    32x32x8, 16x16x16                      none: gfx942's fp8 is the FNUZ variant, which
                                                 has no Kiln dtype
gfx950    32x32x8, 16x16x16, 32x32x16, 16x16x32  16x16x32, 32x32x16, 16x16x128, 32x32x64
========  =====================================  ==========================================

The fp8 ``16x16x128``/``32x32x64`` shapes are gfx950's ``v_mfma_f32_*_f8f6f4``: upstream picks
the unscaled form and encodes each operand's fp8 format in ``cbsz``/``blgp``.

Fragment layouts (lane ``l`` of 64; ``kpl = m * k / 64`` values per lane, see
:func:`operand_a_layout`): A (``m x k``) lane ``l`` holds row ``l % m``, columns
``(l // m) * kpl + v``; B (``k x n``) holds column ``l % n``, rows ``(l // n) * kpl + v``; C is
:func:`kiln.layout.mfma_32x32_accumulator` / :func:`kiln.layout.mfma_16x16_accumulator`. Source:
AMD Matrix Instruction Calculator (``--detail-instruction``) and the CDNA3/CDNA4 ISA guides,
"Matrix fused-multiply-add (MFMA)". Interpreter semantics of ``amdgpu.mfma``: gather every
lane's fragments into A, B and C tiles with these layouts, ``D = A @ B + C`` in f32, scatter D
back with the C layout.
"""

from __future__ import annotations

import functools

from typing import Any

from mlir.dialects import amdgpu, vector

from . import mma
from .amd.buffer import BufferTensor
from .core.dtypes import DType, bf16, f8e4m3, f8e5m2, f16, f32
from .core.errors import KilnTypeError, KilnValueError, UnsupportedError
from .layout import (Layout, ThreadValueLayout, concat_modes, mfma_16x16_accumulator,
                     mfma_32x32_accumulator)
from .ops import lane_id, where
from .values import Value, cast

WAVE = 64
GFX942_SHAPES = ((32, 32, 8), (16, 16, 16))
GFX950_HALF_SHAPES = GFX942_SHAPES + ((32, 32, 16), (16, 16, 32))
GFX950_FP8_SHAPES = ((16, 16, 32), (32, 32, 16), (16, 16, 128), (32, 32, 64))
FP8_DTYPES = (f8e4m3, f8e5m2)


def values_per_lane(m: int, k: int) -> int:
    """How many A (and B, since m == n) elements each of the 64 lanes holds: ``m * k / 64``."""
    return m * k // WAVE


@functools.lru_cache(maxsize=None)  # immutable; built per atom and per tile
def operand_a_layout(m: int, k: int) -> ThreadValueLayout:
    """The A fragment of a single-block ``m x n x k`` MFMA, as a ``(lane, value) -> (row, col)``
    layout of the ``m x k`` tile: row ``l % m``, column ``(l // m) * kpl + v``.

    Example: ``operand_a_layout(32, 16)(33, 2) == (1, 10)`` (lane 33 is row 1, k 8..15).
    """
    kpl = values_per_lane(m, k)
    lanes = Layout((m, WAVE // m), (k, kpl))
    return ThreadValueLayout(concat_modes(lanes, Layout(kpl, 1)), (m, k))


@functools.lru_cache(maxsize=None)  # immutable; built per atom and per tile
def operand_b_layout(k: int, n: int) -> ThreadValueLayout:
    """The B fragment (``k x n`` tile): column ``l % n``, rows ``(l // n) * kpl + v``.

    Example: ``operand_b_layout(16, 32)(33, 2) == (10, 1)``.
    """
    kpl = values_per_lane(n, k)
    lanes = Layout((n, WAVE // n), (1, kpl * n))
    return ThreadValueLayout(concat_modes(lanes, Layout(kpl, n)), (k, n))


def _accumulator_layout(m: int) -> ThreadValueLayout:
    return mfma_32x32_accumulator() if m == 32 else mfma_16x16_accumulator()


def instruction_name(m: int, n: int, k: int, a: DType, b: DType) -> str:
    """The ISA mnemonic the atom becomes, e.g. ``v_mfma_f32_32x32x16_bf16``."""
    if a.is_fp8 and k in (64, 128):
        return f"v_mfma_f32_{m}x{n}x{k}_f8f6f4"
    if a.is_fp8:
        fmt = {f8e4m3: "fp8", f8e5m2: "bf8"}
        return f"v_mfma_f32_{m}x{n}x{k}_{fmt[a]}_{fmt[b]}"
    return f"v_mfma_f32_{m}x{n}x{k}_{a.name}"


class MfmaAtom(mma.MmaAtom):
    """One ``amdgpu.mfma`` shape/dtype combination (see the module docstring for the table)."""
    def __call__(self, a, b, c):
        """``c + a @ b`` for this lane's fragments; returns the new C fragment (f32 vector).

        Example: ``c = atom(a_frag, b_frag, c)`` inside a ``@kiln.kernel`` for gfx950.
        """
        spec = self.spec
        chip = mma._resolve_target(None)
        if not chip.has(spec.feature):
            raise UnsupportedError(
                f"{instruction_name(spec.m, spec.n, spec.k, spec.a_dtype, spec.b_dtype)} "
                f"({spec.describe()}) does not exist on {chip.name}",
                fix=f"compile for {', '.join(spec.chips)}, or use a {chip.name} MFMA: "
                    f"{mma._summary(mma.atoms_for(chip))}")
        self.check_fragments(a, b, c)
        return Value(amdgpu.mfma(spec.m, spec.n, spec.k, a.ir, b.ir, c.ir), f32)


def _atom(m: int, n: int, k: int, a: DType, b: DType, feature: str) -> MfmaAtom:
    suffix = a.name if a is b else f"{a.name}_{b.name}"
    spec = mma.MmaAtomSpec(
        name=f"mfma_f32_{m}x{n}x{k}_{suffix}", vendor="amd", m=m, n=n, k=k, a_dtype=a,
        b_dtype=b, acc_dtype=f32, threads=WAVE, a_layout=operand_a_layout(m, k),
        b_layout=operand_b_layout(k, n), c_layout=_accumulator_layout(m), feature=feature)
    return MfmaAtom(spec)


@functools.cache  # kiln.mfma.ATOMS and the registry hold the same atoms
def _all_atoms() -> tuple[MfmaAtom, ...]:
    atoms = []
    for dt in (bf16, f16):
        for shape in GFX950_HALF_SHAPES:
            feature = "gfx9" if shape in GFX942_SHAPES else "gfx950"  # gfx942 and gfx950, or gfx950
            atoms.append(_atom(*shape, dt, dt, feature))
    for a in FP8_DTYPES:
        for b in FP8_DTYPES:
            atoms.extend(_atom(*shape, a, b, "gfx950") for shape in GFX950_FP8_SHAPES)
    return tuple(atoms)


mma.register_atoms(_all_atoms)


def __getattr__(name: str) -> Any:
    """``kiln.mfma.ATOMS``: every MFMA atom (a tuple), built on first use like the registry's."""
    if name == "ATOMS":
        return _all_atoms()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


ROWS_PER_GROUP = 4  # accumulator values 4q..4q+3 are 4 consecutive rows of one column


def store_accumulator(c: Value, dst, row0: Any, col0: Any, *, transposed: bool = False,
                      limits: tuple | None = None,
                      b_layout: ThreadValueLayout | None = None) -> None:
    """Write this lane's 32x32 or 16x16 accumulator fragment ``c`` into the 2-D tensor ``dst``
    with the tile's corner at ``(row0, col0)``, converted to ``dst``'s dtype.

    ``transposed=True`` says the fragment holds the tile's transpose (the MFMA was issued as
    ``B^T A^T``): then each group of 4 values is 4 consecutive columns of one ``dst`` row and is
    written with one 4-wide vector store. ``limits=(rows, cols)`` drops elements past them; it
    needs a :func:`kiln.amd_buffer.buffer` view (out-of-range stores are dropped by hardware, so
    a store outside the limits is redirected to row ``rows``) and, with ``transposed``, ``cols``
    a multiple of 4.

    ``b_layout`` is the layout of the B fragments the MFMA consumed when it is not the atom's
    own (e.g. :meth:`kiln.loader.TiledMmaLoader.b_tr_layout`, whose columns are permuted): each
    lane's C column is the B column that lane held. Not with ``transposed``.

    Example: ``store_accumulator(acc, c_buf, m0, n0, transposed=True, limits=(M, N))``.
    """
    if not isinstance(c, Value) or c.dtype is not f32 or c.shape not in ((16,), (4,)):
        raise KilnTypeError(f"store_accumulator needs a 32x32 (vector<16xf32>) or 16x16 "
                            f"(vector<4xf32>) MFMA accumulator, got {c!r}",
                            fix="pass the value returned by an MFMA atom")
    if getattr(dst, "rank", None) != 2:
        raise KilnTypeError(f"store_accumulator writes a 2-D tensor, got {dst!r}",
                            fix="pass a 2-D kiln.Tensor or kiln.amd_buffer.buffer view")
    if limits is not None and not isinstance(dst, BufferTensor):
        raise KilnValueError("store_accumulator(limits=...) needs a buffer view to drop "
                             "out-of-range stores", fix="pass kiln.amd_buffer.buffer(c)")
    if b_layout is not None and transposed:
        raise KilnValueError("store_accumulator(b_layout=...) re-maps C columns, which a "
                             "transposed fragment does not have",
                             fix="issue the MFMA as A @ B to use permuted B columns")
    m = 32 if c.shape == (16,) else 16
    layout = _accumulator_layout(m)
    lane = lane_id()
    data = cast(c, dst.dtype)
    for group in range(c.shape[0] // ROWS_PER_GROUP):
        tile_row, tile_col = layout(lane, group * ROWS_PER_GROUP)
        first = group * ROWS_PER_GROUP
        part = Value(vector.shuffle(data.ir, data.ir, list(range(first, first + ROWS_PER_GROUP))),
                     dst.dtype)
        if transposed:
            row, col = row0 + tile_col, col0 + tile_row
            if limits is not None:
                row = where((row < limits[0]) & (col < limits[1]), row, limits[0])
            dst.store(row, col, part)
            continue
        if b_layout is not None:
            tile_col = b_layout(lane, 0)[1]
        for i in range(ROWS_PER_GROUP):
            row, col = row0 + tile_row + i, col0 + tile_col
            if limits is not None:
                row = where((row < limits[0]) & (col < limits[1]), row, limits[0])
            dst[row, col] = Value(vector.extract(part.ir, [], [i]), dst.dtype)
