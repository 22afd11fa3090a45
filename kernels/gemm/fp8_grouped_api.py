"""Host side of the grouped FP8 GEMM (:mod:`.fp8_grouped` on sm_90a, the ``grouped=True``
variant of :mod:`.fp8_gfx950` in the interpreter or compile-only): what
:func:`kiln.kernels.gemm.grouped_matmul` runs for f8e4m3/f8e5m2 operands.

Scales (f32; the kind is read off the shape, ``Kb = ceil(K/128)``, ``Nb = ceil(N/128)``):

==============  ===========================  =============================================
kind            ``scale_a``                  ``scale_b`` (B ``[G, N, K]``)
==============  ===========================  =============================================
per tensor      float, 0-d or ``[1]``        float, 0-d, ``[1]``, or ``[G]`` (one per expert)
per row / col   ``[total_M]`` (per token)    ``[G, N]`` (per expert output column)
block           ``[total_M, Kb]`` (1 x 128)  ``[G, Nb, Kb]`` (128 x 128 per expert)
==============  ===========================  =============================================
"""

import numpy as np

import kiln

from .. import runtime
from ..runtime import ArrayLib, Dims, check_backend, contiguous, empty_like, is_torch, \
    resolve_target
from .fp8_api import fp8_output_dtype, padded, require_trans_b, to_numpy
from .fp8_grouped import GROUPED_FP8_CONFIG, grouped_fp8_constexprs, make_grouped_fp8_kernel
from .grouped import table_size
from .scales import blocks, scale_kind

K_ALIGN, N_ALIGN = 16, 8


def grouped_fp8_matmul(a, b, group_offsets, *, trans_b, scale_a, scale_b, out_dtype, target,
                       backend, validate):
    """:func:`kiln.kernels.gemm.grouped_matmul` for FP8 operands (see this module's table)."""
    from .grouped_api import check_group_offsets, group_extents, grouped_tiles

    chip = resolve_target(target)
    dims = Dims()
    dims.tensor("a", a, "total_M K")
    dims.tensor("b", b, "G N K" if trans_b else "G K N")
    dims.tensor("group_offsets", group_offsets, "G_plus_1")
    name, b_name = kiln.dtype(a.dtype).name, kiln.dtype(b.dtype).name
    if b_name != name:
        raise kiln.KilnTypeError(f"grouped_matmul operands must share a dtype, got a: {name} "
                                 f"and b: {b_name}", fix="quantise both to the same FP8 dtype")
    require_trans_b(trans_b, "b[g]")
    groups, total_m, k, n = group_extents(dims, group_offsets)
    _require_kernel(chip)
    out = fp8_output_dtype(out_dtype)
    mode, sa, sb = _grouped_scales(scale_a, scale_b, groups, total_m, n, k, a)
    check_backend(backend)
    if chip.is_amd and backend != "interpret":
        raise kiln.UnsupportedError(f"Kiln cannot run {chip.name} kernels on this machine",
                                    fix="use compile_grouped_matmul(...) to inspect the AMD "
                                        "kernel, or backend='interpret'")
    check_group_offsets(group_offsets, total_m, validate=validate)
    if total_m * n * k == 0:
        return empty_like(a, (total_m, n), kiln.dtype(out), fill=0.0)
    kp, np_ = -(-k // K_ALIGN) * K_ALIGN, -(-n // N_ALIGN) * N_ALIGN
    b_in = padded(b, (groups, np_, kp)).reshape(groups * np_, kp)
    if mode[1] == "col" and np_ != n:  # the padded columns are sliced off
        sb = padded(sb, (groups, np_))
    c = empty_like(a, (total_m, np_), kiln.dtype(out), fill=None if is_torch(a) else np.nan)
    offsets = contiguous(group_offsets)
    args = [padded(a, (total_m, kp)), b_in, c, c, offsets, sa, sb, groups, total_m, np_, kp,
            np_]
    if chip.is_amd:
        _interpret_gfx950(args[:3] + args[4:], name, out, mode, groups)
        return c if np_ == n else contiguous(c[:, :n])
    if backend == "interpret":
        cfg = GROUPED_FP8_CONFIG
        kernel = make_grouped_fp8_kernel(name, out, mode, cfg)
        host = [to_numpy(x) if hasattr(x, "shape") else x for x in args]
        host[3] = host[2]  # C as tensor map and as tensor: one array
        grid = max(1, min(2, grouped_tiles(host[4], np_, cfg)))
        runtime.interpret(kernel, (grid, 1, 1), host, target=chip.name, num_warps=cfg.num_warps,
                          **grouped_fp8_constexprs(cfg, table_size(groups)))
        if host[2] is not c:
            ArrayLib(c).copy_into(c, host[2])
    else:
        run_grouped_fp8(*args[:3], offsets, sa, sb, mode=mode, k=kp, target=chip.name)
    return c if np_ == n else contiguous(c[:, :n])


def run_grouped_fp8(a, b, c, offsets, scale_a, scale_b, *, mode, k, target="sm_90a",
                    config=None, stream=None):
    """Launch the grouped FP8 kernel on prepared operands: ``a`` ``[total_M, Kp]``, ``b``
    viewed as ``[G * Np, Kp]``, ``c`` ``[total_M, Np]`` (Kp a multiple of 16, Np of 8),
    ``offsets`` int32 ``[G + 1]``, the scales in the kernel's forms (:mod:`.fp8_grouped`) for
    the kind pair ``mode``; ``config`` defaults to ``GROUPED_FP8_CONFIG``. One CTA per SM (for
    numpy offsets, at most one per tile). Example (a bench's A/B of configs):
    ``run_grouped_fp8(a8, w8.reshape(g * n, k), c, offs, sa, sb, mode=("tensor", "tensor"),
    k=k, config=Fp8GemmConfig(block_n=128, stages=5, group_m=16))``."""
    from .grouped_api import grouped_tiles

    groups = int(offsets.shape[0]) - 1
    (total_m, n), cfg = c.shape, config or GROUPED_FP8_CONFIG
    grid = runtime.multiprocessor_count()
    if not is_torch(offsets):  # known tile count: no CTA without a tile
        grid = max(1, min(grid, grouped_tiles(offsets, n, cfg)))
    kernel = make_grouped_fp8_kernel(kiln.dtype(a.dtype).name, kiln.dtype(c.dtype).name,
                                     tuple(mode), cfg)
    runtime.launch(kernel, (grid, 1, 1),
                   (a, b, c, c, offsets, scale_a, scale_b, groups, total_m, n, k, n),
                   target=target, num_warps=cfg.num_warps, stream=stream,
                   **grouped_fp8_constexprs(cfg, table_size(groups)))


def compile_grouped_fp8_matmul(dtype, *, target, out_dtype=None, trans_b=False, groups=8,
                               scales=("tensor", "tensor")):
    """Compile (without running) the grouped FP8 kernel for ``groups`` groups and the scale
    kinds ``scales``. Example: ``compile_grouped_fp8_matmul("f8e4m3", target="sm_90a",
    trans_b=True, scales=("block", "block")).asm["ptx"]``."""
    chip = resolve_target(target)
    require_trans_b(trans_b, "b[g]")
    _require_kernel(chip)
    out, mode = fp8_output_dtype(out_dtype), tuple(scales)
    x = np.empty((1, 1), kiln.dtype(dtype).numpy)
    c = np.empty((1, 1), kiln.dtype(out).numpy)
    sa = np.empty((1,) * (2 if mode[0] == "block" else 1), np.float32)
    sb = np.empty((1, 1), np.float32)
    offsets = np.zeros(groups + 1, np.int32)
    if chip.is_amd:
        from .fp8_gfx950 import Fp8Gfx950Config, make_fp8_gfx950_kernel

        amd = Fp8Gfx950Config()
        return make_fp8_gfx950_kernel(kiln.dtype(dtype).name, out, mode, amd,
                                      grouped=True).compile(
            x, x, c, offsets, sa, sb, groups, 1, 1, 1, 1, 1, target=chip.name,
            num_warps=amd.num_warps, TABLE=table_size(groups))
    cfg = GROUPED_FP8_CONFIG
    return make_grouped_fp8_kernel(kiln.dtype(dtype).name, out, mode, cfg).compile(
        x, x, c, c, offsets, sa, sb, groups, 1, 1, 1, 1,
        target=chip.name, num_warps=cfg.num_warps,
        **grouped_fp8_constexprs(cfg, table_size(groups)))


def _require_kernel(chip) -> None:
    if chip.is_amd and chip.name != "gfx950":
        raise kiln.UnsupportedError(f"the grouped FP8 GEMM uses v_mfma_f32_32x32x64_f8f6f4, "
                                    f"which {chip.name} lacks", fix="target gfx950")
    if not chip.is_amd and not chip.has_wgmma:
        raise kiln.UnsupportedError(f"the grouped FP8 GEMM needs WGMMA (sm_90a); {chip.name} "
                                    "has none", fix="target='sm_90a'")


def _interpret_gfx950(args, dtype, out, mode, groups) -> None:
    """The gfx950 grouped FP8 kernel in the CPU interpreter (at most 2 workgroups walking all
    tiles) on ``args`` (a, b, c, offsets, sa, sb, groups, m, n, k, b_rows)."""
    from .fp8_gfx950 import Fp8Gfx950Config, make_fp8_gfx950_kernel
    from .grouped_api import grouped_tiles

    host = [to_numpy(x) if hasattr(x, "shape") else x for x in args]
    cfg = Fp8Gfx950Config()
    grid = max(1, min(2, grouped_tiles(host[3], host[8], cfg)))
    runtime.interpret(make_fp8_gfx950_kernel(dtype, out, mode, cfg, grouped=True),
                      (grid, 1, 1), host + [grid], target="gfx950", num_warps=cfg.num_warps,
                      TABLE=table_size(groups))
    if host[2] is not args[2]:
        ArrayLib(args[2]).copy_into(args[2], host[2])


def _grouped_scales(scale_a, scale_b, groups, total_m, n, k, like):
    """``(mode, sa, sb)`` in the kernel's forms (see :mod:`.fp8_grouped`): B's per-tensor
    and per-expert scales become ``[G, 1]``, block scales ``[G * Nb, Kb]``."""
    kb, nb = blocks(k), blocks(n)
    a_mode, sa = scale_kind("scale_a", scale_a, {(total_m,): "row", (total_m, kb): "block"},
                            like, f"[total_M]=[{total_m}] or [total_M, ceil(K/128)]="
                                  f"[{total_m}, {kb}]")
    b_mode, sb = scale_kind("scale_b", scale_b, {(groups,): "expert", (groups, n): "col",
                                                 (groups, nb, kb): "block"},
                            like, f"[G]=[{groups}], [G, N]=[{groups}, {n}] or "
                                  f"[G, ceil(N/128), ceil(K/128)]=[{groups}, {nb}, {kb}]")
    if (a_mode == "block") != (b_mode == "block"):
        raise kiln.KilnValueError(f"scale_a is {a_mode} and scale_b is {b_mode}: block scales "
                                  "apply to both operands or neither",
                                  fix="pass block scales for both ([total_M, ceil(K/128)] and "
                                      "[G, ceil(N/128), ceil(K/128)])")
    if b_mode == "block":
        return (a_mode, b_mode), sa, sb.reshape(groups * nb, kb)
    if b_mode == "col":
        return (a_mode, b_mode), sa, sb
    if is_torch(sb):  # one scale per expert, or one for all: [G, 1]
        return (a_mode, "tensor"), sa, sb.reshape(-1, 1).expand(groups, 1).contiguous()
    return (a_mode, "tensor"), sa, np.ascontiguousarray(np.broadcast_to(sb.reshape(-1, 1),
                                                                        (groups, 1)))
