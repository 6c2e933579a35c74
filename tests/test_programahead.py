"""The program read-ahead of a run (layerfs/node/containers/programahead.py):
which programs a command names (its own, and a shell script's commands), a
read of each that stays inside the rootfs and never blocks, and, with a real
daemon, a touched program's libraries held before anything runs.

Tier: fast, but the last test's: node (a real daemon, kernel EROFS and
overlay mounts; root).
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import pytest
from support import need_root
from support.nodes import NodeDaemon, serving, up_lazy
from support.programs import (
    STORE_GONE,
    fetched_settles,
    needs_debian_amd64,
    program_env,
    readable,
)

from layerfs.node.containers.programahead import PROGRAMS_MAX, programs_of, touch, touch_programs


@pytest.mark.parametrize("args,programs", [
    (["python3", "t.py"], ["python3"]),
    (["sh", "-c", "apt-get --version; dpkg -l; perl -e 1; ls -lR /x; bash --version"],
     ["sh", "apt-get", "dpkg", "perl", "ls", "bash"]),
    (["/bin/bash", "-ec", "X=1 make -j4 && cd /w && ./run.sh | grep -v x\nfor i in a; do "
      "python3 t.py; done; if test -f x; then gcc a.c; fi; echo $(date)"],
     ["/bin/bash", "make", "./run.sh", "grep", "python3", "gcc", "date"]),
    (["sh", "-c", "echo 'open quote; ls"], ["sh"]),
    (["sh", "-c", "$PROG; `which x`; ~/bin/y; *.sh"], ["sh"]),
    (["sh", "--norc", "-c", "ls"], ["sh"]),  # not `-c` first: not read as a script
    (["env", "-c", "ls"], ["env"]),  # not a shell
    ([], []),
], ids=["program", "script", "compound", "open-quote", "expansions", "long-option",
        "not-a-shell", "empty"])
def test_the_programs_a_command_names(args, programs):
    assert programs_of(args) == programs


def test_a_long_script_names_at_most_the_bound():
    script = "; ".join(f"prog{i} arg" for i in range(100))
    assert len(programs_of(["sh", "-c", script])) == PROGRAMS_MAX


def test_a_touch_stays_in_the_rootfs_and_never_blocks(tmp_path):
    """A FIFO, a symlink out of the rootfs and a missing program are passed
    over at once; a program in PATH is read."""
    rootfs = tmp_path / "rootfs"
    (rootfs / "bin").mkdir(parents=True)
    os.mkfifo(rootfs / "bin" / "fifo")
    os.chmod(rootfs / "bin" / "fifo", 0o755)
    outside = tmp_path / "outside"
    outside.write_bytes(b"\x7fELF host file")
    outside.chmod(0o755)
    os.symlink(str(outside), rootfs / "bin" / "escape")
    (rootfs / "bin" / "prog").write_bytes(b"\x7fELF" + bytes(8192))
    (rootfs / "bin" / "prog").chmod(0o755)
    config = {"process": {"args": ["sh", "-c", "fifo; escape; missing; prog"],
                          "env": ["PATH=/bin"], "cwd": "/"},
              "root": {"path": str(rootfs)}}
    threads = touch_programs(config)
    for thread in threads:
        thread.join(timeout=5)
    assert threads and not any(t.is_alive() for t in threads)
    touch(str(rootfs), "escape", "/bin", "/")  # resolves inside the rootfs: nothing there


@needs_debian_amd64
def test_a_touched_program_has_its_libraries_held_before_it_runs(tmp_path):
    """Node tier. A sandbox's program touched as a run would (nothing
    executed), then the store taken away: the program and its libraries
    read whole through the sandbox, a file it does not name does not."""
    need_root()
    tree, libs, store_dir = program_env(tmp_path)
    node = NodeDaemon(tmp_path / "node", ["--store", f"file://{store_dir}"], read_timeout=2.0)
    node.expected = [re.compile(p) for p in STORE_GONE]
    for _ in serving(node):
        rootfs = up_lazy(node, "s1")
        thread = threading.Thread(target=touch, args=(str(rootfs), "prog", "/usr/bin", "/"))
        thread.start()
        thread.join(timeout=20)
        files = ["/usr/bin/prog", *libs]
        fetched_settles(node, sum((tree / p.lstrip("/")).stat().st_size for p in files))
        store_dir.rename(tmp_path / "gone")
        got = {p: readable(Path(rootfs) / p.lstrip("/"), tree / p.lstrip("/")) for p in files}
        assert all(got.values()), got
        assert not readable(Path(rootfs) / "usr/share/other.bin", tree / "usr/share/other.bin")
        (tmp_path / "gone").rename(store_dir)
        node.cli("down", "s1")
