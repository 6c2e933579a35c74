"""The cgroup freezer over a sandbox's ``layerfs run`` containers: what a
suspend holds still while it commits the sandbox's upper.

A container's cgroup is found from its init process (the runtime's
``state`` names its pid; ``/proc/PID/cgroup`` its cgroups). Where the
process is in a cgroup2 hierarchy (``/sys/fs/cgroup``, or a hybrid host's
``/sys/fs/cgroup/unified``, which runc joins too) that cgroup's
``cgroup.freeze`` is set to 1 and ``cgroup.events`` read until it says
``frozen 1``: every process in it and below is stopped, none runs again
until it is thawed (fatal signals still end them). Without one, the v1
``freezer`` hierarchy: ``freezer.state`` FROZEN, until it reads FROZEN.
Worker-thread functions: they poll files.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass

from ...errors import UsageError
from ...mounts import MOUNTINFO
from .runner import Container

FREEZE_TIMEOUT = 30.0  # seconds a cgroup may take to say it is frozen
POLL = 0.002


class FreezeFailed(UsageError):
    """cannot freeze {}: {}"""


@dataclass(frozen=True)
class FrozenCgroup:
    """One container's cgroup, frozen: the directory and its hierarchy's kind."""

    container_id: str
    path: str  # the cgroup's directory
    v2: bool  # cgroup.freeze (else the v1 freezer's freezer.state)


def init_pid(container: Container) -> int | None:
    """The pid of the container's init, as its runtime reports it (None if
    it has none now)."""
    try:
        proc = subprocess.run(container.command("state", container.container_id),
                              capture_output=True, timeout=60)
        pid = json.loads(proc.stdout)["pid"] if proc.returncode == 0 else 0
    except (OSError, subprocess.TimeoutExpired, ValueError, KeyError, TypeError):
        return None
    return pid if isinstance(pid, int) and pid > 0 else None


def cgroup_of(pid: int, container_id: str) -> tuple[str, bool] | None:
    """The cgroup directory of process ``pid`` to freeze and whether it is a
    cgroup2 one; None if the process is gone or no freezer holds it. Only a
    cgroup of the container's own (its id a component of the path) is
    taken: a process the runtime left in a cgroup it inherited (crun on a
    hybrid host leaves cgroup2 alone) shares it with others, never frozen."""
    points = freezer_points()
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    paths = {}
    for line in lines:
        _, controllers, path = line.split(":", 2)
        paths[controllers or "cgroup2"] = path
    for key, v2 in (("cgroup2", True), ("freezer", False)):
        if key in paths and key in points and container_id in paths[key].split("/"):
            directory = points[key] + paths[key]
            if os.path.exists(os.path.join(directory, "cgroup.freeze" if v2 else "freezer.state")):
                return directory, v2
    return None


def freezer_points() -> dict[str, str]:
    """``cgroup2`` and ``freezer`` (the v1 hierarchy) → where each is mounted."""
    points: dict[str, str] = {}
    with open(MOUNTINFO, encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            tail = fields[fields.index("-") + 1:]
            point = fields[4].replace("\\040", " ")
            if tail[0] == "cgroup2":
                points.setdefault("cgroup2", point)
            elif tail[0] == "cgroup" and "freezer" in tail[-1].split(","):
                points.setdefault("freezer", point)
    return points


def _write(path: str, value: str) -> None:
    with open(path, "w", encoding="ascii") as f:
        f.write(value)


def _read(path: str) -> str:
    with open(path, encoding="ascii") as f:
        return f.read()


def is_frozen(cgroup: FrozenCgroup) -> bool:
    """Whether the kernel says every process of the cgroup is frozen."""
    if cgroup.v2:
        return "frozen 1" in _read(os.path.join(cgroup.path, "cgroup.events")).splitlines()
    return _read(os.path.join(cgroup.path, "freezer.state")).strip() == "FROZEN"


def freeze(cgroup: FrozenCgroup, timeout: float = FREEZE_TIMEOUT) -> None:
    """Freeze ``cgroup`` and wait until it is frozen (thawed again and
    :class:`FreezeFailed` if that takes more than ``timeout`` seconds)."""
    name = "cgroup.freeze" if cgroup.v2 else "freezer.state"
    try:
        _write(os.path.join(cgroup.path, name), "1" if cgroup.v2 else "FROZEN")
        deadline = time.monotonic() + timeout
        while not is_frozen(cgroup):
            if time.monotonic() > deadline:
                thaw(cgroup)
                raise FreezeFailed(f"container {cgroup.container_id}",
                                   f"not frozen after {timeout:g} s")
            time.sleep(POLL)
    except OSError as exc:
        raise FreezeFailed(f"container {cgroup.container_id}",
                           f"{cgroup.path}: {exc.strerror}") from None


def thaw(cgroup: FrozenCgroup) -> None:
    """Let the cgroup's processes run again (a cgroup already gone: nothing)."""
    name = "cgroup.freeze" if cgroup.v2 else "freezer.state"
    try:
        _write(os.path.join(cgroup.path, name), "0" if cgroup.v2 else "THAWED")
    except FileNotFoundError:
        pass


def freeze_all(containers: list[Container]) -> list[FrozenCgroup]:
    """Freeze each container that has a process (one that has ended since it
    was listed is skipped); the frozen cgroups. If one cannot be frozen the
    others are thawed again and :class:`FreezeFailed` raised."""
    frozen: list[FrozenCgroup] = []
    try:
        for container in containers:
            pid = init_pid(container)
            found = cgroup_of(pid, container.container_id) if pid is not None else None
            if found is None:
                if pid is not None and os.path.exists(f"/proc/{pid}"):
                    raise FreezeFailed(f"container {container.container_id}",
                                       "no freezer cgroup holds it")
                continue  # ended meanwhile
            cgroup = FrozenCgroup(container.container_id, *found)
            freeze(cgroup)
            frozen.append(cgroup)
    except BaseException:
        thaw_all(frozen)
        raise
    return frozen


def thaw_all(frozen: list[FrozenCgroup]) -> None:
    """Thaw every cgroup of ``frozen``."""
    for cgroup in frozen:
        thaw(cgroup)
