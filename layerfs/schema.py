"""Typed JSON: the one parse that turns JSON from anyone into typed records.

Used by everything layerfs reads that someone else may have written: the
manifests and the other records of the store (:mod:`layerfs.manifest`, an
expiry record in :mod:`layerfs.retention`, a pushed access trace in
:mod:`layerfs.node.reads.accesstraces`) and the control protocol's messages
(:mod:`layerfs.node.protocol`, also the sandbox records of ``replica.lmdb``).
Its input is what :func:`loads` made of the bytes; each caller turns a
:class:`SchemaError` into its own error (a manifest's
:class:`~layerfs.errors.IntegrityError`, a control message's ``BadMessage``),
and nothing else escapes.

The rules, the same for every caller:

* A record (a dataclass or a :class:`layerfs.records.Record`) is a JSON object;
  each field must have its declared type: ``str``, ``int``, ``float``,
  ``bool``, ``None``, ``list[X]``, ``dict[str, X]``, a record, ``X | Y`` (the
  first that fits; a JSON object where only one of them is a record is parsed
  as that record, and a value of one of them out of its range is refused, so
  that the error says what is wrong) or ``Any`` (any JSON value, bounded as
  below: a document a record carries whole).
* Types are exact: a bool is not an int, an int is not a float nor a float an
  int (nothing is coerced: a float field is written ``2.0``, not ``2``).
* An int is in [0, 2^63); a float is finite; inside ``Any``, an int is in
  [-2^63, 2^63).
* A string holds at most :data:`~layerfs.bounds.MAX_STRING` characters, a list
  or object at most :data:`~layerfs.bounds.MAX_ITEMS` items (an
  :class:`OverBound`, which a writer reports as over a limit); object keys
  are strings.
* A field left out takes its default; one without a default is missing.
* Unknown keys are refused, unless the caller says they are to be ignored
  (``extra=True``: a client reading a newer daemon's answers, which may carry
  fields added since; the first unknown key is named otherwise).
"""

from __future__ import annotations

import sys
import types

from . import records
from .bounds import MAX_ITEMS, MAX_STRING

TYPE_CHECKING = False  # typing is not imported at run time: a client starts faster
if TYPE_CHECKING:
    from typing import Any, TypeVar

    T = TypeVar("T")

MAX_INT = 2**63 - 1
MAX_FLOAT = 1.7976931348623157e308  # the largest finite float
MAX_SHOWN = 200  # characters of a refused value shown in a message


class SchemaError(Exception):
    """A document that does not fit its type: ``path`` names the field
    (``limits.memory``, ``layers[1]``; empty: the document), ``text`` is the
    one line saying what is wrong."""

    def __init__(self, path: str, text: str) -> None:
        super().__init__(text)
        self.path = path
        self.text = text


class OverBound(SchemaError):
    """A string, list or object over its bound (:mod:`layerfs.bounds`)."""

    def __init__(self, path: str, amount: str, limit: int) -> None:
        super().__init__(path, f"{path or 'the document'} is over the limit: {amount} "
                               f"(at most {limit})")
        self.amount = amount
        self.limit = limit


class AnyJSON:
    """What ``Any`` in a field's annotation stands for: any JSON value."""

    def __repr__(self) -> str:
        return "Any"


ANY = AnyJSON()
_FIELDS: dict[type, dict[str, tuple[Any, bool]]] = {}


def loads(data: bytes | str) -> object:
    """JSON text as Python values; text that is not JSON (or not UTF-8, or
    nested past the parser's depth) is a :class:`SchemaError`."""
    import json

    try:
        return json.loads(data)
    except (ValueError, RecursionError):  # (UnicodeDecodeError is a ValueError)
        raise SchemaError("", "not JSON") from None


def parse(cls: type[T], doc: object, extra: bool = False, path: str = "") -> T:
    """``doc`` (parsed JSON) as a record of class ``cls``, every field of its
    declared type; a :class:`SchemaError` otherwise."""
    if not isinstance(doc, dict):
        raise mismatch(path, cls, doc)
    fields = record_fields(cls)
    if not extra:
        for key in doc:
            if key not in fields:
                name = f"{path}.{key}" if path else str(key)
                raise SchemaError(path, f"unknown field {cut(name)!r}")
    values = {}
    for name, (hint, required) in fields.items():
        where = f"{path}.{name}" if path else name
        if name in doc:
            values[name] = value(hint, doc[name], where, extra)
        elif required:
            raise SchemaError(where, f"{where} is missing")
    return cls(**values)


def value(hint: Any, data: object, path: str, extra: bool = False) -> Any:
    """``data`` checked against the type ``hint`` (see the module's rules)."""
    if hint is ANY:
        check_any(data, path)
        return data
    if isinstance(hint, types.UnionType):
        return _union(hint, data, path, extra)
    origin = hint.__origin__ if isinstance(hint, types.GenericAlias) else None
    if origin is list:
        if not isinstance(data, list):
            raise mismatch(path, hint, data)
        _count(data, path)
        (item,) = hint.__args__
        return [value(item, v, f"{path}[{i}]", extra) for i, v in enumerate(data)]
    if origin is dict:
        if not isinstance(data, dict):
            raise mismatch(path, hint, data)
        _count(data, path)
        _, item = hint.__args__
        return {_key(k, path): value(item, v, f"{path}[{cut(str(k), 64)!r}]", extra)
                for k, v in data.items()}
    if is_record(hint):
        return parse(hint, data, extra, path)
    if hint is int:
        if type(data) is not int:
            raise mismatch(path, hint, data)
        if not 0 <= data <= MAX_INT:
            raise SchemaError(path, f"{path} must be an int in [0, 2^63), not {shown(data)}")
        return data
    if hint is float:
        if type(data) is not float:
            raise mismatch(path, hint, data)
        if not -MAX_FLOAT <= data <= MAX_FLOAT:  # (NaN compares false)
            raise SchemaError(path, f"{path} must be a finite float, not {data!r}")
        return data
    if hint is str:
        if type(data) is not str:
            raise mismatch(path, hint, data)
        if len(data) > MAX_STRING:
            raise OverBound(path, f"a string of {len(data)} characters", MAX_STRING)
        return data
    if hint is bool or hint is type(None):
        if type(data) is not hint:
            raise mismatch(path, hint, data)
        return data
    raise TypeError(f"no typed parse for {hint!r}")  # a schema's own mistake


def _union(hint: types.UnionType, data: object, path: str, extra: bool) -> Any:
    options = hint.__args__
    if data is None and type(None) in options:
        return None
    nested = [o for o in options if is_record(o)]
    if isinstance(data, dict) and len(nested) == 1:
        return parse(nested[0], data, extra, path)
    for option in options:
        try:
            return value(option, data, path, extra)
        except SchemaError as exc:
            if isinstance(exc, OverBound) or type(data) is option:
                raise  # of this type, but over a bound or out of range
    raise mismatch(path, hint, data)


def check_any(data: object, path: str) -> None:
    """``data`` is JSON within the bounds (strings, items, ints of 64 bits),
    however deeply nested (walked without recursion)."""
    pending = [(data, path)]
    while pending:
        item, where = pending.pop()
        if item is None or isinstance(item, bool):
            continue
        if isinstance(item, str):
            if len(item) > MAX_STRING:
                raise OverBound(where, f"a string of {len(item)} characters", MAX_STRING)
        elif isinstance(item, int):
            if not -MAX_INT - 1 <= item <= MAX_INT:
                raise SchemaError(where, f"{where} must be a 64-bit int, not {shown(item)}")
        elif isinstance(item, float):
            if not -MAX_FLOAT <= item <= MAX_FLOAT:
                raise SchemaError(where, f"{where} must be a finite float, not {item!r}")
        elif isinstance(item, list):
            _count(item, where)
            pending += [(v, f"{where}[{i}]") for i, v in enumerate(item)]
        elif isinstance(item, dict):
            _count(item, where)
            pending += [(v, f"{where}[{cut(_key(k, where), 64)!r}]") for k, v in item.items()]
        else:
            raise mismatch(where, ANY, item)


def _count(data: list | dict, path: str) -> None:
    if len(data) > MAX_ITEMS:
        raise OverBound(path, f"{len(data)} items", MAX_ITEMS)


def _key(key: object, path: str) -> str:
    if type(key) is not str:
        raise SchemaError(path, f"{path} must have string keys, not {shown(key)}")
    if len(key) > MAX_STRING:
        raise OverBound(f"{path} key", f"a string of {len(key)} characters", MAX_STRING)
    return key


def is_record(hint: object) -> bool:
    return isinstance(hint, type) and (issubclass(hint, records.Record)
                                       or "__dataclass_fields__" in hint.__dict__)


def record_fields(cls: type) -> dict[str, tuple[Any, bool]]:
    """A record class's fields: name -> (type, whether it has no default), its
    annotations evaluated once (in its module, ``Any`` as :data:`ANY`)."""
    found = _FIELDS.get(cls)
    if found is None:
        annotations: dict[str, Any] = {}
        for klass in reversed(cls.__mro__):
            annotations.update(klass.__dict__.get("__annotations__", {}))
        if issubclass(cls, records.Record):
            required = {f.name: f.required for f in records.fields(cls)}
        else:
            import dataclasses  # (a dataclass's module imported it already)

            required = {f.name: f.default is dataclasses.MISSING
                        and f.default_factory is dataclasses.MISSING
                        for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        names = {**vars(sys.modules[cls.__module__]), "Any": ANY}
        found = _FIELDS[cls] = {
            name: (eval(annotations[name], names) if isinstance(annotations[name], str)
                   else annotations[name], needed)
            for name, needed in required.items()}
    return found


def type_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint)


def mismatch(path: str, hint: Any, data: object) -> SchemaError:
    where = path or "the document"
    return SchemaError(path, f"{where} must be {type_name(hint)}, not {shown(data)}")


def shown(data: object) -> str:
    """A refused value as a message shows it: short, whatever it is (a list or
    object by its size, a huge int by its bits: neither is printed whole)."""
    if isinstance(data, str):
        return repr(cut(data))
    if isinstance(data, bool) or data is None or isinstance(data, float):
        return repr(data)
    if isinstance(data, int):
        return repr(data) if -10**30 < data < 10**30 else f"an int of {data.bit_length()} bits"
    if isinstance(data, list):
        return f"a list of {len(data)} items"
    if isinstance(data, dict):
        return f"an object of {len(data)} keys"
    return f"a {type(data).__name__}"


def cut(text: str, limit: int = MAX_SHOWN) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
