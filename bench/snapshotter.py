"""containerd's snapshotter at a node's rate: what its calls cost as its
records grow, and many lazy Prepares of one chain at once.

A two-layer image (``harness.ociimages.tiny_layers_image``) is imported into
a ``file://`` store under the work directory; a daemon serves
``--containerd-snapshotter``, and this script calls it over gRPC as
containerd's metadata store does (a lazy Prepare answered ALREADY_EXISTS is
followed by containerd's filtered List of that chain and parent). Then:

1. **Concurrent lazy Prepares.** One lazy Prepare of the image's top chain
   alone (its layers mounted cold), then, the snapshot removed (the layers
   unmounted), ``--concurrent`` lazy Prepares of that chain at once, each
   under its own key, from as many client threads: the wall time, against
   the single one's (the ratio), and every answer (all must be ALREADY_EXISTS
   and one snapshot made; it is kept, so the layers stay mounted below).
2. **Cost against records.** A second daemon (its own ROOT, the same
   store) gets ``--records`` snapshots (made by 16 client threads). Then, on
   both daemons in turn, call by call (so that the machine's load weighs on
   both alike), ``--calls`` plain Prepares, each followed by its Remove, and
   as many lazy Prepares on fresh committed parents (each a new snapshot of
   the chain), each with its Remove: p50/p99 per call on the daemon with
   (almost) no snapshot and on the one with ``--records``; the ratios.

Needs root. ``python -m bench.snapshotter [--records 10000] [--concurrent 300]
[--calls 200]``; prints a table and writes bench/results/snapshotter.json
(with the commit).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import grpc

from bench import RESULTS, git_head
from harness.daemonproc import DaemonProcess
from harness.ociimages import tiny_layers_image
from layerfs.builder.oci.importer import ImportOptions, import_image
from layerfs.builder.oci.sources import open_source
from layerfs.node.containerd.api import snapshots_pb2 as pb
from layerfs.node.containerd.api import snapshots_pb2_grpc
from layerfs.refstore import RefStore
from layerfs.store.file import FileStore

OUT = RESULTS / "snapshotter.json"
TARGET = "containerd.io/snapshot.ref"
FILL_THREADS = 16


def imported_chain(work: Path) -> tuple[str, str]:
    """A two-layer image in a file store under ``work``: the store URL and its top chain ID."""
    layout = tiny_layers_image(work / "layout", "v1", [{"a": b"1" * 4096}, {"b": b"2" * 4096}])
    store = FileStore(work / "store")
    source = open_source(f"oci:{layout}:v1")
    try:
        result = import_image(RefStore(store), source, ImportOptions("bench/snap", "1"))
    finally:
        source.close()
    return store.url, result.chains[-1]


class Caller:
    """containerd's calls to the snapshotter, timed."""

    def __init__(self, socket: Path, chain: str) -> None:
        self.stub = snapshots_pb2_grpc.SnapshotsStub(grpc.insecure_channel(f"unix:{socket}"))
        self.chain = chain

    def lazy(self, key: str, parent: str = "") -> grpc.StatusCode:
        """A lazy Prepare and, answered ALREADY_EXISTS, containerd's look-up of the chain."""
        try:
            self.stub.Prepare(pb.PrepareSnapshotRequest(key=key, parent=parent,
                                                        labels={TARGET: self.chain}))
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.ALREADY_EXISTS:
                found = [i for a in self.stub.List(pb.ListSnapshotsRequest(
                    filters=[f'labels."{TARGET}"=={self.chain},parent=="{parent}"']))
                    for i in a.info]
                assert len(found) == 1, found
            return exc.code()
        return grpc.StatusCode.OK

    def lazy_name(self, parent: str) -> str:
        found = [i for a in self.stub.List(pb.ListSnapshotsRequest(
            filters=[f'labels."{TARGET}"=={self.chain},parent=="{parent}"'])) for i in a.info]
        return found[0].name

    def prepare(self, key: str, parent: str = "") -> None:
        self.stub.Prepare(pb.PrepareSnapshotRequest(key=key, parent=parent))

    def commit(self, name: str, key: str) -> None:
        self.stub.Commit(pb.CommitSnapshotRequest(name=name, key=key))

    def remove(self, key: str) -> None:
        self.stub.Remove(pb.RemoveSnapshotRequest(key=key))


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def concurrent_lazy(caller: Caller, count: int) -> dict:
    single = timed(lambda: caller.lazy("one/lazy"))
    caller.remove(caller.lazy_name(""))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(count) as pool:
        codes = list(pool.map(lambda k: caller.lazy(f"many/{k}"), range(count)))
    wall = time.perf_counter() - t0
    caller.lazy_name("")  # kept: its layers stay mounted for what follows
    return {"single_s": round(single, 4), "concurrent": count, "wall_s": round(wall, 3),
            "ratio_to_single": round(wall / single, 1),
            "all_already_exists": set(codes) == {grpc.StatusCode.ALREADY_EXISTS}}


def per_call(callers: dict[str, Caller], calls: int) -> dict[str, dict]:
    """p50/p99 milliseconds of plain Prepare, Remove, and a lazy Prepare on a
    fresh committed parent with its Remove, on each daemon, in turn."""
    times = {side: {"prepare": [], "remove": [], "lazy_prepare": [], "lazy_remove": []}
             for side in callers}
    for n in range(calls):
        for side, caller in callers.items():
            times[side]["prepare"].append(timed(partial(caller.prepare, f"t/p/{n}")))
        for side, caller in callers.items():
            times[side]["remove"].append(timed(partial(caller.remove, f"t/p/{n}")))
    for n in range(calls):
        for caller in callers.values():
            caller.prepare(f"t/base-a/{n}")
            caller.commit(f"t/base/{n}", f"t/base-a/{n}")
    for n in range(calls):
        for side, caller in callers.items():
            lazy = partial(caller.lazy, f"t/l/{n}", f"t/base/{n}")
            times[side]["lazy_prepare"].append(timed(lazy))
        for side, caller in callers.items():
            name = caller.lazy_name(f"t/base/{n}")
            times[side]["lazy_remove"].append(timed(partial(caller.remove, name)))
            caller.remove(f"t/base/{n}")
    return {side: {what: {"p50_ms": round(statistics.median(ts) * 1e3, 2),
                          "p99_ms": round(sorted(ts)[int(len(ts) * 0.99) - 1] * 1e3, 2)}
                   for what, ts in kinds.items()} for side, kinds in times.items()}


def fill(caller: Caller, records: int) -> float:
    """``records`` active snapshots, made by several client threads; seconds."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(FILL_THREADS) as pool:
        list(pool.map(lambda k: caller.prepare(f"fill/{k}"), range(records)))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=10000)
    ap.add_argument("--concurrent", type=int, default=300)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--work", type=Path, default=Path("/tmp/containerd-bench"))
    args = ap.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    url, chain = imported_chain(args.work)
    nodes: dict[str, DaemonProcess] = {}
    callers: dict[str, Caller] = {}
    try:
        for side in ("empty", "full"):
            socket = args.work / f"{side}.sock"
            nodes[side] = DaemonProcess(args.work / side, ["--store", url])
            nodes[side].extra_args = ["--containerd-snapshotter", str(socket)]
            nodes[side].start()
            callers[side] = Caller(socket, chain)
            callers[side].prepare("warm/up")  # the connection made
            callers[side].remove("warm/up")
        lazy = concurrent_lazy(callers["empty"], args.concurrent)
        callers["full"].lazy("hold/lazy")  # the layers mounted there too, and kept
        fill_s = fill(callers["full"], args.records)
        measured = per_call(callers, args.calls)
    finally:
        problems = []
        for node in nodes.values():
            node.stop()
            problems += node.log_problems()[0]
    empty, full = measured["empty"], measured["full"]
    result = {"commit": git_head(), "records": args.records, "fill_s": round(fill_s, 1),
              "concurrent_lazy": lazy, "per_call_empty": empty,
              f"per_call_at_{args.records}": full,
              "ratios_p50": {k: round(full[k]["p50_ms"] / empty[k]["p50_ms"], 2) for k in full},
              "daemon_log_problems": problems[:20]}
    print(f"{args.concurrent} concurrent lazy Prepares of one chain: {lazy['wall_s']} s "
          f"(one alone: {lazy['single_s']} s; ratio {lazy['ratio_to_single']}; all "
          f"ALREADY_EXISTS: {lazy['all_already_exists']})")
    print(f"{'call':14} {'p50 empty':>10} {'p99 empty':>10} {f'p50 at {args.records}':>13} "
          f"{f'p99 at {args.records}':>13} {'ratio p50':>9}")
    for what in empty:
        print(f"{what:14} {empty[what]['p50_ms']:>8.2f}ms {empty[what]['p99_ms']:>8.2f}ms "
              f"{full[what]['p50_ms']:>11.2f}ms {full[what]['p99_ms']:>11.2f}ms "
              f"{result['ratios_p50'][what]:>9}")
    print(f"filling {args.records} snapshots took {fill_s:.1f} s; commit {result['commit']}; "
          f"daemon log problems: {len(problems)}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    shutil.rmtree(args.work, ignore_errors=True)
    if problems or not lazy["all_already_exists"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
