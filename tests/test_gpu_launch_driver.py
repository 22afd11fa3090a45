"""The CUDA launchers on a GPU: the driver launcher (the pipeline's cubin through
``cuLaunchKernel``, by the native shim or ctypes) against the ExecutionEngine's host module
(``KILN_LAUNCHER=mlir``), on fresh random inputs with poisoned outputs: ``kernel[grid]``,
bound launches, dynamic shared memory, and the library's decode (split + combine, fused)
entry points, whose results must agree bit for bit between launchers and with a float64
reference."""

import gc

import numpy as np
import pytest

import kiln
from kiln import f32, i32
from kiln.kernel import JITKernel
from kiln.lowering.compiler import CompiledKernel
from kiln.runtime.cuda import cuda_available
from kiln.runtime.launch import _plan_of, bind_launch

from attention_reference import assert_paged_attention_close

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and driver")]

LAUNCHERS = {"mlir": "HostLauncher", "native": "DriverLauncher", "ctypes": "DriverLauncher"}
BLOCK = 128


@kiln.kernel(num_threads="BLOCK")
def axpy(x: kiln.Tensor[f32], y: kiln.Tensor[f32], out: kiln.Tensor[f32], n: i32, a: f32,
         BLOCK: kiln.constexpr):
    i = kiln.block_id(0) * kiln.block_dim(0) + kiln.thread_id(0)
    if i < n:
        out[i] = a * x[i] + y[i]


def _use_launcher(monkeypatch, kind: str) -> None:
    """Launch through ``kind`` from now on: every compiled kernel's plan and every cached
    launch made with another launcher is dropped."""
    monkeypatch.setenv("KILN_LAUNCHER", kind)
    _drop_launchers()


def _drop_launchers() -> None:
    from kiln.kernels import runtime

    runtime.clear_plans()
    for obj in gc.get_objects():
        kind = type(obj)  # not isinstance: it would read lazy attributes of torch's modules
        if kind is CompiledKernel and "_launch_plan" in vars(obj):
            del obj._launch_plan
        elif kind is JITKernel:
            obj._launches.clear()
            obj._last_launch = None


@pytest.fixture(autouse=True)
def _default_launcher_afterwards():
    """Later tests in the process launch through the default launcher again."""
    yield
    _drop_launchers()


@pytest.mark.parametrize("kind", LAUNCHERS)
def test_every_launcher_matches_the_reference(kind, monkeypatch, rng):
    torch = pytest.importorskip("torch")
    _use_launcher(monkeypatch, kind)
    for n in (1000, 4096 + 3, 1000):
        x, y = (torch.from_numpy(rng.standard_normal(n).astype(np.float32)).cuda()
                for _ in range(2))
        out = torch.full((n,), float("nan"), device="cuda")
        a = float(rng.standard_normal())
        axpy[(n + BLOCK - 1) // BLOCK](x, y, out, n, a, BLOCK=BLOCK)
        want = a * x.double() + y.double()
        torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-6)
    ck = axpy.compile(x, y, out, n, a, BLOCK=BLOCK)
    assert type(_plan_of(ck).launcher).__name__ == LAUNCHERS[kind]
    bound = bind_launch(ck, ((n + BLOCK - 1) // BLOCK, 1, 1), [x, y, out, n, a])
    for _ in range(2):
        x2 = torch.randn(n, device="cuda")
        out.fill_(float("nan"))
        bound(x2.data_ptr(), y.data_ptr(), out.data_ptr())
        torch.testing.assert_close(out.double(), a * x2.double() + y.double(), rtol=1e-6,
                                   atol=1e-6)


@pytest.mark.parametrize("kind", ["native", "ctypes"])
def test_library_decode_agrees_with_the_mlir_launcher_bit_for_bit(kind, monkeypatch, rng):
    torch = pytest.importorskip("torch")
    from kiln.kernels.attention import combine, decode, decode_attention

    torch.manual_seed(int(rng.integers(2 ** 31)))
    B, Hkv, group, D, page, L = 2, 2, 4, 128, 64, 1500
    pages = -(-L // page)
    kc = torch.randn(B * pages, page, Hkv, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.randperm(B * pages, device="cuda").view(B, pages).int()
    lens = torch.tensor([L, L - 333], device="cuda", dtype=torch.int32)
    q = torch.randn(B, 1, Hkv * group, D, device="cuda", dtype=torch.bfloat16)

    def results():
        partials = decode(q, kc, vc, table, lens)
        merged = combine(*partials, max_splits=partials[0].shape[0])
        return (*merged, *decode_attention(q, kc, vc, table, lens, fused_combine=True),
                *decode_attention(q, kc, vc, table, lens, fused_combine=False))

    _use_launcher(monkeypatch, "mlir")
    want = results()
    _use_launcher(monkeypatch, kind)
    for _ in range(2):  # the first call plans and binds, the second is a repeat
        got = results()
        for w, g in zip(want, got):
            assert torch.equal(w, g)
    assert_paged_attention_close(got[0], got[1], q, kc, vc, table, lens)


def test_dynamic_shared_memory_beyond_48k_launches_through_the_driver(monkeypatch, rng):
    """The dynamic shared-memory attribute is set once at load, not per launch."""
    torch = pytest.importorskip("torch")
    from kiln.kernels.attention import decode_attention

    _use_launcher(monkeypatch, "native")
    torch.manual_seed(int(rng.integers(2 ** 31)))
    kc = torch.randn(40, 64, 8, 128, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.randperm(40, device="cuda").view(1, 40).int()
    lens = torch.tensor([40 * 64 - 5], device="cuda", dtype=torch.int32)
    q = torch.randn(1, 1, 64, 128, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        o, lse = decode_attention(q, kc, vc, table, lens)
        torch.cuda.synchronize()
        assert_paged_attention_close(o, lse, q, kc, vc, table, lens)
        q = torch.randn_like(q)


@pytest.mark.parametrize("fused", [True, False])
def test_decode_attention_into_given_outputs_allocates_nothing_and_matches(fused, rng):
    """out= / lse_out= on the bound paths: the caller's tensors are written (poisoned first)
    and returned, equal to a fresh call's outputs; a misaligned or mis-shaped one is refused."""
    torch = pytest.importorskip("torch")
    from kiln.kernels.attention import decode_attention

    torch.manual_seed(int(rng.integers(2 ** 31)))
    kc = torch.randn(30, 64, 2, 128, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.randperm(30, device="cuda").view(1, 30).int()
    lens = torch.tensor([30 * 64 - 17], device="cuda", dtype=torch.int32)
    out = torch.empty(1, 1, 16, 128, device="cuda", dtype=torch.bfloat16)
    lse_out = torch.empty(1, 1, 16, device="cuda")
    for _ in range(3):
        q = torch.randn(1, 1, 16, 128, device="cuda", dtype=torch.bfloat16)
        out.fill_(float("nan"))
        lse_out.fill_(float("nan"))
        o, lse = decode_attention(q, kc, vc, table, lens, fused_combine=fused, out=out,
                                  lse_out=lse_out)
        want, want_lse = decode_attention(q, kc, vc, table, lens, fused_combine=fused)
        assert o is out and lse is lse_out
        assert torch.equal(out, want) and torch.equal(lse_out, want_lse)
    assert_paged_attention_close(out, lse_out, q, kc, vc, table, lens)
    odd = torch.empty(out.numel() + 1, device="cuda", dtype=torch.bfloat16)[1:].view(out.shape)
    for name, bad in (("out", odd), ("lse_out", torch.empty(1, 16, device="cuda"))):
        with pytest.raises(kiln.KilnValueError, match=f"{name} must be"):
            decode_attention(q, kc, vc, table, lens, fused_combine=fused, **{name: bad})
