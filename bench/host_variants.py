"""Host-cost variants of the library entry points' steady state, on the GPU machine (issue 42).

What a repeat call of ``prefill``, ``decode``, ``decode_attention``, ``combine`` and ``matmul``
could be made of, each variant timed in the same run (wall-clock µs per call, median of
batches after warm-up, each fresh tensor counted with its release):

- ``alloc``: ways to get one fresh contiguous CUDA tensor (``torch.empty`` with a string or a
  ``torch.device``, ``new_empty``, ``empty_like`` of an expanded or a real template,
  ``empty_strided``, the aten op), and sets of fresh tensors carved from one allocation shared
  by several calls (``unbind`` or ``unflatten_dense_tensors`` of a per-stream chunk);
- ``reads``: a tensor's attributes a guard or a launch reads, the stream getters, a Python
  frame;
- ``entry``: each entry point whole, then replicas of its hot path with each allocation
  variant (guard, outputs, one ``launch_on``, or one ``launch_outputs`` C call), the guard with
  and without torch's C++ tensor check, so the gain of a variant is measured, not summed;
- ``params``: the driver's share of a launch by parameter count: a one-block kernel's launch
  against ``decode_attention``'s (105 flat parameters), and that kernel by ctypes with a
  pointer per parameter against one packed buffer (``extra``, cuFuncGetParamInfo's layout;
  ``bench/host_params.py``).

Usage::

    python bench/host_variants.py --json /tmp/variants.json
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import math
import sys

sys.path.insert(0, "bench")
from host_breakdown import _closure, per_call_us  # noqa: E402


def timed(call, calls=2000, batches=7, sync=None) -> float:
    return per_call_us(call, calls, batches, sync)


class ChunkSets:
    """Sets of fresh tensors (``specs``: (shape, dtype) each) carved ``sets`` at a time from
    one allocation per stream: a prototype of a pooled output maker."""

    def __init__(self, torch, like, specs, sets, how="unbind"):
        self.torch, self.like, self.sets, self.how = torch, like, sets, how
        self.ready: dict = {}
        self.regions = []
        offset = 0
        for shape, dtype in specs:
            item = torch.empty((), dtype=dtype).element_size()
            numel = math.prod(shape)
            slot = -(-numel * item // 16) * 16 // item  # elements a set's tensor occupies
            strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
            self.regions.append((dtype, shape, strides, slot, offset // item, numel))
            offset += -(-slot * item * sets // 256) * 256
        self.total = offset
        self.templates = [like.new_empty((), dtype=dtype).expand(shape) for shape, dtype in specs]

    def refill(self, stream):
        torch = self.torch
        chunk = self.like.new_empty(self.total, dtype=torch.uint8)
        columns = []
        for (dtype, shape, strides, slot, offset, numel), template in zip(self.regions,
                                                                          self.templates):
            typed = chunk.view(dtype)
            if self.how == "unbind":
                columns.append(typed.as_strided((self.sets, *shape), (slot, *strides),
                                                offset).unbind(0))
            else:
                flat = typed[offset:offset + slot * self.sets]
                columns.append(torch._C._nn.unflatten_dense_tensors(
                    flat, [template] * self.sets) if slot == numel else None)
        ready = list(zip(*columns)) if len(columns) > 1 else list(columns[0])
        self.ready[stream] = ready
        return ready.pop()

    def take(self, stream):
        ready = self.ready.get(stream)
        if ready:
            return ready.pop()
        return self.refill(stream)


def alloc_rows(torch) -> dict:
    dev = torch.device("cuda", torch.cuda.current_device())
    raw = torch._C._cuda_getCurrentRawStream
    capturing = torch._C._cuda_isCurrentStreamCapturing
    rows = {}
    for label, shape, dtype in (("o 8KB", (1, 1, 32, 128), torch.bfloat16),
                                ("c 2MB", (1024, 1024), torch.bfloat16)):
        like = torch.empty(1, dtype=dtype, device=dev)
        expanded = like.new_empty(()).expand(shape)
        real = torch.empty(shape, dtype=dtype, device=dev)
        strides = real.stride()
        size = torch.Size(shape)
        contiguous = torch.contiguous_format
        aten_like = torch.ops.aten.empty_like.default
        variants = {
            "torch.empty(shape, dtype, device='cuda')": lambda: torch.empty(
                shape, dtype=dtype, device="cuda"),
            "torch.empty(shape, dtype, device obj)": lambda: torch.empty(
                shape, dtype=dtype, device=dev),
            "torch.empty(Size, dtype, device obj)": lambda: torch.empty(
                size, dtype=dtype, device=dev),
            "like.new_empty(shape)": functools.partial(like.new_empty, shape),
            "like.new_empty(shape, dtype)": lambda: like.new_empty(shape, dtype=dtype),
            "empty_like(expanded) partial": functools.partial(torch.empty_like, expanded),
            "empty_like(expanded, contiguous)": functools.partial(
                torch.empty_like, expanded, memory_format=contiguous),
            "empty_like(real) partial": functools.partial(torch.empty_like, real),
            "empty_strided(shape, strides, dtype, device)": lambda: torch.empty_strided(
                shape, strides, dtype=dtype, device=dev),
            "like.new_empty_strided(shape, strides)": functools.partial(
                like.new_empty_strided, shape, strides),
            "aten.empty_like.default(real)": functools.partial(aten_like, real),
        }
        for sets in (8, 32):
            pool = ChunkSets(torch, like, [(shape, dtype)], sets)
            variants[f"chunk/unbind x{sets}: take(raw(-1))"] = lambda p=pool: p.take(raw(-1))
            variants[f"chunk/unbind x{sets}: capturing()+take"] = \
                lambda p=pool: capturing() or p.take(raw(-1))
            flat = ChunkSets(torch, like, [(shape, dtype)], sets, how="unflatten")
            variants[f"chunk/unflatten x{sets}: take"] = lambda p=flat: p.take(raw(-1))
        for name, call in variants.items():
            try:
                rows[f"{label}: {name}"] = timed(call, 1000 if "2MB" in label else 2000)
            except Exception as error:  # an API this torch lacks
                rows[f"{label}: {name}"] = f"{type(error).__name__}: {error}"
            print(f"  {label}: {name:<48}{rows[f'{label}: {name}']}", flush=True)
    # Sets of 2 and 3 tensors (decode_attention's o/lse, decode's partials) from one chunk.
    like = torch.empty(1, device=dev)
    two = [((1, 1, 32, 128), torch.bfloat16), ((1, 1, 32), torch.float32)]
    three = [((16, 1, 1, 32, 128), torch.float32), ((16, 1, 1, 32), torch.float32),
             ((1, 1, 32), torch.int32)]
    for label, specs in (("2 tensors (o, lse)", two), ("3 tensors (decode partials)", three)):
        makers = [functools.partial(torch.empty_like, like.new_empty((), dtype=d).expand(s))
                  for s, d in specs]
        rows[f"{label}: empty_like each"] = timed(lambda: [m() for m in makers])
        for sets in (8, 32):
            pool = ChunkSets(torch, like, specs, sets)
            rows[f"{label}: chunk/unbind x{sets}"] = timed(lambda p=pool: p.take(raw(-1)))
        for key in [k for k in rows if k.startswith(label)]:
            print(f"  {key:<64}{rows[key]}", flush=True)
    return rows


def tensor_guards(torch, examples):
    """torch's C++ tensor guard (dynamo's) of ``examples``, by the constructor this torch has."""
    from torch._C._dynamo.guards import TensorGuards

    tries = {"dims": dict(dynamic_dims_sizes=[list(t.shape) for t in examples],
                          dynamic_dims_strides=[list(t.stride()) for t in examples]),
             "dynamic_shapes": dict(dynamic_shapes=False), "plain": {}}
    errors = []
    for how, kwargs in tries.items():
        try:
            return TensorGuards(*examples, **kwargs), how
        except Exception as error:
            errors.append(f"{how}: {error}")
    raise RuntimeError("; ".join(errors))


def read_rows(torch) -> dict:
    t = torch.empty(1, 1, 32, 128, dtype=torch.bfloat16, device="cuda")
    raw, device = torch._C._cuda_getCurrentRawStream, torch._C._cuda_getDevice

    def frame():
        return None

    ops = {
        "empty lambda": lambda: None,
        "python frame (def call)": frame,
        "t.shape": lambda: t.shape,
        "t.dtype": lambda: t.dtype,
        "t.stride()": t.stride,
        "t.is_contiguous()": t.is_contiguous,
        "t.get_device()": t.get_device,
        "t.device": lambda: t.device,
        "t.is_cuda": lambda: t.is_cuda,
        "t.data_ptr()": t.data_ptr,
        "t.numel()": t.numel,
        "raw(device())": lambda: raw(device()),
        "partial(raw, 0)": functools.partial(raw, 0),
        "partial(raw, -1)": functools.partial(raw, -1),
        "capturing()": torch._C._cuda_isCurrentStreamCapturing,
        "tuple of 13": lambda: (t, t, t, t, t, None, None, None, None, "sm_90a", None, None,
                                None),
    }
    try:
        from kiln.runtime.native import native_module
        from kiln.kernels.plan_guard import make_guard
        shim = native_module()
        one = make_guard((t,), shim.guard_values)
        five = make_guard((t, t, t, t, t, None, None, None, None, "sm_90a", None, None, None),
                          shim.guard_values)
        values1 = (t,)
        values5 = (t, t, t, t, t, None, None, None, None, "sm_90a", None, None, None)
        ops["guard_values 1 tensor"] = lambda: one(values1)
        ops["guard_values 5 tensors + 8 values"] = lambda: five(values5)
    except Exception as error:  # no shim
        print(f"  guard rows skipped: {error}")
    try:
        tg5, how = tensor_guards(torch, (t, t, t, t, t))
        tg1, _ = tensor_guards(torch, (t,))
        ops[f"TensorGuards.check 1 tensor ({how})"] = functools.partial(tg1.check, t)
        ops[f"TensorGuards.check 5 tensors ({how})"] = functools.partial(tg5.check, t, t, t, t, t)
        other = torch.empty(1, 1, 32, 64, dtype=torch.bfloat16, device="cuda")
        print(f"  TensorGuards: check(t) {tg1.check(t)}, check(other shape) {tg1.check(other)}, "
              f"check(t.T) {tg1.check(t.transpose(2, 3))}, check(float) "
              f"{tg1.check(t.float())}, check(t.unsqueeze(0)) {tg1.check(t.unsqueeze(0))}",
              flush=True)
    except Exception as error:
        print(f"  TensorGuards unavailable: {type(error).__name__}: {error}", flush=True)
    base = timed(ops.pop("empty lambda"), 5000, 5)
    rows = {"(empty lambda)": base}
    for name, op in ops.items():
        rows[name] = round(timed(op, 5000, 5) - base, 3)
        print(f"  {name:<48}{rows[name]}", flush=True)
    side = torch.cuda.Stream()
    same = [raw(-1) == raw(device())]
    with torch.cuda.stream(side):
        same.append(raw(-1) == raw(device()) == side.cuda_stream)
    rows["raw(-1) is the current stream (default, side)"] = same
    print(f"  raw(-1) is the current stream: {same}", flush=True)
    return rows


def entry_rows(torch) -> dict:
    from launch_overhead import library_calls

    from kiln.kernels import gemm
    # The modules, not the entry points that kiln.kernels.attention exports by these names.
    combine_module, decode_plan, prefill_module = (
        importlib.import_module(f"kiln.kernels.attention.{name}")
        for name in ("combine", "decode_plan", "prefill"))
    from kiln.kernels.workspaces import TorchOutputs

    key = gemm.hopper_autotuner.key_of((None, None, None, 1024, 1024, 1024, "bf16", "mn",
                                        "bf16", "sm_90a"), {})
    gemm.hopper_autotuner.best[key] = gemm.HOPPER_CONFIGS[0]
    raw = torch._C._cuda_getCurrentRawStream
    capturing = torch._C._cuda_isCurrentStreamCapturing
    calls = library_calls(torch, "cuda", "sm_90a")
    sync = torch.cuda.synchronize
    rows: dict = {}

    def record(name, label, call, calls_=200):
        try:
            if call() is None and "only" not in label:
                raise RuntimeError("the guard missed: not a steady-state call")
            sync()
            rows[f"{name}: {label}"] = timed(call, calls_, 7, sync)
        except Exception as error:
            rows[f"{name}: {label}"] = f"{type(error).__name__}: {error}"
        print(f"  {name[:22]:<22} {label:<44}{rows[f'{name}: {label}']}", flush=True)

    for name, call in calls.items():
        record(name, "whole call", call)
        record(name, "whole call (again)", call)
        if "out=" in name:  # the same plan as the row before
            continue
        try:
            variants = _replicas(torch, name, call, raw, capturing, decode_plan,
                                 combine_module, prefill_module, gemm, TorchOutputs)
        except Exception as error:
            print(f"  {name}: replicas failed: {type(error).__name__}: {error}", flush=True)
            continue
        for label, variant in variants.items():
            record(name, label, variant)
    return rows


def _replicas(torch, name, call, raw, capturing, decode_plan, combine_module, prefill_module,
              gemm, TorchOutputs) -> dict:
    """Hand-made hot paths of one entry point: guard, outputs by each variant, one launch."""
    call()
    given = _closure(call)
    out: dict = {}
    from kiln.kernels.plan_guard import make_guard
    from kiln.runtime.native import native_module

    def shim_guard(values):  # the guard without torch's C++ tensor check: attribute reads
        return make_guard(values, native_module().guard_values)

    if name.startswith("prefill"):
        guard, plan = prefill_module._PLANS.last
        dense = given["dense"]
        values = lambda: (dense, dense, dense, None, True, None, None, None, None, False,  # noqa
                          "sm_90a", None)
        launch = plan.bound.launch_on
        tail = (plan.no_lse.data_ptr(), plan.fixed_sinks.data_ptr(), *plan.cu_pointers)
        specs = [(tuple(dense.shape), dense.dtype)]
        makers = {"empty_like": lambda stream, one=plan.fresh.one: one()}
        for sets in (4, 16):
            pool = ChunkSets(torch, dense, specs, sets)
            makers[f"chunk x{sets}"] = lambda stream, p=pool: capturing() or p.take(stream)

        def run(make):
            def hot():
                if guard(values()):
                    stream = raw(-1)
                    o = make(stream)
                    launch(stream, dense.data_ptr(), dense.data_ptr(), dense.data_ptr(),
                           o.data_ptr(), *tail)
                    return o
            return hot
        out = {f"replica, {k}": run(m) for k, m in makers.items()}
        entry = plan.bound.launch_outputs
        makers["empty_like"] = (plan.fresh.makers[0],)
        for label, make in makers.items():
            out[f"C entry, {label}"] = lambda make=make: entry(
                make, raw(-1), dense, dense, dense, None, *tail) if guard(values()) else None
        out["guard only"] = lambda: guard(values())
        attr_guard = shim_guard(values())
        out["guard only (shim attribute reads)"] = lambda: attr_guard(values())
        o = plan.fresh.one()
        ptrs = (dense.data_ptr(),) * 3 + (o.data_ptr(), *tail)
        out["launch only (ready addresses)"] = lambda: launch(raw(-1), *ptrs)
    elif name.startswith("matmul"):
        guard, plan = gemm._PLANS.last
        a, b = given["a"], given["b"]
        launch = plan.bound.launch_on
        specs = [((1024, 1024), a.dtype)]
        makers = {"empty_like": lambda stream, one=plan.fresh_c.one: one()}
        pool = ChunkSets(torch, a, specs, 4)
        makers["chunk x4"] = lambda stream, p=pool: capturing() or p.take(stream)

        def run(make):
            def hot():
                if guard((a, b, False, None, "sm_90a", None)):
                    stream = raw(-1)
                    c = make(stream)
                    launch(stream, a.data_ptr(), b.data_ptr(), c.data_ptr())
                    return c
            return hot
        out = {f"replica, {k}": run(m) for k, m in makers.items()}
        entry = plan.bound.launch_outputs
        makers["empty_like"] = (plan.fresh_c.makers[0],)
        for label, make in makers.items():
            out[f"C entry, {label}"] = lambda make=make: entry(
                make, raw(-1), a, b, None) if guard((a, b, False, None, "sm_90a", None)) \
                else None
        out["guard only"] = lambda: guard((a, b, False, None, "sm_90a", None))
        attr_guard = shim_guard((a, b, False, None, "sm_90a", None))
        out["guard only (shim attribute reads)"] = lambda: attr_guard(
            (a, b, False, None, "sm_90a", None))
    elif name.startswith("combine"):
        guard, plan = combine_module._PLANS.last
        o_p, lse_p, counts = given["o_part"], given["lse_part"], given["counts"]
        slots = o_p.shape[0]
        launch = plan.bound.launch_on
        fresh = plan.fresh_outputs(lse_p)
        specs = [(plan.out_shape, plan.torch_out_dtype), (plan.lse_shape, torch.float32)]
        makers = {"empty_like": lambda stream: fresh()}
        for sets in (8, 32):
            pool = ChunkSets(torch, lse_p, specs, sets)
            makers[f"chunk x{sets}"] = lambda stream, p=pool: capturing() or p.take(stream)
        import kiln
        values = lambda: (o_p, lse_p, counts, slots, kiln.bf16, None, "sm_90a", None,  # noqa
                          None, None)

        def run(make):
            def hot():
                if guard(values()):
                    stream = raw(-1)
                    o, lse = make(stream)
                    launch(stream, o_p.data_ptr(), lse_p.data_ptr(), counts.data_ptr(),
                           o.data_ptr(), lse.data_ptr())
                    return o, lse
            return hot
        out = {f"replica, {k}": run(m) for k, m in makers.items()}
        entry = plan.bound.launch_outputs
        makers["empty_like"] = fresh.makers
        for label, make in makers.items():
            out[f"C entry, {label}"] = lambda make=make: entry(
                make, raw(-1), o_p, lse_p, counts, None, None) if guard(values()) else None
        out["guard only"] = lambda: guard(values())
        attr_guard = shim_guard(values())
        out["guard only (shim attribute reads)"] = lambda: attr_guard(values())
    elif name.startswith("decode"):
        guard, plan = decode_plan.PLANS.last
        q, k_cache, v_cache, table, lens = given["paged"]
        launch = plan.bound.launch_on
        ph = plan.placeholder_pointers
        fused = None if plan.fused else False
        values = lambda: (q, k_cache, v_cache, table, lens, None, None, None, None,  # noqa
                          "sm_90a", None, None, fused)
        inputs = lambda: (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),  # noqa
                          table.data_ptr(), lens.data_ptr(), *ph)
        if plan.fused:
            specs = [(plan.partial_shape[1:], torch.bfloat16),
                     (plan.partial_shape[1:4], torch.float32)]
            makers = {"empty_like": lambda stream: plan.torch_outputs()}
            for sets in (8, 32):
                pool = ChunkSets(torch, plan.no_sinks, specs, sets)
                makers[f"chunk x{sets}"] = lambda stream, p=pool: capturing() or p.take(stream)

            def run(make):
                def hot():
                    if guard(values()):
                        stream = raw(-1)
                        o, lse = make(stream)
                        owners, (p0, p1, p2, tickets) = plan.spaces.get(stream)
                        launch(stream, *inputs(), p0, p1, p2, o.data_ptr(), lse.data_ptr(),
                               tickets)
                        return o, lse
                return hot
        else:
            shape = tuple(plan.partial_shape)
            specs = [(shape, torch.float32), (shape[:4], torch.float32),
                     (shape[1:4], torch.int32)]
            no_out = plan.no_output_pointers
            strided = [(s_, tuple(math.prod(s_[i + 1:]) for i in range(len(s_))))
                       for s_ in (shape, shape[:4], shape[1:4])]

            def current(stream):  # the previous design: one allocation, three views
                words = plan.torch_partial_words()[0]
                return (words.as_strided(*strided[0], 0),
                        words.as_strided(*strided[1], plan.lse_offset),
                        words.view(torch.int32).as_strided(*strided[2], plan.counts_offset))
            three = TorchOutputs(plan.no_sinks, *specs)
            makers = {"1 alloc + 3 views (before)": current,
                      "3 empty_like": lambda stream: three()}
            for sets in (4, 16):
                pool = ChunkSets(torch, plan.no_sinks, specs, sets)
                makers[f"chunk x{sets}"] = lambda stream, p=pool: capturing() or p.take(stream)

            def run(make):
                def hot():
                    if guard(values()):
                        stream = raw(-1)
                        parts = make(stream)
                        launch(stream, *inputs(), parts[0].data_ptr(), parts[1].data_ptr(),
                               parts[2].data_ptr(), *no_out)
                        return parts
                return hot
        out = {f"replica, {k}": run(m) for k, m in makers.items()}
        entry = plan.bound.launch_outputs
        if plan.fused:
            makers["empty_like"] = plan.torch_outputs.makers

            def c_entry(make):
                def hot():
                    if guard(values()):
                        stream = raw(-1)
                        owners, (p0, p1, p2, tickets) = plan.spaces.get(stream)
                        return entry(make, stream, q, k_cache, v_cache, table, lens, *ph, p0,
                                     p1, p2, None, None, tickets)
                return hot
        else:
            del makers["1 alloc + 3 views (before)"]
            makers["3 empty_like"] = three.makers

            def c_entry(make):
                return lambda: entry(make, raw(-1), q, k_cache, v_cache, table, lens, *ph, None,
                                     None, None, *no_out) if guard(values()) else None
        for label, make in makers.items():
            out[f"C entry, {label}"] = c_entry(make)
        if plan.fused:
            kept_sets, makers_ = plan.spaces._kept, plan.torch_outputs.makers

            def spaces_inline():
                if guard(values()):
                    stream = raw(-1)
                    workspace = kept_sets.get(stream)
                    if workspace is None or capturing():
                        workspace = plan.spaces.get(stream)
                    p0, p1, p2, tickets = workspace[1]
                    return entry(makers_, stream, q, k_cache, v_cache, table, lens, *ph, p0,
                                 p1, p2, None, None, tickets)
            out["C entry, empty_like, workspace read inline"] = spaces_inline
        out["guard only"] = lambda: guard(values())
        attr_guard = shim_guard(values())
        out["guard only (shim attribute reads)"] = lambda: attr_guard(values())
        try:
            tg, _ = tensor_guards(torch, (q, k_cache, v_cache, table, lens))
            out["TensorGuards only (5 tensors)"] = lambda: tg.check(q, k_cache, v_cache, table,
                                                                    lens)
        except Exception as error:
            print(f"  no TensorGuards: {error}")
        kept = plan.torch_outputs() if plan.fused else three()  # real outputs
        if plan.fused:
            owners, (p0, p1, p2, tickets) = plan.spaces.get(raw(-1))
            ptrs = (*inputs(), p0, p1, p2, kept[0].data_ptr(), kept[1].data_ptr(), tickets)
        else:
            ptrs = (*inputs(), *(t.data_ptr() for t in kept), *no_out)
        out["launch only (ready addresses)"] = lambda: (kept, launch(raw(-1), *ptrs))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results to this JSON file")
    parser.add_argument("--only", choices=("alloc", "reads", "entry", "params"),
                        action="append")
    args = parser.parse_args(argv)
    import torch

    from host_params import param_rows

    torch.cuda.init()
    parts = args.only or ["reads", "alloc", "entry", "params"]
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    print(f"torch {torch.__version__}, python {sys.version.split()[0]}", flush=True)
    for part in parts:
        print(f"[{part}]", flush=True)
        table = {"alloc": alloc_rows, "reads": read_rows, "entry": entry_rows,
                 "params": param_rows}
        try:
            results[part] = table[part](torch)
        except Exception as error:  # one part failing does not end the run
            results[part] = f"{type(error).__name__}: {error}"
            print(f"  {part} failed: {results[part]}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
