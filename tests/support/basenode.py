"""A node daemon on a file:// store that holds layer base@1, a busybox
rootfs: the fixture of the client's tests and of the error tests that need
a daemon."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from layerfs.store import open_store
from support import build, need_root
from support.nodes import NodeDaemon, serving


def busybox_rootfs(root: Path) -> Path:
    """A busybox rootfs: sh, true and cat."""
    for sub in ("bin", "etc", "proc", "dev", "tmp"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    shutil.copy("/bin/busybox", root / "bin" / "busybox")
    for applet in ("sh", "true", "cat"):
        (root / "bin" / applet).symlink_to("busybox")
    return root


@pytest.fixture(scope="module")
def node(starts_a_server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeDaemon]:
    """A daemon on a file:// store with layer base@1 (the client does not
    depend on the store backend, which test_node covers)."""
    need_root()
    work = tmp_path_factory.mktemp("client")
    url = "file://" + str(work / "store")
    store = open_store(url, None)
    try:
        build(store, str(busybox_rootfs(work / "base")), name="base")
    finally:
        store.close()
    yield from serving(NodeDaemon(work / "node", ["--store", url], cache_size="64M"))
