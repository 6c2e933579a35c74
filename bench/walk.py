"""The walk of an operation: how many of the project's source files one
operation runs code of (a function called; module bodies an import runs do
not count), through ``sys.setprofile`` and ``threading.setprofile``:

* ``build``: ``layerfs build DIR`` (``layerfs.cli.main.main``, in-process)
  to the published manifest, of a small tree into a ``file://`` store;
* ``cold read``: one 128 KiB read at the start of a built layer's blob,
  through the node's read path in-process (``BlobFile.read`` over
  ``ChunkStates``, ``ChunkFetcher`` and the chunk cache; no FUSE), nothing
  cached, until its cache file is written;
* ``cache-hit read``: the same read in a new process over that cache (its
  memory empty: the chunk comes from its cache file).

    python -m bench.walk [--tree DIR] [--out FILE]

Each walk also lists its returns: a call into a module that is already
on the call path below the calling module (A calls B, which calls back
into A), each as ``A <- B (function)``; a read whose modules are layered
has none.

``--tree`` measures another checkout (a worktree of another commit where the
source tree is the package; its compiled check is taken from this one's if it
has none built): each operation runs in a process of its own that imports
``layerfs`` from that tree, so the two trees are measured alike. Prints each
walk's count and files; writes JSON (default ``bench/results/walk-<commit>.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import tomllib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import RESULTS, ROOT

OPERATIONS = ("build", "cold read", "cache-hit read")
READ = 128 << 10  # bytes of the read (FUSE's usual request)
LAYER = "walk/layer"


def laid_out_as_package(tree: Path) -> None:
    """Refuse a tree whose package is mapped from other folders (before the
    source tree was the package): measure it with its own commit's walk."""
    setuptools = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"]
    if "package-dir" in setuptools:
        raise SystemExit(f"{tree}: its package is mapped (package-dir); run that "
                         "commit's own bench/walk.py")


def compiled_check(tree: Path) -> None:
    """Put this checkout's built compiled check beside ``tree``'s (same C source)
    if ``tree`` has none built."""
    formats = tree / "layerfs" / "formats"
    if list(formats.glob("_erofscheck*.so")):
        return
    import layerfs.formats._erofscheck as built  # this checkout's (the editable install)

    source = Path(built.__file__ or "")
    if (ROOT / "layerfs/formats/_erofscheck.c").read_bytes() != (
            formats / "_erofscheck.c").read_bytes():
        raise SystemExit(f"{tree}: its _erofscheck.c differs; build it there first")
    shutil.copy(source, formats / source.name)


def back_into(frame: Any, prefix: str) -> str | None:
    """``A <- B (function)`` where ``frame``'s module A is on the call path
    below its nearest caller under ``prefix``, a module B other than A."""
    name = frame.f_code.co_filename
    caller = frame.f_back
    while caller is not None and not caller.f_code.co_filename.startswith(prefix):
        caller = caller.f_back
    if caller is None or caller.f_code.co_filename == name:
        return None
    below = caller.f_back
    while below is not None:
        if below.f_code.co_filename == name:
            return (f"{name.removeprefix(prefix)} <- "
                    f"{caller.f_code.co_filename.removeprefix(prefix)} "
                    f"({frame.f_code.co_qualname})")
        below = below.f_back
    return None


@dataclass
class Walk:
    """What :func:`profiled` saw: each file with its first function, and
    the calls back into a module already left (:func:`back_into`)."""

    seen: dict[str, str] = field(default_factory=dict)
    returns: set[str] = field(default_factory=set)


@contextmanager
def profiled(prefix: str) -> Iterator[Walk]:
    """The source files under ``prefix`` whose functions run in the block (in
    any thread started meanwhile), each with the first function seen, and
    the returns to a module left; what runs while a module is being
    imported (its body, the functions it calls) does not count."""
    walk = Walk()
    seen = walk.seen
    importing = threading.local()

    def hook(frame: Any, event: str, arg: object) -> None:
        code = frame.f_code
        if code.co_name == "<module>":
            if event in ("call", "return"):
                depth = getattr(importing, "depth", 0)
                importing.depth = depth + (1 if event == "call" else -1)
            return
        if event == "call" and not getattr(importing, "depth", 0):
            name = code.co_filename
            if name.startswith(prefix):
                if name not in seen:
                    seen[name] = code.co_qualname
                back = back_into(frame, prefix)
                if back is not None:
                    walk.returns.add(back)

    threading.setprofile(hook)
    sys.setprofile(hook)
    try:
        yield walk
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


def source_tree(src: Path) -> Path:
    """A small tree: a few text files and two larger ones of random bytes."""
    src.mkdir(parents=True, exist_ok=True)
    for i in range(8):
        (src / f"note{i}.txt").write_text(f"note {i}\n" * 50)
    (src / "lib").mkdir(exist_ok=True)
    (src / "lib" / "big.bin").write_bytes(os.urandom(3 << 20))
    (src / "lib" / "small.bin").write_bytes(os.urandom(200 << 10))
    return src


# -- in the measuring process (layerfs imported from the measured tree) -------------

def refstore_class() -> Any:
    try:
        from layerfs.refstore import RefStore
    except ImportError:  # (before the ref store had its own name)
        from layerfs.registry import Registry as RefStore  # type: ignore[no-redef]
    return RefStore


def op_build(work: Path) -> Callable[[], None]:
    from layerfs.cli.main import main

    src = source_tree(work / "src")
    argv = ["build", str(src), "--name", "walk/built", "--version", "1",
            "--store", f"file://{work / 'build-store'}"]

    def run() -> None:
        try:
            main(argv)
        except SystemExit as exc:
            if exc.code not in (0, None):
                raise RuntimeError(f"layerfs build exited {exc.code}") from None

    return run


def read_setup(work: Path, fresh: bool) -> tuple[Any, Any]:
    """The layer's blob as the node reads it: a BlobFile over a new fetcher
    (empty memory) and the chunk cache under ``work`` (emptied if ``fresh``);
    and the task group its background work runs in (to open)."""
    from layerfs.builder.layer import BuildOptions, build_layer
    from layerfs.node.reads.blobfiles import BlobFile
    from layerfs.node.reads.chunkcache import ChunkCache
    from layerfs.node.reads.fetcher import ChunkFetcher
    from layerfs.store.file import FileStore
    from layerfs.tasks import TaskGroup

    store = FileStore(work / "read-store")
    refstore = refstore_class()(store)
    if fresh:
        shutil.rmtree(work / "cache", ignore_errors=True)
        build_layer(refstore, str(source_tree(work / "src")), BuildOptions(LAYER, "1"))
    digest = refstore.resolve("layers", f"{LAYER}@1")
    table = refstore.chunk_table(refstore.layer(digest))
    tasks = TaskGroup()
    fetcher = ChunkFetcher(store, ChunkCache(work / "cache", 1 << 30, compressed=True),
                           tasks=tasks)
    return BlobFile(digest, table, fetcher, 16), tasks


def op_read(work: Path, fresh: bool) -> Callable[[], None]:
    """The read; a cold one until its cache file is written (a hit writes none)."""
    import trio

    blob, tasks = read_setup(work, fresh)

    def run() -> None:
        async def main() -> None:
            async with trio.open_nursery() as nursery:
                tasks.nursery = nursery  # (not TaskGroup.open: its code is not the read's)
                data = await blob.read(0, READ)
                if fresh:
                    await blob.fetcher.writes_done()
                assert len(data) == READ
                nursery.cancel_scope.cancel()

        trio.run(main)

    return run


def measure_one(operation: str, tree: Path, work: Path) -> dict[str, list[str]]:
    import layerfs  # (from the measured tree: first on this process's PYTHONPATH)

    prefix = str(tree / "layerfs") + os.sep
    if not (layerfs.__file__ or "").startswith(prefix):
        raise SystemExit(f"layerfs imported from {layerfs.__file__}, not {prefix}")
    run = {"build": lambda: op_build(work), "cold read": lambda: op_read(work, True),
           "cache-hit read": lambda: op_read(work, False)}[operation]()
    with profiled(prefix) as walk:
        run()
    return {"which": [f"{name.removeprefix(str(tree) + os.sep)} ({first})"
                      for name, first in sorted(walk.seen.items())],
            "returns": sorted(walk.returns)}


# -- the driver ------------------------------------------------------------------------

def head(tree: Path) -> str:
    return subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", default=str(ROOT), help="the checkout to measure")
    ap.add_argument("--out", default=None, help="default: bench/results/walk-<commit>.json")
    ap.add_argument("--one", choices=OPERATIONS, help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:  # a measuring process
        print(json.dumps(measure_one(args.one, Path(args.tree), Path(args.work))))
        return
    tree = Path(args.tree).resolve()
    laid_out_as_package(tree)
    compiled_check(tree)
    result: dict[str, Any] = {"commit": head(tree), "read_bytes": READ, "walks": {}}
    with tempfile.TemporaryDirectory(prefix="layerfs-walk-") as tmp:
        for operation in OPERATIONS:
            proc = subprocess.run(  # the measured tree's layerfs first on the path
                [sys.executable, "-P", "-m", "bench.walk", "--one", operation, "--tree",
                 str(tree), "--work", tmp], cwd=tmp, capture_output=True, text=True,
                env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(ROOT)])})
            if proc.returncode != 0:
                raise SystemExit(f"{operation}: {proc.stderr[-3000:]}")
            walk = json.loads(proc.stdout.splitlines()[-1])
            result["walks"][operation] = {"files": len(walk["which"]), **walk}
    print(f"commit {result['commit']}")
    for operation, walk in result["walks"].items():
        print(f"{operation}: {walk['files']} files")
        for line in walk["which"]:
            print(f"  {line}")
        print(f"  returns to a module left: {len(walk['returns'])}")
        for line in walk["returns"]:
            print(f"    {line}")
    out = Path(args.out or RESULTS / f"walk-{result['commit']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
