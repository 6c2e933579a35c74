"""Two small layers and an env in a test's store, and a node daemon over
that store: the fixtures of the tests of what a node trusts in a store
(test_remotetrust, test_metacheck)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from layerfs.builder.env import create_env
from layerfs.refstore import RefStore
from layerfs.store.base import Store
from support import build, need_root
from support.nodes import NodeDaemon, serving


def small_tree(root: Path, text: str) -> str:
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "who").write_text(text)
    (root / "big").write_bytes(random.Random(text).randbytes(200_000))
    return str(root)


@pytest.fixture
def two_layers(tmp_path: Path, store: Store) -> tuple[str, str]:
    """Layers a@1 and b@1 (different trees) and env e@1 = [a@1]; their digests."""
    a = build(store, small_tree(tmp_path / "a", "a"), name="a", chunk_size=65536)
    b = build(store, small_tree(tmp_path / "b", "b"), name="b", chunk_size=65536)
    create_env(RefStore(store), "e", "1", ["a@1"])
    return a.digest, b.digest


@pytest.fixture
def node(starts_a_server,
         tmp_path: Path, store: Store, store_location, two_layers) -> Iterator[NodeDaemon]:
    need_root()
    yield from serving(NodeDaemon(tmp_path / "node", store_location.cli_args(), cache_size="64M"))
