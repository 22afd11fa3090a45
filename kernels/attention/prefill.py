"""Attention prefill: the public entries ``prefill`` and ``compile_prefill``.

``prefill`` checks the inputs, then runs the Hopper kernel (:mod:`.prefill_hopper`, ``sm_90a``,
the default) or the gfx950 kernel (:mod:`.prefill_gfx950`, FP8: :mod:`.prefill_gfx950_fp8`;
CPU interpreter only here).

Example::

    from kiln.kernels.attention import prefill
    # q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D]
    o, lse = prefill(q, k, v, causal=True, return_lse=True)
    o = prefill(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)  # ragged q [total, Hq, D]
    o = prefill(q192, k192, v128, causal=True, softcap=30.0)   # D_qk 192, D_v 128, capped
    o = prefill(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv, target="gfx950",
                backend="interpret")                           # f8e4m3 in, bf16 out
    # ragged, with FlashAttention's host-side bounds: no synchronisation, capturable
    o = prefill(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=512, max_seqlen_k=512)
    # FP8 (Hopper): e4m3 q/k/v, descales scalar or [B, Hq] / [B, Hkv]; bf16 output
    o = prefill(q8, k8, v8, causal=True, descale_q=dq, descale_k=dk, descale_v=dv)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

import kiln

from .. import dlpack, runtime
from ..runtime import (ArrayLib, PlanCache, check_backend, check_heads, check_positive,
                       contiguous, dtype_of, empty_like, is_cupy, is_torch, key_of, resolve_target)
from ..one_call import OneCallSlot, address, one_call, output, value
from ..workspaces import SEPARATE
from .prefill_config import check_head_dim
from .prefill_fp8 import check_descales, compiled_prefill_fp8, run_prefill_fp8
from .prefill_hopper import SUPPORTED_DTYPES, HopperPrefillConfig, MaskSpec, make_kernel
from .prefill_hopper_fp8_config import FP8_DTYPES
from .softcap import check_softcap

__all__ = ["prefill", "compile_prefill"]

INTERPRET_CTAS = 3  # a persistent grid in the interpreter: each CTA walks several work items


def compile_prefill(dtype="bf16", *, target, head_dim=128, head_dim_v=None, causal=False,
                    window=None, chunk=None, group=1, sinks=False, return_lse=False, softcap=0.0,
                    **config):
    """Compile (without running) the prefill kernel for ``target``; returns the
    ``CompiledKernel`` (``.asm`` stages, ``.metadata``; on gfx950 also the schedule report).

    ``dtype`` may also be given positionally (``compile_prefill("bf16", target=...)``, the
    shape every ``compile_*`` entry of the kernel library accepts). ``group`` is query heads
    per KV head; ``sinks`` / ``return_lse`` are booleans selecting the
    specialisation; ``head_dim`` is Q/K's and ``head_dim_v`` V's (None: the same; each a
    multiple of 8 up to 256); ``softcap`` > 0 compiles the soft-capped kernel;
    ``config`` keywords are :class:`HopperPrefillConfig` fields on NVIDIA
    (``HopperFp8PrefillConfig`` fields for ``"f8e4m3"``, the FP8 kernel, sm_90a).
    Example: ``compile_prefill(target="sm_90a", head_dim=192, head_dim_v=128).asm["ptx"]``,
    ``compile_prefill("f8e4m3", target="sm_90a", head_dim=128, causal=True)``.
    """
    chip = resolve_target(target)
    name = _dtype_name(dtype)
    mask = _mask_spec(causal, window, chunk)
    softcap = check_softcap(softcap)
    check_head_dim("head_dim", head_dim)
    if head_dim_v is not None:
        check_head_dim("head_dim_v", head_dim_v)
    if chip.is_amd and name in FP8_DTYPES:
        from .prefill_gfx950_fp8 import compile_prefill_gfx950_fp8

        return compile_prefill_gfx950_fp8(head_dim=head_dim, head_dim_v=head_dim_v,
                                          causal=causal, window=window, chunk=chunk,
                                          sinks=True if sinks else None, softcap=softcap,
                                          target=chip.name, **config)
    if chip.is_amd:  # specialised on which masks and sinks exist, not on group or LSE
        from .prefill_gfx950 import compile_prefill_gfx950

        return compile_prefill_gfx950(head_dim=head_dim, head_dim_v=head_dim_v, dtype=name,
                                      causal=causal, window=window, chunk=chunk,
                                      sinks=True if sinks else None, softcap=softcap,
                                      target=chip.name, **config)
    _require_wgmma(chip)
    if name in FP8_DTYPES:  # e4m3: its own kernel (prefill_hopper_fp8)
        return compiled_prefill_fp8(chip, mask, head_dim, head_dim_v, group, sinks, return_lse,
                                   softcap, config)
    cfg = _config(head_dim, head_dim_v, config)
    kernel = make_kernel(name, cfg, mask, int(group), bool(sinks), bool(return_lse), softcap)
    args = _placeholder_args(name, cfg, group)
    return kernel.compile(*args, target=chip.name, num_warps=cfg.num_warps,
                          **_constexprs(cfg, 1))


def prefill(q, k, v, *, causal=False, window=None, chunk=None, sinks=None, scale=None,
            softcap=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
            max_seqlen_k=None, return_lse=False, target=None, backend=None, descale_q=None,
            descale_k=None, descale_v=None):
    """Attention forward ``softmax(scale * q k^T + mask) v``; see the module docs and
    ``tests/attention_reference.py`` for the exact conventions.

    q ``[B, Sq, Hq, D]``, k ``[B, Sk, Hkv, D]``, v ``[B, Sk, Hkv, Dv]`` (or ragged
    ``[total, H, D]`` with int32 ``cu_seqlens_q/k`` of ``B + 1`` prefix sums); bf16 or f16; D and
    Dv multiples of 8 up to 256 (64/128/256 have tuned tiles, the others run on the next
    64-column tile; Dv may differ from D, e.g. DeepSeek's 192/128); ``Hq % Hkv == 0``.
    ``window=(left, right)`` as FlashAttention's ``window_size`` (-1 unbounded); ``chunk=C``
    limits keys to the query's chunk; ``sinks`` are per-head logits of a virtual zero-value key;
    ``scale`` defaults to ``1/sqrt(D)``; ``softcap`` (FlashAttention's, Gemma-2's) replaces
    each scaled score ``s`` by ``softcap * tanh(s / softcap)`` before the mask and softmax
    (0.0 or None: off). Returns ``o`` ``[B, Sq, Hq, Dv]`` in q's dtype, and with
    ``return_lse`` the natural-log LSE ``[B, Hq, Sq]`` (ragged: ``[Hq, total_q]``), f32.

    FP8 (gfx950, interpreter): f8e4m3 q/k/v with FlashAttention-3's descales ``descale_q``
    (a scalar or ``[B, Hq]``), ``descale_k`` / ``descale_v`` (a scalar or ``[B, Hkv]``; None:
    1), so the inputs stand for ``q * descale_q`` etc.; the output is bf16.

    Ragged batches size their grid by the longest query sequence. ``max_seqlen_q`` (and
    ``max_seqlen_k``), host ints as in FlashAttention's ``flash_attn_varlen_func``, give it
    without reading ``cu_seqlens``: the kernel reads the prefix sums on the device, so a call on
    CUDA tensors never synchronises and can be captured in a CUDA graph. They must bound every
    sequence (a longer one's rows past ``max_seqlen_q`` are not written), and the prefix sums on
    a device are then not checked (check them once with a call without ``max_seqlen_q``).
    Without them the prefix sums are copied to the host, checked and measured: a
    synchronisation, which a CUDA-graph capture refuses. Host (numpy, CPU) prefix sums are
    always checked, bounds included; ``max_seqlen_k=0`` launches nothing (no row sees a key).

    Inputs are validated before anything compiles (a :class:`kiln.KilnError` naming the
    argument: kinds, ranks, dtypes, agreeing shapes, ``Hq % Hkv``, ``scale > 0``, the ragged
    prefix sums). Zero-size inputs launch nothing: no query row (``B``, ``Sq``, ``Hq`` or
    ``total_q`` of 0) gives empty outputs; no key (``Sk`` or ``total_k`` of 0) gives ``o = 0``
    and ``lse = -inf`` (a sink's logit with ``sinks``), as for any row that sees no key.
    FP8 (Hopper): f8e4m3 q, k and v (D and Dv multiples of 16) give a bf16 ``o`` of
    ``softmax(scale * (dq q)(dk k)^T) (dv v)`` with ``descale_q/k/v`` each None, a scalar or
    one per (batch, head): ``[B, Hq]`` for q, ``[B, Hkv]`` for k and v (FlashAttention-3's
    convention; :mod:`.prefill_fp8`).

    Example: ``o = prefill(q, k, v, causal=True)`` with torch CUDA tensors.
    """
    call = _ONE_CALL.call
    if call is not None and not SEPARATE.depth:  # one C call (kiln.kernels.one_call)
        made = call(q, k, v, causal, window, chunk, sinks, scale, softcap, cu_seqlens_q,
                    cu_seqlens_k, max_seqlen_q, max_seqlen_k, return_lse, target, backend,
                    descale_q, descale_k, descale_v)
        if made is not None:
            return made
    dense = cu_seqlens_q is None and cu_seqlens_k is None and max_seqlen_q is None and \
        max_seqlen_k is None and descale_q is None and descale_k is None and descale_v is None
    plan = None
    if dense:  # a repeat call of a bound shape class: its plan, found first
        values = (q, k, v, sinks, causal, window, chunk, scale, softcap, return_lse, target,
                  backend)
        guard, plan = _PLANS.last
        if not guard(values):
            plan = _PLANS.find(values)
            if plan is None:
                plan = _new_dense_plan(values)
        if plan:  # one C call: the outputs, the addresses, the launch
            _ONE_CALL.install(plan.calls, "prefill", lambda: _one_call(plan, (
                q, k, v, causal, window, chunk, sinks, scale, softcap, None, None, None, None,
                return_lse, target, backend, None, None, None)))
            bound = plan.bound
            fresh = plan.fresh  # one allocation for o and lse, but in a custom op
            return bound.launch_outputs(fresh.makers if SEPARATE.depth else fresh.fast,
                                        bound.current_stream(), q, k, v,
                                        None, plan.lse_item,
                                        plan.sinks_address if sinks is None else sinks,
                                        *plan.cu_pointers)
    softcap = check_softcap(softcap)  # a float from here on (the key holds what was passed)
    descales = dict(descale_q=descale_q, descale_k=descale_k, descale_v=descale_v)
    fp8 = hasattr(q, "dtype") and _known_dtype_name(q.dtype) in FP8_DTYPES
    if not fp8:
        check_descales(_known_dtype_name(getattr(q, "dtype", None)), descales)
    if dlpack.foreign(q):  # cupy / JAX / DLPack device arrays: zero-copy through torch
        return dlpack.through_torch(prefill, q, k, v, causal=causal, window=window, chunk=chunk,
                                    sinks=sinks, scale=scale, softcap=softcap,
                                    cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                    max_seqlen_q=max_seqlen_q,
                                    max_seqlen_k=max_seqlen_k, return_lse=return_lse,
                                    target=target, backend=backend, **descales)
    chip, shapes, mask, scale = _validate(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, causal,
                                          window, chunk, scale, target, backend,
                                          max_seqlen_q, max_seqlen_k)
    if _without_work(q, k, shapes, cu_seqlens_q is not None) or shapes.get("max_sk") == 0:
        return _outputs_without_work(q, shapes, sinks, cu_seqlens_q is not None, return_lse)
    if chip.is_amd and _dtype_name(q.dtype) in FP8_DTYPES:
        from .prefill_gfx950_fp8 import run_prefill_gfx950_fp8

        out = run_prefill_gfx950_fp8(*(ArrayLib.numpy(x) for x in (q, k, v)), causal=causal,
                                     window=window, chunk=chunk, sinks=_optional_numpy(sinks),
                                     scale=scale, softcap=softcap,
                                     cu_seqlens_q=_optional_numpy(cu_seqlens_q),
                                     cu_seqlens_k=_optional_numpy(cu_seqlens_k),
                                     return_lse=return_lse, backend=backend,
                                     **{n: _optional_numpy(x) for n, x in (
                                         ("descale_q", descale_q), ("descale_k", descale_k),
                                         ("descale_v", descale_v))})
        return _outputs_like(q, out, return_lse)
    if fp8 and not chip.is_amd:
        _require_wgmma(chip)
        if backend == "interpret":
            out = run_prefill_fp8(chip.name, *(ArrayLib.numpy(x) for x in (q, k, v)),
                                  *(_optional_numpy(x) for x in (sinks, cu_seqlens_q,
                                                                 cu_seqlens_k)),
                                  shapes, mask, scale, softcap, return_lse,
                                  {n: _optional_numpy(x) for n, x in descales.items()},
                                  interpret=True)
            return _outputs_like(q, out, return_lse)
        return run_prefill_fp8(chip.name, q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, shapes,
                               mask, scale, softcap, return_lse, descales, interpret=False)
    if chip.is_amd:
        from .prefill_gfx950 import run_prefill_gfx950

        out = run_prefill_gfx950(*(ArrayLib.numpy(x) for x in (q, k, v)), causal=causal,
                                 window=window, chunk=chunk, sinks=_optional_numpy(sinks),
                                 scale=scale, softcap=softcap,
                                 cu_seqlens_q=_optional_numpy(cu_seqlens_q),
                                 cu_seqlens_k=_optional_numpy(cu_seqlens_k),
                                 return_lse=return_lse, backend=backend)
        return _outputs_like(q, out, return_lse)
    _require_wgmma(chip)
    if backend == "interpret":
        arrays = [ArrayLib.numpy(x) for x in (q, k, v)]
        extra = [_optional_numpy(x) for x in (sinks, cu_seqlens_q, cu_seqlens_k)]
        out = _run(chip.name, *arrays, *extra, shapes, mask, scale, softcap, return_lse,
                   interpret=True)
        return _outputs_like(q, out, return_lse)
    return _run(chip.name, q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, shapes, mask, scale,
                softcap, return_lse, interpret=False)


def _run(target, q, k, v, sinks, cu_q, cu_k, shapes, mask, scale, softcap, return_lse, *,
         interpret):
    """Lay out the operands as the kernel wants them and launch (or interpret) it."""
    kernel, args, grid, constexprs, num_warps = _operands(q, k, v, sinks, cu_q, cu_k, shapes,
                                                          mask, scale, softcap, return_lse,
                                                          interpret=interpret)
    run = runtime.interpret if interpret else runtime.launch
    run(kernel, grid, args, target=target, num_warps=num_warps, **constexprs)
    o, lse = args[3].reshape(*q.shape[:-1], shapes["dv"]), args[4]
    if not return_lse:
        return o
    total_q, hq = args[0].shape[0], shapes["hq"]
    return o, lse.reshape(hq, total_q) if cu_q is not None else \
        lse.reshape(shapes["batch"], hq, q.shape[1])


def _operands(q, k, v, sinks, cu_q, cu_k, shapes, mask, scale, softcap, return_lse, *,
              interpret=False, cfg=None):
    """The kernel of this shape class (``cfg``: :meth:`HopperPrefillConfig.for_shape`'s unless
    given), its run-time arguments (fresh ``o`` and ``lse`` included), grid, constexprs and
    warps. A persistent grid has one CTA per SM (``INTERPRET_CTAS`` in the interpreter)."""
    b, hq, hkv, d, dv = (shapes[n] for n in ("batch", "hq", "hkv", "d", "dv"))
    ragged = cu_q is not None
    if cfg is None:
        # Ragged: the longest key sequence (measured, else bounded, else taken as the queries').
        keys = (shapes.get("longest_k") or shapes.get("max_sk") or shapes["max_sq"]) if ragged \
            else k.shape[1]
        cfg = HopperPrefillConfig.for_shape(d, dv, keys, mask.causal)
    # 2-D [rows, H * D] views, or 3-D [rows, H, D] ones whose columns past D read zeros.
    q2 = contiguous(q).reshape((-1, hq, d) if cfg.padded_qk else (-1, hq * d))
    k2 = contiguous(k).reshape((-1, hkv, d) if cfg.padded_qk else (-1, hkv * d))
    v2 = contiguous(v).reshape((-1, hkv, dv) if cfg.padded_v else (-1, hkv * dv))
    total_q = q2.shape[0]
    if ragged:
        cu_q_arr, cu_k_arr = (ArrayLib(q).asarray(cu, kiln.i32) for cu in (cu_q, cu_k))
        max_sq = shapes["max_sq"]
        lse_row_mult, lse_head_stride = 1, total_q
    else:
        sq, sk = q.shape[1], k.shape[1]
        cu_q_arr = _arange_like(q, b, sq)
        cu_k_arr = _arange_like(q, b, sk)
        max_sq = sq
        lse_row_mult, lse_head_stride = hq, sq
    group = hq // hkv
    o2 = empty_like(q, (total_q, hq * dv), kiln.dtype(q.dtype))
    lse = empty_like(q, (max(hq * total_q, 1) if return_lse else 1,), kiln.f32)
    sink_arr = ArrayLib(q).asarray(sinks, kiln.f32) if sinks is not None else \
        empty_like(q, (hq,), kiln.f32)
    kernel = make_kernel(_dtype_name(q.dtype), cfg, mask, group, sinks is not None, return_lse,
                         softcap)
    args = [q2, k2, v2, o2, lse, sink_arr, cu_q_arr, cu_k_arr, float(scale) * math.log2(math.e),
            lse_row_mult, lse_head_stride]
    q_tiles = -(-max_sq // cfg.block_m)
    if cfg.persistent:
        args += [q_tiles, b]
        ctas = INTERPRET_CTAS if interpret else runtime.multiprocessor_count()
        grid = (max(1, min(q_tiles * hq * b, ctas)), 1, 1)
    else:
        grid = (q_tiles, hq, b) if cfg.grid_q_tiles_first(mask) else (hq, q_tiles, b)
    return kernel, args, grid, _constexprs(cfg, hkv), cfg.num_warps


@dataclass(frozen=True)
class _DensePlan:
    """A dense (not ragged) torch prefill of one shape class, bound once: a repeat call is
    one ``launch_outputs`` of the bound launch, which allocates ``o`` (and ``lse``) and writes
    eight addresses into a prepared launch."""

    bound: Any  # kiln.kernels.runtime.bind's launch
    lse_shape: tuple | None  # [B, Hq, Sq] with return_lse, else None
    no_lse: Any  # the one-element LSE the kernel without an LSE output is bound to
    fixed_sinks: Any  # zeros read by no kernel without sinks (kept alive with the plan)
    cu_pointers: tuple[int, int]  # device cu_seqlens of the dense batch (cached, never freed)
    # Fresh o [B, Sq, Hq, Dv] in q's dtype (Dv: v's head dim, 192/128) and, with an LSE, the
    # f32 lse (kiln.kernels.runtime.TorchOutputs on q's device).
    fresh: Any = None
    calls: dict = field(default_factory=dict)  # its one-call object (kiln.kernels.one_call)

    @functools.cached_property
    def lse_item(self):
        """The launch's lse item: None (the fresh lse) with ``return_lse``, else the address
        of :attr:`no_lse`."""
        return None if self.lse_shape is not None else self.no_lse.data_ptr()

    @functools.cached_property
    def sinks_address(self) -> int:
        return self.fixed_sinks.data_ptr()


def _one_call(plan: _DensePlan, values: tuple):
    """The one-call object of a dense plan: ``values`` are :func:`prefill`'s, in order."""
    items = [value(0), value(1), value(2), output(0),
             output(1) if plan.lse_item is None else address(plan.lse_item),
             address(plan.sinks_address) if values[6] is None else value(6),
             *map(address, plan.cu_pointers)]
    return one_call(values, [(plan.bound, items)], stream=plan.bound.current_stream,
                    makers=plan.fresh.fast)


_ONE_CALL = OneCallSlot()  # the one-call object of the last dense plan
# Dense torch plans by the tensors' specs and the options (see kiln.kernels.runtime); False
# marks a shape class that always takes the general path (AMD targets, strided tensors, sinks
# that need converting).
_PLANS = PlanCache("prefill")


def _new_dense_plan(values: tuple) -> _DensePlan | bool | None:
    """The plan of a dense call's new shape class (added to :data:`_PLANS`; False: the general
    path runs the class), or None where no dense plan applies (FP8, the interpreter, arrays
    other than torch tensors)."""
    q, k, v, sinks, causal, window, chunk, scale, softcap, return_lse, target, backend = values
    softcap = check_softcap(softcap)  # a float from here on (the key holds what was passed)
    if backend == "interpret" or not is_torch(q) or _known_dtype_name(q.dtype) in FP8_DTYPES:
        return None
    return _PLANS.add(key_of(values), _make_dense_plan(
        q, k, v, causal, window, chunk, sinks, scale, softcap, return_lse, target, backend),
        values)


def _make_dense_plan(q, k, v, causal, window, chunk, sinks, scale, softcap, return_lse, target,
                     backend) -> _DensePlan | bool:
    """The plan of a dense torch call, or False when the general path must run it."""
    import torch

    chip, shapes, mask, scale = _validate(q, k, v, None, None, sinks, causal, window, chunk,
                                          scale, target, backend)
    if _without_work(q, k, shapes, False) or chip.is_amd or \
            not runtime.bindable(q, k, v, sinks) or \
            (sinks is not None and sinks.dtype != torch.float32):
        return False  # the general path runs it (converting the sinks, or without a kernel)
    _require_wgmma(chip)
    kernel, args, grid, constexprs, num_warps = _operands(
        q.contiguous(), k.contiguous(), v.contiguous(), sinks, None, None, shapes, mask, scale,
        softcap, return_lse)
    bound = runtime.bind(kernel, grid, args, target=chip.name, num_warps=num_warps,
                         **constexprs)
    lse_shape = (shapes["batch"], shapes["hq"], q.shape[1]) if return_lse else None
    outputs = [(q.shape[:-1] + v.shape[-1:], q.dtype)]
    if lse_shape is not None:
        outputs.append((lse_shape, args[4].dtype))
    return _DensePlan(bound=bound, lse_shape=lse_shape, no_lse=args[4], fixed_sinks=args[5],
                      cu_pointers=(args[6].data_ptr(), args[7].data_ptr()),
                      fresh=runtime.TorchOutputs(q, *outputs))


def _validate(q, k, v, cu_q, cu_k, sinks, causal, window, chunk, scale, target, backend,
              max_q=None, max_k=None):
    """The checked chip, shapes, mask and softmax scale of a call (a KilnError on bad input)."""
    chip = resolve_target(target)
    check_backend(backend)
    shapes = _check_inputs(q, k, v, cu_q, cu_k, sinks)
    shapes |= _check_ragged(q, k, cu_q, cu_k, max_q, max_k)
    mask = _mask_spec(causal, window, chunk)
    if scale is None:
        scale = 1.0 / math.sqrt(shapes["d"])
    check_positive("scale", scale, fix="pass a positive softmax scale, or None for 1/sqrt(D)")
    return chip, shapes, mask, scale


def _check_inputs(q, k, v, cu_q, cu_k, sinks) -> dict:
    """Shapes, dtypes and ragged metadata, checked before anything is built."""
    ragged = cu_q is not None or cu_k is not None
    if (cu_q is None) != (cu_k is None):
        raise kiln.KilnValueError("cu_seqlens_q and cu_seqlens_k must be given together",
                                  fix="pass both prefix-sum arrays for a ragged batch, or neither")
    rank = 3 if ragged else 4
    layout = "[total, H, D]" if ragged else "[B, S, H, D]"
    for name, x in (("q", q), ("k", k), ("v", v)):
        dtype_of(name, x)
        if len(x.shape) != rank:
            raise kiln.KilnValueError(f"{name} has shape {tuple(x.shape)}; expected {layout}",
                                      fix="ragged batches take [total, H, D] with cu_seqlens, "
                                          "dense ones [B, S, H, D]")
    names = {n: _dtype_name(x.dtype) for n, x in (("q", q), ("k", k), ("v", v))}
    if len(set(names.values())) != 1 or names["q"] not in SUPPORTED_DTYPES + FP8_DTYPES:
        raise kiln.UnsupportedError(f"q/k/v dtypes {names} are not supported",
                                    fix="pass q, k and v all in one of "
                                        f"{SUPPORTED_DTYPES + FP8_DTYPES}")
    if tuple(k.shape[:-1]) != tuple(v.shape[:-1]):
        raise kiln.KilnValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ",
                                  fix="k and v must have the same shape but for the head dim")
    d, dv, hq, hkv = q.shape[-1], v.shape[-1], q.shape[-2], k.shape[-2]
    check_head_dim("q/k head dim", int(d))
    check_head_dim("v head dim", int(dv))
    if k.shape[-1] != d:
        raise kiln.KilnValueError(f"q's head dim {d} and k's {k.shape[-1]} differ",
                                  fix="q and k need the same head dim (v's may differ)")
    check_heads(hq, hkv, q_name="q", kv_name="k")
    if sinks is not None:
        dtype_of("sinks", sinks)
    if sinks is not None and tuple(sinks.shape) != (hq,):
        raise kiln.KilnValueError(f"sinks has shape {tuple(sinks.shape)}; expected ({hq},)",
                                  fix="pass one sink logit per query head")
    shapes = dict(d=d, dv=dv, hq=hq, hkv=hkv)
    if not ragged and q.shape[0] != k.shape[0]:
        raise kiln.KilnValueError(f"q batch {q.shape[0]} != k batch {k.shape[0]}",
                                  fix="q, k and v need the same batch size")
    return shapes


def _check_ragged(q, k, cu_q, cu_k, max_q, max_k) -> dict:
    """The batch and grid extent: from the prefix sums (read on the host) or, for device
    prefix sums with ``max_seqlen_q``, from their length and the bounds alone."""
    for name, bound in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
        if bound is not None and (isinstance(bound, bool) or
                                  not isinstance(bound, (int, np.integer)) or bound < 0):
            raise kiln.KilnValueError(f"{name}={bound!r} must be an int >= 0",
                                      fix=f"pass the longest sequence's length as {name}, "
                                          "or None")
    if cu_q is None:
        if max_q is not None or max_k is not None:
            raise kiln.KilnValueError("max_seqlen_q/k are given but cu_seqlens_q/k are not",
                                      fix="pass them only with a ragged batch's cu_seqlens")
        return dict(batch=q.shape[0])
    if max_q is not None and _on_device(cu_q) and _on_device(cu_k):
        if len(cu_q.shape) != 1 or tuple(cu_q.shape) != tuple(cu_k.shape) or not cu_q.shape[0]:
            raise kiln.KilnValueError(f"cu_seqlens_q {tuple(cu_q.shape)} / cu_seqlens_k "
                                      f"{tuple(cu_k.shape)} must both have B + 1 entries",
                                      fix="build them as concatenate([[0], cumsum(lengths)])")
        return dict(batch=cu_q.shape[0] - 1, max_sq=max(int(max_q), 1), max_sk=max_k)
    cq, ck = (np.asarray(ArrayLib.numpy(x)).astype(np.int64) for x in (cu_q, cu_k))
    if cq.ndim != 1 or cq.shape != ck.shape or len(cq) < 1 or cq[0] != 0 or ck[0] != 0 \
            or np.any(np.diff(cq) < 0) or np.any(np.diff(ck) < 0) \
            or cq[-1] != q.shape[0] or ck[-1] != k.shape[0]:
        raise kiln.KilnValueError("cu_seqlens_q/k must be non-decreasing prefix sums of B + 1 "
                                  "entries from 0 to the total rows of q and k",
                                  fix="build them as concatenate([[0], cumsum(lengths)])")
    longest_q, longest_k = (int(np.diff(c).max(initial=0)) for c in (cq, ck))
    for name, bound, longest in (("max_seqlen_q", max_q, longest_q),
                                 ("max_seqlen_k", max_k, longest_k)):
        if bound is not None and bound < longest:
            raise kiln.KilnValueError(f"{name}={bound} is below the longest sequence "
                                      f"({longest})", fix=f"pass {name}={longest} or more")
    return dict(batch=len(cq) - 1, max_sq=max(longest_q, 1), max_sk=max_k, longest_k=longest_k)


def _on_device(x) -> bool:
    """A torch CUDA tensor or a cupy array: reading it on the host synchronises."""
    return (is_torch(x) and x.is_cuda) or is_cupy(x)


def _without_work(q, k, shapes, ragged) -> bool:
    """No query row (a zero batch, ``Sq`` or ``Hq``) or no key at all: no kernel runs."""
    rows = q.shape[0] * (1 if ragged else q.shape[1]) * shapes["hq"]
    return rows == 0 or k.shape[0] * (1 if ragged else k.shape[1]) == 0


def _outputs_without_work(q, shapes, sinks, ragged, return_lse):
    """``o`` like q (zeros: a row without keys; bf16 for FP8 inputs) and the LSE: ``-inf``, or
    a sink's logit."""
    out_dtype = kiln.bf16 if _dtype_name(q.dtype) in FP8_DTYPES else kiln.dtype(q.dtype)
    o = empty_like(q, (*q.shape[:-1], shapes["dv"]), out_dtype, fill=0.0)
    if not return_lse:
        return o
    hq = shapes["hq"]
    lse_shape = (hq, q.shape[0]) if ragged else (shapes["batch"], hq, q.shape[1])
    lse = empty_like(q, lse_shape, kiln.f32, fill=-math.inf)
    if sinks is not None:  # the sink is the row's only logit
        heads = [1] * len(lse_shape)
        heads[0 if ragged else 1] = hq
        lse[...] = ArrayLib(q).asarray(sinks, kiln.f32).reshape(heads)
    return o, lse


def _mask_spec(causal, window, chunk) -> MaskSpec:
    left, right = -1, -1
    if window is not None:
        if len(window) != 2 or not all(isinstance(w, (int, np.integer)) and w >= -1
                                       for w in window):
            raise kiln.KilnValueError(f"window={window!r} must be (left, right) ints >= -1",
                                      fix="use FlashAttention's window_size, -1 = unbounded")
        left, right = int(window[0]), int(window[1])
    if chunk is not None and (not isinstance(chunk, (int, np.integer)) or chunk <= 0):
        raise kiln.KilnValueError(f"chunk={chunk!r} must be a positive int",
                                  fix="pass the chunk length in keys, or None")
    return MaskSpec(causal=bool(causal), window_left=left, window_right=right,
                    chunk=int(chunk or 0))


def _config(head_dim, head_dim_v, overrides) -> HopperPrefillConfig:
    return replace(HopperPrefillConfig.for_head_dim(head_dim, head_dim_v), **overrides)


def _constexprs(cfg: HopperPrefillConfig, num_kv_heads: int) -> dict:
    return dict(HKV=num_kv_heads, STAGES=cfg.stages, PRODUCER_REGS=cfg.producer_registers,
                CONSUMER_REGS=cfg.consumer_registers)


def _placeholder_args(name, cfg: HopperPrefillConfig, group):
    """Arrays carrying dtype and rank only: the kernel is specialised on them."""
    x = np.empty((1, cfg.head_dim * group), kiln.dtype(name).numpy)
    qk = np.empty((1, group, cfg.head_dim), x.dtype) if cfg.padded_qk else x
    v = np.empty((1, 1, cfg.dv), x.dtype) if cfg.padded_v else x
    f, i = np.empty(1, np.float32), np.empty(1, np.int32)
    return [qk, qk, v, x, f, f, i, i, 1.0, 1, 1] + ([1, 1] if cfg.persistent else [])


def _require_wgmma(chip):
    if not chip.has_wgmma:
        raise kiln.UnsupportedError(f"the Kiln prefill kernel needs WGMMA (sm_90a); {chip.name} "
                                    "has none", fix="use target='sm_90a', or 'gfx950' on AMD")


def _dtype_name(dtype) -> str:
    return kiln.dtype(dtype).name


def _known_dtype_name(dtype):
    """Kiln's name of ``dtype``, or None for one Kiln does not know (checked later)."""
    try:
        return kiln.dtype(dtype).name
    except (TypeError, ValueError, KeyError):
        return None


def _optional_numpy(x):
    return None if x is None else ArrayLib.numpy(x)


def _outputs_like(template, out, return_lse):
    """Interpreter results (numpy) as tensors of ``template``'s kind and device."""
    lib = ArrayLib(template)
    return tuple(lib.like(x) for x in out) if return_lse else lib.like(out)


def _arange_like(like, batch, length):
    """``cu_seqlens`` of ``batch`` dense sequences of ``length``. On a torch device it is built
    there once per shape: copying it from host memory would synchronise the stream each call."""
    if is_torch(like):
        return _device_offsets(str(like.device), batch, length)
    return np.arange(batch + 1, dtype=np.int32) * length


@functools.lru_cache(maxsize=64)
def _device_offsets(device: str, batch: int, length: int):
    import torch

    return torch.arange(batch + 1, dtype=torch.int32, device=device) * length
