"""``bind_launch``: a launch converted once, then repeated with new device addresses only.

Checked without a GPU: the bound launch runs against a recording launcher and device arrays
described by ``__cuda_array_interface__``.
"""

from types import SimpleNamespace

import numpy as np
import pytest

from kiln.errors import KilnTypeError, KilnValueError
from kiln.lowering import launch as launch_mod
from kiln.lowering.signature import KernelSignature, ScalarParam, TensorMapParam, TensorParam

SIG = KernelSignature("scale_rows", (TensorParam("x", "f32", 2), ScalarParam("n", "i32"),
                                     TensorParam("y", "f16", 1), ScalarParam("a", "f32")),
                      block=(128, 1, 1))


class DeviceArray:
    def __init__(self, ptr, shape, typestr, strides=None):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": shape,
                                         "typestr": typestr, "strides": strides, "version": 3}


def _bound_kernel(signature=SIG):
    calls = []
    plan = launch_mod._LaunchPlan(signature.name, signature,
                                  lambda flat, grid, stream: calls.append((flat, grid, stream)),
                                  driver=None)
    return SimpleNamespace(name=signature.name, signature=signature, _launch_plan=plan), calls


def test_bound_launch_replaces_only_the_tensor_addresses():
    ck, calls = _bound_kernel()
    rng = np.random.default_rng()
    x_ptr, y_ptr, n = (int(v) for v in rng.integers(1 << 20, 1 << 40, 3))
    x = DeviceArray(x_ptr, (6, 10), "<f4", strides=(64, 4))  # padded rows
    bound = launch_mod.bind_launch(ck, (5, 2), [x, n, DeviceArray(y_ptr, (7,), "<f2"), 0.25])
    bound(x_ptr + 4096, y_ptr + 64, stream=77)
    bound(x_ptr, y_ptr)
    (first, grid, stream), (second, _, default_stream) = calls
    assert grid == (5, 2, 1) and stream == 77 and default_stream is None
    assert first == [x_ptr + 4096, x_ptr + 4096, 0, 6, 10, 16, 1, n,
                     y_ptr + 64, y_ptr + 64, 0, 7, 1, 0.25]
    assert second[:2] == [x_ptr, x_ptr] and second[8:10] == [y_ptr, y_ptr]
    assert first[2:8] == second[2:8] and first[10:] == second[10:]


def test_bind_rejects_what_it_cannot_hold_fixed():
    ck, _ = _bound_kernel()
    y = DeviceArray(0x2000, (7,), "<f2")
    with pytest.raises(KilnTypeError, match="numpy arrays"):
        launch_mod.bind_launch(ck, 1, [np.ones((2, 2), np.float32), 3, y, 1.0])
    with pytest.raises(KilnValueError, match="run-time arguments"):
        launch_mod.bind_launch(ck, 1, [y])
    tma = KernelSignature("t", (TensorMapParam("t", "f16", 2, (64, 64), 128),), block=(128, 1, 1))
    ck_tma, _ = _bound_kernel(tma)
    with pytest.raises(KilnTypeError, match="tensor maps"):
        launch_mod.bind_launch(ck_tma, 1, [DeviceArray(0x3000, (128, 128), "<f2")])
    bound = launch_mod.bind_launch(ck, 1, [DeviceArray(0x1000, (2, 2), "<f4"), 3, y, 1.0])
    with pytest.raises(KilnValueError, match="binds 2 tensors"):
        bound(0x1000)
