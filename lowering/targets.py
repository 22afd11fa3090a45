"""The chips Kiln compiles for, with the limits checked in Python before LLVM sees an option.

LLVM aborts the process (``report_fatal_error``) on some bad options, e.g. an unknown CPU or a
PTX version too old for the chip. Every such option is validated here and rejected with a
:class:`~kiln.errors.TargetError` instead.

Example::

    >>> t = get_target("sm_90a")
    >>> (t.vendor, t.max_shared_bytes, t.default_ptx)
    ('nvidia', 232448, 80)
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.errors import ResourceError, TargetError

# PTX ISA versions this bundled LLVM's NVPTX backend can emit (llc -mattr=help).
SUPPORTED_PTX = (70, 71, 72, 73, 74, 75, 76, 77, 78, 80, 81, 82, 83, 84, 85, 86, 87, 88, 90)


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
    has_wgmma: bool = False
    has_tma: bool = False
    ptx_only: bool = False  # no launch support here (no such GPU to test on)

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
        Target("sm_80", "nvidia", 32, 163 * 1024, min_ptx=70, default_ptx=80),
        Target("sm_90", "nvidia", 32, 227 * 1024, min_ptx=78, default_ptx=80, has_tma=True),
        Target("sm_90a", "nvidia", 32, 227 * 1024, min_ptx=80, default_ptx=80, has_wgmma=True,
               has_tma=True),
        Target("sm_100a", "nvidia", 32, 227 * 1024, min_ptx=86, default_ptx=86, has_tma=True,
               ptx_only=True),
        Target("gfx942", "amd", 64, 64 * 1024),
        Target("gfx950", "amd", 64, 160 * 1024),
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
