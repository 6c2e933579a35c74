"""A real program and its libraries laid out as a layer, for the read-ahead
tests (tests/test_libraryahead.py, tests/test_programahead.py), and what
their node-tier tests share: waiting for a daemon's fetches to settle, and
reading a file whole with the store away."""

from __future__ import annotations

import os
import platform
import shutil
from pathlib import Path

import pytest

from layerfs.builder.env import create_env
from layerfs.refstore import RefStore
from layerfs.store.file import FileStore

from . import build
from .nodes import NodeDaemon

PROGRAM = "/usr/bin/ls"  # on the test machine: linked against libselinux, libc (and libpcre2)
DEBIAN_AMD64 = platform.machine() == "x86_64" and all(
    os.path.exists(f"/lib/x86_64-linux-gnu/{n}") for n in ("libselinux.so.1", "libpcre2-8.so.0"))
needs_debian_amd64 = pytest.mark.skipif(not DEBIAN_AMD64, reason="a Debian x86_64 host's ls")

# the store's directory renamed away: the daemon says so for each read that needed it
# (unreachable, unavailable, no answer, timed out: whichever the read met first)
STORE_GONE = [r"ERROR layerfs\.node\.(fuse\.nodefs: read: cannot read chunk \w+: "
              r"|reads\.fetcher: )",
              r"WARNING layerfs\.node\.reads\.partialblobs: a read of layer data failed \(EIO\)"]


def host_file(path: str) -> Path:
    return Path(os.path.realpath(path))


def program_tree(root: Path) -> list[str]:
    """``PROGRAM`` and the libraries it loads, laid out as Debian does (merged
    /usr: /lib and /lib64 links); the libraries' paths in the tree."""
    libdir = root / "usr/lib/x86_64-linux-gnu"
    libdir.mkdir(parents=True)
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/lib64").mkdir()
    shutil.copy(PROGRAM, root / "usr/bin/prog")
    libs = []
    for name in ("libselinux.so.1", "libc.so.6", "libpcre2-8.so.0", "ld-linux-x86-64.so.2"):
        real = host_file(f"/lib/x86_64-linux-gnu/{name}")
        shutil.copy(real, libdir / real.name)
        if real.name != name:
            os.symlink(real.name, libdir / name)
        libs.append(f"/usr/lib/x86_64-linux-gnu/{real.name}")
    os.symlink("usr/lib", root / "lib")
    os.symlink("usr/lib64", root / "lib64")
    os.symlink("../lib/x86_64-linux-gnu/ld-linux-x86-64.so.2",
               root / "usr/lib64/ld-linux-x86-64.so.2")
    (root / "etc").mkdir()
    shutil.copy("/etc/ld.so.cache", root / "etc/ld.so.cache")  # what the loader reads first
    return libs + ["/etc/ld.so.cache"]


def fetched_settles(node: NodeDaemon, at_least: int) -> None:
    """Until the daemon has fetched ``at_least`` bytes (at most 20 s), then
    until its count stays the same for half a second."""
    import time

    deadline = time.monotonic() + 20
    while node.request("stats")["cache"].get("bytes_fetched", 0) < at_least:
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        now = node.request("stats")["cache"].get("bytes_fetched", 0)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since > 0.5:
            return
        time.sleep(0.05)


def readable(path: Path, source: Path) -> bool:
    """Whether ``path`` reads whole with ``source``'s bytes (False on EIO)."""
    try:
        return path.read_bytes() == source.read_bytes()
    except OSError:
        return False


def program_env(tmp_path: Path) -> tuple[Path, list[str], Path]:
    """Env ``e@1`` of one layer (``program_tree`` and a 2 MiB file no program
    names, ``/usr/share/other.bin``) in a file store: the tree, the
    libraries' paths, the store's directory."""
    tree = tmp_path / "tree"
    libs = program_tree(tree)
    (tree / "usr/share").mkdir(parents=True)
    (tree / "usr/share/other.bin").write_bytes(os.urandom(2 << 20))
    store_dir = tmp_path / "store"
    store = FileStore(str(store_dir))
    build(store, str(tree), name="prog")
    create_env(RefStore(store), "e", "1", ["prog@1"])
    return tree, libs, store_dir
