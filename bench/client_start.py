"""How fast a node command's client starts: wall time of ``layerfs up``, ``ps``,
``stats``, ``run`` and ``down`` against a real daemon, each as a ratio against
the floor of the same subprocess path (``python -c pass`` with the same
interpreter, and ``/bin/true``), and what the client's start costs: the
command's wall time less that of the same call through the Python API
(``layerfs.node.Client``) from this already running process (side ``api``,
alternating with the commands), which is the daemon's work and runc's alone.

Builds a busybox layer into a ``file://`` store under the work directory and
starts one daemon on it. Each rep runs, in an order that alternates between
reps, the baselines and the command sequence ``up`` (a fresh sandbox id),
``ps``, ``stats``, ``run ID -- true`` (runc included), ``down``; with
``--compare LAYERFS`` (another checkout's ``layerfs`` script, e.g. the commit
before) that sequence also runs with it in the same rep, against the same
daemon, and with ``--client NAME=LAYERFS`` (repeatable) with more clients, e.g.
a wheel install (``pip install .`` into a venv) of either; each client's
interpreter's ``python -c pass`` is timed too. Also counts the modules each
``layerfs ps`` imports (``python -X importtime``). Needs root.

Bytecode: an installed package has its ``.pyc`` files (pip compiles them), so by
default the commands run with bytecode cached under the work directory
(``PYTHONPYCACHEPREFIX``, written by one warm-up run, whatever
``PYTHONDONTWRITEBYTECODE`` says); ``--bytecode none`` compiles every module
from source on every start instead.

    python -m bench.client_start [--reps 20] [--compare /path/to/layerfs]
        [--client NAME=/path/to/layerfs] [--bytecode cached|none]

Prints a table (medians) and writes bench/results/client_start.json.
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
from bench.daemons import clear_dir
from harness.daemonproc import DaemonProcess
from layerfs.builder.layer import BuildOptions, build_layer
from layerfs.node.client import Client
from layerfs.refstore import RefStore
from layerfs.store.file import FileStore

COMMANDS = ("up", "ps", "stats", "run", "down")


def make_store(work: Path) -> str:
    """A file:// store with layer base@1: busybox and its sh and true."""
    rootfs = work / "rootfs"
    for sub in ("bin", "etc", "proc", "dev", "tmp"):
        (rootfs / sub).mkdir(parents=True, exist_ok=True)
    shutil.copy("/bin/busybox", rootfs / "bin" / "busybox")
    for applet in ("sh", "true"):
        (rootfs / "bin" / applet).symlink_to("busybox")
    url = "file://" + str(work / "store")
    store = FileStore(str(work / "store"))
    try:
        build_layer(RefStore(store), str(rootfs), BuildOptions(name="base", version="1"))
    finally:
        store.close()
    return url


def child_env(bytecode: str, work: Path) -> dict[str, str]:
    """The commands' environment: bytecode cached under ``work`` or never written."""
    env = dict(os.environ)
    if bytecode == "cached":
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(work / "pycache")
    else:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        env.pop("PYTHONPYCACHEPREFIX", None)
    return env


ENV: dict[str, str] = dict(os.environ)


def wall_ms(argv: list[str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)
    elapsed = (time.perf_counter() - start) * 1000
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)}: exit {proc.returncode}: {proc.stderr.decode()}")
    return elapsed


def command_argv(layerfs: str, command: str, root: str, sid: str) -> list[str]:
    return {"up": [layerfs, "up", "--layer", "base@1", "--id", sid, "--root", root],
            "ps": [layerfs, "ps", "--root", root],
            "stats": [layerfs, "stats", "--root", root],
            "run": [layerfs, "run", "--root", root, sid, "--", "true"],
            "down": [layerfs, "down", sid, "--root", root]}[command]


def interpreter_of(layerfs: str) -> str:
    with open(layerfs, encoding="utf-8") as f:
        return f.readline().removeprefix("#!").strip()


def modules_imported(layerfs: str, root: str) -> int:
    """How many modules ``layerfs ps`` imports (its script's interpreter, -X importtime)."""
    proc = subprocess.run([interpreter_of(layerfs), "-X", "importtime", layerfs, "ps",
                           "--root", root], capture_output=True, text=True, check=True, env=ENV)
    return sum(line.startswith("import time:") for line in proc.stderr.splitlines()) - 1


def api_ms(client: Client, command: str, sid: str) -> float:
    """Wall time of ``command`` as one Python API call (no process started)."""
    call = {"up": lambda: client.up(sid, layers=["base@1"]), "ps": client.ps,
            "stats": client.stats, "run": lambda: client.run(sid, ["true"]),
            "down": lambda: client.down(sid)}[command]
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1000


def one_rep(rep: int, clients: dict[str, str], root: str, samples: dict) -> None:
    """The baselines, each client's command sequence and the API's, in an
    order that alternates with ``rep``."""
    sides: list[tuple[str, str | None]] = [*clients.items(), ("api", None)]
    floors = [("python -c pass", [sys.executable, "-c", "pass"]), ("/bin/true", ["/bin/true"])]
    floors += [(f"python -c pass ({side})", [interpreter_of(layerfs), "-c", "pass"])
               for side, layerfs in clients.items() if interpreter_of(layerfs) != sys.executable]
    if rep % 2:
        sides.reverse()
        floors.reverse()
    for name, argv in floors:
        samples.setdefault(name, []).append(wall_ms(argv))
    for side, layerfs in sides:
        sid = f"bench-{side}-{rep}"
        for command in COMMANDS:
            if layerfs is None:
                ms = api_ms(Client(root, timeout=60), command, sid)
            else:
                ms = wall_ms(command_argv(layerfs, command, root, sid))
            samples.setdefault(f"{side} {command}", []).append(ms)


def report(samples: dict, clients: dict[str, str], imports: dict[str, int]) -> dict:
    floor = statistics.median(samples["python -c pass"])
    rows = {name: {"median_ms": round(statistics.median(v), 1), "min_ms": round(min(v), 1),
                   "vs_python_pass": round(statistics.median(v) / floor, 2)}
            for name, v in samples.items()}
    print(f"{'':30} {'median ms':>10} {'min ms':>8} {'x python -c pass':>17}")
    for name, row in rows.items():
        print(f"{name:30} {row['median_ms']:10.1f} {row['min_ms']:8.1f} "
              f"{row['vs_python_pass']:17.2f}")
    if "before" in clients:
        print(f"{'':22} {'after/before':>12}")
        for command in COMMANDS:
            ratio = rows[f"after {command}"]["median_ms"] / rows[f"before {command}"]["median_ms"]
            rows[f"after {command}"]["vs_before"] = round(ratio, 2)
            print(f"{command:22} {ratio:12.2f}")
    for side, count in imports.items():
        print(f"modules imported by `layerfs ps` ({side}): {count}")
    return rows


def client_starts(rows: dict, clients: dict[str, str]) -> dict[str, dict[str, float]]:
    """Per client and command: its median less the API call's (ms), the client's start."""
    out = {side: {c: round(rows[f"{side} {c}"]["median_ms"] - rows[f"api {c}"]["median_ms"], 1)
                  for c in COMMANDS} for side in clients}
    print("\nclient start, ms (the command's median less the API call's; target <= 60)")
    print(f"{'':10}" + "".join(f"{c:>8}" for c in COMMANDS))
    for side, row in out.items():
        print(f"{side:10}" + "".join(f"{row[c]:8.1f}" for c in COMMANDS))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--compare", metavar="LAYERFS",
                    help="Another layerfs script to time in the same run (as 'before').")
    ap.add_argument("--client", action="append", default=[], metavar="NAME=LAYERFS",
                    help="One more layerfs script to time in the same run, as NAME.")
    ap.add_argument("--bytecode", choices=("cached", "none"), default="cached",
                    help="Run the commands with .pyc files cached (as installed) or none.")
    ap.add_argument("--work", default="/tmp/layerfs-bench-client")
    ap.add_argument("--out", default=str(RESULTS / "client_start.json"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (the daemon mounts)")
    ours = str(Path(sys.executable).parent / "layerfs")
    clients = {"after": ours, **({"before": args.compare} if args.compare else {})}
    clients.update(dict(c.split("=", 1) for c in args.client))
    work = clear_dir(Path(args.work), [])
    work.mkdir(parents=True)
    ENV.clear()
    ENV.update(child_env(args.bytecode, work))
    url = make_store(work)
    daemon = DaemonProcess(work / "node", ["--store", url], cache_size="256M",
                           log_path=work / "daemon.log").start()
    try:
        root = str(daemon.root)
        imports = {side: modules_imported(path, root) for side, path in clients.items()}
        one_rep(-1, clients, root, {})  # warm-up: writes the bytecode cache, if any
        samples: dict[str, list[float]] = {}
        load_before = os.getloadavg()[0]
        for rep in range(args.reps):
            one_rep(rep, clients, root, samples)
        load_after = os.getloadavg()[0]
    finally:
        left = daemon.cleanup()
    rows = report(samples, clients, imports)
    starts = client_starts(rows, clients)
    print(f"load average (1 min) {load_before:.1f} before, {load_after:.1f} after; "
          f"mounts left: {left or 'none'}")
    doc = {"commit": git_head(), "reps": args.reps, "rows": rows, "client_start_ms": starts,
           "bytecode": args.bytecode,
           "modules_imported_by_ps": imports, "clients": clients,
           "load_average_1min": [load_before, load_after], "cpus": os.cpu_count()}
    Path(args.out).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
