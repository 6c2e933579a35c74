"""What a VMM needs from a vm's drive set: QEMU's drive arguments, ready to
append to a command line, and cloud-hypervisor's and Firecracker's
equivalents (docs/vm.md).

Each drive is raw, opened with ``O_DIRECT`` (``cache=none``: the guest's page
cache is the only one, and every read of a lazy blob file reaches the daemon
when the guest asks, not before) through QEMU's thread pool
(``aio=threads``: a read that waits for the store does not stop the VMM's
loop), read-only where the drive is. The device is virtio-blk on virtio-mmio
(``virtio-blk-device``, QEMU's ``microvm`` machine); for a ``pc`` or ``q35``
machine, ``virtio-blk-pci``. The guest sees the drives as ``/dev/vda``,
``/dev/vdb``, ... in the drive set's order, and each drive's id as its
serial (``/sys/block/vdX/serial``, udev's ``/dev/disk/by-id/virtio-ID``).

A pmem drive (``vm up --pmem``) is a ``memory-backend-file`` mapped shared
and read-only with a ``virtio-pmem-pci`` device on it: PCI only, so a vm
with pmem drives runs on ``q35`` (or ``pc``) and its block drives are
``virtio-blk-pci``; the machine's ``maxmem`` must leave room for the pmem
devices above its RAM (:func:`qemu_memory_args`). The guest sees them as
``/dev/pmem0``, ``/dev/pmem1``, ... in the drive set's order.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing is not imported at run time: a client starts faster
if TYPE_CHECKING:
    from ..protocol import VmDrive, VmRam

QEMU_DEVICE = "virtio-blk-device"  # virtio-mmio; virtio-blk-pci on a PCI machine
QEMU_PCI_DEVICE = "virtio-blk-pci"
QEMU_PMEM_MACHINE = "q35"  # virtio-pmem is PCI only (microvm has no PCI)
SERIAL_BYTES = 20  # virtio-blk's serial (VIRTIO_BLK_ID_BYTES)


def qemu_value(text: str) -> str:
    """``text`` as a value in a QEMU option list (a comma doubled)."""
    return text.replace(",", ",,")


def has_pmem(drives: list[VmDrive]) -> bool:
    return any(d.kind == "pmem" for d in drives)


def qemu_drive_args(drives: list[VmDrive], device: str | None = None) -> list[str]:
    """``-drive ... -device ...`` for each block drive and ``-object ...
    -device virtio-pmem-pci,...`` for each pmem drive, in the drive set's
    order; block drives on ``device`` (virtio-mmio, or PCI where the vm has
    pmem drives)."""
    device = device or (QEMU_PCI_DEVICE if has_pmem(drives) else QEMU_DEVICE)
    args: list[str] = []
    for d in drives:
        if d.kind == "pmem":
            args += qemu_pmem_args(d)
            continue
        opts = [f"file={qemu_value(d.path_on_host)}", "format=raw", "if=none",
                f"id={qemu_value(d.drive_id)}", "cache=none", "aio=threads"]
        if d.is_read_only:
            opts.append("readonly=on")
        args += ["-drive", ",".join(opts), "-device",
                 f"{device},drive={qemu_value(d.drive_id)},"
                 f"serial={qemu_value(d.drive_id[:SERIAL_BYTES])}"]
    return args


def qemu_pmem_args(d: VmDrive) -> list[str]:
    """A pmem drive: its file mapped shared (one host copy for every vm that
    maps it) and read-only, as a virtio-pmem device."""
    mem = qemu_value(f"mem-{d.drive_id}")
    backend = [f"id={mem}", f"mem-path={qemu_value(d.path_on_host)}", f"size={d.size}",
               "share=on"]
    if d.is_read_only:
        backend.append("readonly=on")
    return ["-object", "memory-backend-file," + ",".join(backend),
            "-device", f"virtio-pmem-pci,memdev={mem},id={qemu_value(d.drive_id)}"]


def qemu_memory_args(drives: list[VmDrive], memory_mb: int) -> list[str]:
    """``-m``: ``memory_mb`` of RAM and, with pmem drives, a ``maxmem`` that
    leaves room for them (QEMU maps them above the RAM as memory devices)."""
    pmem = sum(d.size for d in drives if d.kind == "pmem")
    if not pmem:
        return ["-m", str(memory_mb)]
    return ["-m", f"{memory_mb}M,maxmem={memory_mb + -(-pmem // (1 << 20))}M"]


def qemu_ram_args(ram: VmRam) -> list[str]:
    """A vm's RAM file as QEMU's RAM (``-m`` must be its size), its QMP
    socket (``vm suspend`` drives it), and for a resumed vm the device state
    to load: the file is mapped shared (its pages stay in the file, so the
    migration stream leaves them out: ``x-ignore-shared``; a resumed vm's is
    its RAM disk, pages faulting in from the snapshot), and a resumed vm's
    QEMU is started with ``-incoming defer``: the daemon sets ``x-ignore-shared``
    and loads the state (``migrate-incoming``) through the QMP socket as soon
    as QEMU listens on it, and the guest goes on."""
    backend = (f"memory-backend-file,id=ram0,mem-path={qemu_value(ram.path)},size={ram.size},"
               f"share={'on' if ram.share else 'off'}")
    args = ["-object", backend, "-machine", "memory-backend=ram0",
            "-qmp", f"unix:{qemu_value(ram.qmp)},server=on,wait=off"]
    if ram.incoming:  # the daemon loads the state through the QMP socket once it is there
        args += ["-incoming", "defer"]
    return args


def cloud_hypervisor_args(drives: list[VmDrive]) -> list[str]:
    """cloud-hypervisor's ``--disk`` and ``--pmem`` arguments (its
    ``DiskConfig`` and ``PmemConfig`` have the same fields). A read-only pmem
    is ``discard_writes=on`` (a private mapping: the file is never written)."""
    disks = [",".join([f"path={d.path_on_host}", *(["readonly=on"] if d.is_read_only else []),
                       "direct=on"]) for d in drives if d.kind != "pmem"]
    pmem = [",".join([f"file={d.path_on_host}", f"size={d.size}",
                      *(["discard_writes=on"] if d.is_read_only else [])])
            for d in drives if d.kind == "pmem"]
    return (["--disk", *disks] if disks else []) + (["--pmem", *pmem] if pmem else [])


def firecracker_config(drives: list[VmDrive]) -> dict[str, list[dict[str, object]]]:
    """Firecracker's ``drives`` and ``pmem`` (1.14 on) objects, as its
    ``--config-file`` lists them and ``PUT /drives/{id}``, ``PUT /pmem/{id}``
    take them."""
    return {
        "drives": [{"drive_id": d.drive_id, "path_on_host": d.path_on_host,
                    "is_read_only": d.is_read_only, "is_root_device": d.is_root_device}
                   for d in drives if d.kind != "pmem"],
        "pmem": [{"id": d.drive_id, "path_on_host": d.path_on_host, "root_device": False,
                  "read_only": d.is_read_only} for d in drives if d.kind == "pmem"]}


def guest_names(drives: list[VmDrive]) -> dict[str, str]:
    """Each drive's name in the guest, by drive id: block drives ``/dev/vda``,
    ``/dev/vdb``, ... and pmem drives ``/dev/pmem0``, ... each in the drive
    set's order."""
    names: dict[str, str] = {}
    for d in drives:
        if d.kind == "pmem":
            names[d.drive_id] = f"/dev/pmem{sum(n.startswith('/dev/pmem') for n in names.values())}"
        else:
            names[d.drive_id] = guest_device(sum(n.startswith("/dev/vd") for n in names.values()))
    return names


def guest_device(index: int) -> str:
    """The guest's name of the drive at ``index`` of the drive set."""
    letters = ""
    index += 1
    while index:
        index, rest = divmod(index - 1, 26)
        letters = chr(ord("a") + rest) + letters
    return f"/dev/vd{letters}"
