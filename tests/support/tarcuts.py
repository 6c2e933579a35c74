"""Small tar archives cut where an archive may or may not end, for the reader
tests and for comparing with containerd.

Each case is a whole archive written by Python's ``tarfile`` and then cut (or
extended) around its last member: after its data with no padding, part of the
padding, no end-of-archive blocks, one of them; or with a header, an entry's
data or an end block cut short, a header after a single zero block, a GNU long
name cut short. Go's ``archive/tar`` reads the ``ENDINGS`` as complete archives
and refuses the ``CUT_SHORT`` ones.
"""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Callable

ZEROS = bytes(tarfile.BLOCKSIZE)
Entries = list[tuple[str, bytes | None, dict]]

LAST_FILE: Entries = [("d", None, {"type": tarfile.DIRTYPE, "mode": 0o755}),
                      ("d/a", b"a" * 1000, {}), ("d/last", os.urandom(700), {})]
LAST_EMPTY: Entries = [("d", None, {"type": tarfile.DIRTYPE, "mode": 0o755}),
                       ("d/a", b"a" * 1000, {}), ("d/empty", b"", {})]
# a whiteout's data is never read: the reader skips over it
LAST_UNREAD: Entries = [("d", None, {"type": tarfile.DIRTYPE, "mode": 0o755}),
                        ("d/keep", b"kept", {}), ("d/.wh.gone", os.urandom(700), {})]


def tar_of(entries: Entries) -> bytes:
    """A PAX archive of ``(name, data or None, TarInfo attributes)``."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data, kw in entries:
            info = tarfile.TarInfo(name)
            for k, v in kw.items():
                setattr(info, k, v)
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def cut_after_last(entries: Entries, extra: int = 0, at: str = "data") -> bytes:
    """The archive of ``entries`` ending ``extra`` bytes after the last member's
    header start, data end or padded end (``at``)."""
    data = tar_of(entries)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        last = tar.getmembers()[-1]
    size = last.size if last.isreg() else 0
    start = last.offset_data  # type: ignore[attr-defined]
    where = {"header": last.offset, "data": start + size,
             "padded": start + -(-size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE}
    return data[: where[at] + extra]


def meta_header_then_end(fmt: int = tarfile.GNU_FORMAT) -> bytes:
    """An archive ending after the data of a GNU long name (or pax) header, with
    no member after it."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        tar.addfile(tarfile.TarInfo("short"), io.BytesIO(b""))
        tar.addfile(tarfile.TarInfo("x" * 150), io.BytesIO(b""))
    return buf.getvalue()[: 3 * tarfile.BLOCKSIZE]  # "short", the meta header, its data


def gnu_long_name_then_end() -> bytes:
    return meta_header_then_end(tarfile.GNU_FORMAT)


def pax_header_then_end() -> bytes:
    return meta_header_then_end(tarfile.PAX_FORMAT)


ENDINGS: dict[str, Callable[[], bytes]] = {
    "no padding": lambda: cut_after_last(LAST_FILE),
    "half the padding": lambda: cut_after_last(LAST_FILE, 150),
    "padding, no end blocks": lambda: cut_after_last(LAST_FILE, at="padded"),
    "one end block": lambda: cut_after_last(LAST_FILE, 512, at="padded"),
    "two end blocks": lambda: cut_after_last(LAST_FILE, 1024, at="padded"),
    "empty last member": lambda: cut_after_last(LAST_EMPTY),
    "unread last member, no padding": lambda: cut_after_last(LAST_UNREAD),
}
# the whole archive each ending is the same tree as
ENDING_OF = {"empty last member": LAST_EMPTY, "unread last member, no padding": LAST_UNREAD}

CUT_SHORT: dict[str, Callable[[], bytes]] = {
    "header cut short": lambda: cut_after_last(LAST_FILE, 100, at="header"),
    "data short by one byte": lambda: cut_after_last(LAST_FILE, -1),
    "unread data short by one byte": lambda: cut_after_last(LAST_UNREAD, -1),
    "end block cut short": lambda: cut_after_last(LAST_FILE, 600, at="padded"),
    "header after one zero block": lambda: (cut_after_last(LAST_FILE, at="padded") + ZEROS
                                            + tar_of([("x", b"x", {})])),
    "GNU long name cut short": lambda: gnu_long_name_then_end()[:-400],
}
