"""Generate ``bench/RESULTS.md`` (one page of current numbers) from ``bench/results/*.json``.

Each results file (format: ``results_io.py``) becomes one table headed by its device, date,
commit and command, with Kiln's numbers next to its peers' and the ratios between them.
Experiments and their outcomes live in ``bench/LEDGER.md``, not here.

Usage::

    python bench/results_page.py                 # rewrite bench/RESULTS.md
    python bench/results_page.py --check         # exit 1 if RESULTS.md is stale
    python bench/results_page.py --add OUT/*.json [--commit HASH]  # file new runs, rewrite
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys

from results_io import REQUIRED_FIELDS, RESULTS_DIR, canonical_name

PAGE = RESULTS_DIR.parent / "RESULTS.md"


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _get(key, scale=None):
    """A column reading ``row[key]`` (times ``scale`` where it is a number: ms to µs)."""
    def read(row, doc):
        value = row.get(key)
        return value * scale if scale is not None and _number(value) else value
    return read


def _ratio(num, den):
    """A column ``num / den`` of two other columns' readers, where both are numbers."""
    def read(row, doc):
        a, b = num(row, doc), den(row, doc)
        return a / b if _number(a) and _number(b) and b else None
    return read


def _first(*readers):
    """The first reader that gives a value (the ratio the run recorded from unrounded times,
    else one computed from the columns)."""
    def read(row, doc):
        for reader in readers:
            value = reader(row, doc)
            if value is not None:
                return value
        return None
    return read


def _best_sdpa(row, doc):
    peers = [row.get(k) for k in ("cudnn_tflops", "flash_tflops")]
    peers = [p for p in peers if _number(p)]
    return max(peers) if peers else None


def _triton_ratio(row, doc):
    triton = next((r.get("us") for r in doc["rows"] if r.get("path") == "triton launch"), None)
    us = row.get("us")
    if row.get("path") == "triton launch" or not _number(us) or not _number(triton):
        return None
    return us / triton


# benchmark -> (title, [(column header, reader, format)]); a column no row fills is left out.
TABLES = {
    "decode": ("Split-KV paged decode vs torch gather + SDPA and copy bandwidth", [
        ("ctx", _get("ctx"), "d"), ("batch", _get("batch"), "d"), ("Sq", _get("sq"), "d"),
        ("Kiln µs", _get("kiln_ms", 1e3), ".1f"), ("torch µs", _get("torch_ms", 1e3), ".1f"),
        ("Kiln / copy", _first(_get("ratio_to_copy"), _ratio(
            _get("kiln_gbs"), lambda row, doc: doc.get("copy_gbs"))), ".2f"),
        ("torch / Kiln time", _first(_get("speedup_vs_torch"),
                                     _ratio(_get("torch_ms"), _get("kiln_ms"))), ".1f"),
        ("host µs", _get("host_us"), ".1f")]),
    "attention": ("Attention prefill vs torch SDPA (cuDNN, flash); TFLOP/s", [
        ("B", _get("batch"), "d"), ("seq", _get("seq"), "d"),
        ("Hq/Hkv", lambda row, doc: f"{row['hq']}/{row['hkv']}", "s"), ("D", _get("d"), "d"),
        ("causal", lambda row, doc: "yes" if row["causal"] else "no", "s"),
        ("Kiln", _get("kiln_tflops"), ".0f"), ("cuDNN", _get("cudnn_tflops"), ".0f"),
        ("flash", _get("flash_tflops"), ".0f"),
        ("Kiln / best SDPA", _first(_get("ratio_vs_best_sdpa"),
                                    _ratio(_get("kiln_tflops"), _best_sdpa)), ".2f")]),
    "combine": ("Split-KV combine vs torch, copy bandwidth and launch latency", [
        ("splits", _get("splits"), "d"), ("batch", _get("batch"), "d"), ("sq", _get("sq"), "d"),
        ("H", _get("heads"), "d"), ("run", _get("run"), "d"),
        ("launch µs", _get("launch_us"), ".1f"), ("Kiln µs", _get("kiln_us"), ".1f"),
        ("out= µs", _get("kiln_out_us"), ".1f"), ("torch µs", _get("torch_us"), ".1f"),
        ("GPU µs", _get("gpu_us"), ".1f"), ("Kiln / copy", _get("kiln_vs_copy"), ".2f"),
        ("torch / Kiln time", _get("kiln_vs_torch"), ".2f"),
        ("Kiln / launch", _get("kiln_vs_launch"), ".2f"),
        ("out= / launch", _get("kiln_out_vs_launch"), ".2f")]),
    "gemm": ("Hopper GEMM vs cuBLAS (bf16 in/out, f32 accumulate, autotuned); TFLOP/s", [
        ("M×N×K", lambda row, doc: f"{row['m']}×{row['n']}×{row['k']}", "s"),
        ("Kiln", _get("kiln_tflops"), ".0f"), ("cuBLAS", _get("cublas_tflops"), ".0f"),
        ("Kiln / cuBLAS", _first(_get("ratio"),
                                 _ratio(_get("kiln_tflops"), _get("cublas_tflops"))), ".3f"),
        ("config", _get("config"), "s")]),
    "gemm_grouped": ("Grouped (MoE) GEMM vs dense GEMM of the same FLOPs and a torch loop "
                     "(bf16); TFLOP/s", [
        ("G", _get("groups"), "d"), ("K×N", lambda row, doc: f"{row['k']}×{row['n']}", "s"),
        ("total M", _get("total_m"), "d"),
        ("group sizes", lambda row, doc: f"{row['min_group']}..{row['max_group']}", "s"),
        ("grouped", _get("grouped_tflops"), ".0f"), ("dense", _get("dense_tflops"), ".0f"),
        ("torch loop", _get("torch_loop_tflops"), ".0f"),
        ("grouped / dense", _get("ratio_vs_dense"), ".3f"),
        ("grouped / dense, same config", _get("ratio_vs_dense_same_config"), ".3f"),
        ("grouped / loop", _get("ratio_vs_torch_loop"), ".2f")]),
    "gemm_grouped_fp8": ("Grouped (MoE) FP8 GEMM (e4m3, bf16 out) vs the dense FP8 GEMM of the "
                         "same FLOPs; TFLOP/s", [
        ("G", _get("groups"), "d"), ("scales", _get("kind"), "s"),
        ("K×N", lambda row, doc: f"{row['k']}×{row['n']}", "s"),
        ("group sizes", lambda row, doc: f"{row['min_group']}..{row['max_group']}", "s"),
        ("grouped", _get("grouped_tflops"), ".0f"), ("dense", _get("dense_tflops"), ".0f"),
        ("_scaled_mm", _get("scaled_mm_tflops"), ".0f"),
        ("grouped / dense", _get("ratio_vs_dense"), ".3f"),
        ("per-round median", _get("ratio_vs_dense_round_median"), ".3f")]),
    "gemm_fp8": ("FP8 GEMM (e4m3, bf16 out): per-tensor vs torch._scaled_mm, block-scaled "
                 "vs bf16 GEMMs; TFLOP/s", [
        ("scales", _get("kind"), "s"),
        ("M×N×K", lambda row, doc: f"{row['m']}×{row['n']}×{row['k']}", "s"),
        ("Kiln", _get("kiln_tflops"), ".0f"), ("_scaled_mm", _get("scaled_mm_tflops"), ".0f"),
        ("Kiln / _scaled_mm", _get("ratio_vs_scaled_mm"), ".3f"),
        ("Kiln bf16", _get("kiln_bf16_tflops"), ".0f"),
        ("cuBLAS bf16", _get("cublas_bf16_tflops"), ".0f"),
        ("/ Kiln bf16", _get("ratio_vs_kiln_bf16"), ".2f"),
        ("/ cuBLAS bf16", _get("ratio_vs_cublas_bf16"), ".2f"), ("config", _get("config"), "s")]),
    "launch_overhead": ("Host cost per launch: a one-block kernel and the library entry points", [
        ("path", _get("path"), "s"), ("host µs / call", _get("us"), ".1f"),
        ("/ Triton", _triton_ratio, ".2f"), ("eager back-to-back µs", _get("eager_us"), ".1f"),
        ("GPU µs (graph replay)", _get("gpu_us"), ".1f")]),
    "gemm_llm": ("LLM GEMM sweep (bf16, weights N×K) vs cuBLAS; ratio = cuBLAS time / Kiln time", [
        ("model", _get("model"), "s"), ("layer", _get("layer"), "s"), ("M", _get("m"), "d"),
        ("N×K", lambda row, doc: f"{row['n']}×{row['k']}", "s"),
        ("Kiln TFLOP/s", _get("kiln_tflops"), ".1f"),
        ("cuBLAS TFLOP/s", _get("cublas_tflops"), ".1f"),
        ("Kiln / copy", _get("kiln_copy_fraction"), ".2f"), ("ratio (call)", _get("ratio"), ".3f"),
        ("ratio (GPU time)", _get("ratio_gpu"), ".3f")]),
    "mla_decode": ("MLA decode (576/512, page 64) vs copy bandwidth and torch SDPA", [
        ("batch", _get("batch"), "d"), ("ctx", _get("ctx"), "d"), ("Sq", _get("sq"), "d"),
        ("H", _get("heads"), "d"), ("Kiln µs", _get("kiln_ms", 1e3), ".1f"),
        ("SDPA µs", _get("torch_sdpa_ms", 1e3), ".1f"), ("Kiln GB/s", _get("kiln_gbs"), ".0f"),
        ("Kiln / copy", _get("ratio_to_copy"), ".2f"), ("Kiln TFLOP/s", _get("kiln_tflops"), ".0f"),
        ("SDPA / Kiln time", _get("speedup_vs_torch"), ".1f")]),
    "compile_time": ("Cold compile of the library kernels (cache off, fresh process); seconds", [
        ("kernel", _get("kernel"), "s"), ("compile s", _get("compile_s"), ".2f"),
        ("goal s", _get("goal_s"), ".1f"), ("import s", _get("import_s"), ".2f"),
        ("trace ms", lambda row, doc: row["stages"].get("trace"), ".0f"),
        ("MLIR ms", lambda row, doc: sum(row["stages"].get(k, 0) for k in ("gpu", "nvvm", "llvm")),
         ".0f"),
        ("PTX ms", lambda row, doc: row["stages"].get("ptx"), ".0f"),
        ("ptxas ms", lambda row, doc: row["stages"].get("cubin"), ".0f")]),
    "tutorials": ("Tile-level tutorials vs Triton's tutorial kernels (and cuBLAS, Kiln's "
                  "prefill); lines = kernel code", [
        ("tutorial", _get("op"), "s"), ("shape", _get("shape"), "s"),
        ("causal", _get("causal"), "s"), ("Kiln GB/s", _get("kiln_gbs"), ".0f"),
        ("Triton GB/s", _get("triton_gbs"), ".0f"), ("Kiln / copy", _get("of_copy"), ".2f"),
        ("Kiln / same-size copy", _get("of_copy_same"), ".2f"),
        ("Kiln TFLOP/s", _get("kiln_tflops"), ".0f"),
        ("Triton TFLOP/s", _get("triton_tflops"), ".0f"),
        ("cuBLAS TFLOP/s", _get("cublas_tflops"), ".0f"),
        ("prefill TFLOP/s", _get("prefill_tflops"), ".0f"),
        ("Kiln / Triton", _get("vs_triton"), ".2f"), ("Kiln / cuBLAS", _get("vs_cublas"), ".2f"),
        ("Kiln / prefill", _get("vs_prefill"), ".2f"),
        ("lines Kiln", _get("kiln_lines"), "d"), ("lines Triton", _get("triton_lines"), "d")]),
    "attention_fp8": ("FP8 (e4m3) prefill vs Kiln's bf16 prefill, D 128; TFLOP/s", [
        ("B", _get("batch"), "d"), ("seq", _get("seq"), "d"), ("heads", _get("heads"), "d"),
        ("causal", _get("causal"), "s"), ("FP8", _get("fp8_tflops"), ".0f"),
        ("bf16", _get("bf16_tflops"), ".0f"), ("FP8 / bf16", _get("ratio_fp8_vs_bf16"), ".2f"),
        ("max abs error vs bf16 of dequantised", _get("max_abs_error"), ".4f")]),
}
TABLES["combine-small"] = ("Split-KV combine, small calls", TABLES["combine"][1])
TABLES["attention_head_dims"] = ("Attention prefill at other head dims and softcap vs torch SDPA "
                                 "(SDPA uncapped); TFLOP/s", [
    *TABLES["attention"][1][:4], ("Dv", _get("dv"), "d"), ("softcap", _get("softcap"), "g"),
    *TABLES["attention"][1][4:]])
ORDER = ("decode", "attention", "attention_head_dims", "combine", "combine-small", "mla_decode",
         "attention_fp8", "gemm", "gemm_grouped", "gemm_llm", "gemm_fp8", "gemm_grouped_fp8",
         "tutorials",
         "launch_overhead", "compile_time")


def load_results(directory: pathlib.Path = RESULTS_DIR) -> list[dict]:
    """Every results file, checked for the required metadata, in page order."""
    docs = []
    for path in sorted(directory.glob("*.json")):
        doc = json.loads(path.read_text())
        missing = [f for f in REQUIRED_FIELDS if f not in doc]
        if missing:
            raise SystemExit(f"{path}: missing {', '.join(missing)}")
        docs.append({**doc, "_file": path.name})
    rank = {name: i for i, name in enumerate(ORDER)}
    return sorted(docs, key=lambda d: (rank.get(d["benchmark"], len(ORDER)), d["benchmark"],
                                       d["_file"]))


def _cell(value, fmt: str) -> str:
    if value is None:
        return "–"
    if _number(value) and fmt != "s":
        return format(value, fmt)
    return str(value)


def _generic_columns(doc: dict):
    keys = list(dict.fromkeys(k for row in doc["rows"] for k in row))
    return [(k, _get(k), ".4g") for k in keys]


def table(doc: dict) -> list[str]:
    """One benchmark's section: header line, notes, plot link, table."""
    title, columns = TABLES.get(doc["benchmark"], (doc["benchmark"], None))
    columns = columns or _generic_columns(doc)
    cells = [[reader(row, doc) for _, reader, _ in columns] for row in doc["rows"]]
    keep = [i for i in range(len(columns)) if any(c[i] is not None for c in cells)]
    driver = f", driver {doc['driver']}" if doc.get("driver") else ""
    copy = f"; copy bandwidth {doc['copy_gbs']:.0f} GB/s" if _number(doc.get("copy_gbs")) else ""
    lines = [f"## {title} ({doc['device']})", "",
             f"{doc['device']}{driver} · {doc['date']} · commit {doc['commit']} · "
             f"`{doc['command']}`", "",
             f"Source: {doc['source']}; data `results/{doc['_file']}`{copy}.", ""]
    if doc.get("notes"):
        lines += [doc["notes"], ""]
    if doc.get("plot") and (PAGE.parent / doc["plot"]).exists():
        lines += [f"Plot: [{doc['plot']}]({doc['plot']}).", ""]
    numeric = [columns[i][2] != "s" for i in keep]
    lines.append("| " + " | ".join(columns[i][0] for i in keep) + " |")
    lines.append("| " + " | ".join("---:" if n else "---" for n in numeric) + " |")
    for row in cells:
        lines.append("| " + " | ".join(_cell(row[i], columns[i][2]) for i in keep) + " |")
    return lines + [""]


def render(docs: list[dict]) -> str:
    lines = ["# Benchmark results", "",
             "Generated by `python bench/results_page.py` from `bench/results/*.json`: do not edit "
             "by hand. One table per benchmark, each the latest run recorded, with the device, "
             "date, commit and command it ran with; peers (torch, cuDNN, cuBLAS, Triton, copy "
             "bandwidth) were timed in the same process. What was tried and what it gave: "
             "[LEDGER.md](LEDGER.md) (it also says how to record a run).", ""]
    for doc in docs:
        lines += table(doc)
    return "\n".join(lines).rstrip("\n") + "\n"


def add(paths: list[str], commit: str | None = None) -> None:
    """File new results under ``bench/results/`` by their canonical names, with the plot a
    file names (found beside it) copied into ``bench/``. ``commit`` replaces an "unknown"
    one (a device copy of the tree without git metadata)."""
    for name in paths:
        path = pathlib.Path(name)
        doc = json.loads(path.read_text())
        missing = [f for f in REQUIRED_FIELDS if f not in doc]
        if missing:
            raise SystemExit(f"{path}: missing {', '.join(missing)} (not a results file)")
        if commit and doc["commit"] == "unknown":
            doc["commit"] = commit
        target = RESULTS_DIR / canonical_name(doc)
        target.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
        print(f"{path} -> {target}")
        plot = path.parent / pathlib.Path(doc.get("plot") or "").name
        if doc.get("plot") and plot.is_file():
            shutil.copyfile(plot, PAGE.parent / plot.name)
            print(f"{plot} -> {PAGE.parent / plot.name}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if RESULTS.md differs from what the JSON gives")
    parser.add_argument("--add", nargs="+", metavar="JSON",
                        help="file these results under bench/results/ first")
    parser.add_argument("--commit", help="with --add: the commit of results that say unknown")
    args = parser.parse_args(argv)
    if args.add:
        add(args.add, args.commit)
    text = render(load_results())
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE} is stale: run python bench/results_page.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
