"""The Hopper TMA + WGMMA GEMM: compile-only checks (``lower``) and results on a GPU (``gpu``)."""

import re
import subprocess

import ml_dtypes
import numpy as np
import pytest
from gemm_reference import assert_matmul_close

import kiln
from kiln.kernels.gemm import HopperGemmConfig, compile_matmul, matmul
from kiln.runtime.cuda import cuda_available
from kiln.lowering.tools import find_ptxas

needs_gpu = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and driver")


@pytest.fixture(scope="module")
def default_kernel():
    return compile_matmul("bf16", target="sm_90a")


@pytest.mark.lower
def test_ptx_has_the_hopper_pipeline(default_kernel):
    ptx = default_kernel.asm["ptx"]
    assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16" in ptx
    assert "cp.async.bulk.tensor.2d.shared::cluster.global" in ptx
    assert "mbarrier.try_wait.parity" in ptx
    assert "setmaxnreg.dec.sync.aligned.u32 40" in ptx.replace("\t", " ").replace("  ", " ")
    assert "setmaxnreg.inc.sync.aligned.u32 232" in ptx.replace("\t", " ").replace("  ", " ")
    # Row-major B is read MN-major: the last wgmma immediate (tnspB) is 1.
    assert re.search(r"wgmma\.mma_async[^;]*, 1,\s*1, 0,\s*1;", ptx, re.S)
    assert ".maxntid 384, 1, 1" in ptx


@pytest.mark.lower
def test_no_spills_and_big_dynamic_shared_memory(default_kernel):
    assert default_kernel.metadata["spill_bytes"] == 0
    assert default_kernel.metadata["stack_bytes"] == 0
    config = HopperGemmConfig()
    # The 4-stage ring (192 KB) is dynamic shared memory, plus alignment slack.
    assert default_kernel.signature.dynamic_shared_bytes >= config.shared_bytes()
    assert default_kernel.signature.block == (384, 1, 1)


@pytest.mark.lower
@pytest.mark.skipif(find_ptxas() is None, reason="needs ptxas")
def test_ptxas_honours_setmaxnreg(default_kernel, tmp_path):
    ptx = tmp_path / "gemm.ptx"
    ptx.write_text(default_kernel.asm["ptx"])
    done = subprocess.run([str(find_ptxas()), "-arch=sm_90a", "-v", str(ptx), "-o",
                           str(tmp_path / "gemm.cubin")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "C7508" not in done.stderr and "setmaxnreg ignored" not in done.stderr


@pytest.mark.lower
def test_trans_b_reads_k_major_b():
    ck = compile_matmul("f16", target="sm_90a", trans_b=True, out_dtype="f32", stages=3)
    ptx = ck.asm["ptx"]
    assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16" in ptx
    assert re.search(r"wgmma\.mma_async[^;]*, 1,\s*1, 0,\s*0;", ptx, re.S)
    assert ck.metadata["spill_bytes"] == 0


@pytest.mark.lower
@pytest.mark.parametrize("trans_b, multicast_loads", [(False, 4), (True, 2)])
def test_cluster_pairs_multicast_b_and_release_stages_cluster_wide(trans_b, multicast_loads):
    ck = compile_matmul("bf16", target="sm_90a", trans_b=trans_b, cluster_m=2)
    ptx = ck.asm["ptx"]
    assert ck.signature.cluster == (2, 1, 1)
    assert ".reqnctapercluster 2, 1, 1" in ptx and ".explicitcluster" in ptx
    # B: every 64-column chunk (MN-major) or half (K-major) comes from one CTA of the pair,
    # predicated on its rank and multicast to both; A stays a plain per-CTA load.
    multicast = re.findall(r"@%p\d+ cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global\."
                           r"mbarrier::complete_tx::bytes\.multicast::cluster", ptx)
    assert len(multicast) == multicast_loads
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global\.tile\."
                          r"mbarrier::complete_tx::bytes \[", ptx)) == 1
    # A stage is released on the empty barrier of both CTAs (two release sites per consumer).
    assert ptx.count("mbarrier.arrive.shared::cluster.b64") == 4
    assert len(re.findall(r"mapa\.shared::cluster\.u64\s+%rd\d+, %rd\d+, [01];", ptx)) == 4
    assert "%cluster_ctarank" in ptx
    assert ptx.count("barrier.cluster.wait") == 2  # after mbarrier init and before exit
    assert ck.metadata["spill_bytes"] == 0


@pytest.mark.lower
def test_single_cta_config_has_no_cluster():
    ck = compile_matmul("bf16", target="sm_90a", block_n=192)
    assert ck.signature.cluster is None
    ptx = ck.asm["ptx"]
    assert "multicast" not in ptx and "reqnctapercluster" not in ptx and "mapa" not in ptx


@pytest.mark.lower
def test_cluster_launch_goes_through_mgpu_launch_cluster_kernel():
    from mlir import ir
    from mlir.dialects import llvm

    from kiln.runtime.host import build_host_module, lower_host_module, nvidia_kernel_object
    from kiln.core.targets import get_target

    ck = compile_matmul("bf16", target="sm_90a", cluster_m=2)
    with ir.Context(), ir.Location.unknown():
        module = build_host_module(ck.signature,
                                   nvidia_kernel_object(get_target("sm_90a"), ptx="// ptx"))
        lower_host_module(module)
        text = llvm.translate_module_to_llvmir(module.operation)  # host module: fully lowered
    assert re.search(r"call void @mgpuLaunchClusterKernel\(ptr %\w+, i64 2, i64 1, i64 1,", text)


@pytest.mark.lower
def test_amd_targets_dispatch_to_the_gfx950_kernel():
    ck = compile_matmul("bf16", target="gfx950", trans_b=True, out_dtype="f32")
    assert ck.target.name == "gfx950" and "amdgcn" in ck.asm
    assert ck.signature.params[2].dtype == "f32"
    with pytest.raises(kiln.UnsupportedError, match="cannot run gfx950"):
        matmul(np.ones((8, 8), ml_dtypes.bfloat16), np.ones((8, 8), ml_dtypes.bfloat16),
               target="gfx950")


@pytest.mark.lower
def test_bad_requests_raise_kiln_errors():
    with pytest.raises(kiln.UnsupportedError, match="f32 inputs"):
        compile_matmul("f32", target="sm_90a")
    with pytest.raises(kiln.UnsupportedError, match="WGMMA"):
        compile_matmul("bf16", target="sm_80")
    x = np.ones((8, 8), ml_dtypes.bfloat16)
    with pytest.raises(kiln.UnsupportedError, match="WGMMA"):  # not a shared-memory overflow
        matmul(x, x, target="sm_80", backend="interpret")
    with pytest.raises(kiln.UnsupportedError, match="block_n"):
        HopperGemmConfig(block_n=320)
    with pytest.raises(kiln.ResourceError, match="register file"):
        HopperGemmConfig(block_m=192, stages=2, consumer_registers=232)
    with pytest.raises(kiln.ResourceError, match="no room for the epilogue"):
        HopperGemmConfig(stages=5)
    with pytest.raises(kiln.UnsupportedError, match="cluster_m=4"):
        HopperGemmConfig(cluster_m=4)
    a = np.ones((8, 16), ml_dtypes.bfloat16)
    with pytest.raises(kiln.KilnValueError, match="do not agree on K"):
        matmul(a, np.ones((8, 16), ml_dtypes.bfloat16), target="sm_90a")
    with pytest.raises(kiln.KilnTypeError, match="share a dtype"):
        matmul(a, np.ones((16, 8), np.float16), target="sm_90a")


@pytest.mark.parametrize("shape, trans_b", [((130, 264, 72), False), ((257, 20, 33), True)])
def test_interpret_backend_runs_the_sm90a_kernel_on_the_cpu(shape, trans_b, rng):
    m, n, k = shape
    a = _random((m, k), ml_dtypes.bfloat16, rng)
    b = _random((n, k) if trans_b else (k, n), ml_dtypes.bfloat16, rng)
    c = matmul(a, b, trans_b=trans_b, backend="interpret", target="sm_90a")
    assert c.dtype == ml_dtypes.bfloat16
    assert_matmul_close(c, a, b.T if trans_b else b)


def _random(shape, dtype, rng):
    return rng.standard_normal(shape).astype(dtype)




@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16])
# (100, 296, 200): the second CTA of a pair owns rows 128..255, entirely outside A and C.
@pytest.mark.parametrize("shape", [(1000, 1000, 1000), (4096, 4096, 4096), (192, 264, 72),
                                   (100, 296, 200)])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("config", [HopperGemmConfig(), HopperGemmConfig(block_m=64, stages=3),
                                    HopperGemmConfig(block_n=192),
                                    HopperGemmConfig(cluster_m=2),
                                    HopperGemmConfig(block_n=192, cluster_m=2),
                                    HopperGemmConfig(block_m=64, stages=3, cluster_m=2)],
                         ids=lambda c: f"{c.block_m}x{c.block_n}s{c.stages}c{c.cluster_m}")
def test_matches_float64_with_poisoned_output(dtype, shape, trans_b, config, rng):
    torch = pytest.importorskip("torch")
    from kiln.kernels.gemm import run_hopper

    m, n, k = shape
    a = _random((m, k), dtype, rng)
    b = _random((n, k) if trans_b else (k, n), dtype, rng)
    torch_dtype = torch.bfloat16 if dtype is ml_dtypes.bfloat16 else torch.float16
    a_dev = torch.from_numpy(a.astype(np.float32)).to("cuda", torch_dtype)
    b_dev = torch.from_numpy(b.astype(np.float32)).to("cuda", torch_dtype)
    c = torch.full((m, n), float("nan"), device="cuda", dtype=torch_dtype)
    run_hopper(a_dev, b_dev, c, m, n, k, dtype=kiln.dtype(dtype).name,
               b_major="k" if trans_b else "mn", target="sm_90a", config=config)
    assert_matmul_close(c, a, b.T if trans_b else b)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", [(257, 513, 129), (1000, 1000, 1000), (64, 8, 7)])
@pytest.mark.parametrize("trans_b", [False, True])
def test_matmul_pads_unaligned_shapes(shape, trans_b, rng):
    torch = pytest.importorskip("torch")
    m, n, k = shape
    a_host = _random((m, k), ml_dtypes.bfloat16, rng)
    b_host = _random((n, k) if trans_b else (k, n), ml_dtypes.bfloat16, rng)
    a, b = (torch.from_numpy(x.astype(np.float32)).to("cuda", torch.bfloat16)
            for x in (a_host, b_host))
    torch.empty(m * n, device="cuda").fill_(float("nan"))  # poison the pool matmul allocates from
    c = matmul(a, b, trans_b=trans_b)  # (it allocates c itself: no output argument to poison)
    assert c.dtype == torch.bfloat16
    assert_matmul_close(c, a_host, b_host.T if trans_b else b_host)


@pytest.mark.gpu
@needs_gpu
def test_matmul_numpy_f32_output(rng):
    a = _random((300, 200), np.float16, rng)
    b = _random((200, 136), np.float16, rng)
    c = matmul(a, b, out_dtype="f32")
    assert c.dtype == np.float32
    assert_matmul_close(c, a, b)



@pytest.mark.lower
def test_cluster_dims_rejects_oversized_and_conflicting_shapes():
    @kiln.kernel
    def clustered(x: kiln.Tensor[kiln.f32], SHAPES: kiln.constexpr):
        for shape in SHAPES:
            kiln.nvidia_asm.cluster_dims(*shape)

    x = np.ones(4, np.float32)
    assert clustered.trace(x, SHAPES=((2, 1, 1),)).signature.cluster == (2, 1, 1)
    with pytest.raises(kiln.KilnValueError, match="at most 8 CTAs"):
        clustered.trace(x, SHAPES=((4, 4, 1),))
    with pytest.raises(kiln.KilnValueError, match="declared twice"):
        clustered.trace(x, SHAPES=((2, 1, 1), (1, 2, 1)))
