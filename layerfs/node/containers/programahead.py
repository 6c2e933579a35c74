"""Program read-ahead: the programs a run's command is about to exec, touched
before the runtime starts them.

A container's command names the programs its start execs: its own program
(``argv[0]``) and, for a shell's ``-c`` script, the first word of each of the
script's commands. Before the runtime runs, a thread per program reads its
first page through the sandbox's rootfs, the program looked up as the runtime
and a shell look it up (:func:`.imagecommand.find_program`: ``PATH``, inside
the rootfs). On a layer the node has not read, each read is a miss the
daemon serves at once, all in parallel, and its library fetch-ahead follows
each program's libraries (layerfs/node/reads/libraryahead.py), while the
runtime is still making the container: the start's chain of misses, a
program at a time and a library at a time, becomes a few rounds at its start.

A guess only: the threads are not waited for (a daemon thread each: a slow
store keeps them, never the run), a file is read only if it is a regular
file of the rootfs (found with ``openat2(RESOLVE_IN_ROOT)`` as ``O_PATH``,
checked, and only then reopened for reading, ``O_NONBLOCK``: a name a
container swaps for a device or a FIFO meanwhile is never opened), at most
``PROGRAMS_MAX`` programs and ``SCRIPT_MAX`` bytes of script are looked at,
and a word the parse does not understand (an expansion, a quote left open)
is skipped.
"""

from __future__ import annotations

import os
import posixpath
import shlex
import stat
import threading
from typing import Any

from ...safeopen import RESOLVE_IN_ROOT, RESOLVE_NO_MAGICLINKS, openat2
from .imagecommand import find_program

PROGRAMS_MAX = 16  # programs touched for one run
SCRIPT_MAX = 64 << 10  # bytes of a -c script parsed
PAGE = 4096
SHELLS = frozenset({"sh", "bash", "dash", "ash", "ksh", "zsh", "mksh", "busybox"})
# after these words the next one is a command's (shell keywords and command prefixes)
COMMAND_NEXT = frozenset({";", "&&", "||", "|", "&", "(", ")", "{", "}", "!", "then", "else",
                          "elif", "do", "if", "while", "until", "time", "exec", "command",
                          "nohup", "env", "xargs", "sudo", "timeout"})
# words that run no program of the image (builtins, the rest of compound commands)
NOT_PROGRAMS = frozenset({"fi", "done", "esac", "in", "case", "for", "function", "cd", "echo",
                          "export", "exit", "set", "unset", "true", "false", "test", "[", "[[",
                          "read", "eval", "source", ".", ":", "shift", "return", "local",
                          "printf", "wait", "trap", "umask", "alias", "type", "ulimit",
                          "break", "continue", "let", "declare", "readonly", "pwd"})


def touch_programs(config: dict[str, Any]) -> list[threading.Thread]:
    """The programs of ``config``'s command, each read (its first page) in a
    thread of its own, started now and not waited for: the threads."""
    process = config["process"]
    env = dict(item.partition("=")[::2] for item in process["env"])
    rootfs, path, cwd = config["root"]["path"], env.get("PATH", ""), process["cwd"]
    threads = []
    for program in programs_of(process["args"]):
        thread = threading.Thread(target=touch, args=(rootfs, program, path, cwd),
                                  name="program read-ahead", daemon=True)
        thread.start()
        threads.append(thread)
    return threads


def programs_of(args: list[str]) -> list[str]:
    """The programs a command execs first: its own, and for a shell's ``-c``
    script the first word of each command (at most ``PROGRAMS_MAX``)."""
    if not args:
        return []
    found = [args[0]]
    if posixpath.basename(args[0]) in SHELLS and len(args) > 2 and args[1].startswith("-") \
            and "c" in args[1][1:] and not args[1].startswith("--"):
        found += script_programs(args[2][:SCRIPT_MAX])
    return list(dict.fromkeys(found))[:PROGRAMS_MAX]


def script_programs(script: str) -> list[str]:
    """The first word of each command of a shell script, but builtins,
    keywords, assignments and words with expansions."""
    lexer = shlex.shlex(script.replace("\n", " ; "), posix=True, punctuation_chars=";&|()")
    lexer.whitespace_split = True
    found: list[str] = []
    starts = True
    try:
        for word in lexer:
            if starts and "=" in word and not word.startswith("="):
                continue  # an assignment before the command: its word comes next
            if starts and word not in COMMAND_NEXT and word not in NOT_PROGRAMS \
                    and not any(c in word for c in "$`*?~<>"):
                found.append(word)
                if len(found) >= PROGRAMS_MAX:
                    break
            starts = word in COMMAND_NEXT
    except ValueError:  # a quote left open: what came before it
        pass
    return found


def touch(rootfs: str, program: str, path: str, cwd: str) -> None:
    """Thread: the first page of ``program`` as the runtime would find it in
    ``rootfs``, read and dropped; nothing if it is not a regular file there."""
    try:
        rootfs_fd = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            full = find_program(rootfs_fd, program, path, cwd)
            if full is None:
                return
            where = openat2(rootfs_fd, full, os.O_PATH | os.O_CLOEXEC,
                            RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
            try:  # opened for reading only as the regular file it is (a name
                if stat.S_ISREG(os.fstat(where).st_mode):  # swapped since is not followed)
                    fd = os.open(f"/proc/self/fd/{where}", os.O_RDONLY | os.O_NONBLOCK
                                 | os.O_CLOEXEC)
                    try:
                        os.pread(fd, PAGE, 0)
                    finally:
                        os.close(fd)
            finally:
                os.close(where)
        finally:
            os.close(rootfs_fd)
    except OSError:
        pass  # a guess: the run finds out for itself
