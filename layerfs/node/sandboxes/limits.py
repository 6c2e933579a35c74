"""A sandbox's memory, CPU and process limits: checked at ``up`` against what
the node's cgroups can enforce, and written into a container's config.json
(``linux.resources``) for the runtime to enforce at ``run``.

runc and crun put a container's processes in cgroups of the hierarchy the
runtime sees: cgroup v2 when ``/sys/fs/cgroup`` is a cgroup2 mount, else the
v1 hierarchies mounted there (a hybrid host's ``/sys/fs/cgroup/unified`` holds
no container: :mod:`.containers.runner` runs crun without it, and runc uses v1 there).
A limit whose controller that hierarchy lacks would be ignored or refused by
the runtime, so ``up`` refuses it (:class:`~layerfs.errors.LimitUnsupported`).
"""

from __future__ import annotations

import errno
import os

from ...errors import LimitUnsupported, UsageError
from ...sizes import size_arg
from ..protocol import Limits

TYPE_CHECKING = False  # (typing is not imported at run time)
if TYPE_CHECKING:
    from typing import Any

CGROUP_ROOT = "/sys/fs/cgroup"
MOUNTINFO = "/proc/self/mountinfo"
CPU_PERIOD = 100_000  # µs: the CFS period (Docker's), quota = cpus × period
MIN_MEMORY = 4 << 20  # below this a runtime's own init does not start
MIN_DISK_QUOTA = 1 << 20
# the cgroup controller each limit needs
MAX_LIMIT = 2**63 - 1  # what an int64 in config.json holds
CONTROLLERS = {"memory": "memory", "cpus": "cpu", "pids": "pids"}
OPTIONS = {"memory": "--memory", "cpus": "--cpus", "pids": "--pids",
           "disk_quota": "--disk-quota"}


def validate(limits: Limits) -> None:
    """One usage error for a limit no sandbox could have (or no cgroup file,
    int64, and no quota ioctl, u64, could hold)."""
    for name in ("memory", "pids", "disk_quota"):
        value = getattr(limits, name)
        if value is not None and value > MAX_LIMIT:
            raise UsageError(f"{OPTIONS[name]} {value}: at most {MAX_LIMIT}")
    if limits.memory is not None and limits.memory < MIN_MEMORY:
        raise UsageError(f"--memory {limits.memory}: at least {MIN_MEMORY >> 20} MiB")
    if limits.cpus is not None:
        cpus = os.cpu_count() or 1
        if not 0.01 <= limits.cpus <= cpus:
            raise UsageError(f"--cpus {limits.cpus}: from 0.01 to {cpus} (the node's CPUs)")
    if limits.pids is not None and limits.pids < 1:
        raise UsageError(f"--pids {limits.pids}: at least 1")
    if limits.disk_quota is not None and limits.disk_quota < MIN_DISK_QUOTA:
        raise UsageError(f"--disk-quota {limits.disk_quota}: at least 1 MiB")


def check_enforceable(limits: Limits) -> None:
    """Refuse (:class:`LimitUnsupported`) a memory, CPU or process limit whose
    cgroup controller the runtimes do not find on this node."""
    available = cgroup_controllers()
    for name, controller in CONTROLLERS.items():
        if getattr(limits, name) is not None and controller not in available:
            raise LimitUnsupported(OPTIONS[name], f"no cgroup {controller} controller "
                                   f"under {CGROUP_ROOT}")


def cgroup_controllers() -> set[str]:
    """The controllers of the hierarchy a runtime puts containers in: cgroup2's
    at /sys/fs/cgroup, or the v1 hierarchies mounted below it."""
    mounts = cgroup_mounts()
    if mounts.get(CGROUP_ROOT) == "cgroup2":
        try:
            with open(os.path.join(CGROUP_ROOT, "cgroup.controllers"), encoding="ascii") as f:
                return set(f.read().split())
        except OSError:
            return set()
    found: set[str] = set()
    for point, options in mounts.items():
        if os.path.dirname(point) == CGROUP_ROOT and options != "cgroup2":
            found.update(options.split(","))
    return found


def cgroup_mounts() -> dict[str, str]:
    """Mount point → super options of each v1 cgroup mount (the controllers),
    or ``cgroup2`` for a cgroup2 mount, from this process's mountinfo."""
    found: dict[str, str] = {}
    with open(MOUNTINFO, encoding="utf-8", errors="replace") as f:
        for line in f:
            fields = line.split()
            tail = fields[fields.index("-") + 1:]
            if tail[0] == "cgroup2":
                found[fields[4]] = "cgroup2"
            elif tail[0] == "cgroup" and len(tail) >= 3:
                found[fields[4]] = tail[2]
    return found


def swap_accounted() -> bool:
    """Whether a memory limit can bound swap too (memory+swap = memory: no
    swap). cgroup v2 always accounts it; v1 only with memsw files."""
    mounts = cgroup_mounts()
    if mounts.get(CGROUP_ROOT) == "cgroup2":
        return True
    return any(os.path.exists(os.path.join(point, "memory.memsw.limit_in_bytes"))
               for point, options in mounts.items()
               if "memory" in options.split(","))


def resources(limits: Limits, swap: bool) -> dict[str, Any]:
    """The OCI ``linux.resources`` entries for ``limits`` (besides devices):
    memory (and memory+swap equal to it where ``swap`` can be bounded),
    a CFS quota of ``cpus`` periods, a pids limit."""
    out: dict[str, Any] = {}
    if limits.memory is not None:
        out["memory"] = {"limit": limits.memory}
        if swap:
            out["memory"]["swap"] = limits.memory
    if limits.cpus is not None:
        out["cpu"] = {"quota": max(1000, round(limits.cpus * CPU_PERIOD)),
                      "period": CPU_PERIOD}
    if limits.pids is not None:
        out["pids"] = {"limit": limits.pids}
    return out


def describe(limits: Limits) -> str:
    """``mem=32M cpus=0.5 pids=20 disk=10M`` (``-`` for none), for ``ps``."""
    parts = []
    if limits.memory is not None:
        parts.append(f"mem={size_arg(limits.memory)}")
    if limits.cpus is not None:
        parts.append(f"cpus={limits.cpus:g}")
    if limits.pids is not None:
        parts.append(f"pids={limits.pids}")
    if limits.disk_quota is not None:
        parts.append(f"disk={size_arg(limits.disk_quota)}")
    return " ".join(parts) or "-"


# -- a run with a memory limit: did the OOM killer end it? Its container's
# cgroup is put inside one of the run's own (RUN_CGROUPS/<container id>/container),
# which the runtime leaves when it removes the container's. cgroup2 counts the
# OOM kills of the children in the parent's memory.events; cgroup v1 counts
# them in the container's cgroup alone (memory.oom_control), gone with it, so
# there the kernel's log is read for the kill's line, which names the cgroup.
RUN_CGROUPS = "layerfs"
KMSG = "/dev/kmsg"


def run_cgroup(container_id: str) -> str:
    """The run's own cgroup (a path from each hierarchy's root)."""
    return f"/{RUN_CGROUPS}/{container_id}"


def container_cgroup(container_id: str) -> str:
    """The container's cgroup, config.json's ``linux.cgroupsPath``."""
    return run_cgroup(container_id) + "/container"


class OomWatch:
    """Whether the OOM killer ends a process of one run; made before the run
    starts, closed after it ended (its cgroups removed)."""

    def __init__(self, container_id: str) -> None:
        self.container_id = container_id
        self.unified = cgroup_mounts().get(CGROUP_ROOT) == "cgroup2"
        self.kmsg: int | None = None
        if not self.unified:  # the log from now on (root's; none: nothing is said)
            try:
                self.kmsg = os.open(KMSG, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
                os.lseek(self.kmsg, 0, os.SEEK_END)
            except OSError:
                self.close()

    def killed(self) -> bool:
        """Whether the OOM killer ended a process in the run's cgroups."""
        if self.unified:
            events = CGROUP_ROOT + run_cgroup(self.container_id) + "/memory.events"
            return oom_kill_count(events) > 0
        wanted = f"oom_memcg={container_cgroup(self.container_id)},".encode()
        while self.kmsg is not None:
            try:
                record = os.read(self.kmsg, 8192)  # one record a read
            except BlockingIOError:
                break
            except OSError as exc:  # EPIPE: records were overwritten; the next one follows
                if exc.errno == errno.EPIPE:
                    continue
                break
            if not record:
                break
            if b"oom-kill:" in record and wanted in record:
                return True
        return False

    def close(self) -> None:
        """The kernel's log closed, the run's cgroups removed from every
        hierarchy (the container's too, if the runtime left it); one still in
        use, or never made, stays as it is."""
        if self.kmsg is not None:
            os.close(self.kmsg)
            self.kmsg = None
        for point in cgroup_mounts():
            for path in (container_cgroup(self.container_id), run_cgroup(self.container_id)):
                try:
                    os.rmdir(point + path)
                except OSError:
                    pass


def oom_kill_count(path: str) -> int:
    """The ``oom_kill`` count of a memory.events file, 0 if unknown."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def memory_limit_line(memory: int, exit_code: int) -> str:
    """The line that says the OOM killer ended a process of a run at its
    memory limit: the run's own (SIGKILL: 137), or one of its children."""
    if exit_code == 128 + 9:
        return f"layerfs: run killed: memory limit {size_arg(memory)} reached (OOM kill)"
    return (f"layerfs: run: memory limit {size_arg(memory)} reached: the kernel's OOM "
            "killer ended a process of it")
