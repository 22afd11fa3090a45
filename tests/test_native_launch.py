"""The driver launcher (kiln.runtime.driver_launch) and its native shim (kiln.runtime.native),
with the driver replaced by recording stand-ins: what reaches cuLaunchKernel(Ex) through the
shim and through ctypes, context and error handling, and the shim's cache trust (a tampered,
foreign or planted library is never loaded but rebuilt; no compiler means ctypes)."""

import ctypes
import hashlib
import json
import os
import shutil
import struct
import warnings

import numpy as np
import pytest

from kiln.core.errors import CacheWarning, KilnValueError, LaunchError
from kiln.runtime import native
from kiln.runtime.driver_launch import (CLUSTER_DIMENSION, CLUSTER_SCHEDULING_POLICY_PREFERENCE,
                                        PROGRAMMATIC_STREAM_SERIALIZATION, DriverFunctions,
                                        DriverLauncher)
from kiln.runtime.launch import _LaunchPlan, bind_launch
from kiln.signature import KernelSignature, ScalarParam, TensorMapParam, TensorParam
from recording_runtime import RecordingDriver

HAVE_CC = shutil.which("cc") is not None
SHIMS = ["native", "ctypes"]

SIGNATURE = KernelSignature(
    "mixed", (TensorParam("x", "f32", 2), ScalarParam("n", "i32"), ScalarParam("a", "f32"),
              ScalarParam("h", "f16"), ScalarParam("k", "i64"), TensorParam("y", "bf16", 1)),
    block=(128, 2, 1), dynamic_shared_bytes=4096)


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    if not HAVE_CC:
        pytest.skip("no C compiler")
    return native.load_shim("cc", tmp_path_factory.mktemp("native"))


def _launcher(kind, shim, signature=SIGNATURE, context=None):
    driver = RecordingDriver(signature)
    launcher = DriverLauncher(signature, RecordingDriver.FUNCTION,
                              DriverFunctions(driver.symbols(), context),
                              shim if kind == "native" else None)
    return launcher, driver


def _random_flat(rng):
    """Flat C arguments of SIGNATURE on fresh random values, and what the kernel must see."""
    x, y = (int(v) * 16 for v in rng.integers(1, 1 << 40, size=2))
    rows, cols = (int(v) for v in rng.integers(1, 5000, size=2))
    n, k = int(rng.integers(-2**31, 2**31)), int(rng.integers(-2**63, 2**63))
    a = float(np.float32(rng.standard_normal()))
    h = int(np.float16(rng.standard_normal()).view(np.uint16))
    flat = [x, x, 0, rows, cols, cols, 1, n, a, h, k, y, y, 0, rows, 1]
    return flat, flat


@pytest.mark.parametrize("kind", SHIMS)
def test_launches_pass_every_argument_grid_and_stream(kind, shim, rng):
    launcher, driver = _launcher(kind, shim)
    for _ in range(5):
        flat, expected = _random_flat(rng)
        grid = tuple(int(g) for g in rng.integers(1, 1000, size=3))
        stream = int(rng.integers(1, 1 << 48))
        launcher(flat, grid, stream)
        function, got_grid, block, smem, got_stream, args, _ = driver.launches[-1]
        assert (function, got_grid, block, smem, got_stream) == \
            (RecordingDriver.FUNCTION, grid, (128, 2, 1), 4096, stream)
        assert args == expected
    launcher(flat, (1, 1, 1), None)  # the legacy default stream
    assert driver.launches[-1][4] is None


@pytest.mark.parametrize("kind", SHIMS)
def test_values_that_do_not_fit_are_refused_before_the_driver(kind, shim):
    launcher, driver = _launcher(kind, shim)
    flat, _ = _random_flat(np.random.default_rng(0))
    flat[7] = 2**31
    with pytest.raises(KilnValueError, match="do not fit"):
        launcher(flat, (1, 1, 1), None)
    assert driver.launches == []


@pytest.mark.parametrize("kind", SHIMS)
def test_cluster_and_programmatic_launches_carry_their_attributes(kind, shim):
    cluster = KernelSignature("c", (ScalarParam("n", "i32"),), block=(64, 1, 1),
                              cluster=(2, 1, 1))
    launcher, driver = _launcher(kind, shim, cluster)
    launcher([7], (4, 3, 1), 0x50)
    assert driver.configs == [[(CLUSTER_DIMENSION, (2, 1, 1)),
                               (CLUSTER_SCHEDULING_POLICY_PREFERENCE, (1, 0, 0))]]
    assert driver.launches[-1][1:6] == ((4, 3, 1), (64, 1, 1), 0, 0x50, [7])
    programmatic = KernelSignature("p", (ScalarParam("n", "i32"),), block=(32, 1, 1),
                                   programmatic_launch=True)
    launcher, driver = _launcher(kind, shim, programmatic)
    launcher([5], (2, 1, 1), 0x60)
    assert driver.configs == [[(PROGRAMMATIC_STREAM_SERIALIZATION, (1, 0, 0))]]
    driver.refuse = [1]  # the attribute refused: a plain launch, as MLIR's shim does
    launcher([6], (2, 1, 1), 0x60)
    assert len(driver.configs) == 1 and driver.launches[-1][5] == [6]


@pytest.mark.parametrize("kind", SHIMS)
def test_a_thread_without_the_context_gets_it_and_errors_raise(kind, shim):
    launcher, driver = _launcher(kind, shim, context=0x7777)
    flat, expected = _random_flat(np.random.default_rng(1))
    driver.refuse = [201]  # CUDA_ERROR_INVALID_CONTEXT: made current, launched again
    launcher(flat, (1, 1, 1), None)
    assert driver.context_calls == [("set", 0x7777)] and driver.launches[-1][5] == expected
    driver.refuse = [400]  # another context current: pushed and popped around a retry
    launcher(flat, (1, 1, 1), None)
    assert driver.context_calls[1:] == [("push", 0x7777), ("pop", None)]
    driver.refuse = [700, 700]  # refused either way: LaunchError, never a silent miss
    with pytest.raises(LaunchError, match="700"):
        launcher(flat, (1, 1, 1), None)
    assert len(driver.launches) == 2


@pytest.mark.parametrize("kind", SHIMS)
def test_bound_launches_write_addresses_and_descriptors(kind, shim, rng):
    signature = KernelSignature("b", (TensorParam("x", "f32", 1),
                                      TensorMapParam("t", "f32", 2, box=(8, 8)),
                                      ScalarParam("n", "i32")), block=(32, 1, 1))
    launcher, driver = _launcher(kind, shim, signature)
    plan = _LaunchPlan("b", signature, launcher, None)
    descriptors = {}

    def descriptor(param, ptr, shape, strides, staging=None, stream=None):
        return descriptors.setdefault(ptr, 0x900000 + 0x80 * len(descriptors))

    plan.tensor_maps.descriptor = descriptor
    ck = type("CK", (), {"name": "b", "signature": signature, "_launch_plan": plan})()
    example = _Device(0x1000, (64,)), _Device(0x2000, (16, 16))
    bound = bind_launch(ck, (3, 1, 1), [*example, 99])
    for _ in range(3):
        x, t = (int(v) * 256 for v in rng.integers(1, 1 << 30, size=2))
        bound(x, t, stream=0x42)
        assert driver.launches[-1][1] == (3, 1, 1) and driver.launches[-1][4] == 0x42
        assert driver.launches[-1][5] == [x, x, 0, 64, 1, descriptors[t], 99]
    with pytest.raises(KilnValueError, match="binds 2 tensors"):
        bound(1)


class _Device:
    """A device array by ``__cuda_array_interface__``; never dereferenced."""

    def __init__(self, ptr, shape, typestr="<f4"):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": shape,
                                         "typestr": typestr, "strides": None, "version": 3}


# --- the shim's build cache ------------------------------------------------------------------

needs_cc = pytest.mark.skipif(not HAVE_CC, reason="no C compiler")


def _builds(monkeypatch):
    count = []
    original = native._build

    def counted(*args):
        count.append(args)
        return original(*args)

    monkeypatch.setattr(native, "_build", counted)
    return count


def _files(root):
    (library,) = root.glob("*.so")
    return library, library.with_suffix(".json")


@needs_cc
def test_the_shim_is_built_once_and_then_loaded_from_the_cache(tmp_path, monkeypatch):
    builds = _builds(monkeypatch)
    first = native.load_shim("cc", tmp_path)
    second = native.load_shim("cc", tmp_path)
    assert first is not None and second is not None and len(builds) == 1
    library, record = _files(tmp_path)
    assert json.loads(record.read_bytes())["sha256"] == \
        hashlib.sha256(library.read_bytes()).hexdigest()
    assert library.stat().st_mode & 0o077 == 0 and not list(tmp_path.glob(".load.*"))


@pytest.fixture(scope="module")
def shim_bytes(tmp_path_factory) -> bytes:
    """One real build of the shim, for the tests that only need some valid library."""
    root = tmp_path_factory.mktemp("shim")
    native.load_shim("cc", root)
    return _files(root)[0].read_bytes()


def _copying_builds(monkeypatch, data: bytes) -> None:
    """Builds that install ``data`` as the real build does (a fresh file replacing whatever is
    at the target path): a C compile per build cost most of these tests' time."""
    def build(ext, directory, key):
        target = directory / f"{key}.so"
        scratch = directory / f".{key[:16]}.copy.so"
        scratch.write_bytes(data)
        os.chmod(scratch, 0o600)
        os.replace(scratch, target)
        return target

    monkeypatch.setattr(native, "_build", build)


@needs_cc
@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "foreign record", "symlink",
                                    "other owner"])
def test_a_damaged_or_foreign_shim_is_never_loaded_but_rebuilt(tmp_path, monkeypatch, damage,
                                                               shim_bytes):
    _copying_builds(monkeypatch, shim_bytes)
    native.load_shim("cc", tmp_path)
    library, record = _files(tmp_path)
    if damage == "flipped byte":
        data = bytearray(library.read_bytes())
        data[len(data) // 2] ^= 0xFF
        library.write_bytes(bytes(data))
    elif damage == "truncated":
        library.write_bytes(library.read_bytes()[:100])
    elif damage == "foreign record":  # a consistent record, but of another key
        entry = json.loads(record.read_bytes())
        record.write_text(json.dumps({**entry, "key": "0" * 64}))
    elif damage == "symlink":
        planted = tmp_path / "planted.so"
        library.rename(planted)
        library.symlink_to(planted)
    else:
        if os.getuid() != 0:
            pytest.skip("changing a file's owner needs root")
        os.chown(library, 12345, -1)
    loads = []
    monkeypatch.setattr(native, "_load", lambda ext, data, directory: loads.append(data) or "shim")
    builds = _builds(monkeypatch)
    monkeypatch.setattr(native, "warn_once", lambda reason, message: warnings.warn(
        message, CacheWarning))
    with pytest.warns(CacheWarning, match="native launch shim"):
        assert native.load_shim("cc", tmp_path) == "shim"
    assert len(builds) == 1
    rebuilt = library.read_bytes() if not library.is_symlink() else b""
    assert loads == [rebuilt] and \
        json.loads(record.read_bytes())["sha256"] == hashlib.sha256(rebuilt).hexdigest()


def test_without_a_compiler_there_is_no_shim_and_launches_go_through_ctypes(tmp_path,
                                                                           monkeypatch, rng):
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    assert native.load_shim("cc", tmp_path) is None
    assert native.load_shim(None, tmp_path) is None  # KILN_CC=none
    assert not list(tmp_path.iterdir())
    launcher, driver = _launcher("ctypes", None)
    flat, expected = _random_flat(rng)
    launcher(flat, (2, 2, 2), 0x10)
    assert driver.launches[-1][5] == expected


def test_a_failing_compiler_warns_once_and_gives_no_shim(tmp_path, monkeypatch):
    failing = tmp_path / "cc"
    failing.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo fake-cc 1.0 && exit 0\n"
                       "echo 'error: no' >&2; exit 1\n")
    failing.chmod(0o755)
    root = tmp_path / "cache"
    with pytest.warns(CacheWarning, match="could not build"):
        assert native.load_shim(str(failing), root) is None
    assert not list(root.glob("*.so"))


def test_the_key_covers_source_compiler_and_python():
    base = native.shim_key(b"src", "cc 1", "/inc")
    assert len({base, native.shim_key(b"src2", "cc 1", "/inc"),
                native.shim_key(b"src", "cc 2", "/inc"),
                native.shim_key(b"src", "cc 1", "/inc2")}) == 4


def test_the_record_layout_matches_the_shim(shim):
    from kiln.runtime.driver_launch import _Record

    assert shim.RECORD_BYTES == ctypes.sizeof(_Record)
    assert struct.calcsize("P") == 8


@pytest.mark.parametrize("kind", SHIMS)
def test_bound_descriptor_memo_follows_evictions_and_skips_captures(kind, shim):
    from test_launch_capture import CapturingDriver

    signature = KernelSignature("m", (TensorMapParam("t", "f16", 2, (64, 64), 128),),
                                block=(32, 1, 1))
    launcher, recorder = _launcher(kind, shim, signature)
    device = CapturingDriver()
    plan = _LaunchPlan("m", signature, launcher, device)
    plan.tensor_maps.capacity = 2
    ck = type("CK", (), {"name": "m", "signature": signature, "_launch_plan": plan})()
    bound = bind_launch(ck, (1, 1, 1), [_Device(0x10000, (256, 128), "<f2")])
    encoded = len(device.encoded)
    for _ in range(3):  # a repeat address: the memo, no new descriptor
        bound(0x20000)
    assert len(device.encoded) == encoded + 1
    first = recorder.launches[-1][5][0]
    bound(0x30000)
    bound(0x40000)  # evicts 0x20000's descriptor (capacity 2): the memo is dropped
    bound(0x20000)
    assert device.freed and recorder.launches[-1][5][0] not in (first,) + tuple(device.freed)
    assert device.encoded[-1] == 0x20000
    device.capturing.add(0x77)
    bound(0x50000, stream=0x77)  # first needed in a capture: the arena's slot, not memoised
    captured = recorder.launches[-1][5][0]
    device.capturing.clear()
    bound(0x50000, stream=0x77)
    assert recorder.launches[-1][5][0] != captured and device.encoded[-1] == 0x50000


@pytest.mark.parametrize("kind", SHIMS)
def test_bound_descriptor_memo_serves_many_tensors_in_turn(kind, shim):
    """A serving loop cycles through many caches (one per layer): every address keeps its
    descriptor (encoded once), whichever memo way it shares with others, through the bound
    launch and through launch_on (a miss there calls the bound launch back)."""
    from test_launch_capture import CapturingDriver

    signature = KernelSignature("m", (TensorMapParam("t", "f16", 2, (64, 64), 128),
                                      TensorParam("x", "f32", 1)), block=(32, 1, 1))
    launcher, recorder = _launcher(kind, shim, signature)
    device = CapturingDriver()
    plan = _LaunchPlan("m", signature, launcher, device)
    ck = type("CK", (), {"name": "m", "signature": signature, "_launch_plan": plan})()
    bound = bind_launch(ck, (1, 1, 1), [_Device(0x10000, (256, 128), "<f2"),
                                        _Device(0x8000, (4,), "<f4")])
    addresses = [0x100000 + 0x200 * i * (7 if i % 2 else 1) for i in range(40)]
    before, seen = len(device.encoded), {}
    for round_ in range(3):
        for i, address in enumerate(addresses):
            if (round_ + i) % 2:  # an entry point's C call on the stream it read
                bound.launch_on(0x5150 + i, address, 0x9000 + i)
                assert recorder.launches[-1][4] == 0x5150 + i
            else:
                bound(address, 0x9000 + i)
            descriptor, pointer = recorder.launches[-1][5][:2]
            assert pointer == 0x9000 + i
            assert seen.setdefault(address, descriptor) == descriptor
    assert len(set(seen.values())) == len(addresses)
    assert device.encoded[before:] == addresses  # once each, in the first round


@pytest.mark.parametrize("kind", SHIMS)
def test_the_module_is_loaded_once_and_unloaded_with_the_launcher(kind, shim):
    from kiln.runtime.driver_launch import (MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                            load_driver_launcher)

    recorder = RecordingDriver(SIGNATURE)
    calls = []
    fake = type("FakeDriver", (), {
        "context": 0x7777,
        "launch_symbols": lambda self: recorder.symbols(),
        "load_function": lambda self, image, name: calls.append(("load", image, name)) or
        (0x10, RecordingDriver.FUNCTION),
        "set_function_attribute": lambda self, f, a, v: calls.append(("attribute", f, a, v)),
        "unload_module": lambda self, module: calls.append(("unload", module)),
    })()
    launcher = load_driver_launcher(SIGNATURE, b"cubin", fake, shim if kind == "native" else None)
    flat, expected = _random_flat(np.random.default_rng(2))
    for _ in range(3):
        launcher(flat, (1, 1, 1), None)
    assert calls == [("load", b"cubin", "mixed"),
                     ("attribute", RecordingDriver.FUNCTION, MAX_DYNAMIC_SHARED_SIZE_BYTES, 4096)]
    assert [launch[5] for launch in recorder.launches] == [expected] * 3
    del launcher  # no reference cycle: unloaded at once, not by the cyclic collector
    assert calls[-1] == ("unload", 0x10)


def test_the_launcher_and_compiler_variables_are_checked(monkeypatch):
    from kiln.core import env

    monkeypatch.setenv("KILN_LAUNCHER", "cuda-bindings")
    with pytest.raises(KilnValueError, match="KILN_LAUNCHER.*native or ctypes or mlir"):
        env.launcher()
    monkeypatch.setenv("KILN_LAUNCHER", " MLIR ")
    assert env.launcher() == "mlir"
    monkeypatch.setenv("KILN_CC", "None")
    assert env.c_compiler() is None
    monkeypatch.setenv("KILN_CC", "clang")
    assert env.c_compiler() == "clang"
    monkeypatch.setenv("KILN_CXX", " NONE ")
    assert env.cxx_compiler() is None
    monkeypatch.delenv("KILN_CXX")
    assert env.cxx_compiler() == "c++"


class _Fresh:
    """A fresh output: an object with a device address, as a torch tensor has."""

    def __init__(self, address):
        self.address = address

    def data_ptr(self):
        return self.address


@pytest.mark.parametrize("kind", SHIMS)
def test_launch_outputs_makes_outputs_reads_addresses_and_launches(kind, shim, rng):
    """An entry point's steady state in one call: fresh outputs from a tuple of makers (one
    maker: its tensor alone) or a callable given the stream, each item's address (an int, a
    data_ptr(), None for the next output), a descriptor memo miss through the fallback."""
    from test_launch_capture import CapturingDriver

    signature = KernelSignature("e", (TensorMapParam("t", "f16", 2, (64, 64), 128),
                                      TensorParam("x", "f32", 1), TensorParam("o", "f32", 1),
                                      TensorParam("l", "f32", 1)), block=(32, 1, 1))
    launcher, recorder = _launcher(kind, shim, signature)
    plan = _LaunchPlan("e", signature, launcher, CapturingDriver())
    ck = type("CK", (), {"name": "e", "signature": signature, "_launch_plan": plan})()
    bound = bind_launch(ck, (2, 1, 1), [_Device(0x10000, (256, 128), "<f2"),
                                        *(_Device(0x8000 * i, (4,)) for i in (1, 2, 3))])
    for round_ in range(4):
        t, x, o, lse = (int(v) * 512 for v in rng.integers(1, 1 << 30, size=4))
        made = bound.launch_outputs((lambda: _Fresh(o), lambda: _Fresh(lse)), 0x77 + round_,
                                    _Fresh(t), x, None, None)
        assert [m.address for m in made] == [o, lse] and type(made) is tuple
        launch = recorder.launches[-1]
        assert launch[4] == 0x77 + round_ and launch[5][1:] == [x, x, 0, 4, 1, o, o, 0, 4, 1,
                                                                lse, lse, 0, 4, 1]
        bound(t, x, o, lse)  # the plain bound launch: the same descriptor for t
        assert launch[5][0] == recorder.launches[-1][5][0] != t
        seen = []
        one = bound.launch_outputs(lambda stream: seen.append(stream) or _Fresh(o), 5,
                                   t, _Fresh(x), None, lse)
        assert one.address == o and seen == [5] and recorder.launches[-1][5][11] == lse
        assert bound.launch_outputs((lambda: _Fresh(o),), None, t, x, None, lse).address == o
        assert recorder.launches[-1][4] in (0, None)
    launches = len(recorder.launches)
    with pytest.raises(ValueError, match="more None items than outputs"):
        bound.launch_outputs((lambda: _Fresh(o),), 0, t, x, None, None)
    with pytest.raises(ZeroDivisionError):
        bound.launch_outputs((lambda: 1 / 0, lambda: _Fresh(o)), 0, t, x, None, None)
    with pytest.raises((TypeError, KilnValueError)):
        bound.launch_outputs((lambda: _Fresh(o),), 0, t, None)
    assert len(recorder.launches) == launches  # nothing launched by a failed call
