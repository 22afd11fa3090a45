"""examples/tutorials: each runs in the interpreter against float64 at ragged sizes (as on
NVIDIA and as on AMD), compiles for sm_80, sm_90a and gfx950 without spills or scratch and with
16-byte vector accesses, and (gpu) runs on the GPU."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

import kiln

from source_modules import EXAMPLES, load_module

TUTORIALS = EXAMPLES / "tutorials"
vector_add = load_module(TUTORIALS / "vector_add.py", "kiln_tutorial_vector_add")
fused_softmax = load_module(TUTORIALS / "fused_softmax.py", "kiln_tutorial_fused_softmax")
layernorm = load_module(TUTORIALS / "layernorm.py", "kiln_tutorial_layernorm")
matmul = load_module(TUTORIALS / "matmul.py", "kiln_tutorial_matmul")
attention = load_module(TUTORIALS / "attention.py", "kiln_tutorial_attention")
grouped = load_module(TUTORIALS / "grouped_matmul.py", "kiln_tutorial_grouped_matmul")

TARGETS = ("sm_90a", "gfx950")


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("n", [1, 2047, 2048 * 3 + 5])
def test_vector_add(target, n):
    rng = np.random.default_rng()
    x, y = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    out = np.full(n, np.nan, np.float32)
    vector_add.add(x, y, out, backend="interpret", target=target)
    np.testing.assert_array_equal(out, (x.astype(np.float64) + y).astype(np.float32))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("shape", [(3, 1), (5, 100), (4, 1531), (2, 4099), (3, 16500)])
def test_fused_softmax(target, shape):
    x = np.random.default_rng().standard_normal(shape).astype(np.float32) * 4
    y = np.full_like(x, np.nan)
    fused_softmax.softmax(x, y, backend="interpret", target=target)
    np.testing.assert_allclose(y, fused_softmax.reference(x), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("shape", [(7, 100), (9, 1000)])
def test_softmax_and_layernorm_kernels_either_way(target, stream, shape):
    """Both designs on a grid of 2 blocks, each walking several rows: one row a block at a
    time, and rows streamed through shared memory (the next row's copy in flight)."""
    rng = np.random.default_rng()
    m, n = shape
    x = rng.standard_normal(shape).astype(np.float32) * 3 + 1
    y = np.full_like(x, np.nan)
    align = 16 if n % 4 == 0 else 4
    fused_softmax.softmax_kernel.interpret[(2,)](x, y, m, n, 2, BLOCK=1024, THREADS=128,
                                                 ALIGN=align, STREAM=stream, target=target)
    np.testing.assert_allclose(y, fused_softmax.reference(x), rtol=1e-5, atol=1e-7)
    w, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    y = np.full_like(x, np.nan)
    mean, rstd = np.full(m, np.nan, np.float32), np.full(m, np.nan, np.float32)
    layernorm.layernorm_kernel.interpret[(2,)](x, w, b, y, mean, rstd, m, n, 2, 1e-5,
                                               BLOCK=1024, CHUNK=512, THREADS=128, ALIGN=align,
                                               STREAM=stream, target=target)
    y_ref, mean_ref, rstd_ref = layernorm.reference(x, w, b)
    np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(mean, mean_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rstd, rstd_ref, rtol=1e-4)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("shape", [(3, 7), (5, 1000), (2, 4099), (2, 20001)])
def test_layernorm(target, shape):
    rng = np.random.default_rng()
    m, n = shape
    x = rng.standard_normal(shape).astype(np.float32) * 3 + 2
    w, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    y = np.full_like(x, np.nan)
    mean, rstd = np.full(m, np.nan, np.float32), np.full(m, np.nan, np.float32)
    layernorm.layernorm(x, w, b, y, mean, rstd, backend="interpret", target=target)
    y_ref, mean_ref, rstd_ref = layernorm.reference(x, w, b)
    np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(mean, mean_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rstd, rstd_ref, rtol=1e-4)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("shape", [(200, 150, 100), (129, 257, 40),
                                   pytest.param((96, 136, 72), marks=pytest.mark.slow)])
def test_matmul_bias_gelu(target, shape):
    """Ragged (synchronous copies: rows not 16-byte aligned) and aligned (cp.async) shapes."""
    rng = np.random.default_rng()
    m, n, k = shape
    a = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((k, n)).astype(ml_dtypes.bfloat16)
    bias = rng.standard_normal(n).astype(np.float32)
    c = np.full((m, n), np.nan, ml_dtypes.bfloat16)
    matmul.matmul(a, b, bias, c, backend="interpret", target=target)
    want = matmul.reference(a, b, bias)
    np.testing.assert_allclose(c.astype(np.float64), want, rtol=1e-2,
                               atol=1e-2 * np.abs(want).max())


@pytest.mark.lower
@pytest.mark.parametrize("target", ("sm_80", "sm_90a", "gfx950"))
def test_matmul_compiles_to_the_targets_mma_without_spills(target):
    a = np.zeros((256, 256), ml_dtypes.bfloat16)
    ck = matmul.matmul_kernel.compile(a, a, np.zeros(256, np.float32), a,
                                      **matmul.config(target), ALIGN=16, target=target)
    if target == "sm_90a":  # WGMMA fed by TMA stages, one group kept in flight; C by TMA
        assert ck.metadata["spill_bytes"] == 0 and ck.metadata["wgmma_serialized"] is None
        ptx = ck.asm["ptx"]
        assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16" in ptx
        assert "wgmma.wait_group.sync.aligned \t1;" in ptx and "cp.async.cg" not in ptx
        assert "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier" in ptx
        assert "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group" in ptx
        assert "mma.sync" not in ptx
        assert "rcp.approx.f32" in ptx and "rcp.rn" not in ptx   # GELU without a slow path
    elif target == "sm_80":
        assert ck.metadata["spill_bytes"] == 0
        assert "mma.sync.aligned.m16n8k16" in ck.asm["ptx"] and "cp.async" in ck.asm["ptx"]
    else:
        assert ck.metadata["scratch_bytes"] == 0
        assert "v_mfma_f32_32x32x16_bf16" in ck.asm["amdgcn"]


def _packed(rng, lengths, width):
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return cu, [rng.standard_normal((int(cu[-1]), width)).astype(ml_dtypes.bfloat16)
                for _ in range(3)]


@pytest.mark.parametrize("target,d,causal", [
    ("sm_90a", 64, True), ("gfx950", 64, True),
    pytest.param("sm_90a", 128, True, marks=pytest.mark.slow),  # 11 s in the interpreter
    pytest.param("sm_90a", 64, False, marks=pytest.mark.slow),
    pytest.param("gfx950", 128, False, marks=pytest.mark.slow)])
def test_attention(target, d, causal):
    """Ragged lengths (an empty sequence, a tail past a key tile, a query tile past the end),
    NaN-poisoned output: every row of every sequence is written, within bf16 of float64."""
    rng = np.random.default_rng()
    heads = 2
    cu, (q, k, v) = _packed(rng, [100, 0, 37, 130], heads * d)
    o = np.full(q.shape, np.nan, ml_dtypes.bfloat16)
    attention.attention(q, k, v, o, cu, 130, heads, causal=causal, backend="interpret",
                        target=target)
    want = attention.reference(q, k, v, cu, heads, causal)
    np.testing.assert_allclose(o.astype(np.float64), want, atol=2e-2, rtol=2e-2)


def test_attention_rejects_a_scale_that_is_not_positive():
    x = np.zeros((4, 64), ml_dtypes.bfloat16)
    with pytest.raises(kiln.KilnValueError, match="scale must be positive"):
        attention.attention(x, x, x, x.copy(), np.array([0, 4], np.int32), 4, 1, scale=-0.1,
                            backend="interpret", target="sm_90a")


@pytest.mark.parametrize("target,d,causal", [
    ("gfx950", 64, False), pytest.param("sm_90a", 64, False, marks=pytest.mark.slow),
    pytest.param("gfx950", 128, True, marks=pytest.mark.slow)])
def test_attention_rescales_when_the_max_jumps(target, d, causal):
    """Keys growing 30x along the sequence and sharp queries: the running max grows at most
    steps (O rescaled each time), within bf16 of float64."""
    rng = np.random.default_rng()
    heads, lengths = 2, [300, 5, 130]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    q, k, v = (rng.standard_normal((int(cu[-1]), heads * d)) for _ in range(3))
    k *= np.linspace(0.2, 6, len(k))[:, None]
    q, k, v = (t.astype(ml_dtypes.bfloat16) for t in (3 * q, k, v))
    o = np.full(q.shape, np.nan, ml_dtypes.bfloat16)
    attention.attention(q, k, v, o, cu, max(lengths), heads, causal=causal, backend="interpret",
                        target=target)
    want = attention.reference(q, k, v, cu, heads, causal)
    np.testing.assert_allclose(o.astype(np.float64), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("sizes,k,n", [
    pytest.param([130, 0, 7, 64], 96, 72, id="four_groups"),
    pytest.param([1, 200], 40, 136, id="two_groups", marks=pytest.mark.slow)])
def test_grouped_matmul(target, sizes, k, n):
    """Uneven and empty groups, ragged K and N (synchronous copies) and aligned ones."""
    rng = np.random.default_rng()
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    a = rng.standard_normal((int(offsets[-1]), k)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((len(sizes), k, n)).astype(ml_dtypes.bfloat16)
    c = np.full((a.shape[0], n), np.nan, ml_dtypes.bfloat16)
    grouped.grouped_matmul(a, b, c, offsets, backend="interpret", target=target)
    want = grouped.reference(a, b, offsets)
    np.testing.assert_allclose(c.astype(np.float64), want, rtol=1e-2,
                               atol=1e-2 * np.abs(want).max())


@pytest.mark.lower
# sm_80 and D 64 compile in the slow tier, which CI also runs (3 s each)
@pytest.mark.parametrize("target", (pytest.param("sm_80", marks=pytest.mark.slow), "sm_90a",
                                    "gfx950"))
@pytest.mark.parametrize("d", (pytest.param(64, marks=pytest.mark.slow), 128))
def test_attention_compiles_to_the_targets_mma_without_spills(target, d):
    x = np.zeros((256, 2 * d), ml_dtypes.bfloat16)
    ck = attention.attention_kernel.compile(x, x, x, x, np.array([0, 256], np.int32), 1.0,
                                            CAUSAL=True, ALIGN=16, **attention.config(d, target),
                                            target=target)
    if target.startswith("sm"):
        ptx = ck.asm["ptx"]
        assert ck.metadata["spill_bytes"] == 0 and ck.metadata["stack_bytes"] == 0
        assert ck.metadata["wgmma_serialized"] is None and "cp.async" in ptx
        if target == "sm_90a":   # both products on WGMMA, P from registers (no ldmatrix)
            assert "mma.sync" not in ptx and "ldmatrix" not in ptx
            assert re.search(r"wgmma.mma_async.sync.aligned.m64n\d+k16.f32.bf16.bf16 +"
                             r"\{[^}]*\}, \{%r", ptx)
            # K and V by TMA: a box per 64 columns of a tile, 2 tiles a step, 3 steps a loop,
            # two loops, and the prologue's 2 V and 2 K; Q (masked at the sequence's end) by
            # cp.async
            assert ptx.count("cp.async.bulk.tensor") == (2 * 3 * 2 + 4) * d // 64
            # block barriers after the mbarriers' initialisation and Q only: kiln.release
            # arrives on the K and V tiles' empty mbarriers, a tile each a step
            assert len(re.findall(r"bar.sync\s+0;", ptx)) == ptx.count("bar.sync") == 2
            assert ptx.count("mbarrier.arrive.shared.b64") == 2 * 2 * 3
        else:
            assert "mma.sync.aligned.m16n8k16" in ptx and "ldmatrix" in ptx
            # P reaches the second product straight from registers: no shared stage; Q
            # landed, and kiln.release a block barrier a step (two loops of three)
            assert ptx.count("bar.sync") == 1 + 2 * 3
        # a warp must reach every .aligned WGMMA op at one address: none under a branch
        assert not _wgmma_under_a_branch(ck.asm["gpu"])
    else:
        assert ck.metadata["scratch_bytes"] == 0
        assert "v_mfma_f32_32x32x16_bf16" in ck.asm["amdgcn"]


def _wgmma_under_a_branch(gpu_ir: str) -> list[str]:
    """The WGMMA ops and barriers of ``gpu_ir`` nested in an ``scf.if``."""
    from mlir import ir

    found = []
    with ir.Context():
        module = ir.Module.parse(gpu_ir)

        def visit(op):
            name = op.operation.name
            if name.startswith("nvvm.wgmma") or name == "gpu.barrier":
                parent = op.operation.parent
                while parent is not None and parent.name != "gpu.func":
                    if parent.name == "scf.if":
                        found.append(name)
                    parent = parent.parent
            return ir.WalkResult.ADVANCE

        module.operation.walk(visit)
    return found


@pytest.mark.lower
@pytest.mark.parametrize("target", ("sm_80", "sm_90a", "gfx950"))
def test_grouped_matmul_compiles_to_the_targets_mma_without_spills(target):
    a = np.zeros((256, 256), ml_dtypes.bfloat16)
    ck = grouped.grouped_matmul_kernel.compile(a, a, a, np.array([0, 100, 256], np.int32), 2,
                                               **grouped.config(target), ALIGN=16,
                                               target=target)
    if target == "sm_90a":  # WGMMA; A by TMA boxes, B by cp.async (masked at the group's K)
        ptx = ck.asm["ptx"]
        assert ck.metadata["spill_bytes"] == 0 and ck.metadata["wgmma_serialized"] is None
        assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16" in ptx
        assert "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier" in ptx
        assert "cp.async.cg.shared.global" in ptx and "mma.sync" not in ptx
    elif target == "sm_80":
        assert ck.metadata["spill_bytes"] == 0
        assert "mma.sync.aligned.m16n8k16" in ck.asm["ptx"] and "cp.async" in ck.asm["ptx"]
    else:
        assert ck.metadata["scratch_bytes"] == 0
        assert "v_mfma_f32_32x32x16_bf16" in ck.asm["amdgcn"]


def _compile(name, n, target):
    x2 = np.zeros((2, n), np.float32)
    x1 = np.zeros(n, np.float32)
    if name == "vector_add":
        return vector_add.add_kernel.compile(x1, x1, x1, n, BLOCK=vector_add.BLOCK,
                                             THREADS=vector_add.THREADS, ALIGN=16,
                                             target=target)
    module = fused_softmax if name == "softmax" else layernorm
    block, threads, _, stream = module.config(n)
    if name == "softmax":
        return module.softmax_kernel.compile(x2, x2, 2, n, 1, BLOCK=block, THREADS=threads,
                                             ALIGN=16, STREAM=stream, target=target)
    return module.layernorm_kernel.compile(x2, x1, x1, x2, x1, x1, 2, n, 1, 1e-5, BLOCK=block,
                                           CHUNK=min(block, 4096), THREADS=threads, ALIGN=16,
                                           STREAM=stream, target=target)


VECTOR_ACCESS = {"ptx": (r"ld\.global\.v4\.\w32", r"st\.global\.v4\.\w32"),
                 "amdgcn": (r"global_load_dwordx4", r"global_store_dwordx4")}
# softmax and layernorm stream rows into shared memory: 16-byte cp.async / buffer -> LDS DMA,
# then 16-byte shared reads
ROW_STREAM = {"ptx": (r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], 16",
                      r"ld\.shared\.v4\.\w32"),
              "amdgcn": (r"buffer_load_dwordx4 .* lds", r"ds_read_b128")}


@pytest.mark.lower
@pytest.mark.parametrize("target", ("sm_80", "sm_90a", "gfx950"))
@pytest.mark.parametrize("name,n", [("vector_add", 4096), ("softmax", 4096),
                                    ("softmax", 32768), ("layernorm", 8192),
                                    ("layernorm", 32768)])
def test_tutorials_compile_with_vector_accesses_and_no_spills(target, name, n):
    ck = _compile(name, n, target)
    md = ck.metadata
    stage = "ptx" if target.startswith("sm") else "amdgcn"
    if stage == "ptx":
        assert md["spill_bytes"] == 0 and md["stack_bytes"] == 0
    else:
        assert md["scratch_bytes"] == 0
    load, store = VECTOR_ACCESS[stage]
    asm = ck.asm[stage]
    if name != "vector_add" and (fused_softmax if name == "softmax" else layernorm).config(n)[3]:
        copy, read = ROW_STREAM[stage]
        assert re.search(copy, asm) and re.search(read, asm), f"{name} streams no 16-byte rows"
    else:
        assert re.search(load, asm), f"{name} has no 16-byte loads"
    assert re.search(store, asm), f"{name} has no 16-byte stores"


@pytest.mark.lower
def test_softmax_rows_of_16k_columns_fit_two_blocks_an_sm_on_nvidia():
    """The register cap the tutorial passes on NVIDIA at 16384 columns: 512 threads of at most
    64 registers (two blocks in an SM's 64k), few bytes spilled."""
    x = np.zeros((2, 16384), np.float32)
    ck = fused_softmax.softmax_kernel.compile(
        x, x, 2, 16384, 2, BLOCK=16384, THREADS=512, ALIGN=16, STREAM=False,
        maxnreg=fused_softmax.MAX_REGISTERS[16384], target="sm_90a")
    assert fused_softmax.config(16384) == (16384, 512, 1, False)
    assert 2 * 512 * ck.metadata["registers"] <= 65536 and ck.metadata["spill_bytes"] <= 64


@pytest.mark.lower
def test_streamed_layernorm_loads_the_next_tiles_weights_before_a_store():
    """w/b of tile c + 1 are loaded before tile c's store: a load after a store it may alias
    would wait for it (one L2 round trip a tile). Tile 0's w and b are 4 vector loads a thread
    (8 in the PTX: a whole-chunk and a masked path)."""
    ptx = _compile("layernorm", 32768, "sm_90a").asm["ptx"]
    assert ptx[:ptx.index("st.global.v4")].count("ld.global.v4") == 16


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(64, 1000), (37, 1531), (700, 4096), (300, 32768),
                                   (150, 20001)])
def test_tutorials_on_gpu(shape):
    """Rows not a multiple of 4 (4-byte copies), and more rows than the persistent grid has
    blocks (each block streams several; 20001 columns: streamed rows past their end)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch")
    m, n = shape
    x = torch.randn(m, n, device="cuda") * 3
    y = torch.full_like(x, float("nan"))
    fused_softmax.softmax(x, y)
    np.testing.assert_allclose(y.cpu().numpy(), fused_softmax.reference(x.cpu().numpy()),
                               rtol=1e-5, atol=1e-7)
    w, b = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    mean, rstd = torch.empty(m, device="cuda"), torch.empty(m, device="cuda")
    layernorm.layernorm(x, w, b, y, mean, rstd)
    y_ref, mean_ref, _ = layernorm.reference(x.cpu().numpy(), w.cpu().numpy(), b.cpu().numpy())
    np.testing.assert_allclose(y.cpu().numpy(), y_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(mean.cpu().numpy(), mean_ref, rtol=1e-5, atol=1e-5)
    flat, other = x.reshape(-1)[: m * n - 3], torch.randn(m * n - 3, device="cuda")
    out = torch.full_like(flat, float("nan"))
    vector_add.add(flat, other, out)
    assert torch.equal(out, flat + other)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1000, 515, 333), (1000, 520, 336), (256, 512, 4096)])
def test_matmul_on_gpu(shape):
    """Ragged (synchronous copies) and aligned (cp.async) shapes, WGMMA on Hopper."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch")
    m, n, k = shape
    a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    b = torch.randn(k, n, device="cuda").to(torch.bfloat16)
    bias = torch.randn(n, device="cuda")
    c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    matmul.matmul(a, b, bias, c)
    want = matmul.reference(a.float().cpu().numpy(), b.float().cpu().numpy(), bias.cpu().numpy())
    got = c.float().cpu().numpy()
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


@pytest.mark.gpu
@pytest.mark.parametrize("d", (64, 128))
def test_attention_on_gpu(d):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch")
    heads, lengths = 2, [1000, 0, 37, 700]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    q, k, v = (torch.randn(int(cu[-1]), heads * d, device="cuda").to(torch.bfloat16)
               for _ in range(3))
    for causal in (False, True):
        o = torch.full_like(q, float("nan"))
        attention.attention(q, k, v, o, torch.from_numpy(cu).cuda(), max(lengths), heads,
                            causal=causal)
        want = attention.reference(*(t.float().cpu().numpy() for t in (q, k, v)), cu, heads,
                                   causal)
        np.testing.assert_allclose(o.float().cpu().numpy(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_grouped_matmul_on_gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch")
    sizes, k, n = [300, 0, 1, 517], 264, 520
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    a = torch.randn(int(offsets[-1]), k, device="cuda").to(torch.bfloat16)
    b = torch.randn(len(sizes), k, n, device="cuda").to(torch.bfloat16)
    c = torch.full((a.shape[0], n), float("nan"), device="cuda", dtype=torch.bfloat16)
    grouped.grouped_matmul(a, b, c, torch.from_numpy(offsets).cuda())
    want = grouped.reference(a.float().cpu().numpy(), b.float().cpu().numpy(), offsets)
    np.testing.assert_allclose(c.float().cpu().numpy(), want, rtol=2e-2,
                               atol=2e-2 * np.abs(want).max())
