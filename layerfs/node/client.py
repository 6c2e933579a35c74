"""The Python API of a node: :class:`Client` drives the daemon at a node's root
over its control socket, the same calls the CLI's node commands make.

Requests and answers are the typed records of :mod:`.protocol`; a daemon that
refuses a request raises :class:`~.control.RemoteError` (its message and exit
code) that is also the daemon's error class (:func:`.control.remote_error`:
``SandboxNotFound``, ``SandboxBusy``, ``RefNotFound`` ...), one that is not
running :class:`~.control.DaemonNotRunning`, all
:class:`~layerfs.errors.LayerfsError`. The module imports only the standard
library, the records and the socket client, so that a command starts fast; what
``run`` and ``up --bundle`` need (the OCI bundle writer, the runtime runner) is
imported when they are called.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from ..errors import SandboxNotFound, SandboxNotUp, UsageError
from . import protocol
from .control import DEFAULT_ROOT, call
from .protocol import (
    CommitAnswer,
    PingAnswer,
    SandboxRecord,
    SandboxStatus,
    StatsAnswer,
    SuspendAnswer,
    TracePushAnswer,
    VmRecord,
)

TYPE_CHECKING = False  # (typing is not imported at run time)
if TYPE_CHECKING:
    from typing import Any

    from .containers.runner import Container, RunResult
    from .sandboxes.limits import OomWatch


class Client:
    """The node whose daemon serves ``root``; each call is one control request
    (``timeout`` seconds at most, None: no bound). ``read_ahead``: a ``run``
    reads the first page of the programs its command will exec while the
    runtime starts (:mod:`.containers.programahead`)."""

    def __init__(self, root: str | os.PathLike[str] = DEFAULT_ROOT,
                 timeout: float | None = None, read_ahead: bool = True) -> None:
        self.root = os.fspath(root)
        self.timeout = timeout
        self.read_ahead = read_ahead

    def ping(self) -> PingAnswer:
        """The daemon's root, store URL and pid."""
        return call(self.root, protocol.Ping(), PingAnswer, self.timeout)

    def up(self, sandbox_id: str, env: str | None = None, layers: Sequence[str] = (),
           prefetch: str = "auto", bundle_dir: str | None = None, *,
           memory: int | None = None, cpus: float | None = None, pids: int | None = None,
           disk_quota: int | None = None) -> SandboxRecord:
        """Bring up a sandbox of env ``env`` (a ref) or of ``layers`` (refs, top
        first); ``prefetch`` as ``layerfs up --prefetch`` (auto: replay a
        layer's pushed trace, if it has one). Limits (None: none): ``memory``
        in bytes (swap included), ``cpus`` (CPU time, 0.5: half of one),
        ``pids`` (processes and threads), enforced in every ``run`` and
        ``bundle_dir`` bundle, and ``disk_quota``, the bytes its writable
        layer may hold (a btrfs qgroup or an ext4 image: docs/dev/node.md); a
        limit the node cannot enforce is refused (:class:`~layerfs.errors.LimitUnsupported`, exit
        17). With ``bundle_dir``, also write an
        OCI runtime bundle for it there (``runc run -b DIR ID``), or take it
        down again if that fails. A bundle directory another user could change
        (:func:`.containers.bundle.open_bundle_dir`) is refused before anything is up."""
        if bool(env) == bool(layers):
            raise UsageError("give an env or layer refs (not both)")
        if bundle_dir is not None:
            from .containers import bundle

            fd = bundle.open_bundle_dir(bundle_dir, create=False)
            if fd is not None:
                os.close(fd)
        limits = protocol.Limits(memory=memory, cpus=None if cpus is None else float(cpus),
                                 pids=pids, disk_quota=disk_quota)
        from .sandboxes.limits import validate

        validate(limits)  # (as the daemon does: the option's own words, before a round trip)
        request = protocol.Up(id=sandbox_id, env=env, layers=list(layers), prefetch=prefetch,
                              limits=limits)
        record = call(self.root, request, protocol.SandboxAnswer, self.timeout).sandbox
        if bundle_dir is not None:
            try:
                self.write_bundle(record, bundle_dir)
            except BaseException:  # no sandbox without the bundle asked for
                self.down(sandbox_id)
                raise
        return record

    def write_bundle(self, record: SandboxRecord, directory: str,
                     network: str = "none") -> str:
        """Write ``directory/config.json``, which runs the sandbox's image process
        (Entrypoint + Cmd as its User, with its Env and WorkingDir); its path.
        The directory must be root's alone (:func:`.containers.bundle.open_bundle_dir`), and
        the rootfs's mount points are made real first (:func:`.containers.bundle.write_bundle`)."""
        from .containers import bundle

        config, _ = container_config(record, network)
        return bundle.write_bundle(directory, config, private=False)

    def down(self, sandbox_id: str, keep_upper: bool = False,
             force: bool = False) -> SandboxRecord:
        """Take a sandbox down and unmount what only it used; its last record.
        A sandbox a ``run`` container still runs in is refused (``SandboxBusy``,
        exit code 15) unless ``force``, which kills the container first."""
        request = protocol.Down(id=sandbox_id, keep_upper=keep_upper, force=force)
        return call(self.root, request, protocol.SandboxAnswer, self.timeout).sandbox

    def ps(self) -> list[SandboxStatus]:
        """Every sandbox: its record, upper size and bytes read from its layers."""
        return self.ps_all().sandboxes

    def ps_all(self) -> protocol.PsAnswer:
        """``ps``'s whole answer: the sandboxes and containerd's snapshots."""
        return call(self.root, protocol.Ps(), protocol.PsAnswer, self.timeout)

    def sandbox(self, sandbox_id: str) -> SandboxStatus | None:
        """One sandbox's status (only its upper is measured), None if unknown."""
        rows = call(self.root, protocol.Ps(id=sandbox_id), protocol.PsAnswer,
                    self.timeout).sandboxes
        return next((r for r in rows if r.id == sandbox_id), None)

    def stats(self) -> StatsAnswer:
        """Cache statistics and, per mounted layer, bytes and chunks read."""
        return call(self.root, protocol.Stats(), StatsAnswer, self.timeout)

    def commit(self, sandbox_id: str, name: str, version: str,
               role: str = "workspace", expire: float | None = None) -> CommitAnswer:
        """Publish a sandbox's changes as layer ``name@version`` (its ref expiring
        ``expire`` seconds after)."""
        request = protocol.Commit(id=sandbox_id, name=name, version=version, role=role,
                                  expire=None if expire is None else float(expire))
        return call(self.root, request, CommitAnswer, self.timeout)

    def suspend(self, sandbox_id: str, name: str, version: str) -> SuspendAnswer:
        """Suspend a sandbox into the store: its containers frozen (cgroup
        freezer) while its upper is committed as layer ``name@version``, env
        ``name@version`` (that layer over the sandbox's layers) published,
        then the sandbox ended (its containers killed, taken down). A ref that
        exists is refused (:class:`~layerfs.errors.SnapshotExists`, exit 4)
        and nothing changes. :meth:`resume` brings it up again, on any node."""
        request = protocol.Suspend(id=sandbox_id, name=name, version=version)
        return call(self.root, request, SuspendAnswer, self.timeout)

    def resume(self, ref: str, sandbox_id: str, prefetch: str = "auto",
               bundle_dir: str | None = None, *, memory: int | None = None,
               cpus: float | None = None, pids: int | None = None,
               disk_quota: int | None = None) -> SandboxRecord:
        """Sandbox ``sandbox_id`` from the env ``ref`` a :meth:`suspend` made,
        on this node: an :meth:`up` of it (the same options), with the files
        the suspended sandbox had; its processes start anew."""
        return self.up(sandbox_id, env=ref, prefetch=prefetch, bundle_dir=bundle_dir,
                       memory=memory, cpus=cpus, pids=pids, disk_quota=disk_quota)

    def trace_push(self, ref: str) -> TracePushAnswer:
        """Store this node's access trace of layer ``ref`` beside the layer."""
        return call(self.root, protocol.TracePush(ref=ref), TracePushAnswer, self.timeout)

    def vm_up(self, vm_id: str, env: str | None = None, layers: Sequence[str] = (),
              disk_size: int = protocol.DEFAULT_VM_DISK,
              base_disk: str | None = None, pmem: str = "", ram: int = 0) -> VmRecord:
        """A microVM's drive set: each layer's meta image and lazy blob file,
        read-only, and a writable disk of ``disk_size`` bytes (or over the
        snapshot ``base_disk``); :func:`.vms.vmmargs.qemu_drive_args` makes QEMU's
        arguments of its ``drives``. ``pmem`` ``shared`` (or ``private``):
        the layers as pmem files to map, the ones other vms map (or its own).
        ``ram``: bytes of guest RAM in a file the node keeps (for
        :meth:`vm_suspend`). Kept across daemon restarts."""
        request = protocol.VmUp(id=vm_id, env=env, layers=list(layers), disk_size=disk_size,
                                base_disk=base_disk, pmem=pmem, ram=ram)
        return call(self.root, request, protocol.VmAnswer, self.timeout).vm

    def vm_suspend(self, vm_id: str, name: str, version: str,
                   max_depth: int = protocol.DEFAULT_SNAPSHOT_DEPTH) -> VmRecord:
        """Save a running vm (up with ``ram``) into the store as
        ``name@version`` (its writable disk as ``name-disk@version``); its VMM
        ends, the vm is ``suspended`` (``snapshot``: the ref). A snapshot
        chain (a resumed vm's RAM, its disk's commits) that would grow past
        ``max_depth`` layers is merged into one."""
        request = protocol.VmSuspend(id=vm_id, name=name, version=version, max_depth=max_depth)
        return call(self.root, request, protocol.VmAnswer, self.timeout).vm

    def vm_resume(self, ref: str, vm_id: str) -> VmRecord:
        """Vm ``vm_id`` from snapshot ``ref``, on this node: start the VMM
        with :func:`.vms.vmmargs.qemu_drive_args` and :func:`.vms.vmmargs.qemu_ram_args` of
        the record and the guest goes on where it was suspended."""
        request = protocol.VmResume(ref=ref, id=vm_id)
        return call(self.root, request, protocol.VmAnswer, self.timeout).vm

    def vm_prefetch(self, ref: str) -> protocol.VmPrefetchAnswer:
        """Snapshot ``ref``'s working set fetched onto this node now, ahead of
        a :meth:`vm_resume` of it here."""
        return call(self.root, protocol.VmPrefetch(ref=ref), protocol.VmPrefetchAnswer,
                    self.timeout)

    def vm_ps(self) -> list[VmRecord]:
        """Every vm's drive set (state ``up``, or ``broken`` with its error)."""
        return call(self.root, protocol.VmPs(), protocol.VmList, self.timeout).vms

    def vm_down(self, vm_id: str, keep_disk: bool = False) -> VmRecord:
        """Release a vm's drives, and delete its writable disk unless ``keep_disk``."""
        request = protocol.VmDown(id=vm_id, keep=keep_disk)
        return call(self.root, request, protocol.VmAnswer, self.timeout).vm

    def run(self, sandbox_id: str, command: Sequence[str] = (), *,
            env: Mapping[str, str] | None = None, cwd: str | None = None,
            user: str | None = None, timeout: float | None = None, capture: bool = False,
            stdin: bytes | int | None = None, max_output: int | None = None,
            runtime: str | None = None, network: str = "none",
            entrypoint: str | None = None, terminal: bool = False) -> RunResult:
        """Run the image's process, or ``command`` after its Entrypoint, in a sandbox
        that is up, as a container of OCI runtime ``runtime`` (runc or crun; None:
        runc) in the foreground, signals forwarded (from the main thread), and
        wait for it. ``env`` is set over the image's Env, ``cwd`` replaces its
        WorkingDir, ``user`` its User (as ``run --user``). ``timeout`` seconds
        at most: then the container is killed (``timed_out``, exit code 124).
        ``stdin``: bytes fed to it, or a descriptor (None: ours); ``capture``:
        its stdout and stderr in the result, ``max_output`` bytes of each at
        most (None: 16 MiB; the rest dropped, ``*_truncated`` set), else ours. A program that
        is missing exits 127, one that is not executable 126."""
        if timeout is not None and not 0 < timeout < float("inf"):
            raise UsageError(f"timeout must be a positive number of seconds, not {timeout}")
        if terminal and (capture or stdin is not None):
            raise UsageError("a run on a terminal neither captures output nor takes stdin")
        if max_output is not None and max_output < 0:
            raise UsageError(f"max_output must be at least 0, not {max_output}")
        container, config = self.prepare_run(sandbox_id, command, runtime=runtime,
                                             network=network, user=user,
                                             entrypoint=entrypoint, terminal=terminal,
                                             env=env, cwd=cwd)
        from ..sizes import NO_SPACE
        from .containers import runner
        from .sandboxes import rootspace

        what = f"a container in sandbox {sandbox_id}"
        rootspace.check_room(self.root, what)  # the runtime's state and the bundle go there
        watch = oom_watch(container.container_id, config)
        try:
            result = runner.run(container, config, stdin=stdin, capture=capture,
                                timeout=timeout, max_output=runner.MAX_OUTPUT
                                if max_output is None else max_output,
                                read_ahead=self.read_ahead)
            if watch is not None and watch.killed():
                say_memory_limit(result, config, capture)
        except OSError as exc:
            if exc.errno in NO_SPACE:
                raise rootspace.no_room_for(self.root, what) from None
            raise
        finally:
            if watch is not None:
                watch.close()
        return result

    def prepare_run(self, sandbox_id: str, command: Sequence[str] = (), *,
                    runtime: str | None = None, network: str = "none",
                    user: str | None = None, entrypoint: str | None = None,
                    terminal: bool = False, env: Mapping[str, str] | None = None,
                    cwd: str | None = None) -> tuple[Container, dict[str, Any]]:
        """What :meth:`run` runs: the container (runtime, ids, dirs) and its
        config.json, from one request for the sandbox's record."""
        from .containers import runner

        record = self.sandbox(sandbox_id)
        if record is None:
            raise SandboxNotFound(sandbox_id)
        if record.state != "up":
            raise SandboxNotUp(sandbox_id)
        config, stop = container_config(record, network, command=tuple(command),
                                        entrypoint=entrypoint, user=user, terminal=terminal,
                                        env=env, cwd=cwd)
        container = runner.prepare(self.root, runtime or runner.DEFAULT_RUNTIME, sandbox_id,
                                   stop_signal=stop)
        if record.limits.memory is not None:  # in a cgroup of the run's: its OOM kills read
            from .sandboxes.limits import container_cgroup

            config["linux"]["cgroupsPath"] = container_cgroup(container.container_id)
        return container, config


def container_config(record: SandboxRecord, network: str, command: tuple[str, ...] = (),
                     entrypoint: str | None = None, user: str | None = None,
                     terminal: bool = False, env: Mapping[str, str] | None = None,
                     cwd: str | None = None) -> tuple[dict[str, Any], int]:
    """The config.json of a sandbox's container from its record (the env's image
    config), and the signal that stops it."""
    import resource

    from .containers import bundle
    from .sandboxes import limits

    image = bundle.image_config_from(record.config)
    hostname = record.id[:63]
    process = bundle.image_process(record.rootfs, image, hostname, command=command,
                                   entrypoint=entrypoint, user=user,
                                   term=os.environ.get("TERM"), terminal=terminal,
                                   env=env, cwd=cwd)
    config = bundle.runtime_config(record.rootfs, process, hostname=hostname,
                                   network=network,
                                   nofile=resource.getrlimit(resource.RLIMIT_NOFILE),
                                   annotations=bundle.image_annotations(image),
                                   resources=limits.resources(
                                       record.limits,
                                       swap=record.limits.memory is not None
                                       and limits.swap_accounted()))
    return config, bundle.stop_signal(image)


def oom_watch(container_id: str, config: dict[str, Any]) -> OomWatch | None:
    """For a run with a memory limit (in a cgroup of its own: :meth:`Client.prepare_run`),
    what tells whether the OOM killer ended it."""
    if "cgroupsPath" not in config["linux"]:
        return None
    from .sandboxes.limits import OomWatch

    return OomWatch(container_id)


def say_memory_limit(result: RunResult, config: dict[str, Any], capture: bool) -> None:
    """The line saying the run was killed at its memory limit, on its stderr:
    the captured one, or ours."""
    from .sandboxes.limits import memory_limit_line

    memory = config["linux"]["resources"]["memory"]["limit"]
    line = memory_limit_line(memory, result.exit_code).encode() + b"\n"
    if capture:
        result.stderr = (result.stderr or b"") + line
    else:
        os.write(2, line)
