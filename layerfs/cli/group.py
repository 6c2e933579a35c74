"""The ``layerfs`` click command group: every command, its options and ``--help``.

Each command's module is imported only when that command runs (``--help``
imports them all), so a node command does not pay for the builder's, the
store's or the daemon's imports: see tests/test_client.py. The node client
commands usually skip click altogether (:mod:`.fastpath`)."""

from __future__ import annotations

import importlib
import sys

import click

from layerfs import __version__

# command name -> "module:attribute" under layerfs.cli
COMMANDS = {
    "build": "layers:build", "ls": "layers:ls", "inspect": "layers:inspect",
    "verify": "layers:verify", "rm": "layers:rm", "env": "envs:env", "import": "images:import_cmd",
    "gc": "gc:gc", "export": "exports:export", "store": "store:store",
    "revoke": "revoke:revoke", "unrevoke": "revoke:unrevoke",
    "daemon": "node:daemon", "up": "node:up", "down": "node:down", "ps": "node:ps",
    "run": "run:run", "stats": "node:stats", "trace": "node:trace", "commit": "node:commit",
    "suspend": "node:suspend", "resume": "node:resume",
    "build-disk": "disks:build_disk_cmd", "disk": "disks:disk", "vm": "disks:vm",
}
# Commands that only talk to the daemon and log nothing themselves (its answers
# carry its messages): they skip importing and configuring logging. A record
# one of them logged anyway still reaches stderr (logging's last resort).
CLIENT_COMMANDS = frozenset({"up", "down", "ps", "run", "stats", "trace", "commit", "suspend",
                             "resume"})


class LazyGroup(click.Group):
    """A group whose commands are imported from :data:`COMMANDS` when used."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*COMMANDS, *self.commands})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            module, _, attr = COMMANDS[cmd_name].partition(":")
            command = getattr(importlib.import_module(f"layerfs.cli.{module}"), attr)
            self.add_command(command, cmd_name)
        return self.commands.get(cmd_name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="layerfs")
@click.option("--log-level", default="warning", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
@click.pass_context
def cli(ctx: click.Context, log_level: str) -> None:
    """layerfs: EROFS layers in an object store, composed into versioned envs."""
    if ctx.invoked_subcommand in CLIENT_COMMANDS:
        return
    import logging

    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
