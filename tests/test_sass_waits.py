"""The NVIDIA final-ISA wait check: every HGMMA result is read, and its registers overwritten,
only after a ``WARPGROUP.DEPBAR`` retired its group (``kiln.lowering.isa_sass.wgmma_wait_problems``).

``data/wgmma_waits.sm_90a.sass`` is written by hand in ``cuobjdump --dump-sass`` format (no
``cuobjdump`` here): a loop issuing a descriptor WGMMA (S), its wait, then a register-A WGMMA
(P.V, A in R40..R43) and its wait. Deleting either wait, or overwriting the register-A operand
while it is in flight, must be reported. On a machine with ``cuobjdump`` the shipped Hopper
kernels' real SASS is checked too.
"""

from pathlib import Path

import pytest

from kiln.lowering import isa_sass, tools

SASS = (Path(__file__).parent / "data" / "wgmma_waits.sm_90a.sass").read_text()


def _problems(text: str) -> list[str]:
    return isa_sass.wgmma_wait_problems(isa_sass.parse(text, "wgmma_loop"))


def _without(address: int) -> str:
    return "\n".join(line for line in SASS.splitlines() if f"/*{address:04x}*/" not in line)


def test_waited_listing_passes():
    assert _problems(SASS) == []


@pytest.mark.parametrize("wait,reader", [(0x40, "F2FP"), (0x90, "FADD")])
def test_deleting_a_depbar_is_reported_at_the_reader(wait, reader):
    problems = _problems(_without(wait))
    assert problems and reader in problems[0] and "no WARPGROUP.DEPBAR" in problems[0]


def test_overwriting_register_a_in_flight_is_reported():
    problems = _problems(SASS.replace("FMUL R24, R24, 0.5", "FMUL R41, R24, 0.5"))
    assert problems and "overwrites R41" in problems[0]


def test_a_group_left_in_flight_across_the_back_edge_is_reported():
    # P.V's wait removed and its result read at the top of the loop instead: in address
    # order nothing is in flight there, but on the back edge the P.V group is.
    lines = []
    for line in SASS.splitlines():
        if "/*0090*/" in line:
            continue
        if "/*0010*/" in line:  # the loop head: WARPGROUP.ARRIVE
            line = line.replace("WARPGROUP.ARRIVE ;    ", "FADD R5, R56, R5 ;    ")
        lines.append(line.replace("FADD R3, R56, R57", "FADD R3, R3, R4"))
    problems = _problems("\n".join(lines))
    assert len(problems) == 1 and "FADD R5, R56, R5" in problems[0]


@pytest.mark.lower
def test_shipped_hopper_kernels_sass_is_waited():
    cuobjdump = tools.find_cuobjdump()
    if cuobjdump is None or tools.find_ptxas() is None:
        pytest.skip("needs cuobjdump (with nvdisasm) and ptxas")
    from kiln.kernels.attention.decode import compile_decode
    from kiln.kernels.attention.decode_config import DecodeConfig
    from kiln.kernels.attention.prefill import compile_prefill
    from kiln.kernels.gemm import compile_matmul

    for ck in (compile_prefill("bf16", target="sm_90a", head_dim=128, causal=True),
               compile_decode("bf16", target="sm_90a", head_dim=128, group=8,
                              config=DecodeConfig(consumer="wgmma", num_warps=4)),
               compile_matmul("bf16", target="sm_90a")):
        sass = isa_sass.dump_sass(ck.asm["cubin"], cuobjdump)
        if sass is None:
            pytest.skip("cuobjdump could not disassemble (nvdisasm missing)")
        assert isa_sass.wgmma_wait_problems(isa_sass.parse(sass, ck.name)) == [], ck.name
