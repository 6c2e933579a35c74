"""Shared pytest fixtures: a SeaweedFS S3 server and stores on both backends,
and the log checks every test gets.

``store`` / ``store_url`` / ``store_args`` are parametrised over ``file`` and
``s3``; within one test they all name the same, fresh, empty store.

After each test, every node daemon's log (tests/support/nodes.py) and the test's own
log records are checked: a WARNING or ERROR the test does not declare with
``@pytest.mark.daemon_log("regex", ...)`` fails it.

The fast tier (``pytest -m fast``, ``make test-fast``): every test is marked
``fast`` unless it is a ``cluster`` test, runs on the ``s3`` store, uses a
fixture (directly or through others) that starts a server or a node daemon
(each such fixture says so: it requests :func:`starts_a_server`), or is in a
module that drives the command line and outside tools end to end (the module
says so: ``pytestmark = pytest.mark.end_to_end``); in that tier
:func:`support.need_root` skips, so root-only work (mounts, device nodes)
stays in the full suite.
"""

from __future__ import annotations

import os

# before any test module imports grpc: see the daemon's (layerfs/node/daemon/service.py)
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import FAST_TIER, dummy_aws_env, moduleorder, nodes, weed_or_skip
from support.storeaway import AwayStore
from support.users import local_user  # noqa: F401  (a fixture for every test module)

from harness.s3server import S3Server, start_server
from layerfs.errors import StoreError
from layerfs.store import Store, open_store
from layerfs.store.s3 import S3Store

TEST_BUCKET = "layerfs-test"
BUCKET_TIMEOUT = 30.0
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "daemon_log(*patterns): WARNING/ERROR log records (regexes) the test "
        "expects from its daemons or in-process")
    config.addinivalue_line(
        "markers", "cluster: runs on the real SeaweedFS cluster of harness/seaweedcluster.py")
    config.addinivalue_line(
        "markers", "end_to_end: drives the CLI and outside tools end to end, a process per "
        "step (a module's pytestmark): not in the fast tier")
    config.addinivalue_line(
        "markers", "fast: the unit tier, no server, daemon or root (set by the conftest)")
    if config.getoption("markexpr") == "fast":
        os.environ[FAST_TIER] = "1"  # support.need_root skips (subprocesses see it too)
    if hasattr(config.option, "loadscopereorder"):  # the files' order is ours (below)
        config.option.loadscopereorder = False


@pytest.fixture(scope="session")  # (fixtures of every scope request it)
def starts_a_server() -> None:
    """Requested by every fixture that starts a server or a node daemon
    (SeaweedFS, a registry, containerd, a layerfs daemon, a machine): a test
    that uses one, directly or through others, is not in the fast tier."""


def in_fast_tier(item: pytest.Item) -> bool:
    """No cluster, no S3 store, no fixture that starts a server or a daemon,
    not an end-to-end module."""
    if item.get_closest_marker("cluster") or item.get_closest_marker("end_to_end"):
        return False
    callspec = getattr(item, "callspec", None)
    if callspec is not None and callspec.params.get("store_location") == "s3":
        return False
    return "starts_a_server" not in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if in_fast_tier(item):
            item.add_marker(pytest.mark.fast)
    # the longest files first, for the xdist workers (tests/support/moduleorder.py)
    items[:] = moduleorder.longest_first(items, moduleorder.recorded(config))


PHASE_SECONDS: list[tuple[str, float]] = []  # (nodeid, seconds) of every phase run here


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    PHASE_SECONDS.append((report.nodeid, report.duration))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """After a run of the whole suite (its files from ``testpaths``, no ``-m`` or
    ``-k``), keep each file's seconds for the next run's order; the xdist
    controller does it, with every worker's reports."""
    config = session.config
    whole = (config.args_source == pytest.Config.ArgsSource.TESTPATHS
             and not config.getoption("markexpr") and not config.getoption("keyword"))
    cache = getattr(config, "cache", None)
    if whole and cache is not None and not hasattr(config, "workerinput") and PHASE_SECONDS:
        cache.set(moduleorder.CACHE_KEY,
                  moduleorder.merged(moduleorder.recorded(config), PHASE_SECONDS))


def declared_patterns(item: pytest.Item) -> list[re.Pattern[str]]:
    return [re.compile(p) for mark in item.iter_markers("daemon_log") for p in mark.args]


@pytest.fixture(autouse=True)
def no_unexpected_log(request: pytest.FixtureRequest,
                      caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Fail the test if a daemon or this process logged a WARNING or ERROR it
    did not declare (set up first, so it checks after every other fixture's
    teardown, a daemon's shutdown included)."""
    allowed = declared_patterns(request.node)
    nodes.TEST_EXPECTS[:] = allowed
    try:
        yield
        problems = nodes.unexpected_records(
            caplog.get_records("setup") + caplog.get_records("call"), allowed)
        problems = [f"in-process: {line}" for line in problems]
        for daemon in list(nodes.DAEMONS):
            found = daemon.unexpected_log()
            if found:
                problems.append(nodes.unexpected_report(daemon, found))
        if problems:
            pytest.fail("unexpected log records:\n" + "\n".join(problems), pytrace=False)
    finally:
        nodes.TEST_EXPECTS.clear()


def in_ci() -> bool:
    return os.environ.get("CI") == "true"


def _create_bucket(endpoint: str) -> None:
    """Create the test bucket; the filer may need a moment after S3 first answers."""
    store = S3Store(TEST_BUCKET, endpoint=endpoint)
    deadline = time.monotonic() + BUCKET_TIMEOUT
    try:
        while True:
            try:
                store.create_bucket_if_missing()
                return
            except StoreError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
    finally:
        store.close()


@pytest.fixture(scope="session")
def s3_server(starts_a_server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A SeaweedFS server for the session, with bucket ``layerfs-test`` and dummy credentials."""
    weed = weed_or_skip()
    with dummy_aws_env():
        server = start_server(weed, tmp_path_factory.mktemp("seaweedfs"))
        try:
            _create_bucket(server.endpoint)
            yield server
        finally:
            server.stop()


@dataclass(frozen=True)
class StoreLocation:
    """Where a test's store lives: its URL and, for S3, the endpoint."""

    url: str
    endpoint: str | None = None

    def cli_args(self) -> list[str]:
        args = ["--store", self.url]
        return args + (["--s3-endpoint", self.endpoint] if self.endpoint else [])


@pytest.fixture(params=["file", "s3"])
def store_location(request: pytest.FixtureRequest, tmp_path: Path) -> StoreLocation:
    """A fresh, empty store location on each backend."""
    if request.param == "file":  # an empty store's directory (a missing one is unreachable)
        (tmp_path / "store").mkdir(exist_ok=True)
        return StoreLocation("file://" + str(tmp_path / "store"))
    server: S3Server = request.getfixturevalue("s3_server")
    prefix = f"t/{uuid.uuid4().hex[:16]}"
    return StoreLocation(f"s3://{TEST_BUCKET}/{prefix}", server.endpoint)


@pytest.fixture
def store(store_location: StoreLocation) -> Iterator[Store]:
    opened = open_store(store_location.url, store_location.endpoint)
    yield opened
    opened.close()


@pytest.fixture
def store_url(store_location: StoreLocation) -> str:
    return store_location.url


@pytest.fixture
def store_args(store_location: StoreLocation) -> list[str]:
    """CLI arguments naming the store: ``--store URL [--s3-endpoint EP]``."""
    return store_location.cli_args()


@pytest.fixture
def away_store(store_location: StoreLocation) -> Iterator[AwayStore]:
    """The test's store as a daemon reaches it, which the test can take away
    and bring back (tests/support/storeaway.py)."""
    reachable = AwayStore(store_location.url, store_location.endpoint)
    yield reachable
    reachable.close()
