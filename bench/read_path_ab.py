#!/usr/bin/env python3
"""The node's steady read path, old code against new: bench/node.py's warm
(cached) and cold (uncached, file:// store) sequential reads through a
sandbox, run alternately with the fetcher modules of an older commit and of
the work tree.

Each round runs ``bench/node.py --only warm,cold`` once with each code, the
order reversed on odd rounds. The old code is ``git show OLD:<module>`` of
each of ``--modules``, copied into place for its runs (the daemons are new
processes each run, so they import what is in place) and the work tree's
files put back after every run, also when the run fails. Reports, per code,
the median over rounds of each run's median MB/s and daemon CPU seconds, and
new/old ratios. Needs root (as bench/node.py).

    python bench/read_path_ab.py [--old 3063ee8] [--rounds 3]
        [--node-args "--quick --read-size 200M --reps 3"]

Prints a table and writes bench/results/read_path-<commit>.json.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from daemons import git_head

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MODULES = "layerfs/node/fetcher.py,layerfs/node/failfast.py"


def node_run(node_args: list[str], out: Path) -> dict[str, Any]:
    """One bench/node.py run of the warm and cold reads; its result JSON."""
    subprocess.run([sys.executable, str(HERE / "node.py"), "--only", "warm,cold",
                    "--out", str(out), *node_args], check=True)
    return json.loads(out.read_text())


def numbers(result: dict[str, Any]) -> dict[str, float]:
    warm, cold = result["warm_read"], result["cold_read"]
    return {"warm_mb_s": warm["layerfs_p50_mb_s"],
            "warm_daemon_cpu_s": statistics.median(warm["daemon_cpu_s"]),
            "cold_mb_s": cold["layerfs_p50_mb_s"],
            "cold_daemon_cpu_s": statistics.median(cold["daemon_cpu_s"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default="3063ee8", help="the commit of the old code")
    ap.add_argument("--modules", default=MODULES, help="the files swapped, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--node-args", default="--quick --read-size 200M --reps 3",
                    help="bench/node.py options of every run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    head = git_head()
    modules = [REPO / m for m in args.modules.split(",")]
    new = {m: m.read_bytes() for m in modules}
    old = {m: subprocess.run(["git", "-C", str(REPO), "show",
                              f"{args.old}:{m.relative_to(REPO)}"],
                             capture_output=True, check=True).stdout for m in modules}
    runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    started = time.perf_counter()
    work = HERE / "work" / "read_path_ab"
    work.mkdir(parents=True, exist_ok=True)
    try:
        for rnd in range(args.rounds):
            for code in (("old", "new") if rnd % 2 == 0 else ("new", "old")):
                for m in modules:
                    m.write_bytes(old[m] if code == "old" else new[m])
                try:
                    print(f"round {rnd + 1}, {code} code", flush=True)
                    result = node_run(shlex.split(args.node_args), work / f"{code}-{rnd}.json")
                finally:
                    for m in modules:
                        m.write_bytes(new[m])
                runs[code].append(numbers(result))
                print(f"  {runs[code][-1]}", flush=True)
    finally:
        for m in modules:
            m.write_bytes(new[m])
    keys = list(runs["new"][0])
    medians = {code: {k: statistics.median(r[k] for r in runs[code]) for k in keys}
               for code in runs}
    ratios = {k: round(medians["new"][k] / medians["old"][k], 3) for k in keys}
    print(f"{'':22} {'old':>9} {'new':>9} {'new/old':>8}")
    for k in keys:
        print(f"{k:22} {medians['old'][k]:9.2f} {medians['new'][k]:9.2f} {ratios[k]:8.3f}")
    out = Path(args.out or HERE / "results" / f"read_path-{head.split('+')[0]}.json")
    out.write_text(json.dumps({
        "commit": head, "old": args.old, "modules": args.modules, "rounds": args.rounds,
        "node_args": args.node_args, "runs": runs, "medians": medians, "ratios": ratios,
        "runtime_s": round(time.perf_counter() - started, 1),
        "method": "bench/node.py --only warm,cold, alternating old and new fetcher modules "
                  "(order reversed on odd rounds); medians over rounds of each run's median",
    }, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
