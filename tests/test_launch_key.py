"""The launch key of ``kernel[grid](...)`` and the guards that stand in for it: a guard made
from one call is true for another call exactly when the two calls' keys are equal (keywords
in any order)."""

import itertools
from types import SimpleNamespace

import numpy as np
import pytest

from kiln.launch_key import exact_keywords, launch_guard, launch_key_part


class Tensor:
    __module__ = "torch"
    is_cuda = True

    def __init__(self, shape, dtype="float32", strides=None):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self._strides = strides or tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))

    def data_ptr(self):
        return 0x1000

    def dim(self):
        return len(self.shape)

    def stride(self, dim=None):
        return self._strides if dim is None else self._strides[dim]


class CpuTensor(Tensor):
    __module__ = "torch"
    is_cuda = False


class OtherTensor(Tensor):  # another tensor type: another launcher
    __module__ = "torch"


def _values():
    """A pool of positional values differing in everything the key covers (and in what it
    must not cover: addresses, sizes of outer dimensions, scalar values)."""
    return [Tensor((8,)), Tensor((9,)), Tensor((8,), "float16"), Tensor((2, 4)),
            Tensor((8,), strides=(2,)), Tensor((8, 1), strides=(1, 3)), CpuTensor((8,)),
            OtherTensor((8,)), 3, 4, 3.0, True, False]


def _key(args, kwargs):
    """The launch key, up to the order of the keywords (which does not change the kernel)."""
    items = sorted(kwargs.items())
    return (tuple(launch_key_part(a, False) for a in args), len(args), tuple(items),
            tuple(type(v) for _, v in items))


def test_a_guard_is_true_exactly_for_calls_with_the_same_key(rng):
    pool = _values()
    keywords = [{}, {"BLOCK": 128}, {"BLOCK": 256}, {"BLOCK": True}, {"BLOCK": 1},
                {"BLOCK": 128, "num_warps": 4}, {"num_warps": 4, "BLOCK": 128}, {"D": 2.5}]
    calls = [(tuple(pool[i] for i in rng.integers(0, len(pool), int(rng.integers(1, 4)))),
              keywords[int(rng.integers(len(keywords)))]) for _ in range(60)]
    calls += [((Tensor((8,)), 3), {"BLOCK": 128}), ((Tensor((100,)), 7), {"BLOCK": 128})]
    agreed = 0
    for (args, kwargs), (other_args, other_kwargs) in itertools.product(calls, repeat=2):
        guard = launch_guard(args, kwargs, (False,) * 4)
        same = _key(args, kwargs) == _key(other_args, other_kwargs)
        assert guard(other_args, other_kwargs) == same, (args, kwargs, other_args, other_kwargs)
        agreed += same
    assert agreed > len(calls)  # some pairs beyond the diagonal share a key


@pytest.mark.parametrize("args, kwargs, flags", [
    ((Tensor((8,)), 4), {"BLOCK": -0.0}, (False, False)),      # -0.0 == 0.0
    ((Tensor((8,)), 4), {"BLOCK": float("nan")}, (False, False)),
    ((Tensor((8,)), 4), {"BLOCK": [1, 2]}, (False, False)),    # [2] == [2.0]
    ((Tensor((8,)), 4), {}, (False, True)),                    # a positional constexpr
    ((SimpleNamespace(__cuda_array_interface__={}), 4), {}, (False, False)),
    ((np.zeros(4, np.float32), 4), {}, (False, False)),
    ((np.float32(2.0),), {}, (False,)),
])
def test_no_guard_where_equality_is_not_exact_or_the_kind_is_not_cheap(args, kwargs, flags):
    assert launch_guard(args, kwargs, flags) is None


def test_exact_keywords():
    assert exact_keywords({"BLOCK": 128, "name": "x", "flag": None, "scale": 0.5})
    assert not exact_keywords({"scale": 0.0})
    assert not exact_keywords({"shape": (1, 2)})
