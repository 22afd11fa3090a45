"""Reading NVIDIA SASS (``cuobjdump --dump-sass`` of a cubin) for ``kiln-verify-schedule``.

:func:`parse` splits the listing into one :class:`SassKernel` per ``Function :`` with its
instructions and basic blocks; :meth:`SassInstruction.kind` classifies each one:

============================================  ==============
``HGMMA``                                     ``wgmma``
``HMMA`` ``IMMA`` ``QMMA``                    ``mma``
``LDS`` ``LDSM``                              ``ds_read``
``STS`` ``STSM``                              ``ds_write``
``LDG`` / ``STG``                             ``vmem_read`` / ``vmem_write``
``LDGSTS`` (``cp.async``)                     ``cp_async``
``UTMALDG`` ``UTMASTG`` ``UBLKCP`` ...        ``tma``
``MUFU``                                      ``trans``
``FFMA`` ``FMUL`` ``FADD`` ``HFMA2`` ...      ``valu``
``BAR.SYNC`` / ``BAR.ARV``                    ``barrier`` (with :attr:`barrier_id`)
``WARPGROUP.ARRIVE`` / ``WARPGROUP.DEPBAR``   ``wgmma_fence`` / ``wgmma_wait``
============================================  ==============

Cluster boundaries: the only Kiln cluster code that survives ``ptxas`` is the ping-pong
hand-off of ``kiln-cluster-schedule``: ``bar.sync own, 256`` opens an instance and
``bar.arrive other, 256`` closes it (SASS ``BAR.SYNC.DEFER_BLOCKING Rn, 0x100`` ...
``BAR.ARV Rm, 0x100``). The thread count 256 tells them from a block-wide ``gpu.barrier``
(``BAR.SYNC 0x0``, no count); the lone ``BAR.ARV`` before the loop, with no open instance, is
the first turn's hand-over and opens nothing. Comments and empty inline asm never reach SASS,
and a dedicated marker instruction would cost issue slots in the hot loop, so clusters without
``pingpong`` have no visible start and are not found here.

Example::

    kernel = parse(sass_text, "attn")
    for instance in cluster_instances(kernel):
        print(instance.barrier_id, class_counts(instance.instructions))
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

PINGPONG_THREADS = 256  # kiln-cluster-schedule's named barriers: two consumer warp groups

_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)")
_PREDICATE = re.compile(r"^@!?U?P[T0-9]+\s+")

_KINDS = {
    "HGMMA": "wgmma", "HMMA": "mma", "IMMA": "mma", "QMMA": "mma",
    "LDS": "ds_read", "LDSM": "ds_read", "STS": "ds_write", "STSM": "ds_write",
    "LDG": "vmem_read", "STG": "vmem_write", "LDGSTS": "cp_async",
    "UTMALDG": "tma", "UTMASTG": "tma", "UTMAREDG": "tma", "UBLKCP": "tma", "UBLKRED": "tma",
    "MUFU": "trans", "BAR": "barrier",
}
_VALU = frozenset({"FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "FSETP", "FCHK", "FRND", "F2F", "F2FP",
                   "HFMA2", "HADD2", "HMUL2", "HMNMX2", "HSETP2", "FSWZADD"})
_BRANCHES = frozenset({"BRA", "BRX", "JMP", "JMX", "EXIT", "RET", "CALL"})


@dataclass
class SassInstruction:
    """One SASS instruction: ``opcode`` with its dot modifiers (``BAR.SYNC.DEFER_BLOCKING``)."""

    address: int
    opcode: str
    operands: list[str]
    predicated: bool
    text: str

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]

    def kind(self) -> str | None:
        """The class in this module's table, or None (integer/address arithmetic, moves...)."""
        if self.base == "WARPGROUP":
            return "wgmma_wait" if ".DEPBAR" in self.opcode else "wgmma_fence"
        if self.base in _VALU:
            return "valu"
        return _KINDS.get(self.base)

    @property
    def barrier_id(self) -> str | None:
        """A ``BAR``'s id operand as printed: ``0x3`` (immediate) or ``R10`` (register)."""
        return self.operands[0] if self.base == "BAR" and self.operands else None

    @property
    def barrier_threads(self) -> int | None:
        """A ``BAR``'s thread count, or None for a block-wide ``BAR.SYNC 0x0``."""
        if self.base != "BAR" or len(self.operands) < 2 or not self.operands[1].startswith("0x"):
            return None
        return int(self.operands[1], 16)

    def is_pingpong(self, op: str) -> bool:
        return (self.opcode.startswith(f"BAR.{op}") and not self.predicated
                and self.barrier_threads == PINGPONG_THREADS)

    def branch_target(self) -> int | None:
        if self.base in ("BRA", "JMP", "CALL") and self.operands and self.operands[-1].startswith("0x"):
            return int(self.operands[-1], 16)
        return None


@dataclass
class SassKernel:
    """One ``Function :`` of the listing: its instructions in address order."""

    name: str
    instructions: list[SassInstruction] = field(default_factory=list)

    def basic_blocks(self) -> list[list[SassInstruction]]:
        """Instructions split at branch targets and after branches."""
        leaders = {t for t in (i.branch_target() for i in self.instructions) if t is not None}
        blocks: list[list[SassInstruction]] = []
        for ins in self.instructions:
            if not blocks or ins.address in leaders or blocks[-1][-1].base in _BRANCHES:
                blocks.append([])
            blocks[-1].append(ins)
        return blocks


@dataclass
class ClusterInstance:
    """The instructions between a ping-pong ``BAR.SYNC id, 0x100`` and its ``BAR.ARV``."""

    barrier_id: str
    instructions: list[SassInstruction]
    closed: bool


def _instruction(address: str, body: str) -> SassInstruction:
    predicated = bool(_PREDICATE.match(body))
    body_wo_pred = _PREDICATE.sub("", body)
    opcode, _, rest = body_wo_pred.partition(" ")
    operands = [o.strip() for o in rest.split(",")] if rest.strip() else []
    return SassInstruction(int(address, 16), opcode, operands, predicated, body)


def parse_all(text: str) -> dict[str, SassKernel]:
    """Every kernel in a ``cuobjdump --dump-sass`` listing, by name."""
    kernels: dict[str, SassKernel] = {}
    current = None
    for line in text.splitlines():
        header = _FUNCTION.match(line)
        if header:
            current = kernels.setdefault(header.group(1), SassKernel(header.group(1)))
            continue
        found = _LINE.match(line)
        if found and current is not None:
            current.instructions.append(_instruction(found.group(1), found.group(2)))
    return kernels


def parse(text: str, kernel: str | None = None) -> SassKernel:
    """The kernel ``kernel`` (or the only one) of a SASS listing."""
    kernels = parse_all(text)
    if kernel is not None and kernel in kernels:
        return kernels[kernel]
    if len(kernels) == 1 and kernel is None:
        return next(iter(kernels.values()))
    raise KeyError(f"kernel {kernel!r} not in the SASS listing (found {sorted(kernels)})")


def cluster_instances(kernel: SassKernel) -> list[ClusterInstance]:
    """Every ping-pong cluster instance in address order (see the module docstring)."""
    instances: list[ClusterInstance] = []
    current = None
    for ins in kernel.instructions:
        if ins.is_pingpong("SYNC"):
            if current is not None:  # no arrive before the next turn: keep what was seen
                instances.append(ClusterInstance(current[0], current[1], closed=False))
            current = (ins.barrier_id, [])
        elif ins.is_pingpong("ARV") and current is not None:
            instances.append(ClusterInstance(current[0], current[1], closed=True))
            current = None
        elif current is not None:
            current[1].append(ins)
    if current is not None:
        instances.append(ClusterInstance(current[0], current[1], closed=False))
    return instances


def class_counts(instructions: list[SassInstruction]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for ins in instructions:
        kind = ins.kind()
        if kind is not None:
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def dump_sass(cubin: bytes, cuobjdump: Path) -> str | None:
    """``cuobjdump --dump-sass`` of ``cubin``, or None when it cannot run (it needs
    ``nvdisasm``, looked for next to ``cuobjdump`` and on PATH)."""
    path = os.pathsep.join([str(cuobjdump.parent), os.environ.get("PATH", "")])
    with tempfile.TemporaryDirectory(prefix="kiln-sass-") as tmp:
        cubin_path = Path(tmp) / "kernel.cubin"
        cubin_path.write_bytes(cubin)
        done = subprocess.run([str(cuobjdump), "--dump-sass", str(cubin_path)],
                              capture_output=True, text=True, env={**os.environ, "PATH": path})
    return done.stdout if done.returncode == 0 and "Function" in done.stdout else None


# ---- WGMMA waits on SASS ----------------------------------------------------------------------
# The declared effects of the WGMMA family (kiln.nvidia.wgmma) as SASS spells them: each
# ``HGMMA`` is an event writing its accumulator registers (and reading four A registers in the
# register-A form) asynchronously; the ``HGMMA`` carrying ``gsb0`` closes a commit group;
# ``WARPGROUP.DEPBAR.LE gsb0, N`` retires every group but the N youngest.

_REGISTER = re.compile(r"\bR(\d+)\b")
_HGMMA_SHAPE = re.compile(r"HGMMA\.64x(\d+)x\d+\.F32")
_STORES = frozenset({"STS", "STG", "ST", "STL", "STSM", "RED", "ATOM", "ATOMS", "ATOMG"})


@dataclass(frozen=True)
class _Group:
    """Registers an in-flight WGMMA group writes / reads, and its age in commit groups (-1:
    not yet committed)."""

    writes: frozenset
    reads: frozenset
    younger: int


def _registers(operand: str, opcode: str) -> set[int]:
    base = {int(r) for r in _REGISTER.findall(operand)}
    width = 4 if ".128" in opcode else 2 if ".64" in opcode else 1
    return {r + k for r in base for k in range(width)} if not operand.startswith("[") else base


def _hgmma_group(ins: SassInstruction) -> _Group | None:
    shape = _HGMMA_SHAPE.match(ins.opcode)
    if shape is None or not ins.operands:
        return None
    dest = int(_REGISTER.findall(ins.operands[0])[0])
    a_regs = set()
    if len(ins.operands) > 1 and _REGISTER.fullmatch(ins.operands[1]):
        a0 = int(ins.operands[1][1:])
        a_regs = set(range(a0, a0 + 4))
    return _Group(frozenset(range(dest, dest + int(shape.group(1)) // 2)), frozenset(a_regs), -1)


def _transfer(ins: SassInstruction, state: frozenset, problems: list[str] | None) -> frozenset:
    if ins.base == "HGMMA":
        group = _hgmma_group(ins)
        if group is None:
            return state
        state = state | {group}
        if "gsb0" in ins.operands:  # commits the uncommitted HGMMAs, ages the committed ones
            state = frozenset(_Group(g.writes, g.reads, g.younger + 1) for g in state)
        return state
    if ins.opcode.startswith("WARPGROUP.DEPBAR"):
        keep = int(ins.operands[-1], 16) if ins.operands and ins.operands[-1].startswith("0x") else 0
        return frozenset(g for g in state if not 0 <= keep <= g.younger)
    if problems is not None and state:
        sources = ins.operands if ins.base in _STORES else ins.operands[1:]
        read = set().union(*(_registers(o, ins.opcode) for o in sources)) if sources else set()
        written = set() if ins.base in _STORES or not ins.operands \
            else _registers(ins.operands[0], ins.opcode)
        for g in state:
            if read & g.writes:
                problems.append(f"{ins.address:#06x} {ins.text}: reads R{min(read & g.writes)}, "
                                "a WGMMA result no WARPGROUP.DEPBAR has waited for")
            elif written & (g.writes | g.reads):
                problems.append(f"{ins.address:#06x} {ins.text}: overwrites "
                                f"R{min(written & (g.writes | g.reads))}, which an in-flight "
                                "WGMMA still uses")
    return state


def wgmma_wait_problems(kernel: SassKernel) -> list[str]:
    """The instructions that read an HGMMA's accumulator, or overwrite its registers, while
    the HGMMA may still be in flight on some path (a forward dataflow over the basic blocks;
    paths join by union). Example: ``wgmma_wait_problems(parse(sass)) == []``."""
    blocks = kernel.basic_blocks()
    start = {b[0].address: i for i, b in enumerate(blocks)}
    successors = []
    for i, block in enumerate(blocks):
        last, out = block[-1], []
        target = last.branch_target()
        if target is not None and target in start:
            out.append(start[target])
        falls = last.base not in _BRANCHES or last.predicated
        if falls and last.base not in ("RET",) and i + 1 < len(blocks):
            out.append(i + 1)
        successors.append(out)
    entry = [frozenset() for _ in blocks]
    work = list(range(len(blocks)))
    for _ in range(64 * max(1, len(blocks))):  # a finite lattice: the bound is never reached
        if not work:
            break
        i = work.pop(0)
        state = entry[i]
        for ins in blocks[i]:
            state = _transfer(ins, state, None)
        for j in successors[i]:
            joined = entry[j] | state
            if joined != entry[j]:
                entry[j] = joined
                work.append(j)
    problems: list[str] = []
    for i, block in enumerate(blocks):
        state = entry[i]
        for ins in block:
            state = _transfer(ins, state, problems)
    return problems
