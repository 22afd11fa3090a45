"""The kernel ABI shared by the front end (which builds ``gpu.func``) and lowering (which launches it).

A kernel's run-time parameters, in order, after constexprs are removed:

- :class:`TensorParam` — a global-memory tensor. In the ``gpu.func`` it is a
  ``memref<?x...x?xT, strided<[?, ..., s], offset: ?>, 1>`` (address space 1 = global); the last
  stride ``s`` is ``1`` when ``contiguous`` (a specialisation, like Triton's divisibility hints),
  else dynamic. The host passes the usual memref descriptor fields: allocated pointer, aligned
  pointer, offset, sizes[rank], strides[rank] (elements, not bytes).
- :class:`ScalarParam` — a scalar passed by value with its MLIR type.
- :class:`TensorMapParam` — a TMA tensor map (``CUtensorMap``, 128 bytes) created on the host
  from a tensor and a box; passed to the kernel as a pointer to device memory holding it. One
  with a ``source`` is *derived*: the trace added it (``kiln.copy`` through TMA on a tensor
  parameter), it follows the declared parameters, and its value is the ``source`` tensor's
  argument (:meth:`KernelSignature.expand`), so callers pass only the declared ones.

Example::

    sig = KernelSignature("saxpy", (TensorParam("x", "f32", 1), TensorParam("y", "f32", 1),
                                    ScalarParam("n", "i32"), ScalarParam("a", "f32")),
                          block=(256, 1, 1))
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class TensorParam:
    name: str
    dtype: str  # Kiln dtype name, e.g. "f32", "bf16"
    rank: int
    contiguous: bool = True  # innermost stride is statically 1

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"tensor parameter {self.name!r} needs rank >= 1, got {self.rank}")


@dataclass(frozen=True)
class ScalarParam:
    name: str
    dtype: str


@dataclass(frozen=True)
class TensorMapParam:
    """A TMA descriptor built on the host (``mgpuTensorMapEncodeTiled``) for tensor ``source``.

    ``box`` is the shared-memory box (innermost dimension last, like the tensor), ``swizzle`` one of
    0/32/64/128 bytes, ``oob_fill_nan`` False gives zero fill. ``source``: the name of the
    tensor parameter a derived map is built from (None: a declared ``kiln.TensorMap``).
    """

    name: str
    dtype: str
    rank: int
    box: tuple[int, ...]
    swizzle: int = 0
    oob_fill_nan: bool = False
    source: str | None = None


Param = TensorParam | ScalarParam | TensorMapParam


@dataclass(frozen=True)
class KernelSignature:
    """Everything lowering needs to launch a ``gpu.func``: name, parameters and block shape.

    ``dynamic_shared_bytes`` is requested at launch (static ``memref.global`` shared buffers are
    counted by the backend). ``cluster`` is the CTA cluster shape (NVIDIA sm_90+), or None.
    ``programmatic_launch``: the kernel waits on the grids before it (``griddepcontrol.wait``),
    so it may be launched while they run (NVIDIA sm_90+).
    """

    name: str
    params: tuple[Param, ...]
    block: tuple[int, int, int] = (128, 1, 1)
    dynamic_shared_bytes: int = 0
    cluster: tuple[int, int, int] | None = None
    programmatic_launch: bool = False
    constexprs: tuple[tuple[str, str], ...] = field(default=())  # (name, repr(value)) for reports

    @property
    def num_threads(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]

    @property
    def declared(self) -> int:
        """How many parameters a caller passes: all but the derived tensor maps at the end."""
        return sum(1 for p in self.params if getattr(p, "source", None) is None)

    def sources(self) -> tuple[int, ...]:
        """For each derived tensor map, the index of the declared parameter it is built from."""
        names = {p.name: i for i, p in enumerate(self.params[:self.declared])}
        return tuple(names[p.source] for p in self.params[self.declared:])

    def expand(self, args):
        """``args`` (one value per declared parameter) with the derived tensor maps' values
        appended: each is its source tensor's argument. Other lengths are returned unchanged.

        Example: ``sig.expand([a, b, c, 4])`` is ``[a, b, c, 4, a, b]`` when the trace derived
        maps of ``a`` and ``b``."""
        declared = self.declared
        if declared == len(self.params) or len(args) != declared:
            return args
        return [*args, *(args[i] for i in self.sources())]

    def to_json(self) -> dict:
        """Plain JSON data (for the compile cache); :meth:`from_json` rebuilds the signature.

        Example: ``KernelSignature.from_json(json.loads(json.dumps(sig.to_json()))) == sig``.
        """
        data = asdict(self)
        data["params"] = [{"kind": _KIND_OF[type(p)], **asdict(p)} for p in self.params]
        return data

    @classmethod
    def from_json(cls, data: dict) -> KernelSignature:
        """The signature :meth:`to_json` described; TypeError, ValueError, KeyError or
        AttributeError (a list or number where a dict belongs) if malformed."""
        params = []
        for item in data["params"]:
            fields = {name: value for name, value in item.items() if name != "kind"}
            if "box" in fields:
                fields["box"] = _ints(fields["box"])
            params.append(_PARAM_KINDS[item["kind"]](**fields))
        cluster = data.get("cluster")
        return cls(name=str(data["name"]), params=tuple(params), block=_ints(data["block"]),
                   dynamic_shared_bytes=int(data["dynamic_shared_bytes"]),
                   cluster=None if cluster is None else _ints(cluster),
                   programmatic_launch=bool(data["programmatic_launch"]),
                   constexprs=tuple((str(n), str(v)) for n, v in data["constexprs"]))


_PARAM_KINDS = {"tensor": TensorParam, "scalar": ScalarParam, "tensormap": TensorMapParam}
_KIND_OF = {cls: kind for kind, cls in _PARAM_KINDS.items()}


def _ints(values) -> tuple[int, ...]:
    if not isinstance(values, (list, tuple)) or not all(type(v) is int for v in values):
        raise TypeError(f"expected a list of ints, got {values!r}")
    return tuple(values)
