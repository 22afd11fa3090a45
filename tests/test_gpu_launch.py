"""End-to-end launches on a CUDA GPU (skipped cleanly without one).

The kernel is hand-written kiln IR (what the front end emits for saxpy), compiled to PTX with
``gpu-lower-to-nvvm-pipeline``; the launcher JIT-loads the PTX through the CUDA runtime wrappers.
"""

from types import SimpleNamespace

import numpy as np
import pytest

from kiln.runtime.cuda import cuda_available
from kiln.runtime.launch import launch
from kiln.signature import KernelSignature, ScalarParam, TensorParam
from kiln.core.targets import get_target

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and driver")]

BLOCK = 128
MEMREF = "memref<?xf32, strided<[1], offset: ?>, 1>"
SAXPY_KILN_IR = f"""
module attributes {{gpu.container_module}} {{
  gpu.module @kiln_kernels {{
    gpu.func @saxpy(%x: {MEMREF}, %y: {MEMREF}, %n: i32, %a: f32) kernel
        attributes {{known_block_size = array<i32: {BLOCK}, 1, 1>}} {{
      %bid = gpu.block_id x
      %tid = gpu.thread_id x
      %c_block = arith.constant {BLOCK} : index
      %base = arith.muli %bid, %c_block : index
      %i = arith.addi %base, %tid : index
      %n_index = arith.index_cast %n : i32 to index
      %in_bounds = arith.cmpi ult, %i, %n_index : index
      scf.if %in_bounds {{
        %xv = memref.load %x[%i] : {MEMREF}
        %yv = memref.load %y[%i] : {MEMREF}
        %ax = arith.mulf %a, %xv : f32
        %r = arith.addf %ax, %yv : f32
        memref.store %r, %y[%i] : {MEMREF}
      }}
      gpu.return
    }}
  }}
}}
"""
SIGNATURE = KernelSignature("saxpy", (TensorParam("x", "f32", 1), TensorParam("y", "f32", 1),
                                      ScalarParam("n", "i32"), ScalarParam("a", "f32")),
                            block=(BLOCK, 1, 1))


def _compile_saxpy_ptx(target) -> str:
    from mlir import ir, passmanager
    from mlir.dialects import gpu

    with ir.Context():
        module = ir.Module.parse(SAXPY_KILN_IR)
        passmanager.PassManager.parse(
            f"builtin.module(gpu-lower-to-nvvm-pipeline{{cubin-chip={target.name} "
            f"cubin-features={target.ptx_features()} cubin-format=isa}})").run(module.operation)
        (binary,) = [op for op in module.body.operations if op.operation.name == "gpu.binary"]
        return gpu.ObjectAttr(binary.attributes["objects"][0]).object.decode().rstrip("\0")


@pytest.fixture(scope="module")
def saxpy_kernel():
    target = get_target("sm_80")  # PTX for sm_80 is JIT-compiled for any newer GPU
    return SimpleNamespace(name="saxpy", target=target, signature=SIGNATURE,
                           asm={"ptx": _compile_saxpy_ptx(target)})


@pytest.mark.parametrize("n", [1, 1000, 4096 + 7])
def test_saxpy_numpy(saxpy_kernel, n):
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    y = rng.standard_normal(n).astype(np.float32)
    expected = 1.75 * x + y
    launch(saxpy_kernel, ((n + BLOCK - 1) // BLOCK, 1, 1), [x, y, n, 1.75])
    np.testing.assert_allclose(y, expected, rtol=1e-6, atol=1e-6)


def test_saxpy_torch_on_a_stream(saxpy_kernel):
    torch = pytest.importorskip("torch")
    n = 10_000
    x = torch.randn(n, device="cuda")
    y = torch.randn(n, device="cuda")
    expected = 0.5 * x + y
    out = torch.full((n,), float("nan"), device="cuda")  # poisoned: must be fully overwritten
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out.copy_(y)
    launch(saxpy_kernel, ((n + BLOCK - 1) // BLOCK,), [x, out, n, 0.5], stream=stream)
    stream.synchronize()
    torch.testing.assert_close(out, expected)


def test_saxpy_torch_default_stream_partial_range(saxpy_kernel):
    torch = pytest.importorskip("torch")
    n, active = 4096, 1000
    x = torch.randn(n, device="cuda")
    y = torch.full((n,), -7.0, device="cuda")
    launch(saxpy_kernel, ((n + BLOCK - 1) // BLOCK,), [x, y, active, 2.0])
    torch.cuda.synchronize()
    torch.testing.assert_close(y[:active], 2.0 * x[:active] - 7.0)
    assert bool((y[active:] == -7.0).all())  # threads past n must not store


def test_tensor_map_encoding_accepts_a_device_tensor():
    torch = pytest.importorskip("torch")
    from kiln.runtime.cuda import driver

    tensor = torch.zeros((256, 128), dtype=torch.float16, device="cuda")
    float16, swizzle_128b, zero_fill = 6, 3, 0
    encoded = driver().tensor_map_encode_tiled(float16, tensor.data_ptr(), [128, 256], [256],
                                               [64, 64], swizzle_128b, zero_fill)
    assert len(encoded) == 128 and any(encoded)


def test_stream_none_launches_on_torchs_current_stream(saxpy_kernel):
    torch = pytest.importorskip("torch")
    n = 10_000
    x = torch.randn(n, device="cuda")
    y = torch.randn(n, device="cuda")
    out = torch.full((n,), float("nan"), device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        # Delay the copy on `stream`: a launch on any other stream would run before it and the
        # copy would then overwrite its result.
        torch.cuda._sleep(20_000_000)
        out.copy_(y)
        launch(saxpy_kernel, ((n + BLOCK - 1) // BLOCK,), [x, out, n, 0.5])
    stream.synchronize()
    torch.testing.assert_close(out, 0.5 * x + y)


def test_launch_configuration_beyond_the_device_is_a_resource_error(saxpy_kernel):
    from kiln.core.errors import ResourceError
    from kiln.runtime.cuda import driver

    limits = driver().launch_limits()
    too_much = SimpleNamespace(name="saxpy", target=saxpy_kernel.target, asm=saxpy_kernel.asm,
                               metadata={}, signature=KernelSignature(
                                   "saxpy", SIGNATURE.params, block=(BLOCK, 1, 1),
                                   dynamic_shared_bytes=limits.max_shared_bytes_optin + 1024))
    x = np.ones(4, np.float32)
    with pytest.raises(ResourceError, match="bytes of shared memory") as err:
        launch(too_much, (1,), [x, x, 4, 1.0])
    assert err.value.loc.filename == __file__


def test_bound_combine_with_preallocated_outputs_on_a_side_stream(rng):
    torch = pytest.importorskip("torch")
    import kiln
    from kiln.kernels.attention import combine

    splits, batch, heads, head_dim = 2, 1, 32, 128
    o_np = rng.standard_normal((splits, batch, 1, heads, head_dim)).astype(np.float32)
    lse_np = rng.standard_normal((splits, batch, 1, heads)).astype(np.float32)
    o_p, lse_p = torch.from_numpy(o_np).cuda(), torch.from_numpy(lse_np).cuda()
    counts = torch.full((batch, 1, heads), splits, dtype=torch.int32, device="cuda")
    out = torch.full((batch, 1, heads, head_dim), float("nan"), device="cuda")
    lse_out = torch.full((batch, 1, heads), float("nan"), device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # the bound launch, repeated into the same outputs
            o, lse = combine(o_p, lse_p, counts, max_splits=2, out_dtype=kiln.f32, out=out,
                             lse_out=lse_out)
    stream.synchronize()
    assert o is out and lse is lse_out
    w = np.exp(lse_np - lse_np.max(axis=0))
    expected = (w[..., None] * o_np).sum(axis=0) / w.sum(axis=0)[..., None]
    np.testing.assert_allclose(out.cpu().numpy(), expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(lse_out.cpu().numpy(),
                               np.log(w.sum(axis=0)) + lse_np.max(axis=0), rtol=1e-5, atol=1e-5)
