"""How the store's failures reach users: concurrent identical builds, one
error class per kind of failure (missing, unavailable, unreachable, denied,
corrupt) in the CLI, in ``verify`` and in the daemon's log, and a push that
gives up within its deadline when the store stops answering."""

from __future__ import annotations

import http.server
import logging
import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
import trio
from conftest import TEST_BUCKET
from conftest import _create_bucket as create_test_bucket
from support import build
from support.cli import layerfs
from support.faultstore import FAST_RETRY, Fault, FaultStore
from support.gentree import write_tree

from harness.s3server import DUMMY_AWS_ENV, find_weed, free_ports, start_server
from layerfs.builder.disk import build_disk
from layerfs.builder.env import create_env
from layerfs.errors import (
    AccessDenied,
    IntegrityError,
    NoProgress,
    NoProgressUnavailable,
    ObjectNotFound,
    ObjectUnavailable,
    StoreUnreachable,
    VersionExists,
)
from layerfs.node.daemon.controlserver import exit_code_of
from layerfs.node.reads.chunkcache import ChunkCache
from layerfs.node.reads.fetcher import ChunkFetcher, FetchError
from layerfs.refstore import ENVS, LAYERS, RefStore
from layerfs.store.base import RetryPolicy, blob_key
from layerfs.store.file import FileStore
from layerfs.store.s3 import S3Store
from layerfs.verify import EXIT_CODES, Found, verify_layer, worst

pytestmark = pytest.mark.end_to_end  # the CLI and outside tools, end to end

# ------------------------------------------------ identical builds at once


def racing_refs(store) -> FaultStore:
    """``store`` where two writers of a ref meet before either writes it."""
    faulty = FaultStore(store)
    barrier = threading.Barrier(2, timeout=30)
    faulty.inject(Fault("put_if_absent", "refs/", hook=barrier.wait))
    return faulty


def build_both(store, sources: list[str]) -> list:
    """Build each source to t@1 in its own thread at once; results or errors."""
    def one(src: str):
        try:
            return build(store, src, chunk_size=16384, workers=2)
        except VersionExists as exc:
            return exc

    with ThreadPoolExecutor(len(sources)) as pool:
        return list(pool.map(one, sources))


def test_identical_builds_at_once_both_succeed(tmp_path, store):
    write_tree(tmp_path / "a", 1, files=20)
    results = build_both(racing_refs(store), [str(tmp_path / "a")] * 2)
    assert not [r for r in results if isinstance(r, Exception)], results
    assert sorted(r.published for r in results) == [False, True]
    named = RefStore(store).resolve(LAYERS, "t@1")
    assert [r.digest for r in results] == [named, named]  # the loser reports the winner's layer


def test_different_builds_at_once_one_fails(tmp_path, store):
    write_tree(tmp_path / "a", 1, files=20)
    write_tree(tmp_path / "b", 2, files=20)
    results = build_both(racing_refs(store), [str(tmp_path / "a"), str(tmp_path / "b")])
    failed = [r for r in results if isinstance(r, VersionExists)]
    assert len(failed) == 1 and failed[0].exit_code == 4
    won = next(r for r in results if not isinstance(r, Exception))
    assert RefStore(store).resolve(LAYERS, "t@1") == won.digest


def push_disks_both(store, images: list[Path]) -> list:
    """Push each raw image to d@1 in its own thread at once; results or errors."""
    def one(image: Path):
        try:
            return build_disk(RefStore(store), str(image), "d", "1", chunk_size=65536)
        except VersionExists as exc:
            return exc

    with ThreadPoolExecutor(len(images)) as pool:
        return list(pool.map(one, images))


def raw_image(path: Path, seed: int) -> Path:
    path.write_bytes(random.Random(seed).randbytes(256 << 10) + bytes(256 << 10))
    return path


def test_identical_disk_pushes_at_once_both_succeed(tmp_path, store, monkeypatch):
    """The recipe layers use (layerfs/builder/layer.py): the push that loses the
    race finds the other's disk of the same content, though its manifest was
    made in another second (its ``created`` differs)."""
    seconds = iter(range(10))
    monkeypatch.setattr("layerfs.builder.disk.now_utc",
                        lambda: f"2026-01-01T00:00:0{next(seconds)}Z")
    image = raw_image(tmp_path / "a.img", 1)
    results = push_disks_both(racing_refs(store), [image, image])
    assert not [r for r in results if isinstance(r, Exception)], results
    assert sorted(r.published for r in results) == [False, True]
    named = RefStore(store).resolve(LAYERS, "d@1")
    assert [r.digest for r in results] == [named, named]


def test_different_disk_pushes_at_once_one_fails(tmp_path, store):
    results = push_disks_both(racing_refs(store), [raw_image(tmp_path / "a.img", 1),
                                                   raw_image(tmp_path / "b.img", 2)])
    failed = [r for r in results if isinstance(r, VersionExists)]
    assert len(failed) == 1 and failed[0].exit_code == 4
    won = next(r for r in results if not isinstance(r, Exception))
    assert RefStore(store).resolve(LAYERS, "d@1") == won.digest


def test_identical_env_creates_at_once_both_succeed(tmp_path, store):
    write_tree(tmp_path / "a", 1, files=4)
    build(store, str(tmp_path / "a"), name="base", chunk_size=16384)
    faulty = racing_refs(store)
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: create_env(RefStore(faulty), "e", "1", ["base@1"]),
                                range(2)))
    assert sorted(r.published for r in results) == [False, True]
    assert {r.digest for r in results} == {RefStore(store).resolve(ENVS, "e@1")}


# ------------------------------------------------ one error class per kind of failure


def built_layer(tmp_path, store, files: int = 12):
    """A layer t@1 with several packs; its registry and chunk table."""
    write_tree(tmp_path / "src", 3, files=files)
    result = build(store, str(tmp_path / "src"), chunk_size=16384, pack_size=65536)
    refstore = RefStore(store)
    return refstore, result, refstore.chunk_table(result.manifest)


def test_store_errors_have_their_own_classes_and_codes():
    kinds = [ObjectNotFound, ObjectUnavailable, StoreUnreachable, AccessDenied, IntegrityError]
    assert len({k.exit_code for k in kinds}) == len(kinds)
    messages = {k: k("x", "y").message() for k in kinds}
    assert messages[ObjectUnavailable].startswith("object unavailable")
    assert messages[StoreUnreachable].startswith("store unreachable")
    assert messages[AccessDenied].startswith("access denied")


def test_verify_lists_what_it_found_per_object(tmp_path, store):
    refstore, result, table = built_layer(tmp_path, store)
    packs = sorted(table.packs())
    assert len(packs) >= 4
    unavailable, missing, corrupt = packs[0], packs[1], packs[2]
    faulty = FaultStore(store)
    faulty.inject(Fault("get", blob_key(unavailable)[-64:],
                        error=lambda key: ObjectUnavailable(f"get {key}: InternalError")))
    store.delete(blob_key(missing))
    entry = next(e for e in table.entries if e.pack == corrupt)
    data = bytearray(store.get(blob_key(corrupt)))
    data[entry.pack_offset] ^= 0xFF
    store.put(blob_key(corrupt), bytes(data))

    report = verify_layer(RefStore(faulty), result.digest)
    found = {o.digest: o.found for o in report.objects if o.what == "pack"}
    assert found[unavailable] is Found.UNAVAILABLE
    assert found[missing] is Found.MISSING
    assert found[corrupt] is Found.CORRUPT
    assert {found[p] for p in packs[3:]} == {Found.OK}
    assert [o.found for o in report.objects if o.what != "pack"] == [Found.OK, Found.OK]
    assert report.found is Found.CORRUPT  # the worst
    assert EXIT_CODES[worst([Found.UNAVAILABLE, Found.MISSING])] == ObjectNotFound.exit_code


def test_verify_exit_code_is_the_worst_object(tmp_path, store, store_args):
    _, _, table = built_layer(tmp_path, store)
    missing = sorted(table.packs())[0]
    store.delete(blob_key(missing))
    proc = layerfs("verify", "t@1", *store_args, check=False)
    assert proc.returncode == ObjectNotFound.exit_code, proc.stderr
    assert f"  missing     pack {missing}" in proc.stdout
    assert proc.stdout.count("  ok          pack ") == len(table.packs()) - 1
    assert proc.stderr == "layerfs: error: verify t@1: 1 bad objects (1 missing)\n"


class UnavailableS3(http.server.BaseHTTPRequestHandler):
    """An S3 endpoint that answers every request 503 ServiceUnavailable."""

    def _unavailable(self) -> None:
        body = b"<Error><Code>ServiceUnavailable</Code><Message>volume lost</Message></Error>"
        self.send_response(503)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _unavailable

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def unavailable_endpoint(starts_a_server):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), UnavailableS3)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def cli_error(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("layerfs: error: "), proc.stderr
    return lines[0]


def test_cli_unavailable_store_is_its_own_exit(unavailable_endpoint, monkeypatch):
    for name, value in DUMMY_AWS_ENV.items():
        monkeypatch.setenv(name, value)
    proc = layerfs("ls", "--store", "s3://bkt/p", "--s3-endpoint", unavailable_endpoint,
                   check=False)
    assert proc.returncode == ObjectUnavailable.exit_code
    assert "object unavailable" in cli_error(proc) and "ServiceUnavailable" in proc.stderr


def test_cli_unreachable_store_is_its_own_exit(monkeypatch):
    for name, value in DUMMY_AWS_ENV.items():
        monkeypatch.setenv(name, value)
    endpoint = f"http://127.0.0.1:{free_ports(1)[0]}"  # a stopped server: nothing listens
    proc = layerfs("ls", "--store", "s3://bkt/p", "--s3-endpoint", endpoint, check=False)
    assert proc.returncode == StoreUnreachable.exit_code
    assert cli_error(proc).startswith(f"layerfs: error: store unreachable: {endpoint}")


def test_cli_denied_is_its_own_exit(s3_server, monkeypatch):
    for name, value in DUMMY_AWS_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    proc = layerfs("ls", "--store", f"s3://{TEST_BUCKET}/denied", "--s3-endpoint",
                   s3_server.endpoint, check=False)
    assert proc.returncode == AccessDenied.exit_code
    assert cli_error(proc).startswith("layerfs: error: access denied by store: ")


@pytest.mark.daemon_log(r"ERROR layerfs\.node\.reads\.fetcher: .*: object unavailable \(the store "
                        r"answers but cannot serve it now\): get blobs/sha256/")
def test_fetcher_log_names_the_error_class(tmp_path, caplog):
    store = FileStore(tmp_path / "store")
    _, _, table = built_layer(tmp_path, store, files=2)
    entry = table.entries[0]
    faulty = FaultStore(store)
    faulty.inject(Fault("get", entry.pack[7:],
                        error=lambda key: ObjectUnavailable(f"get {key}: InternalError")))
    fetcher = ChunkFetcher(faulty, ChunkCache(tmp_path / "cache", 1 << 20), timeout=10)

    async def main() -> FetchError:
        with pytest.raises(FetchError) as info:
            await fetcher.get(entry)
        return info.value

    error = trio.run(main)
    assert exit_code_of(error) == ObjectUnavailable.exit_code
    logged = [r.getMessage() for r in caplog.records if r.name == "layerfs.node.reads.fetcher"]
    assert any("object unavailable" in line for line in logged), logged


# ------------------------------------------------ a push's deadline


@pytest.fixture(scope="module")
def own_s3_server(starts_a_server, tmp_path_factory):
    """A SeaweedFS of these tests' own (they freeze it), with the test bucket."""
    weed = find_weed()
    if weed is None:
        pytest.fail("SeaweedFS 'weed' binary not found (make deps installs it)")
    with pytest.MonkeyPatch.context() as env:
        for name, value in DUMMY_AWS_ENV.items():
            env.setenv(name, value)
        server = start_server(weed, tmp_path_factory.mktemp("frozen-seaweedfs"))
        try:
            create_test_bucket(server.endpoint)
            yield server
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
            server.stop()


@contextmanager
def frozen(server):
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.process.pid, signal.SIGCONT)


def test_retries_are_logged_at_info(tmp_path, caplog):
    faulty = FaultStore(FileStore(tmp_path / "store"))
    fault = faulty.inject(Fault("put", "refs/", error=lambda key: ObjectUnavailable(key)))
    with caplog.at_level(logging.INFO, logger="layerfs.store.base"), \
            pytest.raises(ObjectUnavailable):
        faulty.put("refs/x", b"1")
    retries = [r for r in caplog.records if "retry" in r.getMessage()]
    assert fault.hits == FAST_RETRY.attempts
    assert [r.levelno for r in retries] == [logging.INFO] * (FAST_RETRY.attempts - 1)


def test_s3_push_to_a_frozen_store_gives_up_at_its_timeout(own_s3_server, monkeypatch):
    for name, value in DUMMY_AWS_ENV.items():
        monkeypatch.setenv(name, value)
    store = S3Store(TEST_BUCKET, "frozen", endpoint=own_s3_server.endpoint)
    store.set_timeout(2)
    store.put("refs/before", b"1")
    with frozen(own_s3_server):
        with pytest.raises(NoProgress) as info:
            store.put_blob(b"pack bytes" * 1000)
        assert info.value.exit_code == StoreUnreachable.exit_code
        assert "no progress for 2s" in str(info.value)
    store.close()


def test_cli_build_to_a_frozen_store_exits_at_its_timeout(tmp_path, own_s3_server,
                                                          monkeypatch):
    for name, value in DUMMY_AWS_ENV.items():
        monkeypatch.setenv(name, value)
    write_tree(tmp_path / "src", 4, files=6)
    with frozen(own_s3_server):
        proc = layerfs("build", str(tmp_path / "src"), "--name", "t", "--version", "1",
                       "--timeout", "3", "--store", f"s3://{TEST_BUCKET}/frozen",
                       "--s3-endpoint", own_s3_server.endpoint, check=False)
    assert proc.returncode == StoreUnreachable.exit_code, proc.stderr
    assert cli_error(proc).startswith("layerfs: error: store unreachable: no progress for 3s "
                                      "(--timeout), giving up: ")


def test_file_store_write_blocked_on_a_hung_mount_gives_up_at_its_timeout(tmp_path,
                                                                         monkeypatch):
    """A write(2) that never returns (a network mount whose server is gone) is
    left in its thread; the call fails at the store's timeout."""
    import layerfs.store.file as file_store

    hung = threading.Event()
    real_fsync = os.fsync
    monkeypatch.setattr(file_store.os, "fsync",
                        lambda fd: hung.wait() if not hung.is_set() else real_fsync(fd))
    store = FileStore(tmp_path / "store")
    store.set_timeout(1)
    try:
        with pytest.raises(NoProgress) as info:
            store.put_blob(b"pack bytes")
        assert "no answer from the file system" in str(info.value)
    finally:
        hung.set()


# ------------------------------------------------ the deadline is a deadline, whatever the errors

PATIENT = RetryPolicy(attempts=50, base_delay=0.05, max_delay=0.2)  # the deadline ends it first
SLACK = 15.0  # a correctness bound on a loaded machine, not a speed benchmark


def blocked_puts(tmp_path, hook, error=None) -> FaultStore:
    """A file store whose blob and ref writes run ``hook`` first, then raise ``error``."""
    faulty = FaultStore(FileStore(tmp_path / "store"), retry=PATIENT)
    faulty.inject(Fault("put", "blobs/", error=error, hook=hook))
    faulty.inject(Fault("put_if_absent", "refs/", error=error, hook=hook))
    return faulty


def push_in_thread(store, src: str, timeout: float) -> tuple[BaseException | None, float]:
    """Push ``src`` (many packs, so several uploads are in flight) with the store's
    ``timeout``; the push's error (None: it did not end within timeout + SLACK)
    and how long it ran."""
    store.set_timeout(timeout)
    outcome: list[BaseException] = []

    def push() -> None:
        try:
            build(store, src, chunk_size=16384, pack_size=65536, workers=2)
        except BaseException as exc:  # noqa: BLE001 - examined by the test
            outcome.append(exc)

    started = time.monotonic()
    thread = threading.Thread(target=push, daemon=True)
    thread.start()
    thread.join(timeout + SLACK)
    elapsed = time.monotonic() - started
    return (outcome[0] if outcome else None), elapsed


def test_a_push_whose_puts_answer_5xx_slowly_ends_at_its_timeout(tmp_path):
    """Regression: an unavailable object (a 5xx) was retried past --timeout, each
    attempt as long as the store took to answer it."""
    write_tree(tmp_path / "src", 5, files=30)
    faulty = blocked_puts(tmp_path, hook=lambda: time.sleep(1.2),
                          error=lambda key: ObjectUnavailable(f"put {key}: InternalError"))
    error, elapsed = push_in_thread(faulty, str(tmp_path / "src"), timeout=3)
    assert isinstance(error, NoProgressUnavailable), (error, elapsed)
    assert error.exit_code == ObjectUnavailable.exit_code == 11
    assert str(error).startswith("object unavailable: no progress for 3s (--timeout), giving up:")
    assert "InternalError" in str(error)  # the last error the store answered
    assert 3 <= elapsed < 3 + SLACK


def test_a_push_whose_puts_hang_ends_at_its_timeout(tmp_path):
    """Every upload in flight is cut when the stall reaches the timeout, and the
    queued ones are not sent."""
    write_tree(tmp_path / "src", 6, files=30)
    release = threading.Event()
    faulty = blocked_puts(tmp_path, hook=release.wait)
    try:
        error, elapsed = push_in_thread(faulty, str(tmp_path / "src"), timeout=3)
    finally:
        release.set()
    assert isinstance(error, NoProgress), (error, elapsed)
    assert error.exit_code == StoreUnreachable.exit_code == 8
    assert "no progress for 3s (--timeout), giving up: " in str(error)
    assert "no answer from" in str(error) and "in time (3s without progress)" in str(error)
    assert 3 <= elapsed < 3 + SLACK
    puts = sum(f.hits for f in faulty.faults)
    assert puts <= 4, puts  # the two in flight (and their retries at most), nothing queued


def test_a_call_in_flight_is_cut_when_another_gives_up(tmp_path):
    """A hung write started later than the stall is cut with it, not at its own deadline."""
    release = threading.Event()
    faulty = blocked_puts(tmp_path, hook=release.wait)
    faulty.set_timeout(2)
    errors: list[BaseException] = []

    def put(key: str) -> None:
        try:
            faulty.put(key, b"x")
        except BaseException as exc:  # noqa: BLE001 - examined by the test
            errors.append(exc)

    first = threading.Thread(target=put, args=("blobs/sha256/" + "a" * 64,))
    started = time.monotonic()
    first.start()
    time.sleep(1.5)
    later = threading.Thread(target=put, args=("blobs/sha256/" + "b" * 64,))
    later.start()
    first.join(10)
    later.join(10)
    release.set()
    assert [type(e) for e in errors] == [NoProgress, NoProgress]
    assert time.monotonic() - started < 2 + 1.0  # the later one did not run to 1.5 + 2 s



class SlowUnavailablePuts(http.server.BaseHTTPRequestHandler):
    """An S3 endpoint of an empty bucket whose writes all answer 503 after 1.2 s
    (a gateway retrying lost volume servers before it gives up)."""

    protocol_version = "HTTP/1.1"
    EMPTY = (b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult><Name>bkt</Name>'
             b"<KeyCount>0</KeyCount><MaxKeys>1000</MaxKeys><IsTruncated>false</IsTruncated>"
             b"</ListBucketResult>")

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            try:
                self.wfile.write(body)
            except BrokenPipeError:  # the client gave up waiting (its deadline)
                self.close_connection = True

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if "list-type=2" in self.path:
            self._answer(200, self.EMPTY)
        else:
            self._answer(404, b"<Error><Code>NoSuchKey</Code><Message>none</Message></Error>")

    do_HEAD = do_GET

    def do_PUT(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        time.sleep(1.2)
        self._answer(503, b"<Error><Code>ServiceUnavailable</Code>"
                          b"<Message>volume servers lost</Message></Error>")

    def log_message(self, *args: object) -> None:
        pass


def test_cli_build_to_slow_5xx_writes_exits_at_its_timeout(tmp_path, monkeypatch):
    for name, value in DUMMY_AWS_ENV.items():
        monkeypatch.setenv(name, value)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), SlowUnavailablePuts)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    write_tree(tmp_path / "src", 7, files=30)
    try:
        started = time.monotonic()
        proc = layerfs("build", str(tmp_path / "src"), "--name", "t", "--version", "1",
                       "--timeout", "3", "--store", "s3://bkt/p", "--s3-endpoint",
                       f"http://127.0.0.1:{server.server_address[1]}", check=False)
        elapsed = time.monotonic() - started
    finally:
        server.shutdown()
        server.server_close()
    assert proc.returncode == ObjectUnavailable.exit_code, proc.stderr
    assert cli_error(proc).startswith("layerfs: error: object unavailable: no progress for 3s "
                                      "(--timeout), giving up: "), proc.stderr
    assert "ServiceUnavailable" in proc.stderr
    assert 3 <= elapsed < 3 + SLACK
