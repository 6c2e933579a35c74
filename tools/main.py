"""The ``layerfs`` entry point: the command line and error reporting.

A node client command (``up``, ``down``, ``ps``, ``stats``, ``run``) in its
plain form is parsed by :mod:`.fastpath` without importing click (a node
command starts in a few tens of ms); everything else, ``--help`` and any
argument the fast path does not take for certain, goes to the click group of
:mod:`.group`, which parses it as always."""

from __future__ import annotations

import sys

from layerfs.errors import LayerfsError

from . import fastpath
from .common import diagnostic


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; every error a user can cause is one line (of at most
    :data:`~layerfs.bounds.MAX_ERROR_LINE` characters) and a nonzero exit."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        if not fastpath.run(args):
            run_click(args)
    except LayerfsError as exc:
        print(diagnostic("error", exc), file=sys.stderr)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        print("layerfs: interrupted", file=sys.stderr)
        sys.exit(130)
    except OSError as exc:
        print(diagnostic("error", exc), file=sys.stderr)
        sys.exit(1)
    sys.exit(0)


def run_click(args: list[str]) -> None:
    """Parse and run ``args`` with the click group (its usage errors and aborts
    reported as click does)."""
    import click

    from .group import cli

    try:
        cli.main(args=args, prog_name="layerfs", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        from layerfs.bounds import MAX_ERROR_LINE, cut

        # (the message may quote an argument whole; click declares it Final, for its own use)
        exc.message = cut(exc.message, MAX_ERROR_LINE)  # type: ignore[misc]
        exc.show()
        sys.exit(exc.exit_code)
    except click.Abort:
        click.echo("layerfs: aborted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
