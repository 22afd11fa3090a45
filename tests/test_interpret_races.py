"""Plain shared-memory races between threads: a load of a shared byte that another thread
stored with no barrier (``gpu.barrier``, named barrier, mbarrier phase) in between is a
``RaceError`` naming the load's line and the store's line."""

import numpy as np
import pytest

import kiln
from kiln import f32

N = 64


def make_neighbour_kernel(with_barrier: bool):
    @kiln.kernel
    def neighbour(x: kiln.Tensor[f32], y: kiln.Tensor[f32]):
        """y[t] = x[t + 1 mod N], through shared memory."""
        tile = kiln.shared((N,), f32)
        t = kiln.thread_id(0)
        tile[t] = x[t]  # @store
        if with_barrier:
            kiln.barrier()
        y[t] = tile[(t + 1) % N]  # @load

    return neighbour


def test_load_of_another_threads_store_without_barrier_is_a_race(marker_line):
    x = np.random.default_rng().standard_normal(N).astype(np.float32)
    with pytest.raises(kiln.core.errors.RaceError) as info:
        make_neighbour_kernel(False).interpret[(1,)](x, np.zeros(N, np.float32), num_warps=2)
    err = info.value
    assert err.loc.line == marker_line("@load")
    assert f":{marker_line('@store')}" in err.message
    assert "thread 0 loads shared byte 4 that thread 1 stored" in err.message
    assert "Fix:" in str(err)


def test_barrier_orders_the_store_and_the_load():
    x = np.random.default_rng().standard_normal(N).astype(np.float32)
    y = np.full(N, np.nan, np.float32)
    make_neighbour_kernel(True).interpret[(1,)](x, y, num_warps=2)
    np.testing.assert_array_equal(y, np.roll(x, -1))


@kiln.kernel
def own_slot(x: kiln.Tensor[f32], y: kiln.Tensor[f32]):
    """Each thread reads back only what it stored itself: no barrier needed."""
    tile = kiln.shared((N,), f32)
    t = kiln.thread_id(0)
    tile[t] = x[t] * 2.0
    y[t] = tile[t]


def test_reading_ones_own_store_is_not_a_race():
    x = np.random.default_rng().standard_normal(N).astype(np.float32)
    y = np.full(N, np.nan, np.float32)
    own_slot.interpret[(1,)](x, y, num_warps=2)
    np.testing.assert_array_equal(y, x * 2)
