"""The node daemon for real: FUSE blob files, kernel EROFS and overlayfs mounts,
sandboxes, store outages, corruption, crashes and the cache bound, on both
store backends."""

from __future__ import annotations

import errno
import os
import signal
import stat
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
from support import build, need_root
from support.baseenv import CHUNK, publish_base_env, settle, up
from support.nodes import NodeDaemon

from layerfs.builder.env import create_env
from layerfs.node.daemon.service import mounts_under
from layerfs.refstore import RefStore
from layerfs.store.base import blob_key


@pytest.fixture
def node(starts_a_server, tmp_path, store, store_location):
    """Layers base@1 and up@1, env e@1 (up over base), and a daemon on them."""
    publish_base_env(tmp_path, store)
    daemon = NodeDaemon(tmp_path / "node", store_location.cli_args(), cache_size="64M",
                        read_timeout=4.0).start()
    daemon.location = store_location
    try:
        yield daemon
    finally:
        left = daemon.cleanup()
        assert left == [], f"mounts left behind: {left}"


def test_rootfs_is_the_union_of_its_layers(node):
    assert stat.S_IMODE(os.stat(node.root / "control.sock").st_mode) == 0o600
    rootfs = up(node, "s1")
    lower = rootfs / "lower"
    assert (lower / "a").read_text() == "upper a"  # upper layer wins
    assert not (lower / "gone").exists()  # whiteout hides the lower file
    assert sorted(os.listdir(lower / "dir")) == ["x", "z"]  # directories merge
    assert os.listdir(lower / "opq") == ["new"]  # opaque directory hides lower contents
    assert (rootfs / "etc" / "os-release").read_text() == "NAME=test-base\n"
    node.cli("down", "s1")
    assert not rootfs.exists()


def test_writes_stay_in_their_sandbox(node, tmp_path):
    r1, r2 = up(node, "s1"), up(node, "s2")
    (r1 / "etc" / "os-release").write_text("changed")
    (r1 / "new-file").write_text("mine")
    os.unlink(r1 / "lower" / "a")
    upper = node.root / "sandboxes" / "s1" / "upper"
    assert (upper / "new-file").read_text() == "mine"
    assert (upper / "etc" / "os-release").read_text() == "changed"
    assert (r2 / "etc" / "os-release").read_text() == "NAME=test-base\n"
    assert not (r2 / "new-file").exists() and (r2 / "lower" / "a").exists()
    layer_dirs = list((node.root / "layers").iterdir())
    for d in layer_dirs:  # the shared layer mounts are read-only and unchanged
        with pytest.raises(OSError) as err:
            (d / "probe").write_text("x")
        assert err.value.errno == errno.EROFS
    ps = {r["id"]: r for r in node.request("ps")["sandboxes"]}
    assert ps["s1"]["upper_bytes"] > 0 and ps["s2"]["upper_bytes"] == 0
    node.cli("down", "s1", "--keep-upper")
    assert (upper / "new-file").exists()
    node.cli("down", "s2")


def test_busybox_run(node):
    up(node, "s1")
    proc = node.cli("run", "s1", "--", "sh", "-c",
                    "cat /etc/os-release; echo $$; ls /proc/1 >/dev/null && exit 7", check=False)
    assert proc.returncode == 7, proc.stderr
    assert "NAME=test-base" in proc.stdout
    assert proc.stdout.split()[-1] == "1"  # PID 1 of its own pid namespace
    node.cli("down", "s1")


@contextmanager
def store_outage(node: NodeDaemon):
    """Make the store unreachable: freeze the S3 server, or move the store away."""
    loc = node.location
    if loc.endpoint:
        import conftest  # noqa: F401 - the session server is the one in s3_server
        pid = int(node.s3_pid)
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(pid, signal.SIGCONT)
    else:
        path = loc.url.removeprefix("file://")
        os.rename(path, path + ".away")
        try:
            yield
        finally:
            os.rename(path + ".away", path)


@pytest.mark.daemon_log(
    r"ERROR layerfs\.node\.fuse\.nodefs: read: cannot read chunk",
    r"ERROR layerfs\.node\.reads\.fetcher: chunk \S+: (object not found in store|store unreachable"
    r"|no answer from the store within)",
    r"ERROR layerfs\.node\.reads\.fetcher: store does not answer",
)
def test_store_outage_gives_eio_in_bounded_time(node, request):
    if node.location.endpoint:
        node.s3_pid = request.getfixturevalue("s3_server").process.pid
    rootfs = up(node, "s1")
    with store_outage(node):
        found = subprocess.run(["find", str(rootfs)], capture_output=True, text=True, check=True)
        assert "data/file3" in found.stdout
        subprocess.run(["ls", "-lR", str(rootfs)], capture_output=True, check=True)
        for path in rootfs.rglob("*"):
            path.lstat()
        start = time.monotonic()
        with pytest.raises(OSError) as err:
            (rootfs / "data" / "file2").read_bytes()
        elapsed = time.monotonic() - start
        assert err.value.errno == errno.EIO
        assert elapsed < 4.0 + 10.0, elapsed  # the daemon's --read-timeout plus slack
    # the store is back: the same read works (after the daemon's short fail-fast window)
    deadline = time.monotonic() + 15
    while True:
        try:
            data = (rootfs / "data" / "file2").read_bytes()
            break
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.5)
    assert len(data) == 5 * CHUNK + 2468
    node.cli("down", "s1")


@pytest.mark.daemon_log(r"integrity check failed for chunk")
def test_corrupt_chunk_in_store_is_eio_and_logged(node, store):
    refstore = RefStore(store)
    manifest = refstore.layer(refstore.resolve("layers", "base@1"))
    table = refstore.chunk_table(manifest)
    victim = max(table.entries, key=lambda e: e.length)
    data = bytearray(store.get(blob_key(victim.pack)))
    data[victim.pack_offset + 10] ^= 0x55
    store.put(blob_key(victim.pack), bytes(data))
    rootfs = up(node, "s1")
    bad = 0
    for f in sorted(rootfs.rglob("*")):
        if not f.is_file() or f.is_symlink():
            continue
        try:
            f.read_bytes()
        except OSError as exc:
            assert exc.errno == errno.EIO
            bad += 1
    assert bad == 1  # only the file holding the damaged chunk
    assert victim.sha256.hex()[:16] in node.log()
    node.cli("down", "s1")


@pytest.mark.daemon_log(r"WARNING layerfs\.node\.reads\.chunkcache: cache file \S+ is damaged")
def test_corrupt_cache_file_is_refetched(node):
    rootfs = up(node, "s1")
    want = (rootfs / "data" / "file1").read_bytes()
    node.cli("down", "s1")
    assert node.stop() == 0  # drop the daemon's memory and the kernel's page cache
    files = list((node.root / "cache").glob("??/*"))
    assert files
    for p in files:  # damage every cached chunk on disk
        raw = bytearray(p.read_bytes())
        raw[-1] ^= 0xFF
        p.write_bytes(bytes(raw))
    node.start()
    rootfs = up(node, "s2")
    assert (rootfs / "data" / "file1").read_bytes() == want
    after = node.request("stats")["cache"]
    assert after["corrupt"] > 0 and after["bytes_fetched"] > 0
    assert "damaged" in node.log()
    node.cli("down", "s2")


@pytest.mark.daemon_log(r"WARNING layerfs\.node\.reads\.chunkcache: cache file \S+ is damaged")
def test_compressed_chunks_are_cached_as_their_frames_and_still_checked(node, tmp_path):
    """By default a chunk the store holds compressed (busybox's) is cached as
    its zstd frame, a raw one (the random data) plain; a damaged frame is
    dropped and fetched again. ``--cache-form plain`` caches all plain."""
    rootfs = up(node, "s1")
    want = (rootfs / "bin" / "busybox").read_bytes()
    (rootfs / "data" / "file0").read_bytes()
    node.cli("down", "s1")
    assert node.stop() == 0
    files = {p: p.read_bytes() for p in (node.root / "cache").glob("??/*")}
    frames = [p for p, raw in files.items() if raw[:8] == b"LFSCACZ1"]
    assert frames and {raw[:8] for raw in files.values()} == {b"LFSCACZ1", b"LFSCACH3"}
    raw = bytearray(files[frames[0]])
    raw[len(raw) // 2] ^= 0xFF
    frames[0].write_bytes(bytes(raw))
    node.start()
    rootfs = up(node, "s2")
    assert (rootfs / "bin" / "busybox").read_bytes() == want
    after = node.request("stats")["cache"]
    assert after["corrupt"] == 1 and after["bytes_fetched"] > 0
    node.cli("down", "s2")
    plain = NodeDaemon(tmp_path / "plain", [*node.location.cli_args(), "--cache-form", "plain"],
                       cache_size="64M").start()
    try:
        assert (up(plain, "p1") / "bin" / "busybox").read_bytes() == want
        plain.cli("down", "p1")
        assert {p.read_bytes()[:8] for p in (plain.root / "cache").glob("??/*")} == {b"LFSCACH3"}
    finally:
        assert plain.cleanup() == []


def test_kill_9_and_restart(node):
    rootfs = up(node, "s1")
    want = (rootfs / "data" / "file0").read_bytes()
    (rootfs / "kept").write_text("upper survives")
    settle(node)  # let readahead finish, so what it fetched is in the cache too
    node.kill()
    node.start()
    assert mounts_under(node.root) and all(
        "/sandboxes/" in p or "/layers/" in p or p.endswith("/fuse")
        for p in mounts_under(node.root))
    ps = {r["id"]: r for r in node.request("ps")["sandboxes"]}
    assert ps["s1"]["state"] == "up"  # brought back, not lost
    assert (rootfs / "data" / "file0").read_bytes() == want
    assert (rootfs / "kept").read_text() == "upper survives"
    assert node.request("stats")["cache"]["bytes_fetched"] == 0  # served from the cache
    up(node, "s2")
    node.cli("down", "s1")
    node.cli("down", "s2")


def test_cache_stays_within_its_bound(tmp_path, store, store_location):
    need_root()
    src = tmp_path / "big"
    src.mkdir()
    for i in range(12):
        (src / f"f{i}").write_bytes(os.urandom(2 << 20))  # 24 MiB = 3x the cache
    build(store, str(src), name="big", chunk_size=CHUNK)
    node = NodeDaemon(tmp_path / "node", store_location.cli_args(), cache_size="8M").start()
    try:
        rootfs = up(node, "s1", "--layer", "big@1")
        for f in sorted(rootfs.iterdir()):
            assert len(f.read_bytes()) == 2 << 20
            cache = node.request("stats")["cache"]
            assert cache["size"] <= 8 << 20
        assert cache["evictions"] > 0 and cache["bytes_fetched"] >= 24 << 20
        settle(node)  # cache files are written behind the reads
        on_disk = sum(p.stat().st_size for p in (node.root / "cache").rglob("*") if p.is_file())
        assert on_disk <= 8 << 20
        node.cli("down", "s1")
    finally:
        assert node.cleanup() == []


def test_prefetch_full_fetches_everything_before_up_returns(node):
    up(node, "s1", "e@1", "--prefetch", "full")
    stats = node.request("stats")
    for layer in stats["layers"].values():
        assert layer["chunks_touched"] == 0  # nothing read yet ...
    total = sum(layer["blob_bytes"] for layer in stats["layers"].values())
    assert stats["cache"]["bytes_fetched"] >= 0.9 * total  # ... yet all of it is here
    node.cli("down", "s1")


@pytest.mark.daemon_log(r"integrity check failed for chunk")
def test_prefetch_full_with_a_corrupt_chunk_fails_and_leaves_nothing_up(node, store):
    """The damaged chunk sits in the middle of a run of neighbours: `up` fails
    with one line naming it and exit 6, no sandbox stays up or mounted; once the pack is
    repaired `up` succeeds without fetching the run's good chunks again."""
    refstore = RefStore(store)
    table = refstore.chunk_table(refstore.layer(refstore.resolve("layers", "base@1")))
    by_pack = sorted(table.entries, key=lambda e: e.location)
    victim = by_pack[len(by_pack) // 2]
    good = bytes(store.get(blob_key(victim.pack)))
    bad = bytearray(good)
    bad[victim.pack_offset + 10] ^= 0x55
    store.put(blob_key(victim.pack), bytes(bad))
    proc = node.cli("up", "e@1", "--id", "f1", "--prefetch", "full", check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 6 and len(lines) == 1, proc.stderr  # integrity, not unreachable
    assert victim.sha256.hex()[:16] in lines[0] and "integrity check failed" in lines[0]
    assert node.request("ps")["sandboxes"] == []
    assert not [m for m in mounts_under(node.root) if "/sandboxes/" in m]
    fetched = node.request("stats")["cache"]["bytes_fetched"]
    store.put(blob_key(victim.pack), good)
    up(node, "f2", "e@1", "--prefetch", "full")
    again = node.request("stats")["cache"]["bytes_fetched"] - fetched
    whole = sum({e.sha256: e.length for e in table.entries}.values())
    assert victim.length <= again < whole  # the victim's good neighbours were kept
    node.cli("down", "f2")


def test_200_sandboxes_on_shared_layers(node):
    ids = [f"m{i:03d}" for i in range(200)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda sid: node.request("up", id=sid, env="e@1"), ids))
    points = mounts_under(node.root)
    assert sum("/sandboxes/" in p for p in points) == 200
    assert sum("/layers/" in p for p in points) == 2  # one mount per layer, shared
    rootfs = node.root / "sandboxes" / "m123" / "rootfs"
    assert (rootfs / "lower" / "a").read_text() == "upper a"
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda sid: node.request("down", id=sid), ids))
    assert [p for p in mounts_under(node.root) if not p.endswith("/fuse")] == []
    assert node.request("ps")["sandboxes"] == []


def test_bad_requests_are_one_line_errors(node):
    for args, code, words in [(["up", "nothere@1", "--id", "x"], 5, "no such env"),
                              (["up", "e@1", "--id", "bad id"], 2, "invalid sandbox id"),
                              (["down", "nope"], 5, "no such sandbox")]:
        proc = node.cli(*args, check=False)
        assert proc.returncode == code, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and words in lines[0], proc.stderr
    up(node, "dup")
    taken = node.cli("up", "e@1", "--id", "dup", check=False)
    assert (taken.returncode, taken.stderr) == (9, "layerfs: error: sandbox dup: already exists\n")
    node.cli("down", "dup")


def test_blob_file_is_read_only_and_exact(node, store):
    up(node, "s1")
    refstore = RefStore(store)
    digest = refstore.resolve("layers", "base@1")
    table = refstore.chunk_table(refstore.layer(digest))
    blob = node.root / "fuse" / "blobs" / digest.removeprefix("sha256:")
    assert stat.S_ISREG(blob.stat().st_mode) and blob.stat().st_size == table.blob_size
    with pytest.raises(OSError) as err:
        os.open(blob, os.O_RDWR)
    assert err.value.errno == errno.EROFS
    from layerfs.chunks import fetch_chunk
    entry = table.entries[len(table.entries) // 2]
    with open(blob, "rb") as f:
        f.seek(entry.blob_offset)
        assert f.read(entry.length) == fetch_chunk(store, entry)
    node.cli("down", "s1")


def test_readahead_windows_and_direct_blob_reads(node):
    """The kernel's answer to FUSE_INIT would cap readahead at 128 KiB; the
    daemon widens it (default 4 MiB) so blob reads arrive as 1 MiB requests,
    and lets 64 of them be in flight.
    Layer mounts read their blob with O_DIRECT and a 1 MiB window of their own."""
    before = {b for b in os.listdir("/sys/class/bdi") if b.startswith("erofs-")}
    up(node, "s1")
    with open("/proc/self/mountinfo") as f:
        lines = [line.split() for line in f]
    fuse = str(node.root / "fuse")
    dev = next(fields[2] for fields in lines if fields[4] == fuse)
    assert Path(f"/sys/class/bdi/{dev}/read_ahead_kb").read_text().strip() == "4096"
    # and 64 background requests in flight, not the kernel's 12 (fusectl names it by dev_t)
    major, minor = (int(n) for n in dev.split(":"))
    conn = Path(f"/sys/fs/fuse/connections/{major << 20 | minor}")
    assert (conn / "max_background").read_text().strip() == "64"
    layers = [fields for fields in lines if fields[4].startswith(str(node.root / "layers"))]
    assert len(layers) == 2 and all("directio" in fields[-1].split(",") for fields in layers)
    new = {b for b in os.listdir("/sys/class/bdi") if b.startswith("erofs-")} - before
    # other processes on the machine may mount EROFS meanwhile: this node's two
    # layer mounts are among the new entries, each with the 1 MiB window
    windows = [Path(f"/sys/class/bdi/{b}/read_ahead_kb").read_text().strip() for b in new]
    assert len(new) >= 2 and windows.count("1024") >= 2, windows
    node.cli("down", "s1")


def test_trace_recorded_pushed_and_replayed_on_another_node(node, tmp_path):
    rootfs = up(node, "s1")
    (rootfs / "data" / "file2").read_bytes()
    (rootfs / "data" / "file0").read_bytes()
    node.cli("down", "s1")  # unmounting the layers keeps their traces in the replica
    out = node.cli("trace", "push", "base@1").stdout
    assert "trace of" in out
    other = NodeDaemon(tmp_path / "node2", node.location.cli_args()).start()
    try:
        up(other, "t1", "e@1", "--prefetch", "trace")
        stats = settle(other)
        assert stats["bytes_fetched"] >= 2 * 5 * CHUNK  # both files, without reading them
        touched = other.request("stats")["layers"]
        assert all(layer["chunks_touched"] == 0 for layer in touched.values())
        other.cli("down", "t1")
    finally:
        assert other.cleanup() == []
    proc = node.cli("trace", "push", "up@1", check=False)
    assert (proc.returncode, proc.stderr) == (5, "layerfs: error: no such access trace: up@1 "
                                              "(none recorded on this node)\n")


def test_the_node_forgets_a_layer_no_sandbox_used_for_forget_after(tmp_path, store,
                                                                   store_location):
    publish_base_env(tmp_path, store)
    (tmp_path / "other").mkdir()
    want = os.urandom(6 * CHUNK)
    (tmp_path / "other" / "data").write_bytes(want)
    other = build(store, str(tmp_path / "other"), name="other", chunk_size=CHUNK).digest
    create_env(RefStore(store), "o", "1", ["other@1"])
    node = NodeDaemon(tmp_path / "node", store_location.cli_args(), cache_size="64M")
    node.extra_args = ["--forget-after", "1s"]
    node.start()
    try:
        kept = up(node, "s1")
        assert (kept / "data" / "file0").read_bytes()
        assert (up(node, "s2", "o@1") / "data").read_bytes() == want
        node.cli("down", "s2")
        meta = node.root / "meta" / (other.removeprefix("sha256:") + ".erofs")
        entries = node.request("stats")["cache"]["entries"]
        # the log line comes after the meta image and the chunks are gone
        deadline = time.monotonic() + 15
        while f"forgot layer {other}" not in node.log() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert f"forgot layer {other}" in node.log()
        assert not meta.exists(), node.log()
        # its six chunks left the cache; the layers s1 uses stay, however long ago it came up
        assert node.request("stats")["cache"]["entries"] <= entries - 6
        used = node.request("ps")["sandboxes"][0]["layers"]
        assert len(used) == 2 and all(
            (node.root / "meta" / (d.removeprefix("sha256:") + ".erofs")).exists() for d in used)
        assert (kept / "data" / "file0").read_bytes()
        assert (up(node, "s3", "o@1") / "data").read_bytes() == want  # fetched again
        node.cli("down", "s3")
        node.cli("down", "s1")
    finally:
        assert node.cleanup() == []
