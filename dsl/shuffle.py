"""Cross-lane exchange: butterfly (XOR) shuffles and the reductions built from them.

``xor_shuffle(x, mask)`` returns, in lane ``l``, the value ``x`` holds in lane ``l ^ mask``
(within one warp / wavefront). It picks the cheapest instruction per vendor and mask:

=================  =========================================================================
NVIDIA             ``gpu.shuffle xor`` (PTX ``shfl.sync.bfly.b32``)
AMD, mask 1 or 2   ``amdgpu.dpp`` ``quad_perm`` (a DPP modifier on the consuming VALU op)
AMD, mask 4..16    ``rocdl.ds_swizzle`` in bit mode (``and=0x1f, or=0, xor=mask``): no LDS
                   traffic, no address VGPR
AMD, mask 32       ``gpu.shuffle xor``: ds_swizzle stays within 32 lanes; LLVM emits
                   ``v_permlane32_swap`` on gfx950, ``ds_bpermute_b32`` on gfx942
=================  =========================================================================

Values are 32-bit scalars (f32 or i32). Example: the sum over the 4 lanes of each quad::

    s = kiln.shuffle.butterfly_reduce(x, (1, 2), lambda a, b: a + b)
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from mlir import ir
from mlir.dialects import amdgpu, arith, gpu, nvvm, rocdl

from . import builder
from .core import dtypes as dt
from .core.errors import KilnTypeError, KilnValueError
from .values import Value, constant

_DPP_QUAD_PERMS = {1: [1, 0, 3, 2], 2: [2, 3, 0, 1]}
_DS_SWIZZLE_AND_ALL = 0x1F  # bit-mode ds_swizzle: lane = ((lane & and) | or) ^ xor within 32


def ds_swizzle_xor_offset(mask: int) -> int:
    """The ``ds_swizzle`` bit-mode offset for ``lane ^ mask`` (``and`` bits 0-4, ``or`` 5-9,
    ``xor`` 10-14, bit 15 clear). Example: ``ds_swizzle_xor_offset(4) == 0x101F``."""
    return _DS_SWIZZLE_AND_ALL | (mask << 10)


def _check(x: Any, mask: int) -> Value:
    if not isinstance(x, Value) or x.shape or x.dtype not in (dt.f32, dt.i32):
        raise KilnTypeError(f"xor_shuffle needs a scalar f32 or i32 value, got {x!r}",
                            fix="shuffle 32-bit scalars; kiln.cast narrower values to f32 first")
    warp = builder.current_target().warp_size
    if not isinstance(mask, int) or isinstance(mask, bool) or not 0 < mask < warp \
            or mask & (mask - 1):
        raise KilnValueError(f"xor_shuffle mask must be a power of two below the warp size "
                             f"{warp}, got {mask!r}", fix="use 1, 2, 4, ..., warp_size // 2")
    return x


def _gpu_shuffle(x: Value, mask: int, width: int) -> Value:
    i32 = ir.IntegerType.get_signless(32)
    shuffled, _valid = gpu.shuffle(x.ir, arith.constant(i32, mask), arith.constant(i32, width),
                                   gpu.ShuffleMode.XOR)
    return Value(shuffled, x.dtype)


def xor_shuffle(x: Value, mask: int) -> Value:
    """``x`` from lane ``lane ^ mask`` of the same warp/wavefront (see the module table).

    Example: ``other = kiln.shuffle.xor_shuffle(m, 16)``.
    """
    _check(x, mask)
    target = builder.current_target()
    if target.is_nvidia or mask == 32:
        return _gpu_shuffle(x, mask, target.warp_size)
    if mask in _DPP_QUAD_PERMS:
        i32 = ir.IntegerType.get_signless(32)
        perm = ir.ArrayAttr.get([ir.IntegerAttr.get(i32, p) for p in _DPP_QUAD_PERMS[mask]])
        return Value(amdgpu.dpp(x.ir, x.ir, amdgpu.DPPPerm.quad_perm, perm_argument=perm),
                     x.dtype)
    i32 = ir.IntegerType.get_signless(32)
    bits = x.ir if x.dtype is dt.i32 else arith.bitcast(i32, x.ir)
    swizzled = rocdl.ds_swizzle(i32, bits, constant(ds_swizzle_xor_offset(mask), dt.i32).ir)
    return Value(swizzled if x.dtype is dt.i32 else arith.bitcast(x.ir.type, swizzled), x.dtype)


def butterfly_reduce(x: Value, masks: Iterable[int], combine: Callable[[Value, Value], Value]
                     ) -> Value:
    """Combine ``x`` over the lanes ``lane ^ m`` for every subset of ``masks`` (each a power of
    two): after the call every lane of each such group holds the same result.

    Example: ``row_max = butterfly_reduce(m, (1, 2), kiln.maximum)`` (max over a quad).
    """
    for mask in masks:
        x = combine(x, xor_shuffle(x, mask))
    return x


def uniform(x: Value) -> Value:
    """``x`` as the first active lane holds it, known to be equal in every lane of the warp.

    On AMD this is ``gpu.subgroup_broadcast first_active_lane`` (``v_readfirstlane_b32``): the
    value moves to a scalar register, so an ``if`` on it becomes a scalar branch instead of an
    exec-masked region. NVIDIA has no scalar register file; ``x`` is returned unchanged.
    Use it on values a butterfly reduction already made equal across lanes.

    Example: ``any_lane = kiln.shuffle.uniform(butterfly_reduce(flag, masks, or_)) != 0``.
    """
    if not isinstance(x, Value) or x.shape or x.dtype not in (dt.f32, dt.i32):
        raise KilnTypeError(f"uniform needs a scalar f32 or i32 value, got {x!r}",
                            fix="broadcast 32-bit scalars")
    if builder.current_target().is_nvidia:
        return x
    return Value(gpu.subgroup_broadcast(x.ir, gpu.BroadcastType.first_active_lane), x.dtype)


def any_lane(x: Value) -> Value:
    """True in every lane when ``x`` (an i32 or a bool) is nonzero in some lane of the warp.

    NVIDIA: one ``vote.sync.any.pred`` over the full warp. AMD: an OR butterfly over the
    wavefront, then :func:`uniform` (so an ``if`` on the result is a scalar branch). Every lane
    of the warp must call it. Example: ``if kiln.shuffle.any_lane(m_new - m_old > 8.0): ...``
    """
    if not isinstance(x, Value) or x.shape or x.dtype not in (dt.i32, dt.i1):
        raise KilnTypeError(f"any_lane needs a scalar i32 or bool value, got {x!r}",
                            fix="compare first, e.g. any_lane(x > threshold)")
    target = builder.current_target()
    if target.is_nvidia:
        flag = x if x.dtype is dt.i1 else x != 0
        i32 = ir.IntegerType.get_signless(32)
        return Value(nvvm.vote_sync(ir.IntegerType.get_signless(1), arith.constant(i32, -1),
                                    flag.ir, nvvm.VoteSyncKind.any), dt.i1)
    word = x if x.dtype is dt.i32 else Value(arith.extui(ir.IntegerType.get_signless(32), x.ir),
                                             dt.i32)
    masks = [1 << b for b in range(target.warp_size.bit_length() - 1)]
    return uniform(butterfly_reduce(word, masks, lambda a, b: a | b)) != 0
