"""Library entry points on a GPU with cupy and JAX arrays (zero-copy through DLPack, results in
the caller's library, ordered after the producer's stream) and on torch's current stream.

Every result is checked against a float64 reference on fresh random inputs; outputs land in
NaN-poisoned memory. f16 throughout: cupy has no bfloat16.
"""

import os

import numpy as np
import pytest

from attention_reference import assert_attention_close, poison_cuda_pool, random_qkv
from gemm_reference import assert_matmul_close
from kiln.kernels.attention import combine, prefill
from kiln.kernels.gemm import grouped_matmul, matmul
from kiln.runtime.cuda import cuda_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and driver")]


@pytest.fixture
def cupy():
    torch = pytest.importorskip("torch")  # the entry points view cupy arrays as torch tensors
    cp = pytest.importorskip("cupy")
    poison_cuda_pool(torch, 1 << 24)  # the outputs are torch's allocations, viewed by cupy
    return cp


@pytest.fixture
def jax_gpu():
    """JAX and its first GPU, where this JAX build has one."""
    pytest.importorskip("torch")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU
    jax = pytest.importorskip("jax")
    try:
        return jax, jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("this JAX build has no GPU backend")


def test_entry_points_take_jax_gpu_arrays(rng, jax_gpu):
    """JAX CUDA arrays into matmul and a ragged prefill: results come back as JAX arrays on
    the same GPU, equal to the float64 references."""
    jax, gpu = jax_gpu
    a = rng.standard_normal((200, 64)).astype(np.float16)
    b = rng.standard_normal((64, 72)).astype(np.float16)
    c = matmul(jax.device_put(a, gpu), jax.device_put(b, gpu))
    assert isinstance(c, jax.Array) and c.devices() == {gpu}
    assert_matmul_close(np.asarray(c), a, b)
    q, k, v, cu_q, cu_k = random_qkv(rng, batch=3, sq=None, sk=None, hq=4, hkv=2, d=64,
                                     ragged_q=[33, 0, 7], ragged_k=[40, 5, 90],
                                     dtype=np.float16)
    o = prefill(*(jax.device_put(x, gpu) for x in (q, k, v)),
                cu_seqlens_q=jax.device_put(cu_q, gpu), cu_seqlens_k=jax.device_put(cu_k, gpu),
                max_seqlen_q=33, max_seqlen_k=90, causal=True)
    assert isinstance(o, jax.Array) and o.devices() == {gpu}
    assert_attention_close(np.asarray(o), q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                           causal=True)


def _is_cupy(*arrays):
    return all(type(a).__module__.startswith("cupy") for a in arrays)


def test_prefill_takes_cupy_arrays(rng, cupy):
    q, k, v, _, _ = random_qkv(rng, batch=2, sq=70, sk=131, hq=4, hkv=2, d=64,
                               dtype=np.float16)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:  # produced on a side stream: the launch must wait for it
        dev = [cupy.asarray(x) * 1 for x in (q, k, v)]
        o, lse = prefill(*dev, causal=True, return_lse=True)
    stream.synchronize()
    assert _is_cupy(o, lse) and o.dtype == np.float16 and o.shape == q.shape
    assert_attention_close(cupy.asnumpy(o), q, k, v, lse=cupy.asnumpy(lse), causal=True)


def test_ragged_prefill_takes_cupy_prefix_sums(rng, cupy):
    q, k, v, cu_q, cu_k = random_qkv(rng, batch=3, sq=None, sk=None, hq=4, hkv=1, d=128,
                                     ragged_q=[65, 0, 3], ragged_k=[1, 90, 200],
                                     dtype=np.float16)
    o = prefill(*(cupy.asarray(x) for x in (q, k, v)),
                cu_seqlens_q=cupy.asarray(cu_q), cu_seqlens_k=cupy.asarray(cu_k),
                max_seqlen_q=65, max_seqlen_k=200)
    cupy.cuda.Device().synchronize()
    assert _is_cupy(o)
    assert_attention_close(cupy.asnumpy(o), q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def test_gemms_take_cupy_arrays(rng, cupy):
    a = rng.standard_normal((200, 64)).astype(np.float16)
    b = rng.standard_normal((64, 72)).astype(np.float16)
    c = matmul(cupy.asarray(a), cupy.asarray(b))
    cupy.cuda.Device().synchronize()
    assert _is_cupy(c) and c.dtype == np.float16
    assert_matmul_close(cupy.asnumpy(c), a.astype(np.float64), b.astype(np.float64))
    w = rng.standard_normal((3, 64, 48)).astype(np.float16)
    offs = np.array([0, 70, 70, 200], np.int32)
    c = grouped_matmul(cupy.asarray(a), cupy.asarray(w), cupy.asarray(offs), out_dtype="f32")
    cupy.cuda.Device().synchronize()
    assert _is_cupy(c)
    host = cupy.asnumpy(c)
    for g in (0, 2):
        rows = slice(offs[g], offs[g + 1])
        assert_matmul_close(host[rows], a[rows].astype(np.float64), w[g].astype(np.float64))


def test_combine_takes_cupy_arrays(rng, cupy):
    splits, shape = 4, (2, 1, 8)
    o_p = rng.standard_normal((splits, *shape, 64)).astype(np.float32)
    lse_p = (3 * rng.standard_normal((splits, *shape))).astype(np.float32)
    counts = rng.integers(1, splits + 1, shape).astype(np.int32)
    o, lse = combine(*(cupy.asarray(x) for x in (o_p, lse_p, counts)), max_splits=8,
                     out_dtype="f32")
    cupy.cuda.Device().synchronize()
    assert _is_cupy(o, lse)
    live = np.where(np.arange(splits)[:, None, None, None] < counts, lse_p, -np.inf)
    m = live.max(axis=0)
    w = np.exp(live.astype(np.float64) - m)
    want = (w[..., None] * o_p).sum(axis=0) / w.sum(axis=0)[..., None]
    np.testing.assert_allclose(cupy.asnumpy(o), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cupy.asnumpy(lse), m + np.log(w.sum(axis=0)), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("entry", ["prefill", "matmul"])
def test_entry_points_launch_on_the_current_torch_stream(rng, entry):
    """The input is written on a side stream after a 20 ms sleep; the call under that stream
    sees the new values only if it launches there (any other stream runs first)."""
    torch = pytest.importorskip("torch")
    if entry == "prefill":
        x = [torch.from_numpy(t).cuda() for t in random_qkv(
            rng, batch=1, sq=64, sk=64, hq=2, hkv=2, d=64, dtype=np.float16)[:3]]
    else:
        x = [torch.randn(128, 64, device="cuda", dtype=torch.float16),
             torch.randn(64, 64, device="cuda", dtype=torch.float16)]
    fresh = torch.randn_like(x[0])
    run = {"prefill": lambda *t: prefill(*t, causal=True), "matmul": matmul}[entry]
    run(*x)  # compile, tune and bind first
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(20_000_000)
        x[0].copy_(fresh)
        out = run(*x)
    stream.synchronize()
    host = [t.double().cpu().numpy() for t in x]
    if entry == "prefill":
        assert_attention_close(out, *host, causal=True)
    else:
        assert_matmul_close(out, *host)
