"""What a VMM needs from a vm's drive set: QEMU's drive arguments, ready to
append to a command line (docs/vm.md has cloud-hypervisor's and Firecracker's
equivalents).

Each drive is raw, opened with ``O_DIRECT`` (``cache=none``: the guest's page
cache is the only one, and every read of a lazy blob file reaches the daemon
when the guest asks, not before) through QEMU's thread pool
(``aio=threads``: a read that waits for the store does not stop the VMM's
loop), read-only where the drive is. The device is virtio-blk on virtio-mmio
(``virtio-blk-device``, QEMU's ``microvm`` machine); for a ``pc`` or ``q35``
machine, ``virtio-blk-pci``. The guest sees the drives as ``/dev/vda``,
``/dev/vdb``, ... in the drive set's order, and each drive's id as its
serial (``/sys/block/vdX/serial``, udev's ``/dev/disk/by-id/virtio-ID``).
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing is not imported at run time: a client starts faster
if TYPE_CHECKING:
    from .protocol import VmDrive

QEMU_DEVICE = "virtio-blk-device"  # virtio-mmio; virtio-blk-pci on a PCI machine
SERIAL_BYTES = 20  # virtio-blk's serial (VIRTIO_BLK_ID_BYTES)


def qemu_value(text: str) -> str:
    """``text`` as a value in a QEMU option list (a comma doubled)."""
    return text.replace(",", ",,")


def qemu_drive_args(drives: list[VmDrive], device: str = QEMU_DEVICE) -> list[str]:
    """``-drive ... -device ...`` for each drive, in the drive set's order."""
    args: list[str] = []
    for d in drives:
        opts = [f"file={qemu_value(d.path_on_host)}", "format=raw", "if=none",
                f"id={qemu_value(d.drive_id)}", "cache=none", "aio=threads"]
        if d.is_read_only:
            opts.append("readonly=on")
        args += ["-drive", ",".join(opts), "-device",
                 f"{device},drive={qemu_value(d.drive_id)},"
                 f"serial={qemu_value(d.drive_id[:SERIAL_BYTES])}"]
    return args


def guest_device(index: int) -> str:
    """The guest's name of the drive at ``index`` of the drive set."""
    letters = ""
    index += 1
    while index:
        index, rest = divmod(index - 1, 26)
        letters = chr(ord("a") + rest) + letters
    return f"/dev/vd{letters}"
