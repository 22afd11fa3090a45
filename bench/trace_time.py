"""Cold trace time of library kernels: the AST rewrite and the trace itself, apart.

Per kernel, a fresh Python process (``KILN_NO_CACHE=1``) compiles it as
``bench/compile_time.py`` does but stops after the trace, and reports process CPU ms (the
machine is shared: CPU time moves less than wall time with other work) of:

- ``first``: the first trace (what a cold compile's ``trace`` step pays: the AST rewrite of
  every function the kernel calls, then the trace),
- ``rewrite``: the AST rewrite of those functions alone (the fastest of ``--inner`` runs),
- ``again``: the trace once the rewrite is cached (the fastest of ``--inner`` runs).

``--against DIR`` runs each measurement in a second tree too (a checkout of another commit,
e.g. ``git archive <commit> dsl kernels passes lowering bench | tar -x -C DIR``), alternating
the two, and prints the ratios: this tree / DIR. ``--repeat N`` keeps the fastest of N
processes per tree.

Example::

    .venv/bin/python bench/trace_time.py prefill_sm90_d128 mla_decode_sm90
    .venv/bin/python bench/trace_time.py --repeat 3 --against /tmp/base prefill_sm90_d128

The last line of stdout is the JSON (``{"benchmark": "trace_time", "rows": [...]}``); each row
holds ``kernel``, ``first_ms``, ``rewrite_ms``, ``again_ms`` and, with ``--against``,
``against`` (the same for DIR) and ``ratio``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from compile_time import JOBS
from results_io import metadata

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The child: Kiln imported from the tree given (the editable install's package map pointed at
# it), the kernel's compile stopped after its first trace, then the rewrite and the trace
# measured again in the same process.
_CHILD = r"""
import gc, importlib, json, os, sys, time
job, root, inner = sys.argv[1], sys.argv[2], int(sys.argv[3])
finders = [f for f in sys.meta_path if hasattr(sys.modules.get(f.__module__), "MAPPING")]
for finder in finders:
    mapping = sys.modules[finder.__module__].MAPPING
    installed = os.path.dirname(mapping["kiln"])  # the tree the editable install points at
    for name, path in mapping.items():
        mapping[name] = path.replace(installed, root, 1)
sys.path.insert(0, root + "/bench")
from compile_jobs import k
kernel = importlib.import_module("kiln.kernel")
rewrite = importlib.import_module("kiln.ast_rewrite")
if not kernel.__file__.startswith(root):
    sys.exit(f"kiln came from {kernel.__file__}, not {root}")
functions, make = [], rewrite._compile_factory
rewrite._compile_factory = lambda fn: functions.append(fn) or make(fn)
trace, out = kernel.JITKernel._trace_locked, {}

class Stop(Exception):
    pass

def fastest(run):
    best = float("inf")
    for _ in range(inner):
        gc.disable()
        start = time.process_time()
        run()
        best = min(best, time.process_time() - start)
        gc.enable()
    return best * 1e3

def measured(self, *args, **kwargs):
    start = time.process_time()
    trace(self, *args, **kwargs)
    out["first_ms"] = (time.process_time() - start) * 1e3
    rewrite._compile_factory = make
    out["again_ms"] = fastest(lambda: trace(self, *args, **kwargs))
    out["rewrite_ms"] = fastest(lambda: [make(fn) for fn in functions])
    out["functions"] = len(functions)
    raise Stop

kernel.JITKernel._trace_locked = measured
try:
    eval(job)
except Stop:
    pass
print(json.dumps(out))
"""


def measure(name: str, root: str, inner: int) -> dict:
    """One process's figures for kernel ``name`` with Kiln from ``root``."""
    env = dict(os.environ, KILN_NO_CACHE="1")
    done = subprocess.run([sys.executable, "-c", _CHILD, JOBS[name], root, str(inner)],
                          capture_output=True, text=True, cwd=root, env=env, timeout=300)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1][:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def fastest_of(rows: list[dict]) -> dict:
    """Each figure's minimum over the processes."""
    keys = ("first_ms", "rewrite_ms", "again_ms")
    return {key: round(min(row[key] for row in rows), 1) for key in keys} | {
        "functions": rows[0]["functions"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("kernels", nargs="*", help=f"a subset of: {', '.join(JOBS)}")
    parser.add_argument("--repeat", type=int, default=3, help="processes per kernel and tree")
    parser.add_argument("--inner", type=int, default=8,
                        help="runs of the rewrite and of the repeated trace per process")
    parser.add_argument("--against", help="another tree (a checkout) to measure alternately")
    ns = parser.parse_args(argv)
    unknown = [k for k in ns.kernels if k not in JOBS]
    if unknown:
        parser.error(f"unknown kernels {unknown}; bench/compile_time.py --list names them")
    trees = {"this": _ROOT} | ({"against": os.path.abspath(ns.against)} if ns.against else {})
    rows = []
    for name in ns.kernels or [k for k in JOBS if not k.startswith("saxpy")]:
        runs: dict[str, list] = {tree: [] for tree in trees}
        error = None
        for _ in range(max(1, ns.repeat)):
            for tree, root in trees.items():  # alternating: both see the same machine load
                got = measure(name, root, ns.inner)
                error = error or got.get("error")
                runs[tree].append(got)
        if error:
            rows.append({"kernel": name, "error": error})
            print(f"{name:<24} error: {error}", flush=True)
            continue
        row = {"kernel": name} | fastest_of(runs["this"])
        if "against" in runs:
            row["against"] = fastest_of(runs["against"])
            row["ratio"] = {key: round(row[key] / row["against"][key], 3)
                            for key in ("first_ms", "rewrite_ms", "again_ms")}
        rows.append(row)
        ratio = row.get("ratio")
        print(f"{name:<24} first {row['first_ms']:7.1f} ms  rewrite {row['rewrite_ms']:6.1f} ms"
              f"  again {row['again_ms']:6.1f} ms"
              + (f"  (x{ratio['first_ms']:.3f} / x{ratio['rewrite_ms']:.3f} / "
                 f"x{ratio['again_ms']:.3f} of --against)" if ratio else ""), flush=True)
    print(json.dumps({**metadata("trace_time"), "rows": rows}))
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
