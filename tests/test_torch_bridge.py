"""The torch bridge (``kiln.runtime.native_torch``) on torch CPU tensors: built and cached at
first use, its makers give fresh tensors exactly like ``torch.empty``, its guards pass exactly
the tensors laid out as their examples, and the launch shim reads through it the same words a
launch reads through torch's Python attributes (``kernel[grid]``'s guarded launch,
``launch_outputs``' addresses), on recording stand-ins for the driver: no GPU needed."""

import shutil

import numpy as np
import pytest

from kiln.runtime import native_torch
from kiln.runtime.launch_fast import guarded_launcher
from test_launch_fast import Tensor, _entry, axpy, runtimes  # noqa: F401

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def bridge():
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    made = native_torch.load_bridge("c++")  # from the compile cache (built there once)
    assert made is not None  # a real torch and a compiler: the bridge must build and load
    return made


@pytest.fixture
def reader(bridge):
    """The bridge as what the process uses, restored to no bridge afterwards."""
    native_torch.use_bridge(bridge)
    yield bridge
    native_torch.use_bridge(None)


def test_the_bridge_is_built_once_then_loaded_from_the_cache(tmp_path, monkeypatch):
    from kiln.runtime import native

    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    builds = []
    original = native._build
    monkeypatch.setattr(native, "_build", lambda *a: builds.append(a) or original(*a))
    assert native_torch.load_bridge("c++", tmp_path, build=False) is None  # nothing cached
    assert native_torch.load_bridge("c++", tmp_path) is not None
    assert native_torch.load_bridge("c++", tmp_path, build=False) is not None
    assert native_torch.load_bridge(None, tmp_path) is None  # KILN_CXX=none
    assert len(builds) == 1
    monkeypatch.setenv("KILN_NO_CACHE", "1")
    assert native_torch.load_bridge("c++") is None  # no per-process build without a cache
    assert len(builds) == 1


@pytest.mark.parametrize("shape, dtype", [((3, 5, 7), torch.float32), ((1,), torch.bfloat16),
                                          ((0, 4), torch.int32), ((), torch.float16),
                                          ((2, 1, 3, 1), torch.int64)])
def test_a_maker_gives_fresh_contiguous_tensors_like_torch_empty(bridge, rng, shape, dtype):
    like = torch.zeros(2)
    make = bridge.empty_maker(like.new_empty((), dtype=dtype), shape, lambda: None)
    want = torch.empty(shape, dtype=dtype)
    made = [make() for _ in range(4)]
    for t in made:
        assert type(t) is torch.Tensor and t.shape == want.shape and t.dtype == dtype
        assert t.stride() == want.stride() and t.device == like.device
        assert not t.requires_grad and t.is_contiguous() and t.storage_offset() == 0
    if want.numel():
        assert len({t.data_ptr() for t in made}) == len(made)  # no two share memory
        values = torch.from_numpy(rng.standard_normal(want.shape)).to(dtype)
        made[0].copy_(values)
        assert torch.equal(made[0], values)
    with pytest.raises(TypeError):
        make(1)


def test_a_maker_under_deterministic_fill_calls_its_fallback(bridge):
    like = torch.zeros(2)
    marker = torch.full((2, 3), 7.0)
    make = bridge.empty_maker(like.new_empty(()), (2, 3), lambda: marker)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert make() is marker  # torch.empty then fills new memory: the bridge defers to it
    finally:
        torch.use_deterministic_algorithms(previous)
    assert make() is not marker


def test_a_maker_is_refused_for_what_it_cannot_copy(bridge):
    assert bridge.empty_maker(torch.zeros(2).to_sparse(), (2,), lambda: None) is None
    for bad in ((torch.zeros(2), [2], lambda: None), (torch.zeros(2), (-1,), lambda: None),
                (np.zeros(2), (2,), lambda: None), (torch.zeros(2), (2,), None)):
        with pytest.raises((TypeError, ValueError)):
            bridge.empty_maker(*bad)


def test_a_tensor_guard_passes_exactly_the_layouts_of_its_examples(bridge):
    x, y = torch.zeros(4, 6), torch.zeros(5, dtype=torch.int32)
    guard = bridge.tensor_guard((x, y))
    assert guard(torch.ones(4, 6), torch.ones(5, dtype=torch.int32)) is True
    for other in [(torch.zeros(6, 4), y), (torch.zeros(6, 4).t(), y),  # shape, strides
                  (x.double(), y), (x, y.long()),                        # dtypes
                  (torch.nn.Parameter(x), y),                            # a subclass
                  (x[None], y), (x, y[:4]),                              # rank, size
                  (x, torch.zeros(10, dtype=torch.int32)[::2]),          # strides of a view
                  (x, 5), (x,), (x, y, y)]:                              # not tensors, count
        assert guard(*other) is False, other
    c = torch.zeros(3, dtype=torch.complex64)
    assert bridge.tensor_guard((c,))(c.conj()) is False  # the conjugate bit: other keys
    assert bridge.tensor_guard((x.to_sparse(),)) is None
    assert bridge.tensor_guard((torch.nn.Parameter(x),)) is None
    assert bridge.tensor_guard(()) is not None and bridge.tensor_guard(())() is True


def test_plan_guards_take_the_bridge_check(reader):
    from kiln.kernels import runtime

    values = (torch.zeros(4, 6), None, 3, "sm_90a")
    guard = runtime.guard_of(values)
    assert guard.args[1].__class__.__name__ == "TensorGuard"  # the bridge's, not torch's
    assert guard((torch.ones(4, 6), None, 3, "sm_90a")) is True
    assert guard((torch.ones(4, 6), None, 4, "sm_90a")) is False
    assert guard((torch.ones(6, 4), None, 3, "sm_90a")) is False


@pytest.mark.parametrize("runtimes", ["native"], indirect=True)
def test_kernel_grid_reads_the_same_words_through_the_bridge(runtimes, bridge, rng):
    """The guarded launch of axpy on torch CPU tensors, made and called with the shim reading
    tensors through the bridge and through Python attributes: the same launches, the same
    misses."""
    axpy[1](Tensor(256, (64,)), Tensor(512, (64,)), 64, 1.0, BLOCK=128)
    entry = _entry(axpy)
    (runtime,) = runtimes.values()
    n = int(rng.integers(2, 1000))
    x, y = torch.zeros(n), torch.zeros(n)
    calls = [((torch.zeros(n + 3), torch.zeros(n + 3), n + 3, 0.5), True),
             ((torch.zeros(n), torch.zeros(2 * n)[::2], n, 0.5), False),    # strided
             ((torch.zeros(n, dtype=torch.float16), y, n, 0.5), False),     # dtype
             ((torch.zeros(1, n), y, n, 0.5), False),                       # rank
             ((torch.nn.Parameter(x), y, n, 0.5), False)]                   # type
    seen = {}
    try:
        for reading in (bridge, None):
            native_torch.use_bridge(reading)
            guarded = guarded_launcher(entry.ck, (x, y, n, 0.5), {"BLOCK": 128},
                                       axpy._runtime_idx, axpy._constexpr_flags, entry.meta)
            assert len(guarded.args[1][2][0]) == (7 if reading is None else 8)  # dtype code
            words = []
            for args, hit in calls:
                before = len(runtime.launches)
                assert guarded(3, args, {"BLOCK": 128}, None) is hit
                assert len(runtime.launches) == before + hit
                if hit:
                    words.append(runtime.launches[-1][5])
                    a = args[0]
                    assert words[-1][:5] == [a.data_ptr(), a.data_ptr(), 0, n + 3, 1]
            seen[reading is None] = words
    finally:
        native_torch.use_bridge(None)
    assert seen[True] == seen[False]


def test_launch_outputs_reads_torch_addresses_through_the_bridge(reader):
    """The shim's launch_outputs takes a torch tensor's address from the bridge, an int as it
    is, anything else by data_ptr()."""
    from kiln.runtime.launch import _LaunchPlan, bind_launch
    from kiln.runtime.native import native_module
    from kiln.signature import KernelSignature, TensorParam
    from test_launch_capture import CapturingDriver
    from test_native_launch import _Device, _Fresh, _launcher

    shim = native_module()
    if shim is None:
        pytest.skip("no C compiler for the launch shim")
    signature = KernelSignature("e", (TensorParam("x", "f32", 1), TensorParam("w", "f32", 1),
                                      TensorParam("o", "f32", 1)), block=(32, 1, 1))
    launcher, recorder = _launcher("native", shim, signature)
    plan = _LaunchPlan("e", signature, launcher, CapturingDriver())
    ck = type("CK", (), {"name": "e", "signature": signature, "_launch_plan": plan})()
    bound = bind_launch(ck, (1, 1, 1), [_Device(0x8000 * i, (4,)) for i in (1, 2, 3)])
    x, out = torch.zeros(4), torch.zeros(4)
    made = bound.launch_outputs((lambda: out,), 0, x, _Fresh(0x4000), None)
    assert made is out
    words = recorder.launches[-1][5]
    assert words[0] == x.data_ptr() and words[5] == 0x4000 and words[10] == out.data_ptr()
