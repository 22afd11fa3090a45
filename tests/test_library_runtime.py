"""``kiln.kernels.runtime``, the kernel library's one host path (issue 40 item 3, issue 42):
its array handling (numpy; torch CPU tensors where torch is installed), errors at the
caller's line, plan caches (a repeat call does not re-plan, a new shape does) and that every
entry point launches through the runtime. Launches run on a :class:`DryRuntime`, which
compiles and launches nothing, so this needs no GPU."""

import importlib
import inspect

import ml_dtypes
import numpy as np
import pytest

import kiln
from kiln.kernels import runtime
from kiln.kernels.attention import combine, decode, decode_attention, prefill
from kiln.kernels.gemm import grouped_matmul, hopper_autotuner, matmul

BF16 = ml_dtypes.bfloat16
SEED = np.random.SeedSequence().entropy  # printed on failure: rerun with this seed
decode_plan = importlib.import_module("kiln.kernels.attention.decode_plan")
combine_module = importlib.import_module("kiln.kernels.attention.combine")
prefill_module = importlib.import_module("kiln.kernels.attention.prefill")
gemm_module = importlib.import_module("kiln.kernels.gemm")


@pytest.fixture
def rng():
    print(f"seed {SEED}")
    return np.random.default_rng(SEED)


@pytest.fixture
def dry(monkeypatch):
    """A DryRuntime for the test, and matmul's tuning answered without timing (the shapes of
    these tests tune to the first config)."""
    monkeypatch.setattr(hopper_autotuner, "_by_values", {})
    monkeypatch.setattr(hopper_autotuner, "_stored", lambda: {})
    monkeypatch.setattr(hopper_autotuner, "_tune", lambda *args: 0)
    monkeypatch.setattr(hopper_autotuner, "_store", lambda *args: None)
    with runtime.use_runtime(runtime.DryRuntime()) as dry:
        yield dry


def _decode_args(rng, lib=np, batch=1, sq=1, hq=8, hkv=1, d=64, page_size=64, pages=4):
    kc = rng.standard_normal((pages, page_size, hkv, d)).astype(BF16)
    args = (rng.standard_normal((batch, sq, hq, d)).astype(BF16), kc, kc.copy(),
            rng.permutation(pages)[:batch * 2].reshape(batch, 2).astype(np.int32),
            np.full(batch, page_size + 5, np.int32))
    return tuple(lib(a) for a in args) if lib is not np else args


def _partials(rng, splits=4, batch=1, sq=1, heads=8, d=64):
    return (rng.standard_normal((splits, batch, sq, heads, d)).astype(np.float32),
            rng.standard_normal((splits, batch, sq, heads)).astype(np.float32),
            rng.integers(0, splits + 1, (batch, sq, heads)).astype(np.int32))


def _calls(rng):
    """One small numpy call of each entry point: ``(function, arguments)``."""
    q = rng.standard_normal((1, 16, 2, 64)).astype(BF16)
    a = rng.standard_normal((64, 32)).astype(BF16)
    return {
        "prefill": (prefill, (q, q, q)),
        "decode": (decode, _decode_args(rng)),
        "decode_attention": (decode_attention, _decode_args(rng)),
        "combine": (combine, _partials(rng)),
        "matmul": (matmul, (a, rng.standard_normal((32, 48)).astype(BF16))),
        "grouped_matmul": (grouped_matmul, (a, rng.standard_normal((2, 32, 48)).astype(BF16),
                                            np.array([0, 24, 64], np.int32))),
    }


ENTRIES = ["prefill", "decode", "decode_attention", "combine", "matmul", "grouped_matmul"]


# --- every entry point goes through the runtime ----------------------------------------------

@pytest.mark.parametrize("entry", ENTRIES)
def test_every_entry_point_launches_through_the_runtime(dry, rng, entry):
    """With numpy inputs each entry point's kernel goes to the runtime's general launch (the
    DryRuntime records it instead of copying and launching): no entry point reaches the
    launcher around it."""
    fn, args = _calls(rng)[entry]
    fn(*args)
    assert len(dry.launches) == 1 and not dry.binds
    kernel, grid, options = dry.launches[0]
    assert hasattr(kernel, "compile") and hasattr(kernel, "interpret")  # a @kiln.kernel
    assert all(g >= 1 for g in grid) and options["target"] == "sm_90a"


def test_the_library_imports_the_launcher_only_through_the_runtime():
    """The backends, the runtime layer and the interpreter are reached from one module of the
    library, ``kiln.kernels.runtime``; every other library module uses the public DSL."""
    import pathlib

    lower_layers = tuple(f"{kw} kiln.{layer}" for kw in ("from", "import")
                         for layer in ("lowering", "runtime", "interpreter"))
    root = pathlib.Path(runtime.__file__).parent
    users = sorted(str(path.relative_to(root)) for path in root.rglob("*.py")
                   if any(line.lstrip().startswith(lower_layers)
                          for line in path.read_text().splitlines()))
    assert users == ["runtime.py"]


# --- plans ----------------------------------------------------------------------------------

@pytest.mark.parametrize("cache,call,other", [
    (decode_plan.PLANS, lambda rng: decode(*_decode_args(rng)),
     lambda rng: decode(*_decode_args(rng, batch=2))),
    (combine_module._PLANS, lambda rng: combine(*_partials(rng)),
     lambda rng: combine(*_partials(rng, heads=4))),
])
def test_a_repeat_call_reuses_its_plan_and_a_new_shape_makes_one(dry, rng, cache, call, other):
    call(rng)
    built = cache.builds
    call(rng)  # fresh values, same shape class
    assert cache.builds == built
    other(rng)
    assert cache.builds == built + 1 and len(cache) == 2


def test_plan_cache_keys_and_unhashable_options():
    cache = runtime.PlanCache("test")
    assert cache.lookup(([1], 2)) is None
    assert cache.add(([1], 2), "plan") == "plan" and len(cache) == 0 and cache.builds == 1
    x = np.zeros((4, 6), np.float32)
    assert runtime.spec(x) == runtime.spec(np.ones((4, 6), np.float32))
    assert runtime.spec(x) != runtime.spec(x.T.copy().T)  # same shape, other strides
    assert runtime.spec(x) != runtime.spec(x.astype(np.float16))


# --- arrays ---------------------------------------------------------------------------------

def test_numpy_arrays_in_numpy_arrays_out(rng):
    lib = runtime.ArrayLib(np.zeros(1, BF16))
    out = lib.full((2, 3), 1.5, kiln.bf16)
    assert out.dtype == BF16 and (out.astype(np.float32) == 1.5).all()
    x = rng.standard_normal((3, 5)).astype(BF16)
    assert lib.numpy(x) is x and lib.like(x) is x and lib.numpy(7) == 7
    target = np.full((3, 5), np.nan, BF16)
    assert lib.copy_into(target, x) is target
    np.testing.assert_array_equal(target, x)


def test_torch_tensors_round_trip_exactly(rng):
    torch = pytest.importorskip("torch")
    x = rng.standard_normal((3, 5)).astype(BF16)
    t = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    lib = runtime.ArrayLib(t)
    np.testing.assert_array_equal(lib.numpy(t), x)  # every bf16 bit kept
    back = lib.like(x)
    assert back.dtype == torch.bfloat16 and torch.equal(back, t)
    assert lib.empty((2,), kiln.i32).dtype == torch.int32
    assert lib.full((2,), -1.0, kiln.f32).tolist() == [-1.0, -1.0]
    assert runtime.spec(t) != runtime.spec(t.t().contiguous().t())
    assert runtime.bindable(t) is False  # the CUDA runtime binds CUDA tensors only
    with runtime.use_runtime(runtime.DryRuntime()):
        assert runtime.bindable(t) and not runtime.bindable(t.t())


# --- errors at the caller's line ------------------------------------------------------------

@pytest.mark.parametrize("entry", ENTRIES)
def test_a_bad_backend_is_reported_at_the_callers_line(rng, entry):
    fn, args = _calls(rng)[entry]
    line = inspect.currentframe().f_lineno + 2
    with pytest.raises(kiln.KilnValueError, match="backend='cpu' is not one of") as info:
        fn(*args, backend="cpu")
    assert info.value.loc.filename == __file__ and info.value.loc.line == line
    assert info.value.fix


# --- the steady state of torch calls: a plan hit and bound launches --------------------------

def _torch_calls(torch, rng):
    def t(x):
        return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16) \
            if x.dtype == BF16 else torch.from_numpy(np.ascontiguousarray(x))

    q = t(rng.standard_normal((1, 128, 2, 64)).astype(BF16))
    a, b = (t(rng.standard_normal(s).astype(BF16)) for s in ((64, 32), (32, 48)))
    return {
        "prefill": (lambda: prefill(q, q, q, causal=True), 1),
        "decode": (lambda: decode(*_decode_args(rng, lib=t)), 1),
        "decode_attention": (lambda: decode_attention(*_decode_args(rng, lib=t)), 1),
        "decode_attention-unfused": (
            lambda: decode_attention(*_decode_args(rng, lib=t), fused_combine=False), 2),
        "combine": (lambda: combine(*(t(x) for x in _partials(rng))), 1),
        "matmul": (lambda: matmul(a, b), 1),
    }


@pytest.mark.parametrize("entry", ["prefill", "decode", "decode_attention",
                                   "decode_attention-unfused", "combine", "matmul"])
def test_a_repeat_torch_call_is_a_plan_hit_and_bound_launches(dry, rng, entry):
    """After the first call of a shape class, a call makes no plan, binds nothing, launches
    nothing through the general path: its kernels run as the plan's bound launches."""
    torch = pytest.importorskip("torch")
    call, launches = _torch_calls(torch, rng)[entry]
    first = call()
    binds, general, bound = len(dry.binds), len(dry.launches), dry.bound_calls
    builds = [cache.builds for cache in runtime._CACHES]
    again = call()
    assert [cache.builds for cache in runtime._CACHES] == builds
    assert (len(dry.binds), len(dry.launches)) == (binds, general)
    assert dry.bound_calls == bound + launches
    for x, y in zip(first if isinstance(first, tuple) else (first,),
                    again if isinstance(again, tuple) else (again,)):
        assert isinstance(y, torch.Tensor) and (y.shape, y.dtype) == (x.shape, x.dtype)


# --- bench/launch_overhead.py: what runs without a GPU -----------------------------------------

def test_the_launch_overhead_bench_times_the_library_without_a_gpu(monkeypatch):
    import pathlib
    import sys

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent.parent / "bench"))
    monkeypatch.setattr(hopper_autotuner, "best", dict(hopper_autotuner.best))
    bench = importlib.import_module("launch_overhead")
    results = bench.run(10, 1)  # on a GPU machine the whole run, here its skip
    assert "skipped" in results or len(results["library"]) == 6
    rows = importlib.import_module("launch_overhead_host").run_library_host_only(5, 1)
    if "torch" not in sys.modules:
        assert rows == "torch is not installed"
        return
    assert [row["path"].split()[0] for row in rows] == [
        "prefill", "decode", "decode_attention", "decode_attention", "combine", "matmul"]
    assert all(row[key] > 0 for row in rows for key in ("us", "one_call_us", "python_us"))
