"""Whether a container's command can start: its program looked up in the
sandbox rootfs before the runtime is run, so that a missing one gives 127 and
one that cannot be executed 126, as a shell does, under runc and crun alike
(which otherwise fail with their own line and exit 1).

The lookup is the runtimes' own (Go's ``exec.LookPath``, crun's): a name
with a ``/`` is a path (relative ones from the process's cwd), any other is
searched in the process environment's ``PATH`` (an empty entry is the cwd),
and a program is a regular file with an execute bit (the runtime execs with
the container's capabilities, so a root-owned 0700 file is executable for
any user). The rootfs is hostile: every path is opened with
``openat2(RESOLVE_IN_ROOT)`` from a descriptor of it (``O_PATH``: nothing is
read, a FIFO does not block), so its symlinks resolve inside it as they do in
the container. Paths under the container's own mounts (``/proc``, ``/dev``,
``/sys``) are not on the rootfs and are left to the runtime.

The working directory is checked the same way: the runtimes make a missing
one, but fail with their own line when it, or a directory on its way, is a
file; that is one ``layerfs: run:`` line and 126 here.
"""

from __future__ import annotations

import errno
import os
import posixpath
import stat
from collections.abc import Iterator

from ...records import Record
from ...safeopen import RESOLVE_IN_ROOT, RESOLVE_NO_MAGICLINKS, openat2

COMMAND_NOT_FOUND = 127  # a shell's codes
COMMAND_NOT_EXECUTABLE = 126
NOT_ON_ROOTFS = ("/proc", "/dev", "/sys")  # the container mounts its own there
MISSING_ERRNOS = (errno.ENOENT, errno.ENOTDIR)


class CommandProblem(Record):
    """Why the command cannot start: the exit code it gets, and one line saying why."""

    exit_code: int
    message: str


def check_command(rootfs: str, program: str, path: str, cwd: str) -> CommandProblem | None:
    """None if ``program`` (argv[0]) names an executable file in ``rootfs`` as
    the runtime looks it up (``path``: the process's PATH, ``cwd`` its working
    directory), else what is wrong with it."""
    rootfs_fd = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        problem = _check_cwd(rootfs_fd, cwd)
        if problem is not None:
            return problem
        if "/" in program:
            return _check_path(rootfs_fd, program, posixpath.join(cwd, program))
        return _search(rootfs_fd, program, path, cwd)
    finally:
        os.close(rootfs_fd)


def _check_cwd(rootfs_fd: int, cwd: str) -> CommandProblem | None:
    """A working directory that is, or lies below, something other than a
    directory cannot be made (a missing one is the runtime's to make)."""
    if _not_on_rootfs(cwd):
        return None
    try:
        mode = _mode(rootfs_fd, cwd)
    except OSError as exc:
        if exc.errno == errno.ENOTDIR:
            return CommandProblem(COMMAND_NOT_EXECUTABLE,
                                  f"working directory {cwd}: a file on its way")
        return None  # missing (made by the runtime), or the runtime's to say
    if stat.S_ISDIR(mode):
        return None
    return CommandProblem(COMMAND_NOT_EXECUTABLE, f"working directory {cwd}: not a directory")


def _check_path(rootfs_fd: int, program: str, full: str) -> CommandProblem | None:
    if _not_on_rootfs(full):
        return None
    try:
        mode = _mode(rootfs_fd, full)
    except OSError as exc:
        if exc.errno in MISSING_ERRNOS:
            return CommandProblem(COMMAND_NOT_FOUND, f"{program}: no such file or directory")
        return CommandProblem(COMMAND_NOT_EXECUTABLE, f"{program}: {exc.strerror}")
    why = _not_executable(mode)
    return None if why is None else CommandProblem(COMMAND_NOT_EXECUTABLE, f"{program}: {why}")


def _search(rootfs_fd: int, program: str, path: str, cwd: str) -> CommandProblem | None:
    """The first executable ``program`` in a PATH directory wins; a file found
    that is not executable (and no executable one) is 126, nothing is 127."""
    refused: str | None = None
    for full, mode in _found(rootfs_fd, program, path, cwd):
        if mode is None:
            return None  # under the container's own mounts: the runtime's to say
        if stat.S_ISDIR(mode):
            continue  # as the runtimes and shells do: a directory is not a match
        if _not_executable(mode) is None:
            return None
        refused = refused or full
    if refused is not None:
        return CommandProblem(COMMAND_NOT_EXECUTABLE, f"{refused}: permission denied "
                                                      "(not executable)")
    return CommandProblem(COMMAND_NOT_FOUND, f"{program}: command not found in PATH {path}")


def find_program(rootfs_fd: int, program: str, path: str, cwd: str) -> str | None:
    """Where in the rootfs (``rootfs_fd``) the runtime finds ``program``: its
    path if it is an executable file there (not under the container's own
    mounts), else None."""
    for full, mode in _found(rootfs_fd, program, path, cwd):
        if mode is None:
            return None
        if _not_executable(mode) is None:
            return full
    return None


def _found(rootfs_fd: int, program: str, path: str, cwd: str
           ) -> Iterator[tuple[str, int | None]]:
    """Each place the runtime looks for ``program`` (itself if it has a
    ``/``, else in each PATH directory) where something is, with its mode;
    None for one under the container's own mounts (and no more after it)."""
    if "/" in program:
        candidates = [posixpath.join(cwd, program)]
    else:
        candidates = [posixpath.join(cwd, d or ".", program) for d in path.split(":") if path]
    for full in candidates:
        if _not_on_rootfs(full):
            yield full, None
            return
        try:
            yield full, _mode(rootfs_fd, full)
        except OSError:
            continue


def _not_on_rootfs(full: str) -> bool:
    normal = posixpath.normpath(posixpath.join("/", full))
    return any(normal == top or normal.startswith(top + "/") for top in NOT_ON_ROOTFS)


def _mode(rootfs_fd: int, full: str) -> int:
    fd = openat2(rootfs_fd, full, os.O_PATH | os.O_CLOEXEC,
                 RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
    try:
        return os.fstat(fd).st_mode
    finally:
        os.close(fd)


def _not_executable(mode: int) -> str | None:
    if stat.S_ISDIR(mode):
        return "is a directory"
    if not stat.S_ISREG(mode):
        return "permission denied (not a regular file)"
    if not mode & 0o111:
        return "permission denied (not executable)"
    return None
