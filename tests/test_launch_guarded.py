"""``kernel[grid](...)``'s guarded launcher (``kiln.runtime.launch_fast.guarded_launcher``):
the last launch's key check fused with its packing, in Python or in one call into the native
shim (``launch_guarded``). A hit must launch exactly what the checked path would; any change of
dtype, rank, layout, device, scalar or keyword type must miss (launch nothing) and take the
checked path, which re-specialises or reports the mistake.

Runs on every launcher of ``test_launch_fast``'s ``runtimes`` fixture (the ExecutionEngine's
host module, the driver launcher through the shim and through ctypes), all on recording
stand-ins for the driver: no GPU needed.
"""

import numpy as np
import pytest

from kiln.core.errors import KilnTypeError, KilnValueError
from kiln.launch_key import launch_guard
from kiln.runtime.launch_fast import guarded_launcher
from test_launch_fast import CpuTensor, CudaArray, Tensor, axpy, runtimes  # noqa: F401

BLOCK = 128


def _example(rng):
    n = int(rng.integers(1, 1 << 20))
    ptr = int(rng.integers(1, 1 << 30)) * 256
    return (Tensor(ptr, (n,)), Tensor(ptr + 4 * n, (n,)), n, float(rng.standard_normal()))


def _guarded(runtimes, rng):
    """The guarded launcher of axpy made after one launch, its example call, its runtime."""
    args = _example(rng)
    axpy[1](*args, BLOCK=BLOCK)
    (entry,) = set(axpy._launches.values())
    guarded = guarded_launcher(entry.ck, args, {"BLOCK": BLOCK}, axpy._runtime_idx,
                               axpy._constexpr_flags, entry.meta)
    (runtime,) = runtimes.values()
    return guarded, args, runtime


def _variants(rng):
    """(name, args, kwargs, same key as the example's) of calls around the example."""
    x, y, n, a = _example(rng)
    return [
        ("same layout", (x, y, n, a), {"BLOCK": BLOCK}, True),
        ("other sizes", (Tensor(256, (7,)), Tensor(512, (7,)), 7, -1.5), {"BLOCK": BLOCK}, True),
        ("size-1 strided", (Tensor(256, (1,), strides=(3,)), y, 1, a), {"BLOCK": BLOCK}, True),
        ("f16", (Tensor(256, (n,), "float16"), y, n, a), {"BLOCK": BLOCK}, False),
        ("rank 2", (x, Tensor(256, (2, 4)), n, a), {"BLOCK": BLOCK}, False),
        ("strided", (Tensor(256, (n,), strides=(2,)), y, n, a), {"BLOCK": BLOCK}, n <= 1),
        ("cpu", (CpuTensor(256, (n,)), y, n, a), {"BLOCK": BLOCK}, False),
        ("array interface", (CudaArray(256, (n,)), y, n, a), {"BLOCK": BLOCK}, False),
        ("float n", (x, y, float(n), a), {"BLOCK": BLOCK}, False),
        ("int a", (x, y, n, 2), {"BLOCK": BLOCK}, False),
        ("float BLOCK", (x, y, n, a), {"BLOCK": float(BLOCK)}, False),
        ("other BLOCK", (x, y, n, a), {"BLOCK": 2 * BLOCK}, False),
        ("extra keyword", (x, y, n, a), {"BLOCK": BLOCK, "num_warps": 4}, False),
        ("no keyword", (x, y, n, a), {}, False),
        ("three arguments", (x, y, n), {"BLOCK": BLOCK}, False),
    ]


def test_the_guarded_launcher_launches_exactly_the_calls_of_its_key(runtimes, rng):
    guarded, example, runtime = _guarded(runtimes, rng)
    assert guarded
    key_guard = launch_guard(example, {"BLOCK": BLOCK}, (False,) * 4)
    for name, args, kwargs, same in _variants(rng):
        assert key_guard(args, kwargs) == same, name  # the key's own verdict
        before = len(runtime.launches)
        grid = int(rng.integers(1, 1000))
        assert guarded(grid, args, kwargs, None) is same, name
        assert len(runtime.launches) == before + same, name
        if same:
            x, y, n, a = args
            _, launched_grid, _, _, stream, flat, _ = runtime.launches[-1]
            assert launched_grid == (grid, 1, 1) and stream is None, name
            assert flat[:5] == [x.data_ptr(), x.data_ptr(), 0, *x.shape, *x.stride()], name
            assert flat[5:10] == [y.data_ptr(), y.data_ptr(), 0, *y.shape, *y.stride()], name
            assert flat[10] == n and flat[11] == pytest.approx(a, rel=1e-7), name


def test_a_callable_grid_gets_the_constexprs_and_a_given_stream_is_used(runtimes, rng):
    guarded, (x, y, n, a), runtime = _guarded(runtimes, rng)
    seen = []

    def grid(meta):
        seen.append(meta["BLOCK"])
        return (n + meta["BLOCK"] - 1) // meta["BLOCK"], 2

    assert guarded(grid, (x, y, n, a), {"BLOCK": BLOCK}, 0xABC0)
    _, launched_grid, _, _, stream, _, _ = runtime.launches[-1]
    assert seen == [BLOCK] and launched_grid == ((n + BLOCK - 1) // BLOCK, 2, 1)
    assert stream == 0xABC0


@pytest.mark.parametrize("bad, error", [
    (lambda x, y: (x, y, 2**31, 1.0), KilnValueError),      # n past i32
    (lambda x, y: (x, y, 4, 1e39), KilnValueError),         # a past f32
    (lambda x, y: (CpuTensor(256, (4,)), y, 4, 1.0), KilnTypeError),
    (lambda x, y: (x, y, "4", 1.0), KilnTypeError),
])
def test_values_the_guard_cannot_pack_launch_nothing_and_raise(runtimes, rng, bad, error):
    """Past the key (a scalar's range, a grid): the checked path reports them."""
    guarded, (x, y, n, a), runtime = _guarded(runtimes, rng)
    before = len(runtime.launches)
    with pytest.raises(error):
        axpy[1](*bad(x, y), BLOCK=BLOCK)
    for grid in (0, (1, 1 << 17), (1, 2, 3, 4), 2.0):
        with pytest.raises((KilnValueError, KilnTypeError)):
            axpy[grid](x, y, n, a, BLOCK=BLOCK)
    assert len(runtime.launches) == before
    axpy[3](x, y, n, a, BLOCK=BLOCK)  # and the guard still launches the good ones
    assert len(runtime.launches) == before + 1


def test_a_strided_view_after_hits_takes_its_own_specialisation(runtimes, rng):
    (x, y, n, a) = _example(rng)
    for _ in range(3):
        axpy[1](x, y, n, a, BLOCK=BLOCK)
    view = Tensor(x.data_ptr(), (n // 2 + 2,), strides=(2,))
    axpy[1](view, y, n, a, BLOCK=BLOCK)
    cks = {ck.signature.params[0].contiguous: runtime for ck, runtime in runtimes.items()}
    assert set(cks) == {True, False}
    assert len(cks[True].launches) == 3 and len(cks[False].launches) == 1
    flat = cks[False].launches[0][5]
    assert flat[:5] == [x.data_ptr(), x.data_ptr(), 0, n // 2 + 2, 2]  # the view's strides
    axpy[1](x, y, n, a, BLOCK=BLOCK)  # back: the first binary again
    assert len(cks[True].launches) == 4


def test_no_guarded_launcher_without_an_exact_key(runtimes, rng):
    guarded, (x, y, n, a), _ = _guarded(runtimes, rng)
    (entry,) = set(axpy._launches.values())
    for args, kwargs in (((x, y, n, a), {"BLOCK": float("nan")}),
                         ((CudaArray(256, (n,)), y, n, a), {"BLOCK": BLOCK}),
                         ((np.zeros(4, np.float32), y, n, a), {"BLOCK": BLOCK})):
        assert guarded_launcher(entry.ck, args, kwargs, axpy._runtime_idx,
                                axpy._constexpr_flags, entry.meta) is None
