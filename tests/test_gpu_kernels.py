"""DSL kernels launched on a CUDA GPU (marker ``gpu``): numpy, torch and strided arguments.

Fresh random inputs every run, outputs poisoned with NaN before launch, float64 references.
"""

import numpy as np
import pytest
from sample_kernels import (check_split_sum, check_take_tickets, saxpy, scale_rows, split_sum,
                            split_sum_problem, sum_after_wait, take_tickets, take_tickets_problem)
from source_modules import load_example

import kiln
from kiln import f32
from kiln.runtime.cuda import cuda_available
from kiln.shared import dynamic_shared

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and driver")]


def test_saxpy_numpy_all_sizes(rng):
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


def test_demo_rms_norm_matches_float64(rng):
    demo = load_example("demo")
    rows, cols = 300, 257
    x, w, y = demo.random_inputs(rng, rows, cols)
    demo.rms_norm[((rows + 127) // 128,)](x, w, y, rows, cols, 1e-6, BLOCK=128, target="sm_90a")
    ref = demo.reference(x, w, 1e-6)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)  # elementwise, not a norm


@kiln.kernel
def static_beside_dynamic(x: kiln.Tensor[f32, 1], fill: kiln.Tensor[f32, 1],
                          out: kiln.Tensor[f32, 1], STATIC: kiln.constexpr,
                          DYNAMIC: kiln.constexpr):
    """Writes x into a static tile and ``fill`` over a whole dynamic buffer, then reads the
    static tile back: any overlap of the two regions shows in ``out``."""
    tid = kiln.thread_id(0)
    static = kiln.shared((STATIC,), f32)
    barriers = kiln.mbarrier.group(num_barriers=2)
    dynamic = dynamic_shared((DYNAMIC,), f32, align=1024)
    for s in kiln.static_range(2):
        barriers.init(s, count=1, predicate=tid == 0)
    for k in kiln.static_range(STATIC // 128):
        static[tid + 128 * k] = x[tid + 128 * k]
    kiln.barrier()
    for k in kiln.static_range(DYNAMIC // 128):
        dynamic[tid + 128 * k] = fill[tid + 128 * k]
    kiln.barrier()
    for k in kiln.static_range(STATIC // 128):
        out[tid + 128 * k] = static[tid + 128 * k]


def test_dynamic_shared_memory_does_not_overlap_static_buffers(rng):
    """Regression: upstream lowers gpu.dynamic_shared_memory to an internal one-byte global and
    ptxas placed kiln.shared tiles inside the dynamic region (kiln-extern-dynamic-shared)."""
    static, dynamic = 1024, 16384
    x = rng.standard_normal(static).astype(np.float32)
    fill = rng.standard_normal(dynamic).astype(np.float32)
    out = np.full(static, np.nan, np.float32)
    static_beside_dynamic[(1,)](x, fill, out, target="sm_90a", num_warps=4, STATIC=static,
                                DYNAMIC=dynamic)
    np.testing.assert_array_equal(out, x)



@pytest.mark.parametrize("n", [300, 100_000])
def test_atomics_last_cta_reduces_twice(n, rng):
    """Two launches: the second only works if the first's last CTA reset the counter."""
    for _ in range(2):
        ctas, args, expected = split_sum_problem(rng, n)
        split_sum[(ctas,)](*args, n, BLOCK=128, num_warps=4, target="sm_90a")
        check_split_sum(args, expected)


def test_ctas_that_wait_for_count_see_every_ctas_stores(rng):
    """Every CTA sums what all CTAs stored before their tickets, so each must have waited for
    the last ticket and then read the others' stores. Three launches share the counter, which
    only grows: the targets come from the ticket, not from a reset."""
    ctas = 64
    counters = np.zeros(1, np.int64)
    for launch in range(3):
        x = rng.standard_normal(ctas).astype(np.float32)
        out = np.full(ctas, np.nan, np.float32)
        sum_after_wait[(ctas,)](x, np.full(ctas, np.nan, np.float32), counters, out,
                                num_warps=1, target="sm_90a")
        bound = ctas * np.finfo(np.float32).eps * 2 * np.abs(x).sum()
        np.testing.assert_allclose(out, 2 * x.astype(np.float64).sum(), rtol=0, atol=bound)
        assert counters[0] == ctas * (launch + 1)


def test_atomics_return_the_old_value_on_the_gpu(rng):
    args = take_tickets_problem(rng, 5000)
    take_tickets[(-(-5000 // 128),)](*args, BLOCK=128, num_warps=4, target="sm_90a")
    check_take_tickets(args)
