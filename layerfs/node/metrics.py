"""The node daemon's Prometheus metrics (``layerfs daemon --metrics HOST:PORT``).

Served at ``/metrics`` by prometheus_client's own HTTP server thread, off the
trio loop, bound to the given host only. Most values are read when scraped
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

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..errors import UsageError
from ..ratelog import RateLimitedLog

FETCH_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
UP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


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
    """What the daemon counts already, read at scrape time (from the HTTP thread)."""

    cache: Callable[[], dict[str, int]]  # the chunk cache's stats (taken under its lock)
    sandboxes: Callable[[], int]
    restarts: Callable[[], int]
    layer_bytes_read: Callable[[], dict[str, int]]  # layer digest → bytes its blob file served


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


def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name.removesuffix("_total"), doc, value=value)


def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


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

    def read_from(self, readings: NodeReadings) -> None:
        self.registry.register(NodeCollector(readings))

    def serve(self, address: MetricsAddress) -> None:
        """Start the HTTP server thread (a daemon thread: it ends with the process)."""
        start_http_server(address.port, addr=address.host, registry=self.registry)


class CountingLog(RateLimitedLog):
    """A rate-limited log of store errors that counts every one by kind
    (each counted, whether its line is written or left out)."""

    def __init__(self, logger: logging.Logger, errors: Counter) -> None:
        super().__init__(logger)
        self.errors = errors

    def log(self, level: int, kind: str, msg: str, *args: object) -> None:
        self.errors.labels(kind).inc()
        super().log(level, kind, msg, *args)
