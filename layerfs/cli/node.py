"""Node commands: daemon, up, down, ps, stats, trace push, commit, suspend, resume (``run`` is in
:mod:`.run`): their click options and help. Each client command is a thin call
of :class:`layerfs.node.Client`, its body in :mod:`.client_commands` (which
:mod:`.fastpath` runs without click for the plain forms); this module imports
neither the daemon (imported by ``daemon`` when it runs) nor trio, pyfuse3,
lmdb or boto3 (tests/test_client.py checks it)."""

from __future__ import annotations

import functools
import grp
import os
from collections.abc import Callable
from typing import Any

import click

from layerfs.errors import LayerfsError, UsageError
from layerfs.node.client import Client
from layerfs.node.control import DEFAULT_ROOT
from layerfs.node.protocol import LAYER_ROLES, utc_time

from . import client_commands
from .common import Output, check_store_url, parse_size
from .fastpath import PREFETCH_MODES


def root_option(fn):
    return click.option("--root", envvar="LAYERFS_ROOT", default=DEFAULT_ROOT,
                         show_default=True, help="The node's directory [env: LAYERFS_ROOT].")(fn)


def json_option(fn):
    return click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")(fn)


def failure_status(command: Callable[..., None]) -> Callable[..., None]:
    """The daemon's command, its layerfs errors also sent to systemd as
    STATUS= (:func:`layerfs.node.daemon.systemd.report_failure`)."""
    @functools.wraps(command)
    def reporting(*args: Any, **kwargs: Any) -> None:
        try:
            command(*args, **kwargs)
        except LayerfsError as exc:
            from layerfs.node.daemon.systemd import report_failure

            report_failure(exc)
            raise
    return reporting


@click.command()
@root_option
@click.option("--store", "store_url", envvar="LAYERFS_STORE", metavar="URL",
              help="file:///path or s3://bucket/prefix [env: LAYERFS_STORE].")
@click.option("--s3-endpoint", envvar="AWS_ENDPOINT_URL", metavar="URL")
@click.option("--cache-size", default="20G", show_default=True,
              help="Bound of the chunk cache under ROOT/cache.")
@click.option("--reserve", default="auto", show_default=True, metavar="SIZE",
              help="Room on ROOT's file system the cache leaves to everything else (the "
                   "sandboxes' upper directories, meta images, the replica); the cache's "
                   "bound is lowered at start to fit. auto: 5% of the file system, "
                   "16 MiB to 1 GiB. A quarter of it (4 to 64 MiB) is held for the "
                   "daemon's own state, so `down` works on a full disk.")
@click.option("--cache-form", type=click.Choice(["stored", "plain"]), default="stored",
              show_default=True,
              help="How the cache keeps a chunk the store holds compressed: as that zstd "
                   "frame (fewer bytes written; each read from the cache decompresses it) "
                   "or decompressed.")
@click.option("--read-timeout", default=30.0, show_default=True,
              help="Seconds after which a read the store cannot serve fails with EIO.")
@click.option("--store-wait", default=2.0, show_default=True, metavar="SECONDS",
              help="How long an up waits for the store before it uses the node's last "
                   "resolution (or, for a ref never resolved here, fails with exit 8).")
@click.option("--lease-ttl", default=600.0, show_default=True, metavar="SECONDS",
              help="How long the node's lease in the store (the layers its sandboxes and "
                   "vms use, which gc keeps) outlives its last renewal; renewed every "
                   "fifth of it.")
@click.option("--readahead", default="4M", show_default=True,
              help="Kernel readahead window of the FUSE blob and disk files.")
@click.option("--layer-readahead", default="1M", show_default=True,
              help="Kernel readahead window of the EROFS layer mounts.")
@click.option("--miss-span", default="0", show_default=True,
              help="A read that misses a smaller chunk fetches it together with the chunks "
                   "after it in its pack, up to this many bytes in all (0: alone).")
@click.option("--library-ahead/--no-library-ahead", default=True, show_default=True,
              help="A read that misses the start of a program or library (an ELF file) "
                   "fetches the libraries it names, and theirs, before the loader asks.")
@click.option("--fetch-whole-below", default="32M", show_default=True, metavar="SIZE",
              help="A layer whose data is at most SIZE is fetched whole when it is first "
                   "mounted on the node (a few large store reads) into a local file the "
                   "kernel reads directly; larger layers are read lazily (0: none).")
@click.option("--local-blobs", default="4G", show_default=True, metavar="SIZE",
              help="Bound of the whole-layer files under ROOT/blobs: files of layers no "
                   "sandbox uses are deleted, oldest use first, beyond it.")
@click.option("--kernel-reads/--no-kernel-reads", default=False, show_default=True,
              help="Mount larger layers over partial local files the daemon fills as they "
                   "are read, so that what the node holds is read by the kernel alone "
                   "(fanotify pre-content events, Linux 6.14+, needs live restart); "
                   "otherwise, and where the kernel has none, over FUSE files.")
@click.option("--store-fetches", default=16, show_default=True,
              help="Store reads (a chunk or a run of chunks each) the daemon has in flight "
                   "at once.")
@click.option("--fuse-group", metavar="GROUP",
              help="A group (name or gid) whose members may open the files under ROOT/fuse "
                   "and the meta images, e.g. a VMM's user (default: root only).")
@click.option("--takeover", is_flag=True,
              help="Replace the daemon running on ROOT (an upgrade): it exits without "
                   "unmounting anything and this one serves its FUSE connection and sandboxes.")
@click.option("--live-restart/--no-live-restart", default=True, show_default=True,
              help="Keep the FUSE connection in a keeper process, so that a restart (crash or "
                   "--takeover) keeps every sandbox mounted and every read answered.")
@click.option("--restart-grace", default=60.0, show_default=True, metavar="SECONDS",
              help="With live restart: how long the keeper holds the FUSE connection for a "
                   "next daemon once this one is gone; then it lets go, and reads waiting on "
                   "the node's sandboxes fail instead of waiting.")
@click.option("--forget-after", metavar="DURATION",
              help="Drop a layer's cache files, meta image and replica entries once no "
                   "sandbox used it for DURATION (90s, 12h, 7d; nothing while a vm is up); "
                   "by default layers stay until evicted.")
@click.option("--metrics", metavar="HOST:PORT",
              help="Serve Prometheus metrics at http://HOST:PORT/metrics (default: off).")
@click.option("--containerd-snapshotter", metavar="PATH",
              help="Serve containerd's snapshots API on the unix socket PATH (a proxy "
                   "snapshotter: docs/containerd.md); images layerfs imported start lazily.")
@click.option("--containerd-prefetch", type=click.Choice(["auto", "none"]), default="auto",
              show_default=True,
              help="auto: a lazy containerd snapshot replays its layers' pushed traces (as "
                   "`up --prefetch auto`); none: it is read on demand only.")
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text",
              show_default=True, help="json: one JSON object per log line.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
@failure_status
def daemon(root: str, store_url: str | None, s3_endpoint: str | None, cache_size: str,
           reserve: str, cache_form: str, read_timeout: float, store_wait: float,
           lease_ttl: float, readahead: str, layer_readahead: str,
           miss_span: str, library_ahead: bool, fetch_whole_below: str, local_blobs: str,
           kernel_reads: bool, store_fetches: int,
           fuse_group: str | None, takeover: bool,
           live_restart: bool, restart_grace: float, forget_after: str | None,
           metrics: str | None, containerd_snapshotter: str | None, containerd_prefetch: str,
           log_format: str, log_level: str) -> None:
    """Run the node daemon in the foreground (logs to stderr)."""
    import logging

    from layerfs.node.daemon.metrics import parse_address
    from layerfs.node.daemon.service import Daemon, DaemonConfig
    from layerfs.retention import parse_duration

    logging.getLogger().setLevel(log_level.upper())
    if log_format == "json":
        from layerfs.node.daemon.jsonlog import log_json

        log_json()
    if store_url == "":  # the unit's --store=${LAYERFS_STORE}, the variable unset
        raise UsageError("no store: --store is empty (set LAYERFS_STORE, file:///path or "
                         "s3://bucket/prefix, in the daemon's environment file)")
    if store_fetches < 1:
        raise UsageError(f"--store-fetches {store_fetches}: at least 1")
    if not 0 <= restart_grace <= 86400:
        raise UsageError(f"--restart-grace {restart_grace:g}: between 0 and 86400 seconds")
    if not 0 < store_wait <= 600:
        raise UsageError(f"--store-wait {store_wait:g}: between 0 and 600 seconds")
    if not 5 <= lease_ttl <= 7 * 86400:
        raise UsageError(f"--lease-ttl {lease_ttl:g}: between 5 seconds and 7 days")
    if os.geteuid() != 0:
        raise UsageError("the daemon needs root (FUSE, EROFS and overlayfs mounts)")
    check_store_url(store_url)
    cfg = DaemonConfig(root=root, store_url=store_url, s3_endpoint=s3_endpoint,
                       cache_size=parse_size(cache_size), cache_form=cache_form,
                       read_timeout=read_timeout, store_wait=store_wait, lease_ttl=lease_ttl,
                       readahead=parse_size(readahead),
                       layer_readahead=parse_size(layer_readahead),
                       miss_span=parse_size(miss_span), library_ahead=library_ahead,
                       fetch_parallel=store_fetches,
                       fetch_whole_below=parse_size(fetch_whole_below),
                       local_blobs=parse_size(local_blobs), kernel_reads=kernel_reads,
                       fuse_group=group_id(fuse_group) if fuse_group else None,
                       takeover=takeover, live_restart=live_restart,
                       restart_grace=restart_grace,
                       forget_after=parse_duration(forget_after) if forget_after else None,
                       metrics=parse_address(metrics) if metrics else None,
                       reserve=None if reserve == "auto" else parse_size(reserve),
                       containerd_snapshotter=containerd_snapshotter,
                       containerd_prefetch=containerd_prefetch)
    Daemon.start(cfg).run()


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
@click.option("--prefetch", type=click.Choice(PREFETCH_MODES),
              default="auto", show_default=True,
              help="auto: replay a layer's pushed access trace in the background, if it has "
                   "one; none: lazy only; full: fetch everything first; trace: replay this "
                   "node's and the pushed trace.")
@click.option("--bundle", "bundle_dir", metavar="DIR",
              help="Also write an OCI runtime bundle for the sandbox: DIR/config.json runs "
                   "the image's Entrypoint + Cmd as its User, with its Env and WorkingDir "
                   "(`runc run -b DIR ID`).")
@click.option("--memory", metavar="SIZE",
              help="Memory limit of its containers (swap included), e.g. 512M.")
@click.option("--cpus", metavar="N", help="CPU time limit of its containers, e.g. 0.5.")
@click.option("--pids", metavar="N", help="Process (and thread) limit of its containers.")
@click.option("--disk-quota", metavar="SIZE",
              help="Bytes its writable layer may hold, e.g. 10G (a btrfs qgroup or an ext4 image).")
@root_option
@json_option
def up(env_ref: str | None, layers: tuple[str, ...], sid: str, prefetch: str,
       bundle_dir: str | None, memory: str | None, cpus: str | None, pids: str | None,
       disk_quota: str | None, root: str, as_json: bool) -> None:
    """Bring up sandbox ID from ENV_REF (or --layer refs); print its rootfs path.
    A limit the node cannot enforce is refused (exit 17)."""
    client_commands.up(env_ref, layers, sid, prefetch, bundle_dir, root, as_json,
                       memory=memory, cpus=cpus, pids=pids, disk_quota=disk_quota)


@click.command()
@click.argument("sid", metavar="ID")
@click.option("--keep-upper", is_flag=True, help="Keep the sandbox's upper directory.")
@click.option("--force", is_flag=True,
              help="Kill the `layerfs run` containers running in the sandbox first "
                   "(without it, such a sandbox is refused).")
@root_option
@json_option
def down(sid: str, keep_upper: bool, force: bool, root: str, as_json: bool) -> None:
    """Take sandbox ID down and unmount what only it used."""
    client_commands.down(sid, keep_upper, force, root, as_json)


@click.command()
@click.argument("sid", metavar="ID")
@click.option("--name", required=True, help="Name of the new layer.")
@click.option("--version", required=True, help="Version of the new layer.")
@click.option("--role", default="workspace", show_default=True,
              type=click.Choice(LAYER_ROLES))
@click.option("--expire", metavar="DURATION",
              help="The layer's ref expires after DURATION (90s, 15m, 12h, 7d, 2w): the "
                   "first gc after that removes it (unless an env names it).")
@root_option
@json_option
def commit(sid: str, name: str, version: str, role: str, expire: str | None, root: str,
           as_json: bool) -> None:
    """Commit sandbox ID's changes (its overlay upper directory, whiteouts and opaque
    directories included) as layer NAME@VERSION, chunks shared with the sandbox's
    layers. The sandbox stays up; see docs/dev/node.md for what a running one gets."""
    seconds = None
    if expire is not None:
        from layerfs.retention import parse_duration  # (only then: a client command)
        seconds = parse_duration(expire)
    res = Client(root).commit(sid, name, version, role=role, expire=seconds)
    state = "" if res.published else "  (unchanged: already published)"
    if res.expires is not None:
        state += f"  (expires {utc_time(res.expires)})"
    Output(as_json).emit(res.to_json(), f"{res.ref} {res.digest}{state}")


@click.command()
@click.argument("sid", metavar="ID")
@click.option("--name", required=True, help="Name of the snapshot (a layer and an env).")
@click.option("--version", required=True, help="Its version (must not exist).")
@root_option
@json_option
def suspend(sid: str, name: str, version: str, root: str, as_json: bool) -> None:
    """Suspend sandbox ID into the store: its `layerfs run` containers frozen
    (cgroup freezer) while its upper is committed as layer NAME@VERSION and env
    NAME@VERSION (that layer over the sandbox's) is pushed; then the sandbox
    ends. `layerfs resume NAME@VERSION` brings it up on any node."""
    res = Client(root).suspend(sid, name, version)
    Output(as_json).emit(res.to_json(), f"{sid} suspended as {res.ref} {res.digest}")


@click.command()
@click.argument("ref", metavar="REF")
@click.option("--id", "sid", required=True, help="Sandbox id.")
@click.option("--prefetch", type=click.Choice(PREFETCH_MODES), default="auto",
              show_default=True, help="As `up --prefetch`.")
@root_option
@json_option
def resume(ref: str, sid: str, prefetch: str, root: str, as_json: bool) -> None:
    """Bring up sandbox ID from REF, the env a `layerfs suspend` pushed (an
    `up` of it, on any node); print its rootfs path."""
    client_commands.up(ref, (), sid, prefetch, None, root, as_json)


@click.command()
@root_option
@json_option
def ps(root: str, as_json: bool) -> None:
    """List sandboxes: state, layers, upper size, bytes read from their layers."""
    client_commands.ps(root, as_json)


@click.command()
@root_option
@json_option
def stats(root: str, as_json: bool) -> None:
    """Cache statistics and per-layer bytes read."""
    client_commands.stats(root, as_json)


@click.group()
def trace() -> None:
    """Access traces: the order in which sandboxes first touched a layer's chunks."""


@trace.command("push")
@click.argument("ref")
@root_option
@json_option
def trace_push(ref: str, root: str, as_json: bool) -> None:
    """Store this node's trace of layer REF beside it, for other nodes' --prefetch trace."""
    res = Client(root).trace_push(ref)
    Output(as_json).emit(res.to_json(), f"{ref}: trace of {res.chunks} chunks stored")
