"""The chunk cache's two forms side by side: ``--cache-form stored`` (a chunk
the store holds compressed is kept as its zstd frame) against ``plain``
(decompressed), on the image and workload of bench/image_start.py.

Each rep, for each form (the order alternating between reps): a **cold** start
on an empty daemon ROOT (``layerfs up --prefetch none --bundle`` + ``runc run``
of the workload; the daemon's disk writes over it, and the bytes of
ROOT/cache after), then a **warm** start: the daemon stopped, a new one on the
same ROOT, the page cache dropped, the same up + run (every chunk read from
the cache files, none from the store). Needs root.

    python -m bench.cache_form [--reps 5] [--store s3|file] [--client LAYERFS]

Prints a table (medians; ratios are medians of per-rep stored/plain ratios)
and writes bench/results/cache_form.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path

from bench import RESULTS, git_head
from bench.daemons import DaemonRuns, clear_dir, drop_caches, print_footer
from bench.image_start import (
    ENV_REF,
    WORKLOAD,
    du_bytes,
    published_image,
    runc_workload,
    timed_call,
    timed_run,
    write_bytes,
)
from harness.daemonproc import LAYERFS, DaemonProcess, detach_mounts

FORMS = ("stored", "plain")


class FormBench:
    def __init__(self, args: argparse.Namespace, work: Path, store_env: dict[str, str]) -> None:
        self.work = work
        self.store_env = store_env
        self.oddities: list[str] = []
        self.daemons = DaemonRuns(work, self.oddities, "20G", request_timeout=600)
        self.client = [args.client] if args.client else list(LAYERFS)

    def store_args(self, form: str) -> list[str]:
        args = ["--store", self.store_env["LAYERFS_STORE"], "--cache-form", form]
        if "AWS_ENDPOINT_URL" in self.store_env:
            args += ["--s3-endpoint", self.store_env["AWS_ENDPOINT_URL"]]
        return args

    def start(self, root: Path, form: str, sid: str) -> dict:
        """One timed up + run on a daemon started on ``root`` (kept afterwards)."""
        node: DaemonProcess = self.daemons.start(root, form, self.store_args(form))
        try:
            assert node.proc is not None
            pid = node.proc.pid
            drop_caches()
            w0 = write_bytes(pid)
            bundle = self.work / "bundle"
            shutil.rmtree(bundle, ignore_errors=True)
            up = timed_run([*self.client, "up", ENV_REF, "--id", sid, "--root", str(root),
                            "--prefetch", "none", "--bundle", str(bundle)])
            run = timed_call(lambda: runc_workload(bundle, sid, self.work / "runc"))
            os.sync()
            written = write_bytes(pid) - w0
            fetched = node.request("stats")["cache"].get("bytes_fetched", 0)
            node.request("down", id=sid)
        finally:
            self.daemons.finish(node)
        return {"up_s": round(up, 3), "run_s": round(run, 3), "start_s": round(up + run, 3),
                "disk_written_bytes": written, "bytes_fetched": fetched,
                "cache_bytes": du_bytes(root / "cache")}

    def run(self, reps: int) -> dict[str, dict[str, list[dict]]]:
        samples: dict[str, dict[str, list[dict]]] = {f: {"cold": [], "warm": []} for f in FORMS}
        for rep in range(reps):
            for form in (FORMS if rep % 2 == 0 else FORMS[::-1]):
                root = clear_dir(self.work / "roots" / form, self.oddities)
                cold = self.start(root, form, f"c{rep}")
                warm = self.start(root, form, f"w{rep}")
                shutil.rmtree(root, ignore_errors=True)
                samples[form]["cold"].append(cold)
                samples[form]["warm"].append(warm)
                print(f"  rep {rep + 1} {form:6} cold {cold['start_s']:.3f} s "
                      f"({cold['disk_written_bytes'] / 1e6:.1f} MB written, cache "
                      f"{cold['cache_bytes'] / 1e6:.1f} MB), warm {warm['start_s']:.3f} s",
                      flush=True)
        return samples


def summarize(samples: dict[str, dict[str, list[dict]]]) -> dict:
    out: dict = {}
    for form in FORMS:
        out[form] = {kind: {k: statistics.median(s[k] for s in rows) for k in rows[0]}
                     for kind, rows in samples[form].items()}
    ratios = {}
    for kind, key in (("cold", "start_s"), ("cold", "disk_written_bytes"),
                      ("cold", "cache_bytes"), ("warm", "start_s"), ("warm", "run_s")):
        per_rep = [round(s[key] / max(1e-9, p[key]), 4)
                   for s, p in zip(samples["stored"][kind], samples["plain"][kind], strict=True)]
        ratios[f"{kind} {key} stored / plain"] = {"median": statistics.median(per_rep),
                                                  "per_rep": per_rep}
    out["ratios"] = ratios
    return out


def print_table(summary: dict) -> None:
    print(f"\n{'form':8} {'cold start s':>12} {'disk written MB':>15} {'cache MB':>9} "
          f"{'warm start s':>12} {'warm run s':>10}")
    for form in FORMS:
        cold, warm = summary[form]["cold"], summary[form]["warm"]
        print(f"{form:8} {cold['start_s']:12.3f} {cold['disk_written_bytes'] / 1e6:15.1f} "
              f"{cold['cache_bytes'] / 1e6:9.1f} {warm['start_s']:12.3f} {warm['run_s']:10.3f}")
    for name, ratio in summary["ratios"].items():
        print(f"{name}: {ratio['median']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--store", choices=("s3", "file"), default="s3")
    ap.add_argument("--client", metavar="LAYERFS",
                    help="The layerfs script to time (default: this checkout's).")
    ap.add_argument("--work", default="/tmp/layerfs-bench/image-start")
    ap.add_argument("--out", default=str(RESULTS / "cache_form.json"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/cache_form.py needs root (FUSE, EROFS, overlay mounts)")
    work = Path(args.work).resolve()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.perf_counter()
    bench = None
    try:
        with published_image(work, args.store) as (ref, store_env, image_info, _):
            bench = FormBench(args, work, store_env)
            try:
                samples = bench.run(args.reps)
            finally:
                bench.daemons.stop_all()
    finally:
        detach_mounts(work / "roots")
    summary = summarize(samples)
    out = {"commit": git_head(),
           "params": {"reps": args.reps, "store": args.store,
                      "client": args.client or "this checkout (editable)", "workload": WORKLOAD},
           "machine": {"cpus": os.cpu_count(), "kernel": platform.release()},
           "image": {**image_info, "ref": ref}, "samples": samples,
           "summary": summary, "daemon_logs": bench.daemons.scan_logs(),
           "oddities": bench.oddities, "runtime_s": round(time.perf_counter() - started, 1),
           "method": __doc__.split("\n\n")[1].replace("\n", " ")}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print_table(summary)
    print_footer(out["daemon_logs"], bench.oddities, f"{out['runtime_s']:.0f} s")


if __name__ == "__main__":
    main()
