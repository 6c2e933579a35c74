"""``layerfs run``: a command in a sandbox as an OCI container, a thin call of
:meth:`layerfs.node.Client.run` (its own module: its options name the runner's
runtimes and the bundle's network modes, which a ``ps`` need not import)."""

from __future__ import annotations

import click

from layerfs.node.containers import bundle, runner

from . import client_commands
from .node import root_option


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("sid", metavar="ID")
@click.argument("cmd", nargs=-1, type=click.UNPROCESSED)
@click.option("--runtime", "runtime_name", envvar="LAYERFS_RUNTIME", default=runner.DEFAULT_RUNTIME,
              show_default=True, type=click.Choice(runner.RUNTIMES),
              help="The OCI runtime, found on PATH [env: LAYERFS_RUNTIME].")
@click.option("--network", default="none", show_default=True,
              type=click.Choice(bundle.NETWORK_MODES),
              help="none: a new network namespace with only loopback; host: the node's.")
@click.option("--user", "user", metavar="USER[:GROUP]",
              help="Run as this user instead of the image's User (names from the image's "
                   "/etc/passwd and /etc/group, or numbers).")
@click.option("--entrypoint", metavar="PROG",
              help="Replace the image's Entrypoint (and its Cmd); '' for none.")
@click.option("--env", "env", metavar="KEY=VALUE", multiple=True,
              help="Set an environment variable over the image's Env (repeatable).")
@click.option("--cwd", metavar="DIR", help="Run in DIR (absolute) instead of the image's "
                                           "WorkingDir.")
@click.option("--timeout", metavar="SECONDS",
              help="Kill the container after SECONDS; the run then exits 124 (as timeout(1)).")
@root_option
def run(sid: str, cmd: tuple[str, ...], runtime_name: str, network: str, user: str | None,
        entrypoint: str | None, env: tuple[str, ...], cwd: str | None, timeout: str | None,
        root: str) -> None:
    """Run the env's image process, or CMD, in sandbox ID as a container (OCI runtime:
    pivot_root; new pid, mount, ipc, uts and network namespaces; Docker's default
    capabilities; no_new_privs); exit with its status. The image config applies as in
    Docker: CMD replaces its Cmd after its Entrypoint; no CMD runs Entrypoint + Cmd; User,
    Env and WorkingDir are the image's; SIGTERM sends its StopSignal. A missing program
    exits 127, one that is not executable 126.
    Use: layerfs run [OPTIONS] ID [-- CMD...]"""
    client_commands.run(sid, cmd, runtime_name, network, user, entrypoint, root, env=env,
                        cwd=cwd, timeout=timeout)
