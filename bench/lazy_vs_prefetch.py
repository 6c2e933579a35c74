"""Lazy pulls against prefetching, at node scale (issue #5), scaled down to one node.

Reference: 8,192 containers on 10 nodes, each reading 4-13 % of a 4-12 GB
image: on-demand EROFS ~35 min, the same as a fully cached run; an eager full
pull >60 min (1.7x) and ~1,600 GB written per node instead of ~700 GB.

Here: the corpus of bench/corpus.py (bases, toolchains, workspaces; one env
per workspace; tasks reading 4-13 % of their env) in a SeaweedFS S3 store on
127.0.0.1, behind a link of ``--rate-mbit`` and ``--latency-ms`` (one way,
each direction). One real ``layerfs daemon`` runs ``--sandboxes`` tasks, up
to ``--concurrency`` at once: ``up`` the task's env, read its start set
through ROOT/sandboxes/ID/rootfs (ready), then its task reads in four steps
with the task's think time and writes between them (done), ``down``. Modes:

* ``eager``: ``prefetch: full`` (every chunk of the env before ``up`` returns),
  fresh daemon ROOT (empty cache and replica);
* ``cached``: the same ROOT after the eager pass (every chunk cached), daemon
  restarted, ``prefetch: none`` - the floor;
* ``lazy``: ``prefetch: none`` on a fresh ROOT; it is also the recording pass:
  afterwards ``trace-push`` stores every layer's first-touch order;
* ``lazy+trace``: ``prefetch: trace`` on a fresh ROOT (traces from the store).

The daemon ROOT lives on its own ext4 file system on a loop device (direct
I/O to a sparse file under the work dir), so /proc/diskstats of that device
counts exactly what the node wrote (``--node-disk dir`` uses the work dir's
device instead). The page cache is dropped before each mode.

Link throttling (``--throttle auto|tc|proxy|none``): ``tc`` puts an HTB
qdisc on ``lo`` with u32 filters on the S3 port (both directions) and, if the
kernel has sch_netem, a netem delay under each class; ``proxy`` is a token
bucket TCP proxy on 127.0.0.1 in a child process (each direction: a FIFO link
of the given rate, chunks delivered after their transmission time plus the
delay). ``auto`` takes tc when both sch_htb and sch_netem exist (rate and
delay in the kernel), else the proxy. The choice and its reason go into the JSON.

Shapes (``--shape``): ``today`` (1 Gbit/s; the cached run takes ~0.77x the
eager one, so lazy / eager <= 0.6 is out of reach there) and ``reference``
(300 Mbit/s, the same corpus and tasks: the eager run's pulls, 12 envs at once
over the link, take the eager run to >= 1.7x the cached one, as the
reference's 60+ min against 35 min), reported against the reference's targets:
lazy <= 1.05x cached, lazy+trace <= lazy, bytes fetched <= 1.05x the distinct
file chunks the tasks read, disk writes lazy <= 0.45x eager.

``--quick`` (4 sandboxes at once, think time x0.25): a smoke run; with
``--shape reference`` it still takes ~3 minutes here, the eager pass pulling
the 4 envs' 2.5 GB through the 300 Mbit/s link.

    python -m bench.lazy_vs_prefetch [--shape today|reference] [--quick]
        [--sandboxes 96] [--concurrency 8]
        [--rate-mbit 1000] [--latency-ms 1] [--modes eager,cached,lazy,lazy+trace]
        [--tasks bench/work/corpus/tasks.json] [--store URL --s3-endpoint URL]
        [--miss-span SIZE] (the daemons' --miss-span)

Needs root. Prints a table and writes bench/results/lazy_vs_prefetch.json and
bench/results/lazy_vs_prefetch.png.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import multiprocessing as mp
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench import RESULTS, WORK, corpus, git_head
from bench.daemons import DaemonRuns, clear_dir, drop_caches, print_footer
from harness.daemonproc import DaemonProcess, detach_mounts
from layerfs.node.daemon.service import mounts_under
from layerfs.sizes import du
from layerfs.store import open_store

MiB = 1 << 20
MODES = ("eager", "cached", "lazy", "lazy+trace")
PREFETCH = {"eager": "full", "cached": "none", "lazy": "none", "lazy+trace": "trace"}
STEPS = 4  # task reads, think time and writes come in this many steps
Target = tuple[str, str, str, float]  # numerator mode, denominator mode, measure, bound
TARGETS: dict[str, Target] = {
    "makespan lazy / eager": ("lazy", "eager", "makespan_s", 0.6),
    "makespan lazy / cached": ("lazy", "cached", "makespan_s", 1.15),
    "makespan lazy+trace / lazy": ("lazy+trace", "lazy", "makespan_s", 1.0),
    "disk writes lazy / eager": ("lazy", "eager", "disk_written_bytes", 0.45),
    "bytes fetched lazy / eager": ("lazy", "eager", "bytes_fetched", 0.2),
}
# The reference's shape (issue 15): the eager run >= 1.7x the cached one, as
# its 60+ min against 35 min; "floor" is the distinct file chunks the tasks read.
REFERENCE_TARGETS: dict[str, Target] = {
    "makespan lazy / cached": ("lazy", "cached", "makespan_s", 1.05),
    "makespan lazy+trace / lazy": ("lazy+trace", "lazy", "makespan_s", 1.0),
    "bytes fetched lazy / floor": ("lazy", "floor", "bytes_fetched", 1.05),
    "disk writes lazy / eager": ("lazy", "eager", "disk_written_bytes", 0.45),
}
SHAPE_CHECK = ("makespan eager / cached", "eager", "cached", 1.7)  # at least
# per shape: the defaults of --rate-mbit, --think-scale, --sandboxes, --concurrency
SHAPES = {"today": {"rate_mbit": 1000.0, "think_scale": 1.0, "sandboxes": 48,
                    "concurrency": 12},
          "reference": {"rate_mbit": 300.0, "think_scale": 1.0, "sandboxes": 48,
                        "concurrency": 12}}
QUICK = {"sandboxes": 4, "concurrency": 4, "think_scale": 0.25}


# -- the link: a throttling proxy or tc -----------------------------------------------

class Link:
    """One direction of the link: FIFO at ``rate`` bytes/s, then ``delay`` seconds."""

    def __init__(self, rate: float, delay: float) -> None:
        self.rate = rate
        self.delay = delay
        self.free_at = 0.0

    def deliver_at(self, nbytes: int, now: float) -> float:
        if self.rate <= 0:
            return now + self.delay
        start = max(now, self.free_at)
        self.free_at = start + nbytes / self.rate
        return self.free_at + self.delay


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: Link,
                counters: Any, index: int) -> None:
    """Copy one direction through ``link``: each block is scheduled when read (at most
    8 blocks in flight per connection, so TCP back-pressure reaches the sender)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
    room = asyncio.Semaphore(8)

    async def receive() -> None:
        try:
            while True:
                await room.acquire()
                data = await reader.read(64 * 1024)
                if not data:
                    break
                queue.put_nowait((link.deliver_at(len(data), loop.time()), data))
        finally:
            queue.put_nowait((0.0, b""))

    async def send() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                break
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            counters[index] += len(data)
            room.release()
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()

    tasks = [asyncio.ensure_future(receive()), asyncio.ensure_future(send())]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()


async def _proxy(port_out: Any, target: int, rate: float, delay: float, counters: Any) -> None:
    down, up = Link(rate, delay), Link(rate, delay)

    async def handle(creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        try:
            sreader, swriter = await asyncio.open_connection("127.0.0.1", target)
        except OSError:
            cwriter.close()
            return
        counters[2] += 1
        pumps = [asyncio.ensure_future(_pump(creader, swriter, up, counters, 1)),
                 asyncio.ensure_future(_pump(sreader, cwriter, down, counters, 0))]
        try:
            done, pending = await asyncio.wait(pumps, return_when=asyncio.FIRST_EXCEPTION)
            for p in pending:
                if any(d.exception() for d in done):
                    p.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
        finally:
            swriter.close()
            cwriter.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=256)
    port_out.value = server.sockets[0].getsockname()[1]
    async with server:
        await server.serve_forever()


def proxy_main(port_out: Any, target: int, rate: float, delay: float, counters: Any) -> None:
    """The proxy process: 127.0.0.1 only; counters: bytes to client, to server, connections."""
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    asyncio.run(_proxy(port_out, target, rate, delay, counters))


def kernel_has(option: str, module: str) -> bool | None:
    """Whether the kernel was built with CONFIG_<option> (=y or =m with the module
    present); None when neither /proc/config.gz nor the modules directory says."""
    try:
        with gzip.open("/proc/config.gz", "rt") as f:
            config = f.read()
    except OSError:
        config = None
    if config is not None:
        if f"CONFIG_{option}=y" in config:
            return True
        if f"CONFIG_{option}=m" not in config:
            return False
    if Path(f"/sys/module/{module}").exists():
        return True
    mods = Path("/lib/modules") / platform.release()
    if mods.exists():
        return any(mods.rglob(f"{module}.ko*"))
    return None


class Throttle:
    """The node's link to the store: a tc qdisc on lo, a proxy, or nothing."""

    def __init__(self, kind: str, rate_mbit: float, latency_ms: float) -> None:
        self.requested = kind
        self.rate = rate_mbit * 1e6 / 8  # bytes/s
        self.rate_mbit = rate_mbit
        self.delay = latency_ms / 1000
        self.kind = "none"
        self.reason = ""
        self.proc: Any = None
        self.counters: Any = None
        self.tc_added = False
        self.netem = False

    def choose(self, has_tcp_port: bool) -> str:
        htb = kernel_has("NET_SCH_HTB", "sch_htb")
        netem = kernel_has("NET_SCH_NETEM", "sch_netem")
        u32 = kernel_has("NET_CLS_U32", "cls_u32")
        self.netem = bool(netem)
        found = f"sch_htb {htb}, sch_netem {netem}, cls_u32 {u32}"
        if not has_tcp_port:
            self.reason = "the store is not reached over TCP (file://): nothing to throttle"
            return "none"
        if self.requested == "none":
            self.reason = "--throttle none"
            return "none"
        if self.requested == "tc":
            self.reason = f"--throttle tc ({found})" + (
                "" if netem else "; no sch_netem: rate only, no added latency")
            return "tc"
        if self.requested == "proxy":
            self.reason = f"--throttle proxy ({found})"
            return "proxy"
        if htb and netem and u32 and shutil.which("tc"):
            self.reason = f"auto: tc can do rate and delay in the kernel ({found})"
            return "tc"
        self.reason = (f"auto: {found} on kernel {platform.release()}; "
                       + ("tc is missing" if not shutil.which("tc") else
                          "without netem, tc can limit the rate (HTB) but not add latency")
                       + ", so a token-bucket TCP proxy on 127.0.0.1 does both")
        return "proxy"

    def start(self, host: str, port: int | None) -> tuple[str, int | None]:
        """Start throttling traffic to ``host:port``; the (host, port) to use instead."""
        self.kind = self.choose(port is not None)
        if self.kind == "proxy":
            assert port is not None
            ctx = mp.get_context("spawn")
            self.counters = ctx.RawArray("q", 3)
            port_out = ctx.RawValue("i", 0)
            self.proc = ctx.Process(target=proxy_main, daemon=True,
                                    args=(port_out, port, self.rate, self.delay, self.counters))
            self.proc.start()
            deadline = time.monotonic() + 30
            while port_out.value == 0:
                if not self.proc.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError("the throttling proxy did not start")
                time.sleep(0.02)
            return "127.0.0.1", port_out.value
        if self.kind == "tc":
            assert port is not None
            self._tc_start(port)
        return host, port

    def _tc(self, *args: str) -> None:
        subprocess.run(["tc", *args], check=True, capture_output=True, text=True)

    def _tc_start(self, port: int) -> None:
        show = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True,
                              text=True).stdout
        if "qdisc noqueue" not in show and show.strip():
            raise RuntimeError(f"lo already has a qdisc, not touching it: {show.strip()}")
        rate = f"{int(self.rate_mbit)}mbit"
        self._tc("qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb")  # no default:
        self.tc_added = True  # unclassified traffic (all other loopback traffic) passes
        for cls, match in (("1:1", "sport"), ("1:2", "dport")):
            self._tc("class", "add", "dev", "lo", "parent", "1:", "classid", cls, "htb",
                     "rate", rate, "ceil", rate)
            if self.netem and self.delay > 0:
                self._tc("qdisc", "add", "dev", "lo", "parent", cls, "netem", "delay",
                         f"{self.delay * 1000:g}ms", "limit", "100000")
            self._tc("filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio", "1",
                     "u32", "match", "ip", match, str(port), "0xffff", "flowid", cls)

    def bytes_through(self) -> dict[str, int] | None:
        if self.kind == "proxy" and self.counters is not None:
            return {"to_node": int(self.counters[0]), "to_store": int(self.counters[1]),
                    "connections": int(self.counters[2])}
        if self.kind == "tc":
            out = subprocess.run(["tc", "-s", "class", "show", "dev", "lo"], capture_output=True,
                                 text=True).stdout
            sent: dict[str, int] = {}
            cls = None
            for line in out.splitlines():
                parts = line.split()
                if parts[:2] == ["class", "htb"]:
                    cls = parts[2]
                elif parts[:1] == ["Sent"] and cls:
                    sent[cls] = int(parts[1])
            return {"to_node": sent.get("1:1", 0), "to_store": sent.get("1:2", 0)}
        return None

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.is_alive() and self.proc.pid:
                os.kill(self.proc.pid, signal.SIGTERM)
            self.proc.join(10)
            if self.proc.is_alive() and self.proc.pid:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.join(10)
            self.proc = None
        if self.tc_added:
            subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], check=False,
                           capture_output=True)
            self.tc_added = False

    def label(self) -> str:
        if self.kind == "none":
            return "unthrottled"
        delay = self.kind == "proxy" or self.netem
        return (f"{self.rate_mbit:g} Mbit/s, " + (f"+{self.delay * 1000:g} ms each way"
                                                 if delay else "no added latency")
                + f" ({self.kind})")

    def describe(self) -> dict:
        return {"mechanism": self.kind, "requested": self.requested, "reason": self.reason,
                "rate_mbit": self.rate_mbit, "one_way_latency_ms": self.delay * 1000,
                "netem": self.netem}


# -- the node's disk -----------------------------------------------------------------

class NodeDisk:
    """The daemon ROOT's file system: ext4 on a loop device over a sparse file (direct
    I/O), so its diskstats are the node's writes alone; or the work dir's device."""

    def __init__(self, work: Path, kind: str, size_gb: int) -> None:
        self.work = work
        self.kind = kind
        self.size_gb = size_gb
        self.mnt = work / "node"
        self.image = work / "node.img"
        self.loop: str | None = None
        self.device = ""

    def setup(self) -> None:
        if self.kind == "loop":
            detach_mounts(self.mnt)
            for line in subprocess.run(["losetup", "-j", str(self.image)], capture_output=True,
                                       text=True).stdout.splitlines():
                subprocess.run(["losetup", "-d", line.split(":")[0]], check=False)
            self.image.unlink(missing_ok=True)
            subprocess.run(["truncate", "-s", f"{self.size_gb}G", str(self.image)], check=True)
            self.loop = subprocess.run(["losetup", "--find", "--show", "--direct-io=on",
                                        str(self.image)], check=True, capture_output=True,
                                       text=True).stdout.strip()
            subprocess.run(["mkfs.ext4", "-q", "-F", "-i", "65536", "-E",
                            "lazy_itable_init=0,lazy_journal_init=0", self.loop], check=True)
            self.mnt.mkdir(parents=True, exist_ok=True)
            subprocess.run(["mount", self.loop, str(self.mnt)], check=True)
            self.device = Path(self.loop).name
        else:
            self.mnt.mkdir(parents=True, exist_ok=True)
            self.device = device_of(self.mnt)

    def sectors_written(self) -> int:
        with open("/proc/diskstats") as f:
            for line in f:
                parts = line.split()
                if parts[2] == self.device:
                    return int(parts[9])
        raise RuntimeError(f"{self.device} not in /proc/diskstats")

    def teardown(self) -> None:
        if self.kind == "loop":
            if self.mnt.exists() and mounts_under(self.mnt):
                detach_mounts(self.mnt)
            if self.loop:
                subprocess.run(["losetup", "-d", self.loop], check=False)
                self.loop = None
            self.image.unlink(missing_ok=True)


def device_of(path: Path) -> str:
    """The block device name (as in /proc/diskstats) holding ``path``; a partition's
    own name."""
    st = os.stat(path)
    sys_dev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    return sys_dev.resolve().name


# -- the daemon ------------------------------------------------------------------------

def pct(values: list[float], q: float) -> float:
    """The q-quantile (nearest rank) of ``values``."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


# -- one sandbox --------------------------------------------------------------------------

WRITE_BLOCK = os.urandom(MiB)


def read_item(rootfs: Path, item: list, buf: bytearray) -> tuple[int, int]:
    """Read ``[path, offset, length]`` (length -1: to the end) as a process would;
    (bytes, errors)."""
    path, off, length = item
    view = memoryview(buf)
    total = 0
    try:
        with open(rootfs / path, "rb", buffering=0) as f:
            f.seek(off)
            while length < 0 or total < length:
                want = len(buf) if length < 0 else min(len(buf), length - total)
                n = f.readinto(view[:want])
                if not n:
                    break
                total += n
    except OSError:
        return total, 1
    return total, 0


def write_output(path: Path, nbytes: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            n = min(left, len(WRITE_BLOCK))
            f.write(WRITE_BLOCK[:n])
            left -= n


def run_sandbox(node: DaemonProcess, task: dict, start: list[list], prefetch: str,
                think_scale: float, t_run: float) -> dict:
    sid = task["id"]
    buf = bytearray(MiB)
    rec: dict[str, Any] = {"id": sid, "env": task["env"]}
    t0 = time.perf_counter()
    rec["start_at_s"] = round(t0 - t_run, 4)
    try:
        rootfs = Path(node.request("up", id=sid, env=task["env"], prefetch=prefetch)
                      ["sandbox"]["rootfs"])
    except Exception as exc:  # recorded; the run goes on
        rec["error"] = f"up: {exc}"
        rec["end_at_s"] = round(time.perf_counter() - t_run, 4)
        with contextlib.suppress(Exception):  # an up that failed in its prefetch stays up
            node.request("down", id=sid)
        return rec
    t_up = time.perf_counter()
    nbytes = errors = 0
    try:
        for item in start:
            n, e = read_item(rootfs, item, buf)
            nbytes, errors = nbytes + n, errors + e
        t_ready = time.perf_counter()
        reads = task["reads"]
        for step in range(STEPS):
            for item in reads[step * len(reads) // STEPS:(step + 1) * len(reads) // STEPS]:
                n, e = read_item(rootfs, item, buf)
                nbytes, errors = nbytes + n, errors + e
            time.sleep(task["think_s"] * think_scale / STEPS)
            write_output(rootfs / "workspace" / "build" / f"out{step}.bin",
                         task["write_bytes"] // STEPS)
        t_done = time.perf_counter()
        rec["upper_bytes"] = du(node.root / "sandboxes" / sid / "upper")
    finally:
        try:
            node.request("down", id=sid)
        except Exception as exc:
            rec["error"] = f"down: {exc}"
    t_down = time.perf_counter()
    rec.update({"up_s": round(t_up - t0, 4), "ready_s": round(t_ready - t0, 4),
                "done_s": round(t_done - t0, 4), "down_s": round(t_down - t_done, 4),
                "end_at_s": round(t_down - t_run, 4), "bytes_read": nbytes,
                "read_errors": errors})
    return rec


# -- the benchmark ---------------------------------------------------------------------------

class Bench:
    def __init__(self, args: argparse.Namespace, work: Path, doc: dict, store_args: list[str],
                 throttle: Throttle, disk: NodeDisk) -> None:
        self.args = args
        self.work = work
        self.doc = doc
        self.store_args = store_args
        self.throttle = throttle
        self.disk = disk
        self.tasks = doc["tasks"][: args.sandboxes]
        self.oddities: list[str] = []
        self.daemons = DaemonRuns(work, self.oddities, args.cache_size, args.read_timeout,
                                  daemon_args=DaemonRuns.options(args))

    def root(self, name: str) -> Path:
        return self.disk.mnt / name

    def fresh_root(self, name: str) -> Path:
        return clear_dir(self.root(name), self.oddities)

    def node(self, root: Path, tag: str) -> DaemonProcess:
        return self.daemons.start(root, tag, self.store_args)

    def stop(self, node: DaemonProcess) -> None:
        self.daemons.finish(node)

    def start_set(self, task: dict) -> list[list]:
        return [i for name in task["start_layers"] for i in self.doc["layers"][name]["hot"]]

    def run_pass(self, node: DaemonProcess, prefetch: str,
                 think_scale: float) -> tuple[list[dict], float]:
        """Every task once, ``--concurrency`` at a time; (records, makespan). Past
        ``--pass-timeout`` the daemon is killed (a hung FUSE loop would leave the
        readers in D state for ever) and the pass fails."""
        t_run = time.perf_counter()
        pool = ThreadPoolExecutor(self.args.concurrency)
        try:
            futures = [pool.submit(run_sandbox, node, t, self.start_set(t), prefetch,
                                   think_scale, t_run) for t in self.tasks]
            done, pending = wait(futures, timeout=self.args.pass_timeout)
            if pending:
                assert node.proc is not None
                self.oddities.append(f"pass still running after {self.args.pass_timeout} s "
                                     f"({len(pending)} sandboxes left): daemon killed; see "
                                     f"{node.log_path}")
                node.proc.kill()
                raise RuntimeError(f"pass timed out; daemon log {node.log_path}")
            recs = [f.result() for f in futures]
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return recs, time.perf_counter() - t_run

    def measure(self, mode: str, root: Path) -> dict:
        """One measured pass of ``mode`` with a new daemon on ``root``."""
        print(f"{mode}: {len(self.tasks)} sandboxes, {self.args.concurrency} at once "
              f"(prefetch {PREFETCH[mode]})", flush=True)
        drop_caches()
        load0 = os.getloadavg()[0]
        node = self.node(root, mode)
        try:
            sectors0 = self.disk.sectors_written()
            link0 = self.throttle.bytes_through()
            recs, makespan = self.run_pass(node, PREFETCH[mode], self.args.think_scale)
            stats = node.request("stats")
            status = node.proc_status()
            os.sync()
            written = (self.disk.sectors_written() - sectors0) * 512
            link1 = self.throttle.bytes_through()
            if mode == "lazy" and "lazy+trace" in self.args.modes:
                self.push_traces(node)
        finally:
            self.stop(node)
        errors = [r for r in recs if "error" in r]
        ok = [r for r in recs if "error" not in r]
        for r in errors[:5]:
            self.oddities.append(f"{mode} {r['id']}: {r['error']}")
        read_errors = sum(r.get("read_errors", 0) for r in ok)
        if read_errors:
            self.oddities.append(f"{mode}: {read_errors} file reads failed (EIO)")
        link = None
        if link0 is not None and link1 is not None:
            link = {k: link1[k] - link0[k] for k in link1}
        res = {
            "prefetch": PREFETCH[mode], "sandboxes": len(recs), "failed": len(errors),
            "makespan_s": round(makespan, 3),
            "up_p50_s": round(pct([r["up_s"] for r in ok], 0.5), 4),
            "up_p99_s": round(pct([r["up_s"] for r in ok], 0.99), 4),
            "ready_p50_s": round(pct([r["ready_s"] for r in ok], 0.5), 4),
            "ready_p99_s": round(pct([r["ready_s"] for r in ok], 0.99), 4),
            "done_p50_s": round(pct([r["done_s"] for r in ok], 0.5), 4),
            "done_p99_s": round(pct([r["done_s"] for r in ok], 0.99), 4),
            "bytes_read": sum(r["bytes_read"] for r in ok), "read_errors": read_errors,
            "bytes_fetched": stats["cache"]["bytes_fetched"], "link_bytes": link,
            "disk_written_bytes": written,
            "cache_bytes": du(root / "cache"), "meta_bytes": du(root / "meta"),
            "replica_bytes": du(root / "replica.lmdb"),
            "upper_bytes": sum(r.get("upper_bytes", 0) for r in ok),
            "daemon": status, "cache": stats["cache"],
            "load_avg_before": round(load0, 2), "load_avg_after": round(os.getloadavg()[0], 2),
            "sandbox_records": recs,
        }
        print(f"  makespan {makespan:6.1f} s, ready p50 {res['ready_p50_s']:.2f} s "
              f"p99 {res['ready_p99_s']:.2f} s, fetched {res['bytes_fetched'] / 1e6:.0f} MB, "
              f"disk written {written / 1e6:.0f} MB, daemon CPU {status['cpu_s']:.0f} s",
              flush=True)
        return res

    def push_traces(self, node: DaemonProcess) -> None:
        """Store every layer's first-touch order recorded by this pass."""
        refs = sorted({ref for t in self.tasks for ref in self.layer_refs(t["env"])})
        pushed = 0
        for ref in refs:
            try:
                node.request("trace-push", ref=ref)
                pushed += 1
            except Exception as exc:
                self.oddities.append(f"trace push {ref}: {exc}")
        print(f"  pushed the traces of {pushed}/{len(refs)} layers", flush=True)
        self.traces_pushed = pushed

    def layer_refs(self, env_ref: str) -> list[str]:
        env = next(e for e in self.doc["envs"] if e["ref"] == env_ref)
        return [self.doc["layers"][name]["ref"] for name in env["layers"]]

    def unmeasured_pass(self, root: Path, tag: str, push: bool) -> None:
        print(f"{tag}: unmeasured pass (prefetch none)", flush=True)
        node = self.node(root, tag)
        try:
            self.run_pass(node, "none", 0.0)
            if push:
                self.push_traces(node)
        finally:
            self.stop(node)

    def run(self) -> dict[str, dict]:
        modes = self.args.modes
        out: dict[str, dict] = {}
        if "eager" in modes:
            out["eager"] = self.measure("eager", self.fresh_root("eager"))
        if "cached" in modes:
            if "eager" in modes:
                root = self.root("eager")
            else:
                root = self.fresh_root("warm")
                self.unmeasured_pass(root, "warm-up", push=False)
            out["cached"] = self.measure("cached", root)
        self.fresh_root("eager")
        self.fresh_root("warm")
        if "lazy" in modes:
            out["lazy"] = self.measure("lazy", self.fresh_root("lazy"))
            self.fresh_root("lazy")
        elif "lazy+trace" in modes:
            root = self.fresh_root("record")
            self.unmeasured_pass(root, "recording", push=True)
            self.fresh_root("record")
        if "lazy+trace" in modes:
            out["lazy+trace"] = self.measure("lazy+trace", self.fresh_root("trace"))
            self.fresh_root("trace")
        return out



# -- report --------------------------------------------------------------------------------

def ratios(results: dict[str, dict], shape: str, floor: int) -> list[dict]:
    """The target rows of ``shape``; the pseudo-mode ``floor`` is the distinct-chunk
    floor of bytes fetched. In the reference shape, its own condition comes first."""
    values = {**results, "floor": {"bytes_fetched": floor}}
    rows = []
    if shape == "reference":
        name, num, den, least = SHAPE_CHECK
        if num in results and den in results:
            value = results[num]["makespan_s"] / results[den]["makespan_s"]
            rows.append({"ratio": name + " (the shape)", "measured": round(value, 3),
                         "target": f">= {least}", "met": value >= least})
    for name, (num, den, measure, bound) in (REFERENCE_TARGETS if shape == "reference"
                                             else TARGETS).items():
        if num in values and den in values and values[den][measure]:
            value = values[num][measure] / values[den][measure]
            rows.append({"ratio": name, "measured": round(value, 3), "target": f"<= {bound}",
                         "met": value <= bound})
    return rows


def chart(results: dict[str, dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in MODES if m in results]
    colors = {"eager": "#d62728", "cached": "#7f7f7f", "lazy": "#1f77b4",
              "lazy+trace": "#2ca02c"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    ax = axes[0]
    bars = ax.bar(modes, [results[m]["makespan_s"] for m in modes],
                  color=[colors[m] for m in modes])
    ax.bar_label(bars, fmt="%.0f s", fontsize=8)
    ax.set_ylabel("seconds")
    ax.set_title("makespan")
    ax = axes[1]
    x = range(len(modes))
    bars = ax.bar([i - 0.2 for i in x],
                  [results[m]["disk_written_bytes"] / 1e9 for m in modes], width=0.4,
                  color=[colors[m] for m in modes], label="written to local disk")
    ax.bar_label(bars, fmt="%.2f", fontsize=8)
    bars = ax.bar([i + 0.2 for i in x], [results[m]["bytes_fetched"] / 1e9 for m in modes],
                  width=0.4, color=[colors[m] for m in modes], alpha=0.45, hatch="//",
                  label="fetched from store")
    ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(list(x), modes)
    ax.set_ylabel("GB")
    ax.set_title("bytes written to the node's disk / fetched")
    ax.legend(fontsize=8)
    ax = axes[2]
    for m in modes:
        ready = sorted(r["ready_s"] for r in results[m]["sandbox_records"] if "ready_s" in r)
        if ready:
            ax.step(ready, [(i + 1) / len(ready) for i in range(len(ready))], where="post",
                    color=colors[m], label=m)
    ax.set_xscale("log")
    ax.set_xlabel("time to ready (s, log)")
    ax.set_ylabel("fraction of sandboxes")
    ax.set_title("time to ready (up + start set read)")
    ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_tables(results: dict[str, dict], rows: list[dict]) -> None:
    head = (f"{'mode':11} {'makespan':>9} {'ready p50':>9} {'p99':>7} {'done p50':>9} "
            f"{'p99':>7} {'fetched':>8} {'link':>8} {'disk wr':>8} {'cache':>8} "
            f"{'upper':>7} {'RSS':>6} {'CPU':>6}")
    print("\n" + head)
    print(f"{'':11} {'s':>9} {'s':>9} {'s':>7} {'s':>9} {'s':>7} {'MB':>8} {'MB':>8} "
          f"{'MB':>8} {'MB':>8} {'MB':>7} {'MB':>6} {'s':>6}")
    for m in MODES:
        if m not in results:
            continue
        r = results[m]
        link = r["link_bytes"]["to_node"] / 1e6 if r["link_bytes"] else float("nan")
        print(f"{m:11} {r['makespan_s']:9.1f} {r['ready_p50_s']:9.2f} {r['ready_p99_s']:7.2f} "
              f"{r['done_p50_s']:9.2f} {r['done_p99_s']:7.2f} {r['bytes_fetched'] / 1e6:8.0f} "
              f"{link:8.0f} {r['disk_written_bytes'] / 1e6:8.0f} {r['cache_bytes'] / 1e6:8.0f} "
              f"{r['upper_bytes'] / 1e6:7.0f} {r['daemon']['peak_rss_bytes'] / 1e6:6.0f} "
              f"{r['daemon']['cpu_s']:6.0f}")
    print(f"\n{'ratio':30} {'measured':>9}  target")
    for row in rows:
        print(f"{row['ratio']:30} {row['measured']:9.3f}  {row['target']:8} "
              f"{'met' if row['met'] else 'MISSED'}")


# -- main -------------------------------------------------------------------------------------

def link_check(url: str, direct: str | None, linked: str, doc: dict) -> dict:
    """What the link gives boto3: 4-thread GET of whole packs (MB/s) and the latency of
    a 100-byte ranged GET, through the link and (latency) directly."""
    from layerfs.refstore import RefStore
    from layerfs.store.base import blob_key

    out: dict[str, Any] = {}
    store = open_store(url, s3_endpoint=linked)
    try:
        refstore = RefStore(store)
        lay = max(doc["layers"].values(), key=lambda x: x["bytes"])
        packs = refstore.chunk_table(refstore.layer(lay["digest"])).packs()[:8]
        start = time.perf_counter()
        with ThreadPoolExecutor(4) as pool:
            total = sum(pool.map(lambda d: len(store.get(blob_key(d))), packs))
        out["get_4_threads_mb_s"] = round(total / 1e6 / (time.perf_counter() - start), 1)
        for name, ep in (("small_get_ms", linked), ("small_get_direct_ms", direct)):
            st = open_store(url, s3_endpoint=ep) if ep != linked else store
            st.get(blob_key(packs[0]), 0, 100)
            start = time.perf_counter()
            for _ in range(40):
                st.get(blob_key(packs[0]), 0, 100)
            out[name] = round((time.perf_counter() - start) / 40 * 1000, 2)
            if st is not store:
                st.close()
    finally:
        store.close()
    return out



def store_port(endpoint: str | None) -> tuple[str, int | None]:
    if not endpoint:
        return "", None
    parts = urlsplit(endpoint)
    return parts.hostname or "127.0.0.1", parts.port or (443 if parts.scheme == "https" else 80)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=tuple(SHAPES), default="today",
                    help="today: a 1 Gbit/s link (the cached run ~0.77x the eager one); "
                         "reference: a link slow enough for eager >= 1.7x cached, "
                         "reported against the reference's targets")
    ap.add_argument("--quick", action="store_true",
                    help=f"{QUICK['sandboxes']} sandboxes, {QUICK['concurrency']} at once, "
                         f"think time x{QUICK['think_scale']}")
    ap.add_argument("--sandboxes", type=int, default=None, help="tasks run per mode")
    ap.add_argument("--concurrency", type=int, default=None, help="sandboxes at once")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--rate-mbit", type=float, default=None)
    ap.add_argument("--latency-ms", type=float, default=1.0,
                    help="added one-way delay, each direction (netem semantics)")
    ap.add_argument("--throttle", choices=("auto", "tc", "proxy", "none"), default="auto")
    ap.add_argument("--think-scale", type=float, default=None,
                    help="multiplies every task's think time")
    ap.add_argument("--cache-size", default="20G", help="the daemon's --cache-size")
    DaemonRuns.add_arguments(ap)
    ap.add_argument("--read-timeout", type=float, default=30.0,
                    help="the daemon's --read-timeout (default: the daemon's own)")
    ap.add_argument("--pass-timeout", type=float, default=1200.0,
                    help="kill the daemon if one pass takes longer")
    ap.add_argument("--node-disk", choices=("loop", "dir"), default="loop")
    ap.add_argument("--node-disk-gb", type=int, default=0,
                    help="size of the loop file system (default: 2x the corpus + 4)")
    ap.add_argument("--tasks", default=str(WORK / "corpus" / "tasks.json"),
                    help="the task list of bench/corpus.py (made with its defaults if missing)")
    ap.add_argument("--store", default=None, help="override the task list's store URL")
    ap.add_argument("--s3-endpoint", default=None)
    ap.add_argument("--work", default=str(WORK / "lazy"))
    ap.add_argument("--out", default=None, help="default: bench/results/"
                    "lazy_vs_prefetch.json (lazy_vs_prefetch_reference.json for that shape)")
    ap.add_argument("--chart", default=None, help="default: --out with .png")
    args = ap.parse_args()
    defaults = SHAPES[args.shape] | (QUICK if args.quick else {})
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.out is None:
        name = "lazy_vs_prefetch" + ("" if args.shape == "today" else f"_{args.shape}")
        args.out = str(RESULTS / (name + ("_quick" if args.quick else "") + ".json"))
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in args.modes:
        if m not in MODES:
            sys.exit(f"unknown mode {m!r} (expected {', '.join(MODES)})")
    if os.geteuid() != 0:
        sys.exit("bench/lazy_vs_prefetch.py needs root (FUSE, EROFS, overlay, loop, tc)")
    started = time.perf_counter()
    tasks_path = Path(args.tasks)
    if not tasks_path.exists():
        print(f"{tasks_path} missing: making the corpus with bench/corpus.py's defaults",
              flush=True)
        corpus.ensure(corpus.Params(), tasks_path.parent, tasks_path, args.store,
                      args.s3_endpoint)
    doc = json.loads(tasks_path.read_text())
    key = doc.get("key", {})
    if key.get("gen") != corpus.GEN or key.get("task_gen") != corpus.TASK_GEN:
        print(f"{tasks_path} is from an older corpus generator: making it again", flush=True)
        fields = {k: tuple(v) if isinstance(v, list) else v for k, v in key.items()
                  if k in corpus.Params.__dataclass_fields__}
        tasks_path.unlink()
        sw = doc["store"].get("seaweedfs_dir")
        doc = corpus.ensure(corpus.Params(**fields), tasks_path.parent, tasks_path,
                            None if sw else doc["store"]["url"], doc["store"].get("s3_endpoint"),
                            Path(sw) if sw else corpus.SEAWEED_DIR)
    if args.sandboxes > len(doc["tasks"]):
        sys.exit(f"--sandboxes {args.sandboxes}: the task list has {len(doc['tasks'])}")
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    detach_mounts(work)  # an interrupted earlier run
    corpus_bytes = sum(lay["bytes"] for lay in doc["layers"].values())
    disk = NodeDisk(work, args.node_disk,
                    args.node_disk_gb or int(2 * corpus_bytes / (1 << 30)) + 4)
    throttle = Throttle(args.throttle, args.rate_mbit, args.latency_ms)
    url = args.store or doc["store"]["url"]
    endpoint = args.s3_endpoint or doc["store"].get("s3_endpoint")
    managed = args.store is None and doc["store"].get("seaweedfs_dir")
    result: dict[str, Any] = {}
    check: dict[str, Any] = {}
    bench = None
    stack = contextlib.ExitStack()
    try:
        if managed:
            server = stack.enter_context(corpus.seaweedfs(Path(managed)))
            endpoint = server.endpoint
        host, port = store_port(endpoint if url.startswith("s3://") else None)
        host, port = throttle.start(host, port)
        stack.callback(throttle.stop)
        store_args = ["--store", url]
        if url.startswith("s3://") and endpoint:
            scheme = urlsplit(endpoint).scheme or "http"
            store_args += ["--s3-endpoint", f"{scheme}://{host}:{port}"]
        print(f"store {url} at {endpoint}; link: {throttle.kind} ({throttle.reason})",
              flush=True)
        if url.startswith("s3://") and endpoint:
            check = link_check(url, endpoint, store_args[-1], doc)
            print(f"link check: {check}", flush=True)
        disk.setup()
        stack.callback(disk.teardown)
        bench = Bench(args, work, doc, store_args, throttle, disk)
        result = bench.run()
    finally:
        if bench is not None:
            bench.daemons.stop_all()
        stack.close()
        left = detach_mounts(work)
        if left:
            print(f"detached leftover mounts: {left}", file=sys.stderr)
    elapsed = time.perf_counter() - started
    left = mounts_under(work)
    assert bench is not None
    if left:
        bench.oddities.append(f"mounts left under the work dir at the end: {left}")
    rows = ratios(result, args.shape, corpus.union_bytes(doc, args.sandboxes))
    tasks = bench.tasks
    out = {
        "params": {"shape": args.shape, "quick": args.quick,
                   "sandboxes": args.sandboxes, "concurrency": args.concurrency,
                   "modes": args.modes, "think_scale": args.think_scale,
                   "cache_size": args.cache_size, "read_timeout": args.read_timeout,
                   "miss_span": args.miss_span,
                   "node_disk": args.node_disk, "node_disk_device": disk.device,
                   "store": url, "tasks_file": str(tasks_path)},
        "link": throttle.describe() | {"check": check},
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release()},
        "layerfs_commit": git_head(),
        "workload": {
            "corpus": corpus.summary(doc) | {"tasks": len(doc["tasks"])},
            "envs_used": len({t["env"] for t in tasks}),
            "env_bytes_used": sum(e["bytes"] for e in doc["envs"]
                                  if e["ref"] in {t["env"] for t in tasks}),
            "layer_bytes_used": sum(doc["layers"][n]["bytes"] for n in
                                    {n for e in doc["envs"] if e["ref"] in
                                     {t["env"] for t in tasks} for n in e["layers"]}),
            "read_fraction_p50": statistics.median(t["read_fraction"] for t in tasks),
            "read_bytes": sum(t["read_bytes"] for t in tasks),
            "union_read_bytes": corpus.union_bytes(doc, len(tasks)),
            "think_s_total": round(sum(t["think_s"] for t in tasks) * args.think_scale, 1),
            "write_bytes": sum(t["write_bytes"] for t in tasks),
        },
        "modes": result,
        "ratios": rows,
        "daemon_logs": bench.daemons.scan_logs(),
        "oddities": bench.oddities,
        "runtime_s": round(elapsed, 1),
        "notes": [
            f"daemon --read-timeout {args.read_timeout:g} s for every mode (a fetch's time "
            "includes its wait for a slot under the fetch limit)",
        ],
        "method": (
            "One real `layerfs daemon` per mode, driven through the control API; each "
            "sandbox: up (env, prefetch per mode), read its start set (the base's and "
            "toolchain's hot files) through ROOT/sandboxes/ID/rootfs = ready, then its task "
            "reads in 4 steps, each followed by 1/4 of its think time (sleep) and 1/4 of its "
            "output written into the sandbox = done, then down. Reads are plain reads of whole "
            "files or ranges from a worker thread per sandbox. Times to ready and done are "
            "from the sandbox's up request. Makespan: first up to last down. bytes_fetched: "
            "daemon stats cache.bytes_fetched (uncompressed chunk bytes); link_bytes: bytes "
            "through the throttled link. disk_written_bytes: sectors written to the node "
            "disk's device (/proc/diskstats) from daemon start to the end of the pass, after "
            "sync. Page cache dropped before each mode. eager, lazy and lazy+trace start from "
            "an empty ROOT; cached reuses eager's ROOT with a new daemon; lazy+trace replays "
            "the traces pushed after the lazy pass."),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    if result:
        chart_path = Path(args.chart) if args.chart else Path(args.out).with_suffix(".png")
        w = out["workload"]
        chart(result, chart_path,
              f"{len(tasks)} sandboxes ({args.concurrency} at once) over {w['envs_used']} envs "
              f"({w['layer_bytes_used'] / 1e9:.1f} GB of layers), each reading "
              f"4-13 % of its env; link {throttle.label()}")
    w = out["workload"]
    print(f"\nworkload: {len(tasks)} sandboxes over {w['envs_used']} envs, "
          f"{w['layer_bytes_used'] / 1e9:.2f} GB of layers, "
          f"{w['read_bytes'] / 1e9:.2f} GB read in all, {w['union_read_bytes'] / 1e9:.2f} GB "
          f"distinct ({doc['key'].get('chunk_kib', corpus.Params.chunk_kib)} KiB chunks); "
          f"link {throttle.label()}")
    print_tables(result, rows)
    for m in ("lazy", "lazy+trace"):
        if m in result and w["union_read_bytes"]:
            print(f"{m} fetched / distinct chunks read (lower bound): "
                  f"{result[m]['bytes_fetched'] / w['union_read_bytes']:.2f}x")
    print_footer(out["daemon_logs"], bench.oddities, f"{elapsed:.0f} s")


if __name__ == "__main__":
    main()
