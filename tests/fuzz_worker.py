"""Child process of ``tests/test_fuzz.py``: compiles (or interprets) generated kernels.

Reads one JSON request per line on stdin, ``{"source": <module text>}``, writes the module to a
fresh file (the AST rewrite needs real source), imports it and calls its ``run()``. Answers one
JSON line per request on stdout: ``{"status": "ok" | "kiln_error" | "bug", "kind": <exception
class>, "detail": <message or traceback>}``. A request that kills this process (a signal from
LLVM's ``abort``) or hangs is seen by the parent as a missing answer, so it knows which kernel
did it. ``InternalError`` is a KilnError but a Kiln bug, so it is reported as ``"bug"``.

Run by hand to replay a failure: ``echo '{"source": ...}' | python tests/fuzz_worker.py``.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
import tempfile
import traceback
from pathlib import Path


def _answer(status: str, kind: str = "", detail: str = "") -> None:
    sys.stdout.write(json.dumps({"status": status, "kind": kind, "detail": detail}) + "\n")
    sys.stdout.flush()


def main() -> None:
    from kiln.core.errors import InternalError, KilnError

    workdir = Path(tempfile.mkdtemp(prefix="kiln-fuzz-"))
    for n in itertools.count():
        line = sys.stdin.readline()
        if not line:
            return
        path = workdir / f"fuzz_case_{n}.py"
        path.write_text(json.loads(line)["source"])
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
            module.run()
        except KilnError as err:
            if isinstance(err, InternalError):
                _answer("bug", type(err).__name__, str(err))
            else:
                _answer("kiln_error", type(err).__name__, str(err).splitlines()[0][-300:])
        except BaseException as err:  # noqa: BLE001 - every other exception is the finding
            _answer("bug", type(err).__name__, traceback.format_exc())
        else:
            _answer("ok")


if __name__ == "__main__":
    main()
