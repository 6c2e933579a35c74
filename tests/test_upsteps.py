"""The order of an ``up``'s steps: its layers are fetched and checked while
its record is saved as starting, and nothing is mounted before that record
is saved; a record that cannot be saved fails the ``up`` with its own error
and nothing mounted. The layers and the rootfs mount are stand-ins that note
what was asked of them (the real mounts: tests/test_node.py)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio

from layerfs.node.replica.noderefs import NodeRefs
from layerfs.node.sandboxes import manager as sandboxes_module
from layerfs.node.sandboxes.layermounts import MountedLayer
from layerfs.node.sandboxes.manager import Sandboxes

LAYER = "sha256:" + "1" * 64
SAVE_WAIT = 5.0  # seconds a save waits for the layer's fetch to begin


@dataclass
class Steps:
    """What happened, in order, across the trio loop and the worker threads."""

    seen: list[str] = field(default_factory=list)
    fetching: threading.Event = field(default_factory=threading.Event)


class NotedReplica:
    """A replica whose first save (the record as starting) waits for the layer's
    fetch to begin; ``fail_first``: that save fails instead."""

    def __init__(self, steps: Steps, fail_first: bool = False) -> None:
        self.steps = steps
        self.fail_first = fail_first
        self.saves = 0

    def put_sandbox(self, sid: str, data: bytes) -> None:
        self.saves += 1
        if self.saves == 1:
            if self.fail_first:
                raise OSError(5, "replica write failed")
            began = self.steps.fetching.wait(SAVE_WAIT)
            self.steps.seen.append("saved" + (" (fetch under way)" if began else ""))

    def delete_sandbox(self, sid: str) -> None:
        self.steps.seen.append("deleted")


class NotedLayers:
    """Layer mounts that fetch (a note, then a wait for ``may_mount``) and mount (a note)."""

    mount_limit = None
    fetcher = SimpleNamespace(nursery=None)  # no trace replay (prefetch none)

    def __init__(self, steps: Steps) -> None:
        self.steps = steps
        self.mounted: dict[str, MountedLayer] = {}

    async def acquire(self, digest, replay=None, may_mount=None):
        self.steps.seen.append("fetching")
        self.steps.fetching.set()
        if may_mount is not None:
            await may_mount.wait()
        self.steps.seen.append("layer mounted")
        self.mounted[digest] = layer = MountedLayer(digest, None, Path("/nonexistent"))  # type: ignore[arg-type]
        return layer

    async def release(self, digest: str) -> None:
        self.steps.seen.append("layer released")

    def adopt(self, target: Path) -> bool:
        return False


def sandboxes_of(tmp_path, steps: Steps, monkeypatch, fail_first: bool = False) -> Sandboxes:
    replica = NotedReplica(steps, fail_first)
    boxes = Sandboxes(tmp_path, NodeRefs(None, replica, None),  # type: ignore[arg-type]
                      replica, NotedLayers(steps), None)  # type: ignore[arg-type]
    monkeypatch.setattr(boxes, "_resolve", lambda env, refs: ([LAYER], None, []))
    monkeypatch.setattr(sandboxes_module, "make_rootfs",
                        lambda *a, **kw: steps.seen.append("rootfs mounted"))
    monkeypatch.setattr(sandboxes_module, "remove_sandbox_dir", lambda *a: None)
    return boxes


def test_layers_are_fetched_while_the_record_is_saved_and_mounted_only_after(tmp_path,
                                                                              monkeypatch):
    steps = Steps()
    boxes = sandboxes_of(tmp_path, steps, monkeypatch)
    record = trio.run(lambda: boxes.up("s1", env="base@1", prefetch="none"))
    assert record.state == "up"
    assert steps.seen == ["fetching", "saved (fetch under way)", "layer mounted",
                          "rootfs mounted"]


def test_a_record_that_cannot_be_saved_fails_the_up_with_nothing_mounted(tmp_path,
                                                                         monkeypatch):
    steps = Steps()
    boxes = sandboxes_of(tmp_path, steps, monkeypatch, fail_first=True)
    with pytest.raises(OSError, match="replica write failed"):
        trio.run(lambda: boxes.up("s1", env="base@1", prefetch="none"))
    assert "layer mounted" not in steps.seen and "rootfs mounted" not in steps.seen
    assert "s1" not in boxes.records and steps.seen[-1] == "deleted"
