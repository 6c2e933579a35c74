"""The node daemon's Prometheus metrics (``layerfs daemon --metrics HOST:PORT``).

Served at ``/metrics`` from the daemon's own trio loop (:class:`MetricsServer`),
bound to the given host only: at most MAX_CONNECTIONS connections at once, a
request's head read within REQUEST_TIMEOUT seconds of its connection (an
idle or a half-sent request is closed then) and the answer written within
RESPONSE_TIMEOUT; the text is made in one thread at a time. A connection
past the bound closes the oldest one still waiting for its request (a
client sends its request as soon as it connects, so an idle flood cannot
keep a scraper out), or, if every one has sent its request, is closed
itself. So no client, however many connections it opens, adds a thread or
more than MAX_CONNECTIONS file descriptors to the daemon (prometheus_client's
own server started a thread per connection, with no timeout). Most values are read when scraped
from what the daemon already counts (the cache's stats, the sandbox records,
the mounted layers' blob files); the daemon's code only observes what has no
counter of its own: a store fetch's duration, an ``up``'s duration, a store
error's kind. ``layerfs_restarts_total`` is kept in the replica, so it counts
the live restarts of ROOT's daemon over its life; the other counters are this
process's (a restart resets them, as Prometheus's ``rate()`` expects).

Reads come to the daemon through overlayfs, then EROFS, then the layer's FUSE
blob file, and the kernel's page caches of EROFS and of the blob file are the
layer's, shared by every sandbox using it: a sandbox reading pages another
sandbox read first sends no FUSE request at all. So no sandbox's own reads
can be counted here; what is counted per layer is the bytes its blob file
served (``layerfs_layer_read_bytes_total{layer}``).
"""

from __future__ import annotations

import errno
import logging
import platform
import socket
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import pyfuse3
import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from ... import __version__
from ...errors import UsageError
from ...logcontext import LOG_CONTEXT
from ...ratelog import RateLimitedLog
from ..fuse.nodefs import NodeFS
from ..sandboxes.lifecycle import SandboxState

FETCH_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
UP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
MAX_CONNECTIONS = 32  # open at once (one more evicts the oldest still waiting for its request)
REQUEST_TIMEOUT = 5.0  # seconds from the connection to the end of its request's head
RESPONSE_TIMEOUT = 10.0  # seconds to make the answer and write it
MAX_HEAD = 8192  # bytes of a request's head (request line and header lines)
BACKLOG = 1024  # connections the kernel holds until accepted (no file descriptor of ours)
ACCEPT_BACKOFF = 0.1  # seconds to wait when accept() finds no file descriptor left
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MetricsAddress:
    host: str
    port: int


def parse_address(text: str) -> MetricsAddress:
    """``HOST:PORT``, HOST an IP address (an IPv6 one in brackets:
    ``[::1]:9100``): the metrics listen where the operator says, never where a
    name happens to resolve."""
    host, sep, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not _is_ip(host) or not (port.isascii() and port.isdigit()) \
            or not 0 < int(port) < 65536:
        raise UsageError(f"--metrics {text!r}: expected HOST:PORT, e.g. 127.0.0.1:9100")
    return MetricsAddress(host, int(port))


def _is_ip(host: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class NodeReadings:
    """What the daemon counts already, read at scrape time (from the render thread)."""

    cache: Callable[[], dict[str, int]]  # the chunk cache's stats (taken under its lock)
    sandboxes: Callable[[], int]
    restarts: Callable[[], int]
    layer_bytes_read: Callable[[], dict[str, int]]  # layer digest → bytes its blob file served
    sandbox_states: Callable[[], dict[str, int]]  # state → sandboxes in it
    store_reachable: Callable[[], bool]  # the store health's verdict
    read_errors: Callable[[], dict[str, int]]  # layer digest → reads answered with an error


class NodeCollector(Collector):
    """The metrics read from the daemon's own counters when scraped."""

    def __init__(self, readings: NodeReadings) -> None:
        self.readings = readings

    def collect(self) -> Iterator[Any]:
        stats = self.readings.cache()
        yield counter("layerfs_cache_hits_total", "chunk reads served from the cache",
                      stats["hits"])
        yield counter("layerfs_cache_misses_total", "chunk reads the cache did not hold",
                      stats["misses"])
        yield counter("layerfs_store_fetched_bytes_total",
                      "bytes of chunks fetched from the store (uncompressed)",
                      stats["bytes_fetched"])
        yield gauge("layerfs_cache_bytes", "bytes in the cache's files", stats["size"])
        yield gauge("layerfs_cache_limit_bytes", "the cache's bound", stats["limit"])
        yield gauge("layerfs_sandboxes", "sandboxes on this node", self.readings.sandboxes())
        yield counter("layerfs_restarts_total",
                      "live restarts of this ROOT's daemon (a takeover, or a start after a crash)",
                      self.readings.restarts())
        yield layer_counter(self.readings.layer_bytes_read().items())
        yield gauge("layerfs_store_up", "1 while the store answers, 0 while the node finds it "
                    "away (reads of uncached chunks fail, ups use the node's resolutions)",
                    1 if self.readings.store_reachable() else 0)
        yield state_gauge(self.readings.sandbox_states())
        errors = CounterMetricFamily(
            "layerfs_read_errors", "reads of a layer's blob file answered with an error "
            "(EIO or a timeout: a sandbox or vm saw it), by layer", labels=["layer"])
        for digest, count in sorted(self.readings.read_errors().items()):
            errors.add_metric([digest], count)
        yield errors
        yield build_info()


def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name.removesuffix("_total"), doc, value=value)


def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def state_gauge(states: dict[str, int]) -> GaugeMetricFamily:
    """Sandboxes by lifecycle state, every state named (0 when none is in it)."""
    family = GaugeMetricFamily("layerfs_sandboxes_by_state", "sandboxes on this node by "
                               "state (lost: its mounts could not be brought back)",
                               labels=["state"])
    for state in SandboxState:
        family.add_metric([state.value], states.get(state.value, 0))
    return family


def build_info() -> GaugeMetricFamily:
    family = GaugeMetricFamily("layerfs_build_info", "the daemon's version (always 1)",
                               labels=["version", "python"])
    family.add_metric([__version__, platform.python_version()], 1)
    return family


def layer_counter(layers: Iterable[tuple[str, int]]) -> CounterMetricFamily:
    family = CounterMetricFamily(
        "layerfs_layer_read_bytes", "bytes a mounted layer's blob file served (all the "
        "sandboxes using the layer: the kernel's page cache of a layer is shared)",
        labels=["layer"])
    for digest, nbytes in layers:
        family.add_metric([digest], nbytes)
    return family


class NodeMetrics:
    """The daemon's metrics registry and the observations made by its code."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.fetch_seconds = Histogram("layerfs_fetch_seconds",
                                       "duration of a store read of a chunk or a run of chunks",
                                       buckets=FETCH_BUCKETS, registry=self.registry)
        self.up_seconds = Histogram("layerfs_up_seconds", "duration of a sandbox's up",
                                    buckets=UP_BUCKETS, registry=self.registry)
        self.store_errors = Counter("layerfs_store_errors_total",
                                    "store reads that failed, by kind", ["kind"],
                                    registry=self.registry)
        self.data_lost = Counter("layerfs_sandbox_data_lost_total",
                                 "sandboxes found using a layer whose data the store no "
                                 "longer has, by layer", ["layer"], registry=self.registry)

    def read_from(self, readings: NodeReadings) -> None:
        self.registry.register(NodeCollector(readings))

    def text(self) -> bytes:
        """The Prometheus text of every metric (collectors read under their own locks)."""
        return generate_latest(self.registry)


class MeteredFS(NodeFS):
    """The node's FUSE file system, counting the reads of each blob file it
    answers with an error (by the blob's digest): what a sandbox or a vm
    reading that layer got instead of its bytes. A read of a blob file is
    done with the layer, offset and size as its log context (JSON lines
    logged by it, or by the fetches it starts, carry them)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read_errors: dict[str, int] = {}

    async def read(self, fh: int, off: int, size: int) -> Any:  # type: ignore[override]
        blob = self.blobs.by_inode.get(fh)
        token = LOG_CONTEXT.set(None if blob is None else
                                {"layer": blob.digest, "offset": off, "size": size})
        try:
            return await super().read(fh, off, size)
        except pyfuse3.FUSEError:
            if blob is not None:
                self.read_errors[blob.digest] = self.read_errors.get(blob.digest, 0) + 1
            raise
        finally:
            LOG_CONTEXT.reset(token)


class CountingLog(RateLimitedLog):
    """A rate-limited log of store errors that counts every one by kind
    (each counted, whether its line is written or left out)."""

    def __init__(self, logger: logging.Logger, errors: Counter) -> None:
        super().__init__(logger)
        self.errors = errors

    def log(self, level: int, kind: str, msg: str, *args: object) -> None:
        self.errors.labels(kind).inc()
        super().log(level, kind, msg, *args)


def listen(address: MetricsAddress) -> socket.socket:
    """A listening TCP socket at ``address`` (OSError if it cannot be had)."""
    family = socket.AF_INET6 if ":" in address.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((address.host, address.port))
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


@dataclass(frozen=True)
class Answer:
    status: str
    content_type: str
    body: bytes


class MetricsServer:
    """``/metrics`` over HTTP/1.0-style connections (one request, one answer,
    then closed), served by the trio loop. The listening socket is made
    before the loop runs (:func:`listen`), so a port that cannot be had
    stops the start."""

    def __init__(self, sock: socket.socket, render: Callable[[], bytes]) -> None:
        self.sock = sock
        self.render = render
        self.open = 0  # connections being served
        # the connections still waiting for their request, oldest first
        self.waiting: dict[int, trio.CancelScope] = {}
        self.serial = 0
        self.evicted = 0  # waiting connections closed for a newer one
        self.refused = 0  # new connections closed at once (all open ones answering)
        self.render_limit = trio.CapacityLimiter(1)  # one thread makes the text

    async def serve(self) -> None:
        listener = trio.socket.from_stdlib_socket(self.sock)
        with listener:
            async with trio.open_nursery() as nursery:
                while True:
                    try:
                        conn, _ = await listener.accept()
                    except OSError as exc:
                        if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS,
                                             errno.ENOMEM, errno.ECONNABORTED):
                            raise
                        await trio.sleep(ACCEPT_BACKOFF)
                        continue
                    if self.open >= MAX_CONNECTIONS and not await self._evict():
                        self.refused += 1
                        conn.close()
                        continue
                    self.open += 1
                    self.serial += 1
                    nursery.start_soon(self._serve_one, conn, self.serial)

    async def _evict(self) -> bool:
        """Close the oldest connection still waiting for its request and wait
        until it is gone; False if every open connection has sent its own."""
        if not self.waiting:
            return False
        oldest = next(iter(self.waiting))
        self.waiting.pop(oldest).cancel()
        self.evicted += 1
        while self.open >= MAX_CONNECTIONS:  # its task ends at its next checkpoint
            await trio.sleep(0)
        return True

    async def _serve_one(self, conn: trio.socket.SocketType, serial: int) -> None:
        try:
            with conn:
                head = None
                with trio.move_on_after(REQUEST_TIMEOUT) as scope:
                    self.waiting[serial] = scope
                    head = await read_head(conn)
                self.waiting.pop(serial, None)
                if head is None:
                    return  # idle, half-sent, too long or closed: no answer
                with trio.move_on_after(RESPONSE_TIMEOUT):
                    answer = await self._answer(head)
                    await send_all(conn, http_response(answer, head.startswith(b"HEAD ")))
        except OSError:
            pass  # the client went away
        except Exception:  # a scrape must never end the daemon's loop
            log.exception("metrics: cannot answer a request")
        finally:
            self.waiting.pop(serial, None)
            self.open -= 1

    async def _answer(self, head: bytes) -> Answer:
        method, path = request_target(head)
        if method is None:
            return Answer("400 Bad Request", "text/plain", b"bad request\n")
        if method not in ("GET", "HEAD"):
            return Answer("405 Method Not Allowed", "text/plain", b"GET /metrics\n")
        if path.split("?", 1)[0] not in ("/metrics", "/"):
            return Answer("404 Not Found", "text/plain", b"GET /metrics\n")
        body = await trio.to_thread.run_sync(self.render, limiter=self.render_limit)
        return Answer("200 OK", CONTENT_TYPE_LATEST, body)


async def read_head(conn: trio.socket.SocketType) -> bytes | None:
    """The request's head (up to its blank line), or None if the client
    closed first or sent more than MAX_HEAD bytes without one."""
    data = b""
    while b"\r\n\r\n" not in data and b"\n\n" not in data:
        if len(data) >= MAX_HEAD:
            return None
        chunk = await conn.recv(MAX_HEAD)
        if not chunk:
            return None
        data += chunk
    return data


def request_target(head: bytes) -> tuple[str | None, str]:
    """The request line's method and path ((None, "") if it is not one)."""
    line = head.split(b"\n", 1)[0].rstrip(b"\r")
    parts = line.split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/") or not parts[1].startswith(b"/"):
        return None, ""
    try:
        return parts[0].decode("ascii"), parts[1].decode("ascii")
    except UnicodeDecodeError:
        return None, ""


def http_response(answer: Answer, head_only: bool) -> bytes:
    head = (f"HTTP/1.1 {answer.status}\r\nContent-Type: {answer.content_type}\r\n"
            f"Content-Length: {len(answer.body)}\r\nConnection: close\r\n\r\n").encode()
    return head if head_only else head + answer.body


async def send_all(conn: trio.socket.SocketType, data: bytes) -> None:
    view = memoryview(data)
    while view:
        sent = await conn.send(view)
        view = view[sent:]
