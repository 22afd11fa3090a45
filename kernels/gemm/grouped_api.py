"""Host entry points of the grouped (MoE) GEMM: :func:`grouped_matmul` (checks, padding,
launch or interpretation), :func:`compile_grouped_matmul`, :func:`run_grouped` (prepared
operands) and :func:`check_group_offsets`. The kernels are :mod:`.grouped` (sm_90a) and the
``grouped=True`` variant of :mod:`.gfx950` (CPU interpreter and compile-only here).
"""

import numpy as np

import kiln

from .. import dlpack, runtime
from ..runtime import (ArrayLib, Dims, check_backend, contiguous, dtype_of, empty_like,
                       is_torch, refuse_inside_capture, resolve_target)
from .scales import is_fp8, refuse_scales
from .grouped import (MAX_GROUPS, grouped_config, grouped_constexprs, make_grouped_kernel,
                      table_size)

BLOCK_K = 64  # K of one tile on both targets: MN-major B pads each group's K to it


def compile_grouped_matmul(dtype, *, target, out_dtype=None, trans_b=False, groups=8,
                           **fp8):
    """Compile (without running) the grouped GEMM for ``dtype`` inputs and ``groups`` groups
    (which sets the tile table's size) on ``target`` (sm_90a or gfx950); returns the
    ``CompiledKernel``. Example: ``compile_grouped_matmul("bf16", target="sm_90a").asm["ptx"]``.
    FP8 (sm_90a, ``trans_b=True``) takes ``scales=`` (the kind pair, as for ``compile_matmul``).
    """
    from . import _output_dtype

    if is_fp8(kiln.dtype(dtype).name):
        from .fp8_grouped_api import compile_grouped_fp8_matmul

        return compile_grouped_fp8_matmul(kiln.dtype(dtype).name, target=target,
                                          out_dtype=out_dtype, trans_b=trans_b, groups=groups,
                                          **fp8)

    chip = resolve_target(target)
    name = _grouped_input_dtype(dtype)
    _require_kernel(chip)
    out = _output_dtype(out_dtype, "bf16")
    placeholder = np.empty((1, 1), kiln.dtype(name).numpy)
    c = np.empty((1, 1), kiln.dtype(out).numpy)
    offsets = np.zeros(groups + 1, np.int32)
    if chip.is_amd:
        amd = _amd_config(trans_b, out)
        return _amd_kernel(name, amd).compile(placeholder, placeholder, c, offsets, groups, 1,
                                              1, 1, 1, 1, target=chip.name,
                                              num_warps=amd.num_warps, TABLE=table_size(groups))
    cfg = grouped_config(groups)
    return make_grouped_kernel(name, out, "k" if trans_b else "mn", cfg).compile(
        placeholder, placeholder, c, c, offsets, groups, 1, 1, 1, 1, target=chip.name,
        num_warps=cfg.num_warps, **grouped_constexprs(cfg, groups))


def grouped_matmul(a, b, group_offsets, *, trans_b=False, scale_a=None, scale_b=None,
                   out_dtype=None, target=None, backend=None, validate=False):
    """Grouped (MoE) GEMM: ``c[o[g]:o[g+1]] = a[o[g]:o[g+1]] @ b[g]`` for every group ``g``
    (``@ b[g].T`` with ``trans_b``), ``o = group_offsets``, in one persistent launch.

    ``a`` is ``[total_M, K]`` (the rows of all groups back to back), ``b`` ``[G, K, N]``
    (``[G, N, K]`` with ``trans_b``), ``group_offsets`` int32 ``[G + 1]``: non-decreasing, from
    0 to ``total_M`` (empty groups allowed), ``G <= 1024``. Inputs are bf16 or f16 (f32
    accumulation); the output is bf16 unless ``out_dtype`` says otherwise (bf16, f16, f32).
    FP8 inputs (f8e4m3 / f8e5m2, ``b`` ``[G, N, K]`` with ``trans_b=True``) require
    ``scale_a`` / ``scale_b``: per tensor, per token / per expert output column, or block
    scales (see :mod:`.fp8_grouped_api`); their output is bf16 (default) or f32.

    torch CUDA tensors run asynchronously on the current stream and return a torch tensor;
    numpy arrays are copied to the device and back (or, with ``backend="interpret"``, run in
    Kiln's CPU interpreter). ``group_offsets`` of numpy are always checked; torch tensors only
    with ``validate=True`` (one device-side reduction and one synchronisation), so that an
    unchecked call never synchronises and can be captured in a CUDA graph: unchecked bad
    offsets give meaningless rows but no write outside ``c`` (see ``docs/kernels.md``).
    Runs on sm_90a (Hopper WGMMA). The gfx950 (MFMA) kernel runs here only with
    ``backend="interpret"`` (or compiles, :func:`compile_grouped_matmul`), as the dense one does.

    Example::

        offs = torch.tensor([0, 300, 300, 1024], dtype=torch.int32, device="cuda")
        c = grouped_matmul(tokens, expert_weights, offs)   # [1024, K] x [3, K, N] -> [1024, N]
    """
    from . import (STRIDE_ALIGN, _empty_like, _output_dtype, _padded,
                   _round_up)

    if dlpack.foreign(a):  # cupy / JAX / DLPack device arrays: zero-copy through torch
        return dlpack.through_torch(grouped_matmul, a, b, group_offsets, trans_b=trans_b,
                                    scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype,
                                    target=target, backend=backend, validate=validate)
    if hasattr(a, "dtype") and is_fp8(dtype_of("a", a).name):
        from .fp8_grouped_api import grouped_fp8_matmul

        return grouped_fp8_matmul(a, b, group_offsets, trans_b=trans_b, scale_a=scale_a,
                                  scale_b=scale_b, out_dtype=out_dtype, target=target,
                                  backend=backend, validate=validate)
    chip = resolve_target(target)
    refuse_scales(scale_a, scale_b, "bf16/f16")
    dims = Dims()
    dims.tensor("a", a, "total_M K")
    dims.tensor("b", b, "G N K" if trans_b else "G K N")
    dims.tensor("group_offsets", group_offsets, "G_plus_1")
    name = _grouped_input_dtype(dtype_of("a", a), "a")
    if _grouped_input_dtype(dtype_of("b", b), "b") != name:
        raise kiln.KilnTypeError(f"grouped_matmul operands must share a dtype, got a: {name} "
                                 f"and b: {dtype_of('b', b).name}",
                                 fix="convert one operand first")
    groups, total_m, k, n = group_extents(dims, group_offsets)
    kinds = {is_torch(x) for x in (a, b, group_offsets)}
    if len(kinds) > 1:
        raise kiln.KilnTypeError("a, b and group_offsets must all be numpy arrays or all torch "
                                 "tensors", fix="move them to the same kind first")
    out = _output_dtype(out_dtype, "bf16")
    check_backend(backend)
    check_group_offsets(group_offsets, total_m, validate=validate)
    if total_m * n == 0 or k == 0:  # nothing to multiply: an empty c, or zeros for K = 0
        return empty_like(a, (total_m, n), kiln.dtype(out), fill=0.0)
    _require_kernel(chip)
    if chip.is_amd and backend != "interpret":
        raise kiln.UnsupportedError(f"Kiln cannot run {chip.name} kernels on this machine",
                                    fix="use compile_grouped_matmul(...) to inspect the AMD "
                                        "kernel, or backend='interpret'")
    # Row strides of 16 bytes (TMA; AMD's 16-byte loads); K and N pads are zeros.
    kp, np_ = _round_up(k, STRIDE_ALIGN), _round_up(n, STRIDE_ALIGN)
    if trans_b:
        b_rows = np_
        b_in = _padded(b, (groups, np_, kp)).reshape(groups * np_, kp)
    else:
        # A box past K would read the next group's rows: pad each group's K to whole boxes.
        b_rows = _round_up(k, BLOCK_K)
        b_in = _padded(b, (groups, b_rows, np_)).reshape(groups * b_rows, np_)
    a_in = _padded(a, (total_m, kp))
    offsets = contiguous(group_offsets)
    c = _empty_like(a, (total_m, np_), out)
    if backend == "interpret":
        _interpret(chip, name, out, trans_b, [a_in, b_in, c, offsets, groups, total_m, np_, k,
                                              b_rows])
    else:
        run_grouped(a_in, b_in, c, offsets, k=k, b_rows=b_rows, trans_b=trans_b,
                    target=chip.name)
    return c if np_ == n else contiguous(c[:, :n])


def run_grouped(a, b, c, offsets, *, k, b_rows, trans_b, target="sm_90a", config=None,
                stream=None, dynamic=False):
    """Launch the grouped kernel on prepared operands: ``a`` ``[total_M, Kp]``, ``b`` viewed as
    ``[G * b_rows, cols]`` (see :func:`make_grouped_kernel`), ``c`` ``[total_M, Np]`` (Kp, Np
    multiples of 8), ``offsets`` int32 ``[G + 1]``; ``config`` defaults to
    :func:`grouped_config`; ``dynamic`` has CTAs claim tiles from a zeroed counter pair. The
    grid is one CTA per SM (for numpy offsets, at most one per tile). Example (a poisoned
    ``c`` in a test): ``run_grouped(a, b, c, offs, k=k, b_rows=k, trans_b=False)``."""
    groups = int(offsets.shape[0]) - 1
    (total_m, n), cfg = c.shape, config or grouped_config(groups)
    grid = runtime.multiprocessor_count()
    if not is_torch(offsets):  # known tile count: no CTA without a tile
        grid = max(1, min(grid, grouped_tiles(offsets, n, cfg)))
    kernel = make_grouped_kernel(kiln.dtype(a.dtype).name, kiln.dtype(c.dtype).name,
                                 "k" if trans_b else "mn", cfg, dynamic)
    counters = (_claim_counters(offsets),) if dynamic else ()
    runtime.launch(kernel, (grid, 1, 1),
                   (a, b, c, c, offsets, groups, total_m, n, k, b_rows) + counters,
                   target=target, num_warps=cfg.num_warps, stream=stream,
                   **grouped_constexprs(cfg, groups, dynamic))


# Zeroed tile-claim counters per (device, stream): launches on one stream run in order, and
# each launch's last CTA zeroes its counters again (:func:`.grouped.claim_tile`).
_COUNTERS = {}


def _claim_counters(like):
    """The dynamic tile walk's counter pair for a launch on the current stream of ``like``'s
    device (a fresh zeroed pair for numpy operands)."""
    if not is_torch(like):
        return empty_like(like, (2,), kiln.i32, fill=0)
    import torch

    key = (like.device.index, torch.cuda.current_stream(like.device).cuda_stream)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(2, dtype=torch.int32, device=like.device)
    return _COUNTERS[key]


def group_extents(dims: Dims, group_offsets) -> tuple[int, int, int, int]:
    """``(G, total_M, K, N)`` of checked grouped operands (``dims`` holds a, b and
    group_offsets): int32 offsets, ``G + 1`` of them, at most ``MAX_GROUPS`` groups."""
    if dtype_of("group_offsets", group_offsets) is not kiln.i32:
        raise kiln.KilnTypeError(f"group_offsets must be int32, got "
                                 f"{dtype_of('group_offsets', group_offsets)}",
                                 fix="convert it, e.g. offsets.astype(np.int32) / "
                                     ".to(torch.int32)")
    groups = dims["G"]
    if dims["G_plus_1"] != groups + 1:
        raise kiln.KilnValueError(f"group_offsets has {dims['G_plus_1']} entries, but b holds "
                                  f"G={groups} groups (G + 1 entries expected)",
                                  fix="pass the G + 1 row boundaries, starting with 0")
    if groups > MAX_GROUPS:
        raise kiln.UnsupportedError(f"grouped_matmul supports at most {MAX_GROUPS} groups, "
                                    f"got {groups}", fix="split the call into several")
    return groups, dims["total_M"], dims["K"], dims["N"]


def check_group_offsets(offsets, total_m: int, *, validate: bool = False) -> None:
    """``offsets[0] == 0``, non-decreasing, ``offsets[-1] == total_m``: always for numpy,
    for torch tensors only with ``validate`` (one reduction and one synchronisation; not
    inside a CUDA graph capture)."""
    if is_torch(offsets):
        if not validate:
            return
        refuse_inside_capture("group_offsets")
        ok = (offsets[0] == 0) & (offsets[-1] == total_m) & \
            (offsets[1:] >= offsets[:-1]).all()
        if bool(ok):  # the one synchronisation
            return
        offsets = offsets.cpu().numpy()
    offsets = np.asarray(offsets).astype(np.int64)
    if offsets[0] != 0:
        raise kiln.KilnValueError(f"group_offsets[0] = {offsets[0]}, but it must be 0",
                                  fix="start group_offsets with 0 (group 0 starts at row 0)")
    drops = np.flatnonzero(offsets[1:] < offsets[:-1])
    if drops.size:
        g = int(drops[0])
        raise kiln.KilnValueError(f"group_offsets decreases at group {g}: group_offsets[{g}] ="
                                  f" {offsets[g]} > group_offsets[{g + 1}] = {offsets[g + 1]}",
                                  fix="pass cumulative row counts (e.g. a prefix sum of the "
                                      "group sizes)")
    if offsets[-1] != total_m:
        raise kiln.KilnValueError(f"group_offsets[-1] = {offsets[-1]}, but a has total_M = "
                                  f"{total_m} rows", fix="end group_offsets with a.shape[0]")


def grouped_tiles(offsets, n: int, cfg) -> int:
    """Output tiles of all groups (host-side, from numpy offsets) for ``cfg``'s tile shape."""
    rows = np.diff(np.asarray(offsets).astype(np.int64))
    return int((-(-rows // cfg.block_m)).sum() * -(-n // cfg.block_n))


def _interpret(chip, name, out, trans_b, args) -> None:
    """Run the target's grouped kernel in the CPU interpreter on ``args`` (as for the GPU,
    without C's tensor map) with a grid of at most two CTAs: the persistent walk over several
    tiles and groups is what is tested."""
    host = [ArrayLib.numpy(x) if hasattr(x, "shape") else x for x in args]
    offsets, groups, n = host[3], host[4], host[6]
    if chip.is_amd:
        amd = _amd_config(trans_b, out)
        kernel, num_warps, constexprs = _amd_kernel(name, amd), amd.num_warps, \
            dict(TABLE=table_size(groups))
        grid = max(1, min(2, grouped_tiles(offsets, n, amd)))
        launch_args = host + [grid]
    else:
        cfg = grouped_config(groups)
        kernel = make_grouped_kernel(name, out, "k" if trans_b else "mn", cfg)
        num_warps, constexprs = cfg.num_warps, grouped_constexprs(cfg, groups)
        grid = max(1, min(2, grouped_tiles(offsets, n, cfg)))
        launch_args = host[:3] + host[2:]  # C as tensor map and as tensor: one array
    runtime.interpret(kernel, (grid, 1, 1), launch_args, target=chip.name, num_warps=num_warps,
                      **constexprs)
    if host[2] is not args[2]:
        ArrayLib(args[2]).copy_into(args[2], host[2])


def _amd_config(trans_b: bool, out: str):
    from .gfx950 import GemmConfig

    return GemmConfig(b_layout="nk" if trans_b else "kn", out_dtype=out)


def _amd_kernel(name: str, config):
    from .gfx950 import make_kernel

    return make_kernel(name, config, grouped=True)


def _grouped_input_dtype(dtype, what: str = "dtype") -> str:
    name = kiln.dtype(dtype).name
    if is_fp8(name):  # a bf16/f16 a with an FP8 b
        raise kiln.KilnTypeError(f"grouped_matmul operands must share a dtype, got a {name} "
                                 f"{what}", fix="quantise both operands, or neither")
    if name not in ("bf16", "f16"):
        raise kiln.UnsupportedError(f"grouped_matmul does not support {name} inputs "
                                    f"({what})", fix="convert to bf16 or f16")
    return name


def _require_kernel(chip) -> None:
    if chip.is_amd and chip.name != "gfx950":
        raise kiln.UnsupportedError(f"grouped_matmul's AMD kernel uses v_mfma_f32_32x32x16, "
                                    f"which {chip.name} lacks", fix="target gfx950")
    if not chip.is_amd and not chip.has_wgmma:
        raise kiln.UnsupportedError(f"grouped_matmul needs WGMMA (sm_90a); {chip.name} has none",
                                    fix="compile for target='sm_90a'")
