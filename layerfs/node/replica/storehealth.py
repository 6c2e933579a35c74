"""Whether the node's store answers, as the daemon last found out.

The daemon starts without waiting for its store: a first probe runs in the
background. When the store does not answer (that probe, or a request of an
``up``), one WARNING line says so and the node serves what it has (its
replica: :mod:`.replica.noderefs`); a probe (one request, no retries) then checks again
with a backoff (``PROBE_FIRST`` doubling up to ``PROBE_MAX``), and one INFO
line says when the store answers again. A request that the store answers
ends the outage too.

Once the store first answers, the quick checks of ``layerfs store init``
(:func:`layerfs.store.check.quick_check`: the bucket exists, the credentials
list it, a conditional put refuses a second create, a put is read back) run
once; if one fails, one WARNING line says what is wrong and what to do (a
missing bucket, bad credentials, a store not writable), and the node serves
what it has. A check that finds the store not answering is an outage as above,
and the checks run again when it answers (at most ``START_CHECKS`` times).

An ``up`` waits for the store at most ``--store-wait`` seconds
(:meth:`StoreHealth.bounded`): its request runs in a thread of its own, and
the ``up`` stops waiting when that time is up (the store is then found away:
the outage line above) or as soon as the store is found away by anything
else (another ``up``'s wait, the probe), so every waiting ``up`` falls back
at once, not each after its own timeout. A request left behind ends by its
own timeouts (the control store's: :func:`control_store`).

:meth:`StoreHealth.lost`, :meth:`StoreHealth.answered` and
:meth:`StoreHealth.bounded` may be called from worker threads;
:meth:`StoreHealth.watch` runs on the trio loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import trio

from ...errors import NoAnswerInTime, StoreUnreachable, TransientStoreError
from ...store.base import RetryPolicy, Store
from ...store.check import QuickCheck, quick_check

log = logging.getLogger(__name__)
PROBE_KEY = "refs/probe"  # HEAD of a key that is never a ref: any answer, even 404, is one
PROBE_TIMEOUT = 5.0  # seconds one probe may take
PROBE_FIRST, PROBE_MAX = 0.5, 10.0  # seconds between probes while the store does not answer
START_CHECKS = 3  # times the start's quick checks run again after the store stopped answering
DEFAULT_STORE_WAIT = 2.0  # seconds an up waits for the store before it uses the node's resolution
CONTROL_TIMEOUT = 5.0  # seconds without progress of a control request (a ref, a manifest)
CONTROL_ATTEMPTS = 2
T = TypeVar("T")


class StoreHealth:
    """The store's state as the node knows it: answering, or not since when and why."""

    def __init__(self, url: str, open_probe: Callable[[], Store]) -> None:
        self.url = url
        self._open_probe = open_probe  # a store of its own: one attempt, a short timeout
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # an outage began, a bounded call ended
        self._outages = 0  # outages so far: a waiter falls back when it changes
        self.reachable = True
        self.reason = ""
        self._down_since = 0.0
        self._token: trio.lowlevel.TrioToken | None = None
        self._wake = trio.Event()

    def lost(self, exc: TransientStoreError) -> None:
        """A request found the store not answering (one WARNING line per outage)."""
        with self._lock:
            if not self.reachable:
                return
            self.reachable, self.reason = False, exc.message()
            self._down_since = time.monotonic()
            self._outages += 1
            self._changed.notify_all()
        log.warning("store %s unreachable (%s); serving what this node has and checking "
                    "again in the background", self.url, self.reason)
        if self._token is not None:
            try:
                self._token.run_sync_soon(self._notify)
            except trio.RunFinishedError:
                pass

    def _notify(self) -> None:
        self._wake.set()

    def answered(self) -> None:
        """The store answered a request: the outage, if any, is over."""
        with self._lock:
            if self.reachable:
                return
            self.reachable = True
            down = time.monotonic() - self._down_since
        log.info("store %s reachable again (after %.0fs)", self.url, down)

    def bounded(self, call: Callable[[], T], wait: float) -> T:
        """Worker thread: ``call()`` (a store request) in a thread of its own,
        waited for at most ``wait`` seconds and no longer once the store is
        found away meanwhile; then :class:`StoreUnreachable` (and, if it was
        this wait that ran out, the store is found away: :meth:`lost`)."""
        done: list[tuple[bool, Any]] = []

        def run() -> None:
            try:
                outcome: tuple[bool, Any] = (True, call())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                outcome = (False, exc)
            with self._lock:
                done.append(outcome)
                self._changed.notify_all()

        deadline = time.monotonic() + wait
        with self._lock:
            outages = self._outages
        threading.Thread(target=run, name="store-wait", daemon=True).start()
        with self._lock:
            while not done and self._outages == outages:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            if done:
                ok, value = done[0]
                if ok:
                    return value  # type: ignore[no-any-return]
                raise value
            found_away = self._outages != outages
            reason = self.reason
        if found_away:
            raise StoreUnreachable(reason.removeprefix("store unreachable: "))
        exc = NoAnswerInTime(f"no answer within --store-wait {wait:g}s")
        self.lost(exc)
        raise exc

    async def watch(self) -> None:
        """For the daemon's life: probe at once, then again while the store does
        not answer, with a backoff."""
        self._token = trio.lowlevel.current_trio_token()
        try:
            probe = await trio.to_thread.run_sync(self._open_probe)
        except Exception as exc:  # noqa: BLE001 - the daemon serves on, unprobed
            log.error("cannot probe store %s: %s", self.url, exc)
            return
        try:
            await self._check_at_start(probe)
            while True:
                self._wake = trio.Event()
                if self.reachable:
                    await self._wake.wait()
                await self._probe_until_answered(probe)
        finally:
            probe.close()

    async def _check_at_start(self, probe: Store) -> None:
        """Probe until the store answers, then the quick checks (one line if one fails)."""
        for _ in range(START_CHECKS):
            await self._probe_until_answered(probe)
            result = await trio.to_thread.run_sync(quick_check, probe, abandon_on_cancel=True)
            if isinstance(result.error, StoreUnreachable):
                self.lost(result.error)  # an outage: check again once it answers
                continue
            self.report(result)
            return

    def report(self, result: QuickCheck) -> None:
        """The start's verdict: nothing when usable, else one WARNING line."""
        if not result.usable:
            log.warning("store %s; serving what this node has", result.verdict())

    async def _probe_until_answered(self, probe: Store) -> None:
        delay = PROBE_FIRST
        while True:
            failure = await trio.to_thread.run_sync(probe_once, probe, abandon_on_cancel=True)
            if failure is None:
                self.answered()
                return
            self.lost(failure)
            await trio.sleep(delay)
            delay = min(PROBE_MAX, delay * 2)


def probe_once(store: Store) -> TransientStoreError | None:
    """Worker thread: one request; the failure if the store did not answer."""
    try:
        store.head(PROBE_KEY)
    except TransientStoreError as exc:
        return exc
    except Exception:  # noqa: BLE001 - any other answer (denied, an error reply) is an answer
        return None
    return None


def control_store(store: Store, wait: float) -> Store:
    """``store`` set up for an ``up``'s control requests (refs, manifests):
    short timeouts (``CONTROL_TIMEOUT``, or ``wait`` if longer: an S3 request's
    connect and read timeouts are at most that) and no long retries."""
    seconds = max(CONTROL_TIMEOUT, wait)
    store.set_timeout(seconds)
    inner = getattr(store, "inner", None)  # a CountingStore's backend: its socket timeouts
    if isinstance(inner, Store):
        inner.set_timeout(seconds)
    store.retry = RetryPolicy(attempts=CONTROL_ATTEMPTS)
    return store


def probe_store(store: Store) -> Store:
    """``store`` set up for probing: one attempt (opened with ``PROBE_TIMEOUT``)."""
    store.retry = RetryPolicy(attempts=1)
    return store
