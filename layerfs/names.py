"""Names, versions and references (``name@version`` or ``sha256:<hex>``)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import InvalidName, InvalidReference, UsageError

NAME_RE = re.compile(r"[a-z0-9][a-z0-9._/-]*")
VERSION_RE = re.compile(r"[A-Za-z0-9._-]+")
DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
CHAIN_ENV_PREFIX = "oci/chains/"  # the chain index's envs (layerfs/builder/oci/chains.py)
MAX_NAME = 200
MAX_VERSION = 128
# a sandbox's, a disk's or a vm's id on a node (a vm's disk is "<vm id>-rw": the
# vm id is 3 characters shorter)
NODE_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MAX_NODE_ID = 128


def check_node_id(kind: str, ident: str | None, most: int = MAX_NODE_ID) -> str:
    """The id of a sandbox, disk or vm (``kind``), checked: the one rule the
    three share, as a directory name under ROOT."""
    if not NODE_ID_RE.fullmatch(ident or "") or len(ident or "") > most:
        longest = "" if most == MAX_NODE_ID else f", at most {most} characters"
        raise UsageError(f"invalid {kind} id {ident!r} (expected "
                         f"[A-Za-z0-9][A-Za-z0-9._-]*{longest})")
    return ident or ""


def check_name(name: str) -> str:
    bad = (
        not NAME_RE.fullmatch(name)
        or len(name) > MAX_NAME
        or "//" in name
        or name.endswith("/")
        or any(part in (".", "..") for part in name.split("/"))
    )
    if bad:
        raise InvalidName("name", name, "lowercase [a-z0-9][a-z0-9._/-]*")
    return name


def check_version(version: str) -> str:
    if not VERSION_RE.fullmatch(version) or len(version) > MAX_VERSION or version in (".", ".."):
        raise InvalidName("version", version, "[A-Za-z0-9._-]+")
    return version


def check_digest(digest: str) -> str:
    if not DIGEST_RE.fullmatch(digest):
        raise InvalidName("digest", digest, "sha256:<64 lowercase hex>")
    return digest


@dataclass(frozen=True)
class Ref:
    """A parsed reference: either name+version or a manifest digest."""

    name: str | None = None
    version: str | None = None
    digest: str | None = None

    @classmethod
    def parse(cls, text: str) -> Ref:
        if text.startswith("sha256:"):
            if not DIGEST_RE.fullmatch(text):
                raise InvalidReference(text)
            return cls(digest=text)
        name, sep, version = text.rpartition("@")
        if not sep or not name or not version:
            raise InvalidReference(text)
        return cls(name=check_name(name), version=check_version(version))

    def __str__(self) -> str:
        if self.digest:
            return self.digest
        return f"{self.name}@{self.version}"


def version_sort_key(version: str) -> tuple:
    """Natural order: ``v2 < v10``, digits compared as numbers."""
    parts = re.split(r"(\d+)", version)
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in parts if p)
