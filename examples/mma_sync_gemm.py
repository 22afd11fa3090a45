"""sm_80 GEMM with ``cp.async`` double buffering, ``ldmatrix`` and ``mma.sync`` m16n8k16.

``C = A @ B`` for A: M x K bf16, B: K x N bf16 (row-major, N contiguous), C: M x N f32. One
block of 4 warps computes a 64x64 tile of C; the warps form a 2x2 grid, each warp a 32x32
block made of 2x4 m16n8 atoms (``kiln.mma.TiledMma``). M may be ragged (rows past M are
zero-filled on load and skipped on store); N must be a multiple of 64 and K of 32.

Schedule, per K step ``kt`` (stage ``kt % 2`` holds tile ``kt``):

========  ==================================================================================
issue     cp.async tile ``kt + 1`` of A and B into stage ``(kt + 1) % 2``, commit a group
wait      ``cp.async.wait_group 1`` (tile ``kt`` has landed), barrier
compute   ldmatrix A (x4) and B (x2 .trans) fragments, 2 x 4 x 2 mma.sync per warp
release   barrier (stage ``kt % 2`` is free for the copy issued next step)
========  ==================================================================================

Run on any sm_80+ GPU: ``python examples/mma_sync_gemm.py``.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

import kiln
from kiln import cp_async, ldmatrix, mma, tiles
from kiln.swizzle import Swizzle

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32
WARPS_M, WARPS_N = 2, 2
NUM_WARPS = WARPS_M * WARPS_N
THREADS = 32 * NUM_WARPS
STAGES = 2


@kiln.kernel
def mma_sync_gemm(a: kiln.Tensor[kiln.bf16, 2], b: kiln.Tensor[kiln.bf16, 2],
                  c: kiln.Tensor[kiln.f32, 2], m: kiln.i32, k: kiln.i32,
                  BM: kiln.constexpr, BN: kiln.constexpr, BK: kiln.constexpr):
    """c[row0:row0+BM, col0:col0+BN] = a[row0:, :] @ b[:, col0:] for this block's tile."""
    tm = mma.TiledMma(mma.atom(16, 8, 16, kiln.bf16), WARPS_M, WARPS_N, BM, BN, BK)
    row0 = kiln.block_id(0) * BM
    col0 = kiln.block_id(1) * BN
    # Both stages of a tile live in one SharedTile, stacked along the rows; the swizzles keep
    # ldmatrix's eight 16-byte row reads in distinct banks.
    a_s = tiles.SharedTile((STAGES * BM, BK), kiln.bf16, swizzle=Swizzle(2, 3, 3))
    b_s = tiles.SharedTile((STAGES * BK, BN), kiln.bf16, swizzle=Swizzle(3, 3, 3))
    k_tiles = k // BK

    def issue(stage, kt):
        a_g = tiles.GlobalTile(a, (BM, BK), (row0, kt * BK), row_end=m)
        b_g = tiles.GlobalTile(b, (BK, BN), (kt * BK, col0))
        tokens = tiles.copy(a_g, a_s, threads=THREADS, async_copy=True, dst_origin=(stage * BM, 0))
        tokens += tiles.copy(b_g, b_s, threads=THREADS, async_copy=True,
                             dst_origin=(stage * BK, 0))
        return cp_async.commit(tokens)

    issue(0, 0)
    warp_row, warp_col = tm.warp_origin()
    acc = tm.accumulator()
    for kt in kiln.range(k_tiles):
        stage = kt % STAGES
        # The last step reloads its own tile into the idle stage: addresses stay in bounds.
        newest = issue(1 - stage, kiln.min(kt + 1, k_tiles - 1))
        cp_async.wait(newest, pending=1)
        kiln.barrier()
        a_frags = [ldmatrix.load_a(a_s, (stage * BM + warp_row + i * 16, kk * 16))
                   for i in kiln.static_range(tm.rep_m) for kk in kiln.static_range(tm.rep_k)]
        b_frags = [ldmatrix.load_b(b_s, (stage * BK + kk * 16, warp_col + j * 8), trans=True)
                   for kk in kiln.static_range(tm.rep_k) for j in kiln.static_range(tm.rep_n)]
        spec = tm.atom.spec
        acc = tm.mma(acc, tiles.RegTile(a_frags, spec.a_layout, (tm.rep_m, tm.rep_k)),
                     tiles.RegTile(b_frags, spec.b_layout, (tm.rep_k, tm.rep_n)))
        kiln.barrier()
    c_g = tiles.GlobalTile(c, (BM, BN), (row0, col0), row_end=m)
    tiles.store(acc, c_g, (warp_row, warp_col))


def reference_inputs(m: int, n: int, k: int, seed: int = 0):
    """Random bf16 A (m x k), B (k x n) and a NaN-poisoned f32 C."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((k, n)).astype(ml_dtypes.bfloat16)
    c = np.full((m, n), np.nan, dtype=np.float32)
    return a, b, c


def run(a: np.ndarray, b: np.ndarray, c: np.ndarray, *, target: str | None = None) -> None:
    """Launch on the current GPU: one block per 64x64 tile of C."""
    (m, k), n = a.shape, b.shape[1]
    if n % BLOCK_N or k % BLOCK_K:
        raise ValueError(f"N ({n}) must be a multiple of {BLOCK_N} and K ({k}) of {BLOCK_K}")
    grid = (-(-m // BLOCK_M), n // BLOCK_N, 1)
    mma_sync_gemm[grid](a, b, c, m, k, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, num_warps=NUM_WARPS,
                        target=target)


def relative_error(c: np.ndarray, a: np.ndarray, b: np.ndarray) -> float:
    expected = a.astype(np.float64) @ b.astype(np.float64)
    return float(np.linalg.norm(c - expected) / np.linalg.norm(expected))


def main() -> None:
    a, b, c = reference_inputs(200, 128, 96)
    run(a, b, c)
    error = relative_error(c, a, b)
    print(f"relative error {error:.2e}: {'PASS' if error < 1e-2 else 'FAIL'}")


if __name__ == "__main__":
    main()
