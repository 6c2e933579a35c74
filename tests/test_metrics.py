"""The daemon's Prometheus metrics for real: a daemon with ``--metrics``, its
``/metrics`` parsed with prometheus_client's text parser, moving with the
work (a cold read, a warm one, ups and downs, live restarts); and the server
held against an unprivileged user's 2,000 idle and half-sent connections."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import build, need_root
from support.nodes import NodeDaemon, wait_for
from support.users import LocalUser

import layerfs
from harness.daemonproc import LAYERFS
from harness.registryserver import free_port
from layerfs.builder.env import create_env
from layerfs.node.control import wait_ready
from layerfs.node.daemon.metrics import MAX_CONNECTIONS
from layerfs.refstore import RefStore
from layerfs.store.base import blob_key

MiB = 1 << 20
FILE_SIZE = 6 * MiB

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def read_cold(path: Path) -> bytes:
    """The file's bytes, its page cache dropped first (the read asks the daemon)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return b"".join(iter(lambda: os.read(fd, MiB), b""))
    finally:
        os.close(fd)


@pytest.fixture
def metered(starts_a_server, tmp_path, store, store_location):
    """Layer m@1 (one 6 MiB file), env e@1, a daemon serving /metrics."""
    need_root()
    src = tmp_path / "m"
    src.mkdir()
    (src / "data").write_bytes(os.urandom(FILE_SIZE))
    digest = build(store, str(src), name="m", chunk_size=MiB).digest
    create_env(RefStore(store), "e", "1", ["m@1"])
    node = NodeDaemon(tmp_path / "node", store_location.cli_args())
    node.port = free_port()
    node.extra_args = ["--metrics", f"127.0.0.1:{node.port}"]
    node.digest = digest
    node.start()
    try:
        yield node
    finally:
        left = node.cleanup()
        assert not left, f"left mounted: {left}"


def test_metrics_move_with_the_work(metered, tmp_path):
    node, port = metered, metered.port
    before = scrape(port)
    assert value(before, "layerfs_sandboxes") == 0
    assert value(before, "layerfs_up_seconds_count") == 0
    assert value(before, "layerfs_restarts_total") == 0
    node.cli("up", "e@1", "--id", "s1")
    up = scrape(port)
    assert value(up, "layerfs_sandboxes") == 1
    assert value(up, "layerfs_up_seconds_count") == 1
    data = node.root / "sandboxes" / "s1" / "rootfs" / "data"
    assert len(read_cold(data)) == FILE_SIZE
    cold = scrape(port)
    assert value(cold, "layerfs_cache_misses_total") > value(up, "layerfs_cache_misses_total")
    assert value(cold, "layerfs_store_fetched_bytes_total") >= FILE_SIZE
    assert value(cold, "layerfs_fetch_seconds_count") > value(up, "layerfs_fetch_seconds_count")
    assert value(cold, "layerfs_cache_bytes") > 0
    assert value(cold, "layerfs_layer_read_bytes_total", layer=node.digest) >= FILE_SIZE
    # what ps can count is the layers' bytes read (by every sandbox using them), named so
    assert node.cli("ps").stdout.split()[:5] == ["ID", "STATE", "UPPER", "LAYERS", "READ"]
    assert value(cold, "layerfs_store_up") == 1
    assert value(cold, "layerfs_sandboxes_by_state", state="up") == 1
    assert value(cold, "layerfs_sandboxes_by_state", state="lost") == 0
    [info] = [labels for name, labels in cold if name == "layerfs_build_info"]
    assert dict(info)["version"] == layerfs.__version__

    node.kill()  # kill -9; the next daemon takes the FUSE connection over
    node.start()
    restarted = scrape(port)
    assert value(restarted, "layerfs_restarts_total") == 1
    assert value(restarted, "layerfs_sandboxes") == 1  # kept through the restart
    assert len(read_cold(data)) == FILE_SIZE  # the new daemon's memory is empty: from the cache
    warm = scrape(port)
    assert value(warm, "layerfs_cache_hits_total") > value(restarted, "layerfs_cache_hits_total")
    assert value(warm, "layerfs_store_fetched_bytes_total") == value(
        restarted, "layerfs_store_fetched_bytes_total")

    old = node.proc
    node.extra_args = ["--metrics", f"127.0.0.1:{port}", "--takeover"]
    node.start()  # returns once a daemon answers: maybe still the old one
    assert old.wait(60) == 0
    proc = node.proc
    assert wait_ready(node.root, lambda: proc.poll() is None, 60), node.log()[-4000:]
    assert value(scrape(port), "layerfs_restarts_total") == 2
    node.cli("down", "s1")
    assert value(scrape(port), "layerfs_sandboxes") == 0


@pytest.mark.daemon_log(r"ERROR layerfs\.node\.fuse\.nodefs: read: cannot read chunk",
                        r"ERROR layerfs\.node\.reads\.fetcher: chunk \S+: object not found in "
                        r"store",
                        r"ERROR layerfs\.node\.sandboxes\.dataloss: sandbox s1: the data of its "
                        r"layer ")
def test_store_errors_are_counted_by_kind(metered, store):
    node = metered
    node.cli("up", "e@1", "--id", "s1")
    refstore = RefStore(store)
    for pack in {e.pack for e in refstore.chunk_table(refstore.layer(node.digest)).entries}:
        store.delete(blob_key(pack))
    with pytest.raises(OSError):
        read_cold(node.root / "sandboxes" / "s1" / "rootfs" / "data")
    samples = scrape(node.port)
    assert value(samples, "layerfs_store_errors_total", kind="ObjectNotFound") >= 1
    # what the sandbox got instead of its bytes, by layer
    assert value(samples, "layerfs_read_errors_total", layer=node.digest) >= 1
    node.cli("down", "s1")


@pytest.mark.daemon_log(
    r"\"level\": \"ERROR\", \"logger\": \"layerfs\.node\.(fusefs|fetcher|dataloss)\"")
@pytest.mark.parametrize("store_location", ["file"], indirect=True)
def test_read_error_lines_name_the_layer(metered, store):
    """A read that fails: its JSON error lines (the FUSE read's, the fetch's)
    carry the layer's digest and the read's offset and size; the fetch's also
    what it fetched and the store key."""
    node = metered
    node.stop()
    node.extra_args = ["--metrics", f"127.0.0.1:{node.port}", "--log-format", "json"]
    node.start()
    node.cli("up", "e@1", "--id", "s1")
    refstore = RefStore(store)
    for pack in {e.pack for e in refstore.chunk_table(refstore.layer(node.digest)).entries}:
        store.delete(blob_key(pack))
    with pytest.raises(OSError):
        read_cold(node.root / "sandboxes" / "s1" / "rootfs" / "data")
    records = [json.loads(line) for line in node.log().splitlines() if line.startswith("{")]
    errors = [r for r in records if r["level"] == "ERROR"]
    assert {r["logger"] for r in errors} == {  # (s1 lost that layer: dataloss)
        "layerfs.node.fuse.nodefs", "layerfs.node.reads.fetcher", "layerfs.node.sandboxes.dataloss"}
    for record in errors:
        assert record["layer"] == node.digest, record
        assert record["offset"] >= 0 and record["size"] > 0, record
    fetches = [r for r in errors if r["logger"] == "layerfs.node.reads.fetcher"]
    assert fetches and all(r["store_key"].startswith("blobs/sha256/") and r["fetch"]
                           for r in fetches)
    node.cli("down", "s1")


def test_metrics_listen_on_the_given_host_only(metered):
    assert value(scrape(metered.port), "layerfs_sandboxes") == 0
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", metered.port), timeout=5).close()


@pytest.mark.parametrize("address", ["9100", "localhost:", "host:port", "127.0.0.1:70000",
                                     "node1:9100", "127.0.0.1:\u0669\u0661"])
def test_a_bad_metrics_address_is_one_error_line(address, tmp_path):
    need_root()
    proc = subprocess.run([*LAYERFS, "daemon", "--root", str(tmp_path / "node"),
                           "--metrics", address], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"layerfs: error: --metrics {address!r}: expected HOST:PORT, e.g. 127.0.0.1:9100"]


@pytest.mark.parametrize("store_location", ["file"], indirect=True)
def test_json_logs_are_one_object_a_line(tmp_path, store_location):
    """The daemon's lines and its keeper's (a keeper letting a connection go)."""
    need_root()
    node = NodeDaemon(tmp_path / "node", store_location.cli_args())
    node.extra_args = ["--log-format", "json", "--restart-grace", "1"]
    node.start()
    try:
        keeper = int(re.search(r"the FUSE connection is kept by pid (\d+)", node.log())[1])
        node.kill()
        wait_for(lambda: not Path(f"/proc/{keeper}").exists(), "the keeper to let go", 15)
        node.start()  # detaches the dead connection's mount (a warning)
    finally:
        left = node.cleanup()
    assert not left, f"left mounted: {left}"
    records = [json.loads(line) for line in node.log().splitlines()]
    assert all({"level", "logger", "message", "time"} <= set(r) for r in records)
    ready = [r for r in records if r["message"].startswith("layerfs daemon ready at ")]
    assert ready and ready[0]["level"] == "INFO"
    assert ready[0]["logger"] == "layerfs.node.daemon.events"
    assert ready[0]["version"] == layerfs.__version__ and ready[0]["sandboxes"] == 0
    assert {"logger": "layerfs.node.fuse.keeper", "level": "WARNING",
            "message": "no daemon took the FUSE connection within 1 s: letting it go; reads "
            "waiting on its mounts fail"} in [{k: r[k] for k in ("logger", "level", "message")}
                                             for r in records]
    assert records[-1]["message"] == (f"layerfs daemon stopped: version {layerfs.__version__}, "
                                      "0 sandboxes and 0 vms unmounted, their vms' drives closed")


def test_lifecycle_lines_carry_their_fields(metered, tmp_path):
    """A sandbox's up, commit and down, a restart and a stop: each one INFO line
    whose JSON object names the sandbox, its env, its layers (names and
    digests) and the duration; the start and stop summaries count the
    sandboxes restored, handed over and unmounted; botocore's note about
    the credentials it found is not among them."""
    node = metered
    node.cli("up", "e@1", "--id", "s1")
    (node.root / "sandboxes" / "s1" / "rootfs" / "new").write_bytes(b"committed\n")
    node.cli("commit", "s1", "--name", "c", "--version", "1")
    node.cli("down", "s1")
    node.cli("up", "e@1", "--id", "s2")
    node.extra_args = ["--metrics", f"127.0.0.1:{node.port}", "--takeover", "--log-format",
                       "json"]
    old = node.proc
    node.start()  # returns once a daemon answers: maybe still the old one
    assert old.wait(60) == 0
    proc = node.proc
    assert wait_ready(node.root, lambda: proc.poll() is None, 60), node.log()[-4000:]
    assert node.stop() == 0
    text = [line for line in node.log().splitlines() if not line.startswith("{")]
    records = [json.loads(line) for line in node.log().splitlines() if line.startswith("{")]
    assert any(re.search(r"INFO layerfs\.node\.daemon\.events: sandbox s1 up in \d+\.\d\d s: "
                         r"env e@1, "
                         r"layer m@1$", line) for line in text), text
    assert any(re.search(r"INFO layerfs\.node\.daemon\.events: sandbox s1 committed as c@1 sha256:",
                         line) for line in text), text
    assert any(re.search(r"INFO layerfs\.node\.daemon\.events: sandbox s1 down in .* s \(down\)",
                         line) for line in text), text
    assert any(re.search(r"layerfs daemon stopped: .* 1 sandbox and 0 vms handed over", line)
               for line in text), text
    assert not any("Found credentials" in line for line in text)
    # the next daemon's lines are JSON, with the fields
    [ready] = [r for r in records if r["message"].startswith("layerfs daemon ready at ")]
    assert (ready["sandboxes"], ready["states"], ready["vms"]) == (1, {"up": 1}, 0)
    assert ready["version"] == layerfs.__version__ and ready["duration"] >= 0
    [stopped] = [r for r in records if r["message"].startswith("layerfs daemon stopped")]
    assert (stopped["sandboxes"], stopped["ending"]) == (1, "unmounted")
    assert not any("Found credentials" in r["message"] for r in records)


@pytest.mark.parametrize("store_location", ["file"], indirect=True)
def test_lifecycle_fields_in_json(metered):
    """An up and a down as JSON objects with their fields; `stats` with names."""
    node = metered
    node.stop()
    node.extra_args = ["--metrics", f"127.0.0.1:{node.port}", "--log-format", "json"]
    node.start()
    node.cli("up", "--layer", "m@1", "--id", "s1")
    # `stats` names each layer beside its digest
    assert f"layer m@1 {node.digest[:19]}: read " in node.cli("stats").stdout
    assert node.request("stats")["layers"][node.digest]["name"] == "m@1"
    node.cli("down", "s1")
    records = [json.loads(line) for line in node.log().splitlines() if line.startswith("{")]
    [up] = [r for r in records if r["message"].startswith("sandbox s1 up in ")]
    assert up["logger"] == "layerfs.node.daemon.events" and up["level"] == "INFO"
    assert up["message"].endswith(": layer m@1"), up
    assert (up["sandbox"], up["env"], up["layers"], up["layer_refs"], up["state"]) == (
        "s1", None, [node.digest], ["m@1"], "up")
    assert isinstance(up["duration"], float) and up["duration"] > 0
    [down] = [r for r in records if r["message"].startswith("sandbox s1 down in ")]
    assert (down["sandbox"], down["layers"], down["state"]) == ("s1", [node.digest], "down")

    node.cli("vm", "up", "--layer", "m@1", "--id", "v1", "--disk-size", "16M")
    node.cli("vm", "down", "v1")
    records = [json.loads(line) for line in node.log().splitlines() if line.startswith("{")]
    [vm_up] = [r for r in records if r["message"].startswith("vm v1 up in ")]
    assert (vm_up["vm"], vm_up["layers"], vm_up["state"]) == ("v1", [node.digest], "up")
    assert vm_up["message"].endswith(": 1 layer drive, disk " + vm_up["disk"]), vm_up
    [vm_down] = [r for r in records if r["message"].startswith("vm v1 down in ")]
    assert vm_down["vm"] == "v1" and vm_down["duration"] >= 0


def raw_send(port: int, data: bytes) -> socket.socket:
    """A fresh connection with ``data`` sent on it."""
    conn = socket.create_connection(("127.0.0.1", port), timeout=60)
    if data:
        conn.sendall(data)
    return conn


def raw_answer(conn: socket.socket) -> bytes:
    """Everything the server answers until it closes the connection (a close
    with bytes of ours unread is a reset)."""
    got = b""
    with conn:
        try:
            while chunk := conn.recv(65536):
                got += chunk
        except ConnectionResetError:
            pass
    return got


def raw_exchange(port: int, data: bytes) -> bytes:
    return raw_answer(raw_send(port, data))


@pytest.mark.parametrize("store_location", ["file"], indirect=True)  # (the server alone)
def test_the_server_answers_one_request_and_closes_the_rest(metered):
    """One request, one answer, closed; a wrong method or path is answered
    so; an idle connection, a half-sent request and a head past 8 KiB are
    closed by the server with no answer (the client does not close them)."""
    port = metered.port
    idle, half = raw_send(port, b""), raw_send(port, b"GET /metrics HTTP/1.1\r\nHost:")
    answer = raw_exchange(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"Connection: close" in head
    assert int(re.search(rb"Content-Length: (\d+)", head)[1]) == len(body)
    assert b"layerfs_sandboxes 0.0" in body
    assert raw_exchange(port, b"HEAD /metrics HTTP/1.0\r\n\r\n").endswith(b"\r\n\r\n")
    assert raw_exchange(port, b"POST /metrics HTTP/1.1\r\n\r\n").startswith(
        b"HTTP/1.1 405 ")
    assert raw_exchange(port, b"GET /other HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 404 ")
    assert raw_exchange(port, b"\x16\x03\x01 tls?\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    assert raw_answer(idle) == b""  # closed after the request timeout
    assert raw_answer(half) == b""
    assert raw_exchange(port, b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 9000) == b""
    assert value(scrape(port), "layerfs_sandboxes") == 0


# as an unprivileged user: open N connections to the port, the odd ones with a
# request cut short (no blank line), hold them until stdin closes; prints how
# many connected and how many could not
FLOOD = """
import resource, socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
held, failed = [], 0
for i in range(n):
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
    except OSError:
        failed += 1
        continue
    held.append(s)
    if i % 2:
        try:  # (the server may have closed it already)
            s.sendall(b"GET /metrics HTTP/1.1\\r\\nHost: 127.0.0.1\\r\\nX-Slow: ")
        except OSError:
            pass
print(len(held), failed, flush=True)
sys.stdin.read()
"""
FLOOD_CONNECTIONS = 2000


def daemon_counts(pid: int) -> tuple[int, int]:
    """The daemon's threads and open file descriptors."""
    status = Path(f"/proc/{pid}/status").read_text()
    threads = int(re.search(r"^Threads:\s+(\d+)", status, re.M)[1])
    return threads, len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.parametrize("store_location", ["file"], indirect=True)  # (the server alone)
def test_a_connection_flood_adds_no_thread(metered, local_user: LocalUser):
    """prometheus_client's server made a thread per connection and kept it:
    3,000 connections were 3,000 threads, and a pids bound then failed `up`,
    `ps` and cold reads. Served by the trio loop, the connections cost the
    daemon no thread and at most MAX_CONNECTIONS descriptors, and the work
    goes on meanwhile, scrapes included."""
    node, port = metered, metered.port
    node.cli("up", "e@1", "--id", "s1")
    pid = node.proc.pid
    threads, fds = daemon_counts(pid)
    flood = subprocess.Popen(["runuser", "-u", local_user.name, "--", "/usr/bin/python3", "-c",
                              FLOOD, str(port), str(FLOOD_CONNECTIONS)], cwd="/",
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        held, failed = map(int, flood.stdout.readline().split())
        assert (held, failed) == (FLOOD_CONNECTIONS, 0)  # every connection was made
        peak = daemon_counts(pid)
        node.cli("up", "e@1", "--id", "s2")
        assert "s2" in node.cli("ps").stdout
        data = node.root / "sandboxes" / "s2" / "rootfs" / "data"
        assert len(read_cold(data)) == FILE_SIZE
        during = daemon_counts(pid)
        # a scrape gets in: it closes the oldest connection still without a request
        assert value(scrape(port), "layerfs_sandboxes") == 2
    finally:
        flood.stdin.close()
        flood.wait(60)
    assert flood.returncode == 0
    # the trio loop's worker threads (bounded by its limiter) serve the up and
    # the reads; the connections add none, and no more descriptors than the bound
    for count in (peak, during):
        assert count[0] <= threads + 40, (threads, count)
        assert count[1] <= fds + MAX_CONNECTIONS + 16, (fds, count)
    print(f"threads {threads}, flooded {peak[0]}, with the work {during[0]}; "
          f"descriptors {fds}, {peak[1]}, {during[1]}")
    samples = scrape(port)  # and after
    assert value(samples, "layerfs_sandboxes") == 2
    assert value(samples, "layerfs_up_seconds_count") == 2
    node.cli("down", "s1")
    node.cli("down", "s2")
