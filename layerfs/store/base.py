"""The store interface every backend implements, and the retry policy.

Keys are ``/``-separated relative paths (``blobs/sha256/<hex>``,
``refs/layers/<name>/<version>``). Backends raise only the errors of
:mod:`layerfs.errors`: ``ObjectNotFound``, ``AccessDenied``,
``ObjectUnavailable``, ``StoreUnreachable`` (both ``TransientStoreError``) and
``StoreError``; transient failures are retried here, with exponential backoff
and full jitter, a bounded number of times and only while the store has not
failed without progress for longer than its ``timeout`` (:class:`Stall`;
then :class:`~layerfs.errors.NoProgress`).
"""

from __future__ import annotations

import hashlib
import logging
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from ..errors import NoProgress, ObjectNotFound, StoreUnreachable, TransientStoreError

log = logging.getLogger(__name__)
T = TypeVar("T")

BLOB_PREFIX = "blobs/sha256/"


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    mtime: float  # seconds since the epoch


DEFAULT_TIMEOUT = 60.0  # seconds a store may fail without progress before calls give up


class Stall:
    """How long a store has failed without progress: from its first failure
    since its last success (any call of any thread). Calls retry only while
    this is under the store's timeout, so a push whose store stops answering
    ends within about that long, however many objects it writes."""

    def __init__(self) -> None:
        self._since: float | None = None  # monotonic time of the first failure

    def ok(self) -> None:
        self._since = None

    def failed(self, started: float) -> float:
        """Note a failure of an attempt made at ``started`` (monotonic); seconds
        failed without progress so far."""
        if self._since is None:
            self._since = started
        return time.monotonic() - self._since


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 5
    base_delay: float = 0.1
    max_delay: float = 2.0

    def run(self, what: str, fn: Callable[[], T], stall: Stall | None = None,
            timeout: float = DEFAULT_TIMEOUT) -> T:
        """Call ``fn``; retry on transient errors (an unavailable object, an
        unreachable store) until ``attempts`` are made or the store has failed
        without progress (``stall``) for ``timeout`` seconds. Every call makes
        at least one attempt; each retry is logged at INFO."""
        stall = stall or Stall()
        for attempt in range(1, self.attempts + 1):
            started = time.monotonic()
            try:
                result = fn()
            except TransientStoreError as exc:
                stalled = stall.failed(started)
                if stalled >= timeout:
                    if isinstance(exc, StoreUnreachable):
                        raise NoProgress(f"{timeout:g}", exc.message()) from exc
                    raise  # an unavailable object stays what it is
                if attempt == self.attempts:
                    raise
                delay = random.uniform(0, min(self.max_delay, self.base_delay * 2**attempt))
                delay = min(delay, timeout - stalled)
                log.info("%s failed (%s), retry %d of %d in %.2fs", what, exc, attempt,
                         self.attempts - 1, delay)
                time.sleep(delay)
                continue
            stall.ok()
            return result
        raise AssertionError("unreachable")


def blob_key(digest: str) -> str:
    """``sha256:<hex>`` → ``blobs/sha256/<hex>``."""
    algo, _, hexd = digest.partition(":")
    if algo != "sha256" or len(hexd) != 64:
        raise ValueError(f"bad digest {digest!r}")
    return BLOB_PREFIX + hexd


def sha256_digest(data: bytes | memoryview) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class Store(ABC):
    """An object store addressed by keys; thread safe."""

    url: str
    retry: RetryPolicy = RetryPolicy()
    timeout: float = DEFAULT_TIMEOUT  # see Stall; set_timeout() changes it

    def set_timeout(self, seconds: float) -> None:
        """Give up after ``seconds`` without progress (and bound each attempt by it)."""
        self.timeout = seconds

    @property
    def stall(self) -> Stall:
        stall = self.__dict__.get("_stall")
        if stall is None:
            stall = self.__dict__.setdefault("_stall", Stall())
        return stall

    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        return self.retry.run(what, fn, self.stall, self.timeout)

    # -- primitives each backend implements (no retries inside) --
    @abstractmethod
    def _get(self, key: str, start: int | None, end: int | None) -> bytes: ...

    @abstractmethod
    def _put(self, key: str, data: bytes | memoryview) -> None: ...

    @abstractmethod
    def _put_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` unless it exists; True if this call created it."""

    @abstractmethod
    def _head(self, key: str) -> ObjectInfo | None: ...

    @abstractmethod
    def _list(self, prefix: str) -> Iterator[ObjectInfo]: ...

    @abstractmethod
    def _delete(self, key: str) -> None: ...

    def _refresh(self, key: str) -> bool:
        """Set ``key``'s modification time to now; False if ``key`` does not exist."""
        raise NotImplementedError(f"{type(self).__name__} cannot refresh objects")

    def _temporaries(self) -> Iterator[ObjectInfo]:
        """Leftovers of interrupted writes (the file store's temporary files)."""
        return iter(())

    def _delete_temporary(self, key: str) -> None:
        raise NotImplementedError(f"{type(self).__name__} keeps no temporary files")

    # -- the API the rest of layerfs uses --
    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """Whole object, or bytes ``[start, end)`` of it."""
        return self._retry(f"get {key}", lambda: self._get(key, start, end))

    def put(self, key: str, data: bytes | memoryview) -> None:
        """Atomic replace: readers see the old object or the new one, never a part."""
        self._retry(f"put {key}", lambda: self._put(key, data))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return self._retry(f"put {key}", lambda: self._put_if_absent(key, data))

    def head(self, key: str) -> ObjectInfo | None:
        return self._retry(f"head {key}", lambda: self._head(key))

    def exists(self, key: str) -> bool:
        return self.head(key) is not None

    def refresh(self, key: str) -> bool:
        """Make ``key`` young again (its mtime becomes now), so that gc's grace
        period counts from this call; False if ``key`` does not exist."""
        return self._retry(f"refresh {key}", lambda: self._refresh(key))

    def list_temporaries(self) -> list[ObjectInfo]:
        """Leftovers of interrupted writes, sorted by key; their keys are only
        good for :meth:`delete_temporary`."""
        items = self._retry("list temporaries", lambda: list(self._temporaries()))
        return sorted(items, key=lambda o: o.key)

    def delete_temporary(self, key: str) -> None:
        """Delete a leftover that :meth:`list_temporaries` named."""
        self._retry(f"delete {key}", lambda: self._delete_temporary(key))

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Objects whose key starts with ``prefix``, sorted by key."""
        items = self._retry(f"list {prefix}", lambda: list(self._list(prefix)))
        return sorted(items, key=lambda o: o.key)

    def delete(self, key: str) -> None:
        """Delete ``key``; deleting a missing key is not an error."""
        self._retry(f"delete {key}", lambda: self._delete(key))

    # -- content-addressed blobs --
    def put_blob(self, data: bytes | memoryview, digest: str | None = None) -> tuple[str, bool]:
        """Write-once blob named by its sha256; returns (digest, uploaded).

        A blob that is already stored is refreshed instead of written, so a push
        that reuses it gets the same grace period against gc as one that wrote it.
        """
        digest = digest or sha256_digest(data)
        key = blob_key(digest)
        if self.refresh(key):
            return digest, False
        self.put(key, data)
        return digest, True

    def refresh_blob(self, digest: str) -> bool:
        return self.refresh(blob_key(digest))

    def get_blob(self, digest: str, verify: bool = True) -> bytes:
        data = self.get(blob_key(digest))
        if verify and sha256_digest(data) != digest:
            from ..errors import IntegrityError

            raise IntegrityError(digest, "content does not match its digest")
        return data

    def get_text(self, key: str) -> str:
        return self.get(key).decode()

    def missing(self, key: str) -> ObjectNotFound:
        return ObjectNotFound(f"{self.url.rstrip('/')}/{key}")

    def close(self) -> None:  # noqa: B027 - an optional hook, not abstract
        """Release connections."""
