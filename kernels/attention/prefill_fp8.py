"""FP8 (e4m3) attention prefill on Hopper: what :func:`~.prefill.prefill` runs for f8e4m3
q/k/v, and the descales it takes.

``prefill(q, k, v, descale_q=..., descale_k=..., descale_v=...)`` computes
``softmax(scale * (dq q) (dk k)^T + mask) (dv v)`` in bf16 from e4m3 inputs, every mask, GQA,
sink, softcap and ragged option of the bf16 path included (:mod:`.prefill_hopper_fp8`). A
descale is None (1), a scalar (a Python number or a one-element array), or one per (batch,
head) as in FlashAttention-3: ``[B, Hq]`` for q, ``[B, Hkv]`` for k and v (``B`` is the
number of sequences of a ragged batch).

Example::

    q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q / sq, k / sk, v / sv))
    o = prefill(q8, k8, v8, causal=True, descale_q=sq, descale_k=sk, descale_v=sv)   # bf16
"""

from __future__ import annotations

import math

import numpy as np

import kiln

from .. import runtime
from ..runtime import ArrayLib, contiguous, empty_like, is_torch
from .prefill_hopper_fp8 import make_fp8_kernel
from .prefill_hopper_fp8_config import FP8_DTYPES, HopperFp8PrefillConfig, check_fp8_head_dim

__all__ = ["run_prefill_fp8", "check_descales", "compiled_prefill_fp8"]


def check_descales(dtype_name: str, descales: dict) -> None:
    """Descales are for FP8 inputs only: a KilnError naming the first one given otherwise."""
    if dtype_name in FP8_DTYPES:
        return
    given = [name for name, x in descales.items() if x is not None]
    if given:
        raise kiln.KilnValueError(f"{given[0]} is given for {dtype_name} inputs; descales "
                                  "apply to f8e4m3 q/k/v only",
                                  fix=f"drop {given[0]}, or pass f8e4m3 q, k and v")


def compiled_prefill_fp8(chip, mask, head_dim, head_dim_v, group, sinks, return_lse, softcap,
                        overrides):
    """:func:`~.prefill.compile_prefill` for ``"f8e4m3"`` (sm_90a)."""
    cfg = _config(head_dim, head_dim_v, overrides)
    kernel = make_fp8_kernel(cfg, mask, int(group), bool(sinks), bool(return_lse), softcap)
    return kernel.compile(*_placeholder_args(cfg, group), target=chip.name,
                          num_warps=cfg.num_warps, **_constexprs(cfg, 1))


def run_prefill_fp8(target, q, k, v, sinks, cu_q, cu_k, shapes, mask, scale, softcap,
                    return_lse, descales, *, interpret):
    """Lay out the FP8 operands and descales as the kernel wants them and launch (or
    interpret) it; returns ``o`` (bf16, q's kind) and with ``return_lse`` the LSE."""
    b, hq, hkv, d, dv = (shapes[n] for n in ("batch", "hq", "hkv", "d", "dv"))
    check_fp8_head_dim("q/k head dim", int(d))
    check_fp8_head_dim("v head dim", int(dv))
    ragged = cu_q is not None
    cfg = HopperFp8PrefillConfig.for_head_dim(int(d), int(dv))
    q2 = contiguous(q).reshape((-1, hq, d) if cfg.padded_qk else (-1, hq * d))
    k2 = contiguous(k).reshape((-1, hkv, d) if cfg.padded_qk else (-1, hkv * d))
    v2 = contiguous(v).reshape((-1, hkv, dv) if cfg.padded_v else (-1, hkv * dv))
    lib = ArrayLib(q)
    total_q = q2.shape[0]
    if ragged:
        cu_q_arr, cu_k_arr = (lib.asarray(cu, kiln.i32) for cu in (cu_q, cu_k))
        max_sq, lse_row_mult, lse_head_stride = shapes["max_sq"], 1, total_q
    else:
        sq, sk = q.shape[1], k.shape[1]
        from .prefill import _arange_like  # cached on a torch device: no copy per call

        cu_q_arr, cu_k_arr = (_arange_like(q, b, n) for n in (sq, sk))
        max_sq, lse_row_mult, lse_head_stride = sq, hq, sq
    o2 = empty_like(q, (total_q, hq * dv), kiln.bf16)
    lse = empty_like(q, (max(hq * total_q, 1) if return_lse else 1,), kiln.f32)
    sink_arr = lib.asarray(sinks, kiln.f32) if sinks is not None else \
        empty_like(q, (hq,), kiln.f32)
    scales = [_descale(lib, name, x, b, heads) for (name, x), heads in
              zip(descales.items(), (hq, hkv, hkv))]
    kernel = make_fp8_kernel(cfg, mask, hq // hkv, sinks is not None, return_lse, softcap)
    args = [q2, k2, v2, o2, lse, sink_arr, cu_q_arr, cu_k_arr, *scales,
            float(scale) * math.log2(math.e), lse_row_mult, lse_head_stride]
    q_tiles = -(-max_sq // cfg.block_m)
    grid = (q_tiles, hq, b) if cfg.grid_q_tiles_first(mask) else (hq, q_tiles, b)
    run = runtime.interpret if interpret else runtime.launch
    run(kernel, grid, args, target=target, num_warps=cfg.num_warps, **_constexprs(cfg, hkv))
    o = o2.reshape(*q.shape[:-1], dv)
    if not return_lse:
        return o
    return o, lse.reshape(hq, total_q) if ragged else lse.reshape(b, hq, q.shape[1])


def _descale(lib: ArrayLib, name: str, x, batch: int, heads: int):
    """``x`` as the kernel's flat f32 ``[batch * heads]`` descales (ones for None)."""
    if x is None:
        return lib.full((batch * heads,), 1.0, kiln.f32)
    if isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool):
        values = lib.full((batch * heads,), float(x), kiln.f32)
    elif hasattr(x, "shape") and tuple(x.shape) in ((), (1,), (batch, heads)):
        values = lib.asarray(x, kiln.f32).reshape(-1)
        if values.shape[0] == 1:
            values = values.repeat(batch * heads) if not is_torch(values) else \
                values.expand(batch * heads).contiguous()
    else:
        shape = tuple(x.shape) if hasattr(x, "shape") else type(x).__name__
        raise kiln.KilnValueError(f"{name} has shape {shape}; expected a scalar or "
                                  f"[{batch}, {heads}] (batch, heads)",
                                  fix=f"pass one descale, or one per (batch, head) as "
                                      "FlashAttention-3 does")
    return values


def _config(head_dim, head_dim_v, overrides) -> HopperFp8PrefillConfig:
    from dataclasses import replace

    return replace(HopperFp8PrefillConfig.for_head_dim(head_dim, head_dim_v), **overrides)


def _constexprs(cfg: HopperFp8PrefillConfig, num_kv_heads: int) -> dict:
    return dict(HKV=num_kv_heads, STAGES=cfg.stages, RAW_STAGES=cfg.raw_stages,
                PRODUCER_REGS=cfg.producer_registers, CONSUMER_REGS=cfg.consumer_registers)


def _placeholder_args(cfg: HopperFp8PrefillConfig, group):
    """Arrays carrying dtype and rank only: the kernel is specialised on them."""
    fp8 = kiln.f8e4m3.numpy
    x = np.empty((1, cfg.head_dim * group), fp8)
    qk = np.empty((1, group, cfg.head_dim), fp8) if cfg.padded_qk else x
    v = np.empty((1, 1, cfg.dv), fp8) if cfg.padded_v else x
    o = np.empty((1, cfg.dv * group), kiln.bf16.numpy)
    f, i = np.empty(1, np.float32), np.empty(1, np.int32)
    return [qk, qk, v, o, f, f, i, i, f, f, f, 1.0, 1, 1]
