"""The store contract, run against the file and S3 backends; backend specifics; retries."""

from __future__ import annotations

import os
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import botocore.exceptions as bx
import pytest

from harness.registryserver import Answer, FakeServer
from harness.s3server import DUMMY_AWS_ENV, S3Server, free_ports
from layerfs.errors import (
    AccessDenied,
    IntegrityError,
    ObjectNotFound,
    ObjectUnavailable,
    StoreError,
    StoreUnreachable,
    TransientStoreError,
    UsageError,
)
from layerfs.store import (
    ObjectInfo,
    RetryPolicy,
    Store,
    blob_key,
    default_store_url,
    open_store,
    sha256_digest,
)
from layerfs.store.base import TEMP_MARK
from layerfs.store.file import FileStore
from layerfs.store.s3 import S3Store
from layerfs.store.s3ranges import Missing, RangeReader, Unsupported

DATA = bytes(range(256)) * 4  # 1024 bytes
INSTANT = RetryPolicy(attempts=4, base_delay=0)


def in_ci() -> bool:
    return os.environ.get("CI") == "true"


def keys(items: list[ObjectInfo]) -> list[str]:
    return [item.key for item in items]


# ---------------------------------------------------------------- the contract


def test_put_get_whole(store: Store) -> None:
    store.put("refs/layers/base/1", DATA)
    assert store.get("refs/layers/base/1") == DATA
    store.put("refs/layers/base/2", "sha256:é".encode())
    assert store.get_text("refs/layers/base/2") == "sha256:é"


def test_empty_object(store: Store) -> None:
    store.put("refs/empty", b"")
    assert store.get("refs/empty") == b""
    info = store.head("refs/empty")
    assert info is not None and (info.key, info.size) == ("refs/empty", 0)
    assert keys(store.list("refs/")) == ["refs/empty"]


def test_put_memoryview(store: Store) -> None:
    store.put("refs/mv", memoryview(b"hello world")[6:])
    assert store.get("refs/mv") == b"world"


RANGES = [
    (0, 1), (0, 10), (10, 20), (1023, 1024), (0, 1024), (None, 5),
    (100, None), (1000, None), (500, 2000), (1024, None), (2000, None), (5, 5), (9, 3),
]  # fmt: skip


def test_range_get(store: Store) -> None:
    store.put("blobs/sha256/" + "a" * 64, DATA)
    for start, end in RANGES:
        got = store.get("blobs/sha256/" + "a" * 64, start, end)
        assert got == DATA[start:end], (start, end)


def test_range_get_missing(store: Store) -> None:
    for start, end in [(0, 10), (10, None), (5, 5)]:
        with pytest.raises(ObjectNotFound):
            store.get("refs/nothing", start, end)


def test_put_overwrite_is_atomic_replace(store: Store) -> None:
    old, new = b"o" * 3000, b"n" * 7000
    store.put("refs/envs/e/1", old)
    done = threading.Event()

    def reader() -> set[bytes]:
        seen: set[bytes] = set()
        while not done.is_set():
            seen.add(store.get("refs/envs/e/1"))
        return seen

    with ThreadPoolExecutor(3) as pool:
        readers = [pool.submit(reader) for _ in range(3)]
        try:
            for i in range(10):
                store.put("refs/envs/e/1", new if i % 2 == 0 else old)
        finally:
            done.set()
        seen = set().union(*(r.result() for r in readers))
    assert seen <= {old, new}
    assert store.get("refs/envs/e/1") == old


def test_put_if_absent(store: Store) -> None:
    assert store.put_if_absent("refs/layers/x/1", b"first") is True
    assert store.put_if_absent("refs/layers/x/1", b"second") is False
    assert store.get("refs/layers/x/1") == b"first"


def test_put_if_absent_race_has_one_winner(store: Store) -> None:
    writers = 4  # SeaweedFS makes losers of a conditional-PUT race wait ~1 s
    barrier = threading.Barrier(writers)

    def write(i: int) -> bool:
        barrier.wait()
        return store.put_if_absent("refs/layers/race/1", f"writer {i}".encode())

    with ThreadPoolExecutor(writers) as pool:
        results = list(pool.map(write, range(writers)))
    assert results.count(True) == 1
    assert store.get("refs/layers/race/1") == f"writer {results.index(True)}".encode()


def test_put_blob_is_write_once(store: Store) -> None:
    digest, uploaded = store.put_blob(b"blob bytes")
    assert digest == sha256_digest(b"blob bytes")
    assert uploaded is True
    assert store.put_blob(b"blob bytes") == (digest, False)
    assert store.exists(blob_key(digest))
    assert store.get_blob(digest) == b"blob bytes"


def test_get_blob_verifies_digest(store: Store) -> None:
    digest, _ = store.put_blob(b"good")
    store.put(blob_key(digest), b"evil")
    with pytest.raises(IntegrityError):
        store.get_blob(digest)
    assert store.get_blob(digest, verify=False) == b"evil"


def test_head_and_exists(store: Store) -> None:
    assert store.head("refs/layers/h/1") is None
    assert not store.exists("refs/layers/h/1")
    store.put("refs/layers/h/1", b"12345")
    info = store.head("refs/layers/h/1")
    assert info is not None
    assert (info.key, info.size) == ("refs/layers/h/1", 5)
    assert abs(info.mtime - time.time()) < 300
    assert store.exists("refs/layers/h/1")
    assert store.head("refs/layers/h") is None  # a "directory" is not an object


def test_list_by_prefix(store: Store) -> None:
    names = ["refs/layers/b/1", "refs/layers/abd/1", "refs/layers/abc/2", "refs/layers/abc/1",
             "refs/layers/ab", "refs/envs/e/1", "blobs/sha256/" + "f" * 64]  # fmt: skip
    for i, name in enumerate(names):
        store.put(name, b"x" * i)
    assert keys(store.list("refs/layers/ab")) == [
        "refs/layers/ab", "refs/layers/abc/1", "refs/layers/abc/2", "refs/layers/abd/1",
    ]  # fmt: skip
    assert keys(store.list("refs/layers/abc/")) == ["refs/layers/abc/1", "refs/layers/abc/2"]
    assert keys(store.list("refs/layers/abc/1")) == ["refs/layers/abc/1"]
    assert keys(store.list("")) == sorted(names)
    assert store.list("refs/nothing") == []
    assert store.list("nothing/at/all/") == []
    sizes = {item.key: item.size for item in store.list("refs/")}
    assert sizes == {name: i for i, name in enumerate(names) if name.startswith("refs/")}
    assert not any(TEMP_MARK in key for key in keys(store.list()))


def test_delete(store: Store) -> None:
    store.put("refs/layers/d/1", b"bye")
    store.delete("refs/layers/d/1")
    assert store.head("refs/layers/d/1") is None
    with pytest.raises(ObjectNotFound):
        store.get("refs/layers/d/1")
    store.delete("refs/layers/d/1")  # again: not an error
    store.delete("never/existed")
    assert store.list() == []


def test_get_missing_raises_object_not_found(store: Store) -> None:
    with pytest.raises(ObjectNotFound) as info:
        store.get("refs/layers/none/1")
    assert "refs/layers/none/1" in str(info.value)
    assert info.value.exit_code == 5
    with pytest.raises(ObjectNotFound):
        store.get_blob(sha256_digest(b"never stored"))


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "a/../b", "../a", "a/", "./a", "a/.tmp~x"])
def test_invalid_keys(store: Store, key: str) -> None:
    for call in (lambda: store.get(key), lambda: store.put(key, b""), lambda: store.head(key)):
        with pytest.raises(ValueError):
            call()


# ---------------------------------------------------------------- file store


FORK_KEYS = 8  # objects, each read and written by both processes after the fork


def _use_concurrently(store: Store, who: str, rounds: int = 10) -> list[str]:
    """From 4 threads at once, reads of the shared objects and writes and reads
    of this process's own; what came back wrong (empty: all right)."""
    def work(thread: int) -> list[str]:
        wrong = []
        for n in range(rounds):
            key = f"refs/fork/shared{(thread + n) % FORK_KEYS}"
            if store.get(key) != key.encode() * 50:
                wrong.append(key)
            own = f"refs/fork/{who}{thread}-{n}"
            store.put(own, own.encode() * 50)
            if store.get(own) != own.encode() * 50 or store.head(own) is None:
                wrong.append(own)
        return wrong

    with ThreadPoolExecutor(4) as pool:
        return [key for found in pool.map(work, range(4)) for key in found]


def test_a_forked_child_uses_the_store_its_parent_used(store: Store) -> None:
    """The child of a process that used the store uses the same store object,
    while the parent goes on using it: a file store's writer threads are not
    inherited by a fork (its pool starts empty in the child), and an S3
    store's pooled connections are not shared with the child (each would read
    the other's answers)."""
    for n in range(FORK_KEYS):
        store.put(f"refs/fork/shared{n}", f"refs/fork/shared{n}".encode() * 50)
    assert _use_concurrently(store, "before") == []  # connections in the pools
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if all its calls worked and read right
        code = 1
        try:
            code = 0 if _use_concurrently(store, "child") == [] else 2
        finally:
            os._exit(code)
    try:
        wrong = _use_concurrently(store, "parent")
    finally:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the child's calls did not end within 60 s")
    assert wrong == []
    assert os.waitstatus_to_exitcode(status) == 0
    assert store.get("refs/fork/child3-9") == b"refs/fork/child3-9" * 50
    assert _use_concurrently(store, "after") == []  # the parent's pools still work


def test_file_store_creates_root_on_first_put(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "a" / "b" / "store")
    assert store.list() == []
    with pytest.raises(ObjectNotFound):
        store.get("refs/x")
    store.put("refs/x", b"1")
    assert (tmp_path / "a/b/store/refs/x").read_bytes() == b"1"


def test_file_store_root_that_cannot_be_created(tmp_path: Path) -> None:
    (tmp_path / "afile").write_bytes(b"")
    store = FileStore(tmp_path / "afile" / "store")
    with pytest.raises(StoreError) as info:
        store.put("refs/x", b"1")
    assert not isinstance(info.value, ObjectNotFound)
    assert "not a directory" in str(info.value)
    assert str(tmp_path / "afile") in str(info.value)


def test_file_store_skips_temp_files(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.put("refs/layers/t/1", b"1")
    (tmp_path / "refs/layers/t" / f"{TEMP_MARK}0123abcd").write_bytes(b"half written")
    assert keys(store.list()) == ["refs/layers/t/1"]
    assert [p.name for p in (tmp_path / "refs/layers/t").iterdir() if p.name != "1"] == [
        f"{TEMP_MARK}0123abcd"
    ]
    store.put_if_absent("refs/layers/t/1", b"2")  # leaves no temp file of its own
    assert len(list((tmp_path / "refs/layers/t").iterdir())) == 2


def test_file_store_urls(tmp_path: Path) -> None:
    store = FileStore.from_url(f"file://{tmp_path}/s")
    assert store.root == tmp_path / "s"
    assert store.url == f"file://{tmp_path}/s"
    with pytest.raises(UsageError):
        FileStore.from_url("file://otherhost/s")


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A small tmpfs mounted for the test (root only), unmounted after."""
    if os.geteuid() != 0:
        if in_ci():
            pytest.fail("the read-only store test needs root in CI")
        pytest.skip("needs root to mount a tmpfs")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "layerfs-test", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_file_store_read_only_is_access_denied(tmpfs: Path) -> None:
    store = FileStore(tmpfs / "store")
    store.put("refs/layers/r/1", b"kept")
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    writes: list[Callable[[], object]] = [
        lambda: store.put("refs/layers/r/1", b"new"),
        lambda: store.put("refs/layers/r/2", b"new"),
        lambda: store.put_if_absent("refs/layers/other/1", b"new"),
        lambda: store.put_blob(b"new"),
        lambda: store.delete("refs/layers/r/1"),
        lambda: FileStore(tmpfs / "fresh").put("refs/x", b"new"),
    ]
    for write in writes:
        with pytest.raises(AccessDenied) as info:
            write()
        assert "read-only file system" in str(info.value)
    assert store.get("refs/layers/r/1") == b"kept"
    assert keys(store.list()) == ["refs/layers/r/1"]


# ---------------------------------------------------------------- S3 store


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in DUMMY_AWS_ENV.items():
        monkeypatch.setenv(name, value)


def test_s3_unreachable_endpoint(aws_env: None) -> None:
    endpoint = f"http://127.0.0.1:{free_ports(1)[0]}"  # nothing listens there
    store = S3Store("layerfs-test", endpoint=endpoint, retry=RetryPolicy(attempts=2, base_delay=0))
    started = time.monotonic()
    for call in (lambda: store.get("refs/x"), lambda: store.get("refs/x", 0, 10)):
        with pytest.raises(StoreUnreachable) as info:
            call()
        assert endpoint in str(info.value)
        assert info.value.exit_code == 8
    assert time.monotonic() - started < 10


def test_s3_makes_one_attempt_per_retry(aws_env: None) -> None:
    endpoint = f"http://127.0.0.1:{free_ports(1)[0]}"
    store = S3Store("layerfs-test", endpoint=endpoint, retry=RetryPolicy(attempts=3, base_delay=0))
    sends: list[object] = []
    store.client.meta.events.register("before-send.s3", lambda **kw: sends.append(kw))
    with pytest.raises(StoreUnreachable):
        store.head("refs/x")
    assert len(sends) == 3  # botocore itself does not retry


def test_s3_missing_bucket(s3_server: S3Server) -> None:
    store = S3Store(f"missing-{uuid.uuid4().hex[:8]}", endpoint=s3_server.endpoint)
    for call in (lambda: store.get("refs/x"), lambda: store.get("refs/x", 1, 5),
                 lambda: store.list(), lambda: store.put("k", b"")):
        with pytest.raises(StoreError, match="does not exist") as info:
            call()
        assert type(info.value) is StoreError


@pytest.mark.parametrize(
    ("key_id", "secret"),
    [(DUMMY_AWS_ENV["AWS_ACCESS_KEY_ID"], "wrong-secret"), ("unknown-key", "whatever")],
)
def test_s3_bad_credentials_are_access_denied(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch, key_id: str, secret: str
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    store = S3Store("layerfs-test", "denied", endpoint=s3_server.endpoint, retry=INSTANT)
    for call in (lambda: store.get("refs/x"), lambda: store.get("refs/x", 0, 1),
                 lambda: store.put("refs/x", b"1"), store.list):
        with pytest.raises(AccessDenied):
            call()


def test_s3_ranged_get_presigns_again_after_a_403(s3_server: S3Server) -> None:
    """A reused presigned URL that the server refuses (credentials rotated) is
    signed again once; the read succeeds."""
    store = S3Store("layerfs-test", f"t/{uuid.uuid4().hex}", endpoint=s3_server.endpoint)
    store.put("blobs/p", DATA)
    assert store.get("blobs/p", 10, 20) == DATA[10:20]
    key = store._key("blobs/p")
    url, at = store.ranges._urls[key]
    tampered = url.replace("X-Amz-Signature=", "X-Amz-Signature=0")
    store.ranges._urls[key] = (tampered, at)
    assert store.get("blobs/p", 30, 40) == DATA[30:40]
    assert store.ranges._urls[key][0] != tampered


def test_s3_serves_as_many_gets_at_once_as_a_daemon_has_threads(s3_server: S3Server) -> None:
    """128 threads at once (as many as the daemon's store threads and trio's
    could be), whole and ranged GETs: every connection goes back to its pool,
    with no pool-full warning (the log check fails a test on one)."""
    store = S3Store("layerfs-test", f"t/{uuid.uuid4().hex}", endpoint=s3_server.endpoint)
    store.put("blobs/p", DATA)
    start = threading.Barrier(128)

    def get(i: int) -> bytes:
        start.wait(10)
        return store.get("blobs/p", i, i + 10) if i % 2 else store.get("blobs/p")

    with ThreadPoolExecutor(128) as pool:
        got = list(pool.map(get, range(128)))
    assert got == [DATA[i:i + 10] if i % 2 else DATA for i in range(128)]


def test_s3_honours_if_none_match(s3_server: S3Server) -> None:
    store = S3Store("layerfs-test", f"t/{uuid.uuid4().hex}", endpoint=s3_server.endpoint)
    assert store.put_if_absent("refs/a", b"1") is True
    with pytest.raises(bx.ClientError) as info:
        store.client.put_object(
            Bucket=store.bucket, Key=store.prefix + "refs/a", Body=b"2", IfNoneMatch="*"
        )
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert store.put_if_absent("refs/a", b"3") is False
    assert store._conditional_put is True  # no fallback to head-then-put
    assert store.get("refs/a") == b"1"


def client_error(code: str, status: int) -> bx.ClientError:
    response = {
        "Error": {"Code": code, "Message": "msg"},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return bx.ClientError(response, "GetObject")  # type: ignore[arg-type]


ERROR_MAP: list[tuple[Exception, type[StoreError]]] = [
    (client_error("NoSuchKey", 404), ObjectNotFound),
    (client_error("404", 404), ObjectNotFound),
    (client_error("AccessDenied", 403), AccessDenied),
    (client_error("InvalidAccessKeyId", 403), AccessDenied),
    (client_error("SignatureDoesNotMatch", 403), AccessDenied),
    (client_error("SlowDown", 503), ObjectUnavailable),
    (client_error("InternalError", 500), ObjectUnavailable),
    (client_error("RequestTimeout", 400), ObjectUnavailable),
    (client_error("InvalidArgument", 400), StoreError),
    (bx.EndpointConnectionError(endpoint_url="http://h"), StoreUnreachable),
    (bx.ConnectTimeoutError(endpoint_url="http://h"), StoreUnreachable),
    (bx.ConnectionClosedError(endpoint_url="http://h"), StoreUnreachable),
    (bx.ReadTimeoutError(endpoint_url="http://h"), StoreUnreachable),
    (bx.IncompleteReadError(actual_bytes=1, expected_bytes=2), ObjectUnavailable),
    (bx.NoCredentialsError(), AccessDenied),
]


@pytest.mark.parametrize(("exc", "expected"), ERROR_MAP, ids=lambda v: type(v).__name__)
def test_s3_error_mapping(aws_env: None, exc: Exception, expected: type[StoreError]) -> None:
    store = S3Store("bkt", "pre", endpoint="http://127.0.0.1:9")
    assert type(store._error(exc, "refs/k", "get")) is expected


class Reply:
    def __init__(self, status: int, code: str = "") -> None:
        self.status = status
        self.data = f"<Error><Code>{code}</Code></Error>".encode() if code else b""


RANGE_ERRORS: list[tuple[Reply, type[Exception] | None]] = [
    (Reply(416, "InvalidRange"), None),
    (Reply(404, "NoSuchKey"), Missing),
    (Reply(404, "NoSuchBucket"), Missing),
    (Reply(403, "AccessDenied"), AccessDenied),
    (Reply(503, "SlowDown"), ObjectUnavailable),
    (Reply(500), ObjectUnavailable),
    (Reply(301, "PermanentRedirect"), Unsupported),
    (Reply(400, "AuthorizationQueryParametersError"), Unsupported),
    (Reply(400, "InvalidArgument"), StoreError),
]


@pytest.mark.parametrize(("reply", "expected"), RANGE_ERRORS,
                         ids=lambda v: f"{v.status}" if isinstance(v, Reply) else "")
def test_s3_ranged_get_error_mapping(reply: Reply, expected: type[Exception] | None) -> None:
    reader = RangeReader(None, "bkt", "http://127.0.0.1:9")
    if expected is None:
        assert reader._failed(reply, "k") == b""
    else:
        with pytest.raises(expected) as info:
            reader._failed(reply, "k")
        assert type(info.value) is expected


class PresignedAt:
    """A stand-in boto3 client: presigns every key as a URL of ``base``."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.presigned: list[str] = []

    def generate_presigned_url(self, op: str, Params: dict, ExpiresIn: int) -> str:  # noqa: N803
        self.presigned.append(Params["Key"])
        return f"{self.base}/{Params['Key']}"


@pytest.mark.parametrize("ranged", [False, True], ids=["whole", "range"])
def test_s3_a_body_that_breaks_off_is_that_object_unavailable(ranged: bool) -> None:
    """A reply that ends before its Content-Length: the object unavailable (that
    pack backs off), not the store unreachable (every read would)."""
    cut = Answer(206 if ranged else 200, b"x" * 1000, length=5000)
    with FakeServer(lambda path, headers: cut) as fake:
        reader = RangeReader(PresignedAt(f"http://{fake.host}"), "bkt", f"http://{fake.host}")
        with pytest.raises(ObjectUnavailable, match="k"):
            reader.get("k", 10 if ranged else 0, 5010 if ranged else None)


def test_s3_presigned_urls_kept_are_the_most_recently_used(monkeypatch) -> None:
    monkeypatch.setattr("layerfs.store.s3ranges.MAX_URLS", 3)
    client = PresignedAt("http://127.0.0.1:9")
    reader = RangeReader(client, "bkt", "http://127.0.0.1:9")
    for key in ("a", "b", "c", "a", "d", "a", "b"):
        reader._url(key, fresh=False)
    assert client.presigned == ["a", "b", "c", "d", "b"]  # d pushed b out, not a
    assert list(reader._urls) == ["d", "a", "b"]


@pytest.mark.parametrize(("code", "status"), [
    ("RequestTimeout", 400), ("ExpiredToken", 400), ("InvalidToken", 400), ("SlowDown", 503),
    ("AccessDenied", 403), ("InternalError", 500), ("InvalidArgument", 400)])
def test_s3_both_read_paths_map_an_error_reply_alike(aws_env: None, code: str,
                                                      status: int) -> None:
    store = S3Store("bkt", "pre", endpoint="http://127.0.0.1:9")
    through_boto3 = store._error(client_error(code, status), "k", "get")
    with pytest.raises(StoreError) as info:
        RangeReader(None, "bkt", "http://127.0.0.1:9")._failed(Reply(status, code), "k")
    assert type(info.value) is type(through_boto3)


def test_s3_whole_and_ranged_gets_take_the_presigned_path(s3_server: S3Server) -> None:
    """A whole object (a ref, a manifest), an empty one and a range: each one
    presigned GET, none through boto3's get_object; a missing object is
    ObjectNotFound as through boto3."""
    store = S3Store("layerfs-test", f"t/{uuid.uuid4().hex}", endpoint=s3_server.endpoint)
    store.put("blobs/p", DATA)
    store.put("refs/e", b"")
    assert store.ranges is not None
    lean, through_boto3 = [], []
    get, get_object = store.ranges.get, store.client.get_object
    store.ranges.get = lambda *a: lean.append(a[1:]) or get(*a)  # type: ignore[method-assign]
    store.client.get_object = lambda **kw: through_boto3.append(kw) or get_object(**kw)
    assert store.get("blobs/p") == DATA
    assert store.get("refs/e") == b""
    assert store.get("blobs/p", 3, 9) == DATA[3:9]
    with pytest.raises(ObjectNotFound):
        store.get("blobs/none")
    assert lean == [(0, None), (0, None), (3, 9), (0, None)] and through_boto3 == []


@pytest.mark.daemon_log(r"presigned GETs refused \(.*\); using boto3 calls")
def test_s3_gets_fall_back_to_boto3_where_refused(s3_server: S3Server) -> None:
    store = S3Store("layerfs-test", f"t/{uuid.uuid4().hex}", endpoint=s3_server.endpoint)
    store.put("blobs/p", DATA)
    assert store.ranges is not None

    def refuse(key: str, start: int, end: int | None) -> bytes:
        raise Unsupported("query authentication refused")

    store.ranges.get = refuse  # type: ignore[method-assign]
    assert store.get("blobs/p", 1, 5) == DATA[1:5]
    assert store.ranges is None  # from now on, boto3 calls
    assert store.get("blobs/p", 1000, None) == DATA[1000:]
    assert store.get("blobs/p", 2000, None) == b""
    assert store.get("blobs/p") == DATA


def test_s3_no_such_bucket_message(aws_env: None) -> None:
    store = S3Store("bkt", endpoint="http://127.0.0.1:9")
    error = store._error(client_error("NoSuchBucket", 404), "k", "get")
    assert type(error) is StoreError
    assert str(error) == "store error: bucket 'bkt' does not exist at http://127.0.0.1:9"


# ---------------------------------------------------------------- open_store


def test_open_store_by_scheme(tmp_path: Path, aws_env: None) -> None:
    bare = open_store(str(tmp_path / "bare"))
    assert isinstance(bare, FileStore) and bare.root == tmp_path / "bare"
    url = open_store(f"file://{tmp_path}/url")
    assert isinstance(url, FileStore) and url.root == tmp_path / "url"
    s3 = open_store("s3://bucket/some/prefix/", s3_endpoint="http://127.0.0.1:9")
    assert isinstance(s3, S3Store)
    assert (s3.bucket, s3.prefix, s3.endpoint) == ("bucket", "some/prefix/", "http://127.0.0.1:9")
    assert s3.url == "s3://bucket/some/prefix/"
    with pytest.raises(UsageError, match="unknown store URL scheme 'gs'"):
        open_store("gs://bucket/x")
    with pytest.raises(UsageError):
        open_store("s3:///no-bucket")


def test_open_store_relative_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    store = open_store("rel/store")
    assert isinstance(store, FileStore) and store.root == tmp_path / "rel/store"


def test_s3_endpoint_from_env(monkeypatch: pytest.MonkeyPatch, aws_env: None) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:7")
    store = open_store("s3://bucket")
    assert isinstance(store, S3Store) and store.endpoint == "http://127.0.0.1:7"
    assert store.prefix == ""


def test_default_store_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAYERFS_STORE", f"file://{tmp_path}/env")
    assert default_store_url() == f"file://{tmp_path}/env"
    store = open_store()
    assert isinstance(store, FileStore) and store.root == tmp_path / "env"
    monkeypatch.delenv("LAYERFS_STORE")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert default_store_url() == "file:///var/lib/layerfs/store"
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_store_url() == f"file://{tmp_path}/.local/share/layerfs/store"


# ---------------------------------------------------------------- retries


class FakeStore(Store):
    """A backend whose ``_get`` fails ``failures`` times with ``error``, then answers."""

    url = "fake://"

    def __init__(self, failures: int, error: type[StoreError], attempts: int = 4) -> None:
        self.retry = RetryPolicy(attempts=attempts, base_delay=0)
        self.failures = failures
        self.error = error
        self.calls = 0

    def _get(self, key: str, start: int | None, end: int | None) -> bytes:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error(f"failure {self.calls}")
        return b"ok"

    def _put(self, key: str, data: bytes | memoryview) -> None:
        raise NotImplementedError

    def _put_if_absent(self, key: str, data: bytes) -> bool:
        raise NotImplementedError

    def _head(self, key: str) -> ObjectInfo | None:
        raise NotImplementedError

    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        raise NotImplementedError

    def _delete(self, key: str) -> None:
        raise NotImplementedError


@pytest.mark.parametrize("error", [TransientStoreError, StoreUnreachable, ObjectUnavailable])
def test_retry_recovers(error: type[StoreError]) -> None:
    store = FakeStore(failures=2, error=error)
    assert store.get("k") == b"ok"
    assert store.calls == 3


@pytest.mark.parametrize("error", [TransientStoreError, StoreUnreachable, ObjectUnavailable])
def test_retry_gives_up_after_attempts(error: type[StoreError]) -> None:
    store = FakeStore(failures=10**6, error=error, attempts=4)
    with pytest.raises(error, match="failure 4"):
        store.get("k")
    assert store.calls == 4


@pytest.mark.parametrize("error", [ObjectNotFound, AccessDenied, StoreError])
def test_no_retry_on_permanent_errors(error: type[StoreError]) -> None:
    store = FakeStore(failures=1, error=error)
    with pytest.raises(error):
        store.get("k")
    assert store.calls == 1
