"""kiln.print: device printf (gpu.printf) from traced values, in the IR, the PTX, the
interpreter (one prefixed line per active thread) and on a CUDA GPU."""

from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest

import kiln
from kiln import f32, i32
from kiln.runtime.cuda import cuda_available

SEED = 3801


@kiln.kernel
def show(x: kiln.Tensor[f32], n: i32):
    i = kiln.thread_id(0)
    if i < n:
        kiln.print("i", i, "x", x[i], "h", kiln.cast(x[i], kiln.bf16), "neg", i < 1,  # @print
                   "wide", kiln.cast(i, kiln.i64) * 3, "100%", sep=" ")


def _inputs():
    rng = np.random.default_rng(SEED)
    return rng.standard_normal(8).astype(np.float32)


def _parse(lines: list[str]) -> dict[tuple[int, int], tuple]:
    """(block, thread) -> (i, x, h, neg, wide) from the interpreter's prefixed lines."""
    pattern = re.compile(r"\[block \((\d+), 0, 0\) thread (\d+)\] i (-?\d+) x (\S+) h (\S+) "
                         r"neg (\d) wide (-?\d+) 100%$")
    rows = {}
    for line in lines:
        m = pattern.match(line)
        assert m, line
        b, t, i, x, h, neg, wide = m.groups()
        rows[int(b), int(t)] = (int(i), float(x), float(h), int(neg), int(wide))
    return rows


def test_kiln_ir_has_gpu_printf_with_promoted_operands():
    text = show.trace(_inputs(), 5).module_asm
    line = next(l for l in text.splitlines() if "gpu.printf" in l)
    assert '"i %d x %g h %g neg %d wide %lld 100%%\\0A"' in line
    assert line.split(":")[-1].split("loc")[0].strip() == "i32, f64, f64, i32, i64"


@pytest.mark.parametrize("target", ["sm_90a", "gfx950"])
def test_interpreter_prints_every_active_thread(capsys, target):
    x = _inputs()
    n = 5
    show.interpret[2](x, n, num_warps=1, target=target)
    lines = capsys.readouterr().out.splitlines()
    rows = _parse(lines)
    assert sorted(rows) == [(b, t) for b in range(2) for t in range(n)]  # inactive threads silent
    assert len(lines) == len(rows)  # one line per thread, none printed twice
    for (b, t), (i, xv, h, neg, wide) in rows.items():
        assert i == t and neg == int(t < 1) and wide == 3 * t
        np.testing.assert_allclose(xv, x[t], rtol=1e-5)  # %g keeps 6 significant digits
        np.testing.assert_allclose(h, x[t], rtol=1e-2)  # bf16 rounding


def test_print_of_a_vector_is_type_error():
    @kiln.kernel
    def k(x: kiln.Tensor[f32]):
        kiln.print(x.load(0, width=4))

    with pytest.raises(kiln.KilnTypeError, match="kiln.print takes scalars"):
        k.trace(np.zeros(8, np.float32))


@pytest.mark.lower
def test_ptx_calls_vprintf():
    ptx = show.compile(_inputs(), 5, target="sm_90a").asm["ptx"]
    assert "vprintf" in ptx


@pytest.mark.lower
def test_amd_compile_is_unsupported_at_the_print_line(marker_line):
    with pytest.raises(kiln.UnsupportedError, match="kiln.print is not supported on AMD") as info:
        show.compile(_inputs(), 5, target="gfx950")
    assert info.value.loc.line == marker_line("@print")


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and driver")
def test_gpu_prints_from_each_thread(capfd):
    x = _inputs()
    show[1](x, 3, num_warps=1)  # numpy arguments are copied back: the launch has synchronised
    ctypes.CDLL(None).fflush(None)
    lines = [l for l in capfd.readouterr().out.splitlines() if l.startswith("i ")]
    assert len(lines) == 3
    for line in lines:
        fields = line.split()
        t = int(fields[1])
        np.testing.assert_allclose(float(fields[3]), x[t], rtol=1e-5)
        assert fields[7] == str(int(t < 1)) and fields[9] == str(3 * t)
