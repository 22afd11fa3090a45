"""Tensor-core MMA atoms: one instruction's ``C += A @ B`` on per-lane register fragments.

An **atom** is one matrix instruction (``mma.sync.m16n8k16``, ``v_mfma_f32_32x32x16_bf16``,
``wgmma.m64nNk16``). Its :class:`MmaAtomSpec` says what it multiplies (``m x k`` by ``k x n``
into ``m x n``), in which dtypes, over how many threads, which chips have it, and — through
:class:`~kiln.layout.ThreadValueLayout` — which element of each operand every lane holds in
which register. Calling the atom on per-lane fragments (``kiln.Value`` vectors) emits the
instruction and returns the new C fragment::

    atom = kiln.mma.atom(16, 8, 16, kiln.bf16)            # mma.sync on sm_80+
    c = atom(a_frag, b_frag, c_frag)                       # vector<8xbf16>, <4xbf16>, <4xf32>

Families register their atoms here (:func:`register_atoms`, built on the first lookup, or
:func:`register_atom`): this module registers NVIDIA
``mma.sync`` and WGMMA; :mod:`kiln.mfma` registers AMD MFMA. :func:`atom` finds the one a chip
has and raises :class:`~kiln.UnsupportedError` naming what the chip supports otherwise.
:class:`TiledMma` spreads an atom over the warps and repeats of a block tile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

from mlir import ir
from mlir.dialects import llvm, nvvm, vector

from . import layout as L, ops
from . import wgmma
from .core.dtypes import DType, bf16, dtype as as_dtype, f16, f32
from .core.errors import KilnTypeError, KilnValueError, TargetError, UnsupportedError
from .layout import ThreadValueLayout
from .nvidia.sync import current_target
from .reg_tile import RegTile
from .values import Value
from kiln.core.targets import FEATURES, TARGETS, get_target

VENDORS = ("amd", "nvidia")


@dataclass(frozen=True)
class MmaAtomSpec:
    """What one MMA instruction computes and how its operands sit in the lanes' registers.

    ``a_layout`` maps ``(lane, value)`` to ``(row, col)`` of the ``m x k`` A tile, ``b_layout``
    into the ``k x n`` B tile, ``c_layout`` into the ``m x n`` C tile; ``b_layout`` is None
    when B only comes from shared memory (WGMMA descriptors; WGMMA's ``a_layout`` is its
    register form of A). ``feature`` is the target-model feature a chip needs for it
    (``"sm80"``, ``"wgmma"``, ``"gfx9"``, ``"gfx950"``); :attr:`chips` lists those chips.

    Example::

        >>> spec = kiln.mma.atom(16, 8, 16, kiln.bf16, target="sm_80").spec
        >>> spec.c_layout(5, 2), spec.a_layout.num_values
        ((9, 2), 8)
    """
    name: str
    vendor: str
    m: int
    n: int
    k: int
    a_dtype: DType
    b_dtype: DType
    acc_dtype: DType
    threads: int
    a_layout: ThreadValueLayout | None
    b_layout: ThreadValueLayout | None
    c_layout: ThreadValueLayout
    feature: str

    @property
    def chips(self) -> tuple[str, ...]:
        """The chips whose target model has :attr:`feature`."""
        return tuple(name for name, t in TARGETS.items() if self.feature in t.features)

    def __post_init__(self):
        if self.vendor not in VENDORS:
            raise KilnValueError(f"MMA atom {self.name}: vendor must be one of {VENDORS}, "
                                 f"got {self.vendor!r}", fix='use "amd" or "nvidia"')
        if self.feature not in FEATURES:
            raise KilnValueError(f"MMA atom {self.name}: unknown target feature "
                                 f"{self.feature!r}", fix=f"use one of {', '.join(FEATURES)}")
        expected = (("a_layout", self.a_layout, (self.m, self.k)),
                    ("b_layout", self.b_layout, (self.k, self.n)),
                    ("c_layout", self.c_layout, (self.m, self.n)))
        for what, tv, tile in expected:
            if tv is None:
                continue
            if tv.tile != tile or tv.num_threads != self.threads:
                raise KilnValueError(
                    f"MMA atom {self.name}: {what} covers a {tv.tile} tile over "
                    f"{tv.num_threads} threads, expected {tile} over {self.threads}",
                    fix="build the fragment layout for this instruction's operand shape")

    def describe(self) -> str:
        """``"16x8x16 bf16*bf16->f32"``: the shape and dtypes, as error messages list them."""
        ab = (str(self.a_dtype) if self.a_dtype is self.b_dtype
              else f"{self.a_dtype}*{self.b_dtype}")
        return f"{self.m}x{self.n}x{self.k} {ab}->{self.acc_dtype}"


class MmaAtom:
    """One MMA instruction. Subclasses implement :meth:`__call__` for their family.

    ``atom(a, b, c)`` takes this lane's fragments (``kiln.Value`` vectors of
    ``a_layout.num_values`` ``a_dtype`` elements, and so on) and returns the new C fragment.
    """
    spec: MmaAtomSpec

    def __init__(self, spec: MmaAtomSpec):
        self.spec = spec

    def __call__(self, a: Any, b: Any, c: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not implement __call__")

    def __repr__(self) -> str:
        return f"kiln.mma.{type(self).__name__}({self.spec.name})"

    def check_fragments(self, a: Any, b: Any, c: Any) -> None:
        """Raise KilnTypeError unless ``a``/``b``/``c`` are vectors of the spec's dtype/width."""
        spec = self.spec
        for what, frag, dt, tv in (("A", a, spec.a_dtype, spec.a_layout),
                                   ("B", b, spec.b_dtype, spec.b_layout),
                                   ("C", c, spec.acc_dtype, spec.c_layout)):
            width = tv.num_values
            if not isinstance(frag, Value) or frag.dtype is not dt or frag.shape != (width,):
                got = repr(frag) if isinstance(frag, Value) else type(frag).__name__
                raise KilnTypeError(
                    f"{spec.name}: the {what} fragment must be a vector<{width}x{dt}>, got {got}",
                    fix=f"pass this lane's {what} fragment (e.g. from kiln.ldmatrix or a RegTile)")


_REGISTRY: dict[str, MmaAtom] = {}
# Families' atom builders not run yet: each atom validates its fragment layouts, ~50 ms of
# `import kiln` for the built-in ones, so they are built on the first lookup instead.
_PENDING: list[Callable[[], Iterable[MmaAtom]]] = []


def _checked(atom: MmaAtom) -> MmaAtom:
    if not isinstance(atom, MmaAtom) or not isinstance(getattr(atom, "spec", None), MmaAtomSpec):
        raise KilnTypeError(f"register_atom needs an MmaAtom with an MmaAtomSpec, got {atom!r}",
                            fix="subclass kiln.mma.MmaAtom and pass an instance")
    return atom


def _registry() -> dict[str, MmaAtom]:
    """Every registered atom by name, after running the pending builders in registration order."""
    while _PENDING:
        for built in _PENDING.pop(0)():
            _REGISTRY[built.spec.name] = _checked(built)
    return _REGISTRY


def register_atom(atom: MmaAtom) -> None:
    """Make ``atom`` findable by :func:`atom`/:func:`atoms_for`. Registering the same name again
    replaces the entry (module reloads); names are unique across families."""
    _registry()[_checked(atom).spec.name] = atom


def register_atoms(build: Callable[[], Iterable[MmaAtom]]) -> None:
    """Register the atoms ``build()`` returns, building them on the first lookup
    (:func:`atom`, :func:`atoms_for`, :func:`atom_named`), so importing a family stays cheap.

    Example: ``kiln.mma.register_atoms(lambda: [MyAtom(spec) for spec in my_specs()])``.
    """
    if not callable(build):
        raise KilnTypeError(f"register_atoms needs a function returning MmaAtoms, got {build!r}",
                            fix="pass the builder itself, e.g. register_atoms(build_atoms)")
    _PENDING.append(build)


def _resolve_target(target):

    return current_target() if target is None else get_target(target)


def atoms_for(target=None) -> list[MmaAtom]:
    """The registered atoms that ``target`` (a name or Target; default: the kernel's) has."""
    chip = _resolve_target(target)
    return [a for a in _registry().values() if chip.has(a.spec.feature)]


def _summary(atoms: list[MmaAtom]) -> str:
    """Atoms as ``"16x8x16 bf16->f32, 64x{8..256 step 8}x16 f16->f32"`` (N ranges collapsed)."""
    groups: dict[tuple, list[int]] = {}
    for a in atoms:
        s = a.spec
        groups.setdefault((s.m, s.k, s.a_dtype.name, s.b_dtype.name, s.acc_dtype.name),
                          []).append(s.n)
    parts = []
    for (m, k, ad, bd, cd), ns in groups.items():
        ns = sorted(set(ns))
        step = ns[1] - ns[0] if len(ns) > 2 else 0
        if step and ns == list(range(ns[0], ns[-1] + 1, step)):
            n_text = f"{{{ns[0]}..{ns[-1]} step {step}}}"
        else:
            n_text = "/".join(map(str, ns))
        ab = ad if ad == bd else f"{ad}*{bd}"
        parts.append(f"{m}x{n_text}x{k} {ab}->{cd}")
    return ", ".join(parts)


def atom(m: int, n: int, k: int, a_dtype, *, b_dtype=None, acc_dtype=f32,
         target=None) -> MmaAtom:
    """The registered atom computing ``m x n x k`` with these dtypes on ``target``.

    ``target`` defaults to the kernel being traced. Raises :class:`~kiln.TargetError` when the
    chip has no MMA atoms at all and :class:`~kiln.UnsupportedError` (listing the chip's atoms)
    when it lacks this combination.

    Example: ``kiln.mma.atom(32, 32, 16, kiln.bf16, target="gfx950")``.
    """
    chip = _resolve_target(target)
    a_dt = as_dtype(a_dtype)
    b_dt = a_dt if b_dtype is None else as_dtype(b_dtype)
    acc_dt = as_dtype(acc_dtype)
    available = atoms_for(chip)
    if not available:
        raise TargetError(f"{chip.name} has no registered MMA instructions",
                          fix="compile for a chip with tensor cores (sm_80+, gfx942, gfx950), "
                              "or import the module that registers its atoms (kiln.mfma)")
    key = (m, n, k, a_dt, b_dt, acc_dt)
    for candidate in available:
        s = candidate.spec
        if (s.m, s.n, s.k, s.a_dtype, s.b_dtype, s.acc_dtype) == key:
            return candidate
    wanted = f"{m}x{n}x{k} {a_dt if a_dt is b_dt else f'{a_dt}*{b_dt}'}->{acc_dt}"
    elsewhere = sorted({c for a in _registry().values() for c in a.spec.chips
                        if (a.spec.m, a.spec.n, a.spec.k, a.spec.a_dtype, a.spec.b_dtype,
                            a.spec.acc_dtype) == key})
    where = f" (available on {', '.join(elsewhere)})" if elsewhere else ""
    raise UnsupportedError(f"no {wanted} MMA instruction on {chip.name}{where}",
                           fix=f"use one {chip.name} supports: {_summary(available)}")


# ----------------------------------------------------------------------------- NVIDIA mma.sync



class MmaSyncAtom(MmaAtom):
    """``mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}``.

    Fragments per lane (layouts :func:`~kiln.layout.mma_m16n8k16_a`, ``_b`` and
    :func:`~kiln.layout.mma_m16n8_accumulator`): A ``vector<8xT>``, B ``vector<4xT>``,
    C ``vector<4xf32>``. Semantics: the warp computes ``C + A @ B`` for the 16x16 A and 16x8 B
    tiles its lanes hold, in f32, and each lane gets back its four C elements.

    Built as ``nvvm.mma.sync`` on 32-bit registers rather than ``nvgpu.mma.sync``: the nvgpu op
    takes 2-D fragments (``vector<4x2xT>``) whose reshapes the NVVM pipeline cannot lower, and
    its bf16 lowering emits operands ``nvvm.mma.sync`` rejects (bf16 pairs must be packed i32).
    """
    def __call__(self, a: Value, b: Value, c: Value) -> Value:
        self.check_fragments(a, b, c)
        spec = self.spec
        f32_type = f32.mlir_type()
        c_regs = [vector.extract(c.ir, [], [i]) for i in range(c.shape[0])]
        # No typed getters exist in the Python bindings for these NVVM attributes.
        ptx_type = ir.Attribute.parse(f"#nvvm.mma_type<{spec.a_dtype}>")
        shape = ir.Attribute.parse(f"#nvvm.shape<m = {spec.m}, n = {spec.n}, k = {spec.k}>")
        d = nvvm.mma_sync(llvm.StructType.get_literal([f32_type] * len(c_regs)), shape,
                          nvvm.MMALayout.row, nvvm.MMALayout.col, _registers(a), _registers(b),
                          c_regs, multiplicand_a_ptx_type=ptx_type,
                          multiplicand_b_ptx_type=ptx_type)
        result = c.ir
        for i in range(len(c_regs)):
            result = vector.insert(llvm.extractvalue(f32_type, d, [i]), result, [], [i])
        return Value(result, f32)


def _registers(frag: Value) -> list[ir.Value]:
    """A 16-bit fragment as the 32-bit registers mma.sync reads (element 2i in the low half of
    register i): ``vector<2xf16>`` pairs for f16, packed i32 for bf16."""
    count = frag.shape[0] // 2
    if frag.dtype is f16:
        return [vector.shuffle(frag.ir, frag.ir, [2 * i, 2 * i + 1]) for i in range(count)]
    packed = vector.bitcast(ir.VectorType.get([count], ir.IntegerType.get_signless(32)), frag.ir)
    return [vector.extract(packed, [], [i]) for i in range(count)]


def _mma_sync_spec(dt: DType) -> MmaAtomSpec:
    return MmaAtomSpec(name=f"mma_sync_m16n8k16_{dt}", vendor="nvidia", m=16, n=8, k=16,
                       a_dtype=dt, b_dtype=dt, acc_dtype=f32, threads=32,
                       a_layout=L.mma_m16n8k16_a(), b_layout=L.mma_m16n8k16_b(),
                       c_layout=L.mma_m16n8_accumulator(), feature="sm80")


# ----------------------------------------------------------------------------- NVIDIA WGMMA


class WgmmaAtom(MmaAtom):
    """``wgmma.mma_async.m64nNk16`` (sm_90a): :func:`kiln.wgmma.mma_async`, the one WGMMA op.

    ``atom(a, b, c)`` takes A as an i64 shared-memory descriptor or as registers
    (``vector<8 x T>`` laid out as ``spec.a_layout``, :func:`~kiln.wgmma.a_fragment_layout`), B
    as a descriptor (hence no B layout) and C as the accumulator RegTile
    (:func:`~kiln.layout.wgmma_m64_accumulator`). Keyword arguments (``a_major``,
    ``b_major``, ``accumulate``) go to :func:`kiln.wgmma.mma_async`.
    """
    def __call__(self, a, b, c, **options):
        return wgmma.mma_async(c, a, b, dtype=self.spec.a_dtype, **options)


def _wgmma_spec(dt: DType, n: int) -> MmaAtomSpec:
    return MmaAtomSpec(name=f"wgmma_m64n{n}k16_{dt}", vendor="nvidia", m=64, n=n, k=16,
                       a_dtype=dt, b_dtype=dt, acc_dtype=f32, threads=128,
                       a_layout=wgmma.a_fragment_layout(), b_layout=None,
                       c_layout=L.wgmma_m64_accumulator(n), feature="wgmma")


def atom_named(name: str) -> MmaAtom:
    """The registered atom called ``name`` (its ``spec.name``), for atoms :func:`atom` does not
    pick by shape. Example: ``kiln.mma.atom_named("mma_sync_m16n8k16_bf16")``."""
    registry = _registry()
    if name not in registry:
        family = name.split("_m")[0]
        close = [n for n in registry if n.split("_m")[0] == family][:4] or list(registry)[:4]
        raise UnsupportedError(f"no MMA atom named {name!r}",
                               fix=f"use a registered name, e.g. {', '.join(close)}")
    return registry[name]


def _nvidia_atoms() -> list[MmaAtom]:
    atoms: list[MmaAtom] = []
    for dt in (bf16, f16):
        atoms.append(MmaSyncAtom(_mma_sync_spec(dt)))
        atoms.extend(WgmmaAtom(_wgmma_spec(dt, n)) for n in range(8, wgmma.MAX_N + 1, 8))
    return atoms


register_atoms(_nvidia_atoms)


# ----------------------------------------------------------------------------- TiledMma


class TiledMma:
    """An atom spread over a ``tile_m x tile_n`` block tile, ``tile_k`` deep per step.

    ``warps_m x warps_n`` warps (wavefronts) each own a ``tile_m // warps_m`` by
    ``tile_n // warps_n`` block of C, row-major by warp index (warp ``w`` sits at
    ``(w // warps_n, w % warps_n)``); inside it the atom repeats ``rep_m x rep_n`` times, and
    ``rep_k`` times along K. :meth:`mma` issues the ``rep_m * rep_n * rep_k`` atoms.

    Example (a 64x64x32 block tile, 4 warps, mma.sync)::

        tm = kiln.mma.TiledMma(kiln.mma.atom(16, 8, 16, kiln.bf16), 2, 2, 64, 64, 32)
        acc = tm.accumulator()                       # RegTile, grid (2, 4) of 16x8 fragments
        acc = tm.mma(acc, a_frags, b_frags)          # a: grid (2, 2) of 16x16, b: (2, 4) of 16x8
    """
    def __init__(self, atom: MmaAtom, warps_m: int, warps_n: int, tile_m: int, tile_n: int,
                 tile_k: int):
        if not isinstance(atom, MmaAtom):
            raise KilnTypeError(f"TiledMma needs an MmaAtom, got {atom!r}",
                                fix="pass kiln.mma.atom(m, n, k, dtype)")
        s = atom.spec
        if s.a_layout is None or s.b_layout is None:
            raise UnsupportedError(f"TiledMma needs register operands; {s.name} reads B "
                                   "from shared memory",
                                   fix="call the WGMMA atom (or kiln.wgmma.mma_async) directly")
        for name, v in (("warps_m", warps_m), ("warps_n", warps_n), ("tile_m", tile_m),
                        ("tile_n", tile_n), ("tile_k", tile_k)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise KilnValueError(f"TiledMma {name} must be a positive int, got {v!r}",
                                     fix="use compile-time constants")
        if tile_m % (warps_m * s.m) or tile_n % (warps_n * s.n) or tile_k % s.k:
            raise KilnValueError(
                f"a {tile_m}x{tile_n}x{tile_k} tile does not split over {warps_m}x{warps_n} "
                f"warps of {s.m}x{s.n}x{s.k} atoms",
                fix=f"make tile_m a multiple of {warps_m * s.m}, tile_n of {warps_n * s.n} and "
                    f"tile_k of {s.k}")
        self.atom = atom
        self.warps_m, self.warps_n = warps_m, warps_n
        self.tile_m, self.tile_n, self.tile_k = tile_m, tile_n, tile_k
        self.warp_m, self.warp_n = tile_m // warps_m, tile_n // warps_n
        self.rep_m, self.rep_n, self.rep_k = self.warp_m // s.m, self.warp_n // s.n, tile_k // s.k

    @property
    def threads(self) -> int:
        """Threads the block needs: one atom's threads per warp."""
        return self.warps_m * self.warps_n * self.atom.spec.threads

    def warp_origin(self) -> tuple[Value, Value]:
        """``(row, col)`` of this warp's C block in the tile (traced i32)."""
        warp = ops.thread_id(0) // self.atom.spec.threads
        return (warp // self.warps_n) * self.warp_m, (warp % self.warps_n) * self.warp_n

    def accumulator(self, value: float = 0.0) -> "RegTile":
        """This warp's C block as a RegTile of ``value`` (grid ``rep_m x rep_n``)."""
        s = self.atom.spec
        return RegTile.full(s.c_layout, (self.rep_m, self.rep_n), value, s.acc_dtype)

    def mma(self, acc: "RegTile", a: "RegTile", b: "RegTile") -> "RegTile":
        """``acc + a @ b`` for this warp's blocks: ``a`` a ``rep_m x rep_k`` grid of A
        fragments (rows of the warp's C block, ``tile_k`` columns), ``b`` ``rep_k x rep_n``."""
        s = self.atom.spec
        for what, tile, layout, grid in (("acc", acc, s.c_layout, (self.rep_m, self.rep_n)),
                                         ("a", a, s.a_layout, (self.rep_m, self.rep_k)),
                                         ("b", b, s.b_layout, (self.rep_k, self.rep_n))):
            if not isinstance(tile, RegTile) or tile.layout != layout or tile.grid != grid:
                got = (f"a {tile.grid} grid" if isinstance(tile, RegTile)
                       else type(tile).__name__)
                raise KilnTypeError(f"TiledMma.mma: {what} must be a RegTile of {s.name} "
                                    f"{what if what != 'acc' else 'C'} fragments in a {grid} "
                                    f"grid, got {got}",
                                    fix="load operands with the TiledMma's layouts "
                                        "(kiln.ldmatrix / SharedTile.load_fragments)")
        frags = []
        for i in range(self.rep_m):
            for j in range(self.rep_n):
                c = acc.fragment(i, j)
                for kk in range(self.rep_k):
                    c = self.atom(a.fragment(i, kk), b.fragment(kk, j), c)
                frags.append(c)
        return RegTile(frags, s.c_layout, acc.grid)
