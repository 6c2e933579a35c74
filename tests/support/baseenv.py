"""A small base env for node tests: layers base@1 and up@1, env e@1 (up over base)."""

from __future__ import annotations

import io
import os
import shutil
import tarfile
import time
from pathlib import Path

from layerfs.builder.env import create_env
from layerfs.refstore import RefStore
from support import build, need_root
from support.nodes import NodeDaemon

CHUNK = 65536


def make_base(root: Path) -> Path:
    """A busybox rootfs plus data files of several chunks."""
    for sub in ("bin", "etc", "proc", "dev", "tmp", "data", "lower/dir", "lower/opq"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    shutil.copy("/bin/busybox", root / "bin" / "busybox")
    for applet in ("sh", "cat", "ls", "echo", "sha256sum", "wc"):
        (root / "bin" / applet).symlink_to("busybox")
    (root / "etc" / "os-release").write_text("NAME=test-base\n")
    for i in range(4):
        (root / "data" / f"file{i}").write_bytes(os.urandom(5 * CHUNK + 1234 * i))
    (root / "lower" / "a").write_text("lower a")
    (root / "lower" / "gone").write_text("lower gone")
    (root / "lower" / "dir" / "x").write_text("lower x")
    (root / "lower" / "opq" / "hidden").write_text("hidden")
    return root


def upper_tar(path: Path) -> Path:
    entries = [("lower", None), ("lower/a", b"upper a"), ("lower/.wh.gone", b""),
               ("lower/dir", None), ("lower/dir/z", b"upper z"), ("lower/opq", None),
               ("lower/opq/.wh..wh..opq", b""), ("lower/opq/new", b"new")]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in entries:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    path.write_bytes(buf.getvalue())
    return path


def publish_base_env(tmp_path: Path, store) -> None:
    """Layers base@1 and up@1 and env e@1 (up over base) in ``store``."""
    need_root()
    build(store, str(make_base(tmp_path / "base")), name="base", chunk_size=CHUNK)
    build(store, str(upper_tar(tmp_path / "up.tar")), name="up", chunk_size=CHUNK)
    create_env(RefStore(store), "e", "1", ["up@1", "base@1"])


def up(node: NodeDaemon, sid: str, *args: str) -> Path:
    return Path(node.cli("up", *(args or ("e@1",)), "--id", sid).stdout.strip())


def settle(node: NodeDaemon) -> dict:
    """Wait until background fetches stop changing the cache."""
    last = None
    for _ in range(50):
        stats = node.request("stats")["cache"]
        if stats == last:
            return stats
        last = stats
        time.sleep(0.2)
    return last
