"""``Partials``: the typed contract between a split-KV producer and the LSE-merge combine.

A producer (split-KV decode, block-sparse/MSA decode) writes, for every query row ``(b, q, h)``,
``C = split_counts[b, q, h]`` partial results: ``O_partial[s, b, q, h, :]`` (that split's
softmax-weighted values, already divided by its own denominator) and ``LSE_partial[s, b, q,
h]`` (the log of that denominator). How those arrays are to be read is not visible in their
shapes, so a producer declares it::

    DECODE_PARTIALS = Partials(producer="kiln.kernels.attention.decode", max_splits=64)

and the consumer checks it when it compiles (``combine(..., partials=DECODE_PARTIALS)`` or
``partials=<an object with a .partials attribute>``). A disagreement -- a permuted head
dimension, a base-2 LSE read as natural log, more splits than the combine was sized for --
is a :class:`PartialsMismatchError` naming both sides instead of a wrong answer.

Fields (the defaults are what ``combine`` reads):

================  ============================================================================
``layout``        axis order of ``O_partial``; ``LSE_partial`` is the same without ``"d"``.
                  Only split-major ``("split", "b", "q", "h", "d")`` is defined.
``depth_order``   ``"natural"``: column ``d`` of O holds head-dim element ``d``; ``"stg128"``:
                  the permutation an MMA accumulator leaves when each thread stores its
                  registers as 16-byte vectors (``real_to_fake`` below; the MSA seed's order).
``log_base``      ``"e"`` (natural log, the default) or ``"2"``.
``empty_split``   ``"lse_neg_inf_o_zero"``: a slot ``s < C`` that saw no key has LSE ``-inf``
                  and a finite O (zeros); slots ``s >= C`` are never read (any contents).
``dtype``         dtype of ``O_partial`` (LSE is always f32, counts int32).
``max_splits``    the most slots any row may use (the consumer's compile-time sizing).
================  ============================================================================

The ``stg128`` depth order. An MMA accumulator (``mma.sync`` m16n8, WGMMA m64nN) gives the
thread of quad lane ``t`` the column pair ``2t, 2t + 1`` of every 8-column block. A producer
that stores those registers straight out as 16-byte vectors of ``V = 16 / itemsize`` values
(``V / 2`` pairs from ``V / 2`` consecutive blocks) puts natural ("real") column ``r`` at stored
("fake") column ``real_to_fake(r, V)``, a permutation inside each ``4 V``-column group::

    real_to_fake(r) = r - r % 4V + V * (r % 8 // 2) + 2 * (r % 4V // 8) + r % 2
    fake_to_real(f) = f - f % 4V + 8 * (f % V // 2) + 2 * (f % 4V // V) + f % 2

(f32 partials: V = 4, groups of 16 columns; bf16: V = 8, groups of 32). ``combine`` reads such
partials pair by pair at their fake columns and writes ``O`` in natural order.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import kiln

SPLIT_MAJOR = ("split", "b", "q", "h", "d")
NATURAL_DEPTH = "natural"
STG128_DEPTH = "stg128"
DEPTH_ORDERS = (NATURAL_DEPTH, STG128_DEPTH)
STG128_BYTES = 16
NEG_INF_ZERO = "lse_neg_inf_o_zero"
LOG_BASES = ("e", "2")


class PartialsMismatchError(kiln.KilnValueError):
    """A producer's :class:`Partials` and its consumer disagree (the message names both)."""


@dataclass(frozen=True)
class Partials:
    """How a split-KV producer's partial outputs are laid out and encoded (module docs).

    Example::

        produced = Partials(producer="decode", max_splits=16, log_base="2")
        produced.check_consumer(Partials(producer="combine", max_splits=32, log_base="2"))
    """

    producer: str
    max_splits: int
    dtype: kiln.DType = kiln.f32
    layout: tuple[str, ...] = SPLIT_MAJOR
    depth_order: str = NATURAL_DEPTH
    log_base: str = "e"
    empty_split: str = NEG_INF_ZERO

    def __post_init__(self):
        if not isinstance(self.max_splits, int) or self.max_splits < 1:
            raise kiln.KilnValueError(f"Partials.max_splits must be a positive int, got "
                                      f"{self.max_splits!r}", fix="e.g. max_splits=32")
        if self.log_base not in LOG_BASES:
            raise kiln.KilnValueError(f"Partials.log_base must be 'e' or '2', got "
                                      f"{self.log_base!r}", fix="log_base='e' for natural-log LSE")
        object.__setattr__(self, "dtype", kiln.dtype(self.dtype))
        object.__setattr__(self, "layout", tuple(self.layout))

    def check_consumer(self, consumer: "Partials") -> None:
        """Raise :class:`PartialsMismatchError` unless ``consumer`` reads exactly what this
        producer writes (``max_splits``: the consumer must be sized for at least as many)."""
        problems = [f"{f.name}: {self.producer} writes {getattr(self, f.name)!r}, "
                    f"{consumer.producer} reads {getattr(consumer, f.name)!r}"
                    for f in dataclasses.fields(self)
                    if f.name not in ("producer", "max_splits")
                    and getattr(self, f.name) != getattr(consumer, f.name)]
        if self.max_splits > consumer.max_splits:
            problems.append(f"max_splits: {self.producer} may write {self.max_splits} splits, "
                            f"{consumer.producer} is sized for {consumer.max_splits}")
        if problems:
            raise PartialsMismatchError(
                f"partials of {self.producer} do not match {consumer.producer}: "
                + "; ".join(problems),
                fix=f"make {self.producer} and {consumer.producer} agree (e.g. pass "
                    f"max_splits={max(self.max_splits, consumer.max_splits)})")


def partials_of(obj: Any) -> Partials | None:
    """``obj`` if it is a :class:`Partials`, ``obj.partials`` if it carries one, None for None."""
    if obj is None or isinstance(obj, Partials):
        return obj
    found = getattr(obj, "partials", None)
    if isinstance(found, Partials):
        return found
    raise kiln.KilnTypeError(f"expected a Partials or an object with a .partials attribute, got "
                             f"{type(obj).__name__}",
                             fix="pass the producer's declared Partials, e.g. "
                                 "partials=DECODE_PARTIALS")


def stg128_vector(dtype) -> int:
    """Values per 16-byte store of ``dtype``: the ``V`` of the ``stg128`` order.
    Example: ``stg128_vector(kiln.f32) == 4``."""
    return STG128_BYTES // kiln.dtype(dtype).itemsize


def real_to_fake(r, vector: int):
    """The stored column of natural depth ``r`` in the ``stg128`` order of ``vector``-value
    stores (module docs); ints or traced i32 alike. Example: ``real_to_fake(8, 4) == 2``."""
    group = 4 * vector
    return r - r % group + vector * (r % 8 // 2) + 2 * (r % group // 8) + r % 2


def fake_to_real(f, vector: int):
    """The natural depth stored at column ``f`` (inverse of :func:`real_to_fake`).
    Example: ``fake_to_real(2, 4) == 8``."""
    group = 4 * vector
    return f - f % group + 8 * (f % vector // 2) + 2 * (f % group // vector) + f % 2
