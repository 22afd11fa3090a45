"""The one JSON format of the benchmarks' results (read by ``results_page.py``).

Every benchmark's ``--json`` file is ``{benchmark, device, driver, date, commit, command,
source, rows, ...}``: the metadata says what ran where and when, ``rows`` holds Kiln's and its
peers' numbers side by side, and further keys are the benchmark's own (copy bandwidth,
sweeps). Example::

    from results_io import write_results
    write_results(args.json, "gemm", rows, torch=torch, sweep=swept)
"""

from __future__ import annotations

import datetime
import json
import pathlib
import re
import subprocess
import sys

BENCH_DIR = pathlib.Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
# Keys every results file carries; driver may be null where nvidia-smi was not there.
REQUIRED_FIELDS = ("benchmark", "device", "driver", "date", "commit", "command", "source",
                   "rows")


def _run(argv: list[str]) -> str | None:
    """stdout of a short command, or None when it is missing or fails."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=20, cwd=BENCH_DIR)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else None


def git_commit() -> str:
    """Short HEAD of the checkout the benchmark runs from, "+dirty" if tracked files differ
    from it (the numbers are then not that commit's), or "unknown" outside a git checkout."""
    head = _run(["git", "rev-parse", "--short", "HEAD"])
    if head is None:
        return "unknown"
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"])
    return head + ("+dirty" if dirty else "")


def device_and_driver(torch=None) -> tuple[str, str | None]:
    """GPU 0's name (torch's, else nvidia-smi's, else "unknown") and the driver version."""
    smi = _run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader",
                "--id=0"])
    smi_name, driver = (smi.split(", ", 1) + [None])[:2] if smi else (None, None)
    name = None
    if torch is not None and torch.cuda.is_available():
        name = torch.cuda.get_device_name()
    return name or smi_name or "unknown", driver


def metadata(benchmark: str, torch=None) -> dict:
    """What ran, where, when and from which commit, for the top of a results file."""
    device, driver = device_and_driver(torch)
    script = pathlib.Path(sys.argv[0])
    shown = f"bench/{script.name}" if script.parent.resolve() == BENCH_DIR else str(script)
    return {"benchmark": benchmark, "device": device, "driver": driver,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "commit": git_commit(), "command": " ".join(["python", shown, *sys.argv[1:]]),
            "source": "measured"}


def write_results(path: str, benchmark: str, rows: list[dict], torch=None, **extra) -> None:
    """Write ``rows`` (and ``extra`` keys) under this run's :func:`metadata` to ``path``."""
    with open(path, "w") as f:
        json.dump({**metadata(benchmark, torch), **extra, "rows": rows}, f, indent=1)
        f.write("\n")


def device_slug(device: str) -> str:
    """File-name form of a device name: "NVIDIA H100 80GB HBM3" -> "h100-80gb-hbm3"."""
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower().removeprefix("nvidia ")).strip("-")
    return slug or "unknown"


def canonical_name(result: dict) -> str:
    """Where a results file lives under ``bench/results/``: ``<benchmark>.<device>.json``, so a
    new run of a benchmark on a device replaces the previous one."""
    return f"{result['benchmark']}.{device_slug(result['device'])}.json"
