"""The CPU interpreter runs the project's kernels and matches float64 numpy references.

Fresh random inputs every run, outputs poisoned with NaN, sizes that are not multiples of the
block. No GPU needed: ``kernel.interpret[grid](...)`` executes the traced Kiln IR with numpy.
"""


import ml_dtypes
import numpy as np
import pytest
from sample_kernels import (check_split_sum, check_take_tickets, row_stats, saxpy, scale_rows,
                            split_sum, split_sum_problem, take_tickets, take_tickets_problem)
from source_modules import load_example

import kiln
from kiln import f16, f32, i32, mbarrier




@pytest.mark.parametrize("n", [1, 1000, 4099])
def test_saxpy(n):
    rng = np.random.default_rng()
    x = rng.standard_normal(n).astype(np.float32)
    y = rng.standard_normal(n).astype(np.float32)
    expected = 2.5 * x.astype(np.float64) + y
    saxpy.interpret[((n + 255) // 256,)](x, y, n, 2.5, BLOCK=256, num_warps=8)
    np.testing.assert_allclose(y, expected, rtol=1e-6, atol=1e-6)


@kiln.kernel
def branches(x: kiln.Tensor[f32], out: kiln.Tensor[f32], n: i32):
    """if/elif/else yielding two values, a masked load with other=, per thread."""
    i = kiln.block_id(0) * kiln.block_dim(0) + kiln.thread_id(0)
    v = x.load(i, mask=i < n, other=-7.0)
    if v > 0.5:
        a = v * 2.0
        b = 1.0
    elif v > -0.5:
        a = v + 10.0
        b = 2.0
    else:
        a = -v
        b = 3.0
    if i < n + 5:
        out[i] = a * b


def test_divergent_branches_and_masked_load():
    rng = np.random.default_rng()
    n = 97
    x = rng.standard_normal(n).astype(np.float32)
    out = np.full(n + 5, np.nan, np.float32)
    branches.interpret[(2,)](x, out, n, num_warps=2)
    xv = np.concatenate([x, np.full(5, -7.0, np.float32)]).astype(np.float64)
    expected = np.where(xv > 0.5, xv * 2, np.where(xv > -0.5, (xv + 10) * 2, -xv * 3))
    np.testing.assert_allclose(out, expected, rtol=1e-6)


@kiln.kernel
def prefix_sums(x: kiln.Tensor[f32], out: kiln.Tensor[f32], counts: kiln.Tensor[i32], n: i32):
    """Thread t sums x[0 : t % 7 * 3 : 2] — a loop with per-thread bounds, a carried tuple and a
    running max under a divergent if."""
    t = kiln.thread_id(0)
    stop = (t % 7) * 3
    pair = (0.0, 0)
    best = -1.0e30
    for j in kiln.range(0, stop, 2):
        v = x[j]
        pair = (pair[0] + v, pair[1] + 1)
        if v > best:
            best = v
    if t < n:
        out[t] = pair[0] + kiln.where(best > -1.0e29, best, 0.0)
        counts[t] = pair[1]


def test_loop_with_per_thread_bounds_and_carried_values():
    rng = np.random.default_rng()
    n = 50
    x = rng.standard_normal(32).astype(np.float32)
    out = np.full(n, np.nan, np.float32)
    counts = np.full(n, -1, np.int32)
    prefix_sums.interpret[(1,)](x, out, counts, n, num_warps=2)
    stops = (np.arange(n) % 7) * 3
    x64 = x.astype(np.float64)
    expected = [x64[0:s:2].sum() + (x64[0:s:2].max() if s else 0.0) for s in stops]
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(counts, [len(range(0, s, 2)) for s in stops])


def test_struct_shared_memory_and_barrier():
    rng = np.random.default_rng()
    x = rng.standard_normal((5, 37)).astype(np.float32)
    out = np.full((5, 2), np.nan, np.float32)
    row_stats.interpret[(5,)](x, out, 37, num_warps=1)
    np.testing.assert_allclose(out[:, 0], x.max(axis=1))
    # An f32 sum of n terms is off by at most about n·eps·Σ|x|; rtol alone fails on rows whose
    # terms cancel.
    bound = x.shape[1] * np.finfo(np.float32).eps * np.abs(x).astype(np.float64).sum(axis=1)
    np.testing.assert_array_less(np.abs(out[:, 1] - x.astype(np.float64).sum(axis=1)), bound)


def test_bf16_strided_view():
    rng = np.random.default_rng()
    rows, cols = 33, 70
    base = rng.standard_normal((rows, 2 * cols)).astype(ml_dtypes.bfloat16)
    x = base[:, ::2]
    out = np.full((rows, cols), np.nan, np.float32)
    scale_rows.interpret[(rows,)](x, out, rows, cols, num_warps=2)
    expected = x.astype(np.float64) * np.arange(1, rows + 1)[:, None]
    np.testing.assert_allclose(out, expected)


@kiln.kernel
def vector_copy_scaled(x: kiln.Tensor[f16, 2], out: kiln.Tensor[f16, 2], rows: i32):
    """8-wide vector loads along the last dim through a shared tile, then vector stores."""
    tile = kiln.shared((64, 8), f16)
    r = kiln.block_id(0) * 64 + kiln.thread_id(0)
    if r < rows:
        tile.store(kiln.thread_id(0), 0, x.load(r, 0, width=8) * 2.0)
    kiln.barrier()
    if r < rows:
        out.store(r, 0, tile.load(kiln.thread_id(0), 0, width=8))


def test_vector_loads_through_shared_memory():
    rng = np.random.default_rng()
    rows = 100
    x = rng.standard_normal((rows, 8)).astype(np.float16)
    out = np.full_like(x, np.nan)
    vector_copy_scaled.interpret[(2,)](x, out, rows, num_warps=2)
    np.testing.assert_array_equal(out, x * np.float16(2))


def test_demo_rms_norm():
    demo = load_example("demo")
    rng = np.random.default_rng()
    rows, cols = 300, 257
    x, w, y = demo.random_inputs(rng, rows, cols)
    demo.rms_norm.interpret[((rows + 127) // 128,)](x, w, y, rows, cols, 1e-6, BLOCK=128)
    ref = demo.reference(x, w, 1e-6)
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-6


def test_hopper_tma_wgmma_smoke():
    smoke = load_example("hopper_tma_wgmma_smoke")
    a, b, c = smoke.reference_inputs(seed=int(np.random.default_rng().integers(1 << 30)))
    smoke.tma_wgmma_smoke.interpret[(1,)](a, b, c, target="sm_90a", num_warps=4)
    assert smoke.relative_error(c, a, b) < 1e-6


@kiln.kernel
def producer_consumer(x: kiln.Tensor[f32], out: kiln.Tensor[f32]):
    """Warp group 1 produces into shared memory and arrives on an mbarrier; warp group 0 waits
    on it (blocking inside a warp-group-uniform branch), then consumes."""
    t = kiln.thread_id(0)
    buf = kiln.shared((128,), f32)
    bars = mbarrier.group(num_barriers=1)
    bars.init(0, count=128, predicate=t == 0)
    kiln.barrier()
    if t >= 128:
        buf[t - 128] = x[t - 128] * 3.0
        bars.arrive(0)
    else:
        bars.try_wait(0, phase=0)
        out[t] = buf[t] + 1.0


def test_warp_specialised_producer_consumer():
    rng = np.random.default_rng()
    x = rng.standard_normal(128).astype(np.float32)
    out = np.full(128, np.nan, np.float32)
    producer_consumer.interpret[(1,)](x, out, num_warps=8)
    np.testing.assert_allclose(out, x.astype(np.float64) * 3 + 1, rtol=1e-6, atol=1e-6)


def test_amd_target_traces_and_runs_with_64_lane_warps():
    rng = np.random.default_rng()
    n = 300
    x = rng.standard_normal(n).astype(np.float32)
    y = rng.standard_normal(n).astype(np.float32)
    expected = -1.5 * x.astype(np.float64) + y
    saxpy.interpret[((n + 127) // 128,)](x, y, n, -1.5, BLOCK=128, num_warps=2, target="gfx950")
    np.testing.assert_allclose(y, expected, rtol=1e-6, atol=1e-6)


@kiln.kernel
def attention_rows(q: kiln.Tensor[f32, 2], k: kiln.Tensor[f32, 2], v: kiln.Tensor[f32, 2],
                   o: kiln.Tensor[f32, 2], rows: i32, keys: i32, D: kiln.constexpr):
    """Naive attention, one thread per query row: online softmax over keys, D-wide vector
    accumulator (vector.load, broadcast, math.exp, loop-carried vectors, masked tail rows)."""
    row = kiln.block_id(0) * kiln.block_dim(0) + kiln.thread_id(0)
    if row < rows:
        m = kiln.cast(-1.0e30, f32)
        total = kiln.cast(0.0, f32)
        acc = v.load(0, 0, width=D) * 0.0
        for j in kiln.range(keys):
            s = kiln.cast(0.0, f32)
            for d in kiln.static_range(D):
                s = s + q[row, d] * k[j, d]
            m_new = kiln.maximum(m, s)
            p = kiln.exp(s - m_new)
            alpha = kiln.exp(m - m_new)
            total = total * alpha + p
            acc = acc * alpha + v.load(j, 0, width=D) * p
            m = m_new
        o.store(row, 0, acc / total)


def test_online_softmax_attention_rows():
    rng = np.random.default_rng()
    rows, keys, d = 150, 37, 16
    q = rng.standard_normal((rows, d)).astype(np.float32)
    k, v = (rng.standard_normal((keys, d)).astype(np.float32) for _ in range(2))
    o = np.full_like(q, np.nan)
    attention_rows.interpret[(2,)](q, k, v, o, rows, keys, D=d, num_warps=4)
    s = q.astype(np.float64) @ k.T.astype(np.float64)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    np.testing.assert_allclose(o, p / p.sum(axis=1, keepdims=True) @ v, rtol=1e-4, atol=1e-5)


@pytest.mark.lower
@pytest.mark.slow
def test_attention_demo_runs_without_a_gpu(monkeypatch, capsys):
    """``make demo``: compiles both vendors' prefill and checks it in the interpreter here."""
    demo = load_example("attention_demo")
    monkeypatch.setattr(demo, "cuda_available", lambda: False)
    assert demo.main() == 0
    out = capsys.readouterr().out
    assert "== prefill for sm_90a" in out and "== prefill for gfx950" in out
    assert out.count("-> OK") == 2


@pytest.mark.parametrize("n", [1, 300, 1000])
def test_atomics_last_cta_reduces(n):
    ctas, args, expected = split_sum_problem(np.random.default_rng(), n)
    split_sum.interpret[(ctas,)](*args, n, BLOCK=128, num_warps=4)
    check_split_sum(args, expected)


def test_atomics_return_the_old_value():
    args = take_tickets_problem(np.random.default_rng(), 200)
    take_tickets.interpret[(2,)](*args, BLOCK=128, num_warps=4)
    check_take_tickets(args)
