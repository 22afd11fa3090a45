"""The AST rewrite's output kept on disk: a kernel function's rewritten code depends only on its
source, so a new process (or a new specialisation) skips the rewrite, a fifth of a large
kernel's cold compile (about 170 ms of the Hopper prefill's trace).

Entries live under the compile cache's private directory (``rewrite/<key>.code``: the
``marshal`` of the factory's code object, as Python's own ``__pycache__`` holds), with the same
trust rules (:mod:`kiln.core.trusted_dir`: a directory only this user can write, files this
user owns) and the same switch (``KILN_NO_CACHE`` turns it off). The key covers the function's
source, file and first line, the rewriter's and the trace runtime's sources and the Python
version, so editing any of them makes a new entry. Anything unreadable is a miss.

Example::

    code = load(key_of(raw_source, filename, firstlineno))
    if code is None:
        code = compile_it()
        store(key, code)
"""

from __future__ import annotations

import functools
import hashlib
import marshal
import sys
import types
from pathlib import Path

from kiln.core.trusted_dir import read_owned, usable_root, write_atomic

_SUFFIX = ".code"


def key_of(source: str, filename: str, firstlineno: int) -> str:
    """The entry name of one function's rewrite."""
    digest = hashlib.sha256()
    for part in (_rewriter_digest(), sys.version, filename, str(firstlineno), source):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def load(key: str) -> types.CodeType | None:
    """The stored code of ``key``, or None (missing, cache off, untrusted or unreadable)."""
    path = _path(key)
    if path is None:
        return None
    try:
        code = marshal.loads(read_owned(path))
    except Exception:  # a torn, foreign or stale file is a miss, never an error
        return None
    return code if isinstance(code, types.CodeType) else None


def store(key: str, code: types.CodeType) -> None:
    """Keep ``code`` under ``key`` (silently skipped when the cache cannot be written)."""
    path = _path(key)
    if path is None:
        return
    try:
        path.parent.mkdir(mode=0o700, exist_ok=True)
        write_atomic(path, marshal.dumps(code))
    except OSError:
        pass


def _path(key: str) -> Path | None:
    root = usable_root()
    return None if root is None else root / "rewrite" / (key + _SUFFIX)


@functools.lru_cache(maxsize=1)
def _rewriter_digest() -> str:
    """The rewriter's source (its rules decide the code) and the trace runtime's (the code
    calls it by name): a change to either is a new key."""
    digest = hashlib.sha256()
    for name in ("ast_rewrite.py", "trace_runtime.py"):
        digest.update(Path(__file__).with_name(name).read_bytes())
    return digest.hexdigest()
