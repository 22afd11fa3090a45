"""Matrix-vector products for decode (M of 1 to :data:`MAX_ROWS`, weights stored N x K;
M of 5..16 run the tensor-core GEMV of :mod:`.gemv_mma`, dispatched here).

``c[i, j] = sum_k a[i, k] * w[j, k]``: a pure stream of the weights, with no tensor-core tile
to pad (swap-AB pads M = 1 to a 32-column WGMMA tile and runs one CTA per 128 weight rows,
which at Llama-3-8B QKV, N = 6144, leaves 84 of 132 SMs idle). Each warp owns ``ROWS`` weight
rows; its 32 lanes read 16-byte vectors (8 bf16) of each row, ``UNROLL`` vectors of a row in
flight per lane, multiply them with the same columns of every row of ``a`` in f32, and sum the
lanes with butterfly shuffles; lane 0 stores ``c``. K must be a multiple of 8 (``matmul`` pads
it), N and M need not be anything.

Example (through ``kiln.kernels.gemm``, which calls :func:`run_gemv`)::

    run_gemv(x, w, c, m=1, n=6144, k=4096, dtype="bf16", target="sm_90a")
"""

import functools
import operator

import numpy as np

import kiln

from .. import runtime
from . import gemv_mma

MAX_ROWS = 4  # rows of a; above, the CUDA cores' FMAs rather than the weight stream bound it
VECTOR = 8  # elements of one 16-byte load
WARPS = 8  # warps per CTA
ROWS = 2  # weight rows per warp
UNROLL = 4  # 16-byte loads of one row in flight per lane
LANE_MASKS = (16, 8, 4, 2, 1)


@functools.lru_cache(maxsize=None)
def gemv_kernel(dtype: str, out_dtype: str, m: int, rows: int = ROWS, unroll: int = UNROLL):
    """The ``@kiln.kernel`` for ``m`` rows of ``a`` (``m <= MAX_ROWS``), ``rows`` weight rows
    per warp, ``unroll`` loads of each in flight per lane."""
    in_type, out_type = kiln.dtype(dtype), kiln.dtype(out_dtype)
    step = 32 * VECTOR  # K columns one warp covers per load

    def gemv(a: kiln.Tensor[in_type, 2], w: kiln.Tensor[in_type, 2], c: kiln.Tensor[out_type, 2],
             n: kiln.i32, k: kiln.i32):
        lane = kiln.thread_id(0) % 32
        first = (kiln.block_id(0) * (kiln.block_dim(0) // 32) + kiln.thread_id(0) // 32) * rows
        # rows past N read row N - 1 again (a valid address); they are never stored
        row_ids = [kiln.minimum(first + r, n - 1) for r in range(rows)]
        totals = [kiln.cast(0.0, kiln.f32) for _ in range(rows * m)]  # [r * m + i]
        whole = k - k % (step * unroll)  # K columns of whole unrolled rounds
        for k0 in kiln.range(lane * VECTOR, whole, step * unroll):
            totals = accumulate(a, w, row_ids, [k0 + u * step for u in range(unroll)], totals)
        for col in kiln.range(whole + lane * VECTOR, k, step):
            totals = accumulate(a, w, row_ids, [col], totals)
        for r in kiln.static_range(rows):
            for i in range(m):
                total = kiln.shuffle.butterfly_reduce(totals[r * m + i], LANE_MASKS, operator.add)
                if (lane == 0) & (first + r < n):
                    c.store(i, first + r, kiln.cast(total, out_type))

    def accumulate(a, w, row_ids, cols, totals):
        """``totals`` plus the products of columns ``col .. col + 8`` for each of ``cols``:
        every 16-byte load (each weight row's, each row of ``a``'s) issued before the FMAs."""
        def load(t, row, col):
            return kiln.unpack(t.load(row, col, width=VECTOR, align=16))

        xs = [[load(a, i, col) for i in range(m)] for col in cols]
        ws = [[load(w, row, col) for row in row_ids] for col in cols]
        out = list(totals)
        for j in range(len(cols)):
            for r in range(len(row_ids)):
                for i in range(m):
                    for e in range(VECTOR):
                        out[r * m + i] = kiln.fma(kiln.cast(ws[j][r][e], kiln.f32),
                                                  kiln.cast(xs[j][i][e], kiln.f32),
                                                  out[r * m + i])
        return out

    gemv.__name__ = gemv.__qualname__ = f"gemv_{dtype}_{out_dtype}_m{m}_r{rows}_u{unroll}"
    return kiln.kernel(gemv)


def grid(n: int, rows: int = ROWS, warps: int = WARPS) -> tuple[int, int, int]:
    """CTAs of ``warps`` warps for ``n`` weight rows, ``rows`` per warp (the kernel takes its
    warps per CTA from the launch)."""
    return -(-n // (warps * rows)), 1, 1


def check(m: int, b_major: str) -> None:
    """Refuse what the GEMV has no code for (a :class:`kiln.KilnError`, which the small-M
    autotuner skips)."""
    if b_major != "k":
        raise kiln.UnsupportedError("the GEMV reads weights stored N x K",
                                    fix="pass trans_b=True, or a HopperGemmConfig without gemv")
    if not 1 <= m <= gemv_mma.MAX_ROWS:
        raise kiln.UnsupportedError(f"the GEMV takes M of 1..{gemv_mma.MAX_ROWS}, got {m}",
                                    fix="use a tiled HopperGemmConfig (gemv=False)")


def launch_plan(dtype: str, out_dtype: str, m: int, n: int, k: int) -> tuple:
    """``(kernel, grid, arguments after a, w, c, num_warps)`` of the GEMV for ``m`` rows: this
    module's up to :data:`MAX_ROWS`, the tensor-core one of :mod:`.gemv_mma` above."""
    if m <= MAX_ROWS:
        return gemv_kernel(dtype, out_dtype, m), grid(n), (n, k), WARPS
    return (gemv_mma.mma_gemv_kernel(dtype, out_dtype, gemv_mma.halves(m)), gemv_mma.grid(n),
            (m, n, k), gemv_mma.WARPS)


def compile_gemv(dtype: str, out_dtype: str, *, target: str, m: int = 1):
    """The compiled GEMV (``CompiledKernel``) for ``m`` rows, without running it (NVIDIA
    targets: its lanes are 32-wide warps)."""
    check(m, "k")
    if runtime.resolve_target(target).is_amd:
        raise kiln.UnsupportedError(f"the GEMV runs on NVIDIA GPUs, not {target}",
                                    fix="pass target='sm_90a'")
    like = np.empty((1, 1), kiln.dtype(dtype).numpy)
    kernel, _, sizes, warps = launch_plan(dtype, out_dtype, m, 1, 1)
    return kernel.compile(like, like, np.empty((1, 1), kiln.dtype(out_dtype).numpy),
                          *(1 for _ in sizes), target=target, num_warps=warps)


def run_gemv(a, w, c, m, n, k, *, dtype, b_major, target, stream=None,
             interpret=False) -> None:
    """``c = a @ w.T`` for prepared operands (K a multiple of 8, contiguous); ``interpret``
    runs the kernel in the CPU interpreter (numpy operands)."""
    check(m, b_major)
    kernel, blocks, sizes, warps = launch_plan(dtype, kiln.dtype(c.dtype).name, m, n, k)
    args = (a, w, c, *sizes)
    if interpret:
        runtime.interpret(kernel, blocks, list(args), target=target, num_warps=warps)
    else:
        runtime.launch(kernel, blocks, args, target=target, num_warps=warps, stream=stream)


def bind_gemv(a, w, c, m, n, k, *, dtype, target):
    """The bound launch of torch operands shaped like ``a, w, c`` (called with their three
    data pointers)."""
    check(m, "k")
    kernel, blocks, sizes, warps = launch_plan(dtype, kiln.dtype(c.dtype).name, m, n, k)
    return runtime.bind(kernel, blocks, [a, w, c, *sizes], target=target, num_warps=warps)
