"""Validation of store keys and list prefixes, shared by every backend.

A key is a relative ``/``-separated path: not empty, not absolute, with no
empty, ``.`` or ``..`` components and no component that looks like one of the
file store's temporary files.
"""

from __future__ import annotations

TEMP_MARK = ".tmp~"  # '~' appears in no layerfs name, version or digest


def _bad_component(part: str) -> bool:
    return part in ("", ".", "..") or part.startswith(TEMP_MARK)


def _bad_chars(text: str) -> bool:
    return "\0" in text or "\\" in text


def check_key(key: str) -> str:
    """Return ``key`` if it is a valid store key, else raise ValueError."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"invalid store key {key!r}: empty")
    if key.startswith("/") or _bad_chars(key):
        raise ValueError(f"invalid store key {key!r}: must be a relative path")
    if any(_bad_component(part) for part in key.split("/")):
        raise ValueError(f"invalid store key {key!r}: empty, '.', '..' or temporary component")
    return key


def check_prefix(prefix: str) -> str:
    """Return ``prefix`` if it can start a valid key (it may end mid-name or with '/')."""
    if prefix == "":
        return prefix
    if prefix.startswith("/") or _bad_chars(prefix):
        raise ValueError(f"invalid store prefix {prefix!r}: must be a relative path")
    whole = prefix.split("/")[:-1]  # the last part may be any start of a name
    if any(_bad_component(part) for part in whole):
        raise ValueError(f"invalid store prefix {prefix!r}: empty, '.' or '..' component")
    return prefix
