"""The daemon as a systemd service (deploy/systemd/layerfs.service, docs/deploy.md).

Four things, each a no-op outside a systemd service:

* :class:`Notifier`: the service notification protocol (``sd_notify(3)``):
  ``READY=1`` once the control socket answers and the replica is loaded,
  ``STATUS=`` with the sandbox count whenever it changes, ``STOPPING=1`` when
  the daemon starts to stop. One datagram to ``$NOTIFY_SOCKET`` each (a path,
  or ``@`` for Linux's abstract namespace), sent without blocking; a datagram
  that cannot be sent is dropped (one warning for the daemon's life), as
  libsystemd's ``sd_notify`` does. The protocol is the documented, stable one
  that systemd's own man page gives a standalone implementation of; the
  libraries for it either compile against libsystemd (systemd-python,
  cysystemd) or are not kept (sdnotify), and the daemon needs nothing else of
  libsystemd.
* :func:`report_failure`: a start that fails says why in STATUS= too.
* :func:`keeper_command`: where the FUSE keeper runs. In a service, in a
  transient scope unit of its own (``systemd-run --scope``), so that a
  ``systemctl restart`` or an upgrade, which ends every process of the
  service's cgroup, leaves the keeper and the FUSE connection it holds.
* :func:`restart_queued`: whether the SIGTERM the daemon got is the stop half
  of a restart of its unit (``systemctl restart``, ``try-restart``, a package
  upgrade's restart). Then the daemon exits as for a ``--takeover`` (nothing
  unmounted) and the next one takes the connection over from the keeper; a
  ``systemctl stop`` stops for good (everything unmounted, the keeper let go).
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import socket
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)
SYSTEMCTL_TIMEOUT = 5.0  # seconds `systemctl list-jobs` may take at a stop
CGROUP = Path("/proc/self/cgroup")
_SCOPES = itertools.count(1)  # a daemon's keepers: one scope name each
# the keeper's scope's cgroup bounds: one single-threaded process of the standard
# library holding a few descriptors (its system call filter, capability bounding
# set and no-new-privileges are the daemon's, inherited: the scope's process is
# the daemon's child)
KEEPER_LIMITS = (("TasksMax", "8"), ("MemoryMax", "128M"))


def in_service() -> bool:
    """Whether this process is (a child of) a systemd service: systemd sets
    ``$INVOCATION_ID`` for the processes of a unit it runs, and
    ``/run/systemd/system`` exists only where systemd is the init system."""
    return bool(os.environ.get("INVOCATION_ID")) and Path("/run/systemd/system").is_dir()


class Notifier:
    """Messages to the service manager; none without ``$NOTIFY_SOCKET``
    (not started by systemd, or not ``Type=notify``)."""

    def __init__(self, address: str | None = None) -> None:
        address = address if address is not None else os.environ.get("NOTIFY_SOCKET", "")
        self.address = "\0" + address[1:] if address.startswith("@") else address
        self.warned = False
        self.status: str | None = None  # the last STATUS= sent

    @property
    def enabled(self) -> bool:
        return self.address.startswith(("/", "\0"))

    def send(self, *fields: str) -> bool:
        """One datagram of ``KEY=VALUE`` lines; False if not sent."""
        if not self.enabled:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.setblocking(False)
                sock.connect(self.address)
                sock.send("\n".join(fields).encode())
            return True
        except OSError as exc:
            if not self.warned:
                self.warned = True
                log.warning("cannot notify the service manager at %s: %s",
                            self.address.replace("\0", "@"), exc)
            return False

    def ready(self, status: str) -> None:
        self.status = status
        self.send("READY=1", f"STATUS={status}")

    def set_status(self, status: str) -> None:
        """STATUS=, only when it changed since the last one sent."""
        if status != self.status:
            self.status = status
            self.send(f"STATUS={status}")

    def stopping(self, status: str) -> None:
        self.status = status
        self.send("STOPPING=1", f"STATUS={status}")


def report_failure(exc: Exception) -> None:
    """A start refused (no store named, a port taken, ROOT unsuitable) is the
    service's STATUS= too: the line ``systemctl status`` shows beside
    ``failed`` (the error itself goes on to the command's one error line)."""
    Notifier().send(f"STATUS=layerfs: error: {exc}")


def sandboxes_status(count: int, store_url: str) -> str:
    """The STATUS= line: ``serving 3 sandboxes (store s3://...)``."""
    return f"serving {count} sandbox{'' if count == 1 else 'es'} (store {store_url})"


def own_unit(cgroup_text: str) -> str | None:
    """This process's service unit, from ``/proc/self/cgroup``'s text: the
    last ``*.service`` part of the systemd hierarchy's path (``name=systemd``
    on a host with v1 cgroups, else the unified one), or None."""
    paths: dict[str, str] = {}
    for line in cgroup_text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            paths[parts[1]] = parts[2]
    path = paths.get("name=systemd", paths.get(""))
    if not path:
        return None
    units = [part for part in path.split("/") if part.endswith(".service")]
    return units[-1] if units else None


def restart_queued() -> bool:
    """Whether the service manager is restarting this process's unit (its
    job is a restart while it stops it); False outside a service, or when
    ``systemctl`` cannot say (one warning): then a SIGTERM is a stop."""
    if not in_service():
        return False
    try:
        unit = own_unit(CGROUP.read_text())
    except OSError:
        unit = None
    systemctl = shutil.which("systemctl")
    if unit is None or systemctl is None:
        log.warning("cannot tell a restart from a stop (unit %s, systemctl %s): stopping",
                    unit or "unknown", systemctl or "missing")
        return False
    try:
        proc = subprocess.run([systemctl, "list-jobs", "--no-legend", "--no-pager", unit],
                              capture_output=True, text=True, timeout=SYSTEMCTL_TIMEOUT,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("cannot tell a restart from a stop (systemctl list-jobs: %s): stopping", exc)
        return False
    if proc.returncode != 0:
        log.warning("cannot tell a restart from a stop (systemctl list-jobs: %s): stopping",
                    proc.stderr.strip() or f"exit {proc.returncode}")
        return False
    return any(job_type(line, unit) in RESTART_JOBS for line in proc.stdout.splitlines())


RESTART_JOBS = frozenset({"restart", "try-restart", "reload-or-restart"})


def job_type(line: str, unit: str) -> str | None:
    """The job type of one ``systemctl list-jobs --no-legend`` line
    (``JOB UNIT TYPE STATE``) if it is ``unit``'s."""
    fields = line.split()
    if len(fields) >= 4 and fields[1] == unit:
        return fields[2]
    return None


def keeper_command(command: list[str]) -> list[str]:
    """``command`` (the keeper's argv) run in a scope of its own when this
    daemon is a service: ``systemd-run --scope`` makes the scope with its own
    pid and then execs the command, so the keeper keeps the file descriptors
    it is started with. Ordered before the daemon's unit, so that at a
    shutdown the daemon stops first (and lets the keeper go)."""
    systemd_run = shutil.which("systemd-run")
    if not in_service() or systemd_run is None:
        return command
    try:
        unit = own_unit(CGROUP.read_text())
    except OSError:
        unit = None
    scope = f"layerfs-keeper-{os.getpid()}-{next(_SCOPES)}.scope"
    properties = [f"--property=Before={unit}"] if unit else []
    properties += [f"--property={name}={value}" for name, value in KEEPER_LIMITS]
    return [systemd_run, "--scope", "--quiet", "--collect", f"--unit={scope}",
            f"--description=layerfs FUSE keeper (of {unit or 'the layerfs daemon'})",
            *properties, "--", *command]

