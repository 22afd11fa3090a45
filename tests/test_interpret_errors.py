"""Interpreter errors: out-of-bounds accesses, barrier deadlocks, ops without semantics.

Each error is a KilnError subclass at the user's line (file:line, caret, Fix:)."""

import numpy as np
import pytest

import kiln
from kiln import f32, i32, mbarrier
from kiln.kernel import TracedKernel
from kiln.interpreter import interpret_kernel
from kiln.signature import KernelSignature, TensorParam
from kiln.core.targets import get_target


@kiln.kernel
def unmasked_copy(x: kiln.Tensor[f32], y: kiln.Tensor[f32]):
    i = kiln.block_id(0) * kiln.block_dim(0) + kiln.thread_id(0)
    y[i] = x[i]  # @unmasked


def test_global_out_of_bounds_names_index_tensor_and_line(marker_line):
    x = np.random.default_rng().standard_normal(100).astype(np.float32)
    y = np.full(100, np.nan, np.float32)
    with pytest.raises(kiln.core.errors.OutOfBoundsError) as info:
        unmasked_copy.interpret[(2,)](x, y, num_warps=2)
    err = info.value
    assert isinstance(err, IndexError) and err.loc.line == marker_line("@unmasked")
    assert "index (100,) is out of bounds for tensor 'x' of shape (100,)" in err.message
    assert "thread 36 of block (1, 0, 0)" in err.message and "Fix:" in str(err)


def test_bounds_checks_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("KILN_INTERPRET_CHECK_BOUNDS", "0")
    x = np.random.default_rng().standard_normal(64).astype(np.float32)
    y = np.full(64, np.nan, np.float32)
    unmasked_copy.interpret[(1,)](x, y, num_warps=2)
    np.testing.assert_array_equal(y, x)


@kiln.kernel
def shared_overrun(out: kiln.Tensor[f32]):
    buf = kiln.shared((16,), f32)
    t = kiln.thread_id(0)
    buf[t] = kiln.cast(t, f32)  # @shared-overrun
    kiln.barrier()
    out[t] = buf[t]


def test_shared_out_of_bounds(marker_line):
    with pytest.raises(kiln.core.errors.OutOfBoundsError) as info:
        shared_overrun.interpret[(1,)](np.zeros(32, np.float32), num_warps=1)
    err = info.value
    assert err.loc.line == marker_line("@shared-overrun")
    assert "index (16,) is out of bounds for shared buffer" in err.message


@kiln.kernel
def vector_past_the_end(x: kiln.Tensor[f32, 2], out: kiln.Tensor[f32, 2]):
    out.store(0, 0, x.load(0, 2, width=4))  # @vector-overrun


def test_vector_load_past_the_last_dimension(marker_line):
    with pytest.raises(kiln.core.errors.OutOfBoundsError) as info:
        vector_past_the_end.interpret[(1,)](np.ones((2, 5), np.float32),
                                            np.zeros((2, 5), np.float32), num_warps=1)
    assert info.value.loc.line == marker_line("@vector-overrun")
    assert "index (0, 2)" in info.value.message


@kiln.kernel
def miscounted_barrier(x: kiln.Tensor[f32], out: kiln.Tensor[f32], COUNT: kiln.constexpr):
    """Warp group 1 produces; warp group 0 waits for COUNT arrivals (128 is right)."""
    t = kiln.thread_id(0)
    buf = kiln.shared((128,), f32)
    bars = mbarrier.group(num_barriers=1)
    bars.init(0, count=COUNT, predicate=t == 0)
    kiln.barrier()
    if t >= 128:
        buf[t - 128] = x[t - 128]
        bars.arrive(0)
    else:
        bars.try_wait(0, phase=0)  # @consumer-wait
        out[t] = buf[t]


def test_miscounted_mbarrier_between_warp_groups_is_a_deadlock(marker_line):
    x = np.random.default_rng().standard_normal(128).astype(np.float32)
    with pytest.raises(kiln.core.errors.DeadlockError) as info:
        miscounted_barrier.interpret[(1,)](x, np.zeros(128, np.float32), COUNT=129, num_warps=8)
    err = info.value
    assert err.loc.line == marker_line("@consumer-wait")
    assert "still expecting 1 arrivals" in err.message and "Fix:" in str(err)


@kiln.kernel
def barrier_in_one_warp_group(out: kiln.Tensor[f32]):
    t = kiln.thread_id(0)
    bars = mbarrier.group(num_barriers=1)
    bars.init(0, count=1, predicate=t == 0)
    kiln.barrier()
    if t < 128:
        bars.try_wait(0, phase=0)  # @never-arrives
    kiln.barrier()
    out[t] = 1.0


def test_barrier_and_mbarrier_wait_deadlock_names_both(marker_line):
    with pytest.raises(kiln.core.errors.DeadlockError) as info:
        barrier_in_one_warp_group.interpret[(1,)](np.zeros(256, np.float32), num_warps=8)
    message = info.value.message
    assert f":{marker_line('@never-arrives')}" in message and "gpu.barrier" in message


UNSUPPORTED_ASM = """
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    gpu.func @k(%x: memref<?xf32, strided<[1], offset: ?>, 1>) kernel {
      %c0 = arith.constant 0 : index
      %v = memref.load %x[%c0] : memref<?xf32, strided<[1], offset: ?>, 1>
      %a = math.atan %v : f32 loc("user.py":7:5)
      memref.store %a, %x[%c0] : memref<?xf32, strided<[1], offset: ?>, 1>
      gpu.return
    }
  }
}
"""


def test_op_without_semantics_is_unsupported_naming_the_op_and_line():
    sig = KernelSignature("k", (TensorParam("x", "f32", 1),), block=(32, 1, 1))
    traced = TracedKernel("k", UNSUPPORTED_ASM, sig, 0)
    with pytest.raises(kiln.UnsupportedError) as info:
        interpret_kernel(traced, 1, [np.ones(4, np.float32)], get_target("sm_90a"))
    err = info.value
    assert "no semantics for math.atan" in err.message
    assert (err.loc.filename, err.loc.line) == ("user.py", 7)


def test_grid_must_be_positive():
    with pytest.raises(kiln.KilnValueError, match="grid"):
        unmasked_copy.interpret[(0,)](np.ones(4, np.float32), np.ones(4, np.float32))


@kiln.kernel
def scalar_kinds(out: kiln.Tensor[i32], a: i32, b: i32):
    """Integer semantics that differ from Python's: truncating division and remainder."""
    out[0] = a // b
    out[1] = a % b
    out[2] = (a * 65536) * 65536  # wraps at 32 bits


def test_integer_ops_follow_mlir_not_python():
    out = np.full(3, -99, np.int32)
    scalar_kinds.interpret[(1,)](out, -7, 2, num_warps=1)
    assert out.tolist() == [-3, -1, 0]


def test_a_wait_for_other_ctas_is_reported_not_hung():
    """The interpreter runs one CTA at a time, so a CTA waiting for a later one would never
    return: the wait raises at its line instead. A wait the earlier CTAs already satisfied
    (here the only CTA's own ticket, on a counter two earlier launches left at 2) passes."""
    from sample_kernels import sum_after_wait

    x = np.random.default_rng().standard_normal(2).astype(np.float32)
    with pytest.raises(kiln.UnsupportedError, match="it is 1 .* one at a time") as error:
        sum_after_wait.interpret[(2,)](x, np.zeros(2, np.float32), np.zeros(1, np.int64),
                                       np.full(2, np.nan, np.float32), num_warps=1)
    assert "sample_kernels.py" in error.value.loc.filename
    assert "@wait" in open(error.value.loc.filename).read().splitlines()[error.value.loc.line - 1]

    counters, out = np.full(1, 2, np.int64), np.full(1, np.nan, np.float32)
    sum_after_wait.interpret[(1,)](x[:1], np.zeros(1, np.float32), counters, out, num_warps=1)
    assert out[0] == 2 * x[0] and counters[0] == 3
