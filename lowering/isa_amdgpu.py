"""A model of gfx9 (gfx942/gfx950) AMDGPU assembly: instructions, blocks, counters, registers.

Used by the assembly-level checks that run after the ``amdgcn`` stage:

- :func:`verify_waits`: every read (or overwrite) of a register that a VMEM/LDS/SMEM load
  writes is preceded on every path by an ``s_waitcnt`` that retires that load. The in-order
  counters are modelled per basic block with a forward fixed point over branches:
  ``vmcnt`` counts VMEM loads *and stores* (gfx9 has no separate store counter), ``lgkmcnt``
  counts LDS ops (in order) and SMEM loads (out of order: only ``lgkmcnt(0)`` retires them);
  a call (``s_swappc_b64``) retires everything, because the callee opens with ``s_waitcnt 0``.
- :func:`cluster_instances` / :func:`class_counts`: the instructions from the begin marker to
  the end marker of each cluster instance that ``kiln-cluster-schedule`` plants (empty
  ``sched_group_barrier``s with SyncID ``0x4B0000 + k`` / ``0x4B8000 + k``, printed as comments
  in verbose assembly), following branches, counted per work class.
- :func:`live_vgprs_at_clusters`: live VGPRs+AGPRs at each cluster's begin marker, from a
  backward liveness pass (an estimate: operand 0 is taken as the def except for stores,
  LDS writes and branches; MAC/MFMA accumulators count as reads).

Example::

    program = parse(ck.asm["amdgcn"], "k")
    verify_waits(program)                      # raises kiln.core.errors.WaitError on a gap
    live_vgprs_at_clusters(program)            # {'c0': 48, 'c1': 52}
"""

from __future__ import annotations

import bisect
import functools
import re
from dataclasses import dataclass, field
from itertools import repeat

from kiln.core.errors import SourceLoc, WaitError
from kiln.passes.wait_analysis import GFX9_MAX
_REG = re.compile(r"\b([vsa])(\d+)\b|\b([vsa])\[(\d+):(\d+)\]")
_WAIT = re.compile(r"(vmcnt|lgkmcnt|expcnt)\((\d+)\)")
_LABEL = re.compile(r"^([.\w$]+):")
_MARKER = re.compile(r";\s*sched_group_barrier mask\(0x0+\) size\(0\) SyncID\((\d+)\)")
MARKER_SYNC_BASE = 0x4B0000  # kiln.passes.cluster_schedule.marker_sync_id
_LOC = re.compile(r"^\s*\.loc\s+(\d+)\s+(\d+)")
_FILE = re.compile(r'^\s*\.file\s+(\d+)\s+"([^"]*)"(?:\s+"([^"]*)")?')
_NO_DEF = ("global_store", "buffer_store", "flat_store", "scratch_store", "ds_write", "ds_store",
           "s_cbranch", "s_branch", "s_waitcnt", "s_barrier", "s_setprio", "s_endpgm", "s_nop",
           "s_cmp", "s_bitcmp", "s_sleep", "s_sendmsg", "s_setpc", "global_load_lds", "s_trap")
# gfx9 calls. Every non-kernel function opens with ``s_waitcnt 0`` (SIInsertWaitcnts), so a call
# retires everything the caller had in flight; its operands (the target) are checked first.
_CALLS = ("s_swappc",)
_TRANS = ("v_exp", "v_log", "v_rcp", "v_rsq", "v_sqrt", "v_sin", "v_cos")


@dataclass
class Instr:
    """One instruction: mnemonic, operand text, registers it defines/uses, source line."""

    index: int
    mnemonic: str
    text: str
    defs: frozenset
    uses: frozenset
    loc: SourceLoc | None

    @property
    def counter(self) -> str | None:
        m = self.mnemonic
        if m.startswith(("global_", "buffer_", "scratch_", "flat_")):
            return "vmcnt"
        if m.startswith(("ds_", "s_load", "s_buffer_load")):
            return "lgkmcnt"
        return None

    @property
    def is_smem(self) -> bool:
        return self.mnemonic.startswith(("s_load", "s_buffer_load"))

    @property
    def is_lds_dma(self) -> bool:
        return self.mnemonic.startswith("global_load_lds") or (
            self.mnemonic.startswith("buffer_load") and re.search(r"\blds\b", self.text) is not None)

    def work_class(self) -> str | None:
        """The recipe work class of this instruction (see kiln.cluster.SCHED_GROUP_MASKS)."""
        m = self.mnemonic
        if m.startswith(("v_mfma", "v_smfmac")):
            return "mfma"
        if m.startswith(("ds_read", "ds_load")):
            return "ds_read"
        if m.startswith(("ds_write", "ds_store")):
            return "ds_write"
        if self.is_lds_dma:
            return "dma"
        if m.startswith(("global_load", "buffer_load", "flat_load")):
            return "vmem_read"
        if m.startswith(("global_store", "buffer_store", "flat_store")):
            return "vmem_write"
        if m.startswith(_TRANS):
            return "trans"
        if m.startswith("v_"):
            return "valu"
        return None


@dataclass
class Marker:
    kind: str          # "begin" | "end"
    cluster: int
    position: int      # index of the next instruction
    loc: SourceLoc | None


@dataclass
class Program:
    """The instructions of one kernel, its basic blocks (instruction index ranges) and markers."""

    instrs: list = field(default_factory=list)
    blocks: list = field(default_factory=list)   # (start, end, successor block indices)
    markers: list = field(default_factory=list)


@functools.lru_cache(maxsize=1 << 16)  # unrolled code repeats operand texts (a[0:255]...)
def _registers(text: str) -> frozenset:
    regs = set()
    for m in _REG.finditer(text):
        if m.group(1):
            regs.add((m.group(1), int(m.group(2))))
        else:
            regs.update(zip(repeat(m.group(3)), range(int(m.group(4)), int(m.group(5)) + 1)))
    return frozenset(regs)


def _split_operands(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return [p for p in parts if p]


def _defs_uses(mnemonic: str, operands: list[str]) -> tuple[frozenset, frozenset]:
    if not operands or mnemonic.startswith(_NO_DEF) or (
            mnemonic.startswith("buffer_load") and "lds" in operands[-1].split()):
        return frozenset(), _registers(",".join(operands))
    defs = _registers(operands[0])
    uses = _registers(",".join(operands[1:]))
    if "mac" in mnemonic or mnemonic.startswith(("v_mfma", "v_smfmac")):
        uses |= _registers(operands[3]) if len(operands) > 3 else defs
    return defs, uses


def parse(asm: str, kernel: str | None = None) -> Program:
    """Instructions, blocks and cluster markers of ``kernel`` (the first kernel if None)."""
    program = Program()
    files: dict[int, str] = {}
    loc = None
    inside = kernel is None
    labels: dict[str, int] = {}
    block_starts = {0}
    for raw in asm.splitlines():
        file_match = _FILE.match(raw)
        if file_match:
            directory, name = file_match.group(2), file_match.group(3)
            files[int(file_match.group(1))] = f"{directory}/{name}" if name else directory
            continue
        label = _LABEL.match(raw)
        if label:
            name = label.group(1)
            if kernel is not None and name == kernel:
                inside = True
            elif inside and not name.startswith(".L"):
                inside = kernel is None
            labels[name] = len(program.instrs)
            block_starts.add(len(program.instrs))
            continue
        if not inside:
            continue
        if raw.strip().startswith(".Lfunc_end"):
            break
        loc_match = _LOC.match(raw)
        if loc_match and int(loc_match.group(2)) > 0:
            loc = SourceLoc(files.get(int(loc_match.group(1)), "?"), int(loc_match.group(2)))
            continue
        marker = _MARKER.search(raw)
        if marker and int(marker.group(1)) >= MARKER_SYNC_BASE:
            sync = int(marker.group(1)) - MARKER_SYNC_BASE
            program.markers.append(Marker("end" if sync & 0x8000 else "begin", sync & 0x7FFF,
                                          len(program.instrs), loc))
            continue
        line = raw.split(";", 1)[0].strip()
        if not line or line.startswith("."):
            continue
        mnemonic, _, rest = line.partition(" ")
        defs, uses = _defs_uses(mnemonic, _split_operands(rest))
        program.instrs.append(Instr(len(program.instrs), mnemonic, rest, defs, uses, loc))
        if mnemonic.startswith(("s_branch", "s_cbranch", "s_endpgm", "s_setpc")):
            block_starts.add(len(program.instrs))
    starts = sorted(s for s in block_starts if s < len(program.instrs)) or [0]
    ends = starts[1:] + [len(program.instrs)]
    index_of = {s: i for i, s in enumerate(starts)}
    for n, (start, end) in enumerate(zip(starts, ends)):
        last = program.instrs[end - 1] if end > start else None
        succ = []
        if last is not None and last.mnemonic.startswith(("s_branch", "s_cbranch")):
            target = labels.get(last.text.split()[0]) if last.text else None
            if target is not None and target in index_of:
                succ.append(index_of[target])
        falls = last is None or not last.mnemonic.startswith(("s_branch", "s_endpgm", "s_setpc"))
        if falls and n + 1 < len(starts):
            succ.append(n + 1)
        program.blocks.append((start, end, succ))
    return program


# -- waits -------------------------------------------------------------------------------------
def _join(a: dict, b: dict) -> dict:
    out = dict(a)
    for key, younger in b.items():
        out[key] = min(younger, out[key]) if key in out else younger
    return out


def _step(program: Program, ins: Instr, state: dict, gaps: list | None) -> dict:
    instrs = program.instrs
    if ins.mnemonic == "s_waitcnt":
        limits = {c: int(n) for c, n in _WAIT.findall(ins.text)}
        if not limits and ins.text.strip().isdigit() and int(ins.text) == 0:
            limits = {"vmcnt": 0, "lgkmcnt": 0, "expcnt": 0}
        return {k: y for k, y in state.items()
                if not (instrs[k].counter in limits and (
                    y >= limits[instrs[k].counter] if not instrs[k].is_smem
                    else limits[instrs[k].counter] == 0))}
    if gaps is not None:
        touched = ins.uses | ins.defs
        for k in state:
            producer = instrs[k]
            hazard = producer.defs & touched
            if hazard and not (producer.counter == ins.counter and not (producer.defs & ins.uses)):
                gaps.append((ins, producer))
    if ins.mnemonic.startswith(_CALLS):
        return {}  # the callee opens with s_waitcnt 0 (see _CALLS)
    counter = ins.counter
    if counter is None:
        return state
    out = {k: (y + 1 if instrs[k].counter == counter else y) for k, y in state.items()}
    if ins.defs or ins.is_lds_dma or counter == "vmcnt":
        out[ins.index] = 0
    return {k: y for k, y in out.items() if y <= GFX9_MAX[instrs[k].counter] or instrs[k].is_smem}


def verify_waits(program: Program, kernel: str = "kernel") -> None:
    """Raise :class:`WaitError` at the first read of a load's register that no wait covers."""
    entry: dict[int, dict] = {0: {}}
    work = [0]
    while work:
        n = work.pop()
        start, end, succ = program.blocks[n]
        state = dict(entry[n])
        for ins in program.instrs[start:end]:
            state = _step(program, ins, state, None)
        for s in succ:
            joined = _join(entry[s], state) if s in entry else state
            if s not in entry or joined != entry[s]:
                entry[s] = joined
                work.append(s)
    for n, (start, end, _) in enumerate(program.blocks):
        if n not in entry:
            continue
        state, gaps = dict(entry[n]), []
        for ins in program.instrs[start:end]:
            state = _step(program, ins, state, gaps)
            if gaps:
                reader, producer = gaps[0]
                raise WaitError(
                    f"kernel {kernel!r}: `{reader.mnemonic} {reader.text}` touches a register "
                    f"that `{producer.mnemonic} {producer.text}` ({producer.counter}) may still "
                    f"be writing: no s_waitcnt retires it on every path",
                    fix="this is a Kiln or LLVM bug unless the kernel writes raw waits; "
                        "set KILN_DUMP_DIR and report the .amdgcn",
                    loc=reader.loc or _cluster_loc(program, reader.index))


def _cluster_loc(program: Program, index: int) -> SourceLoc | None:
    before = [m for m in program.markers if m.position <= index and m.kind == "begin"]
    return before[-1].loc if before else None


# -- clusters ----------------------------------------------------------------------------------
def cluster_instances(program: Program) -> list[tuple[Marker, list]]:
    """``(begin marker, instructions)`` for every cluster instance, in asm order of the begin
    markers. The instructions are those reachable from the begin marker before the cluster's
    end marker, following branches (a loop that LLVM rotated around a branch inside a cluster
    lays the instance's tail out before its head), each once, blocks in reverse postorder
    (execution order for the if/else shapes clusters hold)."""
    out = []
    starts = [start for start, _, _ in program.blocks]

    def block_of(position: int) -> int:
        return bisect.bisect_right(starts, position) - 1

    for begin in (m for m in program.markers if m.kind == "begin"):
        first = block_of(begin.position)
        segments: dict[int, list] = {}
        edges: dict[int, list] = {}
        closed, queue = False, [(first, begin.position)]
        while queue:
            n, position = queue.pop()
            _, end, succ = program.blocks[n] if n >= 0 else (0, position, [])
            stops = [m for m in program.markers if position <= m.position < end
                     and (m.kind == "begin" and m is not begin
                          or m.kind == "end" and m.cluster == begin.cluster)]
            if not stops and end == len(program.instrs):  # a marker after the last instruction
                stops = [m for m in program.markers if m.position == end and m.kind == "end"
                         and m.cluster == begin.cluster]
            stop = min(stops, key=lambda m: m.position) if stops else None
            segments[n] = program.instrs[position:stop.position if stop else end]
            if stop is not None:
                closed = closed or stop.kind == "end"
                continue
            edges[n] = [s for s in succ if s != first]
            queue += [(s, program.blocks[s][0]) for s in edges[n]
                      if s not in segments and all(s != q for q, _ in queue)]
        if closed:
            out.append((begin, [i for n in _reverse_postorder(first, edges) for i in segments[n]]))
    return out


def _reverse_postorder(root: int, edges: dict[int, list]) -> list[int]:
    order, visited, stack = [], {root}, [(root, iter(edges.get(root, ())))]
    while stack:
        node, children = stack[-1]
        child = next(children, None)
        if child is None:
            order.append(node)
            stack.pop()
        elif child not in visited:
            visited.add(child)
            stack.append((child, iter(edges.get(child, ()))))
    return order[::-1]


def class_counts(instrs: list) -> dict[str, int]:
    counts: dict[str, int] = {}
    for ins in instrs:
        work = ins.work_class()
        if work is not None:
            counts[work] = counts.get(work, 0) + 1
    return counts


def _live_before(instrs: list, succ: list, live_in: dict) -> frozenset:
    """Registers live before ``instrs``, given the live-in sets of the blocks after them
    (updated in place: a new set per instruction copied every live register)."""
    live = set().union(*(live_in.get(s, ()) for s in succ))
    for ins in reversed(instrs):
        live.difference_update(ins.defs)
        live.update(ins.uses)
    return frozenset(live)


def live_vgprs_at_clusters(program: Program) -> dict[str, int]:
    """Live VGPRs + AGPRs at each cluster's begin marker (max over its instances)."""
    live_in: dict[int, frozenset] = {}
    changed = True
    while changed:
        changed = False
        for n in reversed(range(len(program.blocks))):
            start, end, succ = program.blocks[n]
            live = _live_before(program.instrs[start:end], succ, live_in)
            if live_in.get(n) != live:
                live_in[n], changed = live, True
    result: dict[str, int] = {}
    for marker in (m for m in program.markers if m.kind == "begin"):
        n = next(i for i, (s, e, _) in enumerate(program.blocks) if s <= marker.position < e or
                 (s == e == marker.position)) if program.blocks else None
        if n is None:
            continue
        start, end, succ = program.blocks[n]
        live = _live_before(program.instrs[marker.position:end], succ, live_in)
        count = sum(1 for kind, _ in live if kind in "va")
        key = f"c{marker.cluster}"
        result[key] = max(result.get(key, 0), count)
    return result
