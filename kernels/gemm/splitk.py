"""Split-K and swap-AB for the Hopper GEMM: f32 partial tiles, then a deterministic reduction.

A *partials* config (:attr:`HopperGemmConfig.partials`) runs :func:`.hopper.make_kernel` with
an f32 output that is not ``C`` but a workspace ``W`` of ``slices`` stacked partial products,
and :func:`reduce_kernel` sums the slices in a fixed order into ``C``:

| phase | grid | what |
| --- | --- | --- |
| partials | one CTA per SM (at most one per work unit) | work unit ``u`` = K slice ``u // tiles`` of output tile ``u % tiles``: the GEMM's main loop over that slice's K steps, TMA-stored as f32 at row ``slice * slice_rows`` of ``W`` |
| reduce | ``ceil(rows * cols / (WIDTH * 256))`` CTAs of 256 threads | ``C = sum_s W[s]`` (slice 0 first: bitwise reproducible), cast to ``C``'s dtype; with swap-AB ``W`` holds ``C.T`` and the reduction transposes |

*split-K* (``split_k = S``) cuts the K steps into ``S`` slices (fewer when K is short: every
slice has at least one step), so a GEMM of few output tiles still gives every SM work: at
M = 16, N = K = 4096 a 128 x 128 tiling has 32 tiles for 132 SMs; 4 slices make 128 units.
*swap-AB* computes ``C.T = B.T @ A.T`` (B stored N x K is exactly a K-major A operand, and A a
K-major B operand), so a decode-sized M (1..64) becomes WGMMA's N (32 or 64 columns, not 64
rows of which 63 are padding) and the partials are ``N x M``, not ``64 x N`` per slice.

Example (through ``kiln.kernels.gemm``, which calls :func:`run_partials`)::

    cfg = HopperGemmConfig(block_n=32, swap_ab=True, split_k=4, stages=8)
    run_hopper(a, w, c, m, n, k, dtype="bf16", b_major="k", target="sm_90a", config=cfg)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

import kiln
from kiln import nvidia_asm

from .. import runtime
from ..runtime import empty_like, is_torch
from ..workspaces import StreamWorkspaces
from . import streamk
from .hopper import HopperGemmConfig, kernel_constexprs, make_kernel

REDUCE_THREADS = 256
VECTOR = 4  # f32 partials per thread and load when the reduction does not transpose
PARTIALS_ALIGN = 4  # f32 elements per 16 bytes: TMA's row-stride granule
INTERPRET_STREAM_K_CTAS = 5  # few CTAs, so that interpreted stream-K tiles split across them


@dataclass(frozen=True)
class PartialsLayout:
    """Where a partials config's slices live: ``W`` is ``[slices * slice_rows, cols]`` f32.

    ``m``, ``n`` are the kernel's problem (``N``, ``M`` when swapped); ``slice_rows`` rounds
    ``m`` up to whole tiles (tile rows past ``m`` land there, unread); ``cols`` rounds ``n``
    up to 16 bytes. Example: ``PartialsLayout.of(4096, 16, 4096, cfg).units``.
    """

    m: int
    n: int
    slices: int
    slice_rows: int
    cols: int
    tiles: int

    @classmethod
    def of(cls, m: int, n: int, k: int, config: HopperGemmConfig) -> "PartialsLayout":
        k_tiles = -(-k // config.block_k)
        steps = -(-k_tiles // config.split_k)  # the kernel's slice length, in K steps
        tiles_m = -(-m // config.block_m)
        return cls(m=m, n=n, slices=-(-k_tiles // steps), slice_rows=tiles_m * config.block_m,
                   cols=-(-n // PARTIALS_ALIGN) * PARTIALS_ALIGN,
                   tiles=tiles_m * -(-n // config.block_n))

    @property
    def units(self) -> int:
        return self.tiles * self.slices


def run_partials(a, b, c, m, n, k, *, dtype, b_major, target, config, stream=None,
                 interpret=False, ctas=None) -> None:
    """``c = a @ b`` (``b_major`` as in :func:`.hopper.make_kernel`) with a partials
    ``config``: the kernel into an f32 workspace, then :func:`reduce_kernel` into ``c``.
    ``interpret`` runs both kernels in the CPU interpreter (numpy operands); ``ctas`` sets a
    stream-K grid (default: one CTA per SM, :data:`INTERPRET_STREAM_K_CTAS` interpreted)."""
    _check_layout(config, b_major)
    x, y, pm, pn = (b, a, n, m) if config.swap_ab else (a, b, m, n)
    if config.reduces_in_kernel:
        grid = _fused_grid(pm, pn, k, config, interpret, ctas)
        kernel, args, options = _fused_launch(x, y, c, pm, pn, k, dtype, b_major, config,
                                              _fused_buffers(c, pm, pn, k, config, grid))
        if interpret:
            runtime.interpret(kernel, grid, list(args), target=target, **options)
        else:
            runtime.launch(kernel, grid, args, stream=stream, target=target, **options)
        return
    layout = PartialsLayout.of(pm, pn, k, config)
    w = empty_like(c, (layout.slices * layout.slice_rows, layout.cols), kiln.f32,
                   fill=None if is_torch(c) else np.nan)
    kernel = make_kernel(dtype, "f32", "k" if config.swap_ab else b_major, config)
    options = dict(target=target, num_warps=config.num_warps, **kernel_constexprs(config))
    reduce = reduce_kernel(config.pdl)
    width = 1 if config.swap_ab else VECTOR
    reduce_args = (w, c, m, n, layout.slice_rows, layout.slices)
    reduce_grid = (-(-m * n // (width * REDUCE_THREADS)), 1, 1)
    reduce_options = dict(target=target, num_warps=REDUCE_THREADS // 32,
                          SWAP=int(config.swap_ab), WIDTH=width)
    if interpret:
        runtime.interpret(kernel, (layout.units, 1, 1), [x, y, w, pm, pn, k], **options)
        runtime.interpret(reduce, reduce_grid, list(reduce_args), **reduce_options)
        return
    grid = runtime.persistent_grid(layout.units)
    runtime.launch(kernel, grid, (x, y, w, pm, pn, k), stream=stream, **options)
    runtime.launch(reduce, reduce_grid, reduce_args, stream=stream, **reduce_options)


def bind_partials(a, b, c, m, n, k, *, dtype, b_major, target, config):
    """A bound launch pair (one launch with ``fused_reduce``) for torch operands shaped like
    ``a, b, c``: a :class:`PairedLaunch`, called with the three data pointers. The workspace
    (and the fused reduction's tickets, which only grow: see :func:`.epilogue.finish_fused`) is
    kept per stream: launches on one stream run in order, and every launch writes each partial
    before reading it; a CUDA-graph capture gets its own for the calls it records
    (:class:`~kiln.kernels.workspaces.StreamWorkspaces`)."""
    import torch

    x, y, pm, pn = (b, a, n, m) if config.swap_ab else (a, b, m, n)
    if config.reduces_in_kernel:
        return _bind_fused(x, y, c, pm, pn, k, dtype, b_major, target, config, torch)
    layout = PartialsLayout.of(pm, pn, k, config)
    shape = (layout.slices * layout.slice_rows, layout.cols)
    w = torch.empty(shape, dtype=torch.float32, device=c.device)
    kernel = make_kernel(dtype, "f32", "k" if config.swap_ab else b_major, config)
    grid = runtime.persistent_grid(layout.units)
    main = runtime.bind(kernel, grid, [x, y, w, pm, pn, k], target=target,
                        num_warps=config.num_warps, **kernel_constexprs(config))
    width = 1 if config.swap_ab else VECTOR
    reduce = runtime.bind(reduce_kernel(config.pdl), (-(-m * n // (width * REDUCE_THREADS)), 1, 1),
                          [w, c, m, n, layout.slice_rows, layout.slices], target=target,
                          num_warps=REDUCE_THREADS // 32, SWAP=int(config.swap_ab),
                          WIDTH=width)

    def new_workspace():
        ws = torch.empty_like(w)
        return ws, ws.data_ptr()

    spaces = StreamWorkspaces(new_workspace, runtime.capture_id)

    def launch_on(stream, a_ptr, b_ptr, c_ptr):
        ws, ws_ptr = spaces.get(stream)  # ws held until both launches are queued
        main.launch_on(stream, b_ptr, a_ptr, ws_ptr) if config.swap_ab else \
            main.launch_on(stream, a_ptr, b_ptr, ws_ptr)
        reduce.launch_on(stream, ws_ptr, c_ptr)

    return PairedLaunch(main.current_stream, launch_on)


def _check_layout(config: HopperGemmConfig, b_major: str) -> None:
    if config.swap_ab and b_major != "k":
        raise kiln.UnsupportedError("swap-AB needs B stored N x K (it becomes the K-major A "
                                    "operand)", fix="pass trans_b=True, or swap_ab=False")


def _fused_grid(m, n, k, config, interpret, ctas=None) -> tuple[int, int, int]:
    """One CTA per SM, at most one per work unit (split-K) or K step (stream-K); in the
    interpreter one per work unit, or :data:`INTERPRET_STREAM_K_CTAS` for stream-K."""
    layout = PartialsLayout.of(m, n, k, config)
    if config.stream_k:
        sms = ctas or (INTERPRET_STREAM_K_CTAS if interpret else runtime.multiprocessor_count())
        return streamk.grid_size(layout.tiles, -(-k // config.block_k), sms), 1, 1
    return max(1, layout.units if interpret else
               min(layout.units, runtime.multiprocessor_count())), 1, 1


def _fused_buffers(c, m, n, k, config, grid) -> tuple:
    """The in-kernel reduction's f32 slots (NaN in numpy) and zeroed i64 tickets for the
    kernel's ``m x n x k`` problem: split-K, one slot per tile, consumer and slice and one
    ticket per tile and consumer; stream-K (:mod:`.streamk`), two slots per CTA and consumer
    and one ticket per stream-K tile and consumer; a swap-AB config without K slices stores C
    directly and gets a placeholder of each."""
    layout = PartialsLayout.of(m, n, k, config)
    if config.stream_k:
        slots = streamk.SLOTS_PER_CTA * grid[0] * config.consumers
        tickets = max(1, streamk.stream_k_tiles(layout.tiles, grid[0])) * config.consumers
    elif config.split_k == 1:  # swap-AB over all of K stores C directly: nothing to sum
        slots, tickets = 0, 1
    else:
        slots = layout.tiles * config.consumers * layout.slices
        tickets = layout.tiles * config.consumers
    work = empty_like(c, (max(1, slots * 64 * config.block_n),), kiln.f32,
                      fill=None if is_torch(c) else np.nan)
    return work, empty_like(c, (tickets,), kiln.i64, fill=0)


def _fused_launch(x, y, c, m, n, k, dtype, b_major, config, buffers):
    """Kernel, arguments and options of a fused launch."""
    kernel = make_kernel(dtype, kiln.dtype(c.dtype).name, "k" if config.swap_ab else b_major,
                         config)
    # C is the TMA store target (unused with swap-AB, which stores C.T through c_out).
    args = (x, y, c, m, n, k, *buffers) + ((c,) if config.swap_ab else ())
    return kernel, args, dict(num_warps=config.num_warps, **kernel_constexprs(config))


def _bind_fused(x, y, c, m, n, k, dtype, b_major, target, config, torch):
    grid = _fused_grid(m, n, k, config, False)
    work, tickets = _fused_buffers(c, m, n, k, config, grid)
    kernel, args, options = _fused_launch(x, y, c, m, n, k, dtype, b_major, config,
                                          (work, tickets))
    bound = runtime.bind(kernel, grid, list(args), target=target, **options)

    def new_buffers():
        buffers = torch.empty_like(work), torch.zeros_like(tickets)
        return buffers, tuple(t.data_ptr() for t in buffers)

    spaces = StreamWorkspaces(new_buffers, runtime.capture_id)

    def launch_on(stream, a_ptr, b_ptr, c_ptr):
        buffers, pointers = spaces.get(stream)  # buffers held until the launch is queued
        x_ptr, y_ptr = (b_ptr, a_ptr) if config.swap_ab else (a_ptr, b_ptr)
        bound.launch_on(stream, x_ptr, y_ptr, c_ptr, *pointers,
                        *((c_ptr,) if config.swap_ab else ()))

    return PairedLaunch(bound.current_stream, launch_on)


class PairedLaunch:
    """The bound launches of one split-K GEMM call (main and reduce, or one fused launch)
    behind a bound launch's interface: ``launch(a_ptr, b_ptr, c_ptr, stream=None)``,
    ``current_stream()`` and ``launch_on(stream, a_ptr, b_ptr, c_ptr)``."""

    def __init__(self, current_stream, launch_on):
        self.current_stream, self.launch_on = current_stream, launch_on

    def __call__(self, a_ptr: int, b_ptr: int, c_ptr: int, stream=None) -> None:
        self.launch_on(self.current_stream() if stream is None else stream, a_ptr, b_ptr,
                       c_ptr)

    def launch_outputs(self, outputs, stream, *items):
        """``c`` made by ``outputs`` and launched into (see
        :func:`kiln.runtime.launch.launch_with_outputs`)."""
        return runtime.launch_with_outputs(self.launch_on, outputs, stream, items)


@functools.lru_cache(maxsize=None)
def reduce_kernel(pdl: bool = False):
    """The slice reduction: ``c[i, j] = sum_s w[s * slice_rows + i, j]`` (``SWAP``: of
    ``w[s * slice_rows + j, i]``), f32 in slice order, cast to ``c``'s dtype; ``WIDTH``
    consecutive columns per thread (1 with ``SWAP``); ``pdl``: a programmatic dependent launch
    (see :class:`.hopper.HopperGemmConfig`)."""

    def splitk_reduce(w: kiln.Tensor[kiln.f32, 2], c, m: kiln.i32, n: kiln.i32,
                      slice_rows: kiln.i32, slices: kiln.i32, SWAP: kiln.constexpr,
                      WIDTH: kiln.constexpr):
        if pdl:
            nvidia_asm.grid_dependency_wait()
            nvidia_asm.launch_dependents()
        i = kiln.block_id(0) * REDUCE_THREADS + kiln.thread_id(0)
        if SWAP:  # threads run along w's rows (C's columns) for coalesced reads
            row, col = i % m, i // m
            w_row, w_col = col, row
        else:
            row, col = i // (n // WIDTH), (i % (n // WIDTH)) * WIDTH
            w_row, w_col = row, col
        if i * WIDTH < m * n:
            total = w.load(w_row, w_col, width=WIDTH, align=4 * WIDTH)
            for s in kiln.range(1, slices):
                total = total + w.load(s * slice_rows + w_row, w_col, width=WIDTH,
                                       align=4 * WIDTH)
            c.store(row, col, kiln.cast(total, c.dtype), align=c.dtype.itemsize * WIDTH)

    return kiln.kernel(splitk_reduce)
