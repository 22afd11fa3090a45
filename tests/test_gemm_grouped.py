"""Grouped (MoE) GEMM ``kiln.kernels.gemm.grouped_matmul``: the sm_90a kernel in the CPU
interpreter against float64 on ragged groups, input errors, compile-only PTX checks
(``lower``) and results on a GPU (``gpu``)."""

import contextlib
import re
import subprocess

import ml_dtypes
import numpy as np
import pytest

import kiln
from kiln.kernels.gemm import HopperGemmConfig, compile_grouped_matmul, grouped_matmul
from kiln.runtime.cuda import cuda_available
from kiln.lowering.tools import find_ptxas

needs_gpu = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and driver")
BF16 = ml_dtypes.bfloat16


def _offsets(sizes) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)


def _reference(a, b, offsets, trans_b) -> np.ndarray:
    """float64 ``a[o[g]:o[g+1]] @ b[g]`` (``b[g].T`` with ``trans_b``) group by group."""
    c = np.zeros((a.shape[0], b.shape[1] if trans_b else b.shape[2]))
    for g in range(b.shape[0]):
        bg = b[g].astype(np.float64)
        c[offsets[g]:offsets[g + 1]] = a[offsets[g]:offsets[g + 1]].astype(np.float64) @ \
            (bg.T if trans_b else bg)
    return c


def _assert_close(c, expected, out_dtype, atol=None):
    """Elementwise: f32 outputs to accumulation error, bf16 outputs to one bf16 rounding."""
    c = np.asarray(c, np.float64)
    assert c.shape == expected.shape
    assert np.isfinite(c).all(), "an element was not written (the output starts as NaN)"
    rtol, default_atol = (1e-5, 1e-4) if out_dtype == "f32" else (8e-3, 1e-2)
    atol = default_atol if atol is None else atol
    bad = ~(np.abs(c - expected) <= atol + rtol * np.abs(expected))
    assert not bad.any(), f"{bad.sum()} elements differ, first at {np.argwhere(bad)[0]}"


def _random(shape, rng):
    return rng.standard_normal(shape).astype(BF16)


# Each case runs in about a second in the interpreter (grid of at most 2 CTAs).
@pytest.mark.parametrize("sizes, k, n, trans_b, out_dtype", [
    # an empty first group; both groups' single tiles straddle a group end (masked stores)
    ((0, 37, 5), 48, 40, False, "bf16"),
    ((0, 37, 5), 48, 40, True, "f32"),
    # whole 64-row slices (TMA stores) beside partial ones, 2 N tiles, K = 72 (2 K steps)
    ((70, 0, 130, 3), 72, 264, False, "f32"),
    # 5 K steps wrap the 4-stage ring; each of the 2 CTAs walks tiles of both groups
    ((130, 200), 320, 72, True, "bf16"),
])
def test_interpreter_matches_float64(sizes, k, n, trans_b, out_dtype, rng):
    offsets = _offsets(sizes)
    a = _random((offsets[-1], k), rng)
    b = _random((len(sizes), n, k) if trans_b else (len(sizes), k, n), rng)
    c = grouped_matmul(a, b, offsets, trans_b=trans_b, out_dtype=out_dtype, target="sm_90a",
                       backend="interpret")
    assert c.dtype == kiln.dtype(out_dtype).numpy
    _assert_close(c, _reference(a, b, offsets, trans_b), out_dtype)


@pytest.mark.parametrize("config", [HopperGemmConfig(block_n=192),
                                    HopperGemmConfig(block_m=64, block_n=256, stages=4)],
                         ids=lambda c: f"{c.block_m}x{c.block_n}")
@pytest.mark.parametrize("trans_b", [False, True])
def test_other_tile_configs_match_float64(config, trans_b, rng):
    """The configs bench/gemm.py --grouped --sweep compares (3 B chunks; one consumer)."""
    from kiln.kernels.gemm.grouped import grouped_constexprs, make_grouped_kernel

    offsets = _offsets((70, 0, 3, 60))
    k, n = 64, 200
    a = _random((133, k), rng)
    b = _random((4, n, k) if trans_b else (4, k, n), rng)
    c = np.full((133, n), np.nan, np.float32)
    make_grouped_kernel("bf16", "f32", "k" if trans_b else "mn", config).interpret[(2,)](
        a, b.reshape(4 * b.shape[1], -1), c, c, offsets, 4, 133, n, k, b.shape[1],
        target="sm_90a", num_warps=config.num_warps, **grouped_constexprs(config, 4))
    _assert_close(c, _reference(a, b, offsets, trans_b), "f32")


@pytest.mark.parametrize("trans_b", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_dynamic_tile_claims_match_float64_and_reset_the_counters(trans_b, rng):
    """``dynamic=True``: 3 CTAs claim 2 x 3 + 1 tiles of 3 groups from a counter pair, which
    the last CTA to finish zeroes again: a second launch on the same counters is right too."""
    from kiln.kernels.gemm.grouped import grouped_constexprs, make_grouped_kernel

    config = HopperGemmConfig()
    offsets = _offsets((200, 0, 3, 60))
    k, n = 136, 520
    counters = np.zeros(2, np.int32)
    kernel = make_grouped_kernel("bf16", "f32", "k" if trans_b else "mn", config, True)
    for _ in range(2):
        a = _random((263, k), rng)
        b = _random((4, n, k) if trans_b else (4, k, n), rng)
        c = np.full((263, n), np.nan, np.float32)
        kernel.interpret[(3,)](a, b.reshape(4 * b.shape[1], -1), c, c, offsets, 4, 263, n, k,
                               b.shape[1], counters, target="sm_90a",
                               num_warps=config.num_warps,
                               **grouped_constexprs(config, 4, dynamic=True))
        _assert_close(c, _reference(a, b, offsets, trans_b), "f32")
        assert (counters == 0).all()


@pytest.mark.parametrize("trans_b", [False, True])
def test_next_groups_b_never_reaches_a_group(trans_b, rng):
    """A B box past K (or N) of group 0 lies in group 1's B; filled with inf there, any leak
    would turn group 0's rows into NaN (0 * inf), so K = 72 must be padded per group."""
    offsets = _offsets((37, 0))
    a = _random((37, 72), rng)
    b = _random((2, 40, 72) if trans_b else (2, 72, 40), rng)
    b[1] = np.inf
    c = grouped_matmul(a, b, offsets, trans_b=trans_b, out_dtype="f32", target="sm_90a",
                       backend="interpret")
    _assert_close(c, _reference(a, b[:1], offsets[:2], trans_b), "f32")


def test_default_output_is_bf16(rng):
    offsets = _offsets((3, 5))
    a = _random((8, 16), rng)
    b = _random((2, 16, 8), rng)
    c = grouped_matmul(a, b, offsets, target="sm_90a", backend="interpret")
    assert c.dtype == BF16
    _assert_close(c, _reference(a, b, offsets, False), "bf16")


@pytest.mark.parametrize("sizes, k, n", [((0, 0), 16, 8), ((), 16, 8), ((3, 4), 16, 0)])
def test_empty_outputs_launch_nothing(sizes, k, n):
    offsets = _offsets(sizes)
    a = np.ones((offsets[-1], k), BF16)
    b = np.ones((len(sizes), k, n), BF16)
    c = grouped_matmul(a, b, offsets, target="sm_90a", backend="interpret")
    assert c.shape == (offsets[-1], n) and c.dtype == BF16


def test_k_zero_gives_zeros():
    offsets = _offsets((3, 4))
    c = grouped_matmul(np.ones((7, 0), BF16), np.ones((2, 0, 8), BF16), offsets,
                       out_dtype="f32", target="sm_90a", backend="interpret")
    assert c.shape == (7, 8) and (c == 0).all()


def _bad_call(**changes):
    args = dict(a=np.ones((8, 16), BF16), b=np.ones((2, 16, 8), BF16),
                group_offsets=_offsets((3, 5)))
    args.update(changes)
    kwargs = dict(target="sm_90a", backend="interpret")
    kwargs.update({key: args.pop(key) for key in list(args)
                   if key not in ("a", "b", "group_offsets")})
    return lambda: grouped_matmul(args["a"], args["b"], args["group_offsets"], **kwargs)


@pytest.mark.parametrize("changes, error, words", [
    (dict(group_offsets=_offsets((3, 5)).astype(np.int64)), kiln.KilnTypeError,
     "group_offsets must be int32"),
    (dict(group_offsets=_offsets((3, 2, 3))), kiln.KilnValueError, "group_offsets has 4"),
    (dict(group_offsets=np.array([0, 6, 5], np.int32)), kiln.KilnValueError,
     "group_offsets decreases at group 1"),
    (dict(group_offsets=np.array([1, 3, 8], np.int32)), kiln.KilnValueError,
     "group_offsets[0] = 1"),
    (dict(group_offsets=np.array([0, 3, 7], np.int32)), kiln.KilnValueError,
     "group_offsets[-1] = 7"),
    (dict(b=np.ones((2, 12, 8), BF16)), kiln.KilnValueError, "b's K is 12"),
    (dict(b=np.ones((2, 16, 8), np.float16)), kiln.KilnTypeError, "share a dtype"),
    (dict(b=np.ones((16, 8), BF16)), kiln.KilnValueError, "b must be [G, K, N]"),
    (dict(a=np.ones((8, 16), np.float32)), kiln.UnsupportedError, "f32 inputs"),
    (dict(a=np.ones((8, 16), ml_dtypes.float8_e4m3fn)), kiln.KilnTypeError,
     "share a dtype"),
    (dict(scale_a=np.ones(8, np.float32)), kiln.KilnValueError, "apply to FP8 inputs"),
    (dict(backend="cpu"), kiln.KilnValueError, "backend='cpu'"),
    (dict(out_dtype="i32"), kiln.UnsupportedError, "cannot write i32"),
    (dict(group_offsets=[0, 3, 8]), kiln.KilnTypeError, "group_offsets must be a numpy array"),
])
def test_bad_inputs_raise_kiln_errors_naming_the_argument(changes, error, words):
    with pytest.raises(error) as raised:
        _bad_call(**changes)()
    assert words in str(raised.value)


def test_too_many_groups_and_targets_without_a_kernel_are_unsupported():
    with pytest.raises(kiln.UnsupportedError, match="at most 1024 groups"):
        grouped_matmul(np.ones((0, 16), BF16), np.ones((1025, 16, 8), BF16),
                       np.zeros(1026, np.int32), target="sm_90a")
    args = (np.ones((8, 16), BF16), np.ones((2, 16, 8), BF16), _offsets((3, 5)))
    with pytest.raises(kiln.UnsupportedError, match="gfx942 lacks"):
        grouped_matmul(*args, target="gfx942", backend="interpret")
    with pytest.raises(kiln.UnsupportedError, match="needs WGMMA"):
        grouped_matmul(*args, target="sm_80", backend="interpret")
    with pytest.raises(kiln.UnsupportedError, match="cannot run gfx950 kernels"):
        grouped_matmul(*args, target="gfx950")


@pytest.mark.parametrize("sizes, k, n, trans_b, out_dtype", [
    ((0, 37, 5), 48, 40, False, "f32"),
    ((0, 37, 5), 48, 40, True, "bf16"),
    ((70, 0, 130, 3), 72, 264, False, "f32"),  # 3 row tiles, 3 column tiles
    ((130, 200), 136, 72, True, "f32"),  # 3 K steps: the two LDS stages alternate
])
def test_gfx950_interpreter_matches_float64(sizes, k, n, trans_b, out_dtype, rng):
    """The AMD kernel (MFMA 32x32x16, buffer views; C's view ends at each group's last row)."""
    offsets = _offsets(sizes)
    a = _random((offsets[-1], k), rng)
    b = _random((len(sizes), n, k) if trans_b else (len(sizes), k, n), rng)
    c = grouped_matmul(a, b, offsets, trans_b=trans_b, out_dtype=out_dtype, target="gfx950",
                       backend="interpret")
    _assert_close(c, _reference(a, b, offsets, trans_b), out_dtype)


@pytest.mark.parametrize("b_layout", ["nk", "kn"])
def test_gfx950_dma_feed_and_next_groups_b(b_layout, rng):
    """The LDS-DMA feed of the AMD kernel, with an inf-filled empty group after group 0: the
    K and N edges of group 0's B boxes must not reach it."""
    from kiln.kernels.gemm.gfx950 import GemmConfig, make_kernel

    cfg = GemmConfig(feed="dma", b_layout=b_layout, out_dtype="f32")
    offsets = _offsets((70, 0, 60))
    k, n = 72, 136
    b_rows = n if b_layout == "nk" else 128  # per group: N, or K padded to whole 64-row boxes
    a = _random((130, k), rng)
    b = np.zeros((3, b_rows, k if b_layout == "nk" else n), BF16)
    weights = _random((3, n, k) if b_layout == "nk" else (3, k, n), rng)
    b[:, :weights.shape[1]] = weights
    b[1] = np.inf
    c = np.full((130, n), np.nan, np.float32)
    make_kernel("bf16", cfg, grouped=True).interpret[(2,)](
        a, b.reshape(3 * b_rows, -1), c, offsets, 3, 130, n, k, b_rows, 2, target="gfx950",
        num_warps=cfg.num_warps, TABLE=64)
    _assert_close(c, _reference(a, weights, offsets, b_layout == "nk"), "f32")


@pytest.fixture(scope="module")
def compiled():
    return compile_grouped_matmul("bf16", target="sm_90a", groups=64)


@pytest.mark.lower
def test_ptx_has_the_hopper_pipeline_and_masked_epilogue(compiled):
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16" in ptx
    assert "cp.async.bulk.tensor.2d.shared::cluster.global" in ptx  # TMA loads
    assert "cp.async.bulk.tensor.2d.global.shared::cta" in ptx  # TMA stores of whole slices
    # the group's last slice: 16-byte reads of the staged tile, 16-byte masked stores
    assert re.search(r"ld\.shared\.v4\.b32", ptx) and re.search(r"st\.global\.v4\.b32", ptx)
    assert ".maxntid 256, 1, 1" in ptx


@pytest.mark.lower
def test_no_spills_and_table_fits_beside_the_ring(compiled):
    assert compiled.metadata["spill_bytes"] == 0
    assert compiled.metadata["stack_bytes"] == 0
    # The idle-consumer branch must not make ptxas serialise the main loop's WGMMAs.
    assert compiled.metadata["wgmma_serialized"] is None
    assert compiled.signature.block == (256, 1, 1)  # 64 x 256 tiles: one consumer
    # Static (table, barriers) + dynamic shared memory within H100's 227 KB a block, up to
    # 1024 groups (a 2048-entry table) beside 4 stages.
    for groups in (255, 1024):
        ck = compile_grouped_matmul("bf16", target="sm_90a", trans_b=True, out_dtype="f32",
                                    groups=groups)
        assert ck.metadata["spill_bytes"] == 0
        assert ck.metadata["shared_bytes"] + ck.signature.dynamic_shared_bytes <= 227 * 1024


@pytest.mark.lower
def test_gfx950_kernel_compiles_to_mfma_without_scratch():
    ck = compile_grouped_matmul("bf16", target="gfx950", trans_b=True, groups=64)
    assert "v_mfma_f32_32x32x16_bf16" in ck.asm["amdgcn"]
    assert "buffer_load_dwordx4" in ck.asm["amdgcn"]
    assert ck.metadata["scratch_bytes"] in (0, None)


@pytest.mark.lower
@pytest.mark.skipif(find_ptxas() is None, reason="needs ptxas")
def test_ptxas_honours_setmaxnreg(compiled, tmp_path):
    ptx = tmp_path / "grouped.ptx"
    ptx.write_text(compiled.asm["ptx"])
    done = subprocess.run([str(find_ptxas()), "-arch=sm_90a", "-v", str(ptx), "-o",
                           str(tmp_path / "grouped.cubin")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "C7508" not in done.stderr and "setmaxnreg ignored" not in done.stderr


def _moe_sizes(groups: int, total: int, rng) -> np.ndarray:
    """Ragged router-like group sizes summing to ``total``, with some empty groups."""
    weights = rng.dirichlet(np.full(groups, 0.5))
    sizes = np.floor(weights * total).astype(np.int64)
    sizes[rng.integers(groups)] += total - sizes.sum()
    return sizes


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("groups, total, k, n", [(8, 3000, 1024, 520), (64, 5000, 520, 1024)])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("device_offsets", [True, False])
@pytest.mark.parametrize("dynamic", [False, True])
def test_gpu_matches_torch_with_poisoned_output(groups, total, k, n, trans_b, device_offsets,
                                                dynamic, rng):
    torch = pytest.importorskip("torch")
    from kiln.kernels.gemm.grouped_api import run_grouped

    offsets = _offsets(_moe_sizes(groups, total, rng))
    a = torch.randn(total, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn((groups, n, k) if trans_b else (groups, k, n), device="cuda",
                    dtype=torch.bfloat16)
    c = torch.full((total, n), float("nan"), device="cuda", dtype=torch.float32)
    offs = torch.from_numpy(offsets).cuda() if device_offsets else offsets
    # k and n are multiples of 8; K = 520 is not one of 64, so pad MN-major B per group.
    b_rows = n if trans_b else -(-k // 64) * 64
    b_in = b if trans_b else torch.nn.functional.pad(b, (0, 0, 0, b_rows - k))
    run_grouped(a, b_in.reshape(-1, b_in.shape[-1]), c, offs, k=k, b_rows=b_rows,
                trans_b=trans_b, dynamic=dynamic)
    expected = torch.empty_like(c)
    for g in range(groups):
        rows = slice(int(offsets[g]), int(offsets[g + 1]))
        expected[rows] = a[rows].float() @ (b[g].float().T if trans_b else b[g].float())
    # Both sides accumulate in f32, in different orders: allow a few ulps of sqrt(K)-sized sums.
    _assert_close(c.cpu().numpy(), expected.cpu().numpy().astype(np.float64), "f32", atol=2e-3)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("trans_b", [False, True])
def test_gpu_grouped_matmul_torch_and_numpy(trans_b, rng):
    torch = pytest.importorskip("torch")
    groups, k, n = 16, 200, 300  # K and N pad to 8 (and K to 64 for MN-major B)
    offsets = _offsets(_moe_sizes(groups, 2000, rng))
    a = _random((2000, k), rng)
    b = _random((groups, n, k) if trans_b else (groups, k, n), rng)
    expected = _reference(a, b, offsets, trans_b)
    host = grouped_matmul(a, b, offsets, trans_b=trans_b, out_dtype="f32")
    _assert_close(host, expected, "f32", atol=1e-3)
    dev = [torch.from_numpy(x.astype(np.float32)).cuda().to(torch.bfloat16) for x in (a, b)]
    device = grouped_matmul(*dev, torch.from_numpy(offsets).cuda(), trans_b=trans_b,
                            validate=True)
    assert device.dtype == torch.bfloat16 and device.is_cuda
    _assert_close(device.float().cpu().numpy(), expected, "bf16")
    bad = torch.from_numpy(offsets[::-1].copy()).cuda()
    with pytest.raises(kiln.KilnValueError, match="group_offsets"):
        grouped_matmul(*dev, bad, trans_b=trans_b, validate=True)


def test_numpy_array_passed_twice_shares_one_device_copy():
    """grouped_matmul passes C as a tensor map and as a tensor: two device copies of a numpy C
    would each get half of the results, and the copy back would keep only one half."""
    from kiln.runtime.arguments import Staging

    class FakeDriver:
        def __init__(self):
            self.allocations = 0

        def make_current(self):
            pass

        def mem_alloc(self, nbytes):
            self.allocations += 1
            return 4096 * self.allocations

        def memcpy_htod(self, *args):
            pass

    driver = FakeDriver()
    staging = Staging(driver)
    c = np.zeros((4, 8), np.float32)
    first, second = staging.upload(c), staging.upload(c)
    assert first[0] == second[0] and driver.allocations == 1
    assert staging.upload(np.zeros(3))[0] != first[0]


@pytest.mark.parametrize("offsets", [[0, 50, 20, 40], [0, 30, 90, 200], [-70, 10, 10, 40]],
                         ids=["decreasing", "past_total_M", "negative"])
def test_unchecked_bad_offsets_never_write_outside_c(offsets, rng):
    """What an unvalidated device call sees (the kernel run directly, no host checks): bad
    offsets give meaningless rows but every access stays inside the arrays (the interpreter
    raises on any out-of-bounds access; a negative row start reaches the masked stores)."""
    from kiln.kernels.gemm.grouped import (grouped_config, grouped_constexprs,
                                           make_grouped_kernel)

    cfg = grouped_config(3)
    a = _random((40, 64), rng)
    b = _random((3 * 64, 64), rng)
    c = np.full((40, 64), np.nan, np.float32)
    kernel = make_grouped_kernel("bf16", "f32", "mn", cfg)
    with _race_if_groups_overlap(offsets):
        kernel.interpret[(2,)](a, b, c, c, np.array(offsets, np.int32), 3, 40, 64, 64, 64,
                               target="sm_90a", num_warps=cfg.num_warps,
                               **grouped_constexprs(cfg, 3))
    _check_clipped(c, a, b, offsets)


def _race_if_groups_overlap(offsets):
    """Decreasing offsets make two groups' tiles cover the same rows of C: blocks then store
    the same elements, which the interpreter reports as the race it would be on a GPU (the
    bounds check of each store runs first, so an out-of-bounds store would still fail)."""
    if np.all(np.diff(offsets) >= 0):
        return contextlib.nullcontext()
    return pytest.raises(kiln.RaceError, match="tensor 'c'")


def _check_clipped(c, a, b, offsets):
    """Monotone offsets past total_M: the rows that exist are their groups' products."""
    if offsets[0] == 0 and np.all(np.diff(offsets) >= 0):
        clipped = np.minimum(offsets, c.shape[0])
        _assert_close(c, _reference(a, b.reshape(3, 64, 64), clipped, False), "f32")


@pytest.mark.parametrize("offsets", [[0, 50, 20, 40], [0, 30, 90, 200], [-70, 10, 10, 40]],
                         ids=["decreasing", "past_total_M", "negative"])
def test_gfx950_unchecked_bad_offsets_never_write_outside_c(offsets, rng):
    """As on sm_90a: negative rows and rows past total_M fall outside C's buffer view."""
    from kiln.kernels.gemm.gfx950 import GemmConfig, make_kernel

    cfg = GemmConfig(b_layout="kn", out_dtype="f32")
    a = _random((40, 64), rng)
    b = _random((3 * 64, 64), rng)
    c = np.full((40, 64), np.nan, np.float32)
    with _race_if_groups_overlap(offsets):
        make_kernel("bf16", cfg, grouped=True).interpret[(2,)](
            a, b, c, np.array(offsets, np.int32), 3, 40, 64, 64, 64, 2, target="gfx950",
            num_warps=cfg.num_warps, TABLE=64)
    _check_clipped(c, a, b, offsets)
