"""The daemon's meta image checker processes: the same verdicts as the check
in-process, run as a uid of their own that no other process may signal or
trace, and a worker that dies fails only the check it had (the next one gets
a new worker); one that gives no verdict in time is a CheckerTimeout, not a
verdict on the image."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zstandard
from support import need_root
from support.metaimages import layout_of, reseal, sample  # noqa: F401  (a fixture)
from support.remotelayers import node, two_layers  # noqa: F401  (fixtures)
from support.users import LocalUser

from layerfs.errors import BadMetaImage, CheckerTimeout, IntegrityError
from layerfs.formats.erofscheck import check_meta_image
from layerfs.node.replica.metacheck import CHECKER_IDS, LOCK_DIR, MetaChecker, named
from layerfs.node.replica.replica import Replica
from layerfs.refstore import RefStore


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


def status_of(pid: int) -> dict[str, list[str]]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {line.split(":")[0]: line.split(":")[1].split() for line in lines}


def test_a_worker_runs_as_a_uid_of_its_own_without_groups(checker, sample):  # noqa: F811
    need_root()
    checker.check(*stored(sample.image), sample.blob_size, sample.chunk_size, "s@1")
    assert checker.identity is not None
    uid = checker.identity.uid
    fields = status_of(worker_pid(checker))
    assert fields["Uid"] == [str(uid)] * 4 and fields["Gid"] == [str(uid)] * 4
    assert fields["Groups"] == [] and fields["NoNewPrivs"] == ["1"]
    assert uid in CHECKER_IDS and not named(uid)
    assert (LOCK_DIR / str(uid)).read_text() == f"{os.getpid()}\n"
    checker.close()
    assert not (LOCK_DIR / str(uid)).exists()


def test_two_checkers_never_share_a_uid_nor_take_one_a_process_has():
    """Two checkers (two daemons on one host, whatever their ROOTs) get
    different uids; a uid a process runs with (a checker's left over by a
    daemon that died, say) is skipped; with none free, no worker starts."""
    need_root()
    taken = CHECKER_IDS[-3]  # a process of this uid runs: not a checker's to take
    squatter = subprocess.Popen(["sleep", "60"], user=taken, group=taken, extra_groups=[])
    first, second = (MetaChecker(workers=1, ids=range(taken, taken + 2)) for _ in range(2))
    try:
        first.start()
        assert first.identity is not None and first.identity.uid == taken + 1
        with pytest.raises(OSError) as info:
            second.start()
        assert info.value.errno == errno.EUSERS and second.identity is None
        first.close()
        second.start()  # the uid let go is free again
        assert second.identity is not None and second.identity.uid == taken + 1
    finally:
        squatter.kill()
        squatter.wait()
        first.close()
        second.close()


# as another user: signal the pid given, print the errno (0: it was delivered)
SIGNAL = """
import os, signal, sys
for name in sys.argv[2:]:
    try:
        os.kill(int(sys.argv[1]), getattr(signal, name))
        print(0)
    except OSError as exc:
        print(exc.errno)
"""

# as the worker's own uid: trace it, read its memory; print the errnos
TRACE = """
import ctypes, os, sys
pid = int(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
PTRACE_ATTACH = 16
print(ctypes.get_errno() if libc.ptrace(PTRACE_ATTACH, pid, 0, 0) != 0 else 0)
try:
    os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    print(0)
except OSError as exc:
    print(exc.errno)
"""


def dropped_root(pid: int) -> int:
    """The uid of worker ``pid`` once it has given up root (it imports the
    checker first, as root: a signal then would be refused for that reason)."""
    deadline = time.monotonic() + 30
    while (uid := int(status_of(pid)["Uid"][0])) == 0:
        assert time.monotonic() < deadline, "the worker is still root"
        time.sleep(0.05)
    return uid


def signals_from(user: list[str], pid: int) -> list[int]:
    """What ``SIGSTOP`` then ``SIGKILL`` from ``user`` (a runuser argv) did to ``pid``."""
    proc = subprocess.run([*user, "/usr/bin/python3", "-c", SIGNAL, str(pid), "SIGSTOP",
                           "SIGKILL"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return [int(word) for word in proc.stdout.split()]


def test_no_other_user_nor_nobody_may_stop_or_kill_a_worker(checker, sample,  # noqa: F811
                                                            local_user):
    """A local user, and any process of uid nobody, is refused (EPERM) when it
    signals a worker; the worker's own uid may not trace it nor read its
    memory; the check after all that is answered at once."""
    checker.start()
    pid = worker_pid(checker)
    assert checker.identity is not None
    uid = checker.identity.uid
    assert dropped_root(pid) == uid
    tried = {"user": signals_from(["runuser", "-u", local_user.name, "--"], pid),
             "nobody": signals_from(["runuser", "-u", "nobody", "--"], pid)}
    os.kill(pid, signal.SIGCONT)  # were a stop delivered, the check below would wait on it
    traced = subprocess.run(["/usr/bin/python3", "-c", TRACE, str(pid)], user=uid, group=uid,
                            extra_groups=[], capture_output=True, text=True, timeout=30)
    assert tried == {"user": [errno.EPERM] * 2, "nobody": [errno.EPERM] * 2}
    assert traced.stdout.split() == [str(errno.EPERM), str(errno.EACCES)], traced.stderr
    started = time.monotonic()
    checker.check(*stored(sample.image), sample.blob_size, sample.chunk_size, "s@1")
    assert time.monotonic() - started < 5 and worker_pid(checker) == pid


def checker_workers(daemon_pid: int) -> list[int]:
    """The daemon's checker processes (its children running layerfs.node.replica.metacheck)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
                ppid = status_of(int(entry.name))["PPid"]
            except OSError:
                continue
            if b"layerfs.node.replica.metacheck" in cmdline and ppid == [str(daemon_pid)]:
                found.append(int(entry.name))
    return found


def test_a_daemons_checker_stays_out_of_other_users_reach(node, two_layers,  # noqa: F811
                                                          local_user: LocalUser):
    """Against the daemon itself: neither a local user nor nobody may stop its
    checker, and the ``up`` of a layer never seen before is checked within
    seconds (before, a ``kill -STOP`` as nobody held every such ``up`` for
    120 s, then failed it as corrupt)."""
    assert node.proc is not None
    workers = checker_workers(node.proc.pid)
    assert len(workers) == 1 and dropped_root(workers[0]) != 65534
    stopped = [subprocess.run([*user, "kill", "-STOP", str(workers[0])], capture_output=True,
                              text=True, timeout=30)
               for user in (["runuser", "-u", local_user.name, "--"],
                            ["runuser", "-u", "nobody", "--"])]
    os.kill(workers[0], signal.SIGCONT)  # were a stop delivered
    for proc in stopped:
        assert proc.returncode != 0 and "Operation not permitted" in proc.stderr, proc.stderr
    started = time.monotonic()
    node.cli("up", "--layer", "a@1", "--id", "fresh")
    assert time.monotonic() - started < 10
    node.cli("down", "fresh")


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
    monkeypatch.setattr("layerfs.node.replica.metacheck.sys.executable", "/bin/false")
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


@pytest.mark.daemon_log(r"WARNING layerfs\.node\.replica\.metacheck: the checker of the meta "
                        r"image of "
                        r"s@1 gave no verdict within 1s \(signal 9\); starting a fresh one")
def test_a_worker_that_gives_no_verdict_is_a_timeout_and_the_next_check_works(
        sample):  # noqa: F811
    """A worker stuck on an image (one built to be slow, or a stopped
    process) must not hold an ``up``, its thread and a check slot forever:
    once the check's time is up the worker is killed and the check fails with
    a timeout of its own (exit 14: try again), not an integrity error (the
    image was not found corrupt); a fresh worker answers the next check."""
    checker = MetaChecker(workers=1)
    checker.timeout = 1.0
    checker.start()
    pid = worker_pid(checker)
    os.kill(pid, signal.SIGSTOP)
    failed: list[Exception] = []

    def check() -> None:
        try:
            checker.check(*stored(sample.image), sample.blob_size, sample.chunk_size, "s@1")
        except Exception as exc:  # noqa: BLE001 - asserted below
            failed.append(exc)

    thread = threading.Thread(target=check, daemon=True)
    thread.start()
    thread.join(30)  # not a speed bound: only so that a check that hangs fails here
    try:
        assert not thread.is_alive(), "the check still waits on the stopped worker"
        assert len(failed) == 1 and isinstance(failed[0], CheckerTimeout)
        assert not isinstance(failed[0], IntegrityError) and failed[0].exit_code == 14
        assert str(failed[0]) == ("the meta image of s@1 was not checked: the checker gave no "
                                  "verdict within 1s; try again")
        assert not Path(f"/proc/{pid}").exists() or "zombie" not in Path(
            f"/proc/{pid}/status").read_text()
        fresh = worker_pid(checker)  # started at once, for the next check
        assert fresh != pid
        checker.check(*stored(sample.image), sample.blob_size, sample.chunk_size, "s@1")
        assert worker_pid(checker) == fresh
    finally:
        if thread.is_alive():  # the worker, stopped, is not reaped yet: still ours
            os.kill(pid, signal.SIGKILL)
        thread.join()
        checker.close()


@pytest.mark.daemon_log(r"WARNING layerfs\.node\.replica\.metacheck: the checker of the meta "
                        r"image of "
                        r"a@1 gave no verdict within 1s")
def test_a_timeout_keeps_nothing_of_the_layer_and_the_next_fetch_checks_it(
        store, two_layers, tmp_path):  # noqa: F811
    """Through the replica, as the daemon fetches a layer: the timeout is
    the error (not a verdict: the digest was fine and nothing is found
    corrupt), the layer is not in the replica, and the next fetch checks
    it with the fresh worker and keeps it."""
    a, _ = two_layers
    checker = MetaChecker(workers=1, timeout=1.0)
    replica = Replica(tmp_path / "root", check_meta=checker.check)
    try:
        checker.start()
        os.kill(worker_pid(checker), signal.SIGSTOP)
        with pytest.raises(CheckerTimeout, match="a@1 was not checked"):
            replica.verified_layer(RefStore(store), a)
        assert replica.layer(a) is None and list(replica.meta_dir.iterdir()) == []
        assert replica.verified_layer(RefStore(store), a).meta_path.exists()
    finally:
        replica.close()
        checker.close()


DAEMON_LIKE = """
import signal, sys
from layerfs.node.replica.metacheck import MetaChecker
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
    monkeypatch.setattr("layerfs.node.replica.metacheck.sys.executable", "/bin/false")
    errors = []
    for _ in range(3):  # the killed one replaced by one that fails, then two more
        with pytest.raises(BadMetaImage, match="checker process ended") as info:
            checker.check(*stored(sample.image), sample.blob_size, sample.chunk_size, "s@1")
        errors.append(info.value)
    assert open_fds() == before - 2  # the killed worker's pipes gone, and no others
