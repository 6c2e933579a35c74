"""The suite's log check: which daemon log records fail a test, and which a
test may declare (tests/support/nodes.py, tests/conftest.py)."""

from __future__ import annotations

import errno
import logging
import re

import pytest
from support import nodes
from support.nodes import NodeDaemon

from harness.daemonproc import problem_records

LOG = """\
2026-12-01 08:00:00,001 INFO layerfs.node.daemon.service: daemon up
2026-12-01 08:00:01,002 WARNING layerfs.node.daemon.service: unmounted stale /x/fuse
2026-12-01 08:00:02,003 ERROR layerfs.node.control: up failed
Traceback (most recent call last):
  File "daemon.py", line 1, in up
KeyError: b'sha'
2026-12-01 08:00:03,004 INFO layerfs.node.daemon.service: stopping
Exception ignored in: <function Flight.__del__>
layerfs: error: ROOT is on tmpfs
"""


def heads(records: list[str]) -> list[str]:
    """Each record's first line without its time stamp."""
    return [re.sub(r"^\S+ \S+ ", "", r.splitlines()[0]) if r[:1].isdigit()
            else r.splitlines()[0] for r in records]


def test_problem_records_are_warnings_errors_and_tracebacks():
    records = problem_records(LOG)
    assert heads(records) == ["WARNING layerfs.node.daemon.service: unmounted stale /x/fuse",
                              "ERROR layerfs.node.control: up failed",
                              "Exception ignored in: <function Flight.__del__>",
                              "layerfs: error: ROOT is on tmpfs"]
    assert records[1].endswith("KeyError: b'sha'")  # the traceback stays with its record


def unstarted(tmp_path) -> NodeDaemon:
    """A daemon that never runs, with LOG as its log."""
    daemon = NodeDaemon(tmp_path / "node", [])
    daemon.log_path.write_text(LOG)
    return daemon


def test_undeclared_daemon_records_are_found_once(tmp_path):
    daemon = unstarted(tmp_path)
    found = daemon.unexpected_log()
    assert len(found) == 4 and "KeyError" in found[1]
    assert daemon.unexpected_log() == []  # checked already
    with open(daemon.log_path, "a") as log:
        log.write("2026-12-01 08:00:04,005 WARNING layerfs.node.reads.fetcher: late\n")
    with pytest.raises(AssertionError, match="(?s)1 unexpected record.*late"):
        daemon.check_log()


def test_declared_records_pass(tmp_path):
    daemon = unstarted(tmp_path).expect_log(r"unmounted stale", r"up failed")
    nodes.TEST_EXPECTS.append(re.compile(r"Exception ignored|tmpfs"))
    try:
        assert daemon.unexpected_log() == []
    finally:
        nodes.TEST_EXPECTS.pop()


@pytest.mark.daemon_log(r"ROOT is on tmpfs", r"stale")
def test_the_marker_declares_for_every_daemon_of_the_test(tmp_path):
    daemon = unstarted(tmp_path)
    assert heads(daemon.unexpected_log()) == ["ERROR layerfs.node.control: up failed",
                                              "Exception ignored in: <function Flight.__del__>"]


def test_in_process_records_of_warning_or_worse_fail_unless_declared():
    def record(level: int, message: str) -> logging.LogRecord:
        return logging.LogRecord("layerfs.node.reads", level, __file__, 1, message, (), None)

    records = [record(logging.INFO, "fine"), record(logging.WARNING, "cache file damaged"),
               record(logging.ERROR, "store down")]
    assert nodes.unexpected_records(records, []) == [
        "WARNING layerfs.node.reads: cache file damaged", "ERROR layerfs.node.reads: store down"]
    assert nodes.unexpected_records(records, [re.compile("damaged|down")]) == []


@pytest.mark.daemon_log(r"ERROR layerfs\.node\.fuse\.nodefs: read: integrity check failed for "
                        r"chunk c")
def test_a_read_whose_parallel_parts_fail_logs_one_line_not_a_traceback(caplog):
    """A read over several chunks fetches them in a nursery: their FetchErrors
    come as an ExceptionGroup, which is EIO and one line like a single failure."""
    import pyfuse3
    import trio

    from layerfs.errors import IntegrityError
    from layerfs.node.fuse.nodefs import fuse_errors

    @fuse_errors
    async def read() -> bytes:
        raise ExceptionGroup("parts", [IntegrityError("chunk c", "sha256 mismatch")])

    with pytest.raises(pyfuse3.FUSEError) as caught:
        trio.run(read)
    assert caught.value.errno == errno.EIO
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in errors] == [
        "read: integrity check failed for chunk c: sha256 mismatch"]
    assert errors[0].exc_info is None  # no traceback: a known failure
