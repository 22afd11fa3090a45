"""``kiln.cases(value, n)`` (kiln.tile_cases): exactly one arm runs, traced with ``r`` a Python
int, values carried through every arm; and the remainder-first ring it exists for: a TMA-fed
ring of 3 shared tiles whose first ``n % 3`` uses run in the arm of their count with the stages
rotated, handed back by ``kiln.release`` (the mbarrier waits placed by kiln-insert-waits and
proven by kiln-verify-waits), within float64 of numpy for every count of tiles."""

from __future__ import annotations

import numpy as np
import pytest
from mlir import ir

import kiln
from kiln import f32, i32
from kiln.core.errors import WaitError
from kiln.passes import build_pass_manager

from ir_ops import ops_where


@kiln.kernel(num_threads=32)
def pick(x: kiln.Tensor[i32], y: kiln.Tensor[i32], N: kiln.constexpr):
    """``y[0] = x[1] + 10 r + r * r`` for the arm ``r == x[0]`` (``x[1]`` when none runs), and
    ``y[1]`` counts the arms that ran."""
    acc, ran = x[1], x[1] - x[1]
    for r in kiln.cases(x[0], N):
        acc = acc + 10 * r + r * r          # r is a Python int: r * r folds at trace time
        ran = ran + 1
    if kiln.thread_id(0) == 0:
        y[0] = acc
        y[1] = ran


@pytest.mark.parametrize("value", [0, 1, 3, -1, 4])
def test_one_arm_runs_with_r_a_python_int(value):
    y = np.full(2, -7, np.int32)
    pick.interpret[(1,)](np.array([value, 5], np.int32), y, N=4)
    inside = 0 <= value < 4
    assert y.tolist() == [5 + (10 * value + value * value if inside else 0), int(inside)]


@kiln.kernel(num_threads=32)
def pick_constant(y: kiln.Tensor[i32], V: kiln.constexpr):
    acc = y[0]
    for r in kiln.cases(V, 3):              # a Python int value: its arm, or none
        acc = acc + 10 * r + 1
    if kiln.thread_id(0) == 0:
        y[0] = acc


@pytest.mark.parametrize("value", [2, 3])
def test_a_constant_value_runs_its_arm(value):
    y = np.full(1, 5, np.int32)
    pick_constant.interpret[(1,)](y, V=value)
    assert y[0] == 5 + (10 * value + 1 if value < 3 else 0)


def test_cases_refuses_bad_arguments():
    x = np.zeros(2, np.int32)
    with pytest.raises(kiln.KilnValueError, match="must be an int in 1.."):
        pick.interpret[(1,)](x, x.copy(), N=0)
    with pytest.raises(kiln.KilnTypeError, match="must be an integer"):
        kiln.cases(1.5, 3)
    with pytest.raises(kiln.KilnTypeError, match="only drive a `for` statement"):
        iter(kiln.cases(1, 3))


@kiln.kernel(num_threads=128)
def ring_sums(x: kiln.Tensor[f32, 2], y: kiln.Tensor[f32, 2]):
    """``y = sum_j x[:32, 64j:64j+64]`` over ``n`` column blocks through a ring of 3 shared
    tiles by TMA, two blocks ahead: the first ``n % 3`` in ``kiln.cases``' arm (block ``j`` in
    stage ``(j - r) % 3``), then whole groups of 3 from stage 0; every block is read once, no
    padding block past the last."""
    rows, cols = x.shape
    tv = kiln.layout.blocked((32, 64), 128, vec=4)
    s = [kiln.tiles.SharedTile.view(kiln.dynamic_shared((32 * 64,), f32, align=128), (32, 64))
         for _ in range(3)]
    n = kiln.max((cols + 63) // 64, 0)

    def block(j):
        return kiln.GlobalTile(x, (32, 64), (0, j * 64), row_end=rows, col_end=cols, align=16)

    def use(j, st, acc):   # block j from stage st; block j + 2 into the stage of block j - 1
        acc = acc + kiln.load(s[st], tv)
        kiln.release(s[st])
        kiln.copy(block(j + 2), s[(st + 2) % 3])
        return acc

    def first(r, acc):
        for i in range(2):
            kiln.copy(block(i), s[(i - r) % 3])
        for j in range(r):
            acc = use(j, (j - r) % 3, acc)
        return acc

    acc = kiln.tiles.RegTile.full(tv, (1, 1), 0.0)
    for r in kiln.cases(n % 3, 3):
        acc = first(r, acc)
    for g in kiln.range(0, n // 3):
        for st in range(3):
            acc = use(n % 3 + 3 * g + st, st, acc)
    kiln.copy(acc, kiln.GlobalTile(y, (32, 64), (0, 0)))


def _column_sums(x):
    padded = np.zeros((32, -(-x.shape[1] // 64) * 64), np.float64)
    padded[:x.shape[0], :x.shape[1]] = x
    return padded.reshape(32, -1, 64).sum(axis=1)


@pytest.mark.parametrize("cols", [40, 130, 200, 300, 450])   # 1, 3, 4, 5, 8 blocks
def test_remainder_first_ring_in_the_interpreter(cols):
    x = np.random.default_rng().standard_normal((30, cols)).astype(np.float32)
    y = np.full((32, 64), np.nan, np.float32)
    ring_sums.interpret[(1,)](x, y, target="sm_90a")
    np.testing.assert_allclose(y, _column_sums(x), rtol=1e-5, atol=1e-5)


def _waits(module):
    return ops_where(module, lambda op: op.name == "nvgpu.mbarrier.try_wait.parity")


@pytest.mark.lower
def test_deleting_a_placed_ring_wait_fails_verify_waits():
    """Every mbarrier wait kiln-insert-waits put in the arms and the loop (the full waits
    before each read, the empty waits before each refill) is needed: with any one deleted,
    kiln-verify-waits raises a WaitError."""
    x = np.zeros((30, 300), np.float32)
    text = ring_sums.compile(x, np.zeros((32, 64), np.float32), target="sm_90a").asm["gpu"]
    with ir.Context():
        count = len(_waits(ir.Module.parse(text)))
    # reads: arms of 1 and 2 uses and a loop of 3; refills: one per use, in the same places,
    # and arm 1's first copy into stage 2 (the wait for a fresh barrier's parity 1, which
    # passes at once: the proof does not know that arm 0, which never fills stage 2, did
    # not run)
    assert count == 2 * (1 + 2 + 3) + 1
    for index in range(count):
        with ir.Context():
            module = ir.Module.parse(text)
            _waits(module)[index].erase()
            with pytest.raises(WaitError, match="tma|mbarrier"):
                build_pass_manager(["kiln-verify-waits"]).run(module.operation)
