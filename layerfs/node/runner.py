"""Run a command inside a sandbox rootfs (``layerfs run``).

Started by ``unshare --mount --pid --fork`` so it is PID 1 of a new PID
namespace in a new mount namespace; it mounts /proc and a minimal /dev inside
the rootfs, chroots and execs the command, whose exit status becomes ours.
"""

from __future__ import annotations

import os
import stat
import sys

from ..mounts import mount

MS_REC, MS_PRIVATE, MS_NOSUID, MS_NOEXEC = 0x4000, 1 << 18, 2, 8
DEVICES = {"null": (1, 3), "zero": (1, 5), "full": (1, 7), "random": (1, 8),
           "urandom": (1, 9), "tty": (5, 0)}


def prepare(rootfs: str) -> None:
    mount("none", "/", "", MS_REC | MS_PRIVATE)
    for sub in ("proc", "dev", "tmp"):
        os.makedirs(os.path.join(rootfs, sub), exist_ok=True)
    mount("proc", os.path.join(rootfs, "proc"), "proc", MS_NOSUID | MS_NOEXEC)
    dev = os.path.join(rootfs, "dev")
    mount("tmpfs", dev, "tmpfs", MS_NOSUID, "mode=755,size=1m")
    for name, (major, minor) in DEVICES.items():
        os.mknod(os.path.join(dev, name), stat.S_IFCHR | 0o666, os.makedev(major, minor))
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, os.path.join(dev, name))


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: runner ROOTFS CMD...", file=sys.stderr)
        return 2
    rootfs, cmd = argv[0], argv[1:]
    prepare(rootfs)
    os.chroot(rootfs)
    os.chdir("/")
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "HOME": "/root", "TERM": os.environ.get("TERM", "dumb")}
    try:
        os.execvpe(cmd[0], cmd, env)
    except OSError as exc:
        print(f"layerfs: error: cannot run {cmd[0]!r} in the sandbox: {exc.strerror}",
              file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
