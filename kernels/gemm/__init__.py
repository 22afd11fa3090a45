"""Matrix multiplication: Hopper TMA + WGMMA (:mod:`.hopper`), AMD gfx950 MFMA (``.gfx950``).

Two entry points::

    from kiln.kernels.gemm import matmul, compile_matmul

    c = matmul(a, b)                       # torch CUDA tensors or numpy arrays, C = A @ B
    c = matmul(a, w, trans_b=True)         # C = A @ W.T, W stored N x K
    ck = compile_matmul("bf16", target="sm_90a", block_n=128, stages=3)
    print(ck.asm["ptx"], ck.metadata)

``a`` is M x K, ``b`` K x N (or N x K with ``trans_b``), bf16 or f16; accumulation is f32 and
the output dtype defaults to the input dtype. On NVIDIA, ``matmul`` autotunes the tile
configuration once per (shape, dtype) (``kiln.autotune``; results persist next to the compile
cache); for M <= 512 it takes a stored small-M tuning or a heuristic config instead (small
tiles, split-K, swap-AB: :mod:`.small_m`, :mod:`.splitk`). ``matmul_config(a, b, config)``
runs one fixed config. ``backend="interpret"`` runs the kernel of ``target`` in Kiln's CPU
interpreter.

FP8 (f8e4m3 / f8e5m2, B stored N x K with ``trans_b=True``) with per-tensor, per-row/column
or DeepSeek-V3 block scales (:mod:`.scales`; kernels :mod:`.fp8_hopper`, :mod:`.fp8_gfx950`,
host code :mod:`.fp8_api`)::

    c = matmul(a8, w8, scale_a=sa, scale_b=sw, trans_b=True)   # bf16 C = (A sa) @ (W sw)^T

Grouped (MoE) GEMM, one persistent launch over the tiles of all groups (:mod:`.grouped` on
sm_90a, a grouped variant of the gfx950 kernel; host code in :mod:`.grouped_api`; bf16/f16,
and FP8 on sm_90a through :mod:`.fp8_grouped`)::

    from kiln.kernels.gemm import grouped_matmul, compile_grouped_matmul

    # a: [total_M, K] rows of all groups back to back, w: [G, K, N], offs: int32 [G + 1]
    c = grouped_matmul(a, w, offs)                 # c[offs[g]:offs[g+1]] = a[...] @ w[g]
    c = grouped_matmul(a, w_t, offs, trans_b=True)  # w_t: [G, N, K]
    ck = compile_grouped_matmul("bf16", target="sm_90a", groups=64)
"""

import contextlib
import dataclasses
import functools

import numpy as np

import kiln
from kiln.autotune import autotune

from .. import dlpack, runtime
from ..runtime import (ArrayLib, Dims, PlanCache, check_backend, contiguous, empty_like,
                       is_torch, key_of, resolve_target)
from . import gemv, small_m, splitk
from .fp8_api import compile_fp8_matmul, fp8_matmul
from .grouped_api import compile_grouped_matmul, grouped_matmul
from .hopper import OUT_DTYPES, SUPPORTED_DTYPES, HopperGemmConfig, make_kernel
from .hopper import kernel_constexprs as _constexprs
from .scales import is_fp8, refuse_scales

__all__ = ["matmul", "matmul_config", "compile_matmul", "grouped_matmul", "compile_grouped_matmul",
           "HopperGemmConfig", "HOPPER_CONFIGS"]

# TMA global strides must be multiples of 16 bytes: 8 elements of a 2-byte dtype.
STRIDE_ALIGN = 8
INTERPRET_PINGPONG_CTAS = 2
HOPPER_CONFIGS = (HopperGemmConfig(),
                  HopperGemmConfig(stages=3),
                  # 8192 / 192 tiles fill the last wave of 132 SMs better than 8192 / 256.
                  HopperGemmConfig(block_n=192),
                  HopperGemmConfig(block_n=128, stages=5),
                  HopperGemmConfig(block_m=64, block_n=256, stages=4),
                  # CTA pairs multicasting B: a third less L2->SM traffic per CTA.
                  HopperGemmConfig(cluster_m=2),
                  HopperGemmConfig(block_n=192, cluster_m=2),
                  # 4096^3 is 3.9 waves of 128 x 256 tiles: share the last ones out by K steps.
                  HopperGemmConfig(stream_k=True),
                  # 160 columns (B stored N x K only): Llama-3-70B QKV at M = 1024 makes 512
                  # tiles, 3.9 waves (0.927 / 0.933 of cuBLAS in pairs, vs 0.911 tuned before)
                  HopperGemmConfig(block_n=160), HopperGemmConfig(block_n=160, cluster_m=2))


def compile_matmul(dtype, *, target, out_dtype=None, trans_b=False, **config):
    """Compile (without running) the GEMM for ``dtype`` inputs on ``target``; returns the
    ``CompiledKernel`` (``.asm`` stages, ``.metadata``).

    ``config`` keywords are the fields of :class:`HopperGemmConfig` on NVIDIA (with
    ``split_k``/``swap_ab``: the kernel writing f32 partials), or of the
    gfx950 kernel's ``GemmConfig`` on AMD (where ``trans_b`` and ``out_dtype`` fill its
    ``b_layout`` and ``out_dtype`` unless given). FP8 (``"f8e4m3"``, ``"f8e5m2"``) needs
    ``trans_b=True``; its keywords are ``scales`` (the scale-kind pair, default
    ``("tensor", "tensor")``, or ``("block", "block")``) and the fields of
    :class:`~.fp8_hopper.Fp8GemmConfig` (sm_90a) or :class:`~.fp8_gfx950.Fp8Gfx950Config`.
    Example: ``compile_matmul("bf16", target="sm_90a", stages=3).metadata["registers"]``,
    ``compile_matmul("f8e4m3", target="sm_90a", trans_b=True, scales=("block", "block"))``.
    """
    if is_fp8(kiln.dtype(dtype).name):
        return compile_fp8_matmul(kiln.dtype(dtype).name, target=target, out_dtype=out_dtype,
                                  trans_b=trans_b, **config)
    chip = resolve_target(target)
    name = _input_dtype(dtype)
    if chip.is_amd:
        from . import gfx950

        config.setdefault("b_layout", "nk" if trans_b else "kn")
        config.setdefault("out_dtype", out_dtype and kiln.dtype(out_dtype).name)
        return gfx950.compile_gfx950(name, target=chip.name, config=gfx950.GemmConfig(**config))
    _require_wgmma(chip)
    cfg = HopperGemmConfig(**config)
    if cfg.gemv:
        gemv.check(1, "k" if trans_b else "mn")
        return gemv.compile_gemv(name, _output_dtype(out_dtype, name), target=chip.name)
    # A split-K / swap-AB config's kernel writes f32 partials unless it reduces them itself.
    out = "f32" if cfg.partials and not cfg.reduces_in_kernel else _output_dtype(out_dtype, name)
    if cfg.swap_ab and not trans_b:
        raise kiln.UnsupportedError("swap_ab needs B stored N x K", fix="pass trans_b=True")
    b_major = "k" if trans_b else "mn"
    # Placeholder arrays carry dtype and rank only: the kernel is specialised on them.
    a = np.empty((1, 1), kiln.dtype(name).numpy)
    c = np.empty((1, 1), kiln.dtype(out).numpy)
    # the fused reduction's partial slots and tickets (and C for swap-AB's transposed stores)
    fused = (np.empty(1, np.float32), np.empty(1, np.int64)) + ((c,) if cfg.swap_ab else ()) \
        if cfg.reduces_in_kernel else ()
    return make_kernel(name, out, b_major, cfg).compile(a, a, c, 1, 1, 1, *fused,
                                                        target=chip.name,
                                                        num_warps=cfg.num_warps,
                                                        **_constexprs(cfg))


def matmul(a, b, *, scale_a=None, scale_b=None, trans_b=False, out_dtype=None, target=None,
           backend=None):
    """``a @ b`` (``a @ b.T`` with ``trans_b``) on the GPU; see the module docs.

    FP8 operands (f8e4m3 / f8e5m2, B stored N x K with ``trans_b=True``) require ``scale_a``
    and ``scale_b`` (per tensor, per row / column, or DeepSeek-V3 block scales, see
    :mod:`.scales`) and give bf16 (default) or f32:
    ``matmul(a8, w8, scale_a=sa, scale_b=sw, trans_b=True)``.

    Accepts torch CUDA tensors (returns a torch tensor, asynchronous on the current stream)
    or numpy arrays (copied to the device and back). Shapes need not be multiples of the tile.
    Inputs are validated before anything compiles (a :class:`kiln.KilnError` naming the
    operand: kinds, ranks, dtypes, agreeing K). ``M`` or ``N`` of 0 gives an empty ``c``;
    ``K = 0`` gives zeros; neither launches a kernel.
    With contiguous torch CUDA tensors whose K and N are multiples of 8, a repeat call of one
    shape class is a plan look-up, one allocation and one bound launch of the tuned config.
    Example: ``c = matmul(torch.randn(1000, 512, dtype=torch.bfloat16, device="cuda"), w)``.
    """
    values = (a, b, trans_b, out_dtype, target, backend)
    # Only bf16/f16 plans are stored here (the plan's key holds a's dtype): a hit is not FP8.
    guard, plan = _PLANS.last
    if not guard(values):
        plan = _PLANS.find(values) if scale_a is None and scale_b is None else None
    elif scale_a is not None or scale_b is not None:
        plan = None
    if plan is not None:  # one C call: c's allocation, the addresses, the launch
        bound = plan.bound
        return bound.launch_outputs(plan.fresh_c.makers, bound.current_stream(), a, b, None)
    if hasattr(a, "dtype") and is_fp8(_dtype_name(a)):
        return fp8_matmul(a, b, scale_a=scale_a, scale_b=scale_b, trans_b=trans_b,
                          out_dtype=out_dtype, target=target, backend=backend)
    refuse_scales(scale_a, scale_b, "bf16/f16")
    if dlpack.foreign(a):  # cupy / JAX / DLPack device arrays: zero-copy through torch
        return dlpack.through_torch(matmul, a, b, trans_b=trans_b, out_dtype=out_dtype,
                                    target=target, backend=backend)
    c = _matmul(a, b, trans_b, out_dtype, target, backend)
    chip = resolve_target(target)
    if backend != "interpret" and chip.has_wgmma and runtime.bindable(a, b) and c.numel() and \
            a.shape[1] % STRIDE_ALIGN == 0 and c.shape[1] % STRIDE_ALIGN == 0:  # not padded
        _PLANS.add(key_of(values), _bind(a, b, c, trans_b, chip.name), values)
    return c


# Bound torch plans by the operands' specs and the options (see kiln.kernels.runtime), made
# after a shape class's first call, which tunes the config they bind.
_PLANS = PlanCache("matmul")


@dataclasses.dataclass(frozen=True)
class _MatmulPlan:
    # kiln.kernels.runtime.bind's launch of the tuned config (split-K: splitk.PairedLaunch)
    bound: object
    fresh_c: object  # kiln.kernels.runtime.TorchOutputs of C [M, N] (its dtype, a's device)


def _bind(a, b, c, trans_b, target, config=None) -> _MatmulPlan:
    """The plan of aligned contiguous torch operands: ``config``, by default the one the first
    call tuned (or the small-M choice), bound to its persistent grid. Benchmarks bind fixed
    configs here to time each as ``matmul``'s repeat calls run it (host path included)."""
    (m, k), n = a.shape, c.shape[1]
    dtype, out, b_major = _dtype_name(a), _dtype_name(c), "k" if trans_b else "mn"
    config = config or small_m.chosen_config(m, n, k, dtype, b_major, out,
                                             sms=runtime.multiprocessor_count()) or \
        hopper_autotuner.best[hopper_autotuner.key_of(
            (a, b, c, m, n, k, dtype, b_major, out, target), {})]
    if config.gemv:
        bound = gemv.bind_gemv(a, b, c, m, n, k, dtype=dtype, target=target)
        return _MatmulPlan(bound=bound, fresh_c=runtime.TorchOutputs(c, ((m, n), c.dtype)))
    if config.partials:
        bound = splitk.bind_partials(a, b, c, m, n, k, dtype=dtype, b_major=b_major,
                                     target=target, config=config)
        return _MatmulPlan(bound=bound, fresh_c=runtime.TorchOutputs(c, ((m, n), c.dtype)))
    args = [a, b, c, m, n, k]
    bound = runtime.bind(make_kernel(dtype, out, b_major, config),
                         _hopper_grid(m, n, dtype, out, b_major, config), args, target=target,
                         num_warps=config.num_warps, **_constexprs(config))
    return _MatmulPlan(bound=bound, fresh_c=runtime.TorchOutputs(c, ((m, n), c.dtype)))


def matmul_config(a, b, config, *, trans_b=False, out_dtype=None, target=None, backend=None):
    """:func:`matmul` with a fixed :class:`HopperGemmConfig` instead of the tuned or heuristic
    one (sm_90a, or its interpreter): to pin a config, or to compare configs in benchmarks
    and tests. Example:
    ``matmul_config(a, w, HopperGemmConfig(block_n=32, swap_ab=True, split_k=4), trans_b=True)``.
    """
    if not isinstance(config, HopperGemmConfig):
        raise kiln.KilnTypeError(f"config must be a HopperGemmConfig, got {config!r}",
                                 fix="pass e.g. HopperGemmConfig(block_m=64, split_k=2)")
    if resolve_target(target).is_amd:
        raise kiln.UnsupportedError("matmul_config takes Hopper configs",
                                    fix="use matmul(...) for gfx950")
    return _matmul(a, b, trans_b, out_dtype, target, backend, config)


def _require_wgmma(chip) -> None:
    if not chip.has_wgmma:
        raise kiln.UnsupportedError(f"the Kiln GEMM needs WGMMA (sm_90a); {chip.name} has none",
                                    fix="pass target='sm_90a', or gfx950 on AMD")


def _matmul(a, b, trans_b, out_dtype, target, backend, config=None):
    """The general path of :func:`matmul`: checks, padding, tuning, launch or interpretation."""
    chip = resolve_target(target)
    dims = Dims()
    dims.tensor("a", a, "M K")
    dims.tensor("b", b, "N K_b" if trans_b else "K_b N")
    name = _input_dtype(_dtype_name(a))
    if _dtype_name(b) != name:
        raise kiln.KilnTypeError(f"matmul operands must share a dtype, got {name} and "
                                 f"{_dtype_name(b)}", fix="convert one operand first")
    out = _output_dtype(out_dtype, name)
    m, k = a.shape
    n, kb = (b.shape if trans_b else b.shape[::-1])
    if k != kb:
        raise kiln.KilnValueError(f"matmul shapes {tuple(a.shape)} @ {tuple(b.shape)}"
                                  f"{'.T' if trans_b else ''} do not agree on K",
                                  fix="pass A: M x K and B: K x N (or N x K with trans_b=True)")
    check_backend(backend)
    if not chip.is_amd:  # the interpreter runs the same WGMMA kernel
        _require_wgmma(chip)
    if m * n * k == 0:  # nothing to multiply: an empty C, or zeros for K = 0
        return empty_like(a, (m, n), kiln.dtype(out), fill=0.0)
    if chip.is_amd and backend != "interpret":
        raise kiln.UnsupportedError(f"Kiln cannot run {chip.name} kernels on this machine",
                                    fix="use compile_matmul(...) to inspect the AMD kernel, or "
                                        "backend='interpret'")
    # TMA needs 16-byte aligned row strides: zero-pad K (adds nothing) and N (sliced off).
    kp, np_ = _round_up(k, STRIDE_ALIGN), _round_up(n, STRIDE_ALIGN)
    a_in = _padded(a, (m, kp))
    b_in = _padded(b, (np_, kp) if trans_b else (kp, np_))
    c = _empty_like(a, (m, np_), out)
    b_major = "k" if trans_b else "mn"
    if config is None and m <= small_m.SMALL_M and chip.has_wgmma:
        sms = small_m.DEFAULT_SMS if backend == "interpret" else runtime.multiprocessor_count()
        config = small_m.chosen_config(m, np_, kp, name, b_major, out, sms=sms)
    if backend == "interpret":
        _interpret(chip, a_in, b_in, c, trans_b, config)
    elif config is not None:
        run_hopper(a_in, b_in, c, m, np_, kp, dtype=name, b_major=b_major, target=chip.name,
                   config=config)
    else:
        _run_tuned(a_in, b_in, c, m, np_, kp, b_major, name, chip.name)
    return c if np_ == n else contiguous(c[:, :n])


def _compile_hopper(config, a, b, c, m, n, k, dtype, b_major, out_dtype, target):
    # autotune compiles every config up front, concurrently, before timing any
    compile_matmul(dtype, target=target, out_dtype=out_dtype, trans_b=b_major == "k",
                   **dataclasses.asdict(config))


@autotune(configs=HOPPER_CONFIGS, key=["m", "n", "k", "dtype", "b_major", "out_dtype"],
          precompile=_compile_hopper)
def hopper_autotuner(a, b, c, m, n, k, dtype, b_major, out_dtype, target, *, config):
    run_hopper(a, b, c, m, n, k, dtype=dtype, b_major=b_major, target=target, config=config)


def _run_tuned(a, b, c, m, n, k, b_major, dtype, target):
    hopper_autotuner(a, b, c, m, n, k, dtype, b_major, _dtype_name(c), target)


def run_hopper(a, b, c, m, n, k, *, dtype, b_major, target, config, stream=None):
    """Launch the Hopper kernel of ``config`` on prepared (aligned, contiguous) operands over a
    persistent grid of one CTA per SM (at most one per output tile)."""
    if config.gemv:
        gemv.run_gemv(a, b, c, m, n, k, dtype=dtype, b_major=b_major, target=target,
                      stream=stream)
        return
    if config.partials:  # split-K / swap-AB: f32 partials, then a reduction into c
        splitk.run_partials(a, b, c, m, n, k, dtype=dtype, b_major=b_major, target=target,
                            config=config, stream=stream)
        return
    out = _dtype_name(c)
    runtime.launch(make_kernel(dtype, out, b_major, config),
                   _hopper_grid(m, n, dtype, out, b_major, config), (a, b, c, m, n, k),
                   target=target, num_warps=config.num_warps, stream=stream,
                   **_constexprs(config))


def _hopper_grid(m, n, dtype, out, b_major, config) -> tuple[int, int, int]:
    """One CTA per SM (per resident cluster), at most one per output tile."""
    pair = config.cluster_m  # CTAs of a cluster share each (pair) tile's B
    tiles = -(-m // (config.block_m * pair)) * -(-n // config.block_n)
    return runtime.persistent_grid(tiles, pair,
                                   lambda: _resident_clusters(dtype, out, b_major, config))


@functools.lru_cache(maxsize=None)
def _resident_clusters(dtype, out_dtype, b_major, config) -> int:
    """Clusters of ``config``'s kernel that fit on the GPU at once: a persistent grid larger
    than this would run its last clusters in a second wave."""
    return runtime.max_active_clusters(compile_matmul(
        dtype, target="sm_90a", out_dtype=out_dtype, trans_b=b_major == "k",
        **dataclasses.asdict(config)))


def _interpret(chip, a, b, c, trans_b, config=None):
    to_numpy = [ArrayLib.numpy(x) for x in (a, b, c)]
    (m, k), n = to_numpy[0].shape, to_numpy[2].shape[1]
    args = (*to_numpy, m, n, k)
    if chip.is_amd:
        from kiln.kernels.gemm.gfx950 import GemmConfig, make_kernel as make_amd_kernel

        amd = GemmConfig(b_layout="nk" if trans_b else "kn", out_dtype=_dtype_name(c))
        kernel, options = make_amd_kernel(_dtype_name(a), amd), dict(num_warps=amd.num_warps)
        tiles = -(-m // amd.block_m) * -(-n // amd.block_n)
    elif config is not None and config.gemv:
        gemv.run_gemv(*args, dtype=_dtype_name(a), b_major="k" if trans_b else "mn",
                      target=chip.name, interpret=True)
        kernel = None
    elif config is not None and config.partials:
        splitk.run_partials(*args, dtype=_dtype_name(a), b_major="k" if trans_b else "mn",
                            target=chip.name, config=config, interpret=True)
        kernel = None
    else:
        cfg = config or HopperGemmConfig()
        kernel = make_kernel(_dtype_name(a), _dtype_name(c), "k" if trans_b else "mn", cfg)
        options = dict(num_warps=cfg.num_warps, **_constexprs(cfg))
        tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
        if cfg.pingpong:  # few CTAs, so that both consumers take turns over several tiles
            tiles = min(tiles, INTERPRET_PINGPONG_CTAS)
    if kernel is not None:
        runtime.interpret(kernel, (tiles, 1, 1), list(args), target=chip.name, **options)
    if to_numpy[2] is not c:
        ArrayLib(c).copy_into(c, to_numpy[2])


def _input_dtype(dtype) -> str:
    name = kiln.dtype(dtype).name
    if name not in SUPPORTED_DTYPES:
        raise kiln.UnsupportedError(f"the Kiln GEMM does not support {name} inputs",
                                    fix=f"convert to one of {', '.join(SUPPORTED_DTYPES)}")
    return name


def _output_dtype(out_dtype, input_name: str) -> str:
    name = kiln.dtype(out_dtype).name if out_dtype is not None else input_name
    if name not in OUT_DTYPES:
        raise kiln.UnsupportedError(f"the Kiln GEMM cannot write {name} outputs",
                                    fix=f"use one of {', '.join(OUT_DTYPES)}")
    return name


def _dtype_name(x) -> str:
    library_dtype = x.dtype
    try:
        return _DTYPE_NAMES[library_dtype]
    except (KeyError, TypeError):  # a new (or unhashable) dtype: converted, and kept if it can
        name = kiln.dtype(library_dtype).name
        with contextlib.suppress(TypeError):
            _DTYPE_NAMES[library_dtype] = name
        return name


_DTYPE_NAMES: dict = {}  # library dtype -> Kiln dtype name (kiln.dtype costs ~2 µs a call)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _empty_like(x, shape, dtype_name):
    """The output: uninitialised on a torch device; NaN in numpy, so an element the kernel
    failed to write cannot pass for a result."""
    return empty_like(x, shape, kiln.dtype(dtype_name), fill=None if is_torch(x) else np.nan)


def _padded(x, shape: tuple):
    """``x`` itself when already ``shape`` and contiguous, else a zero-padded copy."""
    if tuple(x.shape) == shape:
        return contiguous(x)
    out = x.new_zeros(shape) if is_torch(x) else np.zeros(shape, x.dtype)
    out[tuple(slice(0, s) for s in x.shape)] = x
    return out
