"""Tensor-core GEMV for decode batches of :data:`MIN_ROWS` to :data:`MAX_ROWS` rows of A
(weights stored N x K): the GEMV of :mod:`.gemv` for M where CUDA-core FMAs would bound it.

``c[i, j] = sum_k a[i, k] * w[j, k]``. Like :mod:`.gemv` a plain stream of the weights by
16-byte loads (no TMA ring, no swap-AB tile padding N to 128 rows per CTA), but the products
run on ``mma.sync.m16n8k16``: a CTA owns :data:`TILE_ROWS` weight rows (the MMA's M; or
``tiles`` such row tiles, which share each load of A) and its
:data:`WARPS` warps take turns over K in 32-column blocks (a round of the CTA reads 512
contiguous bytes of each row); the rows of A are the MMA's N, 8 per n-half (two halves up to
M = 16). Lane ``l`` (``g = l // 4``, ``t = l % 4``) loads 16 contiguous bytes at column
``8 t`` of the block from weight rows ``g`` and ``g + 8`` and from A's row ``g`` of each half:
both operands take the MMA's K in the same permuted order (logical ``2t, 2t + 1, 2t + 8,
2t + 9`` of the block's ``c``-th k16 MMA are physical ``8t + 4c .. 8t + 4c + 3``), which
leaves every dot product unchanged and needs neither shared memory nor ``ldmatrix`` on the
way in. The warps' C fragments are summed through shared memory and stored by warp 0.

Example (through ``kiln.kernels.gemm``: ``HopperGemmConfig(gemv=True)`` at M of 5..16)::

    run_gemv(x, w, c, m=16, n=6144, k=4096, dtype="bf16", b_major="k", target="sm_90a")
"""

import functools

import kiln
from kiln.shared import shared

MIN_ROWS = 5  # below, the CUDA-core GEMV of .gemv
MAX_ROWS = 16  # two n8 halves of the MMA
TILE_ROWS = 16  # weight rows per CTA: the MMA's M
BLOCK = 32  # K columns per block and warp: two k16 MMAs
VECTOR = 8  # elements of one 16-byte load
WARPS = 8
UNROLL = 2  # blocks per warp in flight
TILES = 1  # MMA row tiles (of TILE_ROWS weight rows) per CTA


@functools.lru_cache(maxsize=None)
def mma_gemv_kernel(dtype: str, out_dtype: str, halves: int, warps: int = WARPS,
                    unroll: int = UNROLL, tiles: int = TILES):
    """The ``@kiln.kernel`` for ``8 * halves`` rows of A at most, ``warps`` warps per CTA,
    ``unroll`` 32-column blocks in flight per warp, ``tiles`` MMA row tiles per CTA (16
    weight rows each, sharing each load of A)."""
    in_type, out_type = kiln.dtype(dtype), kiln.dtype(out_dtype)
    span = BLOCK * warps * unroll  # K columns of one round of the CTA
    slots = 4 * halves  # C fragment values of one row tile per lane

    def gemv_mma(a: kiln.Tensor[in_type, 2], w: kiln.Tensor[in_type, 2],
                 c: kiln.Tensor[out_type, 2], m: kiln.i32, n: kiln.i32, k: kiln.i32):
        atom = kiln.mma.atom(16, 8, 16, in_type)
        lane = kiln.thread_id(0) % 32
        warp = kiln.thread_id(0) // 32
        g, t = lane // 4, lane % 4
        row0 = kiln.block_id(0) * TILE_ROWS * tiles
        # rows past N (of W) or M (of A) read the last row again; their results are not stored
        w_rows = [kiln.minimum(row0 + g + 8 * i, n - 1) for i in range(2 * tiles)]
        a_rows = [kiln.minimum(8 * h + g, m - 1) for h in range(halves)]
        accs = [kiln.vector_constant([0.0] * 4, kiln.f32) for _ in range(tiles * halves)]
        for base in kiln.range(0, k, span):
            cols = [base + (j * warps + warp) * BLOCK + VECTOR * t for j in range(unroll)]
            accs = blocks(a, w, a_rows, w_rows, cols, k, accs, atom)
        partials = shared((warps, tiles * slots, 32), kiln.f32)
        for i in kiln.static_range(tiles * halves):
            for e, value in enumerate(kiln.unpack(accs[i])):
                partials.store(warp, 4 * i + e, lane, value)
        kiln.barrier()
        if warp == 0:
            for i in kiln.static_range(tiles * halves):
                for e in kiln.static_range(4):
                    total = partials.load(0, 4 * i + e, lane)
                    for other in kiln.static_range(1, warps):
                        total = total + partials.load(other, 4 * i + e, lane)
                    # accumulator i = row tile i // halves, A half i % halves; its element e:
                    # weight row g + 8 (e // 2) of the tile, A row 2t + e % 2 of the half
                    row = row0 + TILE_ROWS * (i // halves) + g + 8 * (e // 2)
                    token = 8 * (i % halves) + 2 * t + e % 2
                    if (row < n) & (token < m):
                        c.store(token, row, kiln.cast(total, out_type))

    def blocks(a, w, a_rows, w_rows, cols, k, accs, atom):
        """``accs`` plus the MMAs of the blocks at ``cols`` (this lane's columns): every load
        issued before the first MMA; columns past K (K is a multiple of 8) count as zeros."""
        zero = kiln.vector_constant([0.0] * VECTOR, in_type)

        def load(t, row, col):
            value = t.load(row, kiln.minimum(col, k - VECTOR), width=VECTOR, align=16)
            return kiln.where(col < k, value, zero)

        ws = [[load(w, row, col) for row in w_rows] for col in cols]
        xs = [[load(a, row, col) for row in a_rows] for col in cols]
        out = list(accs)
        for j in range(len(cols)):
            for tile in range(tiles):
                lo, hi = kiln.unpack(ws[j][2 * tile]), kiln.unpack(ws[j][2 * tile + 1])
                for half_k in range(2):
                    q = 4 * half_k
                    frag = kiln.pack([lo[q], lo[q + 1], hi[q], hi[q + 1],
                                      lo[q + 2], lo[q + 3], hi[q + 2], hi[q + 3]])
                    for h in range(halves):
                        i = tile * halves + h
                        out[i] = atom(frag, kiln.vector_slice(xs[j][h], q, 4), out[i])
        return out

    gemv_mma.__name__ = gemv_mma.__qualname__ = \
        f"gemv_mma_{dtype}_{out_dtype}_h{halves}_w{warps}_u{unroll}_t{tiles}"
    return kiln.kernel(gemv_mma)


def halves(m: int) -> int:
    """n8 halves of the MMA that ``m`` rows of A take."""
    return -(-m // 8)


def grid(n: int, tiles: int = TILES) -> tuple[int, int, int]:
    """One CTA per ``tiles`` row tiles of :data:`TILE_ROWS` weight rows."""
    return -(-n // (TILE_ROWS * tiles)), 1, 1
