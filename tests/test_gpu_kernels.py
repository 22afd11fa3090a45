"""DSL kernels launched on a CUDA GPU (marker ``gpu``): numpy, torch and strided arguments.

Fresh random inputs every run, outputs poisoned with NaN before launch, float64 references.
"""

import numpy as np
import pytest
from source_modules import load_example

import kiln
from kiln import bf16, f32, i32
from kiln.lowering.cuda import cuda_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and driver")]


@kiln.kernel
def saxpy(x: kiln.Tensor[f32], y: kiln.Tensor[f32], n: i32, a: f32, BLOCK: kiln.constexpr):
    i = kiln.block_id(0) * BLOCK + kiln.thread_id(0)
    if i < n:
        y[i] = a * x[i] + y[i]


@kiln.kernel
def scale_rows(x: kiln.Tensor[bf16, 2], out: kiln.Tensor[f32, 2], rows: i32, cols: i32):
    """out[r, c] = x[r, c] * (r + 1); x may be a strided (non-contiguous) view."""
    r = kiln.block_id(0)
    for c in kiln.range(kiln.thread_id(0), cols, kiln.block_dim(0)):
        out[r, c] = kiln.cast(x[r, c], f32) * kiln.cast(r + 1, f32)


def test_saxpy_numpy_all_sizes():
    rng = np.random.default_rng()
    for n in (1, 1000, 4099):
        x = rng.standard_normal(n).astype(np.float32)
        y = rng.standard_normal(n).astype(np.float32)
        expected = 2.5 * x.astype(np.float64) + y
        saxpy[((n + 255) // 256,)](x, y, n, 2.5, BLOCK=256, num_warps=8, target="sm_90a")
        np.testing.assert_allclose(y, expected, rtol=1e-6, atol=1e-6)


def test_saxpy_torch_on_a_stream():
    torch = pytest.importorskip("torch")
    n = 10_000
    x = torch.randn(n, device="cuda")
    y = torch.randn(n, device="cuda")
    expected = (1.5 * x.double() + y.double()).cpu()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        saxpy[((n + 127) // 128,)](x, y, n, 1.5, BLOCK=128, num_warps=4, target="sm_90a",
                                   stream=stream)
    stream.synchronize()
    torch.testing.assert_close(y.cpu().double(), expected, rtol=1e-6, atol=1e-6)


def test_bf16_strided_view_torch():
    torch = pytest.importorskip("torch")
    rows, cols = 33, 70
    base = torch.randn(rows, 2 * cols, device="cuda").to(torch.bfloat16)
    x = base[:, ::2]  # innermost stride 2: specialises the kernel on a dynamic stride
    out = torch.full((rows, cols), float("nan"), device="cuda")
    scale_rows[(rows,)](x, out, rows, cols, num_warps=2, target="sm_90a")
    torch.cuda.synchronize()
    factors = torch.arange(1, rows + 1, dtype=torch.float64).unsqueeze(1)
    torch.testing.assert_close(out.cpu().double(), x.cpu().double() * factors)


def test_demo_rms_norm_matches_float64():
    demo = load_example("demo")
    rng = np.random.default_rng()
    rows, cols = 300, 257
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    w = rng.standard_normal(cols).astype(np.float32)
    y = np.full_like(x, np.nan)
    demo.rms_norm[((rows + 127) // 128,)](x, w, y, rows, cols, 1e-6, BLOCK=128, target="sm_90a")
    ref = demo.reference(x, w, 1e-6)
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-5
