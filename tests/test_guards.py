"""Inputs that used to abort the process (LLVM assertions, ``report_fatal_error``) or hang the
trace. Each case runs in a child process with a timeout, so a regression fails this test
instead of killing pytest; the child must end normally, with the expected Kiln error (or with
none, where the input is now supported: bool tensors and i1 shared arrays).

Numeric checks of the now-supported inputs run in the interpreter (seeded, fresh inputs); the
GPU test runs the bool kernel on a CUDA device.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kiln
from kiln import f64, i1, i32
from kiln.runtime.cuda import cuda_available

CHILD_TIMEOUT_S = 60

# (name, target, kernel body lines, launch arguments, expected error class or None, message)
CASES = [
    ("bool_tensors", "sm_90a", ["y[t] = x[t]", "y.store(4 * t, x.load(4 * t, width=4))"],
     "np.ones(512, bool), np.zeros(512, bool)", None, ""),
    ("bool_tensors", "gfx950", ["y[t] = x[t] != (t > 3)"],
     "np.ones(512, bool), np.zeros(512, bool)", None, ""),
    ("bool_shared", "sm_80", ["s = kiln.shared((128,), kiln.i1)", "s[t % 128] = x[t]",
                              "kiln.barrier()", "y[t] = s[(t + 1) % 128]"],
     "np.ones(512, bool), np.zeros(512, bool)", None, ""),
    ("fence_cluster", "sm_80", ['kiln.fence("cluster")'], "F32, F32", "TargetError", "sm_90"),
    ("named_barrier", "gfx942", ["kiln.nvidia_asm.named_barrier(1, 128)"], "F32, F32",
     "TargetError", "NVIDIA inline PTX"),
    ("named_barrier", "gfx950", ["kiln.nvidia_asm.named_barrier_arrive(1, 128)"], "F32, F32",
     "TargetError", "NVIDIA inline PTX"),
    ("wide_load", "sm_90a", ["y.store(0, x.load(0, width=2**24))"], "F32, F32",
     "KilnValueError", "at most 1024"),
    ("wide_load", "gfx950", ["y.store(0, x.load(0, width=65536))"], "F32, F32",
     "KilnValueError", "at most 1024"),
    ("shared_align", "sm_90a", ["s = kiln.shared((64,), kiln.f32, align=2**40)", "s[0] = x[0]"],
     "F32, F32", "KilnValueError", "power of two from 1 to 1024"),
    ("load_align", "gfx942", ["y.store(0, x.load(0, width=4, align=2**40))"], "F32, F32",
     "KilnValueError", "power of two from 1 to 1024"),
    ("static_range", "sm_90a", ["for j in kiln.static_range(10**7):", "    y[j] = 1.0"],
     "F32, F32", "KilnValueError", "limit is 8192"),
    ("static_range_huge", "gfx942", ["for j in kiln.static_range(2**70):", "    y[j] = 1.0"],
     "F32, F32", "KilnValueError", "limit is 8192"),
    ("python_loop", "sm_90a", ["for j in range(10**6):", "    y[j] = 1.0"], "F32, F32",
     "KilnValueError", "passed 8192 iterations"),
    ("many_ops", "sm_90a", ["for j in range(2000):",
                            "    y[t] = kiln.unpack(kiln.pack([x[t]] * 250) * 2.0)[0]"],
     "F32, F32", "KilnValueError", "MAX_TRACED_VALUES"),
    ("wide_pack", "gfx950", ["y[t] = kiln.unpack(kiln.pack([x[t]] * 300))[0]"], "F32, F32",
     "KilnValueError", "at most 1024"),
    ("zero_step", "sm_90a", ["for j in kiln.range(0, 10, 0):", "    y[j] = 1.0"], "F32, F32",
     "KilnValueError", "step must be positive"),
    ("big_power", "gfx942", ["y[t] = x[t] ** 10**6"], "F32, F32", None, ""),
]


def _child_source(target: str, body: list[str], args: str) -> str:
    lines = "\n".join("    " + line for line in body)
    return textwrap.dedent("""\
        import numpy as np
        import kiln

        F32 = np.ones(512, np.float32)


        @kiln.kernel
        def guard(x: kiln.Tensor, y: kiln.Tensor):
            t = kiln.thread_id(0)
        {lines}


        try:
            compiled = guard.compile({args}, target={target!r}, num_warps=4)
        except kiln.KilnError as err:
            print("KILN_ERROR", type(err).__name__)
            print(err)
        else:
            print("NO_ERROR")
            print(compiled.asm["kiln"])
        """).format(lines=lines, args=args, target=target)


CASE_IDS = [f"{c[0]}-{c[1]}" for c in CASES]
# One child runs the cases in turn (an import of kiln per case cost most of this test's time);
# it prints a marker before and after each, so a case that aborts or hangs the child is named,
# and the cases after it run in a fresh child.
CHILD_DRIVER = textwrap.dedent("""\
    import runpy, sys
    for script in sys.argv[1:]:
        print("@@START", script, flush=True)
        runpy.run_path(script, run_name="__main__")
        print("@@END", script, flush=True)
    """)


def _outputs_by_case(scripts: list[str]) -> dict[str, str]:
    outputs, pending = {}, list(scripts)
    while pending:
        try:
            done = subprocess.run([sys.executable, "-c", CHILD_DRIVER, *pending],
                                  capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
                                  env={**os.environ, "KILN_NO_CACHE": "1"})
            stdout, stderr = done.stdout, done.stderr
            failure = f"child exited with {done.returncode}" if done.returncode else None
        except subprocess.TimeoutExpired as timeout:
            stdout, stderr = (timeout.stdout or b"").decode(), (timeout.stderr or b"").decode()
            failure = f"did not finish in {CHILD_TIMEOUT_S} s (a trace hang)"
        failed = f"CHILD_FAILED {failure}:\n{stderr[-3000:]}"
        ran = []
        for script in list(pending):
            _, started, rest = stdout.partition(f"@@START {script}\n")
            if not started:
                break
            output, ended, stdout = rest.partition(f"@@END {script}\n")
            pending.remove(script)
            ran.append(script)
            outputs[script] = output if ended else failed
            if not ended:
                break
        if failure and not pending and ran:  # every case ended, then the child died
            outputs[ran[-1]] = failed
        if failure and not ran:  # the child died before its first case
            outputs.update({script: failed for script in pending})
            pending = []
    return outputs


@pytest.fixture(scope="module")
def guard_outputs(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("guards")
    scripts = {}
    for case_id, (name, target, body, args, _, _) in zip(CASE_IDS, CASES):
        script = folder / f"{case_id.replace('-', '_')}.py"
        # Tensor annotations without a dtype take the argument's (annotate the dtype the args
        # have).
        script.write_text(_child_source(target, body, args).replace(
            "x: kiln.Tensor, y: kiln.Tensor",
            "x: kiln.Tensor[kiln.i1], y: kiln.Tensor[kiln.i1]" if "bool" in args
            else "x: kiln.Tensor[kiln.f32], y: kiln.Tensor[kiln.f32]"))
        scripts[case_id] = str(script)
    outputs = _outputs_by_case(list(scripts.values()))
    return {case_id: outputs[script] for case_id, script in scripts.items()}


@pytest.mark.parametrize("name,target,body,args,error,message", CASES, ids=CASE_IDS)
def test_input_ends_in_a_kiln_error_or_compiles(guard_outputs, name, target, body, args, error,
                                                message):
    stdout = guard_outputs[f"{name}-{target}"]
    assert not stdout.startswith("CHILD_FAILED"), f"{name} on {target}: {stdout}"
    if error is None:
        assert "NO_ERROR" in stdout, stdout
        if "bool" in args:  # bool tensors are bytes in the kernel ABI
            assert "memref<?xi8" in stdout and "memref<?xi1" not in stdout
    else:
        assert f"KILN_ERROR {error}" in stdout, stdout
        assert message in stdout, stdout
        assert f"{name}_{target}.py:" in stdout  # the error names the user's line


@kiln.kernel
def _bool_roundtrip(x: kiln.Tensor[i1], y: kiln.Tensor[i1], z: kiln.Tensor[i32], n: i32):
    i = kiln.block_id(0) * 128 + kiln.thread_id(0)
    t = kiln.thread_id(0)
    s = kiln.shared((128,), i1)
    if i < n:
        s[t] = x[i] != (i % 3 == 0)
    kiln.barrier()
    if i < n:
        y[i] = s[t]
        z[i] = kiln.cast(x.load(i, mask=i < n, other=False), i32) * 10 + kiln.cast(s[t], i32)


@kiln.kernel
def _bool_vectors(x: kiln.Tensor[i1], y: kiln.Tensor[i1]):
    i = kiln.thread_id(0) * 4
    y.store(i, x.load(i, width=4) != (kiln.thread_id(0) % 2 == 0))


def test_bool_tensors_and_shared_arrays_in_the_interpreter():
    seed = 37
    rng = np.random.default_rng(seed)
    n = 300
    x = rng.random(n) < 0.5
    y = rng.random(n) < 0.5  # poisoned: random bools the kernel must overwrite
    z = np.full(n, -7, np.int32)
    _bool_roundtrip.interpret[(3,)](x, y, z, n)
    ref = x != (np.arange(n) % 3 == 0)
    np.testing.assert_array_equal(y, ref, err_msg=f"seed {seed}")
    np.testing.assert_array_equal(z, x * 10 + ref, err_msg=f"seed {seed}")
    x = rng.random(512) < 0.5
    y = ~x
    _bool_vectors.interpret[(1,)](x, y)
    flip = (np.arange(512) // 4) % 2 == 0
    np.testing.assert_array_equal(y, x != flip, err_msg=f"seed {seed}")


@kiln.kernel
def _power(x: kiln.Tensor[f64], y: kiln.Tensor[f64], k: kiln.Tensor[i32], P: kiln.constexpr):
    i = kiln.thread_id(0)
    y[i] = x[i] ** P
    k[i] = k[i] ** P


@pytest.mark.parametrize("power", [0, 1, 2, 7, 12345])
def test_integer_powers_match_numpy(power):
    seed = 1000 + power % 997
    rng = np.random.default_rng(seed)
    x = 1.0 + rng.uniform(-1e-6, 1e-6, 128)
    y = np.full(128, np.nan)
    k = rng.integers(-5, 6, 128).astype(np.int32)
    expect_k = np.array([pow(int(v), power, 2**32) for v in k], np.uint64).astype(np.uint32)
    _power.interpret[(1,)](x, y, k, P=power, num_warps=4)
    np.testing.assert_allclose(y, x ** power, rtol=1e-9, err_msg=f"seed {seed}")
    np.testing.assert_array_equal(k.view(np.uint32), expect_k, err_msg=f"seed {seed}")


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and driver")
def test_bool_tensors_on_the_gpu():
    seed = 41
    rng = np.random.default_rng(seed)
    n = 300
    x = rng.random(n) < 0.5
    y = rng.random(n) < 0.5
    z = np.full(n, -7, np.int32)
    _bool_roundtrip[(3,)](x, y, z, n)
    ref = x != (np.arange(n) % 3 == 0)
    np.testing.assert_array_equal(y, ref, err_msg=f"seed {seed}")
    np.testing.assert_array_equal(z, x * 10 + ref, err_msg=f"seed {seed}")


@kiln.kernel
def _fill_other(x, y, n: i32, OTHER: kiln.constexpr):
    i = kiln.thread_id(0)
    y[i] = x.load(i, mask=i < n, other=OTHER)


@pytest.mark.parametrize("dtype,other", [(np.int16, 1e30), (np.int32, float("nan")),
                                         (np.int32, 2**70), (np.float32, 2**2000)])
def test_constants_that_do_not_fit_their_dtype_are_kiln_errors(dtype, other):
    # They reached MLIR's attribute builders as TypeError / OverflowError / ValueError.
    x = np.ones(128, dtype)
    with pytest.raises(kiln.KilnValueError, match="constant|has no"):
        _fill_other.compile(x, x.copy(), 100, other, target="sm_90a")


@kiln.kernel
def _copy(x, y):
    i = kiln.thread_id(0)
    y[i] = x[i]


@pytest.mark.parametrize("dtype", [kiln.f8e4m3, kiln.f8e5m2])
def test_fp8_arrays_in_the_interpreter(dtype):
    # numpy's as_strided has no spelling for float8_e5m2 ("data type '<f1' not understood").
    seed = 43
    x = (np.random.default_rng(seed).standard_normal(128) * 4).astype(dtype.numpy)
    y = np.full(128, np.nan, dtype.numpy)
    _copy.interpret[(1,)](x, y)
    np.testing.assert_array_equal(y.astype(np.float32), x.astype(np.float32),
                                  err_msg=f"seed {seed}")


def test_target_feature_model():
    from kiln.core.targets import FEATURES, TARGETS, get_target

    assert get_target("sm_90a").has("wgmma") and not get_target("sm_90").has("wgmma")
    assert not get_target("gfx950").has("ptx") and get_target("gfx950").has("gfx950")
    assert not get_target("sm_80").has("sm90") and get_target("sm_100a").has("tma")
    assert all(t.features <= set(FEATURES) for t in TARGETS.values())
    with pytest.raises(kiln.TargetError, match="sm_90 / sm_90a / sm_100a"):
        get_target("sm_80").require("sm90", 'kiln.fence("cluster")')
    with pytest.raises(kiln.TargetError, match="unknown target feature"):
        get_target("sm_80").has("tensor_cores")


@kiln.kernel
def _vector_constant(y: kiln.Tensor[i32], VALUES: kiln.constexpr, DT: kiln.constexpr):
    y[0] = kiln.cast(kiln.unpack(kiln.vector_constant(list(VALUES), DT))[0], i32)


@pytest.mark.parametrize("values,dtype", [((2**70,), kiln.i32), ((2,), kiln.i1),
                                          ((float("nan"),), kiln.i16)])
def test_vector_constants_that_do_not_fit_are_kiln_errors(values, dtype):
    with pytest.raises(kiln.KilnValueError, match="does not fit|has no"):
        _vector_constant.trace(np.zeros(4, np.int32), VALUES=values, DT=dtype)


def test_vector_constants_take_unsigned_spellings():
    y = np.zeros(4, np.int32)
    _vector_constant.interpret[(1,)](y, VALUES=(2**32 - 5, 1), DT=kiln.i32)
    assert y[0] == -5


@kiln.kernel
def _vector_constant_f32(y: kiln.Tensor[kiln.f32], VALUES: kiln.constexpr, DT: kiln.constexpr):
    vec = kiln.vector_constant(list(VALUES), DT)
    for k in kiln.static_range(len(VALUES)):
        y[k] = kiln.cast(kiln.unpack(vec)[k], kiln.f32)


@pytest.mark.parametrize("dtype", [kiln.f16, kiln.bf16, kiln.f8e4m3, kiln.f8e5m2])
def test_low_precision_vector_constants_in_the_interpreter(dtype):
    # The bindings cannot export these dense constants; the interpreter raised a TypeError.
    values = (0.5, -1.5, 3.0, float("nan"))
    y = np.full(4, 7.0, np.float32)
    _vector_constant_f32.interpret[(1,)](y, VALUES=values, DT=dtype)
    np.testing.assert_array_equal(y, np.array(values, np.float32))


@pytest.mark.parametrize("dtype", [kiln.f16, kiln.bf16, kiln.f8e4m3])
def test_long_low_precision_vector_constants_in_the_interpreter(dtype):
    # Over 100 elements print as one hex blob: the interpreter raised a ValueError.
    values = (0.5, -1.5, 3.0, -2.0) * 32
    y = np.full(len(values), 7.0, np.float32)
    _vector_constant_f32.interpret[(1,)](y, VALUES=values, DT=dtype)
    np.testing.assert_array_equal(y, np.array(values, np.float32))
