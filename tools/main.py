"""The ``layerfs`` entry point: the command group and error reporting."""

from __future__ import annotations

import logging
import sys

import click

from layerfs import __version__
from layerfs.errors import LayerfsError

from . import disks, envs, exports, gc, images, layers, node
from .store import store as store_group


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="layerfs")
@click.option("--log-level", default="warning", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
def cli(log_level: str) -> None:
    """layerfs: EROFS layers in an object store, composed into versioned envs."""
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


cli.add_command(layers.build)
cli.add_command(layers.ls)
cli.add_command(layers.inspect)
cli.add_command(layers.verify)
cli.add_command(envs.env)
cli.add_command(images.import_cmd)
cli.add_command(gc.gc)
cli.add_command(exports.export)
cli.add_command(store_group)
for command in (node.daemon, node.up, node.down, node.ps, node.run, node.stats, node.trace,
                node.commit,
                disks.build_disk_cmd, disks.disk, disks.vm):
    cli.add_command(command)


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; every error a user can cause is one line and a nonzero exit."""
    try:
        cli.main(args=argv, prog_name="layerfs", standalone_mode=False)
    except LayerfsError as exc:
        click.echo(f"layerfs: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.Abort:
        click.echo("layerfs: aborted", err=True)
        sys.exit(130)
    except KeyboardInterrupt:
        click.echo("layerfs: interrupted", err=True)
        sys.exit(130)
    except OSError as exc:
        click.echo(f"layerfs: error: {exc}", err=True)
        sys.exit(1)
    sys.exit(0)


if __name__ == "__main__":
    main()
