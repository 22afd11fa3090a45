"""The chips Kiln compiles for, with the limits checked in Python before LLVM sees an option.

LLVM aborts the process (``report_fatal_error``) on some bad options, e.g. an unknown CPU or a
PTX version too old for the chip. Every such option is validated here and rejected with a
:class:`~kiln.core.errors.TargetError` instead.

Example::

    >>> t = get_target("sm_90a")
    >>> (t.vendor, t.max_shared_bytes, t.default_ptx)
    ('nvidia', 232448, 80)
    >>> (t.has("wgmma"), get_target("gfx950").has("ptx"))
    (True, False)

Ops ask the one feature model below (:data:`FEATURES`) before they build IR: an NVIDIA-only
instruction compiled for AMD (or the reverse, or an sm_90 one for sm_80) otherwise reaches
LLVM, which aborts the whole process. ``target.require("sm90", "kiln.fence('cluster')")``
raises a TargetError naming the chips that have the feature.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from kiln.core.errors import KilnValueError, ResourceError, TargetError

# PTX ISA versions this bundled LLVM's NVPTX backend can emit (llc -mattr=help).
SUPPORTED_PTX = (70, 71, 72, 73, 74, 75, 76, 77, 78, 80, 81, 82, 83, 84, 85, 86, 87, 88, 90)


# Features a chip may have, each a family of instructions ops check for (``Target.require``).
FEATURES = {
    "ptx": "NVIDIA inline PTX",
    "sm80": "an NVIDIA sm_80 or newer target (cp.async, ldmatrix, mma.sync)",
    "sm90": "an NVIDIA sm_90 or newer target (clusters, mbarrier transactions, elect.sync, "
            "fence.proxy, griddepcontrol)",
    "tma": "TMA (the Tensor Memory Accelerator)",
    "wgmma": "WGMMA (warp-group MMA) and setmaxnreg (sm_90a)",
    "gfx9": "AMD GFX9 instructions (s_waitcnt, sched barriers, MFMA, buffer and LDS DMA)",
    "gfx950": "gfx950 (CDNA4) instructions",
}
_SM80 = frozenset({"ptx", "sm80"})
_SM90 = _SM80 | {"sm90", "tma"}
_GFX9 = frozenset({"gfx9"})


@dataclass(frozen=True)
class Target:
    """A GPU chip. ``vendor`` is ``"nvidia"`` or ``"amd"``; ``warp_size`` 32 or 64."""

    name: str
    vendor: str
    warp_size: int
    max_shared_bytes: int  # per block, opt-in maximum (NVIDIA) / LDS size (AMD)
    max_threads: int = 1024
    min_ptx: int = 0  # NVIDIA: oldest PTX ISA that knows this chip
    default_ptx: int = 0
    features: frozenset = frozenset()  # names from FEATURES
    # Largest register vector one load/store/pack builds: a thread's register file is 1-2 KB,
    # and LLVM aborts on vectors of 2**24 elements (and takes minutes on 65536).
    max_vector_bytes: int = 1024
    # Largest alignment a buffer or access may promise (128-byte swizzled TMA tiles need 1024;
    # LLVM asserts past 2**32).
    max_align: int = 1024
    ptx_only: bool = False  # no launch support here (no such GPU to test on)

    def __post_init__(self):
        unknown = set(self.features) - set(FEATURES)
        if unknown:
            raise TargetError(f"target {self.name}: unknown features {sorted(unknown)}",
                              fix=f"use names from {', '.join(FEATURES)}")

    def has(self, feature: str) -> bool:
        """Whether the chip has ``feature`` (a key of :data:`FEATURES`): ``t.has("tma")``."""
        if feature not in FEATURES:
            raise TargetError(f"unknown target feature {feature!r}",
                              fix=f"use one of {', '.join(FEATURES)}")
        return feature in self.features

    def require(self, feature: str, what: str) -> "Target":
        """Return self if the chip has ``feature``, else raise TargetError naming ``what`` (the
        op) and the chips that have it. Example: ``target.require("wgmma", "kiln.wgmma.mma")``."""
        if not self.has(feature):
            chips = [t.name for t in TARGETS.values() if feature in t.features]
            raise TargetError(f"{what} needs {FEATURES[feature]}; {self.name} does not have "
                              "it", fix=f"compile for {' / '.join(chips)}, or guard the call "
                                           "with a constexpr on kiln.current_target()")
        return self

    @property
    def has_wgmma(self) -> bool:
        return "wgmma" in self.features

    @property
    def has_tma(self) -> bool:
        return "tma" in self.features

    @property
    def is_nvidia(self) -> bool:
        return self.vendor == "nvidia"

    @property
    def is_amd(self) -> bool:
        return self.vendor == "amd"

    @property
    def sm(self) -> int:
        """NVIDIA compute capability as an int (``sm_90a`` -> 90)."""
        return int(self.name[3:].rstrip("af")) if self.is_nvidia else 0

    def ptx_features(self, ptx: int | None = None) -> str:
        """The ``+ptxNN`` feature string for this chip, validated."""
        version = self.default_ptx if ptx is None else ptx
        if version < self.min_ptx:
            raise TargetError(f"PTX ISA {version / 10:.1f} is too old for {self.name}",
                              fix=f"use ptx_version >= {self.min_ptx} (default {self.default_ptx})")
        if version not in SUPPORTED_PTX:
            raise TargetError(f"PTX ISA version {version} is not supported by this LLVM",
                              fix=f"use one of {', '.join(map(str, SUPPORTED_PTX))}")
        return f"+ptx{version}"

    def check_vector(self, width, itemsize: int, what: str) -> None:
        """KilnValueError unless ``width`` (a positive int) elements of ``itemsize`` bytes fit
        :attr:`max_vector_bytes`. Example: ``t.check_vector(8, 2, "x.load")``."""
        # numpy ints count (a constexpr computed with numpy), as MLIR's builders take them; a
        # traced value's __index__ raises a KilnTypeError, which is a TypeError.
        try:
            count = None if isinstance(width, bool) else operator.index(width)
        except TypeError:
            count = None
        if count is None or count < 1:
            raise KilnValueError(f"{what}: width must be a positive int, got {width!r}",
                                 fix="pass a Python int or constexpr, e.g. width=4")
        if count * itemsize > self.max_vector_bytes:
            raise KilnValueError(
                f"{what}: a vector of {width} x {itemsize}-byte elements is {width * itemsize} "
                f"bytes; one register vector holds at most {self.max_vector_bytes} on "
                f"{self.name}", fix=f"use width <= {self.max_vector_bytes // itemsize}, or "
                                    "loop over pieces")

    def check_align(self, align, what: str) -> None:
        """KilnValueError unless ``align`` is a power of two of at most :attr:`max_align` bytes.
        Example: ``t.check_align(16, "kiln.shared")``."""
        if not isinstance(align, int) or isinstance(align, bool) or align < 1 \
                or align & (align - 1) or align > self.max_align:
            raise KilnValueError(f"{what}: align={align!r} must be a power of two from 1 to "
                                 f"{self.max_align} bytes",
                                 fix="e.g. align=16 for a 16-byte vector (1024 for 128-byte "
                                     "swizzled TMA tiles)")

    def check_shared_bytes(self, nbytes: int) -> None:
        """Raise ResourceError if a block asks for more shared memory than the chip has."""
        if nbytes > self.max_shared_bytes:
            raise ResourceError(
                f"kernel uses {nbytes} bytes of shared memory; {self.name} allows at most "
                f"{self.max_shared_bytes} per block",
                fix="use smaller tiles or fewer pipeline stages")

    def check_block(self, block: tuple[int, int, int]) -> None:
        threads = block[0] * block[1] * block[2]
        if threads > self.max_threads or threads < 1:
            raise ResourceError(f"block of {threads} threads; {self.name} allows 1..{self.max_threads}",
                                fix="lower num_warps")


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("sm_80", "nvidia", 32, 163 * 1024, min_ptx=70, default_ptx=80, features=_SM80),
        Target("sm_90", "nvidia", 32, 227 * 1024, min_ptx=78, default_ptx=80, features=_SM90),
        Target("sm_90a", "nvidia", 32, 227 * 1024, min_ptx=80, default_ptx=80,
               features=_SM90 | {"wgmma"}),
        Target("sm_100a", "nvidia", 32, 227 * 1024, min_ptx=86, default_ptx=86, features=_SM90,
               ptx_only=True),
        Target("gfx942", "amd", 64, 64 * 1024, features=_GFX9),
        Target("gfx950", "amd", 64, 160 * 1024, features=_GFX9 | {"gfx950"}),
    )
}


def get_target(name: str | Target) -> Target:
    """Look up a chip by name (``"sm_90a"``, ``"gfx950"``, ...); unknown names raise TargetError."""
    if isinstance(name, Target):
        return name
    if not isinstance(name, str) or not name.strip():
        raise TargetError(f"target must be a chip name, got {name!r}",
                          fix=f"use one of {', '.join(TARGETS)}, or leave target unset for the "
                              "default")
    key = name.strip().lower()
    if key.startswith("sm") and not key.startswith("sm_"):
        key = "sm_" + key[2:]
    if key not in TARGETS:
        raise TargetError(f"unknown target {name!r}", fix=f"use one of {', '.join(TARGETS)}")
    return TARGETS[key]
