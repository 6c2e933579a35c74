"""Environments: an ordered list of layer references (top first), versioned."""

from __future__ import annotations

from dataclasses import dataclass

from layerfs.errors import TooManyLayers, UsageError, VersionExists
from layerfs.manifest import EnvLayer, EnvManifest, ImageConfig
from layerfs.mounts import MAX_LOWER_LAYERS
from layerfs.names import check_name, check_version
from layerfs.refstore import ENVS, LAYERS, RefStore

from .layer import now_utc


def check_layer_count(what: str, distinct: int) -> None:
    """TooManyLayers if ``distinct`` layers are more than one overlay can stack
    (a sandbox mounts a layer listed twice once)."""
    if distinct > MAX_LOWER_LAYERS:
        raise TooManyLayers(what, distinct, MAX_LOWER_LAYERS)


@dataclass
class EnvResult:
    ref: str
    digest: str
    manifest: EnvManifest
    published: bool


def create_env(refstore: RefStore, name: str, version: str, layer_refs: list[str],
               config: ImageConfig | None = None, on: str | None = None) -> EnvResult:
    """Publish env ``name@version`` of ``layer_refs`` (top first), with an image
    config, in ``refstore``'s store (the caller's ref store, one per command). With
    ``on`` (an env ref), the layers go on top of that env's layers and the new
    env keeps its image config unless ``config`` is given."""
    check_name(name)
    check_version(version)
    if not layer_refs:
        raise UsageError("an env needs at least one --layer")
    layers = [EnvLayer(ref, refstore.resolve(LAYERS, ref)) for ref in layer_refs]
    for layer in layers:
        refstore.layer(layer.digest)  # must be a readable layer manifest
    if on is not None:
        below = refstore.env(refstore.resolve(ENVS, on))
        layers += below.layers
        config = config if config is not None else below.config
    return publish_env(refstore, name, version, layers, config)


def publish_env(refstore: RefStore, name: str, version: str, layers: list[EnvLayer],
                config: ImageConfig | None = None) -> EnvResult:
    """Publish env ``name@version`` of ``layers`` (top first, resolved and read
    by the caller): an existing one of the same content is kept, one of other
    content is :class:`VersionExists`."""
    ref = f"{name}@{version}"
    check_layer_count(f"env {ref}", len({layer.digest for layer in layers}))
    manifest = EnvManifest(name=name, version=version, layers=layers, created=now_utc(),
                           config=config)
    existing = refstore.read_ref(ENVS, name, version)
    if existing is not None:
        old = refstore.env(existing)
        if old.content_key() != manifest.content_key():
            raise VersionExists(ref)
        return EnvResult(ref, existing, old, published=False)
    digest, _ = refstore.store.put_blob(manifest.checked_bytes())
    key = manifest.content_key()
    if not refstore.publish(ENVS, name, version, digest,
                       same=lambda other: refstore.env(other).content_key() == key):
        winner = refstore.read_ref(ENVS, name, version) or digest  # a concurrent create won
        return EnvResult(ref, winner, refstore.env(winner), published=False)
    return EnvResult(ref, digest, manifest, published=True)
