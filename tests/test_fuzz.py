"""Fuzzing the front end: nothing a user writes may kill or hang the process.

``hypothesis`` composes small kernels from a menu of ops (arithmetic and casts over every dtype,
bool and fp8 included; masked loads, vector loads with widths and alignments, shared arrays,
fences with scopes, barriers and named barriers, loops with steps, vendor-only instructions,
shuffles, atomics, constexprs) and launch options (targets, ``num_warps``), then compiles each
(or runs it in the interpreter) in a child process, ``tests/fuzz_worker.py``. The test fails
when the child dies by a signal, hangs, or raises anything but a ``KilnError`` (an
``InternalError`` counts as a failure: it is a Kiln bug).

Seeded (``derandomize=True``): the same 120 kernels every run (about a minute, so in the ``slow``
tier: ``make test-slow``, which CI runs). For a long run:
``KILN_FUZZ_EXAMPLES=5000 pytest -s tests/test_fuzz.py`` (``-s`` prints the tally).
"""

from __future__ import annotations

import collections
import json
import os
import selectors
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.core import env

EXAMPLES = env.fuzz_examples(120)
CASE_TIMEOUT_S = 60  # a trace + compile takes well under a second; a hang takes minutes
WORKER = Path(__file__).with_name("fuzz_worker.py")

DTYPES = ("i1", "i8", "i16", "i32", "i64", "f16", "bf16", "f32", "f64", "f8e4m3", "f8e5m2")
TARGETS = ("sm_80", "sm_90", "sm_90a", "sm_100a", "gfx942", "gfx950")
LITERALS = ("0", "1", "-1", "3", "2.5", "-0.0", "True", "C", "1e30", "2**31", "2**40", "2**70",
            "float('nan')")
OPERANDS = LITERALS + ("v", "x[0]", "i", "kiln.thread_id(0)")
BINARY = ("+", "-", "*", "/", "//", "%", "&", "|", "^", "<<", ">>", "<", "==")
UNARY = ("-v", "~v", "abs(v)", "kiln.exp2(v)", "kiln.sqrt(v)", "kiln.rcp(v)", "kiln.log(v)",
         "kiln.fma(v, v, v)", "kiln.maximum(v, 2)", "kiln.minimum(v, -1)",
         "kiln.where(v > 1, v, 0)", "kiln.where(v, v, 1)")
POWERS = ("0", "1", "2", "3", "7", "10**6", "2**70", "-1", "0.5", "C")
# (usual values, edge cases): three draws in four take a usual value, so most kernels get far
# enough to reach the backend.
WIDTHS = ((1, 2, 4, 8, 16), (3, 0, -2, 256, 65536, 2**24))
ALIGNS = ((4, 16, None), (1, 1024, 2048, 3, 0, 2**40))
SHARED_SIZES = ((1, 7, 64, 256), (1 << 20, 0))
BOUNDS = (("0", "3", "10", "n"), ("C", "-5", "10**7"))
STEPS = (("1", "2"), ("0", "-1", "C", "n"))
SCOPES = (("cta", "gpu"), ("cluster", "system", ""))
CONSTEXPRS = (("0", "1", "7", "-3", "2.5", "True"), ("2**40", "2**70"))
NUM_WARPS = ((1, 2, 4, 8), (16, 0, 32))
NVIDIA_OPS = ("kiln.nvidia_asm.fence_proxy_async()", "kiln.nvidia_asm.fence_mbarrier_init()",
              "v = kiln.where(kiln.nvidia_asm.elect_sync(), v, v)",
              "v = kiln.cast(kiln.nvidia_asm.cluster_ctarank(), kiln.{dv})",
              "kiln.nvidia_asm.setmaxnreg({r}, increase=True)",
              "kiln.nvidia_asm.grid_dependency_wait()", "kiln.nvidia_asm.launch_dependents()",
              "kiln.nvidia_asm.cluster_sync()", "kiln.nvidia_asm.cluster_dims({c})",
              "kiln.nvidia_asm.named_barrier({b}, {t})",
              "kiln.nvidia_asm.named_barrier_arrive({b}, {t})",
              "v = kiln.where(kiln.nvidia_asm.named_barrier_any({b}, {t}, v), v, v)")
AMD_OPS = ("kiln.amd_asm.s_waitcnt(vmcnt={k})", "kiln.amd_asm.s_waitcnt(lgkmcnt={k})",
           "kiln.amd_asm.s_barrier()", "kiln.amd_asm.s_setprio({k})",
           "kiln.amd_asm.sched_barrier({k})", "kiln.amd_asm.sched_group_barrier({k}, {k}, 0)",
           "kiln.amd_asm.iglp_opt({k})")
SMALL_INTS = (0, 1, 2, 3, 15, 16, 24, 32, 40, 63, 64, 128, 232, 256, 1024, -1)


def _pick(choices):
    usual, edge = (st.sampled_from(c) for c in choices)
    return st.one_of(usual, usual, usual, edge)


def _statement(dv: str, dy: str, depth: int):
    """One statement (a list of source lines) that keeps ``v`` of dtype ``dv``."""
    cast = "v = kiln.cast({}, kiln.%s)" % dv
    simple = st.one_of(
        st.builds(lambda op, rhs: [cast.format(f"v {op} {rhs}")], st.sampled_from(BINARY),
                  st.sampled_from(OPERANDS)),
        st.builds(lambda e: [cast.format(e)], st.sampled_from(UNARY)),
        st.builds(lambda p: [cast.format(f"v ** {p}")], st.sampled_from(POWERS)),
        st.builds(lambda d: [cast.format(f"kiln.cast(v, kiln.{d})")], st.sampled_from(DTYPES)),
        st.builds(lambda off, other: [cast.format(f"x.load(i + {off}, mask=i < n, other={other})")],
                  st.sampled_from(("0", "1", "n")), st.sampled_from(LITERALS)),
        st.builds(lambda size, d, align: [
            f"s = kiln.shared(({size},), kiln.{d}, align={align})",
            f"s[kiln.thread_id(0) % {size}] = kiln.cast(v, kiln.{d})",
            "kiln.barrier()",
            cast.format(f"s[(kiln.thread_id(0) + 1) % {size}]")],
            _pick(SHARED_SIZES), st.sampled_from(DTYPES), _pick(ALIGNS)),
        st.builds(lambda w, a, use: [f"w = x.load(0, width={w}, align={a})", use],
                  _pick(WIDTHS), _pick(ALIGNS),
                  st.sampled_from(("y.store(0, w)", cast.format("kiln.unpack(w)[0]"),
                                   cast.format("kiln.vector_slice(w, 1, 1)"),
                                   f"y.store(0, kiln.cast(w, kiln.{dy}))"))),
        st.builds(lambda size, d, align: [
            f"s = kiln.dynamic_shared(({size},), kiln.{d}, align={align})",
            f"s[kiln.thread_id(0) % {size}] = kiln.cast(v, kiln.{d})",
            "kiln.barrier()",
            cast.format(f"s[(kiln.thread_id(0) + 1) % {size}]")],
            _pick(SHARED_SIZES), st.sampled_from(DTYPES), _pick(ALIGNS)),
        st.builds(lambda k: [cast.format(f"kiln.unpack(kiln.pack([v] * {k}) * 2)[0]")],
                  _pick(((1, 2, 4), (0, 300)))),
        st.builds(lambda d, vals: [cast.format(
            f"kiln.unpack(kiln.vector_constant({vals}, kiln.{d}))[0] + v")],
            st.sampled_from(DTYPES), st.sampled_from(("[1, 2]", "[0.5, -1.5, 3.0, 4.0]", "[]",
                                                      "[2**70]", "[float('nan')]"))),
        st.builds(lambda k: ["k = 0", f"while k < {k}:", "    " + cast.format("v + 1"),
                             "    k += 1"], _pick((("0", "3"), ("C", "10**6")))),
        st.builds(lambda s: [f'kiln.fence("{s}")'], _pick(SCOPES)),
        st.just(["kiln.barrier()"]),
        st.builds(lambda t, r, c, b, n: [t.format(dv=dv, r=r, c=c, b=b, t=n)],
                  st.sampled_from(NVIDIA_OPS), st.sampled_from(SMALL_INTS),
                  st.sampled_from((1, 2, 3, 8, 9, 0)), st.sampled_from((0, 1, 15, 16, -1)),
                  st.sampled_from((32, 128, 0, 33, 1024, 4096))),
        st.builds(lambda t, k: [t.format(k=k)], st.sampled_from(AMD_OPS),
                  st.sampled_from(SMALL_INTS)),
        st.builds(lambda e: [cast.format(e)], st.sampled_from(
            ("kiln.shuffle.xor_shuffle(v, 1)", "kiln.shuffle.xor_shuffle(v, 16)",
             "kiln.shuffle.xor_shuffle(v, 32)", "kiln.shuffle.xor_shuffle(v, 3)",
             "kiln.shuffle.xor_shuffle(v, 0)", "kiln.shuffle.uniform(v)",
             "kiln.shuffle.any_lane(v > 0)"))),
        st.builds(lambda op: [f"old = y.atomic_{op}(0, kiln.cast(v, kiln.{dy}))"],
                  st.sampled_from(("add", "max", "min", "exchange"))),
        st.builds(lambda f, d: [cast.format(f"kiln.{f}({d})")],
                  st.sampled_from(("block_id", "thread_id", "num_blocks", "block_dim")),
                  st.sampled_from(("0", "1", "2", "3", "'x'"))),
        st.sampled_from(([cast.format("kiln.lane_id()")], [cast.format("kiln.warp_id()")])),
    )
    if depth >= 2:
        return simple

    def nest(head, body):
        return [head] + ["    " + line for stmt in body for line in stmt]

    inner = st.lists(_statement(dv, dy, depth + 1), min_size=1, max_size=2)
    use_j = [cast.format(f"v + kiln.cast(j, kiln.{dv})")]
    loops = st.one_of(
        st.builds(lambda lo, hi, step, body: nest(f"for j in kiln.range({lo}, {hi}, {step}):",
                                                  [use_j] + body),
                  _pick(BOUNDS), _pick(BOUNDS), _pick(STEPS), inner),
        st.builds(lambda args, body: nest(f"for j in kiln.static_range({args}):", [use_j] + body),
                  st.sampled_from(("3", "0, 4, 2", "10**7", "0, 10, 0", "4, 0, -1", "C",
                                   "1000, 1001")), inner),
        st.builds(lambda k, body: nest(f"for j in range({k}):", [use_j] + body),
                  st.sampled_from(("2", "300", "10**6")), inner),
        st.builds(lambda cond, body: nest(f"if {cond}:", body),
                  st.sampled_from(("v > 1", "i < n", "C", "v", "kiln.thread_id(0) == 0")), inner),
    )
    return st.one_of(simple, simple, simple, loops)


@st.composite
def kernel_cases(draw) -> str:
    """A module whose ``run()`` compiles (or interprets) one generated kernel."""
    dx, dy, dv = (draw(st.sampled_from(DTYPES)) for _ in range(3))
    body = draw(st.lists(_statement(dv, dy, 0), min_size=1, max_size=5))
    n = draw(st.sampled_from((1, 5, 64, 300)))
    constexpr = draw(_pick(CONSTEXPRS))
    target = draw(st.sampled_from(TARGETS))
    num_warps = draw(_pick(NUM_WARPS))
    interpret = draw(st.integers(0, 9)) == 0
    seed = draw(st.integers(0, 2**31 - 1))
    launch = (f"fuzz.interpret[({draw(st.sampled_from((1, 2)))},)](x, y, n, {constexpr}, "
              f"target={target!r}, num_warps={num_warps})" if interpret else
              f"fuzz.compile(x, y, n, {constexpr}, target={target!r}, num_warps={num_warps})")
    lines = "\n".join("    " + line for stmt in body for line in stmt)
    return textwrap.dedent("""\
        import numpy as np
        import kiln


        @kiln.kernel
        def fuzz(x: kiln.Tensor[kiln.{dx}], y: kiln.Tensor[kiln.{dy}], n: kiln.i32,
                 C: kiln.constexpr):
            i = kiln.block_id(0) * kiln.block_dim(0) + kiln.thread_id(0)
            v = kiln.cast(x.load(i % n, mask=i < n), kiln.{dv})
        {lines}
            if i < n:
                y[i] = kiln.cast(v, kiln.{dy})


        def run():
            rng = np.random.default_rng({seed})
            n = {n}
            x = (rng.standard_normal(n) * 4).astype(kiln.{dx}.numpy)
            y = np.full(n, 1, kiln.{dy}.numpy)
            {launch}
        """).format(dx=dx, dy=dy, dv=dv, lines=lines, seed=seed, n=n, launch=launch)


class Worker:
    """The long-lived child process; restarted after it dies or hangs."""

    def __init__(self):
        self.proc = None

    def run(self, source: str) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            env_vars = dict(os.environ, KILN_INTERPRET_TIMEOUT="5", KILN_NO_CACHE="1")
            self.proc = subprocess.Popen([sys.executable, str(WORKER)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True, env=env_vars)
        self.proc.stdin.write(json.dumps({"source": source}) + "\n")
        self.proc.stdin.flush()
        answer = _read_line(self.proc, CASE_TIMEOUT_S)
        if answer:
            return json.loads(answer)
        if answer is None:  # no answer and no end of output: the case hangs
            self.proc.kill()
            self.proc.wait()
            return {"status": "hang", "kind": "", "detail": f"no answer in {CASE_TIMEOUT_S} s"}
        self.proc.wait()
        stderr = self.proc.stderr.read()[-2000:]
        return {"status": "signal" if self.proc.returncode < 0 else "exit",
                "kind": str(self.proc.returncode), "detail": stderr}

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


def _read_line(proc, timeout: float) -> str | None:
    """The child's next line, ``""`` when it exited, None when it said nothing in time."""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            return None
    return proc.stdout.readline()


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    tally = collections.Counter()
    w.tally = tally
    yield w
    w.close()
    print(f"\nfuzz tally over {sum(tally.values())} kernels: {dict(tally.most_common())}")


@pytest.mark.slow
@settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(source=kernel_cases())
def test_generated_kernels_raise_only_kiln_errors(worker, source):
    answer = worker.run(source)
    worker.tally[answer["status"] if answer["status"] != "kiln_error" else answer["kind"]] += 1
    assert answer["status"] in ("ok", "kiln_error"), (
        f"{answer['status']} {answer['kind']}: {answer['detail']}\n--- kernel ---\n{source}")


def test_worker_reports_a_signal_death_as_a_failure():
    # The harness itself: a case that aborts the child must come back as "signal", not "ok".
    answer = Worker().run("import os\n\ndef run():\n    os.abort()\n")
    assert answer["status"] == "signal" and answer["kind"] == "-6"
