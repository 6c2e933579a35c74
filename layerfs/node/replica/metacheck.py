"""The structural check of meta images in processes of their own, as a user of their own.

The check (:mod:`layerfs.formats.erofscheck`: a compiled verdict, and the
Python reference that names a refusal's problem) parses bytes anyone who can
write to the store may have crafted, and a flaw in it would be a flaw in a
root process; its reference half, on a refused image, holds the interpreter
(~85 ms for a Debian base image's 6,674 inodes on a small VM, seconds for
100,000 files), which in the daemon would stall every sandbox's reads. So the
daemon hands each image to a worker: a fresh interpreter
(``python -I -m layerfs.node.replica.metacheck``, in ``/``, so that only the
installed package is imported) that imports the checker, then gives up root
(the checker identity below, no supplementary groups, no new privileges,
not dumpable) before it reads anything,
and checks one image at a time from its stdin, as the store holds it (zstd),
so that the daemon decompresses and hashes its own copy meanwhile (the
verdict is on the same bytes: decompression is a function of them) and sends
a third of the bytes:

* request: the stored image's length, the image's length, blob size, chunk
  size (4 × u64 little-endian), then the stored image;
* answer: one line, ``ok`` or ``bad <the first problem found>``.

The checker identity is a uid (and the gid of the same number) no other
process on the host has, taken per :class:`MetaChecker` (per daemon start)
from :data:`CHECKER_IDS`, as systemd's DynamicUser takes one: a lock file
``/run/layerfs/checker-ids/UID`` held (``flock``) for the checker's life, so
two daemons on one host, whatever their ROOTs, never share one; then a uid
no user or group database names, and no process runs with nor SysV IPC
object belongs to (``/proc``, read after the lock is taken: from then on
only this checker starts processes with it). So no local user, nor
``nobody``, may signal, trace or read a worker; and a worker, were a
crafted image to take it over, may signal no other process. Being
non-dumpable, a worker refuses even a trace from its own uid.

A new worker that ends without a verdict fails the check it was given
(:class:`~layerfs.errors.BadMetaImage`, "the checker process ended ..."); a
kept one that does (killed while idle, say) is replaced and the check is
asked of the new one. A check with no verdict within ``timeout`` seconds
(a worker stuck on an image built to be slow, or stopped) kills its worker,
starts a fresh one for the next check and fails with
:class:`~layerfs.errors.CheckerTimeout` (not a verdict on the image: nothing
is taken for corrupt), so an ``up`` never waits on a checker without bound.
Up to ``workers`` checks run at once; idle workers are kept. Thread safety:
:meth:`MetaChecker.check` may be called from any thread (the replica's
fetches run in worker threads).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import grp
import logging
import os
import pwd
import secrets
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ...errors import BadMetaImage, CheckerTimeout

log = logging.getLogger(__name__)
REQUEST = struct.Struct("<QQQQ")
MAX_IMAGE = 1 << 32  # what a worker accepts (the manifest bounds the real size)
CHECK_TIMEOUT = 120.0  # seconds a check may take (100,000 files: ~2 s)
# the checker identities: 16-bit uids (and gids) between systemd's container
# bind-user range (60514-60577) and its DynamicUser range (61184-65519), which
# neither useradd (UID_MAX 60000), adduser (59999) nor systemd hands out
CHECKER_IDS = range(60578, 61184)
LOCK_DIR = Path("/run/layerfs/checker-ids")  # host-wide: one lock file per uid taken
PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 4, 38


@dataclass(frozen=True)
class CheckerIdentity:
    """A uid (the gid is the same number) held for one checker's life."""

    uid: int
    lock: Path  # flock'ed through ``lock_fd``; removed when released
    lock_fd: int

    def release(self) -> None:
        with contextlib.suppress(OSError):
            self.lock.unlink()
        os.close(self.lock_fd)


def take_identity(ids: range = CHECKER_IDS, lock_dir: Path = LOCK_DIR) -> CheckerIdentity:
    """A uid of ``ids`` that this host leaves to no one else (see the module
    docstring), from a random place on; OSError (EUSERS) if none is free."""
    lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    used: set[int] | None = None  # read once the first lock is held
    first = secrets.randbelow(len(ids))
    for i in range(len(ids)):
        uid = ids[(first + i) % len(ids)]
        lock = lock_dir / str(uid)
        fd = lock_id_file(lock)
        if fd is None:
            continue  # another checker's
        if used is None:
            used = ids_in_use()
        if uid in used or named(uid):
            with contextlib.suppress(OSError):
                lock.unlink()
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.write(fd, b"%d\n" % os.getpid())
        return CheckerIdentity(uid, lock, fd)
    raise OSError(errno.EUSERS, f"no free checker uid in {ids.start}-{ids.stop - 1} "
                                f"(locks in {lock_dir})")


def lock_id_file(path: Path) -> int | None:
    """``path`` opened and locked (exclusive), or None if another holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        if os.fstat(fd).st_nlink > 0:
            return fd
        os.close(fd)  # its holder removed it between our open and lock: open it again


def named(uid: int) -> bool:
    """Whether a user or group database (/etc/passwd, /etc/group, NSS) has this id."""
    for lookup in (pwd.getpwuid, grp.getgrgid):
        try:
            lookup(uid)
            return True
        except KeyError:
            pass
    return False


def ids_in_use() -> set[int]:
    """Every uid and gid a process runs with (real, effective, saved, file
    system, supplementary) or a SysV IPC object belongs to."""
    used: set[int] = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            status = Path(entry.path, "status").read_text()
        except OSError:
            continue  # gone meanwhile
        for line in status.splitlines():
            key, _, values = line.partition(":")
            if key in ("Uid", "Gid", "Groups"):
                used.update(int(v) for v in values.split())
    for kind in ("msg", "sem", "shm"):
        try:
            head, *rows = Path("/proc/sysvipc", kind).read_text().splitlines()
        except OSError:
            continue
        columns = [i for i, name in enumerate(head.split()) if name in
                   ("uid", "gid", "cuid", "cgid")]
        for row in rows:
            fields = row.split()
            used.update(int(fields[i]) for i in columns if i < len(fields))
    return used


class Worker:
    """One checker process and its pipes."""

    def __init__(self, uid: int | None) -> None:
        self.kept = False  # taken from the idle ones (not started for this check)
        self.timed_out = False  # killed for giving no verdict in time
        # isolated (-I): no PYTHON* variables, no user site, and neither the working
        # directory nor any other writable place ahead of the installed package; in a
        # session of its own, as the keeper: a terminal's ^C is meant for the daemon
        identity = [] if uid is None else [str(uid)]
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-m", "layerfs.node.replica.metacheck", *identity],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd="/", env={"PATH": os.defpath},
            start_new_session=True)

    def check(self, stored: bytes, raw_size: int, blob_size: int, chunk_size: int,
              timeout: float) -> str:
        """The worker's answer line (``ok`` or ``bad ...``); OSError or EOFError
        if it is gone, or killed (``timed_out``) for giving none in ``timeout`` seconds."""
        stdin, stdout = self.pipes()
        timer = threading.Timer(timeout, self._time_out)
        timer.daemon = True
        timer.start()
        try:
            stdin.write(REQUEST.pack(len(stored), raw_size, blob_size, chunk_size))
            stdin.write(stored)
            stdin.flush()
            line = stdout.readline()
        finally:
            timer.cancel()
            timer.join()  # so that ``timed_out`` is final
        if not line.endswith(b"\n"):
            raise EOFError("no answer")
        return line[:-1].decode("utf-8", "replace")

    def _time_out(self) -> None:
        """Timer thread: the check's time is up; the blocked write or read then fails."""
        self.timed_out = True
        self.proc.kill()

    def pipes(self) -> tuple[IO[bytes], IO[bytes]]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        return self.proc.stdin, self.proc.stdout

    def ended(self) -> str:
        """How the process ended (it is killed if it has not); its pipes closed."""
        if self.proc.poll() is None:
            self.proc.kill()
        code = self.proc.wait()
        for pipe in self.pipes():
            with contextlib.suppress(OSError):  # an image not yet written: closed all the same
                pipe.close()
        return f"signal {-code}" if code < 0 else f"exit {code}"

    def close(self) -> None:
        for pipe in self.pipes():
            pipe.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class MetaChecker:
    """Meta image checks in up to ``workers`` checker processes, all of one
    checker identity (taken from ``ids`` with the first worker, if root)."""

    def __init__(self, workers: int = 2, timeout: float = CHECK_TIMEOUT,
                 ids: range = CHECKER_IDS) -> None:
        self.timeout = timeout
        self.slots = threading.BoundedSemaphore(workers)
        self.ids = ids
        self.identity: CheckerIdentity | None = None
        self._idle: list[Worker] = []
        self._lock = threading.Lock()
        self._closed = False

    def start(self) -> None:
        """Start one worker now, so that the first check finds it booted."""
        with self._lock:
            if not self._idle and not self._closed:
                self._idle.append(self._new_worker())

    def _new_worker(self) -> Worker:
        """A worker of this checker's identity (taken now if not yet); the lock held."""
        if self._closed:
            raise BadMetaImage("a layer", "the daemon is stopping")
        if os.geteuid() != 0:
            return Worker(None)  # nothing to give up
        if self.identity is None:
            self.identity = take_identity(self.ids)
            log.info("meta image checkers run as uid and gid %d", self.identity.uid)
        return Worker(self.identity.uid)

    def check(self, stored: bytes, raw_size: int, blob_size: int, chunk_size: int,
              what: str) -> None:
        """Check the meta image ``stored`` (zstd, ``raw_size`` bytes decompressed;
        of layer ``what``) in a worker; BadMetaImage if it
        fails, or if a new worker ends without a verdict (a kept one that does,
        killed meanwhile perhaps, is replaced and the check asked again);
        CheckerTimeout if there is none within ``timeout`` seconds (the worker
        killed, and a fresh one started for the next check)."""
        for fresh in (False, True):
            with self._worker(fresh) as worker:
                try:
                    answer = worker.check(stored, raw_size, blob_size, chunk_size,
                                          self.timeout)
                except (OSError, EOFError):
                    ended = worker.ended()
                    if worker.timed_out:
                        log.warning("the checker of the meta image of %s gave no verdict "
                                    "within %gs (%s); starting a fresh one", what,
                                    self.timeout, ended)
                        self.start()
                        raise CheckerTimeout(what, f"{self.timeout:g}") from None
                    if not worker.kept:
                        raise BadMetaImage(what, f"the checker process ended ({ended})") from None
                    continue
            if answer != "ok":
                raise BadMetaImage(what, answer.removeprefix("bad "))
            return

    @contextmanager
    def _worker(self, fresh: bool) -> Iterator[Worker]:
        """An idle worker (unless ``fresh``) or a new one, kept again after a verdict."""
        with self.slots:
            with self._lock:
                if self._closed:
                    raise BadMetaImage("a layer", "the daemon is stopping")
                worker = self._idle.pop() if self._idle and not fresh else None
            if worker is not None and worker.proc.poll() is not None:
                worker.ended()  # died while idle
                worker = None
            if worker is None:
                with self._lock:
                    worker = self._new_worker()
            else:
                worker.kept = True
            ok = False
            try:
                yield worker
                ok = True
            finally:
                with self._lock:
                    keep = (ok and not self._closed and not worker.timed_out
                            and worker.proc.poll() is None)
                    if keep:
                        self._idle.append(worker)
                if not keep:
                    worker.ended()

    def close(self) -> None:
        """End the idle workers (a busy one ends with its check) and let the
        identity go."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.close()
        with self._lock:
            identity, self.identity = self.identity, None
        if identity is not None:
            identity.release()


# -- the worker process --------------------------------------------------------

def drop_root(uid: int | None) -> None:
    """Become ``uid`` (user and group, no supplementary groups) if root, with
    no new privileges (no setuid program, file capability or LSM transition
    gives any back) and not dumpable (no process, even of ``uid``, may
    trace it or read its memory; set after the uid change, which sets the
    flag to ``fs.suid_dumpable``)."""
    import ctypes

    if os.geteuid() == 0:
        if uid is None:
            raise SystemExit("metacheck: started as root with no checker uid")
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    libc = ctypes.CDLL(None, use_errno=True)
    for option in (PR_SET_NO_NEW_PRIVS, PR_SET_DUMPABLE):
        value = 1 if option == PR_SET_NO_NEW_PRIVS else 0
        if libc.prctl(option, value, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), f"prctl({option}, {value})")


def read_exactly(stream: IO[bytes], n: int) -> bytes | None:
    data = stream.read(n)
    return data if len(data) == n else None


def serve(stdin: IO[bytes], stdout: IO[bytes], uid: int | None) -> None:
    """Answer requests until stdin ends, as ``uid`` (if root)."""
    import zstandard

    from ...formats.erofscheck import check_meta_image

    drop_root(uid)
    while (head := read_exactly(stdin, REQUEST.size)) is not None:
        length, raw_size, blob_size, chunk_size = REQUEST.unpack(head)
        if length > MAX_IMAGE or raw_size > MAX_IMAGE:
            return
        stored = read_exactly(stdin, length)
        if stored is None:
            return
        try:
            image = zstandard.ZstdDecompressor().decompress(stored, max_output_size=raw_size)
            if len(image) != raw_size:
                raise ValueError(f"{len(image)} bytes, the manifest says {raw_size}")
            check_meta_image(image, blob_size, chunk_size, "")
            answer = "ok"
        except BadMetaImage as exc:
            answer = "bad " + str(exc.args[1])
        except (zstandard.ZstdError, ValueError) as exc:
            answer = f"bad cannot decompress ({exc})"
        except Exception as exc:  # noqa: BLE001 - a flaw of the checker refuses the image
            answer = f"bad the check failed ({type(exc).__name__}: {exc})"
        stdout.write(answer.replace("\n", " ").encode("utf-8", "replace") + b"\n")
        stdout.flush()


if __name__ == "__main__":
    try:
        serve(sys.stdin.buffer, sys.stdout.buffer, int(sys.argv[1]) if sys.argv[1:] else None)
    except BrokenPipeError:  # the daemon is gone (killed mid-check): nobody to answer
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error at exit
        sys.exit(0)
