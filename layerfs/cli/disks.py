"""Block commands: build-disk, disk create/ls/rm/commit, vm up/ps/down."""

from __future__ import annotations

import click

from layerfs.builder.disk import build_disk
from layerfs.errors import UsageError
from layerfs.node import protocol
from layerfs.node.control import call
from layerfs.refstore import RefStore

from .common import Output, human_bytes, parse_size, warn_offline, write_store_options
from .node import json_option, root_option


@click.command("build-disk")
@click.argument("image")
@click.option("--name", required=True, help="Layer name.")
@click.option("--version", "version", required=True, help="Layer version.")
@click.option("--parent", metavar="REF", help="The sealed layer this one sits on.")
@click.option("--chunk-size", default="1M", show_default=True)
@write_store_options
def build_disk_cmd(out: Output, refstore: RefStore, image: str, name: str, version: str,
                   parent: str | None, chunk_size: str) -> None:
    """Import the raw disk IMAGE (a multiple of 512 bytes) as a sealed LSMT layer;
    zero ranges are not stored."""
    res = build_disk(refstore, image, name, version, parent, parse_size(chunk_size))
    s = res.manifest.stats
    doc = {"ref": res.ref, "digest": res.digest, "published": res.published,
           "virtual_size": res.manifest.virtual_size,
           "stats": {**s.__dict__, "uploaded_bytes": res.uploaded_bytes}}  # this push's
    text = (f"{res.ref} {res.digest}\n  disk {human_bytes(res.manifest.virtual_size)}, data "
            f"{human_bytes(s.file_bytes)}, stored {human_bytes(s.stored_bytes)}, uploaded "
            f"{human_bytes(s.uploaded_bytes)}" if res.published else
            f"{res.ref} {res.digest}\n  unchanged: already published, nothing uploaded")
    out.emit(doc, text)


def disk_size_of(text: str, option: str) -> int:
    """A disk size given on the command line: zero, negative or garbage is refused."""
    try:
        size = parse_size(text)
    except (click.BadParameter, OverflowError):
        raise UsageError(f"{option}: not a size: {text!r}") from None
    if size <= 0:
        raise UsageError(f"{option}: a disk size must be positive, not {text!r}")
    return size


@click.group()
def disk() -> None:
    """Writable disks (LSMT) served read-write at ROOT/fuse/disks/ID."""


@disk.command("create")
@click.argument("sid", metavar="ID")
@click.option("--size", help="Disk size (e.g. 10G); default: the base's size.")
@click.option("--base", metavar="REF", help="A sealed layer (chain) to start from.")
@root_option
@json_option
def disk_create(sid: str, size: str | None, base: str | None, root: str, as_json: bool) -> None:
    """Create writable disk ID (empty, or over the sealed chain of --base)."""
    if size is None and not base:
        raise UsageError("give --size, --base or both")
    res = call(root, protocol.DiskCreate(
        id=sid, size=None if size is None else disk_size_of(size, "--size"), base=base),
        protocol.DiskAnswer)
    warn_offline(res.disk.offline)
    Output(as_json).emit(res.disk.to_json(), res.disk.path)


@disk.command("ls")
@root_option
@json_option
def disk_ls(root: str, as_json: bool) -> None:
    """List writable disks."""
    rows = call(root, protocol.DiskLs(), protocol.DiskList).disks

    def text() -> str:
        lines = []
        for r in rows:
            if isinstance(r, protocol.BrokenDisk):
                lines.append(f"{r.id:20} BROKEN: {r.error}")
            else:
                lines.append(f"{r.id:20} {human_bytes(r.size):>10} written "
                             f"{human_bytes(r.written_bytes):>10}  base {r.base_ref or '-'}"
                             f" (depth {r.chain_depth})")
        return "\n".join(lines) or "(no disks)"

    Output(as_json).emit([r.to_json() for r in rows], text)


@disk.command("rm")
@click.argument("sid", metavar="ID")
@root_option
def disk_rm(sid: str, root: str) -> None:
    """Delete writable disk ID and its local files."""
    call(root, protocol.DiskRm(id=sid), protocol.DiskRemoved)
    click.echo(f"{sid} removed")


@disk.command("commit")
@click.argument("sid", metavar="ID")
@click.option("--name", required=True)
@click.option("--version", "version", required=True)
@click.option("--max-depth", type=int, default=0, show_default=True,
              help="A chain that would grow past this many layers is merged into one "
                   "(0: no bound).")
@root_option
@json_option
def disk_commit(sid: str, name: str, version: str, max_depth: int, root: str,
                as_json: bool) -> None:
    """Seal the writes made to disk ID since its last commit into the layer
    NAME@VERSION (parent: the previous commit or the base) and push it."""
    request = protocol.DiskCommit(id=sid, name=name, version=version, max_depth=max_depth)
    res = call(root, request, protocol.DiskCommitAnswer)
    merged = f" (merged a chain of {res.merged} layers)" if res.merged else ""
    Output(as_json).emit(res.to_json(), f"{res.ref} {res.digest}{merged}\n  changed "
                         f"{human_bytes(res.changed_bytes)}, stored "
                         f"{human_bytes(res.stored_bytes)}, uploaded "
                         f"{human_bytes(res.uploaded_bytes)}")


@click.group()
def vm() -> None:
    """microVM drive sets: layer disks plus a writable disk."""


@vm.command("up")
@click.argument("env_ref", required=False)
@click.option("--layer", "layers", multiple=True, metavar="REF")
@click.option("--id", "vid", required=True)
@click.option("--disk-size", default="10G", show_default=True)
@click.option("--base-disk", metavar="REF", help="Start the writable disk from this snapshot.")
@click.option("--pmem", "pmem", flag_value="shared", default="",
              help="The layers as pmem drives (map with DAX), the files every such vm maps.")
@click.option("--pmem-private", "pmem", flag_value="private",
              help="The layers as pmem drives of this vm's own (no memory shared with others).")
@click.option("--ram", metavar="SIZE", help="Guest RAM in a file the node keeps (vm suspend).")
@root_option
@json_option
def vm_up(env_ref: str | None, layers: tuple[str, ...], vid: str, disk_size: str,
          base_disk: str | None, pmem: str, ram: str | None, root: str, as_json: bool) -> None:
    """Prepare VM ID's drives: for each layer its meta image and lazy blob file
    (read-only; the blob is the EROFS device= the guest passes), plus one
    writable disk. Prints the drives and QEMU's arguments for them (--json:
    the drive set with each drive's path, read-only flag and role, and the
    VMMs' arguments)."""
    disk_size_bytes = disk_size_of(disk_size, "--disk-size")
    record = call(root, protocol.VmUp(id=vid, env=env_ref, layers=list(layers),
                                      disk_size=disk_size_bytes, base_disk=base_disk,
                                      pmem=pmem,
                                      ram=disk_size_of(ram, "--ram") if ram else 0),
                  protocol.VmAnswer).vm
    warn_offline(record.offline)
    Output(as_json).emit(vm_doc(record), lambda: vm_text(record))


@vm.command("ps")
@root_option
@json_option
def vm_ps(root: str, as_json: bool) -> None:
    """List the VMs' drive sets on the node (kept across daemon restarts)."""
    rows = call(root, protocol.VmPs(), protocol.VmList).vms

    def text() -> str:
        lines = [f"{'ID':20} {'STATE':8} {'DRIVES':>6}  {'DISK':24} LAYERS"]
        for r in rows:
            lines.append(f"{r.id:20} {r.state:8} {len(r.drives):>6}  {r.disk:24} "
                         f"{' '.join(x.ref for x in r.layers) or '-'}")
            if r.error:
                lines.append(f"{'':20} {r.error}")
            if r.snapshot:
                lines.append(f"{'':20} suspended as {r.snapshot}")
            lines += [f"{'':20} {used.note()}" for used in r.offline]
        return "\n".join(lines) if rows else "(no vms)"

    Output(as_json).emit([vm_doc(r) for r in rows], text)


def vm_doc(record: protocol.VmRecord) -> dict:
    """A vm as the JSON output shows it: its record (``created`` in ISO 8601
    UTC), QEMU's arguments for its drives, cloud-hypervisor's and
    Firecracker's; with pmem drives, the bytes they add to QEMU's maxmem."""
    from layerfs.node.vms import vmmargs as vmm

    doc = record.to_json()
    doc["created"] = protocol.utc_time(record.created, micros=True)
    doc["qemu"] = vmm.qemu_drive_args(record.drives)
    if vmm.has_pmem(record.drives):
        doc["pmem_bytes"] = sum(d.size for d in record.drives if d.kind == "pmem")
    if record.ram is not None:
        doc["qemu_ram"] = vmm.qemu_ram_args(record.ram)
    doc["cloud_hypervisor"] = vmm.cloud_hypervisor_args(record.drives)
    doc["firecracker"] = vmm.firecracker_config(record.drives)
    return doc


def vm_text(record: protocol.VmRecord) -> str:
    import shlex

    from layerfs.node.vms import vmmargs as vmm

    lines = [f"{record.id}: {len(record.drives)} drives"]
    names = vmm.guest_names(record.drives)
    for d in record.drives:
        lines.append(f"  {names[d.drive_id]:10} {d.drive_id:14} {d.role:7} "
                     f"{'ro' if d.is_read_only else 'rw'}  {d.path_on_host}")
    dax = "dax=always," if vmm.has_pmem(record.drives) else ""
    for layer in record.layers:
        devices = ",".join(f"device={names[x]}" for x in layer.device_drives)
        lines.append(f"  {layer.ref}: mount -t erofs -o ro,{dax}{devices} "
                     f"{names[layer.meta_drive]} DIR")
    if dax:
        lines.append(f"qemu machine: -M {vmm.QEMU_PMEM_MACHINE} "
                     + shlex.join(vmm.qemu_memory_args(record.drives, 512)) + " (for 512 MiB)")
    lines.append("qemu: " + shlex.join(vmm.qemu_drive_args(record.drives)))
    if record.ram is not None:
        lines.append(f"qemu RAM (-m {record.ram.size // (1 << 20)}M): "
                     + shlex.join(vmm.qemu_ram_args(record.ram)))
    return "\n".join(lines)


@vm.command("suspend")
@click.argument("vid", metavar="ID")
@click.option("--name", required=True)
@click.option("--version", "version", required=True)
@click.option("--max-depth", type=int, default=protocol.DEFAULT_SNAPSHOT_DEPTH,
              show_default=True,
              help="A RAM or disk chain that would grow past this many layers is merged "
                   "into one.")
@root_option
@json_option
def vm_suspend(vid: str, name: str, version: str, max_depth: int, root: str,
               as_json: bool) -> None:
    """Save running VM ID (up with --ram, its VMM started with the qemu_ram
    arguments) into the store as NAME@VERSION: device state, RAM and the
    writable disk (NAME-disk@VERSION). Its VMM ends."""
    request = protocol.VmSuspend(id=vid, name=name, version=version, max_depth=max_depth)
    record = call(root, request, protocol.VmAnswer).vm
    Output(as_json).emit(vm_doc(record), f"{vid} suspended as {record.snapshot}")


@vm.command("resume")
@click.argument("ref", metavar="REF")
@click.option("--id", "vid", required=True)
@root_option
@json_option
def vm_resume(ref: str, vid: str, root: str, as_json: bool) -> None:
    """Make VM ID from snapshot REF on this node: its drive set, RAM served
    lazily from the store and the device state; start the VMM with the
    printed arguments and the guest goes on."""
    record = call(root, protocol.VmResume(ref=ref, id=vid), protocol.VmAnswer).vm
    warn_offline(record.offline)
    Output(as_json).emit(vm_doc(record), lambda: vm_text(record))


@vm.command("prefetch")
@click.argument("ref", metavar="REF")
@root_option
@json_option
def vm_prefetch(ref: str, root: str, as_json: bool) -> None:
    """Fetch the working set of snapshot REF onto this node now, ahead of a
    vm resume of it here (nothing if no resume pushed one yet)."""
    got = call(root, protocol.VmPrefetch(ref=ref), protocol.VmPrefetchAnswer)
    Output(as_json).emit(got.to_json(),
                         f"{ref}: working set on the node, {got.chunks} chunks "
                         f"({got.bytes} bytes, {got.fetched_bytes} fetched now)")


@vm.command("down")
@click.argument("vid", metavar="ID")
@click.option("--keep", is_flag=True, help="Keep the writable disk.")
@root_option
def vm_down(vid: str, keep: bool, root: str) -> None:
    """Release VM ID's drives (and delete its writable disk unless --keep)."""
    call(root, protocol.VmDown(id=vid, keep=keep), protocol.VmAnswer)
    click.echo(f"{vid} down")
