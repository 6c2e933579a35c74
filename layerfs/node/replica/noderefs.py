"""The refs an ``up`` (or a ``vm up``) names, resolved on the node: through the store when it
answers, else through the node's own last resolution.

A digest ref never needs the store once the node holds its manifest (the
registry reads manifests from the replica first). A ``name@version`` is asked
of the store; its answer is kept in the replica with the time it was given
(:meth:`Replica.keep_resolution`). When the store does not answer (a
:class:`~layerfs.errors.TransientStoreError`, or :class:`.StoreHealth` knows
it is away), the kept resolution is used and said on one line (INFO in the
daemon's log, and to the caller through :class:`.protocol.OfflineRef`); a ref
the node never resolved is :class:`~layerfs.errors.StoreUnreachable`. The
store's own answer always wins: a ref the store says does not exist is
forgotten by the node too (docs/dev/node.md: the staleness rule). A digest the
node's copy of the revocation list names (an env, one of its layers, a
layer) is :class:`~layerfs.errors.Revoked`, the store away or not.

The store is asked through ``control``, a ref store with short timeouts and
few retries, and waited for at most ``wait`` seconds (``--store-wait``:
:meth:`.StoreHealth.bounded`); a store found away meanwhile ends every such
wait at once.

Runs in worker threads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ...errors import IntegrityError, RefNotFound, Revoked, StoreUnreachable, TransientStoreError
from ...leases import Revocation
from ...names import Ref
from ...refstore import ENVS, LAYERS, RefStore
from ..protocol import OfflineRef, utc_time
from .replica import Replica
from .storehealth import DEFAULT_STORE_WAIT, StoreHealth

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class Resolved:
    """What an ``up``'s refs resolved to: layer manifest digests, top first, the
    env's image config, and the refs resolved without the store."""

    layers: list[str]
    config: dict[str, Any] | None = None
    offline: list[OfflineRef] = field(default_factory=list)


class NodeRefs:
    def __init__(self, refstore: RefStore, replica: Replica, health: StoreHealth | None,
                 control: RefStore | None = None, wait: float = DEFAULT_STORE_WAIT) -> None:
        self.refstore = refstore
        self.control = control or refstore  # refs and manifests: short timeouts
        self.replica = replica
        self.health = health
        self.wait = wait

    def up_layers(self, env: str | None, layer_refs: list[str]) -> Resolved:
        """An env ref or layer refs → the layers to mount (and the env's config)."""
        offline: list[OfflineRef] = []
        if env:
            manifest = self.refstore.env(self.resolve(ENVS, env, offline))
            for layer in manifest.layers:
                self.check_revoked(f"layer {layer.digest} of env {env}", layer.digest)
            config = manifest.config.to_json() if manifest.config else None
            return Resolved([layer.digest for layer in manifest.layers], config, offline)
        return Resolved([self.resolve(LAYERS, ref, offline) for ref in layer_refs], None, offline)

    def check_revoked(self, what: str, digest: str) -> None:
        """:class:`Revoked` if the node's copy of the revocation list names ``digest``."""
        raw = self.replica.revocation(digest)
        if raw is None:
            return
        try:
            revocation = Revocation.from_bytes(raw, f"revocation of {digest}")
            detail = f" since {utc_time(revocation.revoked)}" + (
                f" ({revocation.reason})" if revocation.reason else "")
        except IntegrityError:
            detail = ""
        log.info("refused %s: revoked%s", what, detail)
        raise Revoked(what, detail)

    def resolve(self, kind: str, text: str, offline: list[OfflineRef]) -> str:
        """``text`` → manifest digest, unless revoked on this node (see :meth:`lookup`)."""
        digest = self.lookup(kind, text, offline)
        shown = text if text == digest else f"{text} ({digest})"
        self.check_revoked(f"{kind[:-1]} {shown}", digest)
        return digest

    def lookup(self, kind: str, text: str, offline: list[OfflineRef]) -> str:
        """``text`` → manifest digest; a resolution made without the store is
        added to ``offline`` (and logged)."""
        ref = Ref.parse(text)
        if ref.digest is not None:
            if self.replica.manifest(ref.digest) is not None:  # held: no store request
                return self.control.resolve(kind, text)
            try:
                digest = self._ask(lambda: self._by_digest(kind, text))
            except TransientStoreError as exc:  # a manifest the node does not hold
                self._lost(exc)
                raise never_resolved(exc, kind, text) from exc
            return digest
        assert ref.name is not None and ref.version is not None
        kept = self.replica.resolution(kind, ref.name, ref.version)
        if kept is not None and self.health is not None and not self.health.reachable:
            return self._use(kept.digest, kept.made, text, offline, "store unreachable")
        try:
            digest, manifest = self._ask(lambda: self._by_name(kind, text))
        except RefNotFound:
            if kept is not None:
                self.replica.forget_resolution(kind, ref.name, ref.version)
            raise
        except TransientStoreError as exc:
            self._lost(exc)
            if kept is None:
                raise never_resolved(exc, kind, text) from exc
            reason = "store unreachable" if isinstance(exc, StoreUnreachable) \
                else "store unavailable"
            return self._use(kept.digest, kept.made, text, offline, reason)
        if self.health is not None:
            self.health.answered()
        self.replica.keep_resolution(kind, ref.name, ref.version, digest, time.time(), manifest)
        return digest

    def _ask(self, call: Callable[[], T]) -> T:
        """``call()``, a store request, waited for at most ``--store-wait``."""
        if self.health is None:
            return call()
        return self.health.bounded(call, self.wait)

    def _by_name(self, kind: str, text: str) -> tuple[str, bytes]:
        """The store's answer for ``text``: the manifest digest and bytes."""
        digest = self.control.resolve(kind, text)
        return digest, self.control.manifest_bytes(digest)

    def _by_digest(self, kind: str, text: str) -> str:
        """A digest ref checked (without the store if the node holds its manifest)."""
        digest = self.control.resolve(kind, text)
        if self.replica.manifest(digest) is None:
            self.replica.keep_manifest(digest, self.control.manifest_bytes(digest))
        return digest

    def remember(self, kind: str, text: str, digest: str, made: float) -> None:
        """A resolution of ``text`` the node knows without asking (a disk's
        recorded base), kept unless one is: so that it resolves while the
        store is away. Only if the node holds the manifest."""
        ref = Ref.parse(text)
        if ref.digest is not None or ref.name is None or ref.version is None:
            return
        manifest = self.replica.manifest(digest)
        if manifest is not None and self.replica.resolution(kind, ref.name, ref.version) is None:
            self.replica.keep_resolution(kind, ref.name, ref.version, digest, made, manifest)

    def _lost(self, exc: TransientStoreError) -> None:
        if self.health is not None and isinstance(exc, StoreUnreachable):
            self.health.lost(exc)

    def _use(self, digest: str, made: float, text: str, offline: list[OfflineRef],
             reason: str) -> str:
        used = OfflineRef(ref=text, digest=digest, made=made, reason=reason)
        log.info("%s", used.note())
        offline.append(used)
        return digest


def never_resolved(exc: TransientStoreError, kind: str, text: str) -> TransientStoreError:
    """The store's error for a ref this node never resolved, saying so."""
    detail = exc.message().removeprefix("store unreachable: ")
    if isinstance(exc, StoreUnreachable):
        return StoreUnreachable(f"{detail} ({kind[:-1]} {text} was never resolved on this node)")
    return exc

