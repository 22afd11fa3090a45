"""Host side of the FP8 GEMM: :func:`fp8_matmul` (what :func:`kiln.kernels.gemm.matmul` runs
for f8e4m3/f8e5m2 operands) and :func:`compile_fp8_matmul`.

FP8 tensor-core instructions read both operands K-major (WGMMA ``m64nNk32``; the gfx950 kernel
follows the same convention), so FP8 B must be stored ``N x K`` and passed with
``trans_b=True``: a K x N FP8 B is refused with a :class:`kiln.KilnValueError` rather than
transposed behind the caller's back (one ``w.t().contiguous()`` at load time does it once).
"""

import dataclasses
import functools

import numpy as np

import kiln
from kiln.autotune import autotune

from .. import runtime
from ..runtime import (ArrayLib, Dims, PlanCache, check_backend, contiguous, empty_like,
                       is_torch, key_of, resolve_target)
from .fp8_hopper import (FP8_OUT_DTYPES, Fp8GemmConfig, fp8_constexprs, make_fp8_kernel)
from .scales import check_scales, is_fp8

K_ALIGN = 16  # TMA row strides: 16 bytes of one-byte elements
N_ALIGN = 8  # C's row stride (bf16)
# Epilogue-scaled (per tensor / row / column) and block-scaled configs the tuner tries, the
# first the default (H200, e4m3, interleaved A/B of bench/gemm_fp8_configs.py): 192-column tiles
# with 240 consumer registers won 8192^3 (per tensor 1256 TFLOP/s vs torch._scaled_mm 1239;
# block 1058 with group_m=16, 1.6x Kiln bf16); 128-column tiles with overlap_steps=2 won
# 4096x8192x8192 per tensor, 192-column split-N overlap 8192x14336x4096. A later run (per
# tensor, median over 11 interleaved rounds of the ratio to _scaled_mm): row tiles swept 4 at
# a time 0.996 at 8192^3 (8 at a time 0.975, 5 stages 0.989), 0.956 at 4096x8192x8192 (0.948,
# 5 stages 0.955; 128 columns with overlap_steps=2 0.980). 3 row tiles a sweep: 0.988 vs 0.967
# (4) at 8192^3 in one run, 0.965 vs 0.989 in the next: within the runs' noise, not taken.
_WIDE = dict(block_n=192, stages=4, producer_registers=24, consumer_registers=240)
SCALED_CONFIGS = (Fp8GemmConfig(**_WIDE, group_m=4),
                  Fp8GemmConfig(block_n=128, stages=6, overlap_steps=2),
                  Fp8GemmConfig(**dict(_WIDE, stages=5)), Fp8GemmConfig(**_WIDE),
                  Fp8GemmConfig(**_WIDE, overlap_steps=2))
BLOCK_CONFIGS = (Fp8GemmConfig(**_WIDE, group_m=16), Fp8GemmConfig(**_WIDE),
                 Fp8GemmConfig(block_n=128, stages=6, overlap_steps=4))


def default_config(mode: tuple) -> Fp8GemmConfig:
    return (BLOCK_CONFIGS if mode[0] == "block" else SCALED_CONFIGS)[0]


def require_trans_b(trans_b: bool, what: str = "b") -> None:
    if not trans_b:
        raise kiln.KilnValueError(f"FP8 GEMMs read B K-major: {what} must be stored N x K and "
                                  "passed with trans_b=True",
                                  fix="store the weight transposed once (w.t().contiguous()) "
                                      "and call with trans_b=True")


def fp8_output_dtype(out_dtype) -> str:
    name = kiln.dtype(out_dtype).name if out_dtype is not None else "bf16"
    if name not in FP8_OUT_DTYPES:
        raise kiln.UnsupportedError(f"the FP8 GEMM cannot write {name} outputs",
                                    fix=f"use out_dtype in {FP8_OUT_DTYPES} (bf16 default)")
    return name


def compile_fp8_matmul(dtype: str, *, target, out_dtype=None, trans_b=False,
                       scales=("tensor", "tensor"), **config):
    """Compile (without running) the FP8 GEMM; see :func:`kiln.kernels.gemm.compile_matmul`.
    ``scales`` is the scale-kind pair (``("block", "block")`` for DeepSeek-V3 scales)."""
    chip = resolve_target(target)
    require_trans_b(trans_b)
    out = fp8_output_dtype(out_dtype)
    if chip.is_amd:
        from .fp8_gfx950 import compile_fp8_gfx950

        return compile_fp8_gfx950(dtype, target=chip.name, out_dtype=out, scales=tuple(scales),
                                  **config)
    if not chip.has_wgmma:
        raise kiln.UnsupportedError(f"the Kiln FP8 GEMM needs WGMMA (sm_90a); {chip.name} has "
                                    "none", fix="compile for target='sm_90a', or gfx950")
    cfg = Fp8GemmConfig(**config) if config else default_config(tuple(scales))
    a = np.empty((1, 1), kiln.dtype(dtype).numpy)
    c = np.empty((1, 1), kiln.dtype(out).numpy)
    sa, sb = (np.empty((1,) * (2 if s == "block" else 1), np.float32) for s in scales)
    return make_fp8_kernel(dtype, out, tuple(scales), cfg).compile(
        a, a, c, sa, sb, 1, 1, 1, target=chip.name, num_warps=cfg.num_warps,
        **fp8_constexprs(cfg))


def fp8_matmul(a, b, *, scale_a, scale_b, trans_b, out_dtype, target, backend):
    """:func:`kiln.kernels.gemm.matmul` for FP8 operands (see its docs and :mod:`.scales`).

    With contiguous torch CUDA operands and scales (K a multiple of 16, N of 8), a repeat call
    of one shape class is a plan look-up, one allocation and one bound launch of the tuned
    config, as for bf16."""
    values = (a, b, scale_a, scale_b, trans_b, out_dtype, target, backend)
    plan = _PLANS.find(values)
    if plan is not None:
        c = plan.fresh_c.one()
        plan.bound(a.data_ptr(), b.data_ptr(), c.data_ptr(), scale_a.data_ptr(),
                   scale_b.data_ptr())
        return c
    c = _fp8_matmul(a, b, scale_a, scale_b, trans_b, out_dtype, target, backend)
    chip = resolve_target(target)
    if backend != "interpret" and chip.has_wgmma and c.numel() and \
            runtime.bindable(a, b, scale_a, scale_b) and a.shape[1] % K_ALIGN == 0 and \
            c.shape[1] % N_ALIGN == 0:  # nothing padded: the caller's tensors are the kernel's
        _PLANS.add(key_of(values), _bind(a, b, c, scale_a, scale_b, chip.name), values)
    return c


# Bound torch plans by the operands' and scales' specs and the options (see
# kiln.kernels.runtime), made after a shape class's first call, which tunes the config.
_PLANS = PlanCache("matmul_fp8")


@dataclasses.dataclass(frozen=True)
class _Fp8Plan:
    bound: object  # kiln.kernels.runtime.bind's launch of the tuned config
    fresh_c: object  # kiln.kernels.runtime.TorchOutputs of C [M, N] (its dtype, a's device)


def _bind(a, b, c, scale_a, scale_b, target) -> _Fp8Plan:
    (m, k), n = a.shape, c.shape[1]
    dtype, out = kiln.dtype(a.dtype).name, kiln.dtype(c.dtype).name
    mode, sa, sb = check_scales(scale_a, scale_b, m=m, n=n, k=k, like=a)
    args = (a, b, c, sa, sb, m, n, k, dtype, out, mode, target)
    tuner = _tuner(mode)
    config = tuner.best[tuner.key_of(args, {})]
    bound = runtime.bind(make_fp8_kernel(dtype, out, mode, config),
                         fp8_grid(m, n, dtype, out, mode, config), list(args[:8]),
                         target=target, num_warps=config.num_warps, **fp8_constexprs(config))
    return _Fp8Plan(bound=bound, fresh_c=runtime.TorchOutputs(c, ((m, n), c.dtype)))


def _fp8_matmul(a, b, scale_a, scale_b, trans_b, out_dtype, target, backend):
    """The general path of :func:`fp8_matmul`: checks, padding, tuning, launch or
    interpretation."""
    chip = resolve_target(target)
    dims = Dims()
    dims.tensor("a", a, "M K")
    dims.tensor("b", b, "N K_b" if trans_b else "K_b N")
    name, b_name = kiln.dtype(a.dtype).name, kiln.dtype(b.dtype).name
    if not is_fp8(b_name) or b_name != name:
        raise kiln.KilnTypeError(f"matmul operands must share an FP8 dtype, got {name} and "
                                 f"{b_name}", fix="quantise both operands to the same FP8 dtype")
    require_trans_b(trans_b)
    (m, k), (n, kb) = a.shape, b.shape
    if k != kb:
        raise kiln.KilnValueError(f"matmul shapes {tuple(a.shape)} @ {tuple(b.shape)}.T do not "
                                  "agree on K", fix="pass A: M x K and B: N x K")
    out = fp8_output_dtype(out_dtype)
    mode, sa, sb = check_scales(scale_a, scale_b, m=m, n=n, k=k, like=a)
    check_backend(backend)
    if m * n * k == 0:
        return empty_like(a, (m, n), kiln.dtype(out), fill=0.0)
    if chip.is_amd and backend != "interpret":
        raise kiln.UnsupportedError(f"Kiln cannot run {chip.name} kernels on this machine",
                                    fix="use compile_matmul(...) to inspect the AMD kernel, or "
                                        "backend='interpret'")
    kp, np_ = _round_up(k, K_ALIGN), _round_up(n, N_ALIGN)
    a_in, b_in = padded(a, (m, kp)), padded(b, (n, kp))
    if mode[1] == "col":  # the kernel's N is the padded one; those columns are sliced off
        sb = padded(sb, (np_,))
    c = empty_like(a, (m, np_), kiln.dtype(out), fill=None if is_torch(a) else np.nan)
    if backend == "interpret":
        interpret_fp8(chip, [a_in, b_in, c, sa, sb, m, np_, kp], name, out, mode)
    else:
        fp8_autotuner(a_in, b_in, c, sa, sb, m, np_, kp, name, out, mode, chip.name)
    return c if np_ == n else contiguous(c[:, :n])


def run_fp8(a, b, c, sa, sb, m, n, k, *, dtype, out, mode, target, config, stream=None):
    """Launch the Hopper FP8 kernel of ``config`` on prepared operands (K a multiple of 16, N
    of 8, contiguous) over a persistent grid of one CTA per SM (at most one per tile)."""
    runtime.launch(make_fp8_kernel(dtype, out, mode, config), fp8_grid(m, n, dtype, out, mode,
                                                                      config),
                   (a, b, c, sa, sb, m, n, k), target=target, num_warps=config.num_warps,
                   stream=stream, **fp8_constexprs(config))


def fp8_grid(m, n, dtype, out, mode, config) -> tuple[int, int, int]:
    """One CTA per SM (per resident cluster of ``cluster_m`` CTAs), at most one per tile."""
    pair = config.cluster_m
    tiles = -(-m // (config.block_m * pair)) * -(-n // config.block_n)
    return runtime.persistent_grid(tiles, pair,
                                   lambda: _resident_clusters(dtype, out, mode, config))


@functools.lru_cache(maxsize=None)
def _resident_clusters(dtype, out, mode, config) -> int:
    """Clusters of ``config``'s kernel that fit on the GPU at once (a larger persistent grid
    would run its last clusters in a second wave)."""
    return runtime.max_active_clusters(compile_fp8_matmul(
        dtype, target="sm_90a", out_dtype=out, trans_b=True, scales=mode,
        **dataclasses.asdict(config)))


def _precompile(config, a, b, c, sa, sb, m, n, k, dtype, out, mode, target):
    make_fp8_kernel(dtype, out, mode, config).compile(
        a, b, c, sa, sb, m, n, k, target=target, num_warps=config.num_warps,
        **fp8_constexprs(config))


@functools.lru_cache(maxsize=None)
def _tuner(mode: tuple):
    """One autotuner per scale kind: block scales have their own configs."""
    configs = BLOCK_CONFIGS if mode[0] == "block" else SCALED_CONFIGS

    @autotune(configs=configs, key=["m", "n", "k", "dtype", "out", "mode"],
              precompile=_precompile)
    def fp8_tuned(a, b, c, sa, sb, m, n, k, dtype, out, mode, target, *, config):
        run_fp8(a, b, c, sa, sb, m, n, k, dtype=dtype, out=out, mode=mode, target=target,
                config=config)

    return fp8_tuned


def fp8_autotuner(a, b, c, sa, sb, m, n, k, dtype, out, mode, target):
    """Run the tuned config for this shape class (tuning on first sight)."""
    _tuner(mode)(a, b, c, sa, sb, m, n, k, dtype, out, mode, target)


def interpret_fp8(chip, args, dtype, out, mode) -> None:
    """Run the ``chip`` FP8 kernel in the CPU interpreter on ``args`` (a, b, c, sa, sb, m, n,
    k), copying C back into the caller's array."""
    host = [to_numpy(x) if hasattr(x, "shape") else x for x in args]
    m, n = host[5], host[6]
    if chip.is_amd:
        from .fp8_gfx950 import interpret_fp8_gfx950

        interpret_fp8_gfx950(host, dtype, out, mode)
    else:
        cfg = default_config(mode)
        tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
        runtime.interpret(make_fp8_kernel(dtype, out, mode, cfg), (min(tiles, 2), 1, 1), host,
                          target=chip.name, num_warps=cfg.num_warps, **fp8_constexprs(cfg))
    if host[2] is not args[2]:
        ArrayLib(args[2]).copy_into(args[2], host[2])


def to_numpy(x):
    """A host numpy copy of ``x``; torch FP8 tensors (which ``.numpy()`` refuses) through their
    bytes."""
    if is_torch(x) and x.element_size() == 1 and x.is_floating_point():
        import torch

        return x.detach().cpu().view(torch.uint8).numpy().view(kiln.dtype(x.dtype).numpy)
    return ArrayLib.numpy(x)


def padded(x, shape: tuple):
    """``x`` itself when already ``shape`` and contiguous, else a zero-padded copy (torch FP8
    through its bytes: FP8 zero is byte 0, and byte copies work on every torch version)."""
    if tuple(x.shape) == shape:
        return contiguous(x)
    if is_torch(x) and x.element_size() == 1 and x.is_floating_point():
        import torch

        return padded(x.view(torch.uint8), shape).view(x.dtype)
    out = x.new_zeros(shape) if is_torch(x) else np.zeros(shape, x.dtype)
    out[tuple(slice(0, s) for s in x.shape)] = x
    return out


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple
