"""Whether a store is safe to share between writers: races run against it.

``run_check`` starts ``writers`` processes (``spawn``: each opens its own store
from a URL; with several URLs, e.g. two mounts of one shared file system,
writer *i* uses URL *i mod n*) and runs ``rounds`` rounds, all writers in step
(a barrier between phases):

1. **create**: every writer calls ``put_if_absent`` on one new key with bytes
   of its own; exactly one may win, and every writer must then read the
   winner's bytes (a double win or a wrong read-back would let two builds
   both publish one ``name@version``);
2. **replace**: every writer ``put``\\ s its own ``payload`` bytes to one new
   key, then reads it: each read must be one writer's bytes whole (a torn
   read is a corrupt ref or trace).

The keys live under ``check/<random>/`` and are deleted afterwards. No awaits:
this is a CLI tool's blocking code.
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.synchronize import Barrier
from pathlib import Path

from ..errors import LayerfsError, StoreError, TransientStoreError, UsageError
from .base import Store

BARRIER_TIMEOUT = 120.0  # seconds one phase may take before the check gives up
CHECK_PREFIX = "check/"


@dataclass(frozen=True)
class CheckPlan:
    """What to run: the store URL(s), how many writers and rounds, payload size."""

    urls: tuple[str, ...]
    writers: int = 4
    rounds: int = 50
    payload: int = 64 << 10
    s3_endpoint: str | None = None


@dataclass(frozen=True)
class WriterReport:
    """One writer's findings: per round whether it won, and what it read."""

    wins: list[bool]
    create_reads: list[str]  # digest of the create key's bytes read back, per round
    replace_reads: list[str]  # digest of the replace key's bytes read back, per round
    errors: list[str]


@dataclass(frozen=True)
class CheckResult:
    """The races' outcome; ``safe`` when none went wrong."""

    plan: CheckPlan
    double_wins: int  # create rounds with more than one winner
    no_wins: int  # create rounds with no winner
    wrong_reads: int  # create rounds where a writer read other bytes than the winner's
    torn_reads: int  # replace reads that were no writer's bytes
    errors: list[str]

    @property
    def safe(self) -> bool:
        return not (self.double_wins or self.no_wins or self.wrong_reads or self.torn_reads
                    or self.errors)

    def verdict(self) -> str:
        p = self.plan
        where = " + ".join(p.urls)
        counts = (f"{self.double_wins} double wins, {self.no_wins} rounds without a winner,"
                  f" {self.wrong_reads} wrong read-backs, {self.torn_reads} torn reads")
        runs = f"{p.rounds} rounds x {p.writers} writers"
        if self.safe:
            return f"{where}: safe to share ({runs}: {counts})"
        first = f"; first error: {self.errors[0]}" if self.errors else ""
        return f"{where}: NOT safe to share ({runs}: {counts}{first})"


class StoreNotSafe(LayerfsError):
    """{}"""

    exit_code = 13


def token(writer: int, round_: int, size: int) -> bytes:
    """Writer ``writer``'s bytes for ``round_``: distinct per writer, ``size`` long."""
    seed = f"layerfs store check: writer {writer} round {round_}\n".encode()
    block = hashlib.sha256(seed).digest() * 64
    return (seed + block * (size // len(block) + 1))[:max(size, len(seed))]


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _in_step(barrier: Barrier, errors: list[str], what: str, fn: Callable[[], str]) -> str:
    """``fn()`` then the barrier; a store error is noted (and read as "")."""
    try:
        result = fn()
    except StoreError as exc:
        errors.append(f"{what}: {exc}")
        result = ""
    barrier.wait(BARRIER_TIMEOUT)
    return result


def _writer(store: Store, plan: CheckPlan, base: str, number: int,
            barrier: Barrier) -> WriterReport:
    report = WriterReport([], [], [], [])
    for round_ in range(plan.rounds):
        barrier.wait(BARRIER_TIMEOUT)
        won, created, replaced = _round(store, plan, f"{base}{round_}-", (number, round_),
                                        barrier, report.errors)
        report.wins.append(won)
        report.create_reads.append(created)
        report.replace_reads.append(replaced)
    return report


def _round(store: Store, plan: CheckPlan, base: str, who: tuple[int, int],
           barrier: Barrier, errors: list[str]) -> tuple[bool, str, str]:
    """One round of writer ``who[0]``: whether it won the create, and the digests
    of what it read back from the create and the replace key."""
    create, replace = base + "create", base + "replace"
    mine, payload = token(*who, 64), token(*who, plan.payload)
    won = _in_step(barrier, errors, f"put_if_absent {create}",
                   lambda: "won" if store.put_if_absent(create, mine) else "")
    created = _in_step(barrier, errors, f"get {create}", lambda: digest(store.get(create)))
    _in_step(barrier, errors, f"put {replace}", lambda: _put_once(store, replace, payload))
    replaced = _in_step(barrier, errors, f"get {replace}", lambda: digest(store.get(replace)))
    return won == "won", created, replaced


def _put_once(store: Store, key: str, data: bytes) -> str:
    """One put, not retried: another writer's bytes read back is this phase's race."""
    try:
        store._bounded(f"put {key}", lambda: store._put(key, data))  # noqa: SLF001
    except TransientStoreError:
        pass
    return ""


def _worker(plan: CheckPlan, base: str, number: int, barrier: Barrier,
            results: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """A writer process: open the store, run the rounds, send the report."""
    from . import open_store

    try:
        store = open_store(plan.urls[number % len(plan.urls)], s3_endpoint=plan.s3_endpoint)
        try:
            report = _writer(store, plan, base, number, barrier)
        finally:
            store.close()
    except Exception as exc:  # noqa: BLE001 - the parent reports it
        barrier.abort()
        report = WriterReport([], [], [], [f"writer {number}: {exc}"])
    results.put((number, report))


def judge(plan: CheckPlan, reports: list[WriterReport]) -> CheckResult:
    """Count what went wrong, round by round."""
    double = none = wrong = torn = 0
    errors = [e for r in reports for e in r.errors]
    complete = [r for r in reports if len(r.wins) == plan.rounds]
    if len(complete) == plan.writers:
        for round_ in range(plan.rounds):
            winners = [n for n, r in enumerate(complete) if r.wins[round_]]
            double += len(winners) > 1
            none += not winners
            expected = {digest(token(n, round_, 64)) for n in winners}
            wrong += any(r.create_reads[round_] not in expected for r in complete)
            payloads = {digest(token(n, round_, plan.payload)) for n in range(plan.writers)}
            torn += sum(r.replace_reads[round_] not in payloads for r in complete)
    elif not errors:
        errors.append("a writer process ended without a report")
    return CheckResult(plan, double, none, wrong, torn, errors)


def run_check(plan: CheckPlan, store: Store) -> CheckResult:
    """Run the races of ``plan`` (``store``: the first URL, for cleaning up)."""
    if plan.writers < 2 or plan.rounds < 1:
        raise UsageError("store check needs at least 2 writers and 1 round")
    base = f"{CHECK_PREFIX}{secrets.token_hex(8)}/"
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(plan.writers)
    results = context.Queue()
    processes = [context.Process(target=_worker, args=(plan, base, n, barrier, results))
                 for n in range(plan.writers)]
    for process in processes:
        process.start()
    try:
        reports = dict(results.get(timeout=BARRIER_TIMEOUT * 4 * plan.rounds)
                       for _ in processes)
    finally:
        for process in processes:
            process.join(BARRIER_TIMEOUT)
        _clean(store, base)
    return judge(plan, [reports[n] for n in sorted(reports)])


def _clean(store: Store, base: str) -> None:
    """Delete the check's keys (and, in a file store, its directories)."""
    for info in store.list(base):
        store.delete(info.key)
    root = getattr(store, "root", None)
    if isinstance(root, Path):
        for directory in (root / base, root / CHECK_PREFIX):
            with contextlib.suppress(OSError):  # another check's, or not empty
                directory.rmdir()
