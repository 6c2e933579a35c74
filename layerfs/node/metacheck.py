"""The structural check of meta images in processes of their own, as nobody.

The check (:mod:`layerfs.formats.erofscheck`: a compiled verdict, and the
Python reference that names a refusal's problem) parses bytes anyone who can
write to the store may have crafted, and a flaw in it would be a flaw in a
root process; its reference half, on a refused image, holds the interpreter
(~85 ms for a Debian base image's 6,674 inodes on a small VM, seconds for
100,000 files), which in the daemon would stall every sandbox's reads. So the
daemon hands each image to a worker: a fresh interpreter
(``python -I -m layerfs.node.metacheck``, in ``/``, so that only the
installed package is imported) that imports the checker, then gives up root
(user and group nobody, no supplementary groups) before it reads anything,
and checks one image at a time from its stdin, as the store holds it (zstd),
so that the daemon decompresses and hashes its own copy meanwhile (the
verdict is on the same bytes: decompression is a function of them) and sends
a third of the bytes:

* request: the stored image's length, the image's length, blob size, chunk
  size (4 × u64 little-endian), then the stored image;
* answer: one line, ``ok`` or ``bad <the first problem found>``.

A new worker that ends without a verdict fails the check it was given
(:class:`~layerfs.errors.BadMetaImage`, "the checker process ended ..."); a
kept one that does (killed while idle, say) is replaced and the check is
asked of the new one. A check with no verdict within ``timeout`` seconds
(a worker stuck on an image built to be slow, or stopped) kills its worker
and fails ("the checker gave no verdict within ..."), so an ``up`` never
waits on a checker without bound. Up to ``workers`` checks run at
once; idle workers are kept. Thread safety: :meth:`MetaChecker.check` may be
called from any thread (the replica's fetches run in worker threads).
"""

from __future__ import annotations

import contextlib
import os
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

from ..errors import BadMetaImage

REQUEST = struct.Struct("<QQQQ")
NOBODY = 65534
MAX_IMAGE = 1 << 32  # what a worker accepts (the manifest bounds the real size)
CHECK_TIMEOUT = 120.0  # seconds a check may take (100,000 files: ~2 s)


class Worker:
    """One checker process and its pipes."""

    def __init__(self) -> None:
        self.kept = False  # taken from the idle ones (not started for this check)
        self.timed_out = False  # killed for giving no verdict in time
        # isolated (-I): no PYTHON* variables, no user site, and neither the working
        # directory nor any other writable place ahead of the installed package; in a
        # session of its own, as the keeper: a terminal's ^C is meant for the daemon
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-m", "layerfs.node.metacheck"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, cwd="/", env={"PATH": os.defpath}, start_new_session=True)

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
    """Meta image checks in up to ``workers`` checker processes."""

    def __init__(self, workers: int = 2, timeout: float = CHECK_TIMEOUT) -> None:
        self.timeout = timeout
        self.slots = threading.BoundedSemaphore(workers)
        self._idle: list[Worker] = []
        self._lock = threading.Lock()
        self._closed = False

    def start(self) -> None:
        """Start one worker now, so that the first check finds it booted."""
        with self._lock:
            if not self._idle and not self._closed:
                self._idle.append(Worker())

    def check(self, stored: bytes, raw_size: int, blob_size: int, chunk_size: int,
              what: str) -> None:
        """Check the meta image ``stored`` (zstd, ``raw_size`` bytes decompressed;
        of layer ``what``) in a worker; BadMetaImage if it
        fails, if a new worker ends without a verdict (a kept one that does,
        killed meanwhile perhaps, is replaced and the check asked again), or
        if there is none within ``timeout`` seconds."""
        for fresh in (False, True):
            with self._worker(fresh) as worker:
                try:
                    answer = worker.check(stored, raw_size, blob_size, chunk_size,
                                          self.timeout)
                except (OSError, EOFError):
                    ended = worker.ended()
                    if worker.timed_out:
                        raise BadMetaImage(what, f"the checker gave no verdict within "
                                                 f"{self.timeout:g}s") from None
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
                worker = Worker()
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
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.close()


# -- the worker process --------------------------------------------------------

def drop_root() -> None:
    """Become nobody (user and group, no supplementary groups), if root."""
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)


def read_exactly(stream: IO[bytes], n: int) -> bytes | None:
    data = stream.read(n)
    return data if len(data) == n else None


def serve(stdin: IO[bytes], stdout: IO[bytes]) -> None:
    """Answer requests until stdin ends."""
    import zstandard

    from ..formats.erofscheck import check_meta_image

    drop_root()
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
    serve(sys.stdin.buffer, sys.stdout.buffer)
