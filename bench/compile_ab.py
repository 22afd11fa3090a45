"""Cold compile times of variants side by side: code trees or environment settings, same run.

``bench/compile_time.py`` starts a fresh Python per compile, so a table pays ``import kiln`` (1-2
s on the GPU host) once per kernel. Here each variant has one server process that imports Kiln
and the library once and then forks a child per compile: the child starts with nothing compiled
and the compile cache off (``KILN_NO_CACHE=1``, its own empty ``KILN_CACHE_DIR``), so it pays
what a fresh process pays after its imports (lazy imports, LLVM's and ptxas' first use, every
stage). The variants compile the same kernel at the same time (one child each, a pair of cores
each at most; ``--serial``: one after the other, the first of a round turning), kernel after
kernel, ``--repeat`` rounds; each keeps its fastest. Host speed
moves between runs by up to 2x on a shared host; ``host_ms`` (a fixed pure-Python loop, timed
before and after) lets two runs' tables be compared, and the ratios are from one run.

A variant is ``NAME`` (this tree, as installed), ``NAME:VAR=VALUE[,VAR=VALUE]`` (this tree with
environment settings, e.g. ``mlir:KILN_NVPTX_PIPELINE=mlir``) or ``NAME@PATH`` (the Kiln source
tree at PATH, e.g. one ``git archive`` made, imported in place of the installed one).

Example::

    .venv/bin/python bench/compile_ab.py --variant head --variant mlir:KILN_NVPTX_PIPELINE=mlir \
        --repeat 2 prefill_sm90_d128 saxpy_sm90
    .venv/bin/python bench/compile_ab.py --variant head --variant base@/tmp/base --repeat 2

The last line of stdout is the JSON (``{"benchmark": "compile_ab", "rows": [...]}``): per kernel
and variant ``compile_s``, ``cpu_s``, ``stages`` and ``steps`` (ms), and each variant's ratio to
the first. ``--budget S`` starts no compile after S seconds (a time-capped batch still gets its
table and JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import tempfile
import time

from compile_time import BESIDE, JOBS
from kiln.core.profile import summarise as wall_by_part
from results_io import metadata

_BENCH_DIR = os.path.dirname(os.path.abspath(__file__))

# The server: imports the library (from the variant's tree), then per kernel name read on stdin
# forks a child that compiles it and prints one JSON line; a blank line ends it.
_SERVER = r"""
import importlib.util, json, os, sys, time
tree = sys.argv[2]
if tree:  # the variant's own source tree in place of the installed package
    mapping = {"kiln": "dsl", "kiln.kernels": "kernels", "kiln.lowering": "lowering",
               "kiln.passes": "passes"}

    class TreeFinder:
        @classmethod
        def find_spec(cls, name, path=None, target=None):
            if name not in mapping:
                return None
            folder = os.path.join(tree, mapping[name])
            return importlib.util.spec_from_file_location(
                name, os.path.join(folder, "__init__.py"), submodule_search_locations=[folder])

    sys.meta_path.insert(0, TreeFinder)
t0 = time.perf_counter()
sys.path.insert(0, sys.argv[1])
from kiln.core.profile import cpu_seconds
from compile_jobs import k
import kiln
print(json.dumps({"ready": time.perf_counter() - t0, "kiln": kiln.__file__}), flush=True)
for line in sys.stdin:
    name, expr, cache = json.loads(line)
    pid = os.fork()
    if pid == 0:
        os.environ["KILN_CACHE_DIR"] = cache
        try:
            c0, t1 = cpu_seconds(), time.perf_counter()
            ck = eval(expr)
            wall = time.perf_counter() - t1
            out = {"compile_s": wall, "cpu_s": cpu_seconds() - c0,
                   "steps": ck.metadata.get("compile_profile", [])}
        except BaseException as err:  # reported, the server goes on
            out = {"error": f"{type(err).__name__}: {err}"[:300]}
        print(json.dumps(out), flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
"""


def host_ms() -> float:
    """Milliseconds of a fixed pure-Python loop: this host's speed for Python right now."""
    started = time.perf_counter()
    total = 0
    for i in range(1_500_000):
        total += i * i % 7
    return round((time.perf_counter() - started) * 1e3, 1)


class Server:
    """One variant's forking server process."""

    def __init__(self, spec: str, work: str):
        self.name, env, tree = spec, {}, ""
        if "@" in spec:
            self.name, tree = spec.split("@", 1)
            tree = os.path.abspath(tree)
        elif ":" in spec:
            self.name, settings = spec.split(":", 1)
            env = dict(item.split("=", 1) for item in settings.split(","))
        self.env = env
        self.work = work
        script = os.path.join(work, "compile_server.py")
        with open(script, "w") as out:
            out.write(_SERVER)
        child_env = dict(os.environ, KILN_NO_CACHE="1", **env)
        child_env.pop("KILN_DUMP_DIR", None)
        self.process = subprocess.Popen([sys.executable, script, _BENCH_DIR, tree],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, env=child_env, bufsize=1)
        self.ready = json.loads(self.process.stdout.readline())
        self.count = 0

    def send(self, kernel: str) -> None:
        self.count += 1
        cache = os.path.join(self.work, f"cache{self.count}")
        self.process.stdin.write(json.dumps([kernel, JOBS[kernel], cache]) + "\n")
        self.process.stdin.flush()

    def receive(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not ready:
            return {"error": f"timed out after {timeout:.0f} s"}
        line = self.process.stdout.readline()
        return json.loads(line) if line else {"error": "server ended"}

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=10)


def summarise(result: dict) -> dict:
    if "error" in result:
        return result
    steps = [tuple(step) for step in result["steps"]]
    return {"compile_s": round(result["compile_s"], 3), "cpu_s": round(result["cpu_s"], 3),
            "beside_ms": round(sum(w for s, w, _ in steps if s.startswith(BESIDE)), 1),
            "stages": {s: round(w, 1) for s, w, _ in steps if "." not in s},
            "parts": wall_by_part(steps),
            "steps": {s: round(w, 1) for s, w, _ in steps}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("kernels", nargs="*", help="default: every kernel of compile_time.py")
    parser.add_argument("--variant", action="append", default=[],
                        help="NAME, NAME:VAR=VALUE[,...] or NAME@TREE (first: the baseline)")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per compile")
    parser.add_argument("--json", help="also write the JSON to this file")
    parser.add_argument("--serial", action="store_true",
                        help="the variants compile a kernel one after the other (in an order "
                             "that turns each round), not at the same time")
    parser.add_argument("--budget", type=float, default=float("inf"),
                        help="seconds after which no further compile starts (the table and "
                             "JSON then hold the kernels compiled so far)")
    ns = parser.parse_args(argv)
    names = ns.kernels or list(JOBS)
    unknown = [k for k in names if k not in JOBS]
    if unknown:
        parser.error(f"unknown kernels {unknown}; compile_time.py --list names them")
    specs = ns.variant or ["head"]
    host_before = host_ms()
    with tempfile.TemporaryDirectory(prefix="kiln-compile-ab-") as work:
        servers = []
        for i, spec in enumerate(specs):
            os.makedirs(os.path.join(work, str(i)))
            servers.append(Server(spec, os.path.join(work, str(i))))
        print("variants: " + "; ".join(f"{s.name} (import {s.ready['ready']:.2f} s, "
                                       f"{s.ready['kiln']})" for s in servers), flush=True)
        best: dict = {name: {} for name in names}
        started = time.perf_counter()
        rounds = [(r, name) for r in range(max(1, ns.repeat)) for name in names]
        for r, name in rounds:
            if time.perf_counter() - started > ns.budget:
                print(f"budget of {ns.budget:.0f} s spent: round {r + 1} stops before {name}",
                      flush=True)
                break
            order = servers[r % len(servers):] + servers[:r % len(servers)]
            for batch in ([[s] for s in order] if ns.serial else [servers]):
                for server in batch:  # a batch's variants compile the kernel at the same time
                    server.send(name)
                for server in batch:
                    got = summarise(server.receive(ns.timeout))
                    old = best[name].get(server.name)
                    if old is None or "error" in old or (
                            "error" not in got and got["compile_s"] < old["compile_s"]):
                        best[name][server.name] = got
            cells = []
            for server in servers:
                row = best[name][server.name]
                cells.append(f"{server.name} " + (row["error"] if "error" in row else
                                                  f"{row['compile_s']:.3f}"))
            print(f"{name:<24} " + "  ".join(cells), flush=True)
        for server in servers:
            server.close()
    base = servers[0].name
    rows = []
    for name in [n for n in names if best[n]]:
        row = {"kernel": name, "variants": best[name]}
        b = best[name].get(base, {})
        row["ratio"] = {v: round(r["compile_s"] / b["compile_s"], 3)
                        for v, r in best[name].items() if "error" not in r and "error" not in b}
        rows.append(row)
    stage_names = []
    for row in rows:
        for r in row["variants"].values():
            stage_names += [s for s in r.get("stages", {}) if s not in stage_names]
    print(f"{'kernel':<24} {'variant':<10} {'compile s':>9} {'/ ' + base:>9} " +
          " ".join(f"{s[:9]:>9}" for s in stage_names))
    for row in rows:
        for v, r in row["variants"].items():
            if "error" in r:
                print(f"{row['kernel']:<24} {v:<10} error: {r['error']}")
                continue
            print(f"{row['kernel']:<24} {v:<10} {r['compile_s']:>9.3f} "
                  f"{row['ratio'].get(v, float('nan')):>9.3f} " +
                  " ".join(f"{r['stages'].get(s, 0):>9.0f}" for s in stage_names))
    host = {"before": host_before, "after": host_ms()}
    print(f"host_ms (pure-Python loop): before {host['before']}, after {host['after']}")
    result = {**metadata("compile_ab"), "host_ms": host, "serial": ns.serial,
              "variants": [{"name": s.name, "env": s.env, "import_s": round(s.ready["ready"], 3),
                            "kiln": s.ready["kiln"]} for s in servers], "rows": rows}
    if ns.json:
        with open(ns.json, "w") as out:
            json.dump(result, out, indent=1)
    print(json.dumps(result))
    return 1 if any("error" in r for row in rows for r in row["variants"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
