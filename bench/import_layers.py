"""How ``layerfs import`` scales with an image's layer count: wall time of
``layerfs import oci:DIR:TAG`` (the CLI, a fresh process each time, into a
fresh ``file://`` store) of images of N tiny layers, each adding one 8-byte
file and rewriting one shared file. Every size but the largest alternates
with the others over ``--reps`` reps (the median is reported); the sizes in
``--once`` run ``--big-reps`` times. An image of more than 500 layers (more
than one overlay stacks) is imported with ``--fold`` set to twice its
largest layer blob, so that its layers fold in pairs into half as many
layers. Also times the same command on a 1-layer image (the start-up floor
every row includes).

    python -m bench.import_layers [--sizes 10,100,500,1000] [--reps 5] [--once 500,1000]
        [--big-reps 2] [--out bench/results/import_layers.json] [--commit C]

Prints a table (seconds, seconds per image layer, and the marginal seconds per
layer between consecutive sizes) and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import RESULTS, git_head
from harness.ociimages import manifest_of, tiny_layers_image
from layerfs.mounts import MAX_LOWER_LAYERS

LAYERFS = str(Path(sys.executable).parent / "layerfs")
TAG = "t"


def make_image(work: Path, count: int) -> Path:
    """A layout of ``count`` tiny layers (made once per work directory)."""
    layout = work / f"image-{count}"
    if not (layout / "index.json").exists():
        shutil.rmtree(layout, ignore_errors=True)
        tiny_layers_image(layout, TAG, [{f"files/{k}": f"{k:08d}".encode(),
                                         "top": f"{k}\n".encode()} for k in range(count)])
    return layout


def fold_option(layout: Path, count: int) -> list[str]:
    """``--fold`` for an image of more layers than an overlay stacks: pairs."""
    if count <= MAX_LOWER_LAYERS:
        return []
    _, manifest = manifest_of(layout, TAG)
    return ["--fold", str(2 * max(layer["size"] for layer in manifest["layers"]))]


def import_once(work: Path, layout: Path, count: int) -> tuple[float, int]:
    """One timed import into a fresh store: seconds, and the env's layer count."""
    store = work / "store"
    shutil.rmtree(store, ignore_errors=True)
    argv = [LAYERFS, "import", f"oci:{layout}:{TAG}", "--name", "bench", "--version", "1",
            "--json", "--store", f"file://{store}", *fold_option(layout, count)]
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True)
    took = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"import of {count} layers failed: {proc.stderr.strip()}")
    return took, len(json.loads(proc.stdout)["layers"])


def run(work: Path, sizes: list[int], once: set[int], reps: int, big_reps: int
        ) -> dict[int, dict]:
    layouts = {n: make_image(work, n) for n in [1, *sizes]}
    samples: dict[int, list[float]] = {n: [] for n in layouts}
    env_layers: dict[int, int] = {}
    small = [n for n in layouts if n not in once]
    for rep in range(reps):
        order = small if rep % 2 == 0 else small[::-1]
        for n in order:
            took, env_layers[n] = import_once(work, layouts[n], n)
            samples[n].append(took)
    for n in sorted(once):
        for _ in range(big_reps):
            took, env_layers[n] = import_once(work, layouts[n], n)
            samples[n].append(took)
    rows = {}
    for n, times in samples.items():
        median = statistics.median(times)
        rows[n] = {"image_layers": n, "env_layers": env_layers[n], "reps": len(times),
                   "seconds": round(median, 3), "min_seconds": round(min(times), 3),
                   "seconds_per_layer": round(median / n, 5), "samples": [round(t, 3)
                                                                         for t in times]}
    ordered = sorted(rows)
    for below, above in zip(ordered, ordered[1:], strict=False):
        extra = rows[above]["seconds"] - rows[below]["seconds"]
        rows[above]["marginal_seconds_per_layer"] = round(extra / (above - below), 5)
    return rows


def report(rows: dict[int, dict]) -> None:
    print(f"{'image layers':>12} {'env layers':>10} {'reps':>4} {'s (median)':>10} "
          f"{'s / layer':>10} {'marginal s / layer':>18}")
    for n in sorted(rows):
        r = rows[n]
        marginal = r.get("marginal_seconds_per_layer")
        print(f"{n:12} {r['env_layers']:10} {r['reps']:4} {r['seconds']:10.3f} "
              f"{r['seconds_per_layer']:10.4f} "
              f"{'' if marginal is None else f'{marginal:18.4f}'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10,100,500,1000")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--once", default="500,1000",
                    help="Sizes run --big-reps times, after the others.")
    ap.add_argument("--big-reps", type=int, default=2)
    ap.add_argument("--work", default="/tmp/layerfs-bench-import-layers")
    ap.add_argument("--out", default=str(RESULTS / "import_layers.json"))
    ap.add_argument("--commit", help="Record this commit for the code measured (default: "
                    "the tree's, with +changes if it differs).")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    once = {int(s) for s in args.once.split(",") if s} & set(sizes)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    commit = args.commit or git_head()  # before the run: the code it measures
    load_before = os.getloadavg()[0]
    start = time.monotonic()
    rows = run(work, sizes, once, args.reps, args.big_reps)
    load_after = os.getloadavg()[0]
    report(rows)
    print(f"load average (1 min) {load_before:.1f} before, {load_after:.1f} after; "
          f"total {time.monotonic() - start:.0f} s")
    doc = {"commit": commit, "rows": [rows[n] for n in sorted(rows)],
           "reps": args.reps, "big_reps": args.big_reps,
           "load_average_1min": [load_before, load_after], "cpus": os.cpu_count()}
    Path(args.out).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
