"""Compile options, validated in Python before any of them reaches LLVM.

LLVM aborts the whole process on some bad options (an unknown chip, a PTX version the chip
does not know), so every option is checked here and rejected with a
:class:`~kiln.core.errors.TargetError` or :class:`~kiln.core.errors.KilnValueError` naming the
user's line.

Example::

    >>> opts = CompileOptions("sm_90a", num_warps=8)
    >>> opts.key()
    'sm_90a/w8/O3/ptx80/r-'
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.core.errors import KilnValueError, TargetError
from kiln.core.targets import Target, get_target

MAX_NUM_WARPS = 32
MAXNREG_RANGE = (24, 255)  # ptxas accepts .maxnreg in this range


@dataclass(frozen=True)
class CompileOptions:
    """How to compile one kernel: chip, warps per block, optimisation and PTX knobs.

    ``target`` is a chip name from :data:`kiln.core.targets.TARGETS`; ``ptx_version`` None
    means the chip's default; ``maxnreg`` caps registers per thread (NVIDIA only);
    ``flush_denormals`` makes f32 arithmetic and ``exp2`` flush denormals to zero, like
    ``nvcc -ftz=true`` (NVIDIA only; pass ``kiln-flush-f32-denormals``).
    """

    target: str
    num_warps: int = 4
    opt_level: int = 3
    ptx_version: int | None = None
    maxnreg: int | None = None
    flush_denormals: bool = False

    def __post_init__(self):
        chip = get_target(self.target)  # TargetError for unknown chips
        object.__setattr__(self, "target", chip.name)  # canonical spelling ("sm90a" -> "sm_90a")
        _check_int("num_warps", self.num_warps, 1, MAX_NUM_WARPS, "use 1..32 warps, e.g. num_warps=4")
        if self.num_warps * chip.warp_size > chip.max_threads:
            raise KilnValueError(
                f"num_warps={self.num_warps} gives {self.num_warps * chip.warp_size} threads per "
                f"block; {chip.name} (warp size {chip.warp_size}) allows at most {chip.max_threads}",
                fix=f"use num_warps <= {chip.max_threads // chip.warp_size}")
        _check_int("opt_level", self.opt_level, 0, 3, "use opt_level 0, 1, 2 or 3")
        if not isinstance(self.flush_denormals, bool):
            raise KilnValueError(f"flush_denormals must be a bool, got {self.flush_denormals!r}",
                                 fix="use flush_denormals=True or False")
        if chip.is_amd:
            if self.flush_denormals:
                raise TargetError(f"flush_denormals is an NVIDIA option; {chip.name} is an AMD "
                                  "chip", fix="drop flush_denormals=True for AMD targets")
            for name in ("ptx_version", "maxnreg"):
                if getattr(self, name) is not None:
                    raise TargetError(f"{name} is an NVIDIA option; {chip.name} is an AMD chip",
                                      fix=f"drop {name}=... for AMD targets")
        else:
            if self.ptx_version is not None:
                _check_int("ptx_version", self.ptx_version, 0, 10**3, "use e.g. ptx_version=80")
            chip.ptx_features(self.ptx_version)  # TargetError when too old or unsupported
        if self.maxnreg is not None:
            _check_int("maxnreg", self.maxnreg, *MAXNREG_RANGE,
                       f"use maxnreg in {MAXNREG_RANGE[0]}..{MAXNREG_RANGE[1]}, or None for no cap")

    @property
    def chip(self) -> Target:
        """The validated :class:`~kiln.core.targets.Target`."""
        return get_target(self.target)

    @property
    def block_size(self) -> int:
        """Threads per block: ``num_warps * warp_size``."""
        return self.num_warps * self.chip.warp_size

    def ptx_features(self) -> str:
        """The ``+ptxNN`` feature string (NVIDIA), e.g. ``"+ptx80"``."""
        return self.chip.ptx_features(self.ptx_version)

    def key(self) -> str:
        """A stable string naming these options, for the compile-cache key."""
        ptx = f"ptx{self.ptx_version or self.chip.default_ptx}" if self.chip.is_nvidia else "ptx-"
        reg = f"r{self.maxnreg}" if self.maxnreg is not None else "r-"
        ftz = "/ftz" if self.flush_denormals else ""
        return f"{self.target}/w{self.num_warps}/O{self.opt_level}/{ptx}/{reg}{ftz}"


def _check_int(name: str, value, low: int, high: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise KilnValueError(f"{name} must be an int, got {value!r}", fix=fix)
    if not low <= value <= high:
        raise KilnValueError(f"{name}={value} is out of range {low}..{high}", fix=fix)
