"""One C call a library call (kiln.kernels.one_call, the shim's ``call_plan``): with recording
stand-ins for the driver, a call whose values match its plan launches every kernel with the
addresses its items name (inputs, fresh outputs, per-stream buffers, fixed addresses) on the
current stream and returns the outputs; any value that differs gives None with nothing
launched; per-stream buffers are kept for eager calls and asked for per capture; errors
raise; a descriptor memo miss launches through the fallback. The library's entry points on
torch CPU tensors (where torch is installed): their repeat calls are one C call, launching
what their Python paths launch."""

import gc
import importlib
import pathlib
import shutil
import weakref

import numpy as np
import pytest

from kiln.core.errors import LaunchError
from kiln.kernels import one_call as one_call_module, runtime
from kiln.kernels.one_call import (address, clear_slots, one_call, one_call_hits, output,
                                   space, use_one_call, value)
from kiln.runtime import native
from kiln.runtime.launch import _LaunchPlan, bind_launch
from kiln.signature import KernelSignature, TensorMapParam, TensorParam
from test_native_launch import _Device, _Fresh, _launcher

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    return native.load_shim("cc", tmp_path_factory.mktemp("native"))


@pytest.fixture
def stand_ins(shim, monkeypatch):
    """one_call with the test's shim, taking _Fresh objects as tensors, all passing a check."""
    monkeypatch.setattr("kiln.kernels.one_call.native_module", lambda: shim)
    monkeypatch.setattr("kiln.kernels.one_call.is_torch", lambda v: isinstance(v, _Fresh))
    monkeypatch.setattr("kiln.kernels.one_call._tensor_check", lambda tensors: lambda *t: True)
    return shim


def _bound(shim, name, ranks, driver=None):
    """A bound launch of a kernel of ``len(ranks)`` f32 tensors over a recording driver."""
    signature = KernelSignature(name, tuple(TensorParam(f"t{i}", "f32", rank)
                                            for i, rank in enumerate(ranks)), block=(32, 1, 1))
    launcher, recorder = _launcher("native", shim, signature)
    plan = _LaunchPlan(name, signature, launcher, driver)
    ck = type("CK", (), {"name": name, "signature": signature, "_launch_plan": plan})()
    example = [_Device(0x1000 * (i + 1), (4,) * rank) for i, rank in enumerate(ranks)]
    return bind_launch(ck, (2, 1, 1), example), recorder


class _Spaces:
    """A StreamWorkspaces stand-in: counts the sets it makes, captures per ``capture``."""

    native_check = False  # capturing() is the test's (torch's would be native_check)

    def __init__(self, keep=True):
        self.keep, self.capture, self.made = keep, False, []

    def capturing(self):
        return self.capture

    def get(self, stream):
        owner = [stream, len(self.made)]
        self.made.append(owner)
        return owner, tuple(0x50000 + 0x100 * len(self.made) + i * 16 for i in range(3))


def _plan(shim, keep=True):
    """A two-launch call plan: values (x tensor, n int, flag None, mode str); the first launch
    takes x, the fresh o and the buffers' first two addresses; the second the buffer's third,
    a fixed address and o."""
    first, rec1 = _bound(shim, "first", (1, 2, 1, 1))
    second, rec2 = _bound(shim, "second", (1, 1, 2))
    spaces, streams = _Spaces(keep), [0x77]
    made = []

    def make():
        made.append(_Fresh(0x9000 * (len(made) + 1)))
        return made[-1]

    call = one_call((_Fresh(0x100), 3, None, "fast"),
                    [(first, [value(0), output(0), space(0), space(1)]),
                     (second, [space(2), address(0x4242), output(0)])],
                    stream=lambda: streams[0], makers=(make,), workspace=spaces,
                    aligns=((0, 256),))
    return call, (rec1, rec2), spaces, streams, made


def _args(launch):
    return launch[5]


def test_a_matching_call_launches_every_kernel_with_its_items(shim, stand_ins, monkeypatch):
    call, (rec1, rec2), spaces, streams, made = _plan(shim)
    rng = np.random.default_rng(0)
    for round_ in range(3):
        x = int(rng.integers(1, 1 << 30)) * 256
        out = call(_Fresh(x), 3, None, "fast")
        assert out is made[-1] and call.hits == round_ + 1
        ws = tuple(0x50000 + 0x100 + i * 16 for i in range(3))  # the stream's one set
        o = out.address
        assert _args(rec1.launches[-1]) == [x, x, 0, 4, 1, o, o, 0, 4, 4, 4, 1,
                                            ws[0], ws[0], 0, 4, 1, ws[1], ws[1], 0, 4, 1]
        assert _args(rec2.launches[-1]) == [ws[2], ws[2], 0, 4, 1, 0x4242, 0x4242, 0, 4, 1,
                                            o, o, 0, 4, 4, 4, 1]
        assert rec1.launches[-1][4] == rec2.launches[-1][4] == 0x77
    assert len(spaces.made) == 1  # kept for the stream
    streams[0] = 0x88  # another stream: its own set, then kept
    call(_Fresh(256), 3, None, "fast")
    call(_Fresh(256), 3, None, "fast")
    assert len(spaces.made) == 2 and rec1.launches[-1][4] == 0x88
    spaces.capture = True  # a capture: asked every call
    call(_Fresh(256), 3, None, "fast")
    call(_Fresh(256), 3, None, "fast")
    assert len(spaces.made) == 4


def test_the_drivers_capture_check_decides_when_the_runtime_has_one(shim, stand_ins,
                                                                   monkeypatch):
    """cuStreamIsCapturing by its address (a ctypes stand-in here): status 0 keeps the
    stream's set, a capture or an error asks the getter every call, with the stream handle."""
    import ctypes

    answers, asked = [(0, 0)], []

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))
    def is_capturing(stream, status):
        asked.append(stream)
        status[0] = answers[0][1]
        return answers[0][0]

    monkeypatch.setattr(_Spaces, "native_check", True)
    monkeypatch.setattr("kiln.kernels.one_call.capture_status_address",
                        lambda: ctypes.cast(is_capturing, ctypes.c_void_p).value)
    call, recorders, spaces, streams, _ = _plan(shim)
    spaces.capture = True  # the Python check would say so: the driver's is asked instead
    for answer, sets in (((0, 0), 1), ((0, 0), 1), ((0, 1), 2), ((0, 1), 3), ((900, 0), 4)):
        answers[0] = answer
        assert call(_Fresh(256), 3, None, "fast") is not None
        assert len(spaces.made) == sets and asked[-1] == 0x77


@pytest.mark.parametrize("args", [
    (_Fresh(256), 4, None, "fast"),       # another constant
    (_Fresh(256), 3.0, None, "fast"),     # another type
    (_Fresh(256), 3, 0, "fast"),          # not None
    (_Fresh(264), 3, None, "fast"),       # misaligned
    (_Device(256, (4,)), 3, None, "fast"),  # another tensor type
    (_Fresh(256), 3, None),               # fewer values
])
def test_any_other_call_gives_none_and_launches_nothing(shim, stand_ins, monkeypatch, args):
    call, recorders, spaces, streams, made = _plan(shim)
    assert call(*args) is None
    assert not any(r.launches for r in recorders) and not made and not spaces.made
    assert call.hits == 0


def test_keywords_give_none(shim, stand_ins, monkeypatch):
    call, recorders, _, _, _ = _plan(shim)
    assert call(_Fresh(256), 3, None, mode="fast") is None and not recorders[0].launches


def test_the_checker_sees_the_tensors_and_decides(shim, stand_ins, monkeypatch):
    seen, verdict = [], [False]

    def checker(*tensors):
        seen.append(tensors)
        return verdict[0]

    monkeypatch.setattr("kiln.kernels.one_call._tensor_check", lambda tensors: checker)
    call, recorders, _, _, _ = _plan(shim)
    x = _Fresh(512)
    assert call(x, 3, None, "fast") is None and seen[-1] == (x,)
    verdict[0] = True
    assert call(x, 3, None, "fast") is not None and len(recorders[0].launches) == 1


def test_errors_raise_and_a_refused_launch_is_a_launch_error(shim, stand_ins, monkeypatch):
    first, recorder = _bound(shim, "first", (1,))
    failing = one_call((_Fresh(256),), [(first, [value(0)])], stream=lambda: 0,
                       makers=(lambda: 1 / 0,))
    with pytest.raises(ZeroDivisionError):
        failing(_Fresh(256))
    no_stream = one_call((_Fresh(256),), [(first, [value(0)])], stream=lambda: "s")
    with pytest.raises(TypeError):
        no_stream(_Fresh(256))
    assert not recorder.launches
    plain = one_call((_Fresh(256),), [(first, [value(0)])], stream=lambda: None)
    assert plain(_Fresh(768)) is None and recorder.launches[-1][4] is None  # legacy stream
    recorder.refuse.append(700)
    with pytest.raises(LaunchError):
        plain(_Fresh(256))


def test_given_outputs_are_returned_and_bad_specs_are_refused(shim, stand_ins, monkeypatch):
    first, recorder = _bound(shim, "first", (1, 1))
    call = one_call((_Fresh(256), _Fresh(512)), [(first, [value(0), value(1)])],
                    stream=lambda: 5, result=(1, 0))
    x, o = _Fresh(1024), _Fresh(2048)
    assert call(x, o) == (o, x) and _args(recorder.launches[-1])[5] == 2048
    with pytest.raises(TypeError, match="one item per address"):
        one_call((_Fresh(256),), [(first, [value(0)])], stream=lambda: 0)
    with pytest.raises(TypeError, match="out of range"):
        one_call((_Fresh(256),), [(first, [value(0), value(3)])], stream=lambda: 0)
    with pytest.raises(TypeError, match="names values"):
        one_call((_Fresh(256),), [(first, [value(0), value(0)])], stream=lambda: 0,
                 result=(2,))


def test_no_shim_no_exact_value_or_no_native_launch_gives_no_one_call(shim, stand_ins, monkeypatch):
    first, _ = _bound(shim, "first", (1,))
    items = [(first, [value(0)])]
    assert one_call((_Fresh(256), float("nan")), items, stream=int) is None
    assert one_call((_Fresh(256),), [(object(), [value(0)])], stream=int) is None
    use_one_call(False)
    try:
        assert one_call((_Fresh(256),), items, stream=int) is None
    finally:
        use_one_call(True)
    monkeypatch.setattr("kiln.kernels.one_call.native_module", lambda: None)
    assert one_call((_Fresh(256),), items, stream=int) is None


def test_a_descriptor_memo_miss_launches_through_the_fallback(shim, stand_ins, monkeypatch):
    from test_launch_capture import CapturingDriver

    signature = KernelSignature("m", (TensorMapParam("t", "f16", 2, (64, 64), 128),
                                      TensorParam("o", "f32", 1)), block=(32, 1, 1))
    launcher, recorder = _launcher("native", shim, signature)
    plan = _LaunchPlan("m", signature, launcher, CapturingDriver())
    ck = type("CK", (), {"name": "m", "signature": signature, "_launch_plan": plan})()
    bound = bind_launch(ck, (1, 1, 1), [_Device(0x10000, (256, 128), "<f2"),
                                        _Device(0x8000, (4,))])
    call = one_call((_Fresh(0x20000),), [(bound, [value(0), output(0)])], stream=lambda: 9,
                    makers=(lambda: _Fresh(0x30000),))
    for _ in range(2):  # a miss (encoded through the fallback, memoised), then a hit
        call(_Fresh(0x20000))
        descriptor = _args(recorder.launches[-1])[0]
        assert descriptor not in (0, 0x20000) and recorder.launches[-1][4] == 9
    assert len(recorder.launches) == 2 and call.hits == 2


def test_a_call_plan_in_a_reference_cycle_is_collected(shim, stand_ins, monkeypatch):
    first, _ = _bound(shim, "first", (1,))

    class Owner:
        pass

    owner = Owner()
    owner.call = one_call((_Fresh(256),), [(first, [value(0)])], stream=lambda: owner and 0)
    gone = weakref.ref(owner)
    del owner
    gc.collect()
    assert gone() is None


# --- the entry points on torch CPU tensors ----------------------------------------------------

class _RecordingRuntime:
    """Real bound launches of the library's kernels (compiled as on the GPU machine) over
    recording drivers, for torch CPU tensors: ``launches`` collects (kernel, arguments)."""

    device_type = "cpu"

    def __init__(self, shim):
        self._shim, self.recorders = shim, []
        self._dry = runtime.DryRuntime()
        self.launch = self._dry.launch
        self.multiprocessor_count = self._dry.multiprocessor_count
        self.max_active_clusters = self._dry.max_active_clusters

    def bind(self, kernel, grid, args, **options):
        from launch_host_cpu import cpu_torch_as_device
        from launch_overhead_host import _FakeDriver
        from recording_runtime import RecordingDriver
        from kiln.runtime.driver_launch import DriverFunctions, DriverLauncher

        ck = kernel.compile(*args, **options)
        recorder = RecordingDriver(ck.signature)
        self.recorders.append((ck.name, recorder))
        plan = _LaunchPlan(ck.name, ck.signature, DriverLauncher(
            ck.signature, RecordingDriver.FUNCTION, DriverFunctions(recorder.symbols(), None),
            self._shim), _FakeDriver())
        ck._launch_plan = plan
        with cpu_torch_as_device():
            bound = bind_launch(ck, grid, args)
        bound.current_stream = bound._current_stream = lambda: 0x33
        return bound

    def launched(self) -> list:
        return sorted((name, launch[5]) for name, r in self.recorders for launch in r.launches)


@pytest.fixture
def torch_library(shim, monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent.parent / "bench"))
    monkeypatch.setattr("kiln.runtime.native.native_module", lambda: shim)
    monkeypatch.setattr("kiln.kernels.runtime.native_module", lambda: shim)
    monkeypatch.setattr("kiln.kernels.one_call.native_module", lambda: shim)
    from kiln.kernels.gemm import HOPPER_CONFIGS, hopper_autotuner

    key = hopper_autotuner.key_of((None, None, None, 1024, 1024, 1024, "bf16", "mn", "bf16",
                                   "sm_90a"), {})
    monkeypatch.setitem(hopper_autotuner.best, key, HOPPER_CONFIGS[0])
    runtime.clear_plans()  # a plan an earlier test made keeps the one-call object it built then
    yield torch, importlib.import_module("launch_overhead").library_calls
    runtime.clear_plans()


def _served(seen: dict) -> int:
    """Calls served by every one-call object seen in the slots so far (``seen``: by id)."""
    for slot in one_call_module._SLOTS:
        if slot.call is not None:
            seen[id(slot.call)] = slot.call
    return sum(call.hits for call in seen.values())


def _unfused(torch):
    """decode_attention unfused (decode's launch, then combine's) on library_calls' inputs."""
    from kiln.kernels.attention import decode_attention

    gen = torch.Generator().manual_seed(0)
    paged = (torch.randn(1, 1, 32, 128, generator=gen).bfloat16(),
             torch.randn(64, 64, 8, 128, generator=gen).bfloat16(),
             torch.randn(64, 64, 8, 128, generator=gen).bfloat16(),
             torch.randperm(64, generator=gen).int()[None], torch.tensor([4000]).int())
    return lambda: decode_attention(*paged, target="sm_90a", fused_combine=False)


@pytest.mark.parametrize("name", ["prefill", "decode ", "decode_attention (same)",
                                  "decode_attention (same, out=", "combine", "matmul",
                                  "unfused"])
def test_entry_points_repeat_calls_are_one_call_launching_what_python_does(torch_library,
                                                                           shim, name):
    """The Python path (its slot emptied before the call) and the one call, in turns on one
    plan: every argument that is the same in two Python calls (inputs, buffers, sizes) is the
    same in the one calls, and every one that differs (a fresh output's address) differs."""
    torch, library_calls = torch_library
    with runtime.use_runtime(_RecordingRuntime(shim)) as rt:
        call = _unfused(torch) if name == "unfused" else next(
            c for n, c in library_calls(torch, "cpu").items() if n.startswith(name))
        call()
        kept, launched, seen = [], {False: [], True: []}, {}
        _served(seen)  # the slot's object, with the calls it served so far
        for one in (False, True, False, True):
            if not one:
                clear_slots()
            before = [len(r.launches) for _, r in rt.recorders]
            hits = _served(seen)
            kept.append(call())
            assert _served(seen) - hits == int(one)
            launched[one].append([launch[5] for (_, r), n in zip(rt.recorders, before)
                                  for launch in r.launches[n:]])
    (py1, py2), (one1, one2) = launched[False], launched[True]
    assert len(py1) == len(py2) == len(one1) == len(one2) == (2 if name == "unfused" else 1)
    fresh = 0
    for p1, p2, o1, o2 in zip(py1, py2, one1, one2):
        for a, b, c, d in zip(p1, p2, o1, o2):
            assert (a == b) == (c == d) == (a == c)
            fresh += a != b
    assert fresh > 0 or "out=" in name  # fresh outputs, except into the caller's


def test_clearing_plans_empties_the_slots(torch_library, shim):
    torch, library_calls = torch_library
    with runtime.use_runtime(_RecordingRuntime(shim)):
        call = library_calls(torch, "cpu")["combine (decode's partials)"]
        call()
        assert one_call_hits() == 0 and call() is not None and one_call_hits() == 1
        runtime.clear_plans()
        assert one_call_hits() == 0
    clear_slots()
