"""Cluster recipes, the DSL annotation, and the schedule check against final assembly."""


import numpy as np
import pytest

import kiln
from kiln import f32
from kiln.cluster import ClusterRecipe, cluster
from kiln.core.errors import KilnValueError, ScheduleError, ScheduleWarning
from kiln.lowering import isa_amdgpu
from kiln.lowering.verify_schedule import verify_schedule


def test_recipe_summary_round_trips_and_expands_its_interleave():
    recipe = ClusterRecipe(work=(("mfma", 4), ("ds_read", 2)), interleave=(("mfma", 2), ("ds_read", 1)),
                           priority=1, drain_lgkm=True)
    assert str(recipe) == "mfma=4 ds_read=2; interleave mfma=2 ds_read=1; barrier; setprio=1; drain"
    assert ClusterRecipe.parse(str(recipe)) == recipe
    assert recipe.sched_groups() == [("mfma", 2), ("ds_read", 1), ("mfma", 2), ("ds_read", 1)]
    bare = ClusterRecipe(work=(("valu", 3),), barrier_at_end=False, iglp=1)
    assert ClusterRecipe.parse(str(bare)) == bare


@pytest.mark.parametrize("kwargs,words", [
    ({"work": (("mfmaa", 1),)}, "unknown work class"),
    ({"work": (("mfma", 0),)}, "positive int"),
    ({"work": (("mfma", 1),), "interleave": (("ds_read", 1),)}, "not declared in work"),
    ({"work": (("mfma", 1),), "priority": 4}, "0..3"),
    ({"work": (("mfma", 1),), "interleave": (("mfma", 1),), "iglp": 0}, "not both"),
])
def test_bad_recipes_name_the_problem(kwargs, words):
    with pytest.raises(KilnValueError, match=words):
        ClusterRecipe(**kwargs)


RECIPE = ClusterRecipe(work=(("vmem_read", 1),), priority=1)


@kiln.kernel
def tagged(x: kiln.Tensor[f32], y: kiln.Tensor[f32], n: kiln.i32):
    i = kiln.thread_id(0)
    with cluster(2, RECIPE):
        v = x[i]
        if i < n:
            v = v + 1.0
    y[i] = v


@kiln.kernel
def nested(x: kiln.Tensor[f32]):
    with cluster(0):
        with cluster(1):
            x[0] = 1.0


def test_cluster_tags_every_op_in_the_block_including_nested_regions():
    text = tagged.trace(np.zeros(4, np.float32), np.zeros(4, np.float32), 4, target="gfx950").module_asm
    body = text[text.index("gpu.thread_id"):]
    load = next(line for line in body.splitlines() if "memref.load" in line)
    inner_add = next(line for line in body.splitlines() if "arith.addf" in line)
    store = next(line for line in body.splitlines() if "memref.store" in line)
    assert "kiln.cluster = 2" in load and "kiln.cluster = 2" in inner_add
    assert "kiln.cluster" not in store
    assert 'kiln.cluster_recipes = {c2 = "vmem_read=1; barrier; setprio=1"}' in text
    assert 'kiln.target = "gfx950"' in text


def _hoist_a_constant():
    """Trace-time Python that puts an op at the top of the current block (above the ops
    before the cluster), as a hoisting helper would."""
    from mlir import ir
    from mlir.dialects import arith

    block = ir.InsertionPoint.current.block
    with ir.InsertionPoint.at_block_begin(block), ir.Location.unknown():
        arith.constant(ir.IntegerType.get_signless(32), 12345)


@kiln.kernel
def hoisting(x: kiln.Tensor[f32], y: kiln.Tensor[f32]):
    i = kiln.thread_id(0)
    with cluster(3):
        _hoist_a_constant()
        v = x[i] * 2.0
    y[i] = v


def test_cluster_finds_its_ops_when_ops_went_in_above_it():
    """Ops inserted above the cluster's start shift the block's indices: the ops built at
    the insertion point are still the cluster's, and nothing before its start."""
    text = hoisting.trace(np.zeros(4, np.float32), np.zeros(4, np.float32),
                          target="gfx950").module_asm
    lines = text[text.index("gpu.func"):].splitlines()
    tagged_lines = [line for line in lines if "kiln.cluster = 3" in line]
    assert any("memref.load" in line for line in tagged_lines)
    assert any("arith.mulf" in line for line in tagged_lines)
    assert not any("12345" in line or "gpu.thread_id" in line for line in tagged_lines)
    assert not any("memref.store" in line for line in tagged_lines)


def test_clusters_do_not_nest():
    with pytest.raises(KilnValueError, match="nested"):
        nested.trace(np.zeros(4, np.float32), target="gfx950")


ASM = """k:
\t; sched_group_barrier mask(0x00000000) size(0) SyncID(4915200)
\ts_setprio 1
\tglobal_load_dword v1, v0, s[0:1]
\tv_mfma_f32_32x32x8f16 a[0:15], v[2:3], v[2:3], a[0:15]
\ts_setprio 0
\ts_barrier
\t; sched_group_barrier mask(0x00000000) size(0) SyncID(4947968)
\ts_endpgm
"""


def test_schedule_check_counts_per_cluster_and_warns_or_raises():
    good = {0: ClusterRecipe(work=(("vmem_read", 1), ("mfma", 1)), priority=1)}
    assert verify_schedule(ASM, good, "k") == []
    bad = {0: ClusterRecipe(work=(("vmem_read", 1), ("mfma", 2)), barrier_at_end=False)}
    with pytest.warns(ScheduleWarning, match="mfma: expected 2, found 1"):
        problems = verify_schedule(ASM, bad, "k")
    assert any("s_barrier: expected none, found 1" in p for p in problems)
    with pytest.raises(ScheduleError, match="cluster 0"):
        verify_schedule(ASM, bad, "k", strict=True)


def test_live_registers_at_a_cluster_start_include_the_accumulator():
    live = isa_amdgpu.live_vgprs_at_clusters(isa_amdgpu.parse(ASM, "k"))
    assert live == {"c0": 1 + 2 + 16}  # v0 (address), v[2:3] (operands), a[0:15] (accumulator)


def test_pingpong_recipe_round_trips_and_rejects_bad_ids():
    recipe = ClusterRecipe(work=(("wgmma", 4),), pingpong=(3, 4))
    assert str(recipe) == "wgmma=4; barrier; pingpong=3,4"
    assert ClusterRecipe.parse(str(recipe)) == recipe
    with pytest.raises(KilnValueError, match="pingpong"):
        ClusterRecipe(work=(("wgmma", 1),), pingpong=(0, 0))
