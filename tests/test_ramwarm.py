"""A resumed vm's working set put into its RAM file's page cache by the daemon
(``layerfs/node/vms/ramwarm.py``), without a mount: the disk a stand-in that
serves bytes, the kernel's store notification recorded. What is stored is the
disk's bytes at their offsets, a piece at a time; after ``stop`` nothing is
stored, and a store under way ends before ``stop`` returns; a failure, also
one a read of several chunks raises as a group, is one warning line (none
once stopped), and nothing a warm-up meets ends the task it runs in. The
kernel side (the pages a guest then finds) is tests/test_vm.py's resumes,
with real guests. On a trio ``MockClock`` that stands still."""

from __future__ import annotations

import logging
import threading

import pytest
import trio
from support.chunkstores import run

from layerfs.errors import StoreUnreachable
from layerfs.node.vms import ramwarm
from layerfs.node.vms.ramwarm import PIECE, RamWarmUp

RAM = 3 * PIECE + 4096


class Disk:
    """A RAM disk's stand-in: byte ``i`` is ``i % 251``; a read of ``fail_at``
    fails as a store away does."""

    inode = 42

    def __init__(self, fail_at: int | None = None, error: BaseException | None = None,
                 before_failing=None) -> None:
        self.fail_at = fail_at
        self.error = error or StoreUnreachable("test store is down")
        self.before_failing = before_failing
        self.reads: list[tuple[int, int]] = []

    async def read_parts(self, sector: int, count: int) -> list[bytes]:
        """The sectors in two parts (views into chunks, as a chain reads)."""
        offset, length = sector * 512, count * 512
        self.reads.append((offset, length))
        if offset == self.fail_at:
            if self.before_failing is not None:
                await self.before_failing()
            raise self.error
        data = bytes((offset + i) % 251 for i in range(length))
        return [data[:length // 2], data[length // 2:]]


@pytest.fixture
def stores(monkeypatch) -> list[tuple[int, int, bytes]]:
    """The store notifications made: (inode, offset, bytes)."""
    made: list[tuple[int, int, bytes]] = []
    monkeypatch.setattr(ramwarm.pyfuse3, "notify_store",
                        lambda inode, offset, data: made.append((inode, offset, bytes(data))))
    return made


def warm_up(warm: RamWarmUp, disk: Disk, path, runs) -> None:
    async def main() -> None:
        await warm.run("v1", disk, str(path), runs)  # type: ignore[arg-type]

    run(main)


def test_the_working_set_is_stored_a_piece_at_a_time_as_the_disk_reads_it(tmp_path, stores,
                                                                           caplog):
    ram = tmp_path / "ram"
    ram.write_bytes(b"")
    warm = RamWarmUp()
    runs = [(0, 4096), (PIECE + 100, 2 * PIECE)]  # (the second widened to whole sectors)
    disk = Disk()
    with caplog.at_level(logging.INFO, "layerfs.node.vms.ramwarm"):
        warm_up(warm, disk, ram, runs)
    assert warm.done.is_set()
    assert sorted(disk.reads) == [(0, 4096), (PIECE, PIECE), (2 * PIECE, PIECE),
                                  (3 * PIECE, 512)]
    halves = [(o, n // 2) for o, n in sorted(disk.reads)] + [
        (o + n // 2, n // 2) for o, n in disk.reads]
    assert sorted((o, len(d)) for _, o, d in stores) == sorted(halves)
    for inode, offset, data in stores:
        assert inode == Disk.inode
        assert data == bytes((offset + i) % 251 for i in range(len(data)))
    assert warm.stored == 4096 + 2 * PIECE + 512
    assert f"vm v1: working set read ahead ({warm.stored} bytes in 2 runs" in caplog.text


def test_nothing_is_stored_after_stop_and_a_store_under_way_ends_first(tmp_path, monkeypatch):
    """The guest goes on only after ``stop``: a store after it could replace a
    page the guest has written."""
    ram = tmp_path / "ram"
    ram.write_bytes(b"")
    entered, leave = threading.Event(), threading.Event()
    made: list[int] = []
    first: list[int] = []

    def slow_store(inode: int, offset: int, data: bytes) -> None:  # (under the warm-up's lock)
        if not entered.is_set():
            first.append(offset)
            entered.set()
            leave.wait(10)
        made.append(offset)

    monkeypatch.setattr(ramwarm.pyfuse3, "notify_store", slow_store)
    warm = RamWarmUp()
    stopped: list[list[int]] = []

    def stop_while_storing() -> None:
        assert entered.wait(10)
        timer = threading.Timer(0.2, leave.set)
        timer.start()
        warm.stop()  # waits for the store under way
        stopped.append(list(made))
        timer.join()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, stop_while_storing)
            await warm.run("v1", Disk(), str(ram), [(0, RAM)])  # type: ignore[arg-type]

    run(main)
    assert first[0] in stopped[0]  # the store under way had ended when stop returned
    assert made == stopped[0]  # and none came after
    assert warm.done.is_set()


@pytest.mark.daemon_log(r"WARNING layerfs\.node\.vms\.ramwarm: vm v1: its working set is not "
                        r"read ahead \(store unreachable: test store is down\)")
def test_a_failed_read_is_one_warning_and_lets_the_guest_go_on(tmp_path, stores, caplog):
    ram = tmp_path / "ram"
    ram.write_bytes(b"")
    warm = RamWarmUp()
    with caplog.at_level(logging.DEBUG, "layerfs.node.vms.ramwarm"):
        warm_up(warm, Disk(fail_at=PIECE), ram, [(0, RAM)])
    assert warm.done.is_set()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.getMessage() for r in warnings] == [
        "vm v1: its working set is not read ahead (store unreachable: test store is down): "
        "the guest faults it in"]
    assert all(o != PIECE for _, o, _ in stores)
    caplog.clear()
    stopped = RamWarmUp()  # the vm goes down while a read is under way: it fails
    with caplog.at_level(logging.DEBUG, "layerfs.node.vms.ramwarm"):
        warm_up(stopped, Disk(fail_at=0, before_failing=stopped.stopped), ram, [(0, 4096)])
    assert stopped.done.is_set()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "its working set's read ahead ended: store unreachable" in caplog.text


@pytest.mark.daemon_log(r"WARNING layerfs\.node\.vms\.ramwarm: vm v1: its working set is not "
                        r"read ahead \(store unreachable: test store is down\)",
                        r"ERROR layerfs\.node\.vms\.ramwarm: vm v1: its working set's read "
                        r"ahead failed: ValueError\('not a disk'\)")
def test_a_group_of_failures_is_one_line_and_never_ends_the_task_it_runs_in(tmp_path, stores,
                                                                             caplog):
    """A read of several chunks fails as a group (one failure of each chunk
    read in parallel): the first is the warning. A failure of a kind a
    warm-up does not expect is one error line: the task group the daemon
    runs its warm-ups in goes on."""
    ram = tmp_path / "ram"
    ram.write_bytes(b"")
    group = ExceptionGroup("reads", [StoreUnreachable("test store is down")])
    warm = RamWarmUp()
    warm_up(warm, Disk(fail_at=0, error=group), ram, [(0, 4096)])
    assert warm.done.is_set()
    odd = RamWarmUp()
    warm_up(odd, Disk(fail_at=0, error=ExceptionGroup("reads", [ValueError("not a disk")])),
            ram, [(0, 4096)])
    assert odd.done.is_set()
    assert caplog.text.count("vm v1: its working set") == 2


def test_a_warm_up_cancelled_with_the_daemon_ends_without_waiting_for_its_file(tmp_path,
                                                                               stores):
    """The daemon stops: the warm-up's task is cancelled, and ends even while
    its file's close (a request the stopping daemon would answer) hangs."""
    ram = tmp_path / "ram"
    ram.write_bytes(b"")
    hang = threading.Event()
    real_close = ramwarm.os.close

    closed: list[int] = []
    entered = threading.Event()

    def stuck_close(fd: int) -> None:
        entered.set()
        hang.wait(10)
        real_close(fd)
        closed.append(fd)

    warm = RamWarmUp()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(warm.run, "v1", Disk(), str(ram), [(0, 4096)])
            assert await trio.to_thread.run_sync(entered.wait, 10)  # its close hangs
            nursery.cancel_scope.cancel()  # the daemon stops

    ramwarm.os.close = stuck_close  # type: ignore[assignment]
    try:
        run(main)
        assert closed == []  # it ended while its close still hung
    finally:
        ramwarm.os.close = real_close  # type: ignore[assignment]
        hang.set()
    assert warm.done.is_set()


@pytest.mark.daemon_log(r"WARNING layerfs\.node\.vms\.ramwarm: vm v1: its working set is not "
                        r"read ahead \(\[Errno 2\] No such file")
def test_a_ram_file_that_cannot_be_opened_is_one_warning(tmp_path, stores, caplog):
    warm = RamWarmUp()
    warm_up(warm, Disk(), tmp_path / "gone", [(0, 4096)])
    assert warm.done.is_set() and stores == []
    assert "vm v1: its working set is not read ahead" in caplog.text
