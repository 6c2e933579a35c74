"""The one publish recipe of layers and sealed disks (both are ``layers/`` refs).

A version is immutable, and its content (not its manifest's bytes, which hold
the creation time and upload counts) says whether two pushes are the same:

1. :func:`existing_version`: if ``name@version`` exists, the push compares
   content without uploading: the same is a success that writes nothing,
   other content is :class:`VersionExists`;
2. the caller uploads its blobs and its manifest;
3. :func:`publish_verified` writes the ref once. A concurrent push of the same
   content that got there first is a success too (the loser reports the
   winner's manifest); then every blob this push reused, or holds, is checked
   to have survived a concurrent gc.

``same`` is the kind's comparison: given a manifest's digest, whether it has
this push's content (:func:`layerfs.builder.layer.build_layer`,
:func:`layerfs.builder.disk.publish_disk`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from layerfs.errors import BlobVanished, VersionExists
from layerfs.refstore import LAYERS, RefStore, ref_key
from layerfs.store.base import blob_key

VERIFY_WORKERS = 8
Same = Callable[[str], bool]  # a manifest's digest -> whether it has this content


def existing_version(ref: str, existing: str | None, same: Same) -> bool:
    """Step 1: True if ``existing`` (the digest ``ref`` names, if any) has this
    content: nothing to publish. False if there is none. Other content:
    :class:`VersionExists`."""
    if existing is None:
        return False
    if not same(existing):
        raise VersionExists(ref)
    return True


def publish_verified(refstore: RefStore, name: str, version: str, digest: str,
                     reused: set[str], held: dict[str, bytes], same: Same) -> tuple[str, bool]:
    """Step 3: write the ref, then check that the blobs a concurrent gc could
    have taken meanwhile are still there: the packs this push reused and the
    blobs it holds (``held``: digest → bytes; written again if gone). A reused
    pack that is gone takes the ref back (if this call wrote it) and fails the
    push. Returns the digest the ref names and whether this call wrote it; the
    digest is ``digest`` or that of another push's manifest that got there
    first and that ``same`` accepts (that push checks its own blobs)."""
    created = refstore.publish(LAYERS, name, version, digest, same)
    if not created:
        winner = refstore.read_ref(LAYERS, name, version)
        if winner is not None and winner != digest:
            return winner, False
    digests = sorted(reused | held.keys())
    with ThreadPoolExecutor(VERIFY_WORKERS, thread_name_prefix="verify") as pool:
        present = list(pool.map(lambda d: refstore.store.exists(blob_key(d)), digests))
    missing = [d for d, ok in zip(digests, present, strict=True) if not ok]
    lost = [d for d in missing if d not in held]
    for d in missing:
        if d in held:
            refstore.store.put_blob(held[d], d)
    if lost:
        if created:
            refstore.store.delete(ref_key(LAYERS, name, version))
        raise BlobVanished(f"pack {lost[0]}", f"{name}@{version} was published")
    return digest, created
