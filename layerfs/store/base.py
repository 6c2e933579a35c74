"""The store interface every backend implements, and the retry policy.

Keys are ``/``-separated relative paths (``blobs/sha256/<hex>``,
``refs/layers/<name>/<version>``), checked by :func:`check_key` for every
backend: not empty, not absolute, with no empty, ``.`` or ``..`` component
and none that looks like one of the file store's temporary files. Backends raise only the errors of
:mod:`layerfs.errors`: ``ObjectNotFound``, ``AccessDenied``,
``ObjectUnavailable``, ``StoreUnreachable`` (both ``TransientStoreError``) and
``StoreError``; transient failures are retried here, with exponential backoff
and full jitter, a bounded number of times and only while the store has not
failed without progress for longer than its ``timeout`` (:class:`Stall`).

The timeout is a deadline, whatever the errors are: each attempt is bounded by
the time left until it (:func:`time_left`: the S3 backend's socket timeouts;
every call but ``get`` runs in a watchdog thread, :meth:`Store._bounded`), and
when the stall reaches it the call gives up: ``NoProgressUnavailable``
(exit 11) if every failed attempt of the stall was answered "unavailable" (a
5xx, throttling, EIO), else ``NoProgress`` (exit 8), both naming the last
error; the attempts of other threads still running then are cut at once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import random
import threading
import time
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from ..errors import (
    NoAnswerInTime,
    NoProgress,
    NoProgressUnavailable,
    ObjectNotFound,
    ObjectUnavailable,
    StoreUnreachable,
    TransientStoreError,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

BLOB_PREFIX = "blobs/sha256/"


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    mtime: float  # seconds since the epoch


DEFAULT_TIMEOUT = 60.0  # seconds a store may fail without progress before calls give up
CUT_SLACK = 0.05  # an unreachable store's error this close to the deadline: cut by it
MIN_WAIT = 0.01  # the least a socket may wait (0 would make it non-blocking)

_attempt = threading.local()  # .deadline: monotonic time the current attempt must end by


def attempt_deadline() -> float | None:
    """When the current thread's store attempt must end (monotonic), if in one."""
    deadline: float | None = getattr(_attempt, "deadline", None)
    return deadline


def time_left(bound: float) -> float:
    """``bound`` seconds, or less: what is left of the current attempt's time."""
    deadline = attempt_deadline()
    if deadline is None:
        return bound
    return max(MIN_WAIT, min(bound, deadline - time.monotonic()))


class Stall:
    """How long a store has failed without progress: from its first failure
    since its last success (any call of any thread). Calls retry only while
    this is under the store's timeout, and each attempt ends by then
    (:meth:`deadline`), so a push whose store stops answering, or answers
    only errors, ends within about that long, however many objects it writes.

    It also remembers what the stall's attempts met (the last error; whether
    the store answered every one "unavailable"), and the bounded attempts in
    flight (:meth:`watch`), which :meth:`give_up` cuts."""

    def __init__(self) -> None:
        self._since: float | None = None  # monotonic time of the first failure
        self._lock = threading.Lock()
        self._last: TransientStoreError | None = None  # the last error met
        self._unavailable = 0  # attempts answered "unavailable"
        self._other = False  # an attempt got no answer, or another transient error
        self._watched: set[threading.Event] = set()

    def ok(self) -> None:
        if self._since is not None:
            with self._lock:
                self._since = None

    def deadline(self, now: float, timeout: float) -> float:
        """When an attempt starting ``now`` must end: ``timeout`` after the
        stall began, or, if none (or that is past: a last try), after ``now``."""
        since = self._since
        if since is None or now - since >= timeout:
            return now + timeout
        return since + timeout

    def failed(self, started: float, exc: TransientStoreError, cut: bool = False) -> float:
        """Note a failure of an attempt made at ``started`` (monotonic), ``cut``
        if it was still running at its deadline; seconds failed without
        progress so far."""
        with self._lock:
            if self._since is None:
                self._since = started
                self._last, self._unavailable, self._other = None, 0, False
            if not cut:
                self._last = exc
                if isinstance(exc, ObjectUnavailable):
                    self._unavailable += 1
                else:
                    self._other = True
            elif self._last is None:
                self._last = exc
            return time.monotonic() - self._since

    def give_up(self, timeout: float, exc: TransientStoreError) -> TransientStoreError:
        """The error a call that gave up raises; the bounded attempts in flight
        (other threads') are cut now."""
        with self._lock:
            last = self._last or exc
            answered = self._unavailable > 0 and not self._other
            for event in self._watched:
                event.set()
        kind = NoProgressUnavailable if answered else NoProgress
        return kind(f"{timeout:g}", last.message())

    def watch(self, done: threading.Event) -> None:
        """Set ``done`` when a call gives up (until :meth:`unwatch`)."""
        with self._lock:
            self._watched.add(done)

    def unwatch(self, done: threading.Event) -> None:
        with self._lock:
            self._watched.discard(done)


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 5
    base_delay: float = 0.1
    max_delay: float = 2.0

    def run(self, what: str, fn: Callable[[], T], stall: Stall | None = None,
            timeout: float = DEFAULT_TIMEOUT) -> T:
        """Call ``fn``; retry on transient errors (an unavailable object, an
        unreachable store) until ``attempts`` are made or the store has failed
        without progress (``stall``) for ``timeout`` seconds; each attempt
        runs with its deadline (:func:`attempt_deadline`). Every call makes
        at least one attempt; each retry is logged at INFO."""
        stall = stall or Stall()
        for attempt in range(1, self.attempts + 1):
            started = time.monotonic()
            deadline = stall.deadline(started, timeout)
            _attempt.deadline = deadline
            try:
                result = fn()
            except TransientStoreError as exc:
                ended = time.monotonic()
                cut = isinstance(exc, NoAnswerInTime) or (
                    isinstance(exc, StoreUnreachable) and ended >= deadline - CUT_SLACK)
                stalled = stall.failed(started, exc, cut)
                if stalled >= timeout - CUT_SLACK:
                    raise stall.give_up(timeout, exc) from exc
                if attempt == self.attempts:
                    raise
                delay = random.uniform(0, min(self.max_delay, self.base_delay * 2**attempt))
                delay = min(delay, timeout - stalled)
                log.info("%s failed (%s), retry %d of %d in %.2fs", what, exc, attempt,
                         self.attempts - 1, delay)
                time.sleep(delay)
                continue
            finally:
                _attempt.deadline = None
            stall.ok()
            return result
        raise AssertionError("unreachable")


class Writers:
    """Daemon threads that run bounded store calls (:meth:`Store._bounded`),
    kept for reuse; a new one is started whenever none is idle, so a call
    blocked for good (a hung mount, a gateway that never answers) holds up
    only its own thread.

    A forked child has none of its parent's threads: :meth:`forget` (run in
    every child, ``os.register_at_fork``) starts it with an empty pool, so its
    first call starts a thread of its own instead of queueing for a thread that
    does not exist there."""

    def __init__(self) -> None:
        self.forget()

    def forget(self) -> None:
        """No threads and no queued tasks: the state of a process that has not written."""
        self._tasks: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, task: Callable[[], None]) -> None:
        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1
        self._tasks.put(task)
        if start:
            threading.Thread(target=self._work, name="store-call", daemon=True).start()

    def _work(self) -> None:
        while True:
            self._tasks.get()()
            with self._lock:
                self._idle += 1


WRITERS = Writers()
os.register_at_fork(after_in_child=WRITERS.forget)


# -- keys ----------------------------------------------------------------------------

TEMP_MARK = ".tmp~"  # '~' appears in no layerfs name, version or digest


def _bad_component(part: str) -> bool:
    return part in ("", ".", "..") or part.startswith(TEMP_MARK)


def _bad_chars(text: str) -> bool:
    return "\0" in text or "\\" in text


def check_key(key: str) -> str:
    """Return ``key`` if it is a valid store key, else raise ValueError."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"invalid store key {key!r}: empty")
    if key.startswith("/") or _bad_chars(key):
        raise ValueError(f"invalid store key {key!r}: must be a relative path")
    if any(_bad_component(part) for part in key.split("/")):
        raise ValueError(f"invalid store key {key!r}: empty, '.', '..' or temporary component")
    return key


def check_prefix(prefix: str) -> str:
    """Return ``prefix`` if it can start a valid key (it may end mid-name or with '/')."""
    if prefix == "":
        return prefix
    if prefix.startswith("/") or _bad_chars(prefix):
        raise ValueError(f"invalid store prefix {prefix!r}: must be a relative path")
    whole = prefix.split("/")[:-1]  # the last part may be any start of a name
    if any(_bad_component(part) for part in whole):
        raise ValueError(f"invalid store prefix {prefix!r}: empty, '.' or '..' component")
    return prefix


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

    def _retry_bounded(self, what: str, fn: Callable[[], T]) -> T:
        """:meth:`_retry`, each attempt in a watchdog thread (:meth:`_bounded`)."""
        return self._retry(what, lambda: self._bounded(what, fn))

    def _bounded(self, what: str, call: Callable[[], T]) -> T:
        """``call()`` in a :data:`WRITERS` thread, given until the current
        attempt's deadline (else the store's timeout): ``NoAnswerInTime`` if it
        has not returned by then, or when another call gives up
        (:meth:`Stall.give_up`), leaving it behind (it ends by its own socket
        timeouts, or never: a hung mount)."""
        deadline = attempt_deadline() or time.monotonic() + self.timeout
        outcome: list[tuple[bool, object]] = []
        done = threading.Event()

        def task() -> None:
            _attempt.deadline = deadline
            try:
                outcome.append((True, call()))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                outcome.append((False, exc))
            finally:
                _attempt.deadline = None
                done.set()

        stall = self.stall
        stall.watch(done)
        try:
            WRITERS.submit(task)
            done.wait(max(0.0, deadline - time.monotonic()))
        finally:
            stall.unwatch(done)
        if not outcome:
            raise self._no_answer(what, self.timeout)
        ok, value = outcome[0]
        if not ok:
            raise typing.cast(BaseException, value)
        return typing.cast(T, value)

    def _no_answer(self, what: str, timeout: float) -> NoAnswerInTime:
        """The error of a bounded call that did not end in time."""
        return NoAnswerInTime(f"{what}: no answer from {self.url} in time"
                              f" ({timeout:g}s without progress)")

    # -- primitives each backend implements (no retries inside; every key and prefix
    #    they get was checked by the API below: check_key, check_prefix) --
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
        check_key(key)
        return self._retry(f"get {key}", lambda: self._get(key, start, end))

    def put(self, key: str, data: bytes | memoryview) -> None:
        """Atomic replace: readers see the old object or the new one, never a part."""
        check_key(key)
        self._retry_bounded(f"put {key}", lambda: self._put(key, data))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        check_key(key)
        return self._retry_bounded(f"put {key}", lambda: self._put_if_absent(key, data))

    def head(self, key: str) -> ObjectInfo | None:
        check_key(key)
        return self._retry_bounded(f"head {key}", lambda: self._head(key))

    def exists(self, key: str) -> bool:
        return self.head(key) is not None

    def refresh(self, key: str) -> bool:
        """Make ``key`` young again (its mtime becomes now), so that gc's grace
        period counts from this call; False if ``key`` does not exist."""
        check_key(key)
        return self._retry_bounded(f"refresh {key}", lambda: self._refresh(key))

    def list_temporaries(self) -> list[ObjectInfo]:
        """Leftovers of interrupted writes, sorted by key; their keys are only
        good for :meth:`delete_temporary`."""
        items = self._retry_bounded("list temporaries", lambda: list(self._temporaries()))
        return sorted(items, key=lambda o: o.key)

    def delete_temporary(self, key: str) -> None:
        """Delete a leftover that :meth:`list_temporaries` named."""
        self._retry_bounded(f"delete {key}", lambda: self._delete_temporary(key))

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Objects whose key starts with ``prefix``, sorted by key."""
        check_prefix(prefix)
        items = self._retry_bounded(f"list {prefix}", lambda: list(self._list(prefix)))
        return sorted(items, key=lambda o: o.key)

    def delete(self, key: str) -> None:
        """Delete ``key``; deleting a missing key is not an error."""
        check_key(key)
        self._retry_bounded(f"delete {key}", lambda: self._delete(key))

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
