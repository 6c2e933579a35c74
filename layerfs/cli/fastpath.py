"""The node client commands without click: ``up``, ``down``, ``ps``, ``stats``
and ``run`` parsed by hand in their plain form, so that one starts in a few
tens of ms (importing click costs more than the rest of the client).

The parse is deliberately narrow: the command first, then only the options
:mod:`.node` and :mod:`.run` declare (``--opt VALUE``, ``--opt=VALUE``,
flags), choices checked, required ones present, and for ``run`` the command
only after ``--``. Anything else (``--help``, ``--log-level`` before the
command, an unknown or misspelt option, a value that looks like an option, a
missing argument) is not an error here: :func:`run` answers False and the
click group parses the same arguments, so help texts, usage errors and every
edge of click's parsing stay click's own.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from layerfs.node.control import DEFAULT_ROOT

TYPE_CHECKING = False  # (typing is not imported at run time)
if TYPE_CHECKING:
    from typing import Any

PREFETCH_MODES = ("auto", "none", "full", "trace")  # up --prefetch (layerfs/cli/node.py too)


class Option:
    """One ``--name``: a flag, a value, or a repeatable value, stored as ``dest``."""

    def __init__(self, dest: str, kind: str = "value", default: Any = None,
                 choices: Sequence[str] = (), envvar: str | None = None) -> None:
        self.dest, self.kind, self.default = dest, kind, default
        self.choices, self.envvar = tuple(choices), envvar


class Command:
    """A client command's options and positional arguments (``?``: optional)."""

    def __init__(self, options: dict[str, Option], positionals: Sequence[str] = (),
                 required: Sequence[str] = (), command_after: bool = False) -> None:
        self.options = {"--root": Option("root", default=DEFAULT_ROOT, envvar="LAYERFS_ROOT"),
                        **options}
        self.positionals, self.required = tuple(positionals), tuple(required)
        self.command_after = command_after  # run: ID [-- CMD...]


JSON = {"--json": Option("as_json", "flag", default=False)}


def up_command() -> Command:
    return Command({"--layer": Option("layers", "multiple", default=()), "--id": Option("sid"),
                    "--prefetch": Option("prefetch", default="auto", choices=PREFETCH_MODES),
                    "--bundle": Option("bundle_dir"), "--memory": Option("memory"),
                    "--cpus": Option("cpus"), "--pids": Option("pids"),
                    "--disk-quota": Option("disk_quota"), **JSON},
                   positionals=("env_ref?",), required=("sid",))


def down_command() -> Command:
    return Command({"--keep-upper": Option("keep_upper", "flag", default=False),
                    "--force": Option("force", "flag", default=False), **JSON},
                   positionals=("sid",))


def listing_command() -> Command:  # ps, stats
    return Command(dict(JSON))


def run_command() -> Command:
    """(Its choices are the runner's and the bundle's, imported only for ``run``.)"""
    from layerfs.node.containers import bundle, runner

    return Command({"--runtime": Option("runtime_name", default=runner.DEFAULT_RUNTIME,
                                        choices=runner.RUNTIMES, envvar="LAYERFS_RUNTIME"),
                    "--network": Option("network", default="none", choices=bundle.NETWORK_MODES),
                    "--user": Option("user"), "--entrypoint": Option("entrypoint"),
                    "--env": Option("env", "multiple", default=()), "--cwd": Option("cwd"),
                    "--timeout": Option("timeout")},
                   positionals=("sid",), command_after=True)


def parse(spec: Command, args: Sequence[str]) -> dict[str, Any] | None:
    """``args`` (after the command's name) as the command's keyword arguments,
    or None if this parse does not take them for certain."""
    values: dict[str, Any] = {}
    positionals: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            if not (spec.command_after and positionals):
                return None
            rest = list(args[i + 1:])
            break
        if spec.command_after and positionals and not arg.startswith("-"):
            return None  # run ID CMD without "--": click's interspersed parse
        if arg.startswith("-"):
            name, eq, value = arg.partition("=")
            option = spec.options.get(name)
            if option is None or (option.kind == "flag" and eq):
                return None
            if option.kind == "flag":
                values[option.dest] = True
            else:
                if not eq:
                    i += 1
                    if i == len(args):
                        return None
                    value = args[i]
                if value.startswith("-") or (option.choices and value not in option.choices):
                    return None
                if option.kind == "multiple":
                    values[option.dest] = (*values.get(option.dest, ()), value)
                elif option.dest in values:
                    return None  # given twice: which one counts is click's to say
                else:
                    values[option.dest] = value
        else:
            positionals.append(arg)
        i += 1
    return complete(spec, values, positionals, rest)


def complete(spec: Command, values: dict[str, Any], positionals: list[str],
             rest: list[str]) -> dict[str, Any] | None:
    """``values`` with the positionals, defaults and environment filled in; None
    if one is missing or the environment's value is not certain."""
    names = [p.rstrip("?") for p in spec.positionals]
    needed = sum(not p.endswith("?") for p in spec.positionals)
    if not needed <= len(positionals) <= len(names):
        return None
    values.update(zip(names, positionals + [None] * (len(names) - len(positionals)),
                      strict=True))
    for option in spec.options.values():
        if option.dest in values:
            continue
        from_env = os.environ.get(option.envvar) if option.envvar else None
        if from_env is not None:
            if not from_env or (option.choices and from_env not in option.choices):
                return None  # what click makes of it is click's to say
            values[option.dest] = from_env
        else:
            values[option.dest] = option.default
    if any(values.get(name) is None for name in spec.required):
        return None
    if spec.command_after:
        values["cmd"] = tuple(rest)
    return values


COMMANDS: dict[str, Callable[[], Command]] = {
    "up": up_command, "down": down_command, "ps": listing_command, "stats": listing_command,
    "run": run_command}


def run(argv: Sequence[str]) -> bool:
    """Run ``argv`` if it is a node client command this parse takes; False if
    it is anything else (for the click group)."""
    if not argv or argv[0] not in COMMANDS:
        return False
    values = parse(COMMANDS[argv[0]](), argv[1:])
    if values is None:
        return False
    from . import client_commands

    handler: Callable[..., None] = getattr(client_commands, argv[0])
    handler(**values)
    return True
