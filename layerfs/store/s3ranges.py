"""GETs of S3 objects without boto3's per-call machinery.

A chunk fetch is one ranged GET of a pack; a ref, a manifest, a meta image or
a chunk table is one GET of a whole object. Through a boto3 client such a call
costs about 2 ms of CPU (request building, signing, event hooks, response
parsing), as much as the network time of a small chunk and more than its
hashing and decompression together. Here boto3 still does everything S3
specific (credentials, region, endpoint, addressing style, signing): it
presigns a GET of each object once, and the URL is reused for every range of
that object with a ``Range`` header (not part of the signature), over one
urllib3 connection pool. A URL is reused for ``REUSE_SECONDS`` and signed for
``SIGNED_SECONDS``; a 400 or 403 on a reused URL (rotated credentials, an
expired session token) presigns again once. Status codes and connection
failures map to the same :mod:`layerfs.errors` as the boto3 path; an endpoint
that redirects or refuses query authentication raises :class:`Unsupported`,
and the store goes back to boto3 calls. Each request's connect and read
timeouts are at most what is left of its attempt (:func:`~.base.time_left`).
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from typing import Any

import urllib3

from ..errors import ObjectUnavailable, StoreError, StoreUnreachable
from .base import attempt_deadline, time_left
from .s3errors import S3Failure, classify, error_class

SIGNED_SECONDS = 3600
REUSE_SECONDS = 600  # well inside the signature's life and short-lived credentials
MAX_URLS = 4096  # presigned URLs kept (the most recently read objects')
_CODE = re.compile(rb"<Code>([^<]*)</Code>")

# connections kept per pool (this one and boto3's): more than a daemon's threads
# use at once in a burst (its store fetches in flight, 16 by default, and trio's
# 40 worker threads, an up's manifest fetches among them), so that none is
# dropped and opened again (a warning line each)
POOL_CONNECTIONS = 128
# no answer: before or while the reply's head comes (the body's own failures are
# that object unavailable; see RangeReader._request)
UNREACHABLE = (urllib3.exceptions.NewConnectionError, urllib3.exceptions.ConnectTimeoutError,
               urllib3.exceptions.ReadTimeoutError, urllib3.exceptions.ProtocolError)  # fmt: skip


class Missing(Exception):
    """The object (or its bucket) is not there; the caller says which."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


class Unsupported(Exception):
    """The endpoint does not serve presigned GETs here (a redirect to
    another region, query authentication refused): use the client's calls."""


REFUSED_CODES = {"AuthorizationQueryParametersError", "NotImplemented", "InvalidRequest",
                 "PermanentRedirect", "TemporaryRedirect", "AuthorizationHeaderMalformed"}


class RangeReader:
    """GETs of ``bucket`` objects, whole or a range; thread safe."""

    def __init__(self, client: Any, bucket: str, where: str, pool_size: int = POOL_CONNECTIONS,
                 connect_timeout: float = 3.0, read_timeout: float = 30.0) -> None:
        self.client = client
        self.bucket = bucket
        self.where = where
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.pool = urllib3.PoolManager(
            maxsize=pool_size, block=False, retries=False,
            timeout=urllib3.Timeout(connect=connect_timeout, read=read_timeout))
        # key → (URL, presigned at), least recently used first
        self._urls: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._lock = threading.Lock()

    def _url(self, key: str, fresh: bool) -> str:
        now = time.monotonic()
        with self._lock:
            known = self._urls.get(key)
            if known is not None:
                self._urls.move_to_end(key)
        if known is not None and not fresh and now - known[1] < REUSE_SECONDS:
            return known[0]
        url: str = self.client.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": key}, ExpiresIn=SIGNED_SECONDS)
        with self._lock:
            self._urls[key] = (url, now)
            self._urls.move_to_end(key)
            while len(self._urls) > MAX_URLS:
                self._urls.popitem(last=False)
        return url

    def get(self, key: str, start: int, end: int | None) -> bytes:
        """Bytes ``[start, end)`` of ``key`` (to its end with ``end`` None; the
        whole object, with no ``Range``, from 0 to None); b"" for a range that
        starts at or past the end. Raises Missing, or the errors of
        :mod:`layerfs.errors`."""
        whole = start == 0 and end is None
        headers = {} if whole else {"Range": f"bytes={start}-{'' if end is None else end - 1}"}
        for fresh in (False, True):
            reply = self._request(self._url(key, fresh), headers, key)
            if reply.status in (200, 206):
                data: bytes = reply.data
                if reply.status == 200:  # the server ignored Range
                    data = data[start:end]
                return data
            if reply.status not in (400, 403) or fresh:  # 400: ExpiredToken
                break
        return self._failed(reply, key)

    def _timeout_now(self) -> dict[str, Any]:
        """The request's timeouts, if the attempt's time left is under the pool's."""
        deadline = attempt_deadline()
        if deadline is None or deadline - time.monotonic() >= self.read_timeout:
            return {}
        return {"timeout": urllib3.Timeout(connect=time_left(self.connect_timeout),
                                           read=time_left(self.read_timeout))}

    def _request(self, url: str, headers: dict[str, str], key: str) -> Any:
        """The reply, its body read: a request that gets no answer is the store
        unreachable; an answer that breaks off (cut short, or the connection
        reset in the body) is that object unavailable, as through boto3."""
        try:
            reply = self.pool.request("GET", url, headers=headers, preload_content=False,
                                      redirect=False, **self._timeout_now())
        except UNREACHABLE as exc:
            raise StoreUnreachable(f"{self.where}: {exc}") from exc
        except urllib3.exceptions.HTTPError as exc:
            raise StoreError(f"get {key} at {self.where}: {exc}") from exc
        try:
            reply.read(cache_content=True)  # then ``reply.data``
        except urllib3.exceptions.ReadTimeoutError as exc:
            raise StoreUnreachable(f"{self.where}: {exc}") from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise ObjectUnavailable(f"get {key} at {self.where}: {exc}") from exc
        finally:
            reply.release_conn()
        return reply

    def _failed(self, reply: Any, key: str) -> bytes:
        found = _CODE.search(reply.data or b"")
        code = found.group(1).decode(errors="replace") if found else str(reply.status)
        what = f"get {key} at {self.where}: {code} (HTTP {reply.status})"
        if reply.status == 416 or code == "InvalidRange":
            return b""
        if 300 <= reply.status < 400 or code in REFUSED_CODES:
            raise Unsupported(what)
        failure = classify(code, reply.status)
        if failure in (S3Failure.MISSING_OBJECT, S3Failure.MISSING_BUCKET):
            raise Missing(code)
        raise error_class(failure)(what)

    def close(self) -> None:
        self.pool.clear()
