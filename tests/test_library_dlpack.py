"""Arrays of other libraries in the library entry points (kernels/dlpack.py): recognised by
DLPack, viewed as torch tensors without a copy, results handed back in the caller's library.

No GPU here, so these run the CPU side of the protocol: ``DEVICE_TYPES`` is widened to DLPack's
CPU device, which makes a CPU exporter take the path a CUDA one takes (``torch.from_dlpack``
views, the interpreter instead of a launch). A stand-in exporter over numpy memory shows the
views share memory (``out=`` writes land in it); JAX CPU arrays come back as JAX arrays.
tests/test_gpu_dlpack.py runs cupy arrays on a GPU."""

import os

import ml_dtypes
import numpy as np
import pytest

from attention_reference import assert_attention_close, random_qkv
from kiln.arrays import describe_array
from kiln.kernels import dlpack
from kiln.kernels.attention import combine, prefill
from kiln.kernels.gemm import matmul

torch = pytest.importorskip("torch")
# A CUDA build of JAX would otherwise take most of the GPU at its first array.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

CPU = 1  # kDLCPU


class Exporter:
    """An array of an unknown library, seen only through the DLPack protocol."""

    def __init__(self, array: np.ndarray):
        self.array = array
        self.shape, self.dtype = array.shape, array.dtype

    def __dlpack__(self, stream=None, **_):
        return self.array.__dlpack__()

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


@pytest.fixture
def cpu_is_a_device(monkeypatch):
    monkeypatch.setattr(dlpack, "DEVICE_TYPES", frozenset({CPU}))


def test_only_exporters_of_other_libraries_are_foreign(cpu_is_a_device):
    x = np.zeros(4, np.float32)
    assert dlpack.foreign(Exporter(x))
    assert not dlpack.foreign(x) and not dlpack.foreign(torch.from_numpy(x))
    assert not dlpack.foreign([1.0]) and not dlpack.foreign(None)


def test_host_exporters_are_not_foreign_by_default():
    """Only CUDA memory is taken through torch; a host exporter keeps the host path."""
    assert not dlpack.foreign(Exporter(np.zeros(4, np.float32)))


def test_views_share_the_exporters_memory(cpu_is_a_device):
    """The entry point sees torch views of the exporter's memory (what it writes lands
    there); its results come back as the library's arrays (torch tensors for an unknown one)."""
    memory = np.arange(6, dtype=np.float32)

    def entry(x, *, scale):
        x.mul_(scale)
        return x, x.sum()

    x, total = dlpack.through_torch(entry, Exporter(memory), scale=2.0)
    np.testing.assert_array_equal(memory, 2 * np.arange(6))
    assert isinstance(x, torch.Tensor) and x.data_ptr() == memory.ctypes.data
    assert float(total) == 30.0


def test_combine_takes_exporters(rng, cpu_is_a_device):
    splits, shape = 3, (2, 1, 4)
    o_p = rng.standard_normal((splits, *shape, 64)).astype(np.float32)
    lse_p = (3 * rng.standard_normal((splits, *shape))).astype(np.float32)
    counts = rng.integers(1, splits + 1, shape).astype(np.int32)
    o, lse_out = combine(*(Exporter(a) for a in (o_p, lse_p, counts)), max_splits=4,
                         out_dtype="f32", backend="interpret")
    lse = np.where(np.arange(splits)[:, None, None, None] < counts, lse_p, -np.inf)
    m = lse.max(axis=0)
    w = np.exp(lse.astype(np.float64) - m)
    want = (w[..., None] * o_p).sum(axis=0) / w.sum(axis=0)[..., None]
    np.testing.assert_allclose(np.asarray(o), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse_out), m + np.log(w.sum(axis=0)), rtol=1e-5,
                               atol=1e-5)


def test_prefill_takes_exporters(rng, cpu_is_a_device):
    q, k, v, _, _ = random_qkv(rng, batch=2, sq=19, sk=37, hq=2, hkv=1, d=64,
                               dtype=np.float16)
    o, lse = prefill(*(Exporter(x) for x in (q, k, v)), causal=True, return_lse=True,
                     backend="interpret")
    assert isinstance(o, torch.Tensor) and o.dtype == torch.float16
    assert_attention_close(o, q, k, v, lse=lse, causal=True)


def _on_jax_cpu(jax, x):
    """``x`` as a JAX array in host memory (a CUDA build of JAX defaults to the GPU)."""
    return jax.device_put(x, jax.devices("cpu")[0])


def test_jax_arrays_come_back_as_jax_arrays(rng, cpu_is_a_device):
    """JAX CPU arrays through matmul and a ragged prefill: the results are JAX arrays
    holding the float64 reference's values."""
    jax = pytest.importorskip("jax")
    a = rng.standard_normal((33, 64)).astype(np.float16)
    b = rng.standard_normal((64, 40)).astype(np.float16)
    c = matmul(_on_jax_cpu(jax, a), _on_jax_cpu(jax, b), out_dtype="f32", backend="interpret")
    assert type(c).__module__.split(".")[0] in ("jax", "jaxlib")
    np.testing.assert_allclose(np.asarray(c), a.astype(np.float64) @ b, rtol=2e-3, atol=2e-3)
    q, k, v, cu_q, cu_k = random_qkv(rng, batch=3, sq=None, sk=None, hq=2, hkv=2, d=64,
                                     ragged_q=[5, 0, 17], ragged_k=[9, 3, 17],
                                     dtype=np.float16)
    o = prefill(*(_on_jax_cpu(jax, x) for x in (q, k, v)), cu_seqlens_q=_on_jax_cpu(jax, cu_q),
                cu_seqlens_k=_on_jax_cpu(jax, cu_k), max_seqlen_q=17, max_seqlen_k=17,
                backend="interpret")
    assert type(o).__module__.split(".")[0] in ("jax", "jaxlib")
    assert_attention_close(np.asarray(o), q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def test_jax_cpu_arrays_are_described_through_dlpack(rng):
    """Kiln's own reading of a DLPack capsule (kiln.arrays): a JAX CPU array's shape, strides,
    dtype and address, in host memory (a launch refuses it, naming the argument)."""
    jax = pytest.importorskip("jax")
    x = _on_jax_cpu(jax, rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16))
    info = describe_array(x)
    assert (info.dtype.name, info.shape, info.strides, info.on_device) == \
        ("bf16", (3, 5), (5, 1), False)
    assert info.data_ptr == x.unsafe_buffer_pointer()
