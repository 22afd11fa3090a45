"""Cold compile time of every library kernel and of the README's saxpy, stage by stage.

Each kernel is compiled in a fresh Python process with the compile cache off
(``KILN_NO_CACHE=1``), so nothing of an earlier compile helps: the time is what the first
call of an entry point at a new shape class pays. Per kernel it prints the wall seconds of
``import kiln`` + the library, of the compile itself, and the compile profile (trace, each Kiln
pass, the MLIR pipelines, LLVM/NVPTX, ptxas, the AMD llvmlite and link steps: the same steps
``kiln compile --report`` prints). The goal (issue 42) is at most 1.5 s per library kernel and
0.3 s for saxpy; the table's ``goal`` column is the ratio to it. The ``beside`` column is the
Python work done while ptxas runs (printing the stages' text, the wait proof: the
``cubin.ptxas.*`` steps) or, on AMD, while LLVM emits the assembly on a thread and the object
in a second process (the ``amdgcn.beside.*`` and ``amdgcn.check.*`` steps), which costs no
wall time where a second core is free; ``--serial-llvm`` makes AMD's one step after the other
instead (the same-run baseline of that overlap). ``--repeat N`` keeps each kernel's fastest of N cold
compiles (on a shared machine the first may wait for a core).

Example::

    .venv/bin/python bench/compile_time.py                     # every kernel, table + JSON
    .venv/bin/python bench/compile_time.py prefill_sm90_d128 saxpy_sm90
    .venv/bin/python bench/compile_time.py --list
    .venv/bin/python bench/compile_time.py --repeat 3 prefill_sm90_d128   # fastest of three
    .venv/bin/python bench/compile_time.py --serial-llvm prefill_gfx950_d128  # no overlap

The last line of stdout is the JSON (``{"benchmark": "compile_time", "rows": [...]}``); each
row holds ``kernel``, ``import_s``, ``compile_s``, ``goal_s``, ``cpu_s``, ``beside_ms``,
``stages`` (the profile's top-level steps in ms), ``parts`` (the wall ms by part of the
pipeline, ``kiln.core.profile.summarise``: cache key, trace, Kiln passes, MLIR, LLVM, ptxas)
and ``steps`` (every step, nested ones named ``a.b``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from kiln.core.profile import BESIDE, summarise
from results_io import metadata

# name -> (goal seconds, the Python expression that compiles it; `k` holds the kernel modules)
_LIBRARY_GOAL, _USER_GOAL = 1.5, 0.3
_BENCH_DIR = os.path.dirname(os.path.abspath(__file__))  # the child imports compile_jobs from it
JOBS = {
    **{f"prefill_sm90_d{d}": f"k.compile_prefill('bf16', target='sm_90a', head_dim={d}, "
                             "causal=True)" for d in (64, 128, 256)},
    **{f"prefill_gfx950_d{d}": f"k.compile_prefill('bf16', target='gfx950', head_dim={d}, "
                               "causal=True)" for d in (64, 128)},
    # D 256 spills on gfx950: compiled only when asked for (allow_scratch)
    "prefill_gfx950_d256": "k.compile_prefill('bf16', target='gfx950', head_dim=256, "
                           "causal=True, allow_scratch=True)",
    "decode_sm90_wgmma": "k.compile_decode('bf16', target='sm_90a', head_dim=128, group=8, "
                         "config=k.DecodeConfig(consumer='wgmma', num_warps=4))",
    "decode_sm90_mma_sync": "k.compile_decode('bf16', target='sm_90a', head_dim=128, group=8, "
                            "config=k.DecodeConfig(consumer='mma_sync'))",
    "decode_sm90_fused": "k.compile_decode('bf16', target='sm_90a', head_dim=128, group=8, "
                         "fused_slots=4)",
    "combine_sm90": "k.compile_combine(target='sm_90a')",
    "matmul_sm90": "k.compile_matmul('bf16', target='sm_90a')",
    "matmul_gfx950": "k.compile_matmul('bf16', target='gfx950')",
    "grouped_matmul_sm90": "k.compile_grouped_matmul('bf16', target='sm_90a')",
    "prefill_fp8_sm90_d128": "k.compile_prefill('f8e4m3', target='sm_90a', head_dim=128, "
                             "causal=True)",
    "prefill_fp8_gfx950_d128": "k.compile_prefill('f8e4m3', target='gfx950', head_dim=128, "
                               "causal=True)",
    "matmul_fp8_sm90": "k.compile_matmul('f8e4m3', target='sm_90a', trans_b=True)",
    "mla_decode_sm90": "k.compile_mla_decode(target='sm_90a')",
    "saxpy_sm90": "k.saxpy_compile('sm_90a')",
    "saxpy_gfx950": "k.saxpy_compile('gfx950')",
}

# The child script: imports (Kiln and the library, through compile_jobs) timed apart from the
# compile, the kernel compiled once, its profile printed as one JSON line.
_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
sys.path.insert(0, sys.argv[2])
from kiln.core.profile import cpu_seconds
from compile_jobs import k, serial_amd_codegen
if sys.argv[3] == "serial":
    serial_amd_codegen()
t1 = time.perf_counter()
c0 = cpu_seconds()
ck = eval(sys.argv[1])
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "compile_s": t2 - t1, "cpu_s": cpu_seconds() - c0,
                  "steps": ck.metadata.get("compile_profile", [])}))
"""


def run_one(name: str, timeout: float, repeat: int = 1, serial_llvm: bool = False) -> dict:
    """Compile ``name`` cold in a fresh process (the fastest of ``repeat``, each with an empty
    cache); its row (``error`` set when one failed). ``serial_llvm``: AMD's LLVM code generation
    without the work beside it (``compile_jobs.serial_amd_codegen``)."""
    goal = _USER_GOAL if name.startswith("saxpy") else _LIBRARY_GOAL
    best: dict = {}
    for _ in range(repeat):
        with tempfile.TemporaryDirectory(prefix="kiln-compile-time-") as work:
            row = _compile_in_child(name, work, timeout, serial_llvm)
        if "error" in row:
            return {"kernel": name, "goal_s": goal} | row
        if not best or row["compile_s"] < best["compile_s"]:
            best = row
    return {"kernel": name, "goal_s": goal, "runs": repeat, "serial_llvm": serial_llvm} | best


def _compile_in_child(name: str, work: str, timeout: float, serial_llvm: bool = False) -> dict:
    """One compile of ``name`` in a fresh process with the compile cache off."""
    env = dict(os.environ, KILN_CACHE_DIR=work, KILN_NO_CACHE="1")
    env.pop("KILN_DUMP_DIR", None)  # dumping would be timed too
    child = os.path.join(work, "compile_one.py")
    with open(child, "w") as script:
        script.write(_CHILD)
    row: dict = {}
    started = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, child, JOBS[name], _BENCH_DIR,
                               "serial" if serial_llvm else "overlap"], env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    row["process_s"] = round(time.perf_counter() - started, 3)
    if done.returncode != 0:
        return row | {"error": (done.stderr.strip().splitlines() or ["failed"])[-1][:300]}
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    steps = [tuple(step) for step in measured["steps"]]
    row.update(import_s=round(measured["import_s"], 3), compile_s=round(measured["compile_s"], 3),
               cpu_s=round(measured["cpu_s"], 3),
               beside_ms=round(sum(wall for s, wall, _ in steps
                                   if s.startswith(BESIDE)), 1),
               stages={s: wall for s, wall, _ in steps if "." not in s},
               parts=summarise(steps), steps={s: wall for s, wall, _ in steps})
    return row


def format_table(rows: list[dict]) -> str:
    """Per kernel: seconds, ratio to the goal, and the top-level stages in ms."""
    stages = []
    for row in rows:
        stages += [s for s in row.get("stages", {}) if s not in stages]
    head = f"{'kernel':<24} {'import s':>8} {'compile s':>9} {'cpu s':>6} {'goal':>6} " + \
        " ".join(f"{s[:9]:>9}" for s in stages) + f" {'beside':>7}"
    lines = [head]
    for row in rows:
        if "error" in row:
            lines.append(f"{row['kernel']:<24} error: {row['error']}")
            continue
        cells = " ".join(f"{row['stages'].get(s, 0):>9.0f}" for s in stages)
        lines.append(f"{row['kernel']:<24} {row['import_s']:>8.2f} {row['compile_s']:>9.2f} "
                     f"{row['cpu_s']:>6.2f} {row['compile_s'] / row['goal_s']:>5.2f}x {cells} "
                     f"{row['beside_ms']:>7.0f}")
    lines.append("(stage columns: wall ms of the cold compile; cpu: this process and ptxas; "
                 "goal: compile s / goal s, at most 1.00x is met; beside: ms of Python work "
                 "done while ptxas or AMD's LLVM codegen ran)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("kernels", nargs="*", help=f"a subset of: {', '.join(JOBS)}")
    parser.add_argument("--json", help="also write the JSON to this file")
    parser.add_argument("--steps", action="store_true", help="print every step per kernel")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per kernel")
    parser.add_argument("--repeat", type=int, default=1,
                        help="cold compiles per kernel; the fastest is reported")
    parser.add_argument("--serial-llvm", action="store_true",
                        help="AMD: code generation (assembly, object) and the proofs and texts "
                             "one after the other (the baseline of their overlap)")
    parser.add_argument("--list", action="store_true", help="list the kernels and exit")
    ns = parser.parse_args(argv)
    if ns.list:
        print("\n".join(JOBS))
        return 0
    unknown = [k for k in ns.kernels if k not in JOBS]
    if unknown:
        parser.error(f"unknown kernels {unknown}; --list names them")
    rows = []
    for name in ns.kernels or JOBS:  # each row printed as it comes (a batch may be cut short)
        rows.append(run_one(name, ns.timeout, max(1, ns.repeat), ns.serial_llvm))
        print(format_table(rows[-1:]).splitlines()[-2], flush=True)
    print(format_table(rows))
    if ns.steps:
        for row in rows:
            print(f"\n{row['kernel']}:")
            for step, wall in row.get("steps", {}).items():
                print(f"  {'  ' * step.count('.') + step:<46} {wall:>9.1f} ms")
    result = {**metadata("compile_time"), "python": sys.version.split()[0], "rows": rows}
    if ns.json:
        with open(ns.json, "w") as out:
            json.dump(result, out, indent=1)
    print(json.dumps(result))
    failed = any("error" in row for row in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
