"""A store that counts the requests it sends: one per backend primitive call.

Wraps any backend; every primitive call (a GET, ranged or not, a HEAD, a
PUT, a LIST, ...) is one request to the store and is counted by kind, retries
included. The node daemon reports the counts in ``layerfs stats``, which is
how a layer's first ``up`` is measured in store round trips.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

from .base import ObjectInfo, Store


class CountingStore(Store):
    """``inner``, counted; with ``counted_with``, into that store's counts."""

    def __init__(self, inner: Store, counted_with: CountingStore | None = None) -> None:
        self.inner = inner
        self.url = inner.url
        self.retry = inner.retry
        self._counts: Counter[str] = counted_with._counts if counted_with else Counter()
        self._lock: threading.Lock = counted_with._lock if counted_with else threading.Lock()

    def __getattr__(self, name: str) -> Any:  # a backend's own extras (S3's bucket calls)
        return getattr(self.inner, name)

    def _count(self, kind: str) -> None:
        with self._lock:
            self._counts[kind] += 1

    def requests(self) -> dict[str, int]:
        """Requests sent so far, by kind (get, head, put, list, delete, refresh)."""
        with self._lock:
            return dict(self._counts)

    def _get(self, key: str, start: int | None, end: int | None) -> bytes:
        self._count("get")
        return self.inner._get(key, start, end)

    def _put(self, key: str, data: bytes | memoryview) -> None:
        self._count("put")
        self.inner._put(key, data)

    def _put_if_absent(self, key: str, data: bytes) -> bool:
        self._count("put")
        return self.inner._put_if_absent(key, data)

    def _head(self, key: str) -> ObjectInfo | None:
        self._count("head")
        return self.inner._head(key)

    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        self._count("list")
        return self.inner._list(prefix)

    def _delete(self, key: str) -> None:
        self._count("delete")
        self.inner._delete(key)

    def _refresh(self, key: str) -> bool:
        self._count("refresh")
        return self.inner._refresh(key)

    def close(self) -> None:
        self.inner.close()
