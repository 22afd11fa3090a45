"""The compile cache trusts nothing it reads: planted, foreign, corrupt or not-owned entries are
misses, and unsafe or unusable directories are warned about once and compiled around."""

import os
import pickle
import shutil
import stat
import warnings

import numpy as np
import pytest
from sample_kernels import saxpy

import kiln
from kiln.core.errors import CacheWarning
from kiln.runtime import cache
from kiln.core import trusted_dir

X = np.arange(8, dtype=np.float32)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    root = tmp_path / "kiln-cache"
    monkeypatch.setenv("KILN_CACHE_DIR", str(root))
    monkeypatch.delenv("KILN_NO_CACHE", raising=False)
    monkeypatch.setattr(trusted_dir, "_warned", set())  # each test sees its own first warning
    return root


def _fresh_compile():
    """Compile saxpy with a new JITKernel: no in-memory entry, so the disk cache is consulted."""
    return kiln.kernel(saxpy.fn).compile(X, X, 8, 2.0, BLOCK=32, target="sm_90a")


def _files(root):
    return sorted(p for p in root.rglob("*") if p.is_file())


class _Bomb:
    """Unpickling this creates ``marker``: proof that a cache read ran planted code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _plant_everywhere(root, content: bytes):
    """Replace every cache file with ``content``, and put it at the pickle path of old caches."""
    for path in _files(root):
        path.write_bytes(content)
        key = next((part for part in path.parts if len(part) == 64), None)
        if key is not None:
            (root / key[:2] / f"{key}.pkl").write_bytes(content)


@pytest.mark.lower
def test_a_planted_pickle_is_never_executed(cache_dir, tmp_path):
    first = _fresh_compile()
    assert _files(cache_dir)
    marker = tmp_path / "pwned"
    _plant_everywhere(cache_dir, pickle.dumps(_Bomb(marker)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = _fresh_compile()
    assert not marker.exists(), "a cache read executed a planted pickle"
    assert again.asm["ptx"] == first.asm["ptx"]
    assert any("ignoring compile cache entry" in str(w.message) for w in caught)


@pytest.mark.lower
def test_well_formed_foreign_entries_are_misses_not_errors(cache_dir):
    first = _fresh_compile()
    # A dict in the old pickle format, lacking the fields (this made every compile KeyError).
    _plant_everywhere(cache_dir, pickle.dumps({"format": 1, "name": "other"}))
    with pytest.warns(CacheWarning):
        assert _fresh_compile().asm["ptx"] == first.asm["ptx"]
    # A genuine, intact entry of this key whose artifact is not a compiled kernel.
    (meta,) = cache_dir.rglob("meta.json")
    key = meta.parent.name
    cache.put(key, {"format": 2, "name": "other"})
    assert cache.get(key) == {"format": 2, "name": "other"}
    assert _fresh_compile().asm["ptx"] == first.asm["ptx"]


def _artifact():
    return {"name": "saxpy", "asm": {"ptx": "// ptx\n" * 300, "cubin": bytes(range(256)) * 64},
            "metadata": {"registers": 12}}


def test_another_keys_entry_copied_under_a_key_is_a_miss(cache_dir):
    mine, other = cache.make_key("mine"), cache.make_key("other")
    cache.put(other, _artifact())
    for path in _files(cache_dir):
        target = cache_dir / str(path.relative_to(cache_dir)).replace(other[:2], mine[:2], 1) \
            .replace(other, mine)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    with pytest.warns(CacheWarning, match="another key"):
        assert cache.get(mine) is None
    assert cache.get(other) == _artifact()


def test_a_flipped_byte_anywhere_in_an_entry_is_a_miss(cache_dir):
    key = cache.make_key("flip")
    cache.put(key, _artifact())
    files = _files(cache_dir)
    assert len(files) == 3  # meta.json, the PTX text and the cubin
    for path in files:
        original = path.read_bytes()
        for offset in (0, len(original) // 2, len(original) - 1):
            flipped = bytearray(original)
            flipped[offset] ^= 0x01
            path.write_bytes(bytes(flipped))
            trusted_dir._warned.clear()
            with pytest.warns(CacheWarning):
                assert cache.get(key) is None, f"{path.name} byte {offset}"
        path.write_bytes(original)
        assert cache.get(key) == _artifact()


def test_problems_are_warned_about_once_per_kind(cache_dir, recwarn):
    keys = [cache.make_key(f"k{i}") for i in range(3)]
    for key in keys:
        cache.put(key, _artifact())
        (cache_dir / key[:2] / key / "meta.json").write_text("{}")
    assert [cache.get(key) for key in keys] == [None] * 3
    assert len([w for w in recwarn if w.category is CacheWarning]) == 1


@pytest.mark.skipif(not hasattr(os, "chown") or os.geteuid() != 0,
                    reason="giving a file to another user needs root")
def test_an_entry_file_owned_by_another_user_is_a_miss(cache_dir):
    key = cache.make_key("chown")
    cache.put(key, _artifact())
    os.chown(cache_dir / key[:2] / key / "meta.json", 12345, 12345)
    with pytest.warns(CacheWarning, match="owned by uid 12345"):
        assert cache.get(key) is None


def test_a_symlinked_entry_file_is_untrusted(cache_dir, tmp_path):
    """A symlink is not followed even to a valid entry: whoever placed it could repoint it."""
    key = cache.make_key("symlink")
    cache.put(key, _artifact())
    manifest = cache_dir / key[:2] / key / "meta.json"
    elsewhere = tmp_path / "meta.json"
    manifest.replace(elsewhere)
    manifest.symlink_to(elsewhere)
    with pytest.warns(CacheWarning, match="is a symlink"):
        assert cache.get(key) is None


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_fifo_in_place_of_an_entry_file_is_refused_without_hanging(cache_dir):
    key = cache.make_key("fifo")
    cache.put(key, _artifact())
    manifest = cache_dir / key[:2] / key / "meta.json"
    manifest.unlink()
    os.mkfifo(manifest)  # opening it for reading would wait for a writer forever
    with pytest.warns(CacheWarning, match="not a regular file"):
        assert cache.get(key) is None


def test_directories_are_created_private(tmp_path, monkeypatch):
    root = tmp_path / "made" / "for" / "kiln"
    monkeypatch.setenv("KILN_CACHE_DIR", str(root))
    old_umask = os.umask(0o022)
    try:
        cache.put(cache.make_key("private"), _artifact())
    finally:
        os.umask(old_umask)
    created = [tmp_path / "made", tmp_path / "made" / "for", root]
    created += [p for p in root.rglob("*") if p.is_dir()]
    assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in created} == {"0o700"}
    assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in _files(root)} == {"0o600"}


@pytest.mark.lower
def test_a_group_writable_cache_is_not_used(cache_dir, monkeypatch):
    _fresh_compile()
    cache_dir.chmod(0o770)
    before = _files(cache_dir)
    monkeypatch.setattr(cache, "_load", lambda *a: pytest.fail("read an untrusted cache"))
    with pytest.warns(CacheWarning, match=f"chmod 700 {cache_dir}"):
        assert "saxpy" in _fresh_compile().asm["ptx"]
        assert "saxpy" in kiln.kernel(saxpy.fn).compile(X, X, 8, 2.0, BLOCK=64).asm["ptx"]
    assert _files(cache_dir) == before  # nothing written either


@pytest.mark.lower
def test_a_cache_owned_by_another_user_is_not_used(cache_dir, monkeypatch):
    cache.put(cache.make_key("warm"), _artifact())
    monkeypatch.setattr(os, "getuid", lambda: os.stat(cache_dir).st_uid + 1)
    before = _files(cache_dir)
    with pytest.warns(CacheWarning, match=f"not using {cache_dir}.*owned by uid"):
        assert cache.get(cache.make_key("warm")) is None
        assert "saxpy" in _fresh_compile().asm["ptx"]
    assert _files(cache_dir) == before


@pytest.mark.lower
@pytest.mark.parametrize("kind", ["a file", "under a file"])
def test_an_unusable_cache_directory_is_compiled_around(tmp_path, monkeypatch, kind):
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    root = blocker if kind == "a file" else blocker / "cache"
    monkeypatch.setenv("KILN_CACHE_DIR", str(root))
    with pytest.warns(CacheWarning, match=str(root)):
        assert "saxpy" in _fresh_compile().asm["ptx"]


@pytest.mark.lower
def test_an_unwritable_cache_is_warned_about_once_and_compiled_around(cache_dir, monkeypatch,
                                                                     recwarn):
    def refuse(path, data):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(cache, "write_atomic", refuse)
    for _ in range(2):
        assert "saxpy" in _fresh_compile().asm["ptx"]
    warned = [w for w in recwarn if w.category is CacheWarning]
    assert len(warned) == 1 and "cannot write the compile cache" in str(warned[0].message)
