"""Hopper GEMM schedules ``HopperGemmConfig(pingpong=True)`` (two consumer warp groups on
alternate 64-row tiles) and ``pdl=True`` (programmatic dependent launches): the dense and
grouped kernels in the CPU interpreter against float64 on odd shapes with NaN-poisoned
outputs, their PTX (``lower``), config errors, and results on a GPU (``gpu``)."""

import ml_dtypes
import numpy as np
import pytest
from gemm_reference import assert_matmul_close

import kiln
from kiln.kernels.gemm import HopperGemmConfig, compile_matmul, matmul_config
from kiln.runtime.cuda import cuda_available

needs_gpu = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and driver")
C = HopperGemmConfig
PINGPONG = {
    "64x64": C(block_m=64, block_n=64, stages=3, pingpong=True),
    "64x128_pdl": C(block_m=64, block_n=128, stages=5, pingpong=True, pdl=True),
    # swap-AB: 64 rows of N x K B per tile, f32 partials transposed by the reduction
    "swap64x32": C(block_m=64, block_n=32, stages=4, swap_ab=True, pingpong=True),
}
PDL = {
    "swap32_split4": C(block_n=32, stages=8, swap_ab=True, split_k=4, pdl=True),
    "swap32_stream_k": C(block_n=32, stages=8, swap_ab=True, stream_k=True, pdl=True),
    "bm64_split2": C(block_m=64, block_n=128, stages=8, split_k=2, pdl=True),
    "bm64_bn256": C(block_m=64, block_n=256, stages=4, pdl=True),
}


def _operands(m, n, k, trans_b, rng):
    a = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(ml_dtypes.bfloat16)
    return a, b, (b.T if trans_b else b)


# Interpreted with 2 CTAs (kiln.kernels.gemm.INTERPRET_PINGPONG_CTAS): 300 rows are 5 tile
# rows, so each CTA's consumers take several turns, the last one with an odd tile count.
@pytest.mark.parametrize("name, shape, trans_b", [
    (name, shape, trans_b) for name in PINGPONG
    for shape, trans_b in (((300, 136, 200), True), ((131, 200, 72), False))
    if trans_b or not PINGPONG[name].swap_ab])  # swap-AB needs B stored N x K
def test_pingpong_matches_float64(name, shape, trans_b, rng):
    config = PINGPONG[name]
    a, b, b_kn = _operands(*shape, trans_b, rng)
    c = matmul_config(a, b, config, trans_b=trans_b, out_dtype="f32", target="sm_90a",
                      backend="interpret")
    assert_matmul_close(c, a, b_kn)


@pytest.mark.parametrize("name", list(PDL))
def test_pdl_configs_match_float64(name, rng):
    config = PDL[name]
    a, b, b_kn = _operands(17, 200, 520, True, rng)  # 9 K steps: uneven slices
    c = matmul_config(a, b, config, trans_b=True, target="sm_90a", backend="interpret")
    assert_matmul_close(c, a, b_kn)


@pytest.mark.parametrize("trans_b", [False, True])
def test_grouped_pingpong_matches_float64(trans_b, rng):
    """Ragged groups (an empty one, a 3-row one) over 2 CTAs taking turns on 64 x 64 tiles."""
    from kiln.kernels.gemm.grouped import grouped_constexprs, make_grouped_kernel

    sizes, k, n = (70, 0, 130, 3, 64), 136, 72
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    total, groups = int(offsets[-1]), len(sizes)
    a = rng.standard_normal((total, k)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((groups, n, k) if trans_b else (groups, k, n)) \
        .astype(ml_dtypes.bfloat16)
    c = np.full((total, n), np.nan, np.float32)
    config = C(block_m=64, block_n=64, stages=3, pingpong=True)
    b_rows = b.shape[1] if trans_b else k
    b_view = b.reshape(groups * b.shape[1], -1)
    if not trans_b:  # a K box past K would read the next group's rows: pad K to whole boxes
        b_rows = -(-k // 64) * 64
        b_view = np.zeros((groups, b_rows, n), b.dtype)
        b_view[:, :k] = b
        b_view = b_view.reshape(groups * b_rows, n)
    make_grouped_kernel("bf16", "f32", "k" if trans_b else "mn", config).interpret[(2,)](
        a, b_view, c, c, offsets, groups, total, n, k, b_rows, target="sm_90a",
        num_warps=config.num_warps, **grouped_constexprs(config, groups))
    for g in range(groups):
        rows = slice(offsets[g], offsets[g + 1])
        expected = a[rows].astype(np.float64) @ (b[g].T if trans_b else b[g]).astype(np.float64)
        np.testing.assert_allclose(c[rows], expected, rtol=1e-5, atol=1e-4)


@pytest.mark.lower
def test_pingpong_ptx_takes_turns_without_spills():
    ck = compile_matmul("bf16", target="sm_90a", trans_b=True,
                        **vars(C(block_m=64, block_n=256, stages=4, pingpong=True)))
    ptx = ck.asm["ptx"]
    assert "bar.arrive" in ptx and "m64n256k16" in ptx
    assert ck.metadata["spill_bytes"] == 0
    assert "bar.arrive" not in compile_matmul("bf16", target="sm_90a", trans_b=True,
                                              block_m=64, stages=4).asm["ptx"]


@pytest.mark.lower
def test_pdl_ptx_waits_on_the_grid_before_it():
    ck = compile_matmul("bf16", target="sm_90a", trans_b=True, **vars(PDL["swap32_split4"]))
    assert "griddepcontrol.wait" in ck.asm["ptx"]
    assert "griddepcontrol.launch_dependents" in ck.asm["ptx"]
    # the first K steps' boxes are L2-prefetched before the wait
    ptx = ck.asm["ptx"]
    assert ptx.index("cp.async.bulk.prefetch.tensor") < ptx.index("griddepcontrol.wait")
    from kiln.kernels.gemm.splitk import reduce_kernel

    w = np.empty((1, 1), np.float32)
    c = np.empty((1, 1), ml_dtypes.bfloat16)
    for pdl in (True, False):
        ptx = reduce_kernel(pdl).compile(w, c, 1, 1, 1, 1, target="sm_90a", num_warps=8,
                                         SWAP=1, WIDTH=1).asm["ptx"]
        assert ("griddepcontrol.wait" in ptx) == pdl
    plain = compile_matmul("bf16", target="sm_90a", trans_b=True, block_n=32, stages=8,
                           swap_ab=True, split_k=4)
    assert "griddepcontrol" not in plain.asm["ptx"]


@pytest.mark.lower
def test_bad_pingpong_and_pdl_configs_raise_kiln_errors():
    with pytest.raises(kiln.UnsupportedError, match="pingpong"):
        C(pingpong=True)  # 128-row tiles
    with pytest.raises(kiln.UnsupportedError, match="pingpong"):
        C(block_m=64, split_k=2, pingpong=True)
    with pytest.raises(kiln.UnsupportedError, match="pingpong"):
        C(block_m=64, stream_k=True, pingpong=True)
    with pytest.raises(kiln.UnsupportedError, match="pdl"):
        C(cluster_m=2, pdl=True)
    with pytest.raises(kiln.KilnValueError, match="stages=13"):
        C(block_n=32, swap_ab=True, stages=13)
    with pytest.raises(kiln.ResourceError, match="no room for the epilogue"):
        C(block_m=64, block_n=128, stages=9, pingpong=True)  # two consumers' staging tiles
    C(block_m=64, block_n=128, stages=9)  # fits with one consumer's
    from kiln.kernels.gemm.grouped import make_grouped_kernel

    with pytest.raises(kiln.UnsupportedError, match="dynamic"):
        make_grouped_kernel("bf16", "bf16", "mn", C(block_m=64, pingpong=True), True)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("config", list(PINGPONG.values()) + list(PDL.values()) + [
    C(block_m=64, block_n=256, stages=4, pingpong=True, pdl=True)], ids=repr)
@pytest.mark.parametrize("shape", [(1, 4096, 4096), (300, 1000, 1000), (512, 4096, 4096)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gpu_matches_float64_with_poisoned_output(config, shape, rng):
    torch = pytest.importorskip("torch")
    from kiln.kernels.gemm import run_hopper

    m, n, k = shape
    a, b, b_kn = _operands(m, n, k, True, rng)
    a_dev, b_dev = (torch.from_numpy(x.astype(np.float32)).to("cuda", torch.bfloat16)
                    for x in (a, b))
    for _ in range(2):  # back to back: a programmatic launch overlaps the one before it
        c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        run_hopper(a_dev, b_dev, c, m, n, k, dtype="bf16", b_major="k", target="sm_90a",
                   config=config)
    assert_matmul_close(c, a, b_kn)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("groups, total", [(8, 3000), (64, 5000)])
def test_gpu_grouped_pingpong_matches_torch(groups, total):
    torch = pytest.importorskip("torch")
    from kiln.kernels.gemm.grouped_api import run_grouped

    k, n = 520, 1024
    sizes = np.random.default_rng(groups).multinomial(total, np.ones(groups) / groups)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    a = torch.randn(total, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(groups, n, k, device="cuda", dtype=torch.bfloat16)
    c = torch.full((total, n), float("nan"), device="cuda", dtype=torch.float32)
    run_grouped(a, b.reshape(-1, k), c, torch.from_numpy(offsets).cuda(), k=k, b_rows=n,
                trans_b=True, config=C(block_m=64, block_n=256, stages=4, pingpong=True))
    for g in range(groups):
        rows = slice(int(offsets[g]), int(offsets[g + 1]))
        expected = a[rows].float() @ b[g].float().T
        torch.testing.assert_close(c[rows], expected, rtol=1e-4, atol=2e-3)


def test_heuristic_launches_partials_configs_programmatically():
    """Split-K / swap-AB / stream-K picks are pdl (they measured faster); whole tiles not."""
    from kiln.kernels.gemm.small_m import SMALL_M_CONFIGS, heuristic_config

    for m, n, k in ((2, 4096, 4096), (2, 4096, 14336), (64, 4096, 4096), (2, 57344, 8192),
                    (256, 4096, 14336)):
        config = heuristic_config(m, n, k, "k", sms=132)
        assert config.partials and config.pdl, (m, n, k)
    for m, n, k in ((2, 28672, 4096), (256, 4096, 4096), (512, 28672, 4096)):
        config = heuristic_config(m, n, k, "k", sms=132)
        assert not config.partials and not config.pdl, (m, n, k)
    picks = {heuristic_config(m, n, k, "k", sms=132) for m in (1, 16, 64, 256, 512)
             for n, k in ((4096, 4096), (28672, 4096), (4096, 14336))}
    assert picks <= set(SMALL_M_CONFIGS)  # the tuner's space holds the heuristic's picks
