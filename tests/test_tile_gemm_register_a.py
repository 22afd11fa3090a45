"""kiln.gemm with A from registers on every target (FlashAttention's P V): on sm_90a the cast
WGMMA accumulator is WGMMA's register A as it lies (checked on the layouts) and K is read
through ``k_s.T`` as a K-major B; a masked softmax-like P (kiln.fma on a tile, a row vector,
coords masks) times V in the interpreter against float64 on fresh random inputs."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import kiln
from kiln import bf16, f32, i32
from kiln.core.errors import KilnTypeError
from kiln.tile_gemm_wgmma import accumulator_layout
from kiln.wgmma import A_REGISTER_VALUES, INSTRUCTION_K, a_fragment_layout


@pytest.mark.parametrize("m,n", [(64, 64), (128, 128), (192, 32)])
def test_cast_accumulator_values_are_the_register_a_fragments(m, n):
    """Values 8j..8j+7 of thread t in the block accumulator are the register A fragment of K
    step j of t's warpgroup: a_fragment_layout(t % 128, v) moved 16j columns right and the
    warpgroup's 64 rows down."""
    rows, cols = accumulator_layout(m, n).coords()
    a_rows, a_cols = a_fragment_layout().coords()
    thread = np.arange(m // 64 * 128)
    for j in range(n // INSTRUCTION_K):
        values = slice(A_REGISTER_VALUES * j, A_REGISTER_VALUES * (j + 1))
        np.testing.assert_array_equal(rows[:, values],
                                      a_rows[thread % 128] + 64 * (thread // 128)[:, None])
        np.testing.assert_array_equal(cols[:, values], a_cols[thread % 128] + 16 * j)


@kiln.kernel(num_threads="THREADS")
def scores_times_v(q: kiln.Tensor[bf16, 2], k: kiln.Tensor[bf16, 2], v: kiln.Tensor[bf16, 2],
                   o: kiln.Tensor[f32, 2], keys: i32, BM: kiln.constexpr, BN: kiln.constexpr,
                   D: kiln.constexpr, THREADS: kiln.constexpr):
    q_s = kiln.tiles.operand_tile((BM, D), bf16, "a")
    k_s = kiln.tiles.operand_tile((BN, D), bf16, "a")
    v_s = kiln.tiles.operand_tile((BN, D), bf16, "b")
    kiln.copy(kiln.GlobalTile(q, (BM, D), (0, 0), align=16), q_s)
    kiln.copy(kiln.GlobalTile(k, (BN, D), (0, 0), row_end=keys, align=16), k_s)
    kiln.copy(kiln.GlobalTile(v, (BN, D), (0, 0), row_end=keys, align=16), v_s)
    kiln.barrier()
    s = kiln.gemm(q_s, k_s.T, kiln.accumulator(q_s, k_s.T, warps="rows"))
    cols = kiln.tiles.coords(s.layout)[1]
    s = kiln.where(cols < keys, s, -float("inf"))
    p = kiln.exp2(kiln.fma(s, 0.5, kiln.reduce(s, "max", axis=1) * -0.5))
    p16 = kiln.cast(p, bf16)
    acc = kiln.gemm(p16, v_s, kiln.accumulator(p16, v_s, warps="rows"))
    kiln.copy(acc, kiln.GlobalTile(o, (BM, D), (0, 0)))


@pytest.mark.parametrize("target", ["sm_90a", "sm_80", "gfx950"])
@pytest.mark.parametrize("bm,keys", [(128, 37), (64, 64)])
def test_register_a_gemm_against_float64(target, bm, keys):
    rng = np.random.default_rng()
    bn, d = 64, 64
    q = rng.standard_normal((bm, d)).astype(ml_dtypes.bfloat16)
    k, v = (rng.standard_normal((keys, d)).astype(ml_dtypes.bfloat16) for _ in range(2))
    o = np.full((bm, d), np.nan, np.float32)
    threads = 256 if target == "gfx950" else 2 * bm
    scores_times_v.interpret[(1,)](q, k, v, o, keys, BM=bm, BN=bn, D=d, THREADS=threads,
                                   target=target)
    s = q.astype(np.float64) @ k.astype(np.float64).T
    p = np.exp2(0.5 * (s - s.max(axis=1, keepdims=True)))
    want = p.astype(ml_dtypes.bfloat16).astype(np.float64) @ v.astype(np.float64)
    np.testing.assert_allclose(o, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


@pytest.mark.lower
def test_register_a_gemm_compiles_to_register_wgmma_without_a_shared_stage():
    x = np.zeros((128, 64), ml_dtypes.bfloat16)
    ck = scores_times_v.compile(x, x, x, np.zeros((128, 64), np.float32), 64, BM=128, BN=64,
                                D=64, THREADS=256, target="sm_90a")
    ptx = ck.asm["ptx"]
    assert ck.metadata["wgmma_serialized"] is None and ck.metadata["spill_bytes"] == 0
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16") == 4 + 4
    assert "ldmatrix" not in ptx and "mma.sync" not in ptx


@kiln.kernel(num_threads=128)
def _fma_of_two_tiles(x: kiln.Tensor[f32, 2]):
    tv = kiln.layout.blocked((1, 512), 128)
    t = kiln.load(kiln.GlobalTile(x, (1, 512), (0, 0)), tv)
    kiln.copy(kiln.fma(t, t, 1.0), kiln.GlobalTile(x, (1, 512), (0, 0)))


def test_fma_of_two_tiles_names_the_fix():
    with pytest.raises(KilnTypeError, match="a \\* b \\+ c"):
        _fma_of_two_tiles.interpret[(1,)](np.zeros((1, 512), np.float32), target="sm_90a")


@pytest.mark.gpu
@pytest.mark.parametrize("bm,keys", [(128, 37), (192, 64)])
def test_register_a_gemm_on_gpu(bm, keys):
    """The same kernel on the device (WGMMA with register A on Hopper), NaN-poisoned output."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch")
    q = torch.randn(bm, 64, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(keys, 64, device="cuda").to(torch.bfloat16) for _ in range(2))
    o = torch.full((bm, 64), float("nan"), device="cuda")
    scores_times_v[(1,)](q, k, v, o, keys, BM=bm, BN=64, D=64, THREADS=2 * bm)
    qf, kf, vf = (t.double().cpu().numpy() for t in (q, k, v))
    s = qf @ kf.T
    p = np.exp2(0.5 * (s - s.max(axis=1, keepdims=True)))
    want = p.astype(ml_dtypes.bfloat16).astype(np.float64) @ vf
    np.testing.assert_allclose(o.cpu().numpy(), want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
