"""``kernel[grid](...)`` on a Hopper GPU: the generated launcher's results, streams, CUDA-graph
capture, and zero-copy arrays from cupy (``__cuda_array_interface__`` and DLPack) and JAX.

Every output is poisoned before the launch and compared with a float64 reference on fresh
random inputs; the launches after the first take the generated launcher.
"""

import numpy as np
import pytest

import kiln
from kiln import f32, i32
from kiln.runtime.cuda import cuda_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and driver")]

BLOCK = 256


@kiln.kernel(num_threads="BLOCK")
def axpy(x: kiln.Tensor[f32], y: kiln.Tensor[f32], out: kiln.Tensor[f32], n: i32, a: f32,
         BLOCK: kiln.constexpr):
    i = kiln.block_id(0) * kiln.block_dim(0) + kiln.thread_id(0)
    if i < n:
        out[i] = a * x[i] + y[i]


def _grid(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK


def _expected(x, y, a):
    return a * np.asarray(x, np.float64) + np.asarray(y, np.float64)


def test_repeat_launches_on_torch_tensors_match_the_reference(rng):
    torch = pytest.importorskip("torch")
    for n in (1000, 1000, 4096 + 7, 1000):
        x, y = (torch.from_numpy(rng.standard_normal(n).astype(np.float32)).cuda()
                for _ in range(2))
        out = torch.full((n,), float("nan"), device="cuda")
        a = float(rng.standard_normal())
        axpy[_grid(n)](x, y, out, n, a, BLOCK=BLOCK)
        torch.cuda.synchronize()
        np.testing.assert_allclose(out.cpu().numpy(), _expected(x.cpu(), y.cpu(), a),
                                   rtol=1e-6, atol=1e-6)
    assert all(entry.fast for entry in axpy._launches.values())


def test_launches_follow_the_current_and_the_given_stream(rng):
    torch = pytest.importorskip("torch")
    n = 1 << 16
    x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    axpy[_grid(n)](x, y, torch.empty_like(x), n, 1.0, BLOCK=BLOCK)  # the generated launcher
    for explicit in (False, True):
        out = torch.full((n,), float("nan"), device="cuda")
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            # A launch on any other stream would run before the delayed copy, which would then
            # overwrite its result.
            torch.cuda._sleep(20_000_000)
            out.copy_(x)
        if explicit:
            axpy[_grid(n)](out, y, out, n, 0.5, BLOCK=BLOCK, stream=stream)
        else:
            with torch.cuda.stream(stream):
                axpy[_grid(n)](out, y, out, n, 0.5, BLOCK=BLOCK)
        stream.synchronize()
        torch.testing.assert_close(out, 0.5 * x + y)


def test_kernel_launch_replays_in_a_cuda_graph(rng):
    torch = pytest.importorskip("torch")
    n = 5000
    x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    out = torch.empty_like(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile, then the generated launcher: nothing left to set up
            axpy[_grid(n)](x, y, out, n, 2.0, BLOCK=BLOCK)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        axpy[_grid(n)](x, y, out, n, 2.0, BLOCK=BLOCK)
    for _ in range(3):
        x.copy_(torch.from_numpy(rng.standard_normal(n).astype(np.float32)))
        y.copy_(torch.from_numpy(rng.standard_normal(n).astype(np.float32)))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        np.testing.assert_allclose(out.cpu().numpy(), _expected(x.cpu(), y.cpu(), 2.0),
                                   rtol=1e-6, atol=1e-6)


class _OnlyDLPack:
    """A cupy array seen only through ``__dlpack__`` (as JAX and array-API libraries export)."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, stream=None):
        return self._array.__dlpack__()

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


@pytest.mark.parametrize("via", ["cuda_array_interface", "dlpack"])
def test_cupy_arrays_are_passed_zero_copy(via, rng):
    cupy = pytest.importorskip("cupy")
    n = 3000
    host_x, host_y = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    x, y = cupy.asarray(host_x), cupy.asarray(host_y)
    out = cupy.full(n, np.nan, np.float32)
    wrap = _OnlyDLPack if via == "dlpack" else (lambda array: array)
    stream = cupy.cuda.Stream(non_blocking=True)
    for _ in range(2):
        out.fill(np.nan)
        cupy.cuda.Device().synchronize()
        axpy[_grid(n)](wrap(x), wrap(y), wrap(out), n, 1.5, BLOCK=BLOCK, stream=stream)
        stream.synchronize()
        np.testing.assert_allclose(cupy.asnumpy(out), _expected(host_x, host_y, 1.5),
                                   rtol=1e-6, atol=1e-6)


def test_jax_arrays_are_read_zero_copy(rng):
    jax = pytest.importorskip("jax")
    torch = pytest.importorskip("torch")
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        pytest.skip("jax has no GPU backend here")
    n = 2000
    host_x, host_y = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    x, y = (jax.device_put(v, gpus[0]) for v in (host_x, host_y))
    x.block_until_ready()
    y.block_until_ready()
    out = torch.full((n,), float("nan"), device="cuda")
    axpy[_grid(n)](x, y, out, n, -0.5, BLOCK=BLOCK)
    torch.cuda.synchronize()
    np.testing.assert_allclose(out.cpu().numpy(), _expected(host_x, host_y, -0.5),
                               rtol=1e-6, atol=1e-6)
