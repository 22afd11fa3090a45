"""The library's steady-state plan look-up (``kiln.kernels.plan_guard``,
``PlanCache.find``): the last plan's guard must pass exactly the calls whose plan key equals
its own (up to the strides of size-1 dimensions of contiguous tensors, which no index reaches),
so a call with another shape, dtype, layout or device never runs a stale plan. No GPU needed:
torch tensors are stand-ins here, and real torch CPU tensors on a ``DryRuntime`` where torch is
installed.
"""

import itertools

import numpy as np
import pytest

import kiln
from kiln.kernels import runtime
from kiln.kernels.attention import combine, decode_attention, prefill
from kiln.kernels.gemm import matmul
from kiln.kernels import plan_guard
from kiln.kernels.plan_guard import make_guard
from kiln.kernels.runtime import PlanCache, key_of
from test_library_runtime import BF16, _decode_args, _partials, dry  # noqa: F401


class Tensor:
    """A torch tensor as spec() and the guards read one."""

    __module__ = "torch"

    def __init__(self, shape, dtype="bf16", strides=None, device=0):
        self.shape, self.dtype, self._device = tuple(shape), dtype, device
        self._strides = strides or tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))

    def stride(self):
        return self._strides

    def get_device(self):
        return self._device

    def data_ptr(self):
        return 0x1000

    def is_contiguous(self):
        expected = 1
        for size, stride in reversed(list(zip(self.shape, self._strides))):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True


def _pool():
    return [
        Tensor((2, 8)), Tensor((2, 8)), Tensor((2, 8), "f32"), Tensor((8, 2)),
        Tensor((2, 8), strides=(1, 2)), Tensor((2, 8), strides=(16, 1)),
        Tensor((1, 8), strides=(99, 1)), Tensor((1, 8)), Tensor((2, 8), device=1),
        Tensor((2, 8), device=-1), None, 2, 2.0, True, "sm_90a", (1, 2), 0.5,
    ]


def _equivalent(a, b) -> bool:
    """Same key, or contiguous tensors whose keys differ only in size-1 strides."""
    if key_of((a,)) == key_of((b,)):
        return True
    return isinstance(a, Tensor) and isinstance(b, Tensor) and a.is_contiguous() and \
        b.is_contiguous() and (a.shape, a.dtype, a._device) == (b.shape, b.dtype, b._device)


@pytest.fixture(params=["python", "native"])
def native(request):
    """make_guard's ``native`` argument: None (a generated function) or the native launch
    shim's guard_values (skipped where no C compiler built the shim)."""
    if request.param == "python":
        return None
    from kiln.kernels import plan_guard
    from kiln.runtime.native import native_module

    shim = native_module()
    if shim is None:
        pytest.skip("no native launch shim here")
    assert (shim.GUARD_VALUE, shim.GUARD_TENSOR) == (plan_guard.GUARD_VALUE,
                                                     plan_guard.GUARD_TENSOR)
    return shim.guard_values


def test_a_guard_passes_exactly_the_values_of_its_key(native):
    pool = _pool()
    for a, b, c in itertools.product(pool, pool[:4] + [None, 2], ["x", 3]):
        guard = make_guard((a, b, c), native)
        for a2, b2, c2 in itertools.product(pool, pool[:4] + [None, 2], ["x", 3]):
            same_key = key_of((a, b, c)) == key_of((a2, b2, c2))
            passed = guard((a2, b2, c2))
            assert passed or not same_key or type(a) is not type(a2), (a, b, c, a2, b2, c2)
            if passed:
                assert _equivalent(a, a2) and _equivalent(b, b2) and c == c2
                assert (type(a), type(b), type(c)) == (type(a2), type(b2), type(c2))
        assert not guard((a, b)) and not guard((a, b, c, None))


def test_a_native_guard_hands_its_tensors_to_the_checker_last(native):
    """With a tensor checker (torch's C++ guard on a GPU machine; a key comparison here) the
    native guard checks the other values itself, then passes the tensors, in order, to the
    checker in one call; the guard passes exactly the values of its key, as without one."""
    if native is None:
        pytest.skip("the checker is the native guard's")
    calls = []

    def tensor_check(examples):
        def check(*tensors):
            calls.append(len(tensors))
            return len(tensors) == len(examples) and all(
                key_of((t,)) == key_of((e,)) for t, e in zip(tensors, examples))
        return check

    pool = _pool()
    for a, b in itertools.product(pool[:6] + [None, 2], pool[:4] + [None, "x"]):
        guard = make_guard((a, 3, b), native, tensor_check)
        tensors = sum(isinstance(v, Tensor) for v in (a, b))
        for a2, b2 in itertools.product(pool[:6] + [None, 2], pool[:4] + [None, "x"]):
            del calls[:]
            passed = guard((a2, 3, b2))
            assert passed == (key_of((a, 3, b)) == key_of((a2, 3, b2)) and
                              type(a) is type(a2) and type(b) is type(b2)), (a, b, a2, b2)
            assert calls in ([], [tensors])  # one call, with every tensor, or none
        assert not guard((a, 4, b)) and not guard((a, 3))
    assert make_guard((Tensor((2,)), 1), native, lambda examples: None).args[0][0][0] == \
        plan_guard.GUARD_TENSOR  # no checker made: the guard reads the attributes itself


@pytest.mark.parametrize("make", [lambda: np.zeros(4, np.float32), lambda: float("nan"),
                                  lambda: [1, 2], lambda: (1, float("nan"))])
def test_no_guard_passes_values_whose_equality_is_not_exact(make, native):
    """Arrays and lists get no guard; a NaN passes only as the same object, as in the key."""
    guard = make_guard((Tensor((2,)), make()), native)
    assert guard is None or not guard((Tensor((2,)), make()))


def test_find_takes_the_guard_then_the_key_and_clear_forgets_both():
    cache = PlanCache("test-guard")
    x, other = Tensor((4, 4)), Tensor((4, 4), strides=(1, 4))
    assert cache.find((x, 2)) is None
    cache.add(key_of((x, 2)), "plan-x", (x, 2))
    cache.add(key_of((other, 2)), "plan-other", (other, 2))
    builds = cache.builds
    assert cache.find((Tensor((4, 4)), 2)) == "plan-x"       # keyed, then guarded
    assert cache.find((Tensor((4, 4)), 2)) == "plan-x"
    assert cache.find((Tensor((4, 4), strides=(1, 4)), 2)) == "plan-other"
    assert cache.find((Tensor((4, 4), "f32"), 2)) is None
    assert cache.find((Tensor((4, 4)), 3)) is None
    assert cache.builds == builds
    cache.clear()
    assert cache.find((Tensor((4, 4)), 2)) is None and cache.find((x, 2)) is None


def _noncontiguous(torch, x):
    """A non-contiguous tensor of ``x``'s shape, dtype and values."""
    wide = torch.zeros((*x.shape[:-1], 2 * x.shape[-1]), dtype=x.dtype)
    view = wide[..., :x.shape[-1]]
    view.copy_(x)
    return view


def _torch_entry_points(torch, rng):
    """(name, call(first argument)) of each entry point and its first argument."""
    def t(x):
        return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16) \
            if x.dtype == BF16 else torch.from_numpy(np.ascontiguousarray(x))

    q = t(rng.standard_normal((1, 128, 2, 64)).astype(BF16))
    decode_args = _decode_args(rng, lib=t)
    partials = [t(x) for x in _partials(rng)]
    a, b = (t(rng.standard_normal(s).astype(BF16)) for s in ((64, 32), (32, 48)))
    return {
        "prefill": (lambda x: prefill(x, q, q, causal=True), q),
        "decode_attention": (lambda x: decode_attention(x, *decode_args[1:]), decode_args[0]),
        "combine": (lambda x: combine(x, *partials[1:]), partials[0]),
        "matmul": (lambda x: matmul(x, b), a),
    }


@pytest.mark.parametrize("entry", ["prefill", "decode_attention", "combine", "matmul"])
def test_a_changed_layout_or_dtype_never_runs_the_last_plan(dry, rng, entry):
    """After hits, a non-contiguous view of the same shape, or another dtype, misses: a new
    plan, the general path, or the full checks' refusal."""
    torch = pytest.importorskip("torch")
    call, first = _torch_entry_points(torch, rng)[entry]
    call(first)

    def state():
        return ([cache.builds for cache in runtime._CACHES], len(dry.binds), len(dry.launches))

    before, bound = state(), dry.bound_calls
    call(first.clone())
    assert state() == before and dry.bound_calls > bound  # a hit: bound launches only
    for changed in (_noncontiguous(torch, first),
                    first.to(torch.float16 if first.dtype != torch.float16 else torch.float32)):
        before = state()
        try:
            call(changed)
        except kiln.KilnError:
            continue  # refused by the full checks (another dtype, a layout combine refuses)
        assert state() != before  # not the last plan: planned, bound or launched afresh


def test_decode_attention_rechecks_given_outputs_that_change(dry, rng):
    """out= / lse_out= laid out like the last checked ones skip the full check; any other
    dtype, shape, layout or a misaligned address is refused, after hits too."""
    torch = pytest.importorskip("torch")

    def t(x):
        return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16)

    args = tuple(t(a) if a.dtype == BF16 else torch.from_numpy(a) for a in _decode_args(rng))
    o, lse = decode_attention(*args)
    for _ in range(2):
        assert decode_attention(*args, out=o, lse_out=lse)[0] is o
    flat = torch.empty(o.numel() + 8, dtype=o.dtype)
    for bad in (o.float(), o[..., :-1], _noncontiguous(torch, o),
                flat[1:1 + o.numel()].view(o.shape)):  # 2 bytes past a 16-byte boundary
        with pytest.raises(kiln.KilnValueError, match="out"):
            decode_attention(*args, out=bad, lse_out=lse)
    with pytest.raises(kiln.KilnValueError, match="lse_out"):
        decode_attention(*args, out=o, lse_out=lse.to(torch.float64))
    assert decode_attention(*args, out=o, lse_out=lse)[1] is lse


def test_torch_tensor_guard_checks_each_tensor_and_keeps_none_alive():
    """runtime.torch_tensor_check (torch's C++ TensorGuards, where this torch has it): passes
    tensors laid out as the examples, refuses another shape, stride, dtype or type, holds no
    example alive; guard_of hands a call's torch tensors to it in one call."""
    torch = pytest.importorskip("torch")
    import gc
    import weakref

    from kiln.runtime.native import native_module

    example, other = torch.zeros(4, 6), torch.zeros(3, dtype=torch.int32)
    check = runtime.torch_tensor_check((example, other))
    if check is None:
        pytest.skip("this torch has no usable C++ tensor guard")
    assert check(torch.ones(4, 6), torch.ones(3, dtype=torch.int32))
    for wrong in (torch.zeros(4, 7), torch.zeros(6, 4).T, torch.zeros(4, 6, dtype=torch.float64),
                  torch.nn.Parameter(torch.zeros(4, 6))):
        assert not check(wrong, other)
    dropped = weakref.ref(example)
    del example, check
    gc.collect()
    assert dropped() is None
    values = (torch.zeros(2, 3), None, 5, torch.zeros(3, dtype=torch.int32))
    guard = runtime.guard_of(values)
    if native_module() is not None:
        assert plan_guard.GUARD_CHECKED in [entry[0] for entry in guard.args[0] if entry]
    assert guard((torch.ones(2, 3), None, 5, torch.ones(3, dtype=torch.int32)))
    assert not guard((torch.ones(2, 3), None, 6, torch.ones(3, dtype=torch.int32)))
    assert not guard((torch.ones(2, 3), None, 5, None))  # no tensor where one was: no check
    assert not guard((torch.ones(3, 2), None, 5, torch.ones(3, dtype=torch.int32)))
