"""The ``layerfs`` entry point: the command line and error reporting.

An error is one line on stderr and its exit code; with ``--json`` among the
arguments (before any ``--``) it is also one JSON document on stdout,
``{"error": LINE, "exit": CODE, "kind": KIND}`` (:func:`.common.json_error`),
unless the command already printed its JSON document there.

A node client command (``up``, ``down``, ``ps``, ``stats``, ``run``) in its
plain form is parsed by :mod:`.fastpath` without importing click (a node
command starts in a few tens of ms); everything else, ``--help`` and any
argument the fast path does not take for certain, goes to the click group of
:mod:`.group`, which parses it as always."""

from __future__ import annotations

import sys

from layerfs.errors import LayerfsError

from .common import diagnostic, json_error, json_requested

TYPE_CHECKING = False  # (typing is not imported at run time: a node command starts faster)
if TYPE_CHECKING:
    from typing import NoReturn

    import click

NODE_CLIENT_COMMANDS = ("up", "down", "ps", "stats", "run")  # the ones :mod:`.fastpath` parses


def run_fast(args: list[str]) -> bool:
    """Run ``args`` through :mod:`.fastpath` if it is a node client command
    that parse takes; False otherwise (the fast path is not even imported)."""
    if not args or args[0] not in NODE_CLIENT_COMMANDS:
        return False
    from . import fastpath

    return fastpath.run(args)


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; every error a user can cause is one line (of at most
    :data:`~layerfs.bounds.MAX_ERROR_LINE` characters) and a nonzero exit."""
    args = sys.argv[1:] if argv is None else list(argv)
    as_json = json_requested(args)
    try:
        if not run_fast(args):
            run_click(args, as_json)
    except LayerfsError as exc:
        fail(exc, exc.exit_code, exc.kind, as_json)
    except KeyboardInterrupt:
        fail("interrupted", 130, "Interrupted", as_json, line="layerfs: interrupted")
    except OSError as exc:
        fail(exc, 1, type(exc).__name__, as_json)
    sys.exit(0)


def fail(error: object, exit_code: int, kind: str, as_json: bool,
         line: str | None = None) -> NoReturn:
    """Report an error (with ``as_json`` also as JSON on stdout) and exit with its code."""
    if as_json:
        json_error(error, exit_code, kind)
    print(line or diagnostic("error", error), file=sys.stderr)
    sys.exit(exit_code)


def run_click(args: list[str], as_json: bool = False) -> None:
    """Parse and run ``args`` with the click group (its usage errors and aborts
    reported as click does; with ``as_json`` also as JSON)."""
    import click

    from .group import cli

    try:
        cli.main(args=args, prog_name="layerfs", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        from layerfs.bounds import MAX_ERROR_LINE, cut

        # (the message may quote an argument whole; click declares it Final, for its own use)
        exc.message = cut(with_hint(exc, args), MAX_ERROR_LINE)  # type: ignore[misc]
        if as_json:
            kind = "UsageError" if isinstance(exc, click.UsageError) else type(exc).__name__
            json_error(exc.format_message(), exc.exit_code, kind)
        exc.show()
        sys.exit(exc.exit_code)
    except click.Abort:
        fail("aborted", 130, "Aborted", as_json, line="layerfs: aborted")


def with_hint(exc: click.ClickException, args: list[str]) -> str:
    """Click's message, and the hint for a slip it stems from (:mod:`.hints`)."""
    import click

    from .hints import EXTRA_ARGUMENTS, repeat_hint

    if isinstance(exc, click.UsageError) and EXTRA_ARGUMENTS in exc.message:
        hint = repeat_hint(args, exc.ctx.command if exc.ctx is not None else None)
        if hint is not None:
            return f"{exc.message}; {hint}"
    return exc.message


if __name__ == "__main__":
    main()
