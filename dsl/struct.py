"""``@kiln.struct``: small classes of traced fields that flow through ``if`` and ``kiln.range``.

Fields are declared with annotations: a dtype (``m: f32``) holds a Value of exactly that dtype
(Python literals are converted; other dtypes are a KilnTypeError), any other annotation (a
Handle, another struct) holds such an object. Methods are ordinary Python methods run at trace
time, AST-rewritten like kernels so ``if`` on traced values works inside them, and
``self.field = ...`` inside a traced ``if`` or loop updates the instance::

    @kiln.struct
    class OnlineSoftmax:
        m: f32
        l: f32

        @classmethod
        def start(cls):
            return cls(m=-float("inf"), l=0.0)

        def update(self, x):
            m_new = kiln.maximum(self.m, x)
            self.l = self.l * kiln.exp(self.m - m_new) + kiln.exp(x - m_new)
            self.m = m_new

    state = OnlineSoftmax.start()
    for k in kiln.range(0, n):
        state.update(row[k])          # state is loop-carried (two f32 iter_args)

Generic structs use a ``typing.TypeVar`` as a field annotation and are specialised by
subscripting: ``T = TypeVar("T")``, ``class Pair: a: T; b: T``, then ``Pair[kiln.f16](x, y)``
enforces f16 fields (``Pair`` itself accepts any dtype).
"""

from __future__ import annotations

import functools
from typing import Any, TypeVar

from . import ast_rewrite
from .core import dtypes as dt
from .core.errors import KilnTypeError
from .trace_runtime import flatten, unflatten
from .values import Value, constant, is_literal


def _field_kind(annotation: Any) -> Any:
    if isinstance(annotation, str):
        try:
            return dt.dtype(annotation)
        except KilnTypeError:
            return None
    if isinstance(annotation, dt.DType):
        return annotation
    return annotation if isinstance(annotation, type) else None


def _coerce(cls_name: str, field: str, kind: Any, value: Any) -> Any:
    if isinstance(kind, dt.DType):
        if is_literal(value):
            return constant(value, kind)
        if not isinstance(value, Value) or value.dtype is not kind:
            got = value.dtype if isinstance(value, Value) else type(value).__name__
            raise KilnTypeError(f"{cls_name}.{field} is declared {kind} but was given {got}",
                                fix=f"convert first, e.g. kiln.cast(value, kiln.{kind})")
        return value
    if kind is not None and not isinstance(value, kind):
        raise KilnTypeError(f"{cls_name}.{field} is declared {kind.__name__} but was given "
                            f"{type(value).__name__}", fix=f"pass a {kind.__name__}")
    return value


def _rewritten_method(fn):
    @functools.wraps(fn)
    def method(*args, **kwargs):
        return ast_rewrite.rewrite(fn)(*args, **kwargs)

    return method


def struct(cls: type) -> type:
    """Make ``cls`` a Kiln struct (see module docs). Fields come from its annotations, in order;
    a class attribute of the same name is the field's default."""
    annotations = dict(cls.__dict__.get("__annotations__", {}))
    fields = {name: _field_kind(ann) for name, ann in annotations.items()}
    defaults = dict(getattr(cls, "__kiln_defaults__", {}))
    defaults.update({name: cls.__dict__[name] for name in fields if name in cls.__dict__})
    for name in fields:
        if name in cls.__dict__:
            delattr(cls, name)
    type_params = [a for a in dict.fromkeys(annotations.values()) if isinstance(a, TypeVar)]
    for name, attr in list(cls.__dict__.items()):
        if isinstance(attr, (classmethod, staticmethod)):
            setattr(cls, name, type(attr)(_rewritten_method(attr.__func__)))
        elif callable(attr) and hasattr(attr, "__code__") and not name.startswith("__kiln"):
            setattr(cls, name, _rewritten_method(attr))

    def __init__(self, *args, **kwargs):
        if len(args) > len(fields):
            raise KilnTypeError(f"{cls.__name__} takes {len(fields)} fields, got {len(args)}",
                                fix=f"fields are {', '.join(fields)}")
        values = dict(zip(fields, args))
        for key, value in kwargs.items():
            if key in values:
                raise KilnTypeError(f"{cls.__name__} got field '{key}' twice",
                                    fix="pass each field once")
            values[key] = value
        for name in fields:
            if name not in values:
                if name not in defaults:
                    raise KilnTypeError(f"{cls.__name__} is missing field '{name}'",
                                        fix=f"pass {name}=... (fields: {', '.join(fields)})")
                values[name] = defaults[name]
        for name, value in values.items():
            setattr(self, name, value)

    def __setattr__(self, name, value):
        if name not in fields:
            raise KilnTypeError(f"{cls.__name__} has no field '{name}'",
                                fix=f"declare it in the class body, e.g. {name}: kiln.f32")
        object.__setattr__(self, name, _coerce(cls.__name__, name, fields[name], value))

    def __kiln_flatten__(self):
        leaves, specs = [], []
        for name in fields:
            sub, spec = flatten(getattr(self, name))
            leaves += sub
            specs.append((spec, len(sub)))
        return leaves, tuple(specs)

    @classmethod
    def __kiln_unflatten__(klass, aux, values):
        obj = object.__new__(klass)
        pos = 0
        for name, (spec, n) in zip(fields, aux):
            object.__setattr__(obj, name, unflatten(spec, values[pos:pos + n]))
            pos += n
        return obj

    def __kiln_assign__(self, other):
        for name in fields:
            object.__setattr__(self, name, getattr(other, name))

    def __repr__(self):
        inner = ", ".join(f"{n}={getattr(self, n, '?')!r}" for n in fields)
        return f"{cls.__name__}({inner})"

    def __class_getitem__(klass, args):
        args = args if isinstance(args, tuple) else (args,)
        if len(args) != len(type_params):
            raise KilnTypeError(f"{cls.__name__} takes {len(type_params)} type parameters "
                                f"({', '.join(map(str, type_params))}), got {len(args)}",
                                fix="give one dtype per type parameter, e.g. "
                                    f"{cls.__name__}[{', '.join('kiln.f32' for _ in type_params)}]")
        key = tuple(dt.dtype(a) if not isinstance(a, type) else a for a in args)
        if key not in specialised:
            bound = dict(zip(type_params, key))
            label = ", ".join(getattr(k, "name", None) or k.__name__ for k in key)
            name = f"{cls.__name__}[{label}]"
            specialised[key] = struct(type(name, (cls,), {
                "__annotations__": {f: bound.get(a, a) for f, a in annotations.items()},
                "__kiln_defaults__": defaults, "__module__": cls.__module__,
                "__qualname__": name}))
        return specialised[key]

    specialised: dict[tuple, type] = {}
    if type_params:
        cls.__class_getitem__ = classmethod(__class_getitem__)
    cls.__kiln_defaults__ = defaults
    cls.__init__ = __init__
    cls.__setattr__ = __setattr__
    cls.__kiln_flatten__ = __kiln_flatten__
    cls.__kiln_unflatten__ = __kiln_unflatten__
    cls.__kiln_assign__ = __kiln_assign__
    cls.__repr__ = __repr__
    cls.__kiln_fields__ = dict(fields)
    return cls

