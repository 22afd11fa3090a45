"""Threads per block on every vendor (issue 38): the README's saxpy is right on sm_90a and
gfx950, ``num_threads=`` and ``@kiln.kernel(num_threads=...)`` fix the block in threads, and
indexing that assumes another thread count is a ThreadCountWarning at its line."""

from __future__ import annotations

import contextlib
import io
import re
import warnings
from pathlib import Path

import numpy as np
import pytest

import kiln
from kiln import f32, i32
from kiln.threads import ThreadCountWarning

README = Path(__file__).resolve().parents[1] / "README.md"
SEED = 3802
N = 10_000


@kiln.kernel
def saxpy_assumes_block(x: kiln.Tensor[f32], y: kiln.Tensor[f32], n: i32, a: f32,
                        BLOCK: kiln.constexpr):
    i = kiln.block_id(0) * BLOCK + kiln.thread_id(0)  # @assumes-block
    if i < n:
        y[i] = a * x[i] + y[i]


@kiln.kernel(num_threads="BLOCK")
def saxpy_declared(x: kiln.Tensor[f32], y: kiln.Tensor[f32], n: i32, a: f32,
                   BLOCK: kiln.constexpr):
    i = kiln.block_id(0) * kiln.block_dim(0) + kiln.thread_id(0)
    if i < n:
        y[i] = a * x[i] + y[i]


def _data(seed: int = SEED):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(N).astype(np.float32)
    y = rng.standard_normal(N).astype(np.float32)
    return x, y, 2.0 * x.astype(np.float64) + y.astype(np.float64)


def _readme_kernel_block() -> str:
    text = README.read_text()
    section = text[text.index("## A kernel"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.lower
def test_readme_example_runs_and_its_launch_is_right_on_both_vendors(tmp_path, monkeypatch):
    """The README block runs as written (less the CUDA launch), and its CUDA launch line, run
    in the interpreter for sm_90a and for gfx950, updates all 10000 elements correctly."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    code = _readme_kernel_block()
    setup, rest = code.split("ck = ", 1)
    lines = ("ck = " + rest).splitlines()
    launches = [line.split("#")[0].strip() for line in lines if line.startswith("saxpy[")]
    assert len(launches) == 1  # the GPU launch: the one line not run as written here
    path = tmp_path / "readme_saxpy.py"
    path.write_text(code)
    namespace: dict = {"__file__": str(path)}
    exec(compile(setup, str(path), "exec"), namespace)  # noqa: S102 - the README's own code
    x, y0 = namespace["x"].copy(), namespace["y"].copy()
    want = 2.0 * x.astype(np.float64) + y0
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("error", ThreadCountWarning)
        rest_code = "\n".join(line for line in lines if not line.startswith("saxpy["))
        exec(compile(rest_code, str(path), "exec"), namespace)  # noqa: S102
        np.testing.assert_allclose(namespace["y"], want, rtol=1e-6)
        assert launches[0].endswith(")")
        for target in ("sm_90a", "gfx950"):
            namespace["y"] = y0.copy()
            launch = ("saxpy.interpret[" + launches[0][len("saxpy["):-1]
                      + f", target={target!r})")
            exec(launch, namespace)  # noqa: S102
            np.testing.assert_allclose(namespace["y"], want, rtol=1e-6, err_msg=target)


@pytest.mark.parametrize("target", ["sm_90a", "gfx950"])
def test_declared_thread_count_is_right_on_both_vendors(target):
    x, y, want = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ThreadCountWarning)
        saxpy_declared.interpret[(N + 255) // 256](x, y, N, 2.0, BLOCK=256, target=target)
    np.testing.assert_allclose(y, want, rtol=1e-6)


@pytest.mark.parametrize("target", ["sm_90a", "gfx950"])
def test_num_threads_option_gives_the_same_block_on_both_vendors(target):
    x, y, want = _data()
    saxpy_assumes_block.interpret[(N + 255) // 256](x, y, N, 2.0, BLOCK=256, num_threads=256,
                                                   target=target)
    np.testing.assert_allclose(y, want, rtol=1e-6)


def test_readme_pattern_with_num_warps_8_on_gfx950_warns_at_the_index_line(marker_line):
    x, y, _ = _data()
    with pytest.warns(ThreadCountWarning, match=r"block_id\(0\) \* 256 \+ kiln.thread_id\(0\) "
                      r"but its blocks have 512 threads \(8 warps of 64 on gfx950\): "
                      r"consecutive blocks overlap") as record:
        saxpy_assumes_block.trace(x, y, N, 2.0, BLOCK=256, num_warps=8, target="gfx950")
    assert record[0].lineno == marker_line("@assumes-block")
    assert record[0].filename == __file__


def test_default_block_smaller_than_block_constant_warns_about_gaps():
    x, y, _ = _data()
    with pytest.warns(ThreadCountWarning, match=r"indices 128\.\.255 of each block's range are "
                                                r"never reached"):
        saxpy_assumes_block.trace(x, y, N, 2.0, BLOCK=256, target="sm_90a")


def test_matching_block_does_not_warn():
    x, y, _ = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ThreadCountWarning)
        saxpy_assumes_block.trace(x, y, N, 2.0, BLOCK=256, num_warps=8, target="sm_90a")
        saxpy_assumes_block.trace(x, y, N, 2.0, BLOCK=256, num_warps=4, target="gfx950")


def test_declared_kernel_rejects_a_launch_with_another_thread_count(marker_line):
    x, y, _ = _data()
    with pytest.raises(kiln.KilnValueError, match=r"declares num_threads='BLOCK' \(= 256\) but "
                       r"the launch asks for 8 warps \(512 threads on gfx950") as info:
        saxpy_declared.interpret[40](x, y, N, 2.0, BLOCK=256, num_warps=8,  # @bad-launch
                                     target="gfx950")
    assert info.value.loc.line == marker_line("@bad-launch")
    with pytest.raises(kiln.KilnValueError, match="declares"):
        saxpy_declared.compile(x, y, N, 2.0, BLOCK=256, num_threads=128, target="sm_90a")


def test_declared_kernel_compiles_the_declared_block():
    x, y, _ = _data()
    traced = saxpy_declared.trace(x, y, N, 2.0, BLOCK=128, target="gfx950")
    assert traced.signature.block == (128, 1, 1)
    assert saxpy_declared.trace(x, y, N, 2.0, BLOCK=128, target="sm_90a",
                                num_warps=4).signature.block == (128, 1, 1)


def test_grid_callable_receives_num_threads():
    x, y, want = _data()
    seen = {}

    def grid(meta):
        seen.update(meta)
        return ((N + meta["num_threads"] - 1) // meta["num_threads"],)

    saxpy_declared.interpret[grid](x, y, N, 2.0, BLOCK=256, target="gfx950")
    assert seen["num_threads"] == 256 and seen["num_warps"] == 4
    np.testing.assert_allclose(y, want, rtol=1e-6)


@pytest.mark.parametrize("threads, message", [
    (96, "num_threads=96 is not a positive multiple of gfx950's warp size"),
    (0, "num_threads=0 is not a positive multiple"),
])
def test_num_threads_must_be_whole_warps(threads, message):
    x, y, _ = _data()
    with pytest.raises(kiln.KilnValueError, match=message):
        saxpy_assumes_block.trace(x, y, N, 2.0, BLOCK=256, num_threads=threads, target="gfx950")


@pytest.mark.parametrize("warps", ["4", 2.0, True, 0])
@pytest.mark.parametrize("how", ["trace", "interpret"])
def test_num_warps_must_be_a_positive_int_without_compile_options(how, warps):
    x, y, _ = _data()
    run = saxpy_assumes_block.trace if how == "trace" else saxpy_assumes_block.interpret[1]
    with pytest.raises(kiln.KilnValueError, match=f"num_warps must be a positive int, got {warps!r}"):
        run(x, y, N, 2.0, BLOCK=128, num_warps=warps)


def test_a_numpy_int_thread_count_is_a_thread_count():
    x, y, _ = _data()
    traced = saxpy_assumes_block.trace(x, y, N, 2.0, BLOCK=128, num_threads=np.int64(128),
                                       target="gfx950")
    assert traced.signature.block == (128, 1, 1)


def test_num_warps_and_num_threads_together_is_an_error():
    x, y, _ = _data()
    with pytest.raises(kiln.KilnValueError, match="both num_warps=4 and num_threads=128"):
        saxpy_assumes_block.trace(x, y, N, 2.0, BLOCK=128, num_warps=4, num_threads=128)


def test_bad_declaration_names_the_constexprs():
    def k(x: kiln.Tensor[f32], BLOCK: kiln.constexpr):
        pass

    with pytest.raises(kiln.KilnValueError, match=r"num_threads='BLOK'.*\(BLOCK\)"):
        kiln.kernel(num_threads="BLOK")(k)


@pytest.mark.parametrize("target", ["sm_90a", "gfx950"])
def test_demo_rms_norm_is_right_on_both_vendors(target):
    """examples/demo.py compiles for gfx950 too; with BLOCK=128 as 4 warps it had 256-thread
    blocks there, each overlapping the next block's rows."""
    from source_modules import load_example

    demo = load_example("demo")
    rng = np.random.default_rng(SEED)
    rows, cols = 300, 33
    x, w, y = demo.random_inputs(rng, rows, cols)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ThreadCountWarning)
        demo.rms_norm.interpret[((rows + 127) // 128,)](x, w, y, rows, cols, 1e-6, BLOCK=128,
                                                        target=target)
    ref = demo.reference(x, w, 1e-6)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)
