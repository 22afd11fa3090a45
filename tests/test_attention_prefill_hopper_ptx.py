"""The Hopper attention prefill compiled (``lower``): the PTX of its pipeline, no spills on any
shipped configuration, ``setmaxnreg`` and asynchronous WGMMAs kept by ptxas, and where the
main loop's P V wait sits in SASS."""

import importlib
import re
import subprocess
from dataclasses import replace

import pytest

import kiln
from kiln.kernels.attention.prefill import compile_prefill
from kiln.kernels.attention.prefill_hopper import HopperPrefillConfig
from kiln.lowering.tools import find_ptxas

prefill_module = importlib.import_module("kiln.kernels.attention.prefill")
# The persistent kernel with every opt-in overlap option (the overlapped walk, the zigzag
# causal deal, direct output stores).
OVERLAPPED = dict(overlap_items=True, zigzag=True, direct_store=True)

@pytest.fixture(scope="module")
def causal_d128():
    return compile_prefill(target="sm_90a", head_dim=128, dtype="bf16", causal=True,
                           return_lse=True)


@pytest.mark.lower
def test_ptx_has_the_hopper_pipeline(causal_d128):
    ptx = " ".join(causal_d128.asm["ptx"].split())
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16" in ptx
    assert "cp.async.bulk.tensor.2d.shared::cluster.global" in ptx
    assert "setmaxnreg.dec.sync.aligned.u32 24" in ptx
    assert "setmaxnreg.inc.sync.aligned.u32 240" in ptx
    assert "mbarrier.try_wait.parity" in ptx
    assert ".maxntid 384, 1, 1" in ptx
    # Ping-pong: each consumer waits for its turn and hands the next one to the other group.
    assert "bar.sync" in ptx and "bar.arrive" in ptx
    # S_j and P_{j-1} V_{j-1} in flight together, softmax after the first completes.
    assert "wgmma.wait_group.sync.aligned 1" in ptx
    # K and V halves of a stage are released separately: the producer waits on k_empty and
    # v_empty (the consumers wait on q_full, k_full twice and v_full twice), and a consumer
    # frees K_j after S_j's softmax (whose rare redo reads K_j again), before P_{j-1} V_{j-1}
    # is done: the group's vote, then K's release, then the wait for P V.
    assert ptx.count("mbarrier.try_wait.parity") == 2 + 5
    assert ptx.count("mbarrier.arrive.shared.b64") == 4  # K: prologue, loop; V: loop, epilogue
    after_scores = ptx[ptx.index("wgmma.wait_group.sync.aligned 1"):]
    vote = after_scores.index("bar.red.or.pred")
    release_k = after_scores.index("mbarrier.arrive.shared.b64")
    assert vote < release_k < after_scores.index("wgmma.wait_group.sync.aligned 0", release_k)
    # P @ V takes P from registers (four b32 A registers, V through a transposed descriptor):
    # one issue per 16 keys of the 128-key tile in the loop and again in the epilogue, and no
    # P tile in shared memory.
    pv = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16 \{[^}]*\}, "
                    r"\{%r\d+, %r\d+, %r\d+, %r\d+\}, %rd\d+, p, 1, 1, 1;", ptx)
    assert len(pv) == 2 * 128 // 16
    # No P tile in shared memory: the only shared stores stage the output (one b32 pair of
    # bf16 per two accumulator registers), which then leaves in 16-byte global stores.
    assert len(re.findall(r"st\.shared\.b32", ptx)) == 128 * 64 // 128 // 2
    assert set(re.findall(r"st\.shared\.\S+", ptx)) == {"st.shared.b32"}
    assert "st.global.v4.b32" in ptx and "st.global.b16" not in ptx
    # Flushed denormals: every exp2 is the single-instruction ex2.approx.ftz.
    assert "ex2.approx.ftz.f32" in ptx and "ex2.approx.f32" not in ptx


@pytest.mark.lower
@pytest.mark.parametrize("d,block_n", [(64, None), (128, None), (128, 144), (256, None)])
@pytest.mark.slow
def test_no_spills(d, block_n):
    tiles = {} if block_n is None else dict(block_n=block_n)
    ck = compile_prefill(target="sm_90a", head_dim=d, dtype="f16", window=(128, 0), group=4,
                         sinks=True, return_lse=True, **tiles)
    assert ck.metadata["spill_bytes"] == 0 and ck.metadata["stack_bytes"] == 0
    assert ck.metadata["wgmma_serialized"] is None
    config = HopperPrefillConfig(head_dim=d, **tiles) if tiles else \
        HopperPrefillConfig.for_head_dim(d)
    assert ck.signature.dynamic_shared_bytes >= config.shared_bytes()
    assert ck.signature.block == (384, 1, 1)


@pytest.mark.lower
@pytest.mark.parametrize("d,dv,causal", [
    pytest.param(64, None, False, marks=pytest.mark.slow), (64, None, True), (128, None, False),
    pytest.param(96, None, True, marks=pytest.mark.slow), (192, 128, False)])
def test_persistent_kernel_has_no_spills(d, dv, causal):
    ck = compile_prefill(target="sm_90a", head_dim=d, head_dim_v=dv, causal=causal, group=2,
                         return_lse=True, persistent=True)
    assert ck.metadata["spill_bytes"] == 0 and ck.metadata["stack_bytes"] == 0
    assert ck.metadata["wgmma_serialized"] is None
    config = replace(HopperPrefillConfig.for_head_dim(d, dv), persistent=True)
    assert ck.signature.dynamic_shared_bytes >= config.shared_bytes()


@pytest.mark.slow
@pytest.mark.lower
@pytest.mark.parametrize("d,causal,tiles", [(64, False, (128, 3)), (64, False, (192, 3)),
                                            (64, True, (128, 3)), (128, False, (128, 2)),
                                            (128, True, (128, 2))])
def test_overlapped_persistent_kernel_has_no_spills(d, causal, tiles):
    # Direct output stores: staging O in the Q buffer while the next item's S is live spills
    # at D 128 and with 192-key tiles. D 128 causal (zigzag, GQA) takes the max-first softmax:
    # the max-on-demand redo spills there.
    ck = compile_prefill(target="sm_90a", head_dim=d, causal=causal, group=2, return_lse=True,
                         persistent=True, block_n=tiles[0], stages=tiles[1], **OVERLAPPED,
                         exp_before_max=not (d == 128 and causal))
    assert ck.metadata["spill_bytes"] == 0 and ck.metadata["stack_bytes"] == 0
    assert ck.metadata["wgmma_serialized"] is None


@pytest.mark.lower
@pytest.mark.skipif(find_ptxas() is None, reason="needs ptxas")
def test_ptxas_keeps_setmaxnreg_and_wgmma_async(causal_d128, tmp_path):
    ptx = tmp_path / "prefill.ptx"
    ptx.write_text(causal_d128.asm["ptx"])
    done = subprocess.run([str(find_ptxas()), "-arch=sm_90a", "-v", str(ptx), "-o",
                           str(tmp_path / "prefill.cubin")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "0 bytes spill stores" in done.stderr
    assert "setmaxnreg ignored" not in done.stderr
    assert "serialized" not in done.stderr  # ptxas would serialise WGMMAs it cannot pipeline


PV_WAIT_CASES = {
    # The default at D = 128: P against the running max, then the group's vote (bar.red).
    "d128_exp_before_max": (128, dict(), "BAR.RED.OR"),
    # Max first with sched_barrier's clock read holding the wait (pin_pv_wait).
    "d128_max_first_pinned": (128, dict(exp_before_max=False, pin_pv_wait=True), "SR_CLOCKLO"),
    # Max first, nothing holding the wait: ptxas hoists it above every exp2.
    "d64_max_first": (64, dict(exp_before_max=False, lazy_rescale=False), None),
}


@pytest.mark.lower
@pytest.mark.parametrize("d,schedule,holder", PV_WAIT_CASES.values(), ids=PV_WAIT_CASES.keys())
def test_pv_wait_follows_the_softmax_in_sass(d, schedule, holder):
    """The main loop's wait for the group's own P V (``WARPGROUP.DEPBAR.LE gsb0, 0x0``) comes
    after the softmax's exp2s in SASS when something holds it there (the vote's barrier, or
    ``sched_barrier``'s clock read); without either ptxas hoists it above them."""
    from kiln.lowering import isa_sass
    from kiln.lowering.tools import find_cuobjdump

    cuobjdump = find_cuobjdump()
    if cuobjdump is None or find_ptxas() is None:
        pytest.skip("needs ptxas and cuobjdump")
    ck = compile_prefill(target="sm_90a", head_dim=d, dtype="bf16", **schedule)
    sass = isa_sass.dump_sass(ck.asm["cubin"], cuobjdump)
    if sass is None:
        pytest.skip("cuobjdump could not disassemble (no nvdisasm)")
    code = isa_sass.parse(sass).instructions
    # The loop's body: from the wait for S_j (gsb0 <= 1) to the next wait.
    start = next(n for n, i in enumerate(code)
                 if i.opcode == "WARPGROUP.DEPBAR.LE" and i.operands == ["gsb0", "0x1"])
    end = next(n for n in range(start + 1, len(code)) if code[n].opcode == "WARPGROUP.DEPBAR.LE")
    exps = sum(i.opcode == "MUFU.EX2" for i in code[start:end])
    held = holder is not None and any(holder in i.opcode or holder in i.operands
                                      for i in code[start:end])
    assert (exps >= 64 and held) if holder else (exps == 0)


# The upper 32 bits of a 128-byte-swizzled WGMMA descriptor with a 1024-byte stride.
DESCRIPTOR_UPPER = "0x40000040"


def _descriptor_upper_word_lost(code) -> list[str]:
    """Register-A HGMMAs (the P V products) whose B descriptor's upper uniform register was last
    written, in address order, by something that cannot hold ``DESCRIPTOR_UPPER``: a zero, an
    address, a 32-bit result. ptxas 13.0 built the overlapped walk's last P V so when its
    descriptor was made after the item loop (docs/kernels.md, short sequences). Registers
    filled from vector registers or constants (R2UR, ULDC) count as unknown, not lost."""
    state: dict[int, str] = {}  # uniform register -> "upper", "other" or "unknown"
    lower_by_add = set()  # registers last written by a 32-bit add of an immediate
    lost = []
    for ins in code:
        hgmma = re.match(r"R\d+$", ins.operands[1]) if ins.base == "HGMMA" and \
            len(ins.operands) > 2 else None
        if hgmma:
            upper = int(re.search(r"gdesc\[UR(\d+)\]", ins.operands[2]).group(1)) + 3
            # A lower word from a 32-bit add of the descriptor's constant: its upper word needs
            # the constant's upper half, which ptxas 13.0 left out.
            if state.get(upper) == "other" or (upper - 1 in lower_by_add
                                               and state.get(upper) != "upper"):
                lost.append(f"{ins.address:#x}: {ins.text}")
            continue
        if not ins.operands or not re.fullmatch(r"UR\d+", ins.operands[0]):
            continue
        dest = int(ins.operands[0][2:])
        sources = [int(s[2:]) for s in ins.operands[1:] if re.fullmatch(r"UR\d+", s)]
        lower_by_add.discard(dest)
        if ins.opcode == "UIADD3" and any(o.startswith("0x") for o in ins.operands[1:]):
            lower_by_add.add(dest)
        if ins.opcode == "UMOV":
            state[dest] = "upper" if ins.operands[1] == DESCRIPTOR_UPPER else \
                state.get(sources[0], "unknown") if sources else "other"
        elif ins.opcode.startswith("UIMAD.WIDE"):
            state[dest], state[dest + 1] = "other", state.get(sources[-1] + 1, "unknown")
        elif ins.opcode == "UIADD3.64":
            state[dest], state[dest + 1] = "other", state.get(sources[0] + 1, "unknown")
        elif ins.base in ("R2UR", "ULDC", "S2UR") or ins.opcode.startswith("UIADD3.X"):
            state[dest] = "unknown"
        else:
            state[dest] = "other"
    return lost


@pytest.mark.lower
@pytest.mark.parametrize("d,causal", [(64, True), (96, False), (128, False)])
def test_overlapped_walk_last_product_keeps_its_descriptor_in_sass(d, causal):
    from kiln.lowering import isa_sass
    from kiln.lowering.tools import find_cuobjdump

    cuobjdump = find_cuobjdump()
    if cuobjdump is None or find_ptxas() is None:
        pytest.skip("needs ptxas and cuobjdump")
    ck = compile_prefill(target="sm_90a", head_dim=d, causal=causal, persistent=True,
                         **OVERLAPPED)
    sass = isa_sass.dump_sass(ck.asm["cubin"], cuobjdump)
    if sass is None:
        pytest.skip("cuobjdump could not disassemble (no nvdisasm)")
    code = isa_sass.parse(sass).instructions
    assert sum(i.base == "HGMMA" and ".tnspB" in i.text for i in code) > 0
    assert _descriptor_upper_word_lost(code) == []
