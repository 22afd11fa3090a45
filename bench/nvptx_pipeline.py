"""LLVM IR -> PTX: Kiln's pipeline (``KILN_NVPTX_PIPELINE=fast``) against upstream's
``gpu-module-to-binary`` (``mlir``) and ``default<O3>`` through the C API (``o3``), per kernel.

For each kernel of ``bench/compile_time.py``'s table (sm_90a ones) the kernel is compiled once
per pipeline in this process with the cache off, in rotation, ``--repeat`` times; it prints
whether each pipeline's PTX is byte-identical to ``mlir``'s and the fastest CPU milliseconds of
the ``ptx`` stage (CPU time: on a shared machine wall time is noise), with the ratio to ``mlir``.

Example::

    .venv/bin/python bench/nvptx_pipeline.py prefill_sm90_d256 saxpy_sm90 --repeat 3
    .venv/bin/python bench/nvptx_pipeline.py --parallel matmul_sm90 grouped_matmul_sm90 \
        matmul_fp8_sm90 decode_sm90_wgmma      # at once, as autotune compiles its configs

The last line of stdout is the JSON (``{"benchmark": "nvptx_pipeline", "rows": [...]}``).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import sys
import time

os.environ["KILN_NO_CACHE"] = "1"

from compile_jobs import k  # noqa: E402
from compile_time import JOBS  # noqa: E402
from kiln.kernel import JITKernel  # noqa: E402

PIPELINES = ("mlir", "o3", "fast")


def forget_compiled() -> None:
    """Empty every kernel's in-memory specialisations, so the next call compiles again."""
    for obj in gc.get_objects():
        if isinstance(obj, JITKernel):
            obj._compiled.clear()


def ptx_cpu_ms(kernel) -> float:
    """CPU ms of the kernel's ``ptx`` stage (its profile's top-level step)."""
    return next(cpu for step, _, cpu in kernel.metadata["compile_profile"] if step == "ptx")


def measure(name: str, repeat: int) -> dict:
    """Each pipeline's PTX digest and fastest ``ptx`` CPU ms for kernel ``name``."""
    best: dict[str, float] = {}
    digest: dict[str, str] = {}
    for _ in range(repeat):
        for pipeline in PIPELINES:
            os.environ["KILN_NVPTX_PIPELINE"] = pipeline
            forget_compiled()
            kernel = eval(JOBS[name], {"k": k})
            digest[pipeline] = hashlib.sha256(kernel.asm["ptx"].encode()).hexdigest()[:16]
            best[pipeline] = min(best.get(pipeline, float("inf")), ptx_cpu_ms(kernel))
    row = {"kernel": name, "ptx_cpu_ms": {p: round(v, 1) for p, v in best.items()},
           "identical": {p: digest[p] == digest["mlir"] for p in PIPELINES if p != "mlir"},
           "ratio": {p: round(best[p] / best["mlir"], 3) for p in PIPELINES if p != "mlir"}}
    print(f"{name:<24} " + "  ".join(
        f"{p} {best[p]:7.1f} ms" + ("" if p == "mlir" else
                                    f" ({row['ratio'][p]:.2f}x, "
                                    f"{'same' if row['identical'][p] else 'DIFFERENT'} PTX)")
        for p in PIPELINES), flush=True)
    return row


def parallel(names: list[str], repeat: int) -> dict:
    """Wall seconds to compile ``names`` at once on autotune's thread pool, per pipeline (the
    fastest of ``repeat``), beside the sum of their one-at-a-time compiles."""
    from kiln.autotune import compile_all

    best: dict[str, dict] = {}
    for _ in range(repeat):
        for pipeline in ("mlir", "fast"):
            os.environ["KILN_NVPTX_PIPELINE"] = pipeline
            forget_compiled()
            started = time.perf_counter()
            for name in names:
                eval(JOBS[name], {"k": k})
            serial = time.perf_counter() - started
            forget_compiled()
            started = time.perf_counter()
            compile_all(lambda name: eval(JOBS[name], {"k": k}), names)
            wall = time.perf_counter() - started
            if pipeline not in best or wall < best[pipeline]["parallel_s"]:
                best[pipeline] = {"parallel_s": round(wall, 3), "serial_s": round(serial, 3)}
    row = {"kernels": names, **best,
           "ratio": round(best["fast"]["parallel_s"] / best["mlir"]["parallel_s"], 3)}
    print(f"{len(names)} kernels at once: mlir {best['mlir']['parallel_s']:.2f} s "
          f"(one at a time {best['mlir']['serial_s']:.2f}), fast {best['fast']['parallel_s']:.2f} s "
          f"(one at a time {best['fast']['serial_s']:.2f}); fast / mlir {row['ratio']:.2f}",
          flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    nvidia = [name for name in JOBS if "gfx" not in name]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kernels", nargs="*", help=f"default: all of {', '.join(nvidia)}")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--parallel", action="store_true",
                        help="compile the kernels at once on autotune's thread pool instead")
    ns = parser.parse_args(argv)
    unknown = sorted(set(ns.kernels) - set(nvidia))
    if unknown:
        parser.error(f"unknown kernels {unknown}; choose from {nvidia}")
    if ns.parallel:
        print(json.dumps({"benchmark": "nvptx_pipeline", "parallel": parallel(
            ns.kernels or nvidia, ns.repeat)}))
        return 0
    rows = [measure(name, ns.repeat) for name in ns.kernels or nvidia]
    print(json.dumps({"benchmark": "nvptx_pipeline", "rows": rows}))
    return 0 if all(all(row["identical"].values()) for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
