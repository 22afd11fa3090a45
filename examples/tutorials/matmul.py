"""Tutorial 4: matmul with a fused epilogue, ``C = gelu(A @ B + bias)``, portable.

``A`` (M x K) and ``B`` (K x N) are bf16, ``bias`` (N) f32, ``C`` (M x N) bf16; M, N and K may
all be ragged. Each block computes a ``BM x BN`` tile of C (blocks visit the tiles in grouped
order: ``GROUP_M`` row tiles sweep the columns together, so they share B tiles in L2).
``kiln.pipeline`` runs the K loop over ``STAGES`` pairs of shared tiles: ``fetch`` copies a K
step's tiles of A and B into one stage while ``kiln.gemm`` multiplies an earlier stage with the
target's MMA into an accumulator whose register layout Kiln derives. The tiles' masks are the
tensors' own extents (``a.shape``), so on sm_90a the copies are TMA boxes (``align=16``: rows
of 16-byte multiples; the boxes past the edges read zeros, which add nothing), completing on
mbarriers; on sm_80 ``cp.async`` (``col_multiple``: K and N multiples of 8, so each 16-byte
chunk is copied whole or not at all); vector loads elsewhere. ``kiln.tiles.operand_tile`` lays
each shared tile out for the MMA: WGMMA's 128-byte-swizzled chunks on sm_90a (two warpgroups,
each 64 rows of a 128 x 256 tile, one WGMMA group kept in flight), ``mma.sync`` fed by
``ldmatrix`` on sm_80, the double-rate MFMA on gfx950. No wait is in the program:
``kiln-insert-waits`` places the mbarrier, ``cp.async`` and WGMMA waits (docs/tiles.md has the
schedule). The epilogue is plain tile math on the accumulator: the bias is a 1-D tensor read as
a tile (every row the same), GELU is the tanh form written as a sigmoid whose reciprocal is the
hardware's approximate one (``kiln.rcp(approx=True)``: the correctly rounded ``rcp.rn`` runs a
slow path for every lane whose ``1 + exp(-z)`` overflowed, about half of them: 487 -> 610
TFLOP/s at 4096^3 on an H200), ``kiln.cast`` rounds to bf16 and ``kiln.copy`` stores the
unmasked part: on sm_90a (``STAGED``) through shared memory and TMA stores, 64 columns at a time.

Run: ``python examples/tutorials/matmul.py``.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

import kiln
from kiln import bf16, f32, i32
from kiln.kernel import default_target
from kiln.runtime.cuda import cuda_available

SQRT_2_OVER_PI = 0.7978845608028654


@kiln.kernel(num_threads="THREADS")
def matmul_kernel(a: kiln.Tensor[bf16, 2], b: kiln.Tensor[bf16, 2], bias: kiln.Tensor[f32],
                  c: kiln.Tensor[bf16, 2], BM: kiln.constexpr, BN: kiln.constexpr,
                  BK: kiln.constexpr, STAGES: kiln.constexpr, GROUP_M: kiln.constexpr,
                  THREADS: kiln.constexpr, STAGED: kiln.constexpr, ALIGN: kiln.constexpr):
    (m, k), (kb, n) = a.shape, b.shape   # masks at the tensors' own extents: TMA on sm_90a
    # grouped order: GROUP_M row tiles sweep the columns together, sharing B tiles in L2
    pid, tiles_m, tiles_n = kiln.block_id(0), (m + BM - 1) // BM, (n + BN - 1) // BN
    first = pid // (GROUP_M * tiles_n) * GROUP_M
    rows = kiln.min(tiles_m - first, GROUP_M)
    row0 = (first + pid % (GROUP_M * tiles_n) % rows) * BM
    col0 = pid % (GROUP_M * tiles_n) // rows * BN
    # one pair of shared tiles per stage, laid out for the target's MMA (WGMMA on sm_90a)
    a_s = [kiln.tiles.operand_tile((BM, BK), bf16, "a") for _ in range(STAGES)]
    b_s = [kiln.tiles.operand_tile((BK, BN), bf16, "b") for _ in range(STAGES)]

    def fetch(k0, s):   # masked rows and columns read as 0, which adds nothing
        kiln.copy(kiln.GlobalTile(a, (BM, BK), (row0, k0), row_end=m, col_end=k, align=ALIGN,
                                  col_multiple=ALIGN // 2), a_s[s])
        kiln.copy(kiln.GlobalTile(b, (BK, BN), (k0, col0), row_end=kb, col_end=n, align=ALIGN,
                                  col_multiple=ALIGN // 2), b_s[s])

    acc = kiln.accumulator(a_s[0], b_s[0])
    for it in kiln.pipeline(0, k, BK, stages=STAGES, fetch=fetch):
        acc = kiln.gemm(a_s[it.stage], b_s[it.stage], acc)
    x = acc + kiln.load(kiln.GlobalTile(bias, (BM, BN), (0, col0), col_end=n), acc.layout)
    z = (x + 0.044715 * x * x * x) * (2.0 * SQRT_2_OVER_PI)
    y = x * kiln.rcp(1.0 + kiln.exp(-z), approx=True)   # no slow path where exp(-z) is inf
    c_tile = kiln.GlobalTile(c, (BM, BN), (row0, col0), row_end=c.shape[0], col_end=c.shape[1],
                             align=ALIGN)
    kiln.copy(kiln.cast(y, bf16), c_tile, staged=STAGED)


def config(target: str | None) -> dict:
    """Tile sizes per target: 128 x 256 x 64 over two WGMMA warpgroups and 4 stages on
    sm_90a (4 x 48 KB of shared tiles: two stages of TMA copies in flight beside the WGMMA
    group, and 2 x 16 KB for C's TMA stores; on an H200 at 4096^3, 706 TFLOP/s: 0.90 of
    cuBLAS, 1.08 of Triton's tutorial matmul; ``cp.async`` copies 677, C stored from the
    accumulator's layout 684, 3 stages with ``barrier_before_fetch`` 683: the kernel's copy in
    bench/matmul_epilogue_ab.py); 128 x 128 x 32, 8 warps, 3 stages elsewhere (C stored from the
    accumulator: ``STAGED`` is for TMA stores)."""
    name = target or default_target()
    if name.startswith("sm_90"):
        return dict(BM=128, BN=256, BK=64, STAGES=4, GROUP_M=8, THREADS=256, STAGED=True)
    return dict(BM=128, BN=128, BK=32, STAGES=3, GROUP_M=8, THREADS=256, STAGED=False)


def alignment(k: int, n: int, *arrays) -> int:
    """Bytes the 8-element chunks of A's, B's and C's rows are aligned to: 16 when the rows
    (of ``k`` and ``n`` bf16) keep the arrays' 16-byte start alignment, else 2 (the copies are
    then synchronous: ``cp.async`` needs aligned sources; C's pairs are stored as scalars)."""
    pointers = [a.data_ptr() for a in arrays if hasattr(a, "data_ptr")]
    return 16 if k % 8 == 0 and n % 8 == 0 and all(p % 16 == 0 for p in pointers) else 2


def matmul(a, b, bias, c, *, backend: str = "gpu", target: str | None = None):
    """``c = gelu(a @ b + bias)`` (tanh GELU) for bf16 ``a``, ``b``, ``c`` and f32 ``bias``."""
    (m, k), n = a.shape, b.shape[1]
    cfg = config(target)
    grid = (-(-m // cfg["BM"]) * -(-n // cfg["BN"]),)
    launch = matmul_kernel.interpret[grid] if backend == "interpret" else matmul_kernel[grid]
    extra = {"target": target} if target else {}
    align = alignment(k, n, a, b, c)   # C is staged (TMA stores) only where rows are aligned
    cfg["STAGED"] = cfg["STAGED"] and align == 16
    launch(a, b, bias, c, **cfg, ALIGN=align, **extra)
    return c


def reference(a, b, bias):
    x = a.astype(np.float64) @ b.astype(np.float64) + bias
    return 0.5 * x * (1.0 + np.tanh(SQRT_2_OVER_PI * (x + 0.044715 * x ** 3)))


if __name__ == "__main__":
    rng = np.random.default_rng(0)
    m, n, k = 200, 150, 100
    a = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((k, n)).astype(ml_dtypes.bfloat16)
    bias = rng.standard_normal(n).astype(np.float32)
    c = np.full((m, n), np.nan, ml_dtypes.bfloat16)
    backend = "gpu" if cuda_available() else "interpret"
    matmul(a, b, bias, c, backend=backend)
    want = reference(a, b, bias)
    err = np.abs(c.astype(np.float64) - want).max() / np.abs(want).max()
    assert err < 1e-2, err
    print(f"matmul + bias + gelu of {m}x{n}x{k} ({backend}): max relative error {err:.2e}")
