"""One C call a library call against each entry point's Python path, on the GPU machine, in
one process and few compiles (issue 42; :mod:`kiln.kernels.one_call`).

First, correctness on ``bench/launch_overhead.py``'s inputs: each entry point's outputs
through its one C call equal those of its Python path on the same inputs (both in turns on
one plan), no NaN; ``decode_attention`` captured in a CUDA graph through the one call and
replayed on new inputs equals an eager call on them. Then host µs per call (median and
fastest batch), eager and graph µs, one path after the other in turns A B B A
(``launch_overhead.run_library`` with ``--turns`` rounds), with the one-call hits per row;
entry points in the order given by ``--only`` (matmul with its first config, untuned: the
host path is the same for any config). Each entry point is checked then timed before the
next (a run cut short keeps those); rows print as they come, a table last.

Usage: ``python bench/host_one_call.py --only decode_attention,decode,combine,prefill,matmul``.
"""

from __future__ import annotations

import argparse
import json
import sys

from launch_overhead import _print_table, _ratios, library_calls, run_library


def _tensors(out) -> list:
    return list(out) if isinstance(out, tuple) else [out]


def check_paths(torch, calls: dict) -> dict:
    """name -> whether the one call's outputs equal the Python path's (same inputs, no NaN)."""
    from kiln.kernels.one_call import clear_slots, one_call_hits

    verdicts = {}
    for name, call in calls.items():
        call()
        clear_slots()  # the next call takes the Python path (and installs the one call)
        python = [t.clone() for t in _tensors(call())]
        hits = one_call_hits()
        one = _tensors(call())
        torch.cuda.synchronize()
        pairs = list(zip(one, python)) if len(one) == len(python) else []
        verdicts[name] = {
            "equal": bool(pairs) and all(torch.equal(a, b) for a, b in pairs),
            "close": bool(pairs) and all(torch.allclose(a.float(), b.float(), rtol=1e-5,
                                                        atol=1e-5) for a, b in pairs),
            "nan": any(bool(torch.isnan(a.float()).any()) for a in one),
            "one call": one_call_hits() - hits}
        print(f"  check {name}: {verdicts[name]}", flush=True)
    return verdicts


def pieces(torch, calls: dict, batches: int) -> dict:
    """µs per call of the pieces of decode's, decode_attention's and combine's one call on
    the GPU: its fresh outputs alone (made and dropped), its launch(es) with ready addresses
    (outputs kept), and the whole call, the three in turns."""
    import importlib

    from launch_overhead import _per_launch_us

    decode_plan = importlib.import_module("kiln.kernels.attention.decode_plan")
    combine_module = importlib.import_module("kiln.kernels.attention.combine")
    sync, rows = torch.cuda.synchronize, {}
    for name, call in calls.items():
        short = name.split(" ")[0]
        if short not in ("decode", "decode_attention", "combine") or "out=" in name:
            continue
        made = call()
        call()
        if short == "combine":
            plan = combine_module._PLANS.last[1]
            closure = {n: c.cell_contents for n, c in zip(call.__code__.co_freevars,
                                                          call.__closure__)}
            o_p, lse_p, counts = closure["o_part"], closure["lse_part"], closure["counts"]
            maker = plan.fresh.fast
            items = (o_p.data_ptr(), lse_p.data_ptr(), counts.data_ptr(),
                     *(t.data_ptr() for t in made))
            launches = [(plan.bound, items)]
        else:
            plan = decode_plan.PLANS.last[1]
            closure = {n: c.cell_contents for n, c in zip(call.__code__.co_freevars,
                                                          call.__closure__)}
            q, k, v, table, lens = closure["paged"]
            inputs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), table.data_ptr(),
                      lens.data_ptr(), *plan.placeholder_pointers)
            stream = plan.bound.current_stream()
            if short == "decode":
                maker = plan.partial_outputs.fast
                launches = [(plan.bound, inputs + tuple(t.data_ptr() for t in made) +
                             plan.no_output_pointers)]
            else:
                owners, space = plan.spaces.get(stream)
                maker = plan.torch_outputs.fast
                launches = [(plan.bound, inputs + tuple(space[:3]) +
                             tuple(t.data_ptr() for t in made) + (space[3],))]
        stream = plan.bound.current_stream()
        timed = {"outputs alone": lambda: maker[0](),
                 "launch, ready addresses": lambda: [b.launch_on(stream, *items)
                                                    for b, items in launches],
                 "whole call": call}
        row = rows[short] = {}
        for piece in list(timed) + list(timed)[::-1]:
            us = _per_launch_us(timed[piece], 100, batches, sync)
            row[piece] = round(min(row.get(piece, us), us), 3)
        print(f"  pieces {short}: {row}", flush=True)
    return rows


def kernel_grid(torch, batches: int) -> dict:
    """``kernel[grid](...)`` of a one-block kernel on torch tensors: right on the default and a
    side stream (its guarded launch reads the current stream), and µs per launch beside the
    shim's launch of a ready argument block."""
    from launch_overhead import N, _per_launch_us, add_one

    sync = torch.cuda.synchronize
    y = torch.zeros(N, device="cuda")
    side = torch.cuda.Stream()
    launcher = add_one[(1,)]
    for _ in range(3):
        launcher(y, N, BLOCK=N, num_warps=N // 32, target="sm_90a")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(1 << 20)  # the side stream busy: a launch on another stream would race
        for _ in range(3):
            launcher(y, N, BLOCK=N, num_warps=N // 32, target="sm_90a")
        guarded = getattr(add_one._last_launch, "guarded", None)
        spec = getattr(guarded, "args", (None, None))[1]  # the shim's launch_guarded spec
        follows = None if spec is None else spec[4]() == side.cuda_stream
    torch.cuda.current_stream().wait_stream(side)
    sync()
    row = {"right on both streams": bool((y == 6).all()), "reads the side stream": follows}
    plan = add_one.compile(y, N, BLOCK=N, num_warps=N // 32, target="sm_90a")._launch_plan
    arguments = plan.launcher.new_arguments()
    plan.launcher.pack(arguments, [y.data_ptr(), y.data_ptr(), 0, N, 1, N], (1, 1, 1),
                       torch.cuda.current_stream().cuda_stream)
    for _ in range(2):
        for key, issue in (("kernel[grid] µs", lambda: launcher(
                y, N, BLOCK=N, num_warps=N // 32, target="sm_90a")),
                           ("ready block µs", lambda: plan.launcher.launch_packed(arguments))):
            us = _per_launch_us(issue, 1000, batches, sync)
            row[key] = round(min(row.get(key, us), us), 3)
    print(f"  kernel[grid]: {row}", flush=True)
    return row


def check_capture(torch, target: str = "sm_90a") -> bool:
    """decode_attention captured through its one C call, replayed on new inputs, against an
    eager call on those inputs."""
    from kiln.kernels.attention import decode_attention

    gen = torch.Generator().manual_seed(1)

    def paged():
        kc = torch.randn(64, 64, 8, 128, generator=gen).cuda().bfloat16()
        table = torch.randperm(64, generator=gen).cuda().int().view(2, 32)
        return [torch.randn(2, 1, 32, 128, generator=gen).cuda().bfloat16(), kc,
                torch.randn(64, 64, 8, 128, generator=gen).cuda().bfloat16(), table,
                torch.tensor([2000, 777], dtype=torch.int32, device="cuda")]

    inputs = paged()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        decode_attention(*inputs, target=target)
        decode_attention(*inputs, target=target)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(*inputs, target=target)
    for x, fresh in zip(inputs, paged()):
        x.copy_(fresh)
    graph.replay()
    want = decode_attention(*inputs, target=target)
    torch.cuda.synchronize()
    return all(torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2)
               for a, b in zip(out, want))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="decode_attention,decode,combine,prefill,matmul")
    parser.add_argument("--batches", type=int, default=9)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--driver", action="store_true",
                        help="first, bench/host_driver.py's rows (the driver's share)")
    parser.add_argument("--pieces", action="store_true",
                        help="first, kernel[grid] on two streams, then the pieces of decode's, "
                             "decode_attention's and combine's one call")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    import torch

    driver = None
    if args.driver:  # in this process: no second torch import or CUDA start
        from host_driver import print_rows, run as run_driver

        driver = run_driver(500, 5)
        print_rows(driver)

    from kiln.kernels.gemm import HOPPER_CONFIGS, hopper_autotuner
    from launch_bridge_report import load_bridge

    key = hopper_autotuner.key_of((None, None, None, 1024, 1024, 1024, "bf16", "mn", "bf16",
                                   "sm_90a"), {})
    hopper_autotuner.best.setdefault(key, HOPPER_CONFIGS[0])
    bridge, report = load_bridge()
    names = [name for name in args.only.split(",") if name]
    calls = library_calls(torch, "cuda")
    results: dict = {"torch_bridge": report, "library": [], "checks": {}, "driver": driver}
    if args.pieces:
        results["kernel_grid"] = kernel_grid(torch, args.batches)
        results["pieces"] = pieces(torch, calls, args.batches)
    variants = (("", "native", True, True, True), ("pycall_", "native", True, True, False))
    for name in names:  # each entry point checked, then timed: a run cut short keeps those
        results["checks"].update(check_paths(torch, {n: c for n, c in calls.items()
                                                     if n.split(" ")[0] == name}))
        results["library"] += run_library(torch, args.batches, variants, bridge,
                                          (name + " ",), args.turns)
        print("  " + " | ".join(f"{row['path'][5:30]} {row.get('us', 0):.2f} / "
                                f"{row.get('pycall_us', 0):.2f}" for row in results["library"]
                                if row["path"].startswith(f"kiln {name} ")), flush=True)
    results["capture"] = check_capture(torch)
    print(f"  capture through the one call equals eager: {results['capture']}", flush=True)
    results["ratios"] = _ratios(results)
    _print_table(results)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
