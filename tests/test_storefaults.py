"""How the store's failures reach users: concurrent identical builds, one
error class per kind of failure (missing, unavailable, unreachable, denied,
corrupt) in the CLI, in ``verify`` and in the daemon's log, and a push that
gives up within its deadline when the store stops answering."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from faultstore import Fault, FaultStore
from support import build
from test_builder import write_tree

from layerfs.builder.env import create_env
from layerfs.errors import VersionExists
from layerfs.registry import ENVS, LAYERS, Registry

# ------------------------------------------------ identical builds at once


def racing_refs(store) -> FaultStore:
    """``store`` where two writers of a ref meet before either writes it."""
    faulty = FaultStore(store)
    barrier = threading.Barrier(2, timeout=30)
    faulty.inject(Fault("put_if_absent", "refs/", hook=barrier.wait))
    return faulty


def build_both(store, sources: list[str]) -> list:
    """Build each source to t@1 in its own thread at once; results or errors."""
    def one(src: str):
        try:
            return build(store, src, chunk_size=16384, workers=2)
        except VersionExists as exc:
            return exc

    with ThreadPoolExecutor(len(sources)) as pool:
        return list(pool.map(one, sources))


def test_identical_builds_at_once_both_succeed(tmp_path, store):
    write_tree(tmp_path / "a", 1, files=20)
    results = build_both(racing_refs(store), [str(tmp_path / "a")] * 2)
    assert not [r for r in results if isinstance(r, Exception)], results
    assert sorted(r.published for r in results) == [False, True]
    named = Registry(store).resolve(LAYERS, "t@1")
    assert [r.digest for r in results] == [named, named]  # the loser reports the winner's layer


def test_different_builds_at_once_one_fails(tmp_path, store):
    write_tree(tmp_path / "a", 1, files=20)
    write_tree(tmp_path / "b", 2, files=20)
    results = build_both(racing_refs(store), [str(tmp_path / "a"), str(tmp_path / "b")])
    failed = [r for r in results if isinstance(r, VersionExists)]
    assert len(failed) == 1 and failed[0].exit_code == 4
    won = next(r for r in results if not isinstance(r, Exception))
    assert Registry(store).resolve(LAYERS, "t@1") == won.digest


def test_identical_env_creates_at_once_both_succeed(tmp_path, store):
    write_tree(tmp_path / "a", 1, files=4)
    build(store, str(tmp_path / "a"), name="base", chunk_size=16384)
    faulty = racing_refs(store)
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: create_env(faulty, "e", "1", ["base@1"]), range(2)))
    assert sorted(r.published for r in results) == [False, True]
    assert {r.digest for r in results} == {Registry(store).resolve(ENVS, "e@1")}
