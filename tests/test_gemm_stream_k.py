"""Stream-K Hopper GEMM (``HopperGemmConfig(stream_k=True)``, ``kiln.kernels.gemm.streamk``):
odd shapes whose tiles split across CTAs, in the interpreter against float64 with NaN-poisoned
outputs and workspaces, the schedule's host mirror, the PTX, and on a GPU (``gpu``)."""

import re

import ml_dtypes
import numpy as np
import pytest
from gemm_reference import assert_matmul_close

import kiln
from kiln.kernels.gemm import HopperGemmConfig, compile_matmul, matmul_config, splitk, streamk
from kiln.kernels.gemm.splitk import PartialsLayout
from kiln.runtime.cuda import cuda_available

needs_gpu = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and driver")
C = HopperGemmConfig
CONFIGS = {
    "bm64_bn128": C(block_m=64, block_n=128, stages=4, stream_k=True),
    "bm64_bn64": C(block_m=64, block_n=64, stages=4, stream_k=True),
    "bm128_bn128": C(block_n=128, stages=4, stream_k=True),  # two consumers per tile
    "default_tiles": C(stream_k=True),
    "swap32": C(block_n=32, stages=8, swap_ab=True, stream_k=True),
    "swap64": C(block_n=64, stages=8, swap_ab=True, stream_k=True),
}
# (m, n, k, ctas): all tiles stream-K (tiles < ctas), the hybrid (one data-parallel wave,
# then a wave and the remainder by K steps), a single K step, and whole waves (no split).
CASES = [(100, 136, 520, 5), (300, 270, 200, 4), (130, 300, 330, 7), (3, 100, 520, 5),
         (17, 264, 136, 6), (64, 72, 64, 5), (256, 256, 128, 4)]


def _operands(m, n, k, trans_b, rng):
    a = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(ml_dtypes.bfloat16)
    return a, b, (b.T if trans_b else b)


def _run(a, b, config, ctas, trans_b, out=np.float32):
    m, n = a.shape[0], b.shape[0] if trans_b else b.shape[1]
    c = np.full((m, n), np.nan, out)  # an element never written fails the check
    splitk.run_partials(a, b, c, m, n, a.shape[1], dtype="bf16",
                        b_major="k" if trans_b else "mn", target="sm_90a", config=config,
                        interpret=True, ctas=ctas)
    return c


# make test runs each config on one of the first two cases (all stream-K, then the hybrid),
# alternating; the slow tier, which CI also runs, every other pair.
@pytest.mark.parametrize("name,case", [
    pytest.param(name, case, id=f"{'x'.join(map(str, case))}-{name}",
                 marks=() if case == CASES[i % 2] else pytest.mark.slow)
    for i, name in enumerate(CONFIGS) for case in CASES])
def test_interpreted_stream_k_matches_float64(name, case, rng):
    config = CONFIGS[name]
    m, n, k, ctas = case
    trans_b = config.swap_ab or m % 2 == 1  # both B layouts across the cases
    a, b, b_kn = _operands(m, n, k, trans_b, rng)
    assert_matmul_close(_run(a, b, config, ctas, trans_b), a, b_kn)


def test_stream_k_splits_tiles_across_ctas():
    """The cases really split: a K-step range of some CTA starts or ends inside a tile."""
    for m, n, k, ctas in CASES[:5]:
        tiles = PartialsLayout.of(m, n, k, CONFIGS["bm64_bn128"]).tiles
        sk = streamk.stream_k_tiles(tiles, ctas)
        steps = sk * -(-k // 64)
        assert sk and any(c * steps // ctas % -(-k // 64) for c in range(1, ctas)), (m, n, k)
    assert streamk.stream_k_tiles(8, 4) == 0  # whole waves: all data-parallel
    assert streamk.stream_k_tiles(25, 4) == 5  # 4 data-parallel waves less one, then 4 + 1
    assert streamk.grid_size(1, 1, 132) == 1  # never more CTAs than K steps


def test_stream_k_is_deterministic_and_bf16_output(rng):
    """Same inputs, same grid: bitwise equal, whichever piece arrives last."""
    config = CONFIGS["bm64_bn128"]
    a, b, b_kn = _operands(70, 200, 1000, True, rng)
    first = _run(a, b, config, 7, True, ml_dtypes.bfloat16)
    assert first.dtype == ml_dtypes.bfloat16
    assert_matmul_close(first, a, b_kn)
    assert (first.view(np.uint16) == _run(a, b, config, 7, True,
                                          ml_dtypes.bfloat16).view(np.uint16)).all()


def test_matmul_config_stream_k_in_the_interpreter(rng):
    a, b, b_kn = _operands(33, 100, 300, False, rng)  # N, K padded to 8 by matmul_config
    c = matmul_config(a, b, C(block_m=64, block_n=64, stream_k=True), out_dtype="f32",
                      target="sm_90a", backend="interpret")
    assert_matmul_close(c, a, b_kn)


@pytest.mark.lower
def test_stream_k_ptx_fixes_up_with_one_ticket():
    ck = compile_matmul("bf16", target="sm_90a", trans_b=True, block_m=64, block_n=128,
                        stages=8, stream_k=True)
    ptx = ck.asm["ptx"]
    assert len(re.findall(r"atom\.[^\s]*add", ptx)) == 1  # one ticket per split tile
    assert len(re.findall(r"fence\.[a-z_.]*gpu", ptx)) == 2  # release, then acquire if last
    assert "cp.async.bulk.tensor.2d.global.shared" in ptx  # C leaves by TMA stores
    assert ck.metadata["spill_bytes"] == 0


def test_bad_stream_k_configs_raise_kiln_errors():
    with pytest.raises(kiln.KilnValueError, match="split_k=1"):
        C(stream_k=True, split_k=2)
    with pytest.raises(kiln.UnsupportedError, match="cluster_m=1"):
        C(stream_k=True, cluster_m=2)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name", list(CONFIGS))
# all tiles by K steps at one CTA per SM, then (64 x 128 tiles: 256 of them) the hybrid
@pytest.mark.parametrize("shape", [(100, 136, 520), (17, 4096, 4096), (1000, 1000, 2000),
                                   (2000, 1024, 1536)], ids=lambda s: "x".join(map(str, s)))
def test_gpu_stream_k_matches_float64(name, shape, rng):
    """One CTA per SM; a bound plan reuses its workspace and tickets launch after launch."""
    torch = pytest.importorskip("torch")
    config = CONFIGS[name]
    m, n, k = shape
    if config.swap_ab and m > 256:
        pytest.skip("swap-AB is for small M")
    a, b, b_kn = _operands(m, n, k, True, rng)
    a_dev, b_dev = (torch.from_numpy(x.astype(np.float32)).to("cuda", torch.bfloat16)
                    for x in (a, b))
    c = matmul_config(a_dev, b_dev, config, trans_b=True)
    assert_matmul_close(c, a, b_kn)
    bound = torch.full_like(c, float("nan"))
    launch = splitk.bind_partials(a_dev, b_dev, bound, m, n, k, dtype="bf16", b_major="k",
                                  target="sm_90a", config=config)
    for _ in range(3):
        bound.fill_(float("nan"))
        launch(a_dev.data_ptr(), b_dev.data_ptr(), bound.data_ptr())
        assert torch.equal(bound, c)  # deterministic, tickets carried over
