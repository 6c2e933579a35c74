"""One S3 store reached through several endpoints, failing over between them.

``--s3-endpoint http://a:8333,http://b:8333`` (or ``$AWS_ENDPOINT_URL`` with
commas) names several gateways of one S3 service (SeaweedFS runs one per
filer, Ceph one per RGW). :class:`FailoverS3Store` keeps one
:class:`~layerfs.store.s3.S3Store` per endpoint and sends each call to the
current one; when that endpoint does not answer (``StoreUnreachable``:
connection refused, connect timeout), the same call goes at once to the next,
which becomes current if it answers. Only when none answers is the call
``StoreUnreachable`` (then retried by the store's ``RetryPolicy``, the next
attempt starting at the current endpoint again). An endpoint that answers
with an error (a 500, a 404, denied) is the service's answer: no failover.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar
from urllib.parse import urlsplit

from ..errors import StoreUnreachable, UsageError
from .base import ObjectInfo, RetryPolicy, Store
from .s3 import S3Store, endpoint_from_env, parse_url

log = logging.getLogger(__name__)
T = TypeVar("T")


def split_endpoints(endpoint: str | None) -> list[str]:
    """``"http://a,http://b"`` → both; None or "" → [] (boto3's default endpoint)."""
    if not endpoint:
        return []
    parts = [part.strip() for part in endpoint.split(",")]
    if not all(parts):
        raise UsageError(f"empty endpoint in S3 endpoint list {endpoint!r}")
    for part in parts:
        check_endpoint(part)
    return parts


def check_endpoint(endpoint: str) -> None:
    """An S3 endpoint is an http:// or https:// URL with a host (boto3 takes
    nothing else)."""
    if "://" not in endpoint:
        raise UsageError(f"S3 endpoint {endpoint!r} needs a scheme: http://{endpoint} "
                         f"or https://{endpoint}")
    try:
        parts = urlsplit(endpoint)
        valid = parts.scheme in ("http", "https") and bool(parts.hostname)
        parts.port  # noqa: B018 - a port that is not a number raises
    except ValueError:
        valid = False
    if not valid:
        raise UsageError(f"S3 endpoint {endpoint!r}: expected http://HOST[:PORT] or "
                         "https://HOST[:PORT]")


def open_s3(url: str, endpoint: str | None = None,
            retry: RetryPolicy | None = None) -> Store:
    """The S3 store at ``url``, through one endpoint or failing over between several."""
    endpoints = split_endpoints(endpoint or endpoint_from_env())
    if len(endpoints) <= 1:
        return S3Store.from_url(url, endpoints[0] if endpoints else None, retry)
    bucket, prefix = parse_url(url)
    return FailoverS3Store([S3Store(bucket, prefix, e, RetryPolicy(attempts=1))
                            for e in endpoints], retry)


class FailoverS3Store(Store):
    """An S3 store behind several endpoints; thread safe."""

    def __init__(self, members: list[S3Store], retry: RetryPolicy | None = None) -> None:
        self.members = members
        self.bucket = members[0].bucket
        self.prefix = members[0].prefix
        self.url = members[0].url
        self.endpoint = ",".join(m.where for m in members)
        if retry is not None:
            self.retry = retry
        self.current = 0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"FailoverS3Store({self.url!r}, endpoints={self.endpoint!r})"

    @property
    def where(self) -> str:
        return self.members[self.current].where

    def set_timeout(self, seconds: float) -> None:
        super().set_timeout(seconds)
        for member in self.members:
            member.set_timeout(seconds)

    def _call(self, fn: Callable[[S3Store], T]) -> T:
        """``fn`` on the current endpoint, else on each next one that answers."""
        start = self.current
        failures: list[str] = []
        for step in range(len(self.members)):
            index = (start + step) % len(self.members)
            try:
                result = fn(self.members[index])
            except StoreUnreachable as exc:
                failures.append(str(exc))
                continue
            if index != start:
                self._switch(start, index, failures[-1])
            return result
        raise StoreUnreachable(f"none of {len(self.members)} endpoints answers: "
                               + "; ".join(failures))

    def _switch(self, old: int, new: int, why: str) -> None:
        with self._lock:
            if self.current != old:  # another thread switched already
                return
            self.current = new
        log.warning("S3 endpoint %s does not answer (%s); using %s",
                    self.members[old].where, why, self.members[new].where)

    # -- the primitives, each on the current endpoint --
    def _get(self, key: str, start: int | None, end: int | None) -> bytes:
        return self._call(lambda m: m._get(key, start, end))  # noqa: SLF001

    def _put(self, key: str, data: bytes | memoryview) -> None:
        self._call(lambda m: m._put(key, data))  # noqa: SLF001

    def _put_if_absent(self, key: str, data: bytes) -> bool:
        return self._call(lambda m: m._put_if_absent(key, data))  # noqa: SLF001

    def _head(self, key: str) -> ObjectInfo | None:
        return self._call(lambda m: m._head(key))  # noqa: SLF001

    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        return iter(self._call(lambda m: list(m._list(prefix))))  # noqa: SLF001

    def _delete(self, key: str) -> None:
        self._call(lambda m: m._delete(key))  # noqa: SLF001

    def _refresh(self, key: str) -> bool:
        return self._call(lambda m: m._refresh(key))  # noqa: SLF001

    # -- buckets --
    def bucket_exists(self) -> bool:
        return self._call(lambda m: m.bucket_exists())

    def create_bucket_if_missing(self) -> None:
        self._call(lambda m: m.create_bucket_if_missing())

    def close(self) -> None:
        for member in self.members:
            member.close()
