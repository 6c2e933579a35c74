"""Retention: removing layer and env refs, and refs that expire.

``rm`` deletes a ref (``refs/<kind>/<name>/<version>``); the blobs it reached
stay until a ``gc`` finds them unreachable (and older than its grace). A
layer an env names is refused (:class:`LayerInUse`) unless forced; an env
that cannot be read counts as one that may name it.

A ref is removed last-writer-safe: it is read, checked, then read again right
before the delete, and deleted only if it still holds the digest that was
checked. A version never changes while its ref exists, so the second read
differs only if the ref was removed and published again meanwhile (a new
publication), which is then left alone.

An expiry is recorded beside a ref, at ``expiry/<kind>/<name>/<version>``: a
small JSON object ``{"digest": ..., "expires": <unix time>}``. It is written
after the ref, so an interrupted writer leaves a ref that never expires (the
safe side), and it applies only while the ref holds that digest: a stale
expiry never removes a later publication of the same version. Refs stay one
digest line, as every reader expects.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass

from . import schema
from .errors import (
    IntegrityError,
    LayerfsError,
    LayerInUse,
    ObjectNotFound,
    RefNotFound,
    UsageError,
)
from .names import CHAIN_ENV_PREFIX, Ref
from .refstore import ENVS, LAYERS, RefEntry, RefStore, ref_key

EXPIRY_PREFIX = "expiry/"
MAX_EXPIRY_BYTES = 1024
DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)([smhdw]?)")
UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``12h``, ``7d``, ``2w`` → seconds (more than 0)."""
    match = DURATION_RE.fullmatch(text.strip())
    if not match or float(match.group(1)) <= 0:
        raise UsageError(f"invalid duration {text!r} (expected a number and s, m, h, d or w)")
    return float(match.group(1)) * UNITS[match.group(2)]


def expiry_key(kind: str, name: str, version: str) -> str:
    return f"{EXPIRY_PREFIX}{kind}/{name}/{version}"


@dataclass(frozen=True)
class Expiry(RefEntry):
    """When the ref ``name@version`` expires, while it holds ``digest``."""

    expires: float


def set_expiry(refstore: RefStore, kind: str, name: str, version: str, digest: str,
               expires: float) -> None:
    """Record that the ref, while it holds ``digest``, expires at ``expires``."""
    doc = {"digest": digest, "expires": round(float(expires), 3)}  # (a float: layerfs.schema)
    refstore.store.put(expiry_key(kind, name, version), json.dumps(doc).encode() + b"\n")


@dataclass(frozen=True)
class ExpiryRecord:
    """What an expiry record holds (its ref is its key)."""

    digest: str
    expires: float  # seconds since the epoch


def _parse_expiry(kind: str, rest: str, data: bytes) -> Expiry:
    name, _, version = rest.rpartition("/")
    what = f"expiry of {kind[:-1]} {name}@{version}"
    if len(data) > MAX_EXPIRY_BYTES:
        raise IntegrityError(what, f"{len(data)} bytes")
    try:
        Ref.parse(f"{name}@{version}")
        record = schema.parse(ExpiryRecord, schema.loads(data))
        if Ref.parse(record.digest).digest is None:
            raise ValueError(f"digest {record.digest[:80]!r}")
    except schema.SchemaError as exc:
        raise IntegrityError(what, f"not an expiry record ({exc.text})") from None
    except ValueError as exc:
        raise IntegrityError(what, f"not an expiry record ({exc})") from None
    except LayerfsError as exc:  # an invalid name, version or digest
        raise IntegrityError(what, exc.message()) from None
    return Expiry(kind, name, version, record.digest, record.expires)


def read_expiries(refstore: RefStore, kind: str) -> tuple[list[Expiry], list[str]]:
    """Every expiry of ``kind``, and the keys of those that do not parse."""
    prefix = f"{EXPIRY_PREFIX}{kind}/"
    found, bad = [], []
    for info in refstore.store.list(prefix):
        if info.size > MAX_EXPIRY_BYTES:  # (not read: it cannot be one)
            bad.append(info.key)
            continue
        try:
            found.append(_parse_expiry(kind, info.key[len(prefix):], refstore.store.get(info.key)))
        except IntegrityError:
            bad.append(info.key)
        except ObjectNotFound:
            continue  # removed meanwhile
    return found, bad


def envs_naming(refstore: RefStore, digest: str, besides: frozenset[str] = frozenset()
                ) -> list[str]:
    """The envs (``env name@version``) that name the layer manifest ``digest``,
    and those that cannot be read (they may); ``besides`` (env refs) left out."""
    rows, unreadable = refstore.read_refs(ENVS, None, refstore.env)
    users = [f"env {entry}" for entry, manifest in rows if str(entry) not in besides
             and any(layer.digest == digest for layer in manifest.layers)]
    return users + [f"{u.what} (unreadable)" for u in unreadable]


def remove_ref(refstore: RefStore, kind: str, name: str, version: str, digest: str) -> bool:
    """Delete the ref if it still holds ``digest`` (True), else leave it (False);
    then its expiry, which applied to that digest only."""
    if refstore.read_ref(kind, name, version) != digest:
        return False
    refstore.store.delete(ref_key(kind, name, version))
    refstore.store.delete(expiry_key(kind, name, version))  # (a missing key is no error)
    return True


def resolve_target(refstore: RefStore, text: str) -> RefEntry:
    """``name@version`` (a layer or an env; ``layer:`` or ``env:`` in front says
    which when both exist) → its ref."""
    kinds = [LAYERS, ENVS]
    for prefix, kind in (("layer:", LAYERS), ("env:", ENVS)):
        if text.startswith(prefix):
            text, kinds = text[len(prefix):], [kind]
    ref = Ref.parse(text)
    if ref.digest or ref.name is None or ref.version is None:
        raise UsageError(f"rm takes name@version, not a digest: {text}")
    found = [(kind, d) for kind in kinds
             if (d := refstore.read_ref(kind, ref.name, ref.version)) is not None]
    if not found:
        raise RefNotFound(" or ".join(k[:-1] for k in kinds), text)
    if len(found) > 1:
        raise UsageError(f"{text} is both a layer and an env: say layer:{text} or env:{text}")
    kind, digest = found[0]
    return RefEntry(kind, ref.name, ref.version, digest)


def remove(refstore: RefStore, texts: list[str],
           force: bool = False) -> list[tuple[RefEntry, bool]]:
    """Remove the refs ``texts`` name; envs first, so that a layer only envs
    removed here name goes too. Each layer an env still names is refused
    (before anything is removed) unless ``force``; the chain index's entries
    (``oci/chains/...``) that name a layer removed here are no users: they
    go first, with it. Each ref removed and whether it was (False: published
    again meanwhile, left alone)."""
    targets = list(dict.fromkeys(resolve_target(refstore, t) for t in texts))
    targets.sort(key=lambda t: t.kind != ENVS)
    gone_envs = frozenset(f"{t.name}@{t.version}" for t in targets if t.kind == ENVS)
    index: list[RefEntry] = []  # the chain index's entries naming a layer removed here
    for target in targets:
        if target.kind != LAYERS:
            continue
        users = envs_naming(refstore, target.digest, gone_envs)
        chains = [u for u in users if u.startswith(f"env {CHAIN_ENV_PREFIX}")]
        if not force and (others := [u for u in users if u not in chains]):
            raise LayerInUse(f"{target.name}@{target.version}", ", ".join(others))
        index += [resolve_target(refstore, "env:" + u.removeprefix("env ")) for u in chains]
    index = [entry for entry in dict.fromkeys(index) if entry not in targets]
    return [(t, remove_ref(refstore, t.kind, t.name, t.version, t.digest))
            for t in index + targets]


@dataclass
class ExpiryReport:
    """What a gc did with the expiries it found."""

    removed: list[Expiry]  # refs removed (a dry run: that would be): expired
    kept_in_use: list[str]  # expired layers an env names: kept, "<ref> (by env e@1)"
    stale: int  # expiries of refs gone or published again (their record deleted)
    unreadable: list[str]  # expiry keys that do not parse (left alone)


def expire_refs(refstore: RefStore, now: float, dry_run: bool, grace: float) -> ExpiryReport:
    """Remove each ref whose expiry has passed (envs first; a layer an env
    still names is kept), and expiries that no longer apply (older than
    ``grace``: a writer records its expiry right after its ref)."""
    report = ExpiryReport([], [], 0, [])
    for kind in (ENVS, LAYERS):
        expiries, bad = read_expiries(refstore, kind)
        report.unreadable += bad
        for exp in expiries:
            current = refstore.read_ref(kind, exp.name, exp.version)
            if current != exp.digest:
                if not dry_run and _stale_long_enough(refstore, exp, now, grace):
                    report.stale += 1
                    refstore.store.delete(expiry_key(kind, exp.name, exp.version))
                continue
            if exp.expires > now:
                continue
            gone_envs = frozenset(str(e) for e in report.removed)  # (envs are done first)
            users = envs_naming(refstore, exp.digest, gone_envs) if kind == LAYERS else []
            if users:
                report.kept_in_use.append(f"{exp} (by {', '.join(users)})")
            elif dry_run or remove_ref(refstore, kind, exp.name, exp.version, exp.digest):
                report.removed.append(exp)
    return report


def _stale_long_enough(refstore: RefStore, exp: Expiry, now: float, grace: float) -> bool:
    info = refstore.store.head(expiry_key(exp.kind, exp.name, exp.version))
    return info is not None and info.mtime < now - grace


def expires_at(seconds: float) -> float:
    """The unix time ``seconds`` from now."""
    return time.time() + seconds
