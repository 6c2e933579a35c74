"""Whether a store is usable (quick checks) and safe to share between writers
(races run against it).

:func:`quick_check` (``store init`` after :func:`create_store`, ``store
check`` before its races, the node daemon at start): the store exists and the
credentials list it, a conditional put refuses a second create, a put is read
back whole and listed; one :class:`QuickCheck` verdict.

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
import dataclasses
import errno
import hashlib
import multiprocessing
import os
import secrets
import stat
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.synchronize import Barrier
from pathlib import Path

from ..errors import StoreError, TransientStoreError, UsageError
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


class StoreNotSafe(StoreError):
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


# -- the quick checks: ``store init``, and the node daemon at start --------------------------

QUICK_PAYLOAD = 4096  # bytes of the read-after-write object


@dataclass(frozen=True)
class QuickCheck:
    """Whether a store is usable: the quick checks that passed, and the first
    failure (its error and what to do about it)."""

    url: str
    created: bool  # the bucket or directory was made by this check (``store init``)
    passed: tuple[str, ...]
    failed: str = ""  # the check that failed
    error: StoreError | None = None
    advice: str = ""
    warnings: tuple[str, ...] = ()  # a usable store's risks (a directory others can change)

    @property
    def usable(self) -> bool:
        return self.error is None

    def verdict(self) -> str:
        """One line: usable (what was checked), or what is wrong and what to do."""
        if self.error is None:
            made = "created; " if self.created else ""
            return f"{self.url}: usable ({made}{', '.join(self.passed)} ok)"
        return f"{self.url}: not usable: {self.failed}: {self.error}; {self.advice}"

    def refusal(self) -> StoreError | None:
        """The failure as the error the CLI exits with: the store error's own
        class (its exit code), its message the verdict line."""
        if self.error is None:
            return None
        cls = _one_argument_class(type(self.error))
        return cls(f"{self.url}: {self.failed}: {_inner(self.error)}; {self.advice}")


def _one_argument_class(cls: type[StoreError]) -> type[StoreError]:
    """``cls`` or the nearest base whose message takes one argument (same exit code)."""
    for base in cls.__mro__:
        if issubclass(base, StoreError) and (base.__doc__ or "").count("{}") == 1 \
                and base.exit_code == cls.exit_code:
            return base
    return StoreError


def _inner(error: StoreError) -> str:
    """The error's message without its class's prefix when it has a single argument."""
    if len(error.args) == 1 and (type(error).__doc__ or "").count("{}") == 1:
        return str(error.args[0])
    return error.message()


def create_store(store: Store) -> bool:
    """Create the store's bucket (S3) or directory (a file store) unless it exists;
    whether it was created."""
    bucket_exists = getattr(store, "bucket_exists", None)
    if callable(bucket_exists):
        if bucket_exists():
            return False
        store.create_bucket_if_missing()  # type: ignore[attr-defined]
        return True
    root = getattr(store, "root", None)
    if isinstance(root, Path):
        if root.is_dir():
            return False
        try:
            root.mkdir(parents=True)
        except FileExistsError:
            return False
        except OSError as exc:
            raise _directory_error(exc) from exc
        return True
    return False


def _directory_error(exc: OSError) -> StoreError:
    from ..errors import AccessDenied

    reason = exc.strerror or str(exc)
    message = f"cannot create the directory: {reason[:1].lower()}{reason[1:]}"
    if isinstance(exc, PermissionError) or exc.errno == errno.EROFS:
        return AccessDenied(message)
    return StoreError(message)


def advice_for(error: StoreError, url: str) -> str:
    """What to do about ``error`` met on the store at ``url``."""
    from ..errors import AccessDenied, ObjectUnavailable, StoreUnreachable

    s3 = url.startswith("s3://")
    if isinstance(error, AccessDenied):
        if s3:
            return ("check the credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE)"
                    " and that they may list, read, write and delete under the prefix")
        return "make the directory (or, for a new one, its parent) writable, or choose another"
    if isinstance(error, StoreNotSafe):
        return "use a store that honours conditional puts and reads its own writes"
    if isinstance(error, StoreUnreachable):
        if s3:
            return "check the endpoint (--s3-endpoint / AWS_ENDPOINT_URL) and that the server runs"
        return (f"create the directory with `layerfs store init {url}`, or mount its"
                " file system")
    if isinstance(error, ObjectUnavailable):
        return "the store answers but fails: check its servers' health and logs, then try again"
    if "does not exist" in str(error):
        return f"create it with `layerfs store init {url}`"
    return "see the error above"


def quick_check(store: Store, created: bool = False) -> QuickCheck:
    """The quick checks, in order, stopping at the first that fails: the store
    exists and the credentials list it, a conditional put creates a new key and
    refuses a second create of it, and a put is read back whole and listed.
    Its keys (under ``check/<random>/``) are deleted afterwards. Blocking."""
    passed: list[str] = []
    base = f"{CHECK_PREFIX}{secrets.token_hex(8)}/"
    steps: list[tuple[str, Callable[[], None]]] = [
        ("credentials", lambda: _exists_and_lists(store, base)),
        ("conditional put", lambda: _conditional_put(store, base + "create")),
        ("read-after-write", lambda: _read_after_write(store, base + "object")),
    ]
    try:
        for name, step in steps:
            try:
                step()
            except StoreError as exc:
                return QuickCheck(store.url, created, tuple(passed), name, exc,
                                  advice_for(exc, store.url))
            passed.append(name)
    finally:
        with contextlib.suppress(StoreError):
            _clean(store, base)
    return QuickCheck(store.url, created, tuple(passed))


def _exists_and_lists(store: Store, base: str) -> None:
    bucket_exists = getattr(store, "bucket_exists", None)
    if callable(bucket_exists) and not bucket_exists():
        bucket, where = getattr(store, "bucket", ""), getattr(store, "where", "")
        raise StoreError(f"bucket {bucket!r} does not exist at {where}")
    store.list(base)


def _conditional_put(store: Store, key: str) -> None:
    first, second = b"layerfs store check: first create\n", b"layerfs store check: second\n"
    if not store.put_if_absent(key, first):
        raise StoreNotSafe(f"put_if_absent of a new key {key} did not create it")
    if store.put_if_absent(key, second):
        raise StoreNotSafe(f"a second put_if_absent of {key} was not refused"
                           " (If-None-Match ignored)")
    if store.get(key) != first:
        raise StoreNotSafe(f"{key} does not hold the first create's bytes after a second create")


def _read_after_write(store: Store, key: str) -> None:
    data = token(0, 0, QUICK_PAYLOAD)
    store.put(key, data)
    if store.get(key) != data:
        raise StoreNotSafe(f"a get of {key} right after its put returned other bytes")
    if key not in {info.key for info in store.list(key.rpartition("/")[0] + "/")}:
        raise StoreNotSafe(f"a list right after the put of {key} does not show it")


def init_store(store: Store) -> QuickCheck:
    """``store init``: create the bucket or directory, then the quick checks,
    and for a file store the warnings of :func:`directory_warnings`."""
    try:
        created = create_store(store)
    except StoreError as exc:
        return QuickCheck(store.url, False, (), "create", exc, advice_for(exc, store.url))
    result = quick_check(store, created)
    root = getattr(store, "root", None)
    if result.usable and isinstance(root, Path):
        result = dataclasses.replace(result, warnings=directory_warnings(root))
    return result


def directory_warnings(root: Path) -> tuple[str, ...]:
    """Who else could change a file store's objects: the store directory, its
    folders and the directories above it must belong to root (or to the
    caller) and be writable by no one else (an ancestor with the sticky bit,
    such as /tmp, may be); one line per directory that is not so. Whoever
    can write there can plant refs and blobs that every node then reads."""
    trusted = {0, os.geteuid()}
    paths = [root, *sorted(_folders(root)), *root.parents]
    found = []
    for path in paths:
        try:
            st = os.lstat(path)
        except OSError:
            continue
        ancestor = path != root and root.is_relative_to(path)
        if st.st_uid not in trusted:
            found.append(f"{path} belongs to uid {st.st_uid}, not root: that user can plant "
                         "objects every node reads (chown root)")
        elif st.st_mode & 0o022 and not (ancestor and st.st_mode & stat.S_ISVTX):
            found.append(f"{path} is writable by {'others' if st.st_mode & 0o002 else 'its group'}"
                         f" (mode {stat.S_IMODE(st.st_mode):04o}): they can plant objects every"
                         " node reads (chmod go-w)")
    return tuple(found)


def _folders(root: Path) -> list[Path]:
    """The store's top folders (refs, blobs, ...), not followed if symlinks."""
    try:
        return [Path(e.path) for e in os.scandir(root) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
