"""Node commands: daemon, up, down, ps, run, stats, trace push, commit."""

from __future__ import annotations

import grp
import logging
import os
import resource
import sys
from typing import Any

import click

from layerfs.errors import UsageError
from layerfs.node import bundle, protocol, runner
from layerfs.node.control import call
from layerfs.node.daemon import DEFAULT_ROOT, Daemon, DaemonConfig
from layerfs.node.protocol import SandboxRecord
from layerfs.node.sandboxes import LAYER_ROLES

from .common import Output, human_bytes, parse_size


def root_option(fn):
    return click.option("--root", envvar="LAYERFS_ROOT", default=DEFAULT_ROOT,
                         show_default=True, help="The node's directory [env: LAYERFS_ROOT].")(fn)


def json_option(fn):
    return click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")(fn)


@click.command()
@root_option
@click.option("--store", "store_url", envvar="LAYERFS_STORE", metavar="URL",
              help="file:///path or s3://bucket/prefix [env: LAYERFS_STORE].")
@click.option("--s3-endpoint", envvar="AWS_ENDPOINT_URL", metavar="URL")
@click.option("--cache-size", default="20G", show_default=True,
              help="Bound of the chunk cache under ROOT/cache.")
@click.option("--read-timeout", default=30.0, show_default=True,
              help="Seconds after which a read the store cannot serve fails with EIO.")
@click.option("--readahead", default="4M", show_default=True,
              help="Kernel readahead window of the FUSE blob and disk files.")
@click.option("--layer-readahead", default="1M", show_default=True,
              help="Kernel readahead window of the EROFS layer mounts.")
@click.option("--miss-span", default="0", show_default=True,
              help="A read that misses a smaller chunk fetches it together with the chunks "
                   "after it in its pack, up to this many bytes in all (0: alone).")
@click.option("--fuse-group", metavar="GROUP",
              help="A group (name or gid) whose members may open the files under ROOT/fuse "
                   "and the meta images, e.g. a VMM's user (default: root only).")
@click.option("--takeover", is_flag=True,
              help="Replace the daemon running on ROOT (an upgrade): it exits without "
                   "unmounting anything and this one serves its FUSE connection and sandboxes.")
@click.option("--live-restart/--no-live-restart", default=True, show_default=True,
              help="Keep the FUSE connection in a keeper process, so that a restart (crash or "
                   "--takeover) keeps every sandbox mounted and every read answered.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
def daemon(root: str, store_url: str | None, s3_endpoint: str | None, cache_size: str,
           read_timeout: float, readahead: str, layer_readahead: str, miss_span: str,
           fuse_group: str | None, takeover: bool, live_restart: bool,
           log_level: str) -> None:
    """Run the node daemon in the foreground (logs to stderr)."""
    logging.getLogger().setLevel(log_level.upper())
    if os.geteuid() != 0:
        raise UsageError("the daemon needs root (FUSE, EROFS and overlayfs mounts)")
    cfg = DaemonConfig(root=root, store_url=store_url, s3_endpoint=s3_endpoint,
                       cache_size=parse_size(cache_size), read_timeout=read_timeout,
                       readahead=parse_size(readahead),
                       layer_readahead=parse_size(layer_readahead),
                       miss_span=parse_size(miss_span),
                       fuse_group=group_id(fuse_group) if fuse_group else None,
                       takeover=takeover, live_restart=live_restart)
    Daemon(cfg).run()


def group_id(group: str) -> int:
    """A group name or number → its gid; an unknown group is a usage error."""
    try:
        return grp.getgrgid(int(group)).gr_gid if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError:
        raise UsageError(f"--fuse-group: no such group {group!r}") from None


@click.command()
@click.argument("env_ref", required=False)
@click.option("--layer", "layers", multiple=True, metavar="REF",
              help="Layers instead of an env, top first (repeatable).")
@click.option("--id", "sid", required=True, help="Sandbox id.")
@click.option("--prefetch", type=click.Choice(["none", "full", "trace"]), default="none",
              show_default=True, help="none: lazy; full: fetch everything first; "
                                      "trace: replay recorded access order in the background.")
@click.option("--bundle", "bundle_dir", metavar="DIR",
              help="Also write an OCI runtime bundle for the sandbox: DIR/config.json runs "
                   "the image's Entrypoint + Cmd as its User, with its Env and WorkingDir "
                   "(`runc run -b DIR ID`).")
@root_option
@json_option
def up(env_ref: str | None, layers: tuple[str, ...], sid: str, prefetch: str,
       bundle_dir: str | None, root: str, as_json: bool) -> None:
    """Bring up sandbox ID from ENV_REF (or --layer refs); print its rootfs path."""
    if bool(env_ref) == bool(layers):
        raise UsageError("give ENV_REF or --layer refs (not both)")
    record = call(root, protocol.Up(id=sid, env=env_ref, layers=list(layers),
                                    prefetch=prefetch), protocol.SandboxAnswer).sandbox
    doc = record.to_json()
    if bundle_dir:
        try:
            config, _ = container_config(record, network="none")
            doc["bundle"] = bundle.write_bundle(os.path.abspath(bundle_dir), config,
                                                private=False)
        except BaseException:  # no sandbox without the bundle asked for
            call(root, protocol.Down(id=sid), protocol.SandboxAnswer)
            raise
    Output(as_json).emit(doc, record.rootfs)


def container_config(record: SandboxRecord, network: str, command: tuple[str, ...] = (),
                     entrypoint: str | None = None, user: str | None = None,
                     terminal: bool = False) -> tuple[dict[str, Any], int]:
    """The config.json of a sandbox's container from its record (the env's image
    config), and the signal that stops it."""
    image = bundle.image_config_from(record.config)
    hostname = record.id[:63]
    process = bundle.image_process(record.rootfs, image, hostname, command=command,
                                   entrypoint=entrypoint, user=user,
                                   term=os.environ.get("TERM"), terminal=terminal)
    config = bundle.runtime_config(record.rootfs, process, hostname=hostname,
                                   network=network,
                                   nofile=resource.getrlimit(resource.RLIMIT_NOFILE),
                                   annotations=bundle.image_annotations(image))
    return config, bundle.stop_signal(image)


@click.command()
@click.argument("sid", metavar="ID")
@click.option("--keep-upper", is_flag=True, help="Keep the sandbox's upper directory.")
@root_option
@json_option
def down(sid: str, keep_upper: bool, root: str, as_json: bool) -> None:
    """Take sandbox ID down and unmount what only it used."""
    res = call(root, protocol.Down(id=sid, keep_upper=keep_upper), protocol.SandboxAnswer)
    Output(as_json).emit(res.sandbox.to_json(), f"{sid} down")


@click.command()
@click.argument("sid", metavar="ID")
@click.option("--name", required=True, help="Name of the new layer.")
@click.option("--version", required=True, help="Version of the new layer.")
@click.option("--role", default="workspace", show_default=True,
              type=click.Choice(LAYER_ROLES))
@root_option
@json_option
def commit(sid: str, name: str, version: str, role: str, root: str, as_json: bool) -> None:
    """Commit sandbox ID's changes (its overlay upper directory, whiteouts and opaque
    directories included) as layer NAME@VERSION, chunks shared with the sandbox's
    layers. The sandbox stays up; see docs/node.md for what a running one gets."""
    res = call(root, protocol.Commit(id=sid, name=name, version=version, role=role),
               protocol.CommitAnswer)
    state = "" if res.published else "  (unchanged: already published)"
    Output(as_json).emit(res.to_json(), f"{res.ref} {res.digest}{state}")


@click.command()
@root_option
@json_option
def ps(root: str, as_json: bool) -> None:
    """List sandboxes: state, layers, upper size, bytes read from their layers."""
    rows = call(root, protocol.Ps(), protocol.PsAnswer).sandboxes

    def text() -> str:
        lines = [f"{'ID':20} {'STATE':8} {'UPPER':>10} {'READ':>10}  LAYERS"]
        for r in rows:
            refs = r.env or " ".join(r.layer_refs)
            lines.append(f"{r.id:20} {r.state:8} {human_bytes(r.upper_bytes):>10} "
                         f"{human_bytes(r.layer_bytes_read):>10}  {refs}")
        return "\n".join(lines)

    Output(as_json).emit([r.to_json() for r in rows], text)


@click.command()
@root_option
@json_option
def stats(root: str, as_json: bool) -> None:
    """Cache statistics and per-layer bytes read."""
    res = call(root, protocol.Stats(), protocol.StatsAnswer)
    c = res.cache

    def text() -> str:
        lines = [f"cache: {human_bytes(c['size'])} of {human_bytes(c['limit'])} in "
                 f"{c['entries']} chunks; hits {c['hits']}, misses {c['misses']}, fetched "
                 f"{human_bytes(c['bytes_fetched'])}, written {human_bytes(c['bytes_written'])}"
                 f", evictions {c['evictions']}, corrupt {c['corrupt']}"]
        for digest, layer in res.layers.items():
            lines.append(f"layer {digest[:19]}: read {human_bytes(layer.bytes_read)} of "
                         f"{human_bytes(layer.blob_bytes)}, chunks {layer.chunks_touched}"
                         f"/{layer.chunks}, used by {layer.users}")
        return "\n".join(lines)

    Output(as_json).emit(res.to_json(), text)


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
@root_option
def run(sid: str, cmd: tuple[str, ...], runtime_name: str, network: str, user: str | None,
        entrypoint: str | None, root: str) -> None:
    """Run the env's image process, or CMD, in sandbox ID as a container (OCI runtime:
    pivot_root; new pid, mount, ipc, uts and network namespaces; Docker's default
    capabilities; no_new_privs); exit with its status. The image config applies as in
    Docker: CMD replaces its Cmd after its Entrypoint; no CMD runs Entrypoint + Cmd; User,
    Env and WorkingDir are the image's; SIGTERM sends its StopSignal.
    Use: layerfs run [OPTIONS] ID [-- CMD...]"""
    rows = call(root, protocol.Ps(), protocol.PsAnswer).sandboxes
    match = [r for r in rows if r.id == sid]
    if not match or match[0].state != "up":
        raise UsageError(f"sandbox {sid} is not up")
    config, stop = container_config(match[0], network, command=cmd, entrypoint=entrypoint,
                                    user=user, terminal=sys.stdin.isatty())
    container = runner.prepare(root, runtime_name, sid, stop_signal=stop)
    sys.exit(runner.run(container, config))


@click.group()
def trace() -> None:
    """Access traces: the order in which sandboxes first touched a layer's chunks."""


@trace.command("push")
@click.argument("ref")
@root_option
@json_option
def trace_push(ref: str, root: str, as_json: bool) -> None:
    """Store this node's trace of layer REF beside it, for other nodes' --prefetch trace."""
    res = call(root, protocol.TracePush(ref=ref), protocol.TracePushAnswer)
    Output(as_json).emit(res.to_json(), f"{ref}: trace of {res.chunks} chunks stored")
