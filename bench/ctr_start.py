"""containerd's path against the ``Client`` path: one image started cold on one node.

The image and the workload are bench/image_start.py's (the Debian bookworm
minbase as one gzip OCI layer in a local ``docker-registry``, imported into the
layerfs store beforehand; ``apt-get --version; dpkg -l; perl -e 1; ls -lR
/usr/share/doc; bash --version``). Each rep, alternating which goes first:

* **ctr_layerfs**: a ``layerfs daemon --containerd-snapshotter SOCK
  --containerd-prefetch none`` on an empty ROOT and a containerd (CRI on, the
  daemon as its ``proxy_plugins`` snapshotter) on empty roots; timed: CRI's
  PullImage (what the kubelet asks; the imported layer becomes a lazy
  snapshot) + ``ctr -n k8s.io run --snapshotter layerfs`` of the workload, to
  ``ctr``'s exit.
* **client**: the same daemon (the same options, an empty ROOT), a
  ``layerfs.node.Client`` made and connected beforehand; timed: ``Client.up``
  (``prefetch="none"``) + ``Client.run`` of the same workload (output
  captured), to the run's return.
* **runc_local** (the floor under both): ``runc run`` of the workload with
  the unpacked tree as the bundle's read-only root.
* **ctr_overlay** (containerd's own floor): the same containerd with CRI off
  and its overlayfs snapshotter, the image pulled and unpacked before the
  timed part; timed: ``ctr run`` of the workload alone. What containerd's own
  run path costs (``ctr``, the container and task records, the shim, runc)
  on a local unpacked tree.

With ``--trace`` both layerfs sides replay the trace one lazy run pushed
(``--containerd-prefetch auto``, ``prefetch="auto"``). The page cache is
dropped right before each timed part. The workload prints the wall clock at
its start and end, so each start splits into steps: ``pull`` (CRI), ``to
command`` (``ctr``'s or ``Client.run``'s start to the workload's first line:
the container's create, the snapshot's Prepare and Mounts, the shim, runc
create and start), ``command`` and ``exit`` (the workload's last line to the
caller's return). With ``--daemon-log-level debug`` the snapshotter's calls
(Prepare, Mounts, ...) and their times are read from the daemon's log.

    python -m bench.ctr_start [--reps 5] [--store s3|file] [--trace] [--daemon-log-level debug]

Prints a table and writes bench/results/ctr_start.json (the commit in it);
the ratio is the median of the per-rep ratios ctr_layerfs / client (target
<= 1.2, issue 35). Needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import RESULTS, git_head
from bench.daemons import DaemonRuns, clear_dir, drop_caches, print_footer
from bench.image_start import ENV_REF, SNAPSHOTTER, WORKLOAD, Bench, Containerd, published_image
from harness.containerdserver import cri_pull
from harness.daemonproc import DaemonProcess, detach_mounts

SIDES = ("ctr_layerfs", "client", "ctr_overlay", "runc_local")
TARGET = 1.2  # ctr_layerfs / client, issue 35
# the workload between two stamps of the wall clock (stdout lines "@@ SECONDS")
STAMPED = f"echo @@ $(date +%s.%N); {WORKLOAD}; echo @@ $(date +%s.%N)"
STAMP = re.compile(rb"^@@ (\d+\.\d+)$", re.M)
ANSWERED = re.compile(r"containerd (\w+)\b.*?: answered in ([\d.]+) ms \(asked at ([\d.]+)\)")
# the daemon's info line at the end of a lazy Prepare (its text log's clock: local time)
LAZY = re.compile(r"^(\S+ \S+),(\d{3}) INFO .*containerd snapshot .* lazily, in (\d+) ms$", re.M)


def stamps(output: bytes) -> tuple[float, float]:
    """The workload's start and end (wall clock) from its output."""
    found = [float(m) for m in STAMP.findall(output)]
    if len(found) != 2:
        raise RuntimeError(f"the workload printed {len(found)} stamps, not 2: "
                           f"{output[-500:]!r}")
    return found[0], found[1]


def ctr_run(argv: list[str]) -> tuple[float, bytes]:
    """Run ``ctr run ...`` (stdin closed, output captured); (the wall clock
    at its start, its output). A failure is raised with its stderr."""
    start = time.time()
    done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:6])} failed ({done.returncode}): "
                           f"{done.stderr.decode(errors='replace')[-2000:]}")
    return start, done.stdout


def steps(t0: float, run_start: float, output: bytes, t_end: float) -> dict[str, float]:
    """A start's steps in seconds, from the wall-clock times around it."""
    first, last = stamps(output)
    return {"pull_s": round(run_start - t0, 3), "to_command_s": round(first - run_start, 3),
            "command_s": round(last - first, 3), "exit_s": round(t_end - last, 3),
            "cold_start_s": round(t_end - t0, 3)}


def snapshot_calls(log: Path, since: float) -> list[dict]:
    """The snapshotter's calls the daemon logged from ``since`` on: its lazy
    Prepares (an info line), every call at debug level."""
    if not log.exists():
        return []
    calls = []
    for m in LAZY.finditer(log.read_text(errors="replace")):
        end = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1e3
        took = float(m.group(3))
        calls.append({"call": "lazy_prepare", "at_s": round(end - took / 1e3 - since, 3),
                      "ms": took})
    for m in ANSWERED.finditer(log.read_text(errors="replace")):
        asked = float(m.group(3))
        if asked >= since:
            calls.append({"call": m.group(1), "at_s": round(asked - since, 3),
                          "ms": float(m.group(2))})
    return calls


class CtrStart:
    """The three sides of one run, on the store and image ``Bench`` set up."""

    def __init__(self, bench: Bench, trace: bool, read_ahead: bool = True) -> None:
        self.bench = bench
        self.read_ahead = read_ahead  # the Client side's program read-ahead
        self.work = bench.work
        self.prefetch = "auto" if trace else "none"
        self.sock = self.work / "snapshotter.sock"
        self.ctrd = Containerd(self.work / "ctrd")

    def daemon(self) -> DaemonProcess:
        """The layerfs daemon both layerfs sides use, on an empty ROOT."""
        root = clear_dir(self.work / "roots" / "node", self.bench.oddities)
        return self.bench.daemons.start(root, "node", [
            *self.bench.store_args(), "--containerd-snapshotter", str(self.sock),
            "--containerd-prefetch", self.prefetch])

    def ctr_layerfs(self, rep: int) -> dict:
        node = self.daemon()
        self.ctrd.wipe(self.bench.oddities)
        try:
            self.ctrd.start(self.sock, self.bench.image.split("/", 1)[0])
            drop_caches()
            t0 = time.time()
            cri_pull(self.ctrd.sock, self.bench.image, timeout=600)
            run_start, out = ctr_run(self.ctrd.ctr(
                "-n", "k8s.io", "run", "--snapshotter", SNAPSHOTTER, self.bench.image,
                f"ctr{rep}", "sh", "-c", STAMPED))
            t_end = time.time()
            sample = steps(t0, run_start, out, t_end)
            sample["bytes_fetched"] = node.request("stats")["cache"].get("bytes_fetched", 0)
            subprocess.run(self.ctrd.ctr("-n", "k8s.io", "container", "rm", f"ctr{rep}"),
                           capture_output=True)
        finally:
            self.ctrd.stop()
            self.bench.daemons.finish(node, remove_root=True)
        sample["snapshot_calls"] = snapshot_calls(node.log_path, t0)
        return sample

    def client(self, rep: int) -> dict:
        from layerfs.node.client import Client

        node = self.daemon()
        sid = f"client{rep}"
        try:
            client = Client(node.root, timeout=600, read_ahead=self.read_ahead)
            client.ping()  # a warm client: connected once, its modules loaded
            drop_caches()
            t0 = time.time()
            client.up(sid, ENV_REF, prefetch=self.prefetch)
            run_start = time.time()
            done = client.run(sid, ["sh", "-c", STAMPED], capture=True)
            t_end = time.time()
            if done.exit_code != 0:
                raise RuntimeError(f"the workload in {sid} exited {done.exit_code}: "
                                   f"{(done.stderr or b'').decode(errors='replace')[-2000:]}")
            sample = steps(t0, run_start, done.stdout or b"", t_end)
            sample["up_s"] = sample.pop("pull_s")
            sample["bytes_fetched"] = node.request("stats")["cache"].get("bytes_fetched", 0)
            client.down(sid)
        finally:
            self.bench.daemons.finish(node, remove_root=True)
        return sample

    def ctr_overlay(self, rep: int) -> dict:
        self.ctrd.wipe(self.bench.oddities)
        self.ctrd.start()
        try:
            subprocess.run(self.ctrd.ctr("image", "pull", "--plain-http", self.bench.image),
                           check=True, capture_output=True, timeout=600)
            drop_caches()
            run_start, out = ctr_run(self.ctrd.ctr("run", self.bench.image, f"ovl{rep}",
                                                   "sh", "-c", STAMPED))
            t_end = time.time()
            sample = steps(run_start, run_start, out, t_end)
            del sample["pull_s"]
            subprocess.run(self.ctrd.ctr("container", "rm", f"ovl{rep}"), capture_output=True)
        finally:
            self.ctrd.stop()
        return sample

    def runc_local(self, rep: int) -> dict:
        return {"cold_start_s": round(self.bench.runc_local(rep), 3)}

    def run(self, reps: int) -> dict[str, list[dict]]:
        samples: dict[str, list[dict]] = {s: [] for s in SIDES}
        for rep in range(reps):
            for side in SIDES if rep % 2 == 0 else SIDES[::-1]:
                sample = getattr(self, side)(rep)
                samples[side].append(sample)
                print(f"  rep {rep + 1} {side:12} {sample['cold_start_s']:.3f} s  "
                      + " ".join(f"{k.removesuffix('_s')} {v:.3f}" for k, v in sample.items()
                                 if k.endswith("_s") and k != "cold_start_s"), flush=True)
        return samples


def prepare_s(sample: dict) -> float:
    """Seconds of the snapshotter's lazy Prepares in a ctr_layerfs start."""
    return sum(c["ms"] for c in sample.get("snapshot_calls", [])
               if c["call"] == "lazy_prepare") / 1e3


def summarize(samples: dict[str, list[dict]]) -> dict[str, Any]:
    out: dict[str, Any] = {side: {k: statistics.median(s[k] for s in rows)
                                  for k in rows[0] if k.endswith("_s")}
                           for side, rows in samples.items()}
    per_rep = [round(a["cold_start_s"] / max(1e-9, b["cold_start_s"]), 3)
               for a, b in zip(samples["ctr_layerfs"], samples["client"], strict=True)]
    # containerd's own steps, rep by rep: the CRI pull less the snapshotter's
    # lazy Prepare in it, and ctr run's start and exit over Client.run's; the
    # start without them over the client's (the snapshotter's Prepare against
    # Client.up, and the same workload). ctr_overlay less runc_local: ctr
    # run's own path on a local tree, measured apart.
    own = [round(a["pull_s"] - prepare_s(a) + a["to_command_s"] - b["to_command_s"]
                 + a["exit_s"] - b["exit_s"], 3)
           for a, b in zip(samples["ctr_layerfs"], samples["client"], strict=True)]
    rest = [round((a["cold_start_s"] - o) / max(1e-9, b["cold_start_s"]), 3)
            for a, b, o in zip(samples["ctr_layerfs"], samples["client"], own, strict=True)]
    run_path = [round(a["cold_start_s"] - b["cold_start_s"], 3)
                for a, b in zip(samples["ctr_overlay"], samples["runc_local"], strict=True)]
    out["ratios"] = {
        "cold start ctr_layerfs / client": statistics.median(per_rep),
        "per_rep cold start ctr_layerfs / client": per_rep,
        "containerd's own steps (s)": statistics.median(own),
        "per_rep containerd's own steps (s)": own,
        "cold start ctr_layerfs less containerd's own steps / client": statistics.median(rest),
        "per_rep ctr_layerfs less containerd's own steps / client": rest,
        "ctr run's own path: ctr_overlay - runc_local (s)": statistics.median(run_path),
        "per_rep ctr run's own path (s)": run_path}
    calls: dict[str, list[float]] = {}
    for sample in samples["ctr_layerfs"]:
        for call in sample.get("snapshot_calls", []):
            calls.setdefault(call["call"], []).append(call["ms"])
    out["snapshot_calls_ms"] = {k: {"n_per_rep": len(v) / len(samples["ctr_layerfs"]),
                                    "median": statistics.median(v), "sum_median_rep":
                                    round(sum(v) / len(samples["ctr_layerfs"]), 1)}
                                for k, v in calls.items()}
    return out


def print_table(summary: dict) -> None:
    cols = ("cold_start_s", "pull_s", "up_s", "to_command_s", "command_s", "exit_s")
    print(f"\n{'side':34}" + "".join(f"{c.removesuffix('_s'):>12}" for c in cols))
    labels = {"ctr_layerfs": "CRI pull + ctr run (layerfs)", "client": "Client.up + Client.run",
              "ctr_overlay": "ctr run (overlayfs, pre-pulled)",
              "runc_local": "runc run on the unpacked tree"}
    for side, label in labels.items():
        row = summary[side]
        print(f"{label:34}" + "".join(f"{row[c]:12.3f}" if c in row else f"{'':>12}"
                                      for c in cols))
    ratio = summary["ratios"]["cold start ctr_layerfs / client"]
    print(f"\ncold start ctr_layerfs / client: {ratio:.3f} (per rep "
          f"{summary['ratios']['per_rep cold start ctr_layerfs / client']}; target <= "
          f"{TARGET}: {'met' if ratio <= TARGET else 'missed'})")
    ratios = summary["ratios"]
    for name in ("containerd's own steps (s)",
                 "cold start ctr_layerfs less containerd's own steps / client",
                 "ctr run's own path: ctr_overlay - runc_local (s)"):
        print(f"{name}: {ratios[name]:.3f}")
    for call, row in summary["snapshot_calls_ms"].items():
        print(f"  snapshotter {call}: {row['n_per_rep']:.0f} per start, median "
              f"{row['median']:.1f} ms, {row['sum_median_rep']:.1f} ms per start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5, help="cold reps of each side")
    ap.add_argument("--store", choices=("s3", "file"), default="s3")
    ap.add_argument("--trace", action="store_true",
                    help="both layerfs sides replay a pushed trace (default: lazy)")
    DaemonRuns.add_arguments(ap)
    ap.add_argument("--daemon-log-level", default="info",
                    help="the daemons' --log-level (debug: the snapshotter's calls, timed)")
    ap.add_argument("--work", default="/tmp/layerfs-bench/image-start",
                    help="bench/image_start.py's work dir (the image made once is shared)")
    ap.add_argument("--no-read-ahead", action="store_true",
                    help="the Client side without its program read-ahead (Client(read_ahead="
                         "False)): what only a caller that knows the command can do")
    ap.add_argument("--out", default=str(RESULTS / "ctr_start.json"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/ctr_start.py needs root (containerd, FUSE, EROFS, overlay mounts)")
    work = Path(args.work).resolve()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.perf_counter()
    args.client = None  # Bench's own option (bench/image_start.py)
    try:
        with published_image(work, args.store) as (ref, store_env, image_info, _):
            bench = Bench(args, work, ref, store_env, work / "minbase")
            run = CtrStart(bench, args.trace, read_ahead=not args.no_read_ahead)
            try:
                bench.record_trace()  # the bundle runc_local runs; the trace --trace replays
                samples = run.run(args.reps)
            finally:
                bench.daemons.stop_all()
                run.ctrd.stop()
    finally:
        left = detach_mounts(work / "roots")
        if left:
            print(f"detached leftover mounts: {left}", file=sys.stderr)
    summary = summarize(samples)
    out = {"commit": git_head(),
           "params": {"reps": args.reps, "store": args.store, "trace": args.trace,
                      "client_read_ahead": not args.no_read_ahead,
                      "miss_span": args.miss_span, "workload": WORKLOAD,
                      "daemon_log_level": args.daemon_log_level},
           "machine": {"cpus": os.cpu_count(), "kernel": platform.release(),
                       "loadavg": os.getloadavg()},
           "image": {**image_info, "ref": ref}, "samples": samples, "summary": summary,
           "target": {"cold start ctr_layerfs / client": TARGET},
           "daemon_logs": bench.daemons.scan_logs(), "oddities": bench.oddities,
           "runtime_s": round(time.perf_counter() - started, 1),
           "method": (
               "Per rep, alternating order: ctr_layerfs = CRI PullImage + `ctr -n k8s.io run "
               "--snapshotter layerfs` on fresh containerd and layerfs roots; client = "
               "Client.up + Client.run on a fresh ROOT of the same daemon command; "
               "ctr_overlay = `ctr run` on containerd's overlayfs snapshotter, the image "
               "pulled before. Page cache dropped before each timed part; steps from the "
               "wall clock the workload prints at its start and end; ratio = median of "
               "per-rep ratios.")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print_table(summary)
    print_footer(out["daemon_logs"], bench.oddities, f"{out['runtime_s']:.0f} s")


if __name__ == "__main__":
    main()
