"""A store wrapper for tests that injects faults at the primitive level: an
error for some operations on some keys, or a hook run before them (a barrier
to make two writers race). The wrapped store's retry policy does not apply;
the wrapper's own (``retry``) does, as in a real store."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from layerfs.store.base import ObjectInfo, RetryPolicy, Store

FAST_RETRY = RetryPolicy(attempts=3, base_delay=0.0, max_delay=0.0)


@dataclass
class Fault:
    """Before operation ``op`` (``get``, ``put``, ``put_if_absent``, ``head``,
    ``list``, ``delete``, ``refresh``; ``*`` for any) on a key containing
    ``key_part``: run ``hook``, then raise what ``error`` makes (if given)."""

    op: str
    key_part: str
    error: Callable[[str], Exception] | None = None
    hook: Callable[[], None] | None = None
    hits: int = 0

    def applies(self, op: str, key: str) -> bool:
        return self.op in (op, "*") and self.key_part in key


class FaultStore(Store):
    """``inner`` with :class:`Fault` s injected; thread safe as ``inner`` is."""

    def __init__(self, inner: Store, retry: RetryPolicy = FAST_RETRY) -> None:
        self.inner = inner
        self.url = inner.url
        self.retry = retry
        self.faults: list[Fault] = []

    def inject(self, fault: Fault) -> Fault:
        self.faults.append(fault)
        return fault

    def _call(self, op: str, key: str, fn: Callable[[], object]) -> object:
        for fault in self.faults:
            if fault.applies(op, key):
                fault.hits += 1
                if fault.hook is not None:
                    fault.hook()
                if fault.error is not None:
                    raise fault.error(key)
        return fn()

    def _get(self, key: str, start: int | None, end: int | None) -> bytes:
        return self._call("get", key, lambda: self.inner._get(key, start, end))  # type: ignore[return-value]

    def _put(self, key: str, data: bytes | memoryview) -> None:
        self._call("put", key, lambda: self.inner._put(key, data))

    def _put_if_absent(self, key: str, data: bytes) -> bool:
        return self._call("put_if_absent", key,  # type: ignore[return-value]
                          lambda: self.inner._put_if_absent(key, data))

    def _head(self, key: str) -> ObjectInfo | None:
        return self._call("head", key, lambda: self.inner._head(key))  # type: ignore[return-value]

    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        return iter(self._call("list", prefix,  # type: ignore[call-overload]
                               lambda: list(self.inner._list(prefix))))

    def _delete(self, key: str) -> None:
        self._call("delete", key, lambda: self.inner._delete(key))

    def _refresh(self, key: str) -> bool:
        return self._call("refresh", key, lambda: self.inner._refresh(key))  # type: ignore[return-value]

    def close(self) -> None:
        self.inner.close()
