"""The S3 store: objects under ``s3://bucket/prefix`` through boto3.

Works against AWS S3 and S3-compatible servers (SeaweedFS, MinIO, Ceph RGW)
given an endpoint (constructor argument, else ``AWS_ENDPOINT_URL_S3`` /
``AWS_ENDPOINT_URL``). Credentials come from the standard AWS chain. botocore
makes one attempt per call; :class:`~layerfs.store.base.RetryPolicy` does the
retries. One boto3 client per store, shared by all threads (clients are thread
safe) and made again in a forked child on its first call (a parent's pooled
connections are not shared with its children); GETs (chunk fetches, refs, manifests) go through
:mod:`layerfs.store.s3ranges` (presigned by that client). Errors are mapped
to :mod:`layerfs.errors`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import boto3
import botocore.exceptions as bx
from botocore.config import Config

from ..errors import AccessDenied, ObjectUnavailable, StoreError, StoreUnreachable, UsageError
from .base import ObjectInfo, RetryPolicy, Store
from .s3errors import S3Failure, classify, error_class
from .s3ranges import POOL_CONNECTIONS, Missing, RangeReader, Unsupported

log = logging.getLogger(__name__)
NO_CREDENTIALS = (bx.NoCredentialsError, bx.PartialCredentialsError, bx.CredentialRetrievalError)
UNREACHABLE = (bx.ConnectionError, bx.HTTPClientError)  # no connection, no answer in time
CUT_BODY = (bx.IncompleteReadError, bx.ResponseStreamingError)  # the answer broke off

SESSION_ENV = (
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
    "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
)  # fmt: skip
_sessions: dict[tuple[str | None, ...], boto3.session.Session] = {}
_sessions_lock = threading.Lock()
_fork_lock = threading.Lock()


def _locks_in_child() -> None:
    """Fresh locks in a forked child (a parent's thread may hold one at the fork)."""
    global _sessions_lock, _fork_lock  # noqa: PLW0603
    _sessions_lock, _fork_lock = threading.Lock(), threading.Lock()


os.register_at_fork(after_in_child=_locks_in_child)


CONNECT_TIMEOUT, READ_TIMEOUT = 3.0, 30.0  # per attempt, and at most the store's timeout


def client_config(timeout: float = READ_TIMEOUT) -> Config:
    """One attempt per call (botocore's ``max_attempts: 1`` would mean one *retry*)."""
    return Config(
        connect_timeout=min(CONNECT_TIMEOUT, timeout),
        read_timeout=min(READ_TIMEOUT, timeout),
        retries={"total_max_attempts": 1, "mode": "standard"},
        max_pool_connections=POOL_CONNECTIONS,
        signature_version="s3v4",  # presigned URLs too (botocore presigns with SigV2 otherwise)
    )


def make_client(endpoint: str | None, timeout: float = READ_TIMEOUT) -> Any:
    """A boto3 S3 client; sessions (slow to build) are shared per credential environment."""
    config = client_config(timeout)
    if endpoint:  # S3-compatible servers want bucket-in-path addressing
        config = config.merge(Config(s3={"addressing_style": "path"}))
    env = tuple(os.environ.get(name) for name in SESSION_ENV)
    with _sessions_lock:  # creating clients from one session is not thread safe
        session = _sessions.get(env)
        if session is None:
            session = _sessions[env] = boto3.session.Session()
        return session.client("s3", endpoint_url=endpoint, config=config)


def endpoint_from_env() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def parse_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` → ``("bucket", "some/prefix/")``."""
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc:
        raise UsageError(f"bad S3 store URL {url!r}: expected s3://bucket/prefix")
    prefix = parts.path.strip("/")
    return parts.netloc, prefix + "/" if prefix else ""


def _code(exc: bx.ClientError) -> tuple[str, int]:
    error = exc.response.get("Error", {})
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return str(error.get("Code", status)), int(status or 0)


def _failure(exc: bx.ClientError) -> S3Failure:
    return classify(*_code(exc))


class S3Store(Store):
    """A store in an S3 bucket, under a key prefix; thread safe."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        endpoint: str | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.endpoint = endpoint or endpoint_from_env()
        self.url = f"s3://{bucket}/{self.prefix}"
        if retry is not None:
            self.retry = retry
        self._connect()
        self._conditional_put = True

    def _connect(self) -> None:
        """The client and range reader, their timeouts per attempt within ``timeout``."""
        client = make_client(self.endpoint, self.timeout)
        self._ranges: RangeReader | None = RangeReader(
            client, self.bucket, self.endpoint or str(client.meta.endpoint_url),
            pool_size=POOL_CONNECTIONS, connect_timeout=min(CONNECT_TIMEOUT, self.timeout),
            read_timeout=min(READ_TIMEOUT, self.timeout))
        self._client = client
        self._pid = os.getpid()  # last: other threads of a child wait for the new ones

    # A forked child must not send requests on its parent's pooled connections
    # (both processes would write to one socket and read each other's answers):
    # its first use of the store gives it a client and a pool of its own.
    def _own(self) -> None:
        if self._pid == os.getpid():
            return
        with _fork_lock:
            if self._pid != os.getpid():  # the parent's connections are dropped, not closed
                presigned = self._ranges is not None
                self._connect()
                if not presigned:
                    self._ranges = None

    @property
    def client(self) -> Any:
        self._own()
        return self._client

    @property
    def ranges(self) -> RangeReader | None:
        self._own()
        return self._ranges

    @ranges.setter
    def ranges(self, reader: RangeReader | None) -> None:
        self._ranges = reader

    def set_timeout(self, seconds: float) -> None:
        before = min(READ_TIMEOUT, self.timeout)
        super().set_timeout(seconds)
        if min(READ_TIMEOUT, seconds) != before:  # per-attempt timeouts change
            self.close()
            self._connect()

    @classmethod
    def from_url(
        cls, url: str, endpoint: str | None = None, retry: RetryPolicy | None = None
    ) -> S3Store:
        bucket, prefix = parse_url(url)
        return cls(bucket, prefix, endpoint, retry)

    def __repr__(self) -> str:
        return f"S3Store({self.url!r}, endpoint={self.where!r})"

    @property
    def where(self) -> str:
        """The endpoint, for messages."""
        return self.endpoint or str(self.client.meta.endpoint_url)

    def _key(self, key: str) -> str:
        return self.prefix + key

    # -- errors --
    def _error(self, exc: Exception, key: str, action: str) -> StoreError:
        """Map a boto3 exception met while doing ``action`` on ``key``."""
        what = f"{action} {self.url}{key}"
        if isinstance(exc, bx.ClientError):
            return self._client_error(exc, key, what)
        if isinstance(exc, NO_CREDENTIALS):
            return AccessDenied(f"{what}: no usable AWS credentials ({exc})")
        if isinstance(exc, CUT_BODY):
            return ObjectUnavailable(f"{what} at {self.where}: {exc}")
        if isinstance(exc, UNREACHABLE):
            return StoreUnreachable(f"{self.where}: {exc}")
        return StoreError(f"{what} at {self.where}: {exc}")

    def _client_error(self, exc: bx.ClientError, key: str, what: str) -> StoreError:
        code, _ = _code(exc)
        failure = _failure(exc)
        if failure is S3Failure.MISSING_OBJECT:
            return self.missing(key)
        if failure is S3Failure.MISSING_BUCKET:
            return StoreError(f"bucket {self.bucket!r} does not exist at {self.where}")
        message = exc.response.get("Error", {}).get("Message") or code
        return error_class(failure)(f"{what}: {code}: {message}")

    def _denied_or_no_bucket(self, error: StoreError) -> StoreError:
        """SeaweedFS answers AccessDenied to writes into a missing bucket: say which."""
        if not isinstance(error, AccessDenied):
            return error
        try:
            exists = self.bucket_exists()
        except StoreError:
            return error
        if exists:
            return error
        return StoreError(f"bucket {self.bucket!r} does not exist at {self.where}")

    # -- reads --
    def _get(self, key: str, start: int | None, end: int | None) -> bytes:
        full = self._key(key)
        first = start or 0
        if first < 0 or (end is not None and end < 0):
            raise ValueError(f"bad range [{start}, {end}) for {key}")
        if end is not None and end <= first:
            if self._head(key) is None:
                raise self.missing(key)
            return b""
        ranged = first > 0 or end is not None
        ranges = self.ranges  # read once: another thread may drop it
        if ranges is not None:  # the lean path (~3 ms less a GET than boto3's)
            try:
                return ranges.get(full, first, end)
            except Missing as exc:
                if exc.code != "NoSuchBucket":
                    raise self.missing(key) from None
                raise StoreError(f"bucket {self.bucket!r} does not exist at {self.where}") from None
            except Unsupported as exc:
                log.warning("%s: presigned GETs refused (%s); using boto3 calls",
                            self.where, exc)
                self.ranges = None
            except bx.BotoCoreError as exc:  # presigning: credentials
                raise self._error(exc, key, "get") from exc
        kwargs = {"Range": f"bytes={first}-{'' if end is None else end - 1}"} if ranged else {}
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=full, **kwargs)
            data: bytes = response["Body"].read()
        except bx.ClientError as exc:
            if _code(exc)[0] == "InvalidRange":  # start at or past the end
                return b""
            raise self._error(exc, key, "get") from exc
        except bx.BotoCoreError as exc:
            raise self._error(exc, key, "get") from exc
        if ranged and "ContentRange" not in response:  # server ignored Range
            data = data[first:end]
        return data

    def _head(self, key: str) -> ObjectInfo | None:
        try:
            response = self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except bx.ClientError as exc:
            if _failure(exc) is S3Failure.MISSING_OBJECT:
                return None
            raise self._error(exc, key, "head") from exc
        except bx.BotoCoreError as exc:
            raise self._error(exc, key, "head") from exc
        return ObjectInfo(key, response["ContentLength"], response["LastModified"].timestamp())

    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        paginator = self.client.get_paginator("list_objects_v2")
        cut = len(self.prefix)
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix):
                for item in page.get("Contents", []):
                    if item["Key"].endswith("/"):  # folder markers
                        continue
                    mtime = item["LastModified"].timestamp()
                    yield ObjectInfo(item["Key"][cut:], item["Size"], mtime)
        except (bx.ClientError, bx.BotoCoreError) as exc:
            raise self._error(exc, prefix, "list") from exc

    # -- writes --
    def _put(self, key: str, data: bytes | memoryview) -> None:
        body = data if isinstance(data, bytes) else bytes(data)
        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=body)
        except (bx.ClientError, bx.BotoCoreError) as exc:
            raise self._denied_or_no_bucket(self._error(exc, key, "put")) from exc

    def _put_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` unless it exists, with a conditional PUT (``If-None-Match: *``).

        AWS S3, SeaweedFS and current MinIO honour the header and answer 412 when
        the key exists, so exactly one of several racing writers wins. A server
        that answers 501 NotImplemented gets head-then-put instead, which is racy:
        two writers can both see the key absent and the later one replaces the
        earlier. A server that silently ignores the header overwrites.
        """
        if not self._conditional_put:
            return self._head_then_put(key, data)
        full = self._key(key)
        body = data if isinstance(data, bytes) else bytes(data)
        try:
            self.client.put_object(Bucket=self.bucket, Key=full, Body=body, IfNoneMatch="*")
        except bx.ClientError as exc:
            code, status = _code(exc)
            if code == "PreconditionFailed" or status == 412:
                return False
            if code == "NotImplemented" or status == 501:
                self._conditional_put = False
                return self._head_then_put(key, data)
            raise self._denied_or_no_bucket(self._error(exc, key, "put")) from exc
        except bx.BotoCoreError as exc:
            raise self._error(exc, key, "put") from exc
        return True

    def _head_then_put(self, key: str, data: bytes) -> bool:
        if self._head(key) is not None:
            return False
        self._put(key, data)
        return True

    def _refresh(self, key: str) -> bool:
        """Copy the object onto itself with new metadata: S3 gives it a new
        LastModified (SeaweedFS copies only metadata; about 250 per second here).
        Copying a missing source fails, so a refresh never recreates a key."""
        full = self._key(key)
        try:
            self.client.copy_object(Bucket=self.bucket, Key=full, MetadataDirective="REPLACE",
                                    CopySource={"Bucket": self.bucket, "Key": full},
                                    Metadata={"layerfs-refreshed": "1"})
        except bx.ClientError as exc:
            if _failure(exc) is S3Failure.MISSING_OBJECT:
                return False
            raise self._error(exc, key, "refresh") from exc
        except bx.BotoCoreError as exc:
            raise self._error(exc, key, "refresh") from exc
        return True

    def _delete(self, key: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key))
        except bx.ClientError as exc:
            if _failure(exc) is not S3Failure.MISSING_OBJECT:
                raise self._error(exc, key, "delete") from exc
        except bx.BotoCoreError as exc:
            raise self._error(exc, key, "delete") from exc

    # -- buckets --
    def bucket_exists(self) -> bool:
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except bx.ClientError as exc:
            if _failure(exc) in (S3Failure.MISSING_OBJECT, S3Failure.MISSING_BUCKET):
                return False
            raise self._error(exc, "", "head bucket") from exc
        except bx.BotoCoreError as exc:
            raise self._error(exc, "", "head bucket") from exc
        return True

    def create_bucket_if_missing(self) -> None:
        """Create the bucket unless it exists (used by tests and first-time setup)."""
        if self.bucket_exists():
            return
        region = self.client.meta.region_name
        kwargs: dict[str, Any] = {}
        if region and region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
        try:
            self.client.create_bucket(Bucket=self.bucket, **kwargs)
        except bx.ClientError as exc:
            if _code(exc)[0] != "BucketAlreadyOwnedByYou":  # lost a race with ourselves
                raise self._error(exc, "", "create bucket") from exc
        except bx.BotoCoreError as exc:
            raise self._error(exc, "", "create bucket") from exc

    def close(self) -> None:
        if self._pid != os.getpid():  # a child: the connections are its parent's
            return
        if self._ranges is not None:
            self._ranges.close()
        self._client.close()
