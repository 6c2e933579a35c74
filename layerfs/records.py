"""Typed records that cost nothing to define: the base of the control
protocol's messages (:mod:`layerfs.node.protocol`) and an image's config
(:mod:`layerfs.imageconfig`).

A subclass of :class:`Record` declares its fields as annotations, with
defaults and :func:`field` ``(default_factory=...)`` as a dataclass does, and
mypy checks it as one (``dataclass_transform``). Unlike ``@dataclass``, which
generates and compiles an ``__init__``, ``__repr__`` and ``__eq__`` for every
class (most of a node command's import time), a record's fields are collected
once from the class's annotations and one shared ``__init__``, ``__eq__`` and
``__repr__`` serve every class. Instances keep their fields in ``__dict__``, so
``vars(record)`` is the record's fields.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing itself is not imported: a client starts faster
if TYPE_CHECKING:
    from typing import Any, ClassVar, dataclass_transform
else:
    def dataclass_transform(**_: Any) -> Any:
        return lambda cls: cls

MISSING: Any = object()  # a field without a default


class Field:
    """A field's declaration: its name and default (or the factory that makes it)."""

    __slots__ = ("name", "default", "default_factory")

    def __init__(self, name: str = "", default: Any = MISSING,
                 default_factory: Any = MISSING) -> None:
        self.name = name
        self.default = default
        self.default_factory = default_factory

    @property
    def required(self) -> bool:
        return self.default is MISSING and self.default_factory is MISSING


def field(*, default: Any = MISSING, default_factory: Any = MISSING) -> Any:
    """A field's default made by ``default_factory()`` for each record (a list, a dict)."""
    return Field(default=default, default_factory=default_factory)


@dataclass_transform(field_specifiers=(field,))
class Record:
    """A typed record: ``Cls(field=value, ...)`` or positionally in field order."""

    __record_fields__: ClassVar[tuple[Field, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        fields = {f.name: f for f in cls.__record_fields__}
        for name, annotation in cls.__dict__.get("__annotations__", {}).items():
            if str(annotation).startswith(("ClassVar", "typing.ClassVar")):
                continue
            declared = cls.__dict__.get(name, MISSING)
            if isinstance(declared, Field):
                declared.name = name
                delattr(cls, name)
                fields[name] = declared
            else:
                fields[name] = Field(name, default=declared)
        cls.__record_fields__ = tuple(fields.values())

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        fields = self.__record_fields__
        if len(args) > len(fields):
            raise TypeError(f"{type(self).__name__}: {len(args)} positional arguments, "
                            f"at most {len(fields)}")
        values = dict(zip((f.name for f in fields[:len(args)]), args, strict=True))
        for name in kwargs:
            if name in values:
                raise TypeError(f"{type(self).__name__}: {name} given twice")
        values.update(kwargs)
        for f in fields:
            if f.name in values:
                continue
            if f.default_factory is not MISSING:
                values[f.name] = f.default_factory()
            elif f.default is not MISSING:
                values[f.name] = f.default
            else:
                raise TypeError(f"{type(self).__name__}: missing field {f.name!r}")
        if len(values) > len(fields):
            names = {f.name for f in fields}
            unknown = sorted(n for n in values if n not in names)
            raise TypeError(f"{type(self).__name__}: unknown field {unknown[0]!r}")
        self.__dict__.update(values)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(getattr(self, f.name) == getattr(other, f.name)
                   for f in self.__record_fields__)

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value

    def __repr__(self) -> str:
        inner = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in self.__record_fields__)
        return f"{type(self).__name__}({inner})"


def fields(record: Record | type[Record]) -> tuple[Field, ...]:
    """A record's (or record class's) fields, in declaration order."""
    return record.__record_fields__
