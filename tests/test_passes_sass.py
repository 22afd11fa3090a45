"""The NVIDIA half of kiln-verify-schedule: SASS parsing, ping-pong instances, the check, the hook.

``data/pingpong_exp.sm_90a.sass`` is ``cuobjdump --dump-sass`` (CUDA 13.1) of the cubin that
``ptxas`` makes for :func:`pingpong_exp` below (sm_90a, num_warps=8); regenerate it with
``KILN_DUMP_DIR=out KILN_CUOBJDUMP=... `` and a compile of that kernel (``out/*.sass``).
"""

from pathlib import Path

import numpy as np
import pytest

import kiln
from kiln import f32
from kiln.cluster import ClusterRecipe, cluster
from kiln.core.errors import ScheduleError, ScheduleWarning
from kiln.lowering import isa_sass, tools
from kiln.lowering.verify_schedule import verify_schedule_sass

SASS = (Path(__file__).parent / "data" / "pingpong_exp.sm_90a.sass").read_text()
RECIPE = ClusterRecipe(work=(("vmem_read", 2), ("trans", 1), ("valu", 1)), pingpong=(3, 4),
                       barrier_at_end=False)


@kiln.kernel
def pingpong_exp(x: kiln.Tensor[f32], y: kiln.Tensor[f32], n: kiln.i32):
    i = kiln.thread_id(0)
    acc = x[i] * 0.0
    for j in kiln.range(n):
        with cluster(0, RECIPE):
            a = x[i + j * 256]
            b = y[i + j * 256]
            acc = acc + kiln.exp2(a * b)
    y[i] = acc


def test_parser_reads_instructions_predicates_and_basic_blocks():
    kernel = isa_sass.parse(SASS, "pingpong_exp")
    assert kernel.name == "pingpong_exp" and kernel.instructions[0].opcode == "LDC"
    handover = next(i for i in kernel.instructions if i.opcode == "BAR.ARV" and i.predicated)
    assert (handover.barrier_id, handover.barrier_threads) == ("0x3", 256)
    kinds = isa_sass.class_counts(kernel.instructions)
    assert kinds["vmem_read"] == 1 + 4 * 2 + 2 and kinds["trans"] == 5 and kinds["valu"] > 5
    blocks = kernel.basic_blocks()
    assert len(blocks) > 3 and sum(map(len, blocks)) == len(kernel.instructions)
    assert all(i.base not in ("BRA", "EXIT") for b in blocks for i in b[:-1])


def test_pingpong_instances_are_delimited_by_the_named_barriers():
    instances = isa_sass.cluster_instances(isa_sass.parse(SASS))
    assert len(instances) == 5  # 4 in the unrolled loop, 1 in the remainder loop
    assert all(inst.closed and inst.barrier_id == "R10" for inst in instances)
    assert all(isa_sass.class_counts(inst.instructions)["vmem_read"] == 2 for inst in instances)


def test_classifier_covers_hopper_instructions():
    lines = ["HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;", "HMMA.16816.F32 R4, R8, R12, R4 ;",
             "LDSM.16.M88.4 R8, [R2] ;", "STS.128 [R3], R4 ;", "UTMALDG.2D [UR8], [UR4] ;",
             "LDGSTS.E.128 [R5], desc[UR6][R2.64] ;", "WARPGROUP.ARRIVE ;",
             "WARPGROUP.DEPBAR.LE gsb0, 0x0 ;", "MUFU.EX2 R9, R20 ;", "FFMA R1, R2, R3, R4 ;",
             "IADD3 R1, R2, R3, RZ ;", "BAR.SYNC.DEFER_BLOCKING 0x0 ;"]
    text = "Function : k\n" + "\n".join(f"/*{16 * n:04x}*/ {line}" for n, line in enumerate(lines))
    kinds = [i.kind() for i in isa_sass.parse(text).instructions]
    assert kinds == ["wgmma", "mma", "ds_read", "ds_write", "tma", "cp_async", "wgmma_fence",
                     "wgmma_wait", "trans", "valu", None, "barrier"]
    assert isa_sass.parse(text).instructions[-1].barrier_threads is None


def test_matching_recipe_passes_and_wrong_count_warns_or_raises():
    assert verify_schedule_sass(SASS, {0: RECIPE}, "pingpong_exp") == []
    wrong = ClusterRecipe(work=(("vmem_read", 3),), pingpong=(3, 4))
    with pytest.warns(ScheduleWarning, match="vmem_read: expected 3, found 2"):
        problems = verify_schedule_sass(SASS, {0: wrong}, "pingpong_exp")
    assert len(problems) == 2 * 5  # count and missing bar.sync 0, in each of the 5 instances
    assert "bar.sync 0: expected at the end of the cluster" in problems[1]
    with pytest.raises(ScheduleError, match="cluster 0"):
        verify_schedule_sass(SASS, {0: wrong}, "pingpong_exp", strict=True)


def test_instances_of_several_pingpong_recipes_are_not_guessed():
    other = ClusterRecipe(work=(("wgmma", 9),), pingpong=(5, 6))
    assert verify_schedule_sass(SASS, {0: RECIPE, 1: other}, "pingpong_exp") == []


WRONG = ClusterRecipe(work=(("vmem_read", 7),), pingpong=(3, 4), barrier_at_end=False)


@kiln.kernel
def pingpong_miscounted(x: kiln.Tensor[f32], y: kiln.Tensor[f32], n: kiln.i32):
    i = kiln.thread_id(0)
    acc = x[i] * 0.0
    for j in kiln.range(n):
        with cluster(0, WRONG):
            acc = acc + x[i + j * 256]
    y[i] = acc


def _args():
    return np.random.rand(1024).astype(np.float32), np.random.rand(1024).astype(np.float32), 4


@pytest.mark.lower
def test_check_is_skipped_cleanly_without_cuobjdump(monkeypatch, recwarn):
    if tools.find_ptxas() is None:
        pytest.skip("needs ptxas for a cubin")
    monkeypatch.setattr(tools, "find_cuobjdump", lambda: None)
    monkeypatch.setenv("KILN_NO_CACHE", "1")
    monkeypatch.setattr(pingpong_miscounted, "_compiled", {})  # compile afresh, not from memory
    ck = pingpong_miscounted.compile(*_args(), target="sm_90a", num_warps=8)
    assert "cubin" in ck.asm
    assert not [w for w in recwarn if issubclass(w.category, ScheduleWarning)]


@pytest.mark.lower
def test_compile_checks_the_sass_when_cuobjdump_is_found(monkeypatch, tmp_path):
    if tools.find_cuobjdump() is None or tools.find_ptxas() is None:
        pytest.skip("needs ptxas and cuobjdump (set KILN_CUOBJDUMP)")
    monkeypatch.setenv("KILN_NO_CACHE", "1")
    monkeypatch.setenv("KILN_DUMP_DIR", str(tmp_path))
    for kernel in (pingpong_exp, pingpong_miscounted):
        monkeypatch.setattr(kernel, "_compiled", {})
    pingpong_exp.compile(*_args(), target="sm_90a", num_warps=8)
    (dump,) = tmp_path.glob("pingpong_exp.sm_90a.*.sass.sass")  # kernel.target.key8.stage.ext
    sass = dump.read_text()
    assert len(isa_sass.cluster_instances(isa_sass.parse(sass))) >= 2
    with pytest.warns(ScheduleWarning, match="vmem_read: expected 7, found 1"):
        pingpong_miscounted.compile(*_args(), target="sm_90a", num_warps=8)
