"""The chain index: an imported image's layer chains, by chain ID, as envs.

containerd names the snapshot of an image's first ``k`` layers by their
chain ID (the OCI image spec's ``ChainID``: the first diff_id, then
``sha256(<chain of k-1> + " " + <diff_id k>)``), and asks a snapshotter for a
snapshot by it (the ``containerd.io/snapshot.ref`` label of a Prepare). So
``layerfs import`` records, for every chain of the image that ends on a
layerfs layer (every layer; with ``--fold``, every group's last), the env
``oci/chains/<chain ID hex>@1`` of the layerfs layers that hold it (top
first). It is an env like any other: content-checked the same way (env
manifest → layer manifests), kept by gc while its ref is, readable without
the store once the node used it. A chain an earlier import recorded with
other layers (the same image layers folded otherwise, ``--fold``) keeps that
entry: it holds the same tree. The node trusts it no further than its
content: the diff_ids the layers' manifests record (``source``) must make
that very chain ID again (:func:`chain_layers_diff_ids`).
"""

from __future__ import annotations

import hashlib

from layerfs.errors import VersionExists
from layerfs.manifest import EnvLayer, LayerManifest
from layerfs.names import CHAIN_ENV_PREFIX, DIGEST_RE
from layerfs.refstore import ENVS, RefStore

from ..env import publish_env

CHAIN_PREFIX = CHAIN_ENV_PREFIX
CHAIN_VERSION = "1"


def chain_ids(diff_ids: list[str]) -> list[str]:
    """The chain ID of each prefix of ``diff_ids`` (bottom first)."""
    out: list[str] = []
    for diff_id in diff_ids:
        out.append(diff_id if not out else
                   "sha256:" + hashlib.sha256(f"{out[-1]} {diff_id}".encode()).hexdigest())
    return out


def chain_env(chain_id: str) -> str:
    """The env ref of a chain ID (``sha256:<hex>``): ``oci/chains/<hex>@1``."""
    if not DIGEST_RE.fullmatch(chain_id):
        raise ValueError(f"not a chain ID: {chain_id[:80]!r}")
    return f"{CHAIN_PREFIX}{chain_id.removeprefix('sha256:')}@{CHAIN_VERSION}"


def source_diff_ids(manifest: LayerManifest) -> list[str] | None:
    """The diff_ids (bottom first) a layer says it holds: ``oci:<diff_id>`` of
    an image layer, ``oci:<d1>,<d2>,...`` of a folded one; None for any other
    source (a folded one whose list was too long to keep is summarised)."""
    source = manifest.source
    if not source.startswith("oci:"):
        return None
    ids = source.removeprefix("oci:").split(",")
    return ids if all(DIGEST_RE.fullmatch(d) for d in ids) else None


def chain_of(manifests: list[LayerManifest]) -> str | None:
    """The chain ID that layers (top first) hold, from their recorded diff_ids;
    None if one of them does not say."""
    diff_ids: list[str] = []
    for manifest in reversed(manifests):
        ids = source_diff_ids(manifest)
        if ids is None:
            return None
        diff_ids += ids
    return chain_ids(diff_ids)[-1] if diff_ids else None


def record_chains(refstore: RefStore, groups: list[tuple[list[str], EnvLayer]]) -> list[str]:
    """Publish the chain env of each prefix of ``groups`` (bottom first: the
    diff_ids of a layerfs layer and that layer) that ends on a group; the
    chain IDs, bottom first. They are written bottom first, so when the top
    one is there already with these layers (an earlier import of the image),
    so are the others: nothing more is read or written."""
    every = chain_ids([d for ids, _ in groups for d in ids])
    entries: list[tuple[str, list[EnvLayer]]] = []  # (chain ID, its layers top first)
    count = 0
    for ids, layer in groups:
        count += len(ids)
        entries.append((every[count - 1], [layer, *(entries[-1][1] if entries else [])]))
    if not entries:
        return []
    top_chain, top_layers = entries[-1]
    name, _, version = chain_env(top_chain).partition("@")
    existing = refstore.read_ref(ENVS, name, version)
    if existing is None or [x.digest for x in refstore.env(existing).layers] != \
            [x.digest for x in top_layers]:
        for chain, layers in entries:
            name, _, version = chain_env(chain).partition("@")
            try:
                publish_env(refstore, name, version, layers)
            except VersionExists:
                pass  # the chain's other layers (folded otherwise): as good, kept
    return [chain for chain, _ in entries]
