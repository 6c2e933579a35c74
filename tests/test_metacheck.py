"""The daemon's meta image checker processes: the same verdicts as the check
in-process, run as nobody, and a worker that dies fails only the check it
had (the next one gets a new worker)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import zstandard
from test_erofscheck import layout_of, reseal, sample  # noqa: F401 - the fixture

from layerfs.errors import BadMetaImage
from layerfs.formats.erofscheck import check_meta_image
from layerfs.node.metacheck import NOBODY, MetaChecker


def stored(image: bytes) -> tuple[bytes, int]:
    """An image as the store holds it (zstd) and its length."""
    return zstandard.ZstdCompressor().compress(image), len(image)


@pytest.fixture
def checker():
    c = MetaChecker(workers=1)
    try:
        yield c
    finally:
        c.close()


def chunk_past_blob(sample) -> bytes:  # noqa: F811
    image = bytearray(sample.image)
    at = layout_of(sample.image, sample.blob_size, sample.chunk_size).chunk_indexes[0]
    image[at + 4 : at + 8] = (1 << 20).to_bytes(4, "little")
    return reseal(image)


def test_the_verdicts_are_the_in_process_checks(checker, sample):  # noqa: F811
    checker.check(*stored(sample.image), sample.blob_size, sample.chunk_size, "s@1")
    bad = chunk_past_blob(sample)
    with pytest.raises(BadMetaImage) as here:
        check_meta_image(bad, sample.blob_size, sample.chunk_size, "s@1")
    with pytest.raises(BadMetaImage) as there:
        checker.check(*stored(bad), sample.blob_size, sample.chunk_size, "s@1")
    assert str(there.value) == str(here.value) and "outside the blob" in str(here.value)
    with pytest.raises(BadMetaImage, match="not a positive multiple"):
        checker.check(*stored(b"\0" * 100), sample.blob_size, sample.chunk_size, "s@1")
    frame, size = stored(sample.image)
    for bad_frame, bad_size in ((frame[:-9], size), (frame, size - 1), (b"not zstd", size)):
        with pytest.raises(BadMetaImage, match="cannot decompress"):
            checker.check(bad_frame, bad_size, sample.blob_size, sample.chunk_size, "s@1")
    checker.check(*stored(sample.image), sample.blob_size, sample.chunk_size, "s@1")  # serving


def worker_pid(checker: MetaChecker) -> int:
    assert len(checker._idle) == 1
    return checker._idle[0].proc.pid


def test_a_worker_runs_as_nobody_without_groups(checker, sample):  # noqa: F811
    if os.geteuid() != 0:
        pytest.skip("dropping to nobody needs root")
    checker.check(*stored(sample.image), sample.blob_size, sample.chunk_size, "s@1")
    status = Path(f"/proc/{worker_pid(checker)}/status").read_text().splitlines()
    fields = {line.split(":")[0]: line.split(":")[1].split() for line in status}
    assert fields["Uid"] == [str(NOBODY)] * 4 and fields["Gid"] == [str(NOBODY)] * 4
    assert fields["Groups"] == []


def test_a_kept_worker_killed_in_a_check_is_replaced_and_the_check_asked_again(
        checker, sample):  # noqa: F811
    checker.start()
    pid = worker_pid(checker)
    os.kill(pid, signal.SIGSTOP)  # the check below waits on it
    done: list[str] = []

    def check() -> None:
        checker.check(*stored(sample.image), sample.blob_size, sample.chunk_size, "s@1")
        done.append("ok")

    thread = threading.Thread(target=check)
    thread.start()
    thread.join(0.5)
    assert thread.is_alive()  # blocked on the stopped worker
    os.kill(pid, signal.SIGKILL)
    thread.join(30)
    assert done == ["ok"] and worker_pid(checker) != pid


def test_a_new_worker_that_ends_without_a_verdict_fails_the_check(checker, sample,  # noqa: F811
                                                                  monkeypatch):
    monkeypatch.setattr("layerfs.node.metacheck.sys.executable", "/bin/false")
    with pytest.raises(BadMetaImage) as info:
        checker.check(*stored(sample.image), sample.blob_size, sample.chunk_size, "s@1")
    assert str(info.value) == ("integrity check failed for the meta image of s@1: the checker "
                               "process ended (exit 1)")
    monkeypatch.undo()
    checker.check(*stored(sample.image), sample.blob_size, sample.chunk_size, "s@1")  # a real one


def test_a_closed_checker_checks_nothing(sample):  # noqa: F811
    checker = MetaChecker()
    checker.start()
    pid = worker_pid(checker)
    checker.close()
    assert not Path(f"/proc/{pid}").exists() or "zombie" not in Path(
        f"/proc/{pid}/status").read_text()
    with pytest.raises(BadMetaImage, match="stopping"):
        checker.check(*stored(sample.image), sample.blob_size, sample.chunk_size, "s@1")


def test_a_worker_imports_nothing_from_the_daemons_working_directory(sample, tmp_path,  # noqa: F811
                                                                     monkeypatch):
    """A ``layerfs`` package planted where the daemon was started (a writable
    /tmp, say) must not run in a worker while it is still root."""
    planted = tmp_path / "layerfs"
    planted.mkdir()
    marker = tmp_path / "ran"
    (planted / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    checker = MetaChecker()
    try:
        checker.check(*stored(sample.image), sample.blob_size, sample.chunk_size, "s@1")
    finally:
        checker.close()
    assert not marker.exists()


def test_a_worker_that_gives_no_verdict_fails_the_check_once_its_time_is_up(sample):  # noqa: F811
    """A worker stuck on an image (one built to be slow, or a stopped
    process) must not hold an ``up``, its thread and a check slot forever:
    once the check's time is up the worker is killed and the check fails."""
    checker = MetaChecker(workers=1)
    checker.timeout = 1.0
    checker.start()
    pid = worker_pid(checker)
    os.kill(pid, signal.SIGSTOP)
    failed: list[str] = []

    def check() -> None:
        try:
            checker.check(*stored(sample.image), sample.blob_size, sample.chunk_size, "s@1")
        except BadMetaImage as exc:
            failed.append(str(exc))

    thread = threading.Thread(target=check, daemon=True)
    thread.start()
    thread.join(30)  # not a speed bound: only so that a check that hangs fails here
    try:
        assert not thread.is_alive(), "the check still waits on the stopped worker"
        assert failed == ["integrity check failed for the meta image of s@1: the checker "
                          "gave no verdict within 1s"]
        assert not Path(f"/proc/{pid}").exists() or "zombie" not in Path(
            f"/proc/{pid}/status").read_text()
    finally:
        if thread.is_alive():  # the worker, stopped, is not reaped yet: still ours
            os.kill(pid, signal.SIGKILL)
        thread.join()
        checker.close()


DAEMON_LIKE = """
import signal, sys
from layerfs.node.metacheck import MetaChecker
checker = MetaChecker(workers=1)
checker.start()
worker = checker._idle[0].proc
try:
    print(worker.pid, flush=True)
    signal.pause()
except KeyboardInterrupt:  # the ^C, as the daemon's own stop
    pass
checker.close()
print(worker.returncode, flush=True)
"""


def test_a_terminals_interrupt_for_the_daemon_does_not_reach_its_checkers():
    """A ^C at the terminal of a daemon in the foreground goes to its whole
    process group: it is the daemon's request to stop, and must not kill its
    checker workers (a traceback each in the daemon's log, a check under way
    failed); they end when the daemon closes their stdin."""
    proc = subprocess.Popen([sys.executable, "-c", DAEMON_LIKE], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        proc.stdout.readline()  # the worker is up
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert out.split() == ["0"] and "KeyboardInterrupt" not in err, (out, err)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_worker_that_ended_leaves_no_pipe_open(checker, sample, monkeypatch):  # noqa: F811
    """The pipes of a worker that ended are closed then, not whenever the
    error that tells of it (which holds it) is let go of."""
    checker.check(*stored(sample.image), sample.blob_size, sample.chunk_size, "s@1")  # one kept
    before = open_fds()
    os.kill(worker_pid(checker), signal.SIGKILL)
    monkeypatch.setattr("layerfs.node.metacheck.sys.executable", "/bin/false")
    errors = []
    for _ in range(3):  # the killed one replaced by one that fails, then two more
        with pytest.raises(BadMetaImage, match="checker process ended") as info:
            checker.check(*stored(sample.image), sample.blob_size, sample.chunk_size, "s@1")
        errors.append(info.value)
    assert open_fds() == before - 2  # the killed worker's pipes gone, and no others
