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
cache). ``backend="interpret"`` runs the kernel of ``target`` in Kiln's CPU interpreter.

Grouped (MoE) GEMM, one persistent launch over the tiles of all groups (:mod:`.grouped` on
sm_90a, a grouped variant of the gfx950 kernel; host code in :mod:`.grouped_api`; bf16/f16,
FP8 not yet)::

    from kiln.kernels.gemm import grouped_matmul, compile_grouped_matmul

    # a: [total_M, K] rows of all groups back to back, w: [G, K, N], offs: int32 [G + 1]
    c = grouped_matmul(a, w, offs)                 # c[offs[g]:offs[g+1]] = a[...] @ w[g]
    c = grouped_matmul(a, w_t, offs, trans_b=True)  # w_t: [G, N, K]
    ck = compile_grouped_matmul("bf16", target="sm_90a", groups=64)
"""

import dataclasses
import functools

import numpy as np

import kiln
from kiln.autotune import autotune

from .. import dlpack, runtime
from ..runtime import (ArrayLib, Dims, PlanCache, check_backend, contiguous, empty_like,
                       is_torch, resolve_target, spec)
from .grouped_api import compile_grouped_matmul, grouped_matmul
from .hopper import OUT_DTYPES, SUPPORTED_DTYPES, HopperGemmConfig, make_kernel

__all__ = ["matmul", "compile_matmul", "grouped_matmul", "compile_grouped_matmul",
           "HopperGemmConfig", "HOPPER_CONFIGS"]

# TMA global strides must be multiples of 16 bytes: 8 elements of a 2-byte dtype.
STRIDE_ALIGN = 8
HOPPER_CONFIGS = (HopperGemmConfig(),
                  HopperGemmConfig(stages=3),
                  # 8192 / 192 tiles fill the last wave of 132 SMs better than 8192 / 256.
                  HopperGemmConfig(block_n=192),
                  HopperGemmConfig(block_n=128, stages=5),
                  HopperGemmConfig(block_m=64, block_n=256, stages=4),
                  # CTA pairs multicasting B: a third less L2->SM traffic per CTA.
                  HopperGemmConfig(cluster_m=2),
                  HopperGemmConfig(block_n=192, cluster_m=2))


def compile_matmul(dtype, *, target, out_dtype=None, trans_b=False, **config):
    """Compile (without running) the GEMM for ``dtype`` inputs on ``target``; returns the
    ``CompiledKernel`` (``.asm`` stages, ``.metadata``).

    ``config`` keywords are the fields of :class:`HopperGemmConfig` on NVIDIA, or of the
    gfx950 kernel's ``GemmConfig`` on AMD (where ``trans_b`` and ``out_dtype`` fill its
    ``b_layout`` and ``out_dtype`` unless given).
    Example: ``compile_matmul("bf16", target="sm_90a", stages=3).metadata["registers"]``.
    """
    chip = resolve_target(target)
    name = _input_dtype(dtype)
    if chip.is_amd:
        from . import gfx950

        config.setdefault("b_layout", "nk" if trans_b else "kn")
        config.setdefault("out_dtype", out_dtype and kiln.dtype(out_dtype).name)
        return gfx950.compile_gfx950(name, target=chip.name, config=gfx950.GemmConfig(**config))
    if not chip.has_wgmma:
        raise kiln.UnsupportedError(f"the Kiln GEMM needs WGMMA (sm_90a); {chip.name} has none",
                                    fix="compile for target='sm_90a', or gfx950 on AMD")
    out = _output_dtype(out_dtype, name)
    cfg = HopperGemmConfig(**config)
    b_major = "k" if trans_b else "mn"
    # Placeholder arrays carry dtype and rank only: the kernel is specialised on them.
    a = np.empty((1, 1), kiln.dtype(name).numpy)
    c = np.empty((1, 1), kiln.dtype(out).numpy)
    return make_kernel(name, out, b_major, cfg).compile(a, a, c, 1, 1, 1, target=chip.name,
                                                        num_warps=cfg.num_warps,
                                                        **_constexprs(cfg))


def matmul(a, b, *, trans_b=False, out_dtype=None, target=None, backend=None):
    """``a @ b`` (``a @ b.T`` with ``trans_b``) on the GPU; see the module docs.

    Accepts torch CUDA tensors (returns a torch tensor, asynchronous on the current stream)
    or numpy arrays (copied to the device and back). Shapes need not be multiples of the tile.
    Inputs are validated before anything compiles (a :class:`kiln.KilnError` naming the
    operand: kinds, ranks, dtypes, agreeing K). ``M`` or ``N`` of 0 gives an empty ``c``;
    ``K = 0`` gives zeros; neither launches a kernel.
    With contiguous torch CUDA tensors whose K and N are multiples of 8, a repeat call of one
    shape class is a plan look-up, one allocation and one bound launch of the tuned config.
    Example: ``c = matmul(torch.randn(1000, 512, dtype=torch.bfloat16, device="cuda"), w)``.
    """
    key = (spec(a), spec(b), trans_b, out_dtype, target, backend)
    plan = _PLANS.lookup(key)
    if plan is not None:
        c = a.new_empty(plan.shape, dtype=plan.out)
        plan.bound(a.data_ptr(), b.data_ptr(), c.data_ptr())
        return c
    if dlpack.foreign(a):  # cupy / JAX / DLPack device arrays: zero-copy through torch
        return dlpack.through_torch(matmul, a, b, trans_b=trans_b, out_dtype=out_dtype,
                                    target=target, backend=backend)
    c = _matmul(a, b, trans_b, out_dtype, target, backend)
    chip = resolve_target(target)
    if backend != "interpret" and chip.has_wgmma and runtime.bindable(a, b) and c.numel() and \
            a.shape[1] % STRIDE_ALIGN == 0 and c.shape[1] % STRIDE_ALIGN == 0:  # not padded
        _PLANS.add(key, _bind(a, b, c, trans_b, chip.name))
    return c


# Bound torch plans by the operands' specs and the options (see kiln.kernels.runtime), made
# after a shape class's first call, which tunes the config they bind.
_PLANS = PlanCache("matmul")


@dataclasses.dataclass(frozen=True)
class _MatmulPlan:
    bound: object  # kiln.kernels.runtime.bind's launch of the tuned config
    shape: tuple[int, int]
    out: object  # torch dtype of C


def _bind(a, b, c, trans_b, target) -> _MatmulPlan:
    """The plan of aligned contiguous torch operands: the config the first call tuned, bound
    to its persistent grid."""
    (m, k), n = a.shape, c.shape[1]
    dtype, out, b_major = _dtype_name(a), _dtype_name(c), "k" if trans_b else "mn"
    config = hopper_autotuner.best[hopper_autotuner.key_of(
        (a, b, c, m, n, k, dtype, b_major, out, target), {})]
    args = [a, b, c, m, n, k]
    bound = runtime.bind(make_kernel(dtype, out, b_major, config),
                         _hopper_grid(m, n, dtype, out, b_major, config), args, target=target,
                         num_warps=config.num_warps, **_constexprs(config))
    return _MatmulPlan(bound=bound, shape=(m, n), out=c.dtype)


def _matmul(a, b, trans_b, out_dtype, target, backend):
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
    if backend == "interpret":
        _interpret(chip, a_in, b_in, c, trans_b)
    else:
        _run_tuned(a_in, b_in, c, m, np_, kp, "k" if trans_b else "mn", name, chip.name)
    return c if np_ == n else contiguous(c[:, :n])


def _compile_hopper(config, a, b, c, m, n, k, dtype, b_major, out_dtype, target):
    # autotune compiles every config up front, concurrently, before timing any
    make_kernel(dtype, out_dtype, b_major, config).compile(
        a, b, c, m, n, k, target=target, num_warps=config.num_warps, **_constexprs(config))


@autotune(configs=HOPPER_CONFIGS, key=["m", "n", "k", "dtype", "b_major", "out_dtype"],
          precompile=_compile_hopper)
def hopper_autotuner(a, b, c, m, n, k, dtype, b_major, out_dtype, target, *, config):
    run_hopper(a, b, c, m, n, k, dtype=dtype, b_major=b_major, target=target, config=config)


def _run_tuned(a, b, c, m, n, k, b_major, dtype, target):
    hopper_autotuner(a, b, c, m, n, k, dtype, b_major, _dtype_name(c), target)


def run_hopper(a, b, c, m, n, k, *, dtype, b_major, target, config, stream=None):
    """Launch the Hopper kernel of ``config`` on prepared (aligned, contiguous) operands over a
    persistent grid of one CTA per SM (at most one per output tile)."""
    out = _dtype_name(c)
    runtime.launch(make_kernel(dtype, out, b_major, config),
                   _hopper_grid(m, n, dtype, out, b_major, config), (a, b, c, m, n, k),
                   target=target, num_warps=config.num_warps, stream=stream,
                   **_constexprs(config))


def _hopper_grid(m, n, dtype, out, b_major, config) -> tuple[int, int, int]:
    """One CTA per SM (per resident cluster), at most one per output tile."""
    pair = config.cluster_m  # CTAs of a cluster share each (pair) tile's B
    tiles = -(-m // (config.block_m * pair)) * -(-n // config.block_n)
    resident = runtime.multiprocessor_count() if pair == 1 else \
        _resident_clusters(dtype, out, b_major, config)
    return pair * max(1, min(tiles, resident)), 1, 1


@functools.lru_cache(maxsize=None)
def _resident_clusters(dtype, out_dtype, b_major, config) -> int:
    """Clusters of ``config``'s kernel that fit on the GPU at once: a persistent grid larger
    than this would run its last clusters in a second wave."""
    return runtime.max_active_clusters(compile_matmul(
        dtype, target="sm_90a", out_dtype=out_dtype, trans_b=b_major == "k",
        **dataclasses.asdict(config)))


def _interpret(chip, a, b, c, trans_b):
    to_numpy = [ArrayLib.numpy(x) for x in (a, b, c)]
    (m, k), n = to_numpy[0].shape, to_numpy[2].shape[1]
    args = (*to_numpy, m, n, k)
    if chip.is_amd:
        from kiln.kernels.gemm.gfx950 import GemmConfig, make_kernel as make_amd_kernel

        amd = GemmConfig(b_layout="nk" if trans_b else "kn", out_dtype=_dtype_name(c))
        kernel, options = make_amd_kernel(_dtype_name(a), amd), dict(num_warps=amd.num_warps)
        tiles = -(-m // amd.block_m) * -(-n // amd.block_n)
    else:
        cfg = HopperGemmConfig()
        kernel = make_kernel(_dtype_name(a), _dtype_name(c), "k" if trans_b else "mn", cfg)
        options = dict(num_warps=cfg.num_warps, **_constexprs(cfg))
        tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    runtime.interpret(kernel, (tiles, 1, 1), list(args), target=chip.name, **options)
    if to_numpy[2] is not c:
        ArrayLib(c).copy_into(c, to_numpy[2])


def _constexprs(cfg: HopperGemmConfig) -> dict:
    return dict(BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, STAGES=cfg.stages,
                GROUP_M=cfg.group_m, PRODUCER_REGS=cfg.producer_registers,
                CONSUMER_REGS=cfg.consumer_registers, CLUSTER_M=cfg.cluster_m)


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
    return kiln.dtype(x.dtype).name


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
