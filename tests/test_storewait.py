"""The bounded wait for the store (StoreHealth.bounded, `daemon --store-wait`),
in-process: a wait that runs out finds the store away, and every other wait
on it ends then too, not at its own bound; a store found away by anyone
(another request, the probe) ends them the same way."""

from __future__ import annotations

import threading

import pytest

from layerfs.errors import NoAnswerInTime, StoreUnreachable
from layerfs.node.replica.storehealth import StoreHealth

LOST = r"WARNING layerfs\.node\.replica\.storehealth: store test:// unreachable \("
LONG = 120.0  # a bound no wait here reaches


def health() -> StoreHealth:
    return StoreHealth("test://", lambda: None)  # type: ignore[arg-type,return-value]


def waiters(h: StoreHealth, hang: threading.Event, count: int) -> tuple[list, list]:
    """``count`` threads waiting (up to LONG) on a request that hangs until ``hang``."""
    results: list = []
    asked = threading.Semaphore(0)  # a request sent: its caller is waiting

    def request() -> bool:
        asked.release()
        return hang.wait()

    def wait() -> None:
        try:
            results.append(h.bounded(request, LONG))
        except StoreUnreachable as exc:
            results.append(exc)
    threads = [threading.Thread(target=wait) for _ in range(count)]
    for t in threads:
        t.start()
    for _ in threads:
        asked.acquire()
    return threads, results


@pytest.mark.daemon_log(LOST)
def test_one_wait_running_out_ends_every_wait():
    h, hang = health(), threading.Event()
    threads, results = waiters(h, hang, 4)
    with pytest.raises(NoAnswerInTime, match=r"no answer within --store-wait 0\.2s"):
        h.bounded(hang.wait, 0.2)
    for t in threads:
        t.join(timeout=LONG / 10)  # far below their own bound
    assert not any(t.is_alive() for t in threads)
    assert len(results) == 4 and all(isinstance(r, StoreUnreachable) for r in results)
    assert "no answer within --store-wait 0.2s" in str(results[0])
    assert not h.reachable
    hang.set()


@pytest.mark.daemon_log(LOST)
def test_the_store_found_away_elsewhere_ends_every_wait():
    h, hang = health(), threading.Event()
    threads, results = waiters(h, hang, 3)
    h.lost(StoreUnreachable("connection refused"))  # the probe's finding
    for t in threads:
        t.join(timeout=LONG / 10)
    assert not any(t.is_alive() for t in threads)
    assert [str(r) for r in results] == ["store unreachable: connection refused"] * 3
    hang.set()


def test_answers_and_errors_pass_through():
    h = health()
    assert h.bounded(lambda: 42, 1.0) == 42

    def refused() -> None:
        raise StoreUnreachable("refused")
    with pytest.raises(StoreUnreachable, match="refused"):
        h.bounded(refused, 1.0)
    assert h.reachable  # (the caller reports the outage: NodeRefs)
