"""A store shared by several writers: the file store's read-back after each
write, and ``layerfs store check`` (races against a store, one verdict line)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from layerfs.errors import TransientStoreError
from layerfs.store import RetryPolicy
from layerfs.store import file as file_store
from layerfs.store.check import CheckPlan, WriterReport, digest, judge, token
from layerfs.store.file import FileStore

KEY = "refs/layers/app/1"


def layerfs(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "layerfs.cli.main", *args],
                          capture_output=True, text=True, timeout=120)


def test_put_if_absent_loses_when_another_clients_create_lands_over_its_link(tmp_path,
                                                                            monkeypatch):
    """Regression (issue 16, item 5): on a shared file system both clients' link(2)
    "succeeded"; the one whose bytes are not there afterwards must not win."""
    real_link = os.link

    def link_then_other_client_writes(src: str, dst: str, **at: object) -> None:
        real_link(src, dst, **at)  # type: ignore[arg-type]
        (tmp_path / "store" / KEY).write_bytes(b"sha256:the other client's digest\n")

    monkeypatch.setattr(file_store.os, "link", link_then_other_client_writes)
    store = FileStore(tmp_path / "store")
    assert store.put_if_absent(KEY, b"sha256:mine\n") is False
    assert store.get(KEY) == b"sha256:the other client's digest\n"


def test_put_if_absent_does_not_win_where_link_ignores_an_existing_key(tmp_path, monkeypatch):
    """A client whose link(2) replaces what another client created (it does not
    see the other's file as existing) must still not win over it."""
    store = FileStore(tmp_path / "store")
    assert store.put_if_absent(KEY, b"sha256:first\n") is True

    def link_replaces(src: str, dst: str, src_dir_fd: int, dst_dir_fd: int,
                      follow_symlinks: bool) -> None:
        # replace(2), not link(2): an existing key is overwritten
        os.replace(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

    monkeypatch.setattr(file_store.os, "link", link_replaces)
    assert store.put_if_absent(KEY, b"sha256:second\n") is False
    assert store.get(KEY) == b"sha256:first\n"


def test_a_put_that_reads_back_torn_bytes_is_a_transient_error(tmp_path, monkeypatch):
    real_replace = os.replace

    def replace_torn(src: str, dst: str, **at: int) -> None:
        real_replace(src, dst, **at)
        with open(tmp_path / "store" / "traces" / dst, "r+b") as f:
            f.truncate(10)

    monkeypatch.setattr(file_store.os, "replace", replace_torn)
    store = FileStore(tmp_path / "store", retry=RetryPolicy(attempts=1))
    with pytest.raises(TransientStoreError, match="read back other bytes"):
        store.put("traces/some-layer", b"a trace record\n" * 100)


def test_store_check_says_a_store_is_safe_to_share(tmp_path, store_args):
    url, endpoint = store_args[1], store_args[3:]  # --store URL [--s3-endpoint EP]
    proc = layerfs("store", "check", url, *(["--s3-endpoint", *endpoint] if endpoint else []),
                   "--rounds", "10", "--writers", "3")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("(10 rounds x 3 writers: 0 double wins, 0 rounds"
                                        " without a winner, 0 wrong read-backs, 0 torn reads)")
    assert "safe to share" in proc.stdout and "NOT" not in proc.stdout
    if url.startswith("file://"):  # nothing left behind
        assert not (Path(url[len("file://"):]) / "check").exists()


def reports(plan: CheckPlan, winners: list[int],
            torn_by: int | None = None) -> list[WriterReport]:
    """Writer reports of one round in which ``winners`` won (and ``torn_by`` read torn)."""
    winner_bytes = digest(token(winners[-1], 0, 64))
    out = []
    for n in range(plan.writers):
        read = digest(b"torn") if n == torn_by else digest(token(0, 0, plan.payload))
        out.append(WriterReport([n in winners], [winner_bytes], [read], []))
    return out


def test_store_check_counts_double_wins_and_torn_reads():
    plan = CheckPlan(("file:///x",), writers=3, rounds=1)
    assert judge(plan, reports(plan, [1])).safe
    double = judge(plan, reports(plan, [0, 2]))
    assert (double.double_wins, double.safe) == (1, False)
    assert "NOT safe to share" in double.verdict()
    torn = judge(plan, reports(plan, [1], torn_by=2))
    assert (torn.torn_reads, torn.double_wins, torn.safe) == (1, 0, False)
    nobody = judge(plan, [WriterReport([False], [""], [digest(token(0, 0, plan.payload))], [])]
                   * plan.writers)
    assert (nobody.no_wins, nobody.safe) == (1, False)
