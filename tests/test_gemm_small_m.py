"""Small-M GEMM configs (``kiln.kernels.gemm.small_m``, ``.splitk``): small tiles, split-K and
swap-AB, in the interpreter (odd shapes, float64 reference, NaN-poisoned outputs and
workspaces), at the PTX level, the untuned heuristic, and on a GPU (``gpu``)."""

import re

import ml_dtypes
import numpy as np
import pytest
from gemm_reference import assert_matmul_close

import kiln
from kiln.kernels.gemm import HopperGemmConfig, compile_matmul, matmul, matmul_config
from kiln.kernels.gemm.small_m import (SMALL_M, SMALL_M_CONFIGS, chosen_config,
                                       heuristic_config)
from kiln.kernels.gemm.splitk import PartialsLayout
from kiln.runtime.cuda import cuda_available

needs_gpu = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and driver")
C = HopperGemmConfig
FAMILIES = {  # one config per family, with every new knob somewhere
    "swap32": C(block_n=32, stages=8, swap_ab=True),
    "swap32_split4": C(block_n=32, stages=8, swap_ab=True, split_k=4),
    "swap64_split2": C(block_n=64, stages=8, swap_ab=True, split_k=2),
    "swap32_bm192_split4": C(block_m=192, block_n=32, stages=6, consumer_registers=152,
                             swap_ab=True, split_k=4),
    "bm64_bn128": C(block_m=64, block_n=128, stages=8),
    "bm64_bn128_split3": C(block_m=64, block_n=128, stages=8, split_k=3),
    "bm64_bn256_split2": C(block_m=64, block_n=256, stages=4, split_k=2),
    "bm128_bn128_split2": C(block_n=128, stages=6, split_k=2),
    # the in-kernel reduction (last slice of a tile to finish sums the partials)
    # swap-AB over all of K: tiles of C.T stored straight into C, one launch
    "fused_swap32": C(block_n=32, stages=8, swap_ab=True, fused_reduce=True),
    "direct_swap32_bm64": C(block_m=64, block_n=32, stages=12, swap_ab=True, fused_reduce=True),
    "direct_swap64_bm64": C(block_m=64, block_n=64, stages=12, swap_ab=True, fused_reduce=True),
    "fused_swap32_split4": C(block_n=32, stages=8, swap_ab=True, split_k=4, fused_reduce=True),
    "fused_swap64_split3": C(block_n=64, stages=8, swap_ab=True, split_k=3, fused_reduce=True),
    "fused_bm64_bn128_split3": C(block_m=64, block_n=128, stages=8, split_k=3,
                                 fused_reduce=True),
    "fused_bm128_bn128_split2": C(block_n=128, stages=6, split_k=2, fused_reduce=True),
}
SWAP_FAMILIES = [name for name, cfg in FAMILIES.items() if cfg.swap_ab]
# M of a decode step, N and K off the tile grid (K = 520: 9 K steps, uneven slices).
SHAPES = [(1, 100, 300), (3, 264, 520), (17, 70, 136), (100, 136, 200)]
# In the interpreter make test runs each family on one shape, alternating between an odd M
# with B stored N x K and uneven K slices (3 x 264 x 520) and an even M with B stored K x N
# (100 x 136 x 200); the slow tier, which CI also runs, the other shapes.
FAST_SHAPES = ((3, 264, 520), (100, 136, 200))
INTERPRETED_CASES = [
    pytest.param(family, shape, id=f"{'x'.join(map(str, shape))}-{family}",
                 marks=() if shape == FAST_SHAPES[i % 2] else pytest.mark.slow)
    for i, family in enumerate(FAMILIES) for shape in SHAPES]


def _operands(m, n, k, trans_b, rng, dtype=ml_dtypes.bfloat16):
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(dtype)
    return a, b, (b.T if trans_b else b)


@pytest.mark.parametrize("family,shape", INTERPRETED_CASES)
def test_interpreted_config_matches_float64(family, shape, rng):
    config = FAMILIES[family]
    m, n, k = shape
    trans_b = config.swap_ab or m % 2 == 1  # both B layouts across the shapes
    a, b, b_kn = _operands(m, n, k, trans_b, rng)
    # numpy outputs and workspaces start as NaN: an element never written fails the check
    c = matmul_config(a, b, config, trans_b=trans_b, out_dtype="f32", target="sm_90a",
                      backend="interpret")
    assert_matmul_close(c, a, b_kn)


@pytest.mark.parametrize("m", [1, 3, 17, 100, 512])
def test_matmul_small_m_uses_the_heuristic_in_the_interpreter(m, rng):
    a, b, b_kn = _operands(m, 72, 264, True, rng)
    c = matmul(a, b, trans_b=True, target="sm_90a", backend="interpret")
    assert c.dtype == ml_dtypes.bfloat16
    assert_matmul_close(c, a, b_kn)


def test_default_config_still_interprets_at_small_m(rng):
    a, b, b_kn = _operands(100, 264, 136, False, rng, np.float16)
    c = matmul_config(a, b, HopperGemmConfig(), out_dtype="f16", target="sm_90a",
                      backend="interpret")
    assert_matmul_close(c, a, b_kn)


def test_heuristic_shapes_the_work_to_the_gpu():
    # M = 1 with B stored N x K is the GEMV; the tile rules below from M = 2
    assert heuristic_config(1, 4096, 4096, "k", sms=132) == HopperGemmConfig(gemv=True)
    assert not heuristic_config(1, 4096, 4096, "mn", sms=132).gemv
    decode = heuristic_config(2, 4096, 4096, "k", sms=132)
    assert decode.swap_ab and decode.block_n == 32 and not decode.fused_reduce
    units = PartialsLayout.of(4096, 2, 4096, decode).units
    assert 64 < units <= 132  # split-K fills the SMs without a second wave
    mid = heuristic_config(48, 4096, 4096, "k", sms=132)
    assert (mid.block_m, mid.block_n, mid.swap_ab, mid.split_k) == (64, 128, False, 4)
    # 96 swap-AB tiles of 64 rows (half the SMs or more) over all of K, each stored straight
    # into C (one launch); K of 14336 is too long for that: 48 tiles of 64 x 128, whole K
    mid_direct = heuristic_config(48, 6144, 4096, "k", sms=132)
    assert (mid_direct.block_m, mid_direct.block_n, mid_direct.swap_ab) == (64, 64, True)
    assert mid_direct.fused_reduce and mid_direct.split_k == 1 and mid_direct.pdl
    mid_long = heuristic_config(48, 6144, 14336, "k", sms=132)
    assert (mid_long.block_m, mid_long.swap_ab, mid_long.split_k) == (64, False, 1)
    # enough 64 x 128 tiles for the GPU at M = 256, N = 4096: no split
    one_wave = heuristic_config(256, 4096, 4096, "k", sms=132)
    assert (one_wave.block_m, one_wave.block_n, one_wave.split_k) == (64, 128, 1)
    wide_n = heuristic_config(2, 28672, 4096, "k", sms=132)  # 224 tiles: no swap, no split
    assert not wide_n.partials and wide_n.block_m == 64
    row_major = heuristic_config(16, 4096, 4096, "mn", sms=132)
    assert not row_major.swap_ab and row_major.block_m == 64 and row_major.split_k > 1
    wide = heuristic_config(512, 28672, 4096, "k", sms=132)
    # 448 tiles of 128 x 256 are 3.4 waves, 512 of 128 x 224 3.9: a fuller last wave
    assert wide == HopperGemmConfig(block_n=224)
    assert heuristic_config(256, 28672, 4096, "k", sms=132) == HopperGemmConfig(block_n=224)
    # B stored K x N takes 64-multiples only: 600 tiles of 128 x 192 are 4.5 waves
    assert heuristic_config(512, 28672, 4096, "mn", sms=132) == HopperGemmConfig(block_n=192)
    # Llama-3-70B QKV at M = 256: 128 tiles of 128 x 160 (one wave) rather than 80 of
    # 128 x 256 or 160 of 128 x 128 (two); at 8B QKV the 96 tiles of 128 x 128 fit one
    # partial wave: a programmatic launch
    assert heuristic_config(256, 10240, 8192, "k", sms=132) == HopperGemmConfig(block_n=160)
    assert heuristic_config(256, 6144, 4096, "k", sms=132) == HopperGemmConfig(
        block_n=128, stages=6, pdl=True)
    # M = 512, N = 4096: 128 tiles of 64 x 256 rather than as many of 128 x 128
    for k in (4096, 14336):
        assert heuristic_config(512, 4096, k, "k", sms=132) == HopperGemmConfig(block_m=64)
    # M = 256, K = 14336: 128 x 128 tiles in 2 K slices (128 units), not 64 x 128 ones whole
    long_k = heuristic_config(256, 4096, 14336, "k", sms=132)
    assert (long_k.block_m, long_k.block_n, long_k.split_k, long_k.pdl) == (128, 128, 2, True)
    short = heuristic_config(2, 4096, 128, "k", sms=132)
    assert short.split_k == 1  # 2 K steps: nothing to split
    # 448 swap-AB tiles (Llama-3-70B gate/up at decode): stream-K balances the 3.4 waves
    many = heuristic_config(2, 57344, 8192, "k", sms=132)
    assert many.swap_ab and many.stream_k and many.split_k == 1
    # a third to a half of the SMs' worth of swap-AB tiles and K of at most 128 steps: whole K
    # per tile, C stored directly (70B O: 64 tiles); 80 tiles (70B QKV) run whole K through
    # the reduction; at 70B down (448 steps) the 64 tiles split K in sms // tiles = 2 slices
    direct = heuristic_config(16, 8192, 8192, "k", sms=132)
    assert direct.swap_ab and direct.fused_reduce and direct.split_k == 1
    qkv = heuristic_config(2, 10240, 8192, "k", sms=132)
    assert qkv.swap_ab and not qkv.fused_reduce and qkv.split_k == 1
    assert heuristic_config(2, 8192, 28672, "k", sms=132).split_k == 2
    # 32 tiles of 128 rows (Llama-3-8B down, K = 14336): 22 of 192 rows in 4 slices up to
    # M = 8; 128-row ones in 4 slices above
    down = heuristic_config(2, 4096, 14336, "k", sms=132)
    assert (down.block_m, down.swap_ab, down.split_k, down.fused_reduce) == (192, True, 4, False)
    down16 = heuristic_config(16, 4096, 14336, "k", sms=132)
    assert (down16.block_m, down16.swap_ab, down16.split_k) == (128, True, 4)
    # the same 32 tiles over K = 4096 (Llama-3-8B O) at M of 5..16: the tensor-core GEMV;
    # at M = 4 still 4 K slices, and above 16 (the GEMV's limit) too
    for m in (5, 16):
        assert heuristic_config(m, 4096, 4096, "k", sms=132) == HopperGemmConfig(gemv=True)
    for m in (4, 17):
        assert heuristic_config(m, 4096, 4096, "k", sms=132).split_k == 4
    # 64 x 128 tiles split only when they are at most a third of the SMs (row-major B: 32
    # tiles, 4 slices; 48: none)
    assert heuristic_config(64, 4096, 4096, "mn", sms=132).split_k == 4
    assert heuristic_config(64, 6144, 4096, "mn", sms=132).split_k == 1
    assert chosen_config(SMALL_M + 1, 4096, 4096, "bf16", "k", "bf16") is None
    assert all(isinstance(cfg, HopperGemmConfig) for cfg in SMALL_M_CONFIGS)


def test_partials_layout_keeps_every_slice_non_empty():
    cfg = C(block_m=64, block_n=128, split_k=4)
    # 5 K steps in slices of 2: 3 slices, not 4 (the kernel computes the same)
    layout = PartialsLayout.of(100, 136, 5 * 64, cfg)
    assert (layout.slices, layout.slice_rows, layout.cols, layout.tiles) == (3, 128, 136, 4)
    assert PartialsLayout.of(4096, 3, 64, C(block_n=32, swap_ab=True, split_k=8)).cols == 4


def test_autotuner_cached_reads_without_tuning(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))  # a fresh store
    calls = []

    @kiln.autotune(configs=["a", "b"], key=["n"], timer=lambda run: (run(), 1.0)[1],
                   progress=False)
    def tuned(n, *, config):
        calls.append(config)

    assert tuned.cached((7,), {}) is None and not calls
    tuned(7)
    assert tuned.cached((7,), {}) == "a" and tuned.cached((8,), {}) is None


def test_fused_tickets_carry_over_between_launches(rng):
    """The fused reduction's tickets are never reset: a plan reuses them launch after launch
    and ``ticket % slices`` still picks the last slice of each tile (three launches)."""
    from kiln.kernels.gemm import splitk
    from kiln.kernels.runtime import interpret

    config = FAMILIES["fused_swap32_split4"]
    m, n, k = 5, 136, 520  # the kernel's problem is n x m (swap-AB)
    a, b, _ = _operands(m, n, k, True, rng)
    grid = splitk._fused_grid(n, m, k, config, interpret=True)
    work, tickets = splitk._fused_buffers(a, n, m, k, config, grid)
    for _ in range(3):
        a, b, b_kn = _operands(m, n, k, True, rng)
        c = np.full((m, n), np.nan, np.float32)
        work[:] = np.nan
        kernel, args, options = splitk._fused_launch(b, a, c, n, m, k, "bf16", "k", config,
                                                     (work, tickets))
        interpret(kernel, grid, list(args), target="sm_90a", **options)
        assert_matmul_close(c, a, b_kn)
    layout = PartialsLayout.of(n, m, k, config)
    assert (tickets == 3 * layout.slices).all()


@pytest.mark.lower
def test_fused_reduce_ptx_publishes_then_takes_a_ticket():
    ck = compile_matmul("bf16", target="sm_90a", trans_b=True, block_n=32, stages=8,
                        swap_ab=True, split_k=4, fused_reduce=True)
    ptx = ck.asm["ptx"]
    assert len(re.findall(r"atom\.[^\s]*add", ptx)) == 1  # one ticket per tile and consumer
    assert len(re.findall(r"fence\.[a-z_.]*gpu", ptx)) == 2  # release, then acquire if last
    assert "cp.async.bulk.tensor.2d.global.shared" not in ptx  # C leaves by plain stores
    assert ck.metadata["spill_bytes"] == 0


@pytest.mark.lower
def test_whole_k_swap_ab_ptx_stores_c_without_a_ticket():
    ck = compile_matmul("bf16", target="sm_90a", trans_b=True, block_m=64, block_n=32,
                        stages=12, swap_ab=True, fused_reduce=True)
    ptx = ck.asm["ptx"]
    assert not re.findall(r"atom\.", ptx) and not re.findall(r"fence\.[a-z_.]*gpu", ptx)
    assert re.search(r"st\.global[^;]*\.b16", ptx)  # C (bf16) by plain stores
    assert ck.metadata["spill_bytes"] == 0


@pytest.mark.lower
def test_swap_ab_ptx_reads_a_as_wgmma_n32():
    ck = compile_matmul("bf16", target="sm_90a", trans_b=True, out_dtype="f32", block_n=32,
                        stages=8, swap_ab=True, split_k=4)
    ptx = ck.asm["ptx"]
    assert "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16" in ptx
    assert re.search(r"wgmma\.mma_async[^;]*, 1,\s*1, 0,\s*0;", ptx, re.S)  # both K-major
    assert ck.metadata["spill_bytes"] == 0 and ck.metadata["stack_bytes"] == 0


@pytest.mark.lower
@pytest.mark.parametrize("family", ["bm64_bn128_split3", "bm128_bn128_split2"])
def test_split_k_kernels_compile_without_spills(family):
    cfg = FAMILIES[family]
    ck = compile_matmul("bf16", target="sm_90a", out_dtype="f32", **vars(cfg))
    assert f"m64n{cfg.block_n}k16" in ck.asm["ptx"]
    assert ck.metadata["spill_bytes"] == 0


@pytest.mark.lower
def test_bad_small_m_configs_raise_kiln_errors(rng):
    with pytest.raises(kiln.UnsupportedError, match="block_n=32"):
        C(block_n=32)  # 32-column tiles only for f32 partials
    with pytest.raises(kiln.KilnValueError, match="split_k=0"):
        C(split_k=0)
    with pytest.raises(kiln.KilnValueError, match="split_k=17"):
        C(split_k=17)
    a, b, _ = _operands(3, 64, 64, False, rng)
    with pytest.raises(kiln.UnsupportedError, match="trans_b=True"):
        matmul_config(a, b, C(block_n=32, swap_ab=True), target="sm_90a", backend="interpret")
    with pytest.raises(kiln.UnsupportedError, match="cluster_m=1"):
        C(split_k=2, cluster_m=2)
    with pytest.raises(kiln.KilnValueError, match="fused_reduce"):
        C(fused_reduce=True)  # nothing to reduce
    with pytest.raises(kiln.KilnTypeError, match="HopperGemmConfig"):
        matmul_config(a, b, {"split_k": 2}, target="sm_90a", backend="interpret")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("shape", SHAPES + [(64, 4096, 4096), (512, 1000, 1000)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gpu_config_matches_float64(family, shape, rng):
    torch = pytest.importorskip("torch")
    from kiln.kernels.gemm import run_hopper

    config = FAMILIES[family]
    m, n, k = shape
    trans_b = config.swap_ab or m % 2 == 1
    a, b, b_kn = _operands(m, n, k, trans_b, rng)
    a_dev, b_dev = (torch.from_numpy(x.astype(np.float32)).to("cuda", torch.bfloat16)
                    for x in (a, b))
    if n % 8 or k % 8:  # unaligned: through matmul_config, which pads
        torch.empty(m * n * 8, device="cuda").fill_(float("nan"))  # poison the pool
        c = matmul_config(a_dev, b_dev, config, trans_b=trans_b)
    else:
        c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        run_hopper(a_dev, b_dev, c, m, n, k, dtype="bf16", b_major="k" if trans_b else "mn",
                   target="sm_90a", config=config)
    assert_matmul_close(c, a, b_kn)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("m", [1, 16, 64, 256, 512])
@pytest.mark.parametrize("trans_b", [True, False])
def test_gpu_matmul_small_m_plans(m, trans_b, rng):
    """The heuristic config through matmul: the first call plans, the repeat call is the
    bound launch pair (workspace allocated per call)."""
    torch = pytest.importorskip("torch")
    n, k = 1024, 2048
    a, b, b_kn = _operands(m, n, k, trans_b, rng)
    a_dev, b_dev = (torch.from_numpy(x.astype(np.float32)).to("cuda", torch.bfloat16)
                    for x in (a, b))
    for _ in range(2):
        torch.empty(m * n * 8, device="cuda").fill_(float("nan"))
        c = matmul(a_dev, b_dev, trans_b=trans_b)
        assert_matmul_close(c, a, b_kn)


# Odd shapes on which an H100/H200 (132 SMs) heuristic picks each rule of the H200 batch-3
# fit: swap-AB 128-row tiles stored directly, 64 x 64 ones stored directly, 192-row tiles over
# long K in slices, one wave of 128 x 192 tiles.
# (13, 4001, 4001): the tensor-core GEMV (gemv=True: the tile fields keep their defaults).
HEURISTIC_PICKS = {  # shape: block_m, swap_ab, fused_reduce, split_k
    (2, 6001, 999): (128, True, True, 1), (40, 5999, 1001): (64, True, True, 1),
    (13, 4001, 4001): (128, False, False, 1),
    (3, 4001, 9001): (192, True, False, 4), (200, 10001, 2001): (128, False, False, 1)}


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", list(HEURISTIC_PICKS), ids=lambda s: "x".join(map(str, s)))
def test_gpu_matmul_heuristic_picks_match_float64(shape, rng):
    """Each measured heuristic rule through matmul (padding, plan, repeat call) on odd shapes
    against float64, the pool poisoned with NaN before every call."""
    torch = pytest.importorskip("torch")
    from kiln.kernels import runtime

    m, n, k = shape
    sms = runtime.multiprocessor_count()
    if sms != 132:
        pytest.skip(f"the picks are fitted to 132 SMs, this GPU has {sms}")
    config = chosen_config(m, -(-n // 8) * 8, -(-k // 8) * 8, "bf16", "k", "bf16", sms=sms)
    assert (config.block_m, config.swap_ab, config.fused_reduce, config.split_k) == \
        HEURISTIC_PICKS[shape]
    a, b, b_kn = _operands(m, n, k, True, rng)
    a_dev, b_dev = (torch.from_numpy(x.astype(np.float32)).to("cuda", torch.bfloat16)
                    for x in (a, b))
    for _ in range(2):
        torch.empty(m * n * 8, device="cuda").fill_(float("nan"))
        c = matmul(a_dev, b_dev, trans_b=True)
        assert_matmul_close(c, a, b_kn)


def test_bench_candidate_lists_are_valid_configs(monkeypatch):
    """bench/gemm_ab.py and gemm_config_sweep.py build their candidates at import: a config
    that cannot exist (too many stages for shared memory) must fail here, not on a GPU."""
    import importlib
    import pathlib

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent.parent / "bench"))
    ab = importlib.import_module("gemm_ab")
    sweep = importlib.import_module("gemm_config_sweep")
    configs = [c for group in ab.CANDIDATES.values() for c in group]
    configs += list(sweep.SMALL_CONFIGS) + list(sweep.LARGE_CONFIGS)
    assert configs and all(isinstance(c, HopperGemmConfig) for c in configs)
    assert all(c.shared_bytes() <= 227 * 1024 for c in configs)
