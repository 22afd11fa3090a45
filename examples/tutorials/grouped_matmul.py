"""Tutorial 6: grouped (ragged) matmul, ``C[rows of g] = A[rows of g] @ B[g]``, as in MoE layers.

``A`` (``total x K``) holds the rows of every group back to back, ``group_offsets`` (int32,
``G + 1``) their prefix sums (a group may be empty); ``B`` is ``G`` weight matrices ``K x N``
stacked as ``G * K x N``; ``C`` (``total x N``) bf16. The grid has one block per ``BM``-row
tile of any group (at most ``ceil(total / BM) + G`` of them) and ``BN``-column tile: a block
finds its group by scanning the offsets (G scalar steps, no host work, no sync), then runs the
matmul tutorial's ``kiln.pipeline`` K loop on its group's rows. A's tiles are masked at A's own
extents only: rows past the group's end belong to the next group (or read zeros past ``total``)
and land in rows of C that the store masks, so on sm_90a they are TMA boxes. B's tiles stop at
the group's last K row (``cp.async`` on sm_80 and sm_90a), so no product reads another group's
weights. Blocks past the last tile find no group: an empty K loop and a store of no rows.

Run: ``python examples/tutorials/grouped_matmul.py``.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

import kiln
from kiln import bf16, i32
from kiln.kernel import default_target
from kiln.runtime.cuda import cuda_available


@kiln.kernel(num_threads="THREADS")
def grouped_matmul_kernel(a: kiln.Tensor[bf16, 2], b: kiln.Tensor[bf16, 2],
                          c: kiln.Tensor[bf16, 2], group_offsets: kiln.Tensor[i32], groups: i32,
                          BM: kiln.constexpr, BN: kiln.constexpr, BK: kiln.constexpr,
                          STAGES: kiln.constexpr, THREADS: kiln.constexpr,
                          ALIGN: kiln.constexpr):
    (total, k), n = a.shape, b.shape[1]
    tile = kiln.block_id(0)
    col0 = kiln.block_id(1) * BN
    # find the group of this row tile: tiles [seen, seen + tiles of g) belong to group g
    seen = 0
    group = 0
    row0 = 0
    row_end = 0
    for g in kiln.range(0, groups):
        lo = group_offsets[g]
        hi = group_offsets[g + 1]
        tiles = (hi - lo + BM - 1) // BM
        mine = (tile >= seen) & (tile < seen + tiles)
        group = kiln.where(mine, g, group)
        row0 = kiln.where(mine, lo + (tile - seen) * BM, row0)
        row_end = kiln.where(mine, hi, row_end)
        seen = seen + tiles
    a_s = [kiln.tiles.operand_tile((BM, BK), bf16, "a") for _ in range(STAGES)]
    b_s = [kiln.tiles.operand_tile((BK, BN), bf16, "b") for _ in range(STAGES)]

    def fetch(k0, s):   # A at its own extents (TMA on sm_90a); B stops at the group's K
        kiln.copy(kiln.GlobalTile(a, (BM, BK), (row0, k0), row_end=total, col_end=k,
                                  align=ALIGN, col_multiple=ALIGN // 2), a_s[s])
        kiln.copy(kiln.GlobalTile(b, (BK, BN), (group * k + k0, col0), row_end=group * k + k,
                                  col_end=n, align=ALIGN, col_multiple=ALIGN // 2), b_s[s])

    acc = kiln.accumulator(a_s[0], b_s[0])
    k_end = kiln.where(row0 < row_end, k, 0)          # no group: an empty K loop
    for it in kiln.pipeline(0, k_end, BK, stages=STAGES, fetch=fetch):
        acc = kiln.gemm(a_s[it.stage], b_s[it.stage], acc)
    kiln.copy(kiln.cast(acc, bf16), kiln.GlobalTile(c, (BM, BN), (row0, col0), row_end=row_end,
                                                    col_end=n))


def config(target: str | None) -> dict:
    """Tile sizes per target: the matmul tutorial's 128 x 256 x 64, two WGMMA warpgroups and 4
    stages on sm_90a; 128 x 128 x 32, 8 warps, 3 stages elsewhere."""
    if (target or default_target()).startswith("sm_90"):
        return dict(BM=128, BN=256, BK=64, STAGES=4, THREADS=256)
    return dict(BM=128, BN=128, BK=32, STAGES=3, THREADS=256)


def grouped_matmul(a, b, c, group_offsets, *, backend: str = "gpu", target: str | None = None):
    """``c[lo:hi] = a[lo:hi] @ b[g]`` for every group ``g`` of ``group_offsets`` (``G + 1``
    int32 prefix sums); ``b`` is ``[G, K, N]`` or ``[G * K, N]``, all bf16."""
    total, k = a.shape
    groups = len(group_offsets) - 1
    b2 = b.reshape(groups * k, -1)
    n = b2.shape[1]
    cfg = config(target)
    grid = (-(-total // cfg["BM"]) + groups, -(-n // cfg["BN"]))
    launch = (grouped_matmul_kernel.interpret[grid] if backend == "interpret"
              else grouped_matmul_kernel[grid])
    extra = {"target": target} if target else {}
    pointers = [t.data_ptr() for t in (a, b2) if hasattr(t, "data_ptr")]
    align = 16 if k % 8 == 0 and n % 8 == 0 and all(p % 16 == 0 for p in pointers) else 2
    launch(a, b2, c, group_offsets, groups, **cfg, ALIGN=align, **extra)
    return c


def reference(a, b, group_offsets) -> np.ndarray:
    """float64 ``a[lo:hi] @ b[g]`` per group."""
    groups = len(group_offsets) - 1
    b3 = b.reshape(groups, a.shape[1], -1).astype(np.float64)
    out = np.zeros((a.shape[0], b3.shape[2]))
    for g in range(groups):
        lo, hi = int(group_offsets[g]), int(group_offsets[g + 1])
        out[lo:hi] = a[lo:hi].astype(np.float64) @ b3[g]
    return out


if __name__ == "__main__":
    rng = np.random.default_rng(0)
    sizes, k, n = [130, 0, 7, 64], 96, 72
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    a = rng.standard_normal((int(offsets[-1]), k)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((len(sizes), k, n)).astype(ml_dtypes.bfloat16)
    c = np.full((a.shape[0], n), np.nan, ml_dtypes.bfloat16)
    backend = "gpu" if cuda_available() else "interpret"
    grouped_matmul(a, b, c, offsets, backend=backend)
    want = reference(a, b, offsets)
    err = np.abs(c.astype(np.float64) - want).max() / np.abs(want).max()
    assert err < 1e-2, err
    print(f"grouped matmul of groups {sizes}, {k} x {n} ({backend}): max relative error {err:.2e}")
