"""Shared tiles laid out for the target's MMA: :func:`operand_tile` (``kiln.tiles.operand_tile``)
allocates one, :func:`operand_layout` says which layout and swizzle it gets — WGMMA's 128-byte
swizzled chunks on sm_90a (:mod:`kiln.tile_gemm_wgmma`), row-major with
:func:`kiln.tiles.operand_swizzle` for ``ldmatrix``/MFMA elsewhere (:mod:`kiln.tile_gemm`).

Example::

    a_s = [kiln.tiles.operand_tile((128, 64), kiln.bf16, "a") for _ in range(STAGES)]
"""

from __future__ import annotations

from typing import Any

from .core import dtypes as dt
from .core.errors import KilnValueError
from .shared import dynamic_shared
from .shared_tile import SharedTile
from .swizzle import Swizzle
from .tile_gemm import operand_swizzle
from .tile_gemm_wgmma import ATOM_BYTES, chunked_layout, wgmma_operand


def operand_layout(shape: tuple[int, int], dtype: Any, operand: str, target=None):
    """``(layout, swizzle, wgmma)`` of :func:`operand_tile` for ``target`` (default: the
    kernel's): WGMMA's chunks (``wgmma`` True) or row-major with ``operand_swizzle``.

    Example: ``operand_layout((128, 64), kiln.bf16, "a", get_target("sm_90a"))``."""
    if operand not in ("a", "b"):
        raise KilnValueError(f"operand must be 'a' or 'b', got {operand!r}",
                             fix="'a' for the BM x BK tile, 'b' for the BK x BN tile")
    dtype = dt.dtype(dtype)
    if wgmma_operand(shape, dtype, operand, target):
        layout = chunked_layout(shape[0], shape[1], dtype)
        return layout, Swizzle.sw128b(dtype.itemsize), True
    return None, operand_swizzle(shape, dtype), False


def operand_tile(shape: tuple[int, int], dtype: Any, operand: str) -> SharedTile:
    """A ``shape`` SharedTile (its own dynamic shared memory, 1024-byte aligned) laid out for
    operand ``"a"`` (``BM x BK``) or ``"b"`` (``BK x BN``) of :func:`kiln.gemm` on this target:
    WGMMA's 128-byte-swizzled 64-column chunks (:mod:`kiln.tile_gemm_wgmma`) on sm_90a where
    the shape allows (64-column multiples of bf16/f16, ``BN <= 256``), else row-major with
    :func:`kiln.tiles.operand_swizzle` (``ldmatrix``/MFMA reads free of bank conflicts). Each
    call is its own allocation, so the waits of a pipeline's stages are told apart.

    Example: ``a_s = [kiln.tiles.operand_tile((128, 64), kiln.bf16, "a") for _ in range(3)]``.
    """
    layout, swizzle, is_wgmma = operand_layout(shape, dtype, operand)
    flat = dynamic_shared((shape[0] * shape[1],), dtype, align=ATOM_BYTES)
    tile = SharedTile.view(flat, shape, layout, swizzle)
    tile.wgmma_operand = operand if is_wgmma else None
    return tile
