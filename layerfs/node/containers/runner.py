"""Run a command in a sandbox as a container (``layerfs run``).

Writes an OCI bundle (``bundle.runtime_config``) in a per-run directory
``ROOT/run/bundles/<container id>/`` (``ROOT/run`` is mode 0700), runs it in the
foreground with an OCI runtime (``runc`` or ``crun``, its state under
``ROOT/run/state/<runtime>``), passes
stdin/stdout/stderr through (or feeds stdin bytes and captures stdout and
stderr, each up to a bound: :class:`Streams`), forwards SIGINT/SIGTERM/SIGHUP
to the container (a second one kills it; SIGTERM, a request to stop, arrives
as the image's StopSignal), kills the container at a timeout (:func:`stop`),
and afterwards deletes the container and its bundle. Its result
(:class:`RunResult`) carries the runtime's exit status (the command's, or 128
+ signal; 124 after a timeout). A command whose program is missing (127) or
not executable (126) is found so before the runtime runs
(:mod:`.containers.imagecommand`), the same under runc and crun.
While it runs, the runtime's own state says so: :func:`running_containers`
asks it (``RUNTIME state``) for the daemon's ``down``, which refuses such a
sandbox or, forced, kills the container first (:func:`kill`).
A run cannot outlive its ``layerfs run``: before the runtime starts, a
watcher is forked off (:class:`Reaper`, in a session of its own, holding only
the read end of a pipe); if the run ends without saying so on that pipe (it
was SIGKILLed, or crashed), the watcher kills the container and the runtime,
deletes the container's state and removes its bundle. A timeout may be as
long as :data:`MAX_TIMEOUT`; it is waited for in bounded steps (``poll(2)``
takes an int of milliseconds).
The runtime is started with ``posix_spawn`` (``subprocess``, with the
threading and locale machinery it imports, would add ~5 ms to the start of
every ``layerfs run``), its signal dispositions reset as ``subprocess`` does.

crun refuses a host whose cgroups are in hybrid mode with controllers on the
cgroup2 hierarchy (``cgroups in hybrid mode not supported``). There it runs in
a mount namespace of its own without ``/sys/fs/cgroup/unified``
(:func:`runtime_command`), where it sees a cgroup v1 host and puts the
container in v1 cgroups, device cgroup included.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import FrameType

from ...errors import UsageError
from ...records import Record
from .bundle import write_bundle
from .imagecommand import CommandProblem, check_command
from .programahead import touch_programs

TYPE_CHECKING = False  # typing is not imported at run time: a client starts faster
if TYPE_CHECKING:
    from typing import Any

RUNTIMES = ("runc", "crun")
DEFAULT_RUNTIME = "runc"
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
UNIFIED_CGROUP = "/sys/fs/cgroup/unified"  # the cgroup2 hierarchy of a hybrid host
WITHOUT_UNIFIED = f'umount {UNIFIED_CGROUP} && exec "$0" "$@"'
# ignored by Python itself, so reset to the default in the children (as subprocess does)
CHILD_DEFAULT_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ)
# the OCI states of a container that has a process: made, started or frozen, not yet ended
LIVE_STATES = ("creating", "created", "running", "paused")
MAX_OUTPUT = 16 << 20  # bytes of stdout, and of stderr, a captured run keeps
TIMED_OUT = 124  # the exit code of a run its timeout killed, as timeout(1)'s
READ_SIZE = 1 << 16
PIPE_WRITE = 1 << 16
DRAIN_SECONDS = 1.0  # after the runtime ends, how long the pipes may stay silent
STOP_SECONDS = 10.0  # after the timeout, how long the runtime has to end
STOP_POLL_MS = 250
MAX_TIMEOUT = 366 * 86400.0  # seconds: the longest timeout a run takes (a leap year)
WAIT_STEP = 3600.0  # seconds: the longest single poll(2) of a run's supervision
REAPER_PID = b"P"  # the reaper's messages: the runtime's pid follows
REAPER_DONE = b"D"  # the run ended as it should: nothing to clean up


class Container(Record):
    """One run: the runtime binary, its state root, the container id and bundle
    dir, and the signal that asks the container's process to stop."""

    runtime: str
    state_root: str
    container_id: str
    bundle_dir: str
    stop_signal: int = signal.SIGTERM

    def command(self, *args: str) -> list[str]:
        """``RUNTIME --root STATE ARGS...`` (in its own mount namespace where it needs one)."""
        return runtime_command(self.runtime, self.state_root, *args)


def runtime_command(runtime: str, state_root: str, *args: str) -> list[str]:
    """The argv of ``RUNTIME --root STATE ARGS...``; crun on a hybrid cgroup host
    runs in a private mount namespace without the cgroup2 hierarchy."""
    argv = [runtime, "--root", state_root, *args]
    if os.path.basename(runtime) == "crun" and hybrid_cgroup2_controllers():
        return ["unshare", "--mount", "--propagation", "private", "--",
                "sh", "-c", WITHOUT_UNIFIED, *argv]
    return argv


def hybrid_cgroup2_controllers() -> bool:
    """Whether cgroup2 is mounted at /sys/fs/cgroup/unified beside v1 hierarchies
    and has controllers: crun refuses to create containers there."""
    from ...mounts import mount_table

    mounted = any(m.point == UNIFIED_CGROUP and m.fstype == "cgroup2" for m in mount_table())
    if not mounted:
        return False
    try:
        with open(os.path.join(UNIFIED_CGROUP, "cgroup.controllers"), encoding="ascii") as f:
            return bool(f.read().strip())
    except OSError:
        return False


def find_runtime(name: str) -> str:
    """The path of runtime ``name`` (runc or crun) on PATH, or one clear error."""
    if name not in RUNTIMES:
        raise UsageError(f"unknown runtime {name!r} (expected one of {', '.join(RUNTIMES)})")
    path = on_path(name)
    if path is None:
        raise UsageError(f"the OCI runtime {name} is not on PATH (Debian package {name})")
    return path


def on_path(name: str) -> str | None:
    """The first executable file ``name`` in a directory of PATH (``shutil.which``,
    whose module imports every compression library, is not imported here)."""
    for directory in os.get_exec_path():
        path = os.path.join(directory, name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def container_id(sandbox_id: str) -> str:
    """A container id unique to this run: the sandbox id and 12 random hex digits."""
    return f"{sandbox_id}-{os.urandom(6).hex()}"


def is_container_of(sandbox_id: str, cid: str) -> bool:
    """Whether ``cid`` is a :func:`container_id` of ``sandbox_id`` (sandbox ids
    have no ``-`` + 12 hex digits to spare: ``a-0123456789ab``'s containers
    are not ``a``'s)."""
    return re.fullmatch(re.escape(sandbox_id) + r"-[0-9a-f]{12}", cid) is not None


def running_containers(root: str, sandbox_id: str) -> list[Container]:
    """The containers ``layerfs run`` started in sandbox ``sandbox_id`` that
    have a process now, as each runtime's ``state`` reports it from its state
    root (``ROOT/run/state/<runtime>``): a fact of the moment, not a record
    that could outlive a killed run. A state the runtime cannot report (its
    binary gone from PATH) counts as running."""
    found = []
    for name in RUNTIMES:
        state_root = os.path.join(root, "run", "state", name)
        try:
            ids = sorted(os.listdir(state_root))
        except FileNotFoundError:
            continue
        for cid in ids:
            if not is_container_of(sandbox_id, cid):
                continue
            container = Container(runtime=on_path(name) or name, state_root=state_root,
                                  container_id=cid,
                                  bundle_dir=os.path.join(root, "run", "bundles", cid))
            if container_status(container) in (*LIVE_STATES, None):
                found.append(container)
    return found


def container_status(container: Container) -> str | None:
    """The container's OCI status (``running``, ``stopped``, ...), ``gone`` if
    the runtime knows no such container, None if it could not be asked."""
    import subprocess  # (only here: ``layerfs run`` starts faster without it)

    try:
        proc = subprocess.run(container.command("state", container.container_id),
                              capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        state = os.path.join(container.state_root, container.container_id)
        return "gone" if not os.path.lexists(state) else None
    try:
        status = json.loads(proc.stdout)["status"]
    except (ValueError, KeyError, TypeError):
        return None
    return status if isinstance(status, str) else None


def kill(container: Container) -> bool:
    """SIGKILL the container and delete it (``RUNTIME delete --force``); the
    ``layerfs run`` that started it then ends with 128 + 9. Whether it is gone."""
    import subprocess

    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        subprocess.run(container.command("delete", "--force", container.container_id),
                       capture_output=True, timeout=60)
    gone = container_status(container) not in (*LIVE_STATES, None)
    if gone:
        remove_bundle(container.bundle_dir)
    return gone


def prepare(root: str, runtime_name: str, sandbox_id: str,
            stop_signal: int = signal.SIGTERM) -> Container:
    """Find the runtime and name this run's container, bundle dir and state root."""
    runtime = find_runtime(runtime_name)
    run_dir = os.path.join(root, "run")
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    os.chmod(run_dir, 0o700)
    cid = container_id(sandbox_id)
    return Container(runtime=runtime, state_root=os.path.join(run_dir, "state", runtime_name),
                     container_id=cid, bundle_dir=os.path.join(run_dir, "bundles", cid),
                     stop_signal=stop_signal)


def spawn(argv: list[str], *, quiet: bool = False, stdout_null: bool = False,
          own_group: bool = False, stdio: Sequence[int | None] = ()) -> int:
    """Start ``argv`` (its program looked up on PATH) with our environment and
    stdio and no other descriptor (``stdout_null``: stdout to /dev/null;
    ``quiet``: stderr too; ``stdio``: the descriptors for 0, 1, 2 instead of
    ours, None keeps ours), in a process group of its own if ``own_group``;
    its pid."""
    actions: list[tuple] = [(os.POSIX_SPAWN_DUP2, fd, target)
                            for target, fd in enumerate(stdio) if fd is not None]
    actions += [(os.POSIX_SPAWN_CLOSE, fd) for fd in inheritable_fds()]
    actions += [(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_WRONLY, 0)
                for fd in ((1, 2) if quiet else (1,) if stdout_null else ())]
    if own_group:
        return os.posix_spawnp(argv[0], argv, os.environ, file_actions=actions, setpgroup=0,
                               setsigdef=CHILD_DEFAULT_SIGNALS)
    return os.posix_spawnp(argv[0], argv, os.environ, file_actions=actions,
                           setsigdef=CHILD_DEFAULT_SIGNALS)


def inheritable_fds() -> list[int]:
    """Our descriptors above stderr a child would inherit (closed in it, as
    subprocess's ``close_fds`` does: only stdio reaches the runtime)."""
    fds = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
            if fd > 2 and os.get_inheritable(fd):
                fds.append(fd)
    return fds


def wait(pid: int) -> int:
    """Wait for child ``pid``; its exit code, or -N if signal N ended it."""
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


class RunResult(Record):
    """How a run ended: the command's exit code (128 + N if signal N ended it;
    :data:`TIMED_OUT` if the timeout killed it; 127 or 126 if its program is
    missing or not executable), and, if captured, what it wrote to stdout and
    stderr, at most the bound asked for each (``*_truncated``: more was written
    and dropped)."""

    exit_code: int
    stdout: bytes | None = None
    stderr: bytes | None = None
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timed_out: bool = False


def run(container: Container, config: dict[str, Any], *, stdin: bytes | int | None = None,
        capture: bool = False, timeout: float | None = None,
        max_output: int = MAX_OUTPUT, read_ahead: bool = True) -> RunResult:
    """Run ``config`` as ``container`` in the foreground and wait for it (at most
    ``timeout`` seconds: then the container is killed, and the runtime if it
    does not end); stdin from ``stdin`` (bytes, or a descriptor; None: ours),
    stdout and stderr captured if ``capture`` (else ours). A command that
    cannot start (:func:`.containers.imagecommand.check_command`) is not run: its one
    line goes to stderr. ``read_ahead``: the programs the command will exec
    are read ahead while the runtime starts (:mod:`.containers.programahead`)."""
    problem = command_problem(config)
    if problem is not None:
        line = f"layerfs: run: {problem.message}\n".encode()
        if not capture:
            os.write(2, line)
        return RunResult(exit_code=problem.exit_code, stdout=b"" if capture else None,
                         stderr=line if capture else None)
    if timeout is not None and not 0 < timeout <= MAX_TIMEOUT:
        raise UsageError(f"timeout must be a positive number of seconds up to {MAX_TIMEOUT:g},"
                         f" not {timeout:g}")
    if read_ahead:
        touch_programs(config)  # not waited for: read while the runtime starts
    argv = container.command("run", "--bundle", container.bundle_dir, container.container_id)
    reaper = Reaper(container)
    try:
        write_bundle(container.bundle_dir, config)
        streams = Streams(stdin, capture, max_output)
        try:
            # Without a terminal, a Ctrl-C meant for us reaches the runtime only by our
            # forwarding (once); with one, the runtime owns the terminal's foreground.
            pid = spawn(argv, own_group=not config["process"]["terminal"],
                        stdio=streams.child_fds())
            reaper.runtime_started(pid)
            streams.started()
            with forwarding_signals(container, pid):
                status, timed_out = supervise(container, pid, streams, timeout)
        finally:
            streams.close()
            delete(container)
    finally:
        reaper.done()
    return RunResult(exit_code=TIMED_OUT if timed_out else
                     status if status >= 0 else 128 - status,
                     stdout=streams.output(1), stderr=streams.output(2),
                     stdout_truncated=streams.truncated(1), stderr_truncated=streams.truncated(2),
                     timed_out=timed_out)


def command_problem(config: dict[str, Any]) -> CommandProblem | None:
    """Why the config's command cannot start in its rootfs, or None."""
    process = config["process"]
    env = dict(item.partition("=")[::2] for item in process["env"])
    return check_command(config["root"]["path"], process["args"][0],
                         env.get("PATH", ""), process["cwd"])


class Streams:
    """The runtime's stdio for one run: a pipe that feeds it ``stdin`` bytes
    (or that descriptor, or ours), pipes that capture its stdout and stderr,
    each kept up to ``max_output`` bytes (the rest read and dropped, so that
    the command never blocks on a full pipe), or ours."""

    def __init__(self, stdin: bytes | int | None, capture: bool, max_output: int) -> None:
        self.max_output = max_output
        self.feed = b""
        self.stdin_fd: int | None = stdin if isinstance(stdin, int) else None
        self.writer: int | None = None
        if isinstance(stdin, bytes | bytearray | memoryview):
            self.feed = bytes(stdin)
            self.stdin_fd, self.writer = os.pipe()
        self.readers: dict[int, int] = {}  # our read end: 1 or 2
        self.child: dict[int, int] = {}  # 1 or 2: the runtime's write end
        self.kept: dict[int, bytearray] = {}
        self.dropped: dict[int, int] = {}
        if capture:
            for target in (1, 2):
                read_end, write_end = os.pipe()
                self.readers[read_end] = target
                self.child[target] = write_end
                self.kept[target] = bytearray()
                self.dropped[target] = 0

    def child_fds(self) -> tuple[int | None, int | None, int | None]:
        return self.stdin_fd, self.child.get(1), self.child.get(2)

    def started(self) -> None:
        """Close the runtime's ends of our pipes (its copies are its own now)."""
        for fd in self.child.values():
            os.close(fd)
        self.child = {}
        if self.writer is not None and self.stdin_fd is not None:
            os.close(self.stdin_fd)
            self.stdin_fd = None
        if self.writer is not None:
            os.set_blocking(self.writer, False)
            if not self.feed:
                self._close_writer()

    def watched(self) -> dict[int, int]:
        """The descriptors to poll, with the events awaited."""
        fds = {fd: select.POLLIN for fd in self.readers}
        if self.writer is not None:
            fds[self.writer] = select.POLLOUT
        return fds

    def ready(self, fd: int) -> None:
        """Move what ``fd`` is ready for: write some stdin, or read some output."""
        if fd == self.writer:
            self._write()
            return
        target = self.readers[fd]
        data = os.read(fd, READ_SIZE)
        if not data:
            os.close(fd)
            del self.readers[fd]
            return
        room = self.max_output - len(self.kept[target])
        self.kept[target] += data[:max(room, 0)]
        self.dropped[target] += max(len(data) - max(room, 0), 0)

    def _write(self) -> None:
        assert self.writer is not None
        try:
            written = os.write(self.writer, self.feed[:PIPE_WRITE])
        except BlockingIOError:
            return
        except BrokenPipeError:  # the command did not read it all: its business
            written = len(self.feed)
        self.feed = self.feed[written:]
        if not self.feed:
            self._close_writer()

    def _close_writer(self) -> None:
        if self.writer is not None:
            os.close(self.writer)
            self.writer = None

    def output(self, target: int) -> bytes | None:
        kept = self.kept.get(target)
        return None if kept is None else bytes(kept)

    def truncated(self, target: int) -> bool:
        return self.dropped.get(target, 0) > 0

    def close(self) -> None:
        fds = [*self.readers, *self.child.values()]
        if self.writer is not None:
            fds.append(self.writer)
        if self.stdin_fd is not None and self.writer is not None:
            fds.append(self.stdin_fd)
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.readers, self.child, self.writer = {}, {}, None


def supervise(container: Container, pid: int, streams: Streams,
              timeout: float | None) -> tuple[int, bool]:
    """Move the run's stdio until the runtime ``pid`` has ended and its output
    is read, at most ``timeout`` seconds (then :func:`stop` it); its wait
    status (as :func:`wait`) and whether the timeout ended it."""
    deadline = None if timeout is None else time.monotonic() + timeout
    pidfd = os.pidfd_open(pid)
    try:
        ended = False
        while not ended or streams.readers:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return stop(container, pid, pidfd), True
            if ended:  # the container's processes are gone: what is left in the pipes
                left = DRAIN_SECONDS if left is None else min(left, DRAIN_SECONDS)
            poller = select.poll()
            if not ended:
                poller.register(pidfd, select.POLLIN)
            for fd, awaited in streams.watched().items():
                poller.register(fd, awaited)
            step = WAIT_STEP if left is None else min(left, WAIT_STEP)
            ready = poller.poll(max(int(step * 1000), 1))
            if ended and not ready:
                break
            for fd, _ in ready:
                if fd == pidfd:
                    ended = True
                else:
                    streams.ready(fd)
        return wait(pid), False
    finally:
        os.close(pidfd)


def stop(container: Container, pid: int, pidfd: int) -> int:
    """Kill the container (``RUNTIME kill ID KILL``, again until the runtime
    ends: a container still being made has no state to kill yet), and after
    :data:`STOP_SECONDS` the runtime itself; its wait status. Its pid namespace
    ends with its init, so no process of the command outlives it; the state
    left is deleted afterwards (:func:`delete`, ``delete --force``)."""
    give_up = time.monotonic() + STOP_SECONDS
    while time.monotonic() < give_up:
        wait(spawn(container.command("kill", container.container_id, "KILL"), quiet=True))
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        if poller.poll(STOP_POLL_MS):
            return wait(pid)
    _signal_quietly(pid, signal.SIGKILL)
    return wait(pid)


class Reaper:
    """The watcher that ends a run's container if the run itself is killed.

    Forked off before the bundle is written; it sets up a session of its own
    (no terminal's signal reaches it), keeps no descriptor of ours but the read
    end of a pipe, and waits on it. The run writes the runtime's pid once it
    has spawned it (:meth:`runtime_started`) and, at its end, a done mark
    (:meth:`done`), then waits for the watcher to exit. End of file without
    the mark means the run died: the watcher kills the container (``RUNTIME
    kill ID KILL``, again until the runtime ends, at most
    :data:`STOP_SECONDS`), then the runtime, deletes the container's state
    and removes its bundle. Everything it runs is computed before the fork.
    A watcher that has not exited yet when the run ends is reaped by the next
    run of this process (:data:`_UNREAPED`), not waited for."""

    def __init__(self, container: Container) -> None:
        _reap_finished()
        kill_argv = container.command("kill", container.container_id, "KILL")
        delete_argv = container.command("delete", "--force", container.container_id)
        read_end, self.writer = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the watcher
            code = 0
            try:
                os.close(self.writer)
                _watch(read_end, kill_argv, delete_argv, container.bundle_dir)
            except BaseException:  # noqa: BLE001 - nothing to report to, nowhere to go
                code = 1
            finally:
                os._exit(code)
        os.close(read_end)

    def runtime_started(self, pid: int) -> None:
        """Tell the watcher the runtime's pid."""
        with contextlib.suppress(OSError):
            os.write(self.writer, REAPER_PID + str(pid).encode() + b"\n")

    def done(self) -> None:
        """The run ended as it should: let the watcher go (reaped now if it has
        exited already, else later)."""
        with contextlib.suppress(OSError):
            os.write(self.writer, REAPER_DONE)
        os.close(self.writer)
        with _UNREAPED_LOCK:
            _UNREAPED.append(self.pid)
        _reap_finished()


_UNREAPED: list[int] = []  # watchers told to go that had not exited yet
_UNREAPED_LOCK = threading.Lock()  # runs in several threads of one scheduler share the list


def _reap_finished() -> None:
    """Reap the watchers of earlier runs that have exited by now."""
    with _UNREAPED_LOCK:
        for pid in list(_UNREAPED):
            try:
                ended, _status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else
                ended = pid
            if ended == pid:
                _UNREAPED.remove(pid)


def _watch(read_end: int, kill_argv: list[str], delete_argv: list[str],
           bundle_dir: str) -> None:
    """The watcher's life (:class:`Reaper`): wait for the run's word or its death."""
    os.setsid()
    for signum in (*FORWARDED_SIGNALS, signal.SIGPIPE):
        signal.signal(signum, signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDWR)
    for target in (0, 1, 2):
        os.dup2(null, target)
    os.closerange(3, read_end)
    os.closerange(read_end + 1, os.sysconf("SC_OPEN_MAX"))
    heard = b""
    runtime: int | None = None
    while True:
        chunk = os.read(read_end, 64)
        if not chunk:
            break
        heard += chunk
        if REAPER_DONE in heard:
            return
        if runtime is None and heard.startswith(REAPER_PID) and b"\n" in heard:
            with contextlib.suppress(OSError, ValueError):
                runtime = os.pidfd_open(int(heard[1:heard.index(b"\n")]))
    _end_container(runtime, kill_argv, delete_argv)
    remove_bundle(bundle_dir)


def _end_container(runtime: int | None, kill_argv: list[str], delete_argv: list[str]) -> None:
    """Kill the container until its runtime (a pidfd, if known) ends, then the
    runtime itself; delete the container's state."""
    give_up = time.monotonic() + (STOP_SECONDS if runtime is not None else 1.0)
    while time.monotonic() < give_up:
        wait(spawn(kill_argv, quiet=True))
        if runtime is None:  # the run died before it could say: a few tries
            time.sleep(STOP_POLL_MS / 1000)
            continue
        poller = select.poll()
        poller.register(runtime, select.POLLIN)
        if poller.poll(STOP_POLL_MS):
            break
    else:
        if runtime is not None:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(runtime, signal.SIGKILL)
    wait(spawn(delete_argv, quiet=True))


@contextmanager
def forwarding_signals(container: Container, pid: int) -> Iterator[None]:
    """Forward SIGINT/SIGTERM/SIGHUP to the runtime ``pid`` (which forwards them
    to the container's process; SIGTERM as the container's stop signal); on the
    second one, kill the container. Only the main thread has signal handlers:
    a run in another thread forwards nothing."""
    received: list[int] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        received.append(signum)
        if len(received) == 1:
            _signal_quietly(pid, container.stop_signal if signum == signal.SIGTERM else signum)
        else:
            wait(spawn(container.command("kill", container.container_id, "KILL"), quiet=True))

    previous: dict[signal.Signals, Any] = {}
    try:
        for sig in FORWARDED_SIGNALS:
            previous[sig] = signal.signal(sig, forward)
    except ValueError:  # not the main thread (a caller's worker): nothing to forward
        pass
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _signal_quietly(pid: int, signum: int) -> None:
    """Signal the runtime, which we have not waited for yet (so ``pid`` is still it)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def delete(container: Container) -> None:
    """Remove the container if the runtime left it (it normally deletes it on exit),
    then the bundle directory."""
    state = os.path.join(container.state_root, container.container_id)
    if os.path.lexists(state):
        wait(spawn(container.command("delete", "--force", container.container_id),
                   stdout_null=True))
    remove_bundle(container.bundle_dir)


def remove_bundle(directory: str) -> None:
    """Remove a bundle directory: the files :func:`write_bundle` put in it."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))
    with contextlib.suppress(OSError):
        os.rmdir(directory)
