"""Bad and unusual build input: streams read once, bounded tar headers, odd numbers, old dates.

Every case runs ``layerfs build`` as a command: bad input must give one line
``layerfs: error: ...`` and exit 3 with nothing published; unusual but
legitimate input (FIFOs, files dated before 1970) must build and mount.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
import random
import resource
import subprocess
import sys
import tarfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import zstandard
from support import mounted_layer

from layerfs.refstore import LAYERS, RefStore
from layerfs.store.file import FileStore

pytestmark = pytest.mark.end_to_end  # the CLI and outside tools, end to end

COMPRESSIONS = ["plain", "gzip", "xz", "bzip2", "zstd"]
MEMORY_LIMIT = 1 << 30
FIFO_TIMEOUT = 120  # a reader that opens a FIFO twice waits for ever: fail instead
S64_MAX = 2**63 - 1
NS = 10**9
T1960 = -315619200  # 1960-01-01T00:00:00Z
BIG = random.Random(8).randbytes(300_000)


def compress(data: bytes, how: str) -> bytes:
    if how == "gzip":
        return gzip.compress(data)
    if how == "xz":
        return lzma.compress(data)
    if how == "bzip2":
        return bz2.compress(data)
    if how == "zstd":
        return zstandard.ZstdCompressor().compress(data)
    return data


def make_tar(entries: list[tuple[str, bytes | None, dict]]) -> bytes:
    """A PAX tar of (name, file data or None, TarInfo attributes incl. pax_headers)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data, attrs in entries:
            info = tarfile.TarInfo(name)
            info.mtime = 1_700_000_000
            for key, value in attrs.items():
                setattr(info, key, value)
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def sample_tar() -> bytes:
    return make_tar([
        ("etc", None, {"type": tarfile.DIRTYPE, "mode": 0o755}),
        ("etc/hostname", b"sandbox\n", {"mode": 0o644}),
        ("big", BIG, {"mode": 0o600, "uid": 1000}),
        ("etc/link", None, {"type": tarfile.SYMTYPE, "linkname": "hostname"}),
    ])


def header(name: str, kind: bytes, size: int) -> bytes:
    """One raw 512-byte tar header that claims ``size`` bytes of data."""
    info = tarfile.TarInfo(name)
    info.type = kind
    info.size = size
    return info.tobuf(format=tarfile.GNU_FORMAT)


def layerfs(*args: str, stdin=None, memory_limit: int | None = None,
            timeout: float = 600) -> subprocess.CompletedProcess:
    def limit() -> None:
        if memory_limit:
            resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))

    return subprocess.run([sys.executable, "-m", "layerfs.cli.main", *args], stdin=stdin,
                          capture_output=True, text=True, preexec_fn=limit, timeout=timeout)


def build_cmd(src: str, store: Path, version: str = "1") -> list[str]:
    return ["build", src, "--name", "t", "--version", version, "--store", f"file://{store}"]


def assert_one_line_error(proc: subprocess.CompletedProcess, store: Path, *words: str) -> None:
    lines = proc.stderr.splitlines()
    assert proc.returncode == 3, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("layerfs: error: "), proc.stderr
    for word in words:
        assert word in lines[0], proc.stderr
    if store.exists():
        assert RefStore(FileStore(str(store))).list_refs(LAYERS) == []


def layer_digest(store: Path, ref: str = "t@1") -> str:
    return RefStore(FileStore(str(store))).resolve(LAYERS, ref)


def meta_digest(store: Path, ref: str = "t@1") -> str:
    refstore = RefStore(FileStore(str(store)))
    return refstore.layer(refstore.resolve(LAYERS, ref)).meta.raw_digest


def build_file(tmp_path: Path, data: bytes,
               name: str = "in.tar") -> tuple[subprocess.CompletedProcess, Path]:
    path = tmp_path / name
    path.write_bytes(data)
    store = tmp_path / "store"
    return layerfs(*build_cmd(str(path), store)), store


# -- finding 8: a FIFO or pipe is read once, as a stream --

@pytest.mark.parametrize("how", COMPRESSIONS)
def test_process_substitution_gives_the_tar_content(tmp_path, how):
    archive = tmp_path / "x.tar"
    archive.write_bytes(compress(sample_tar(), how))
    from_file, from_pipe = tmp_path / "s_file", tmp_path / "s_pipe"
    assert layerfs(*build_cmd(str(archive), from_file)).returncode == 0
    args = " ".join(build_cmd("<(cat x.tar)", from_pipe))
    proc = subprocess.run(["bash", "-c", f"{sys.executable} -m layerfs.cli.main {args}"],
                          cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    refstore = RefStore(FileStore(str(from_pipe)))
    manifest = refstore.layer(refstore.resolve(LAYERS, "t@1"))
    assert (manifest.stats.files, manifest.stats.dirs, manifest.stats.symlinks) == (2, 1, 1)
    assert meta_digest(from_pipe) == meta_digest(from_file)


@contextmanager
def fed_fifo(path: Path, data: bytes) -> Iterator[None]:
    """A FIFO that a thread fills in 100-byte writes (short reads for the sniffer)."""
    os.mkfifo(path)

    def feed() -> None:
        try:
            with open(path, "wb", buffering=0) as f:
                for i in range(0, len(data), 100):
                    f.write(data[i : i + 100])
        except BrokenPipeError:
            pass  # the reader went away early

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    try:
        yield
    finally:
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))  # frees a writer still waiting
        writer.join()


@pytest.mark.parametrize("how", COMPRESSIONS)
def test_fifo_fed_in_small_pieces_builds_the_tar(tmp_path, how):
    store = tmp_path / "store"
    with fed_fifo(tmp_path / "fifo", compress(sample_tar(), how)):
        proc = layerfs(*build_cmd(str(tmp_path / "fifo"), store), timeout=FIFO_TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    with mounted_layer(FileStore(str(store)), layer_digest(store), str(tmp_path / "m")) as mnt:
        assert Path(mnt, "etc/hostname").read_bytes() == b"sandbox\n"
        assert os.readlink(Path(mnt, "etc/link")) == "hostname"
        assert Path(mnt, "big").read_bytes() == BIG


def test_fifo_with_garbage_is_one_line(tmp_path):
    store = tmp_path / "store"
    with fed_fifo(tmp_path / "fifo", os.urandom(5000)):
        proc = layerfs(*build_cmd(str(tmp_path / "fifo"), store), timeout=FIFO_TIMEOUT)
    assert_one_line_error(proc, store, "not a directory or tar archive")


# -- finding 10: pax and GNU long name headers are bounded --

def write_zstd_bomb(path: Path, kind: bytes, size: int) -> None:
    """A tiny .tar.zst whose one extended header really holds ``size`` bytes."""
    piece = b"a" * (1 << 20)
    with open(path, "wb") as f, zstandard.ZstdCompressor(level=1).stream_writer(f) as out:
        out.write(header("././@header", kind, size))
        record_head = f"{size} comment=".encode()
        out.write(record_head)
        left = size - len(record_head) - 1
        while left > 0:
            out.write(piece[: min(left, len(piece))])
            left -= len(piece)
        out.write(b"\n" + b"\0" * (-size % 512))
        out.write(make_tar([("f", b"x", {})]))
    assert path.stat().st_size < 1 << 20


@pytest.mark.parametrize("kind", [tarfile.XHDTYPE, tarfile.GNUTYPE_LONGNAME])
def test_large_extended_header_is_refused_within_memory(tmp_path, kind):
    path = tmp_path / "bomb.tar.zst"
    write_zstd_bomb(path, kind, 1536 << 20)
    store = tmp_path / "store"
    proc = layerfs(*build_cmd(str(path), store), memory_limit=MEMORY_LIMIT)
    assert "MemoryError" not in proc.stderr and "Traceback" not in proc.stderr
    assert_one_line_error(proc, store, "header of 1610612736 bytes")


@pytest.mark.parametrize("kind", [tarfile.XHDTYPE, tarfile.GNUTYPE_LONGLINK])
def test_claimed_huge_extended_header_is_one_line(tmp_path, kind):
    data = header("././@header", kind, 8 << 30) + b"1" * 4096
    proc, store = build_file(tmp_path, compress(data, "zstd"), "claim.tar.zst")
    assert_one_line_error(proc, store, "header of 8589934592 bytes")


def test_many_extended_headers_before_one_entry_are_refused(tmp_path):
    record = b"30 comment=" + b"c" * 18 + b"\n"
    one = header("././@PaxHeader", tarfile.XHDTYPE, len(record)) + record.ljust(512, b"\0")
    proc, store = build_file(tmp_path, one * 100 + make_tar([("f", b"x", {})]))
    assert_one_line_error(proc, store, "too many pax and long name headers")


def test_pax_header_of_digits_is_parsed_in_linear_time(tmp_path):
    """tarfile's own pax regexes backtrack quadratically on a header of digits."""
    body = b"1" * (1 << 20)
    data = header("././@PaxHeader", tarfile.XHDTYPE, len(body)) + body
    path = tmp_path / "digits.tar"
    path.write_bytes(data + make_tar([("f", b"x", {})]))
    store = tmp_path / "store"
    proc = layerfs(*build_cmd(str(path), store), timeout=120)
    assert_one_line_error(proc, store, "malformed pax record")


# -- finding 11: numbers an inode cannot hold, malformed headers --

@pytest.mark.parametrize("pax,words", [
    ({"mtime": "abc"}, ["invalid pax mtime 'abc'"]),
    ({"mtime": "1e10"}, ["invalid pax mtime '1e10'"]),
    ({"mtime": "1.5.5"}, ["invalid pax mtime"]),
    ({"uid": "-1"}, ["invalid pax uid '-1'"]),
    ({"uid": "abc"}, ["invalid pax uid 'abc'"]),
    ({"uid": str(2**40)}, ["uid 1099511627776 out of range"]),
    ({"gid": str(10**25)}, ["gid 10000000000000000000000000 out of range"]),
    ({"size": str(10**20)}, ["size 100000000000000000000 out of range"]),
    ({"size": "-5"}, ["invalid pax size '-5'"]),
    ({"size": "9" * 5000}, ["invalid pax size"]),
    ({"GNU.sparse.map": "0,abc"}, ["invalid pax GNU.sparse.map '0,abc'"]),
    ({"GNU.sparse.offset": "0", "GNU.sparse.numbytes": "1"}, ["GNU sparse format 0.0"]),
])
def test_bad_pax_numbers_are_one_line(tmp_path, pax, words):
    data = make_tar([("dir", None, {"type": tarfile.DIRTYPE}),
                     ("dir/f", b"data", {"pax_headers": pax})])
    proc, store = build_file(tmp_path, data)
    assert_one_line_error(proc, store, *words)


@pytest.mark.parametrize("fmt", ["posix", "gnu"])
def test_gnu_tar_sparse_file_builds_with_its_holes(tmp_path, fmt):
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "holey", "wb") as f:
        for at in (3 << 20, 9 << 20):
            f.seek(at)
            f.write(BIG[:5000])
        f.truncate(12 << 20)
    archive = tmp_path / "sparse.tar"
    subprocess.run(["tar", f"--format={fmt}", "--sparse", "-C", str(src), "-cf", str(archive),
                    "."], check=True)
    store = tmp_path / "store"
    proc = layerfs(*build_cmd(str(archive), store))
    assert proc.returncode == 0, proc.stderr
    refstore = RefStore(FileStore(str(store)))
    assert refstore.layer(layer_digest(store)).stats.holes == 10
    with mounted_layer(FileStore(str(store)), layer_digest(store), str(tmp_path / "m")) as mnt:
        assert Path(mnt, "holey").read_bytes() == (src / "holey").read_bytes()


def test_endless_sparse_map_is_one_line(tmp_path):
    """A GNU 1.0 sparse map that claims more entries than the archive holds."""
    data = make_tar([("f", b"99999999\n" + b"1\n" * 3_000_000,
                      {"pax_headers": {"GNU.sparse.major": "1", "GNU.sparse.minor": "0",
                                       "GNU.sparse.name": "f",
                                       "GNU.sparse.realsize": "100"}})])
    proc, store = build_file(tmp_path, data)
    assert_one_line_error(proc, store, "too many pax and long name headers")


def test_device_numbers_beyond_dev_t_are_one_line(tmp_path):
    data = make_tar([("null", None, {"type": tarfile.CHRTYPE, "devmajor": 1 << 20,
                                     "devminor": 3})])
    proc, store = build_file(tmp_path, data)
    assert_one_line_error(proc, store, "device major 1048576 out of range")


def ustar_member(name: str, data: bytes, mode_field: bytes | None = None) -> bytes:
    """A plain ustar header (optionally with a raw mode field) and its padded data."""
    info = tarfile.TarInfo(name)
    info.size = len(data)
    head = bytearray(info.tobuf(format=tarfile.USTAR_FORMAT))
    if mode_field is not None:
        head[100:108] = mode_field
        head[148:156] = b" " * 8
        head[148:156] = b"%06o\0 " % sum(head)
    return bytes(head) + data.ljust(-(-len(data) // 512) * 512, b"\0")


def test_bad_mode_field_is_one_line(tmp_path):
    data = ustar_member("a", b"1") + ustar_member("b", b"2", mode_field=b"zzzzzzz\0")
    proc, store = build_file(tmp_path, data + b"\0" * 1024)
    assert_one_line_error(proc, store, "invalid tar header at byte 1024")


def test_corrupt_header_mid_archive_is_an_error_not_the_end(tmp_path):
    """tarfile takes a bad header after the first as the end of the archive."""
    second = bytearray(ustar_member("b", b"2"))
    second[148:156] = b"0000000\0"  # wrong checksum
    data = ustar_member("a", b"1" * 600) + bytes(second) + b"\0" * 1024
    proc, store = build_file(tmp_path, data)
    assert_one_line_error(proc, store, "invalid tar header at byte 1536")


def test_corrupt_gzip_data_is_one_line(tmp_path):
    packed = bytearray(compress(make_tar([("f", os.urandom(200_000), {})]), "gzip"))
    packed[len(packed) // 2 : len(packed) // 2 + 64] = b"\xff" * 64
    proc, store = build_file(tmp_path, bytes(packed), "in.tar.gz")
    assert_one_line_error(proc, store)


# -- finding 11: times before 1970 are stored, times beyond an inode are clamped --

def stored_mtimes(store: Path, tmp_path: Path, names: list[str]) -> dict[str, int]:
    with mounted_layer(FileStore(str(store)), layer_digest(store), str(tmp_path / "m")) as mnt:
        return {n: os.lstat(os.path.join(mnt, n)).st_mtime_ns for n in names}


@pytest.mark.parametrize("pax,want_ns", [
    ("-1.5", -1_500_000_000),
    ("-315619200", T1960 * NS),
    ("-315619199.25", T1960 * NS + 750_000_000),
    ("1700000000.123456789123", 1_700_000_000_123_456_789),
])
def test_pax_mtime_before_1970_is_stored(tmp_path, pax, want_ns):
    data = make_tar([("d", None, {"type": tarfile.DIRTYPE, "pax_headers": {"mtime": pax}}),
                     ("d/f", b"x", {"pax_headers": {"mtime": pax}})])
    proc, store = build_file(tmp_path, data)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert stored_mtimes(store, tmp_path, ["d", "d/f"]) == {"d": want_ns, "d/f": want_ns}


def test_pax_mtime_beyond_an_inode_is_clamped_with_one_warning(tmp_path):
    data = make_tar([("far", b"x", {"pax_headers": {"mtime": "1" + "0" * 40}}),
                     ("farther", b"y", {"pax_headers": {"mtime": "9" * 5000}}),
                     ("past", b"z", {"pax_headers": {"mtime": "-" + "9" * 25 + ".5"}}),
                     ("now", b"n", {})])
    proc, store = build_file(tmp_path, data)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("layerfs: warning: 3 entries"), proc.stderr
    got = stored_mtimes(store, tmp_path, ["far", "farther", "past", "now"])
    assert got == {"far": S64_MAX * NS + NS - 1, "farther": S64_MAX * NS + NS - 1,
                   "past": -(2**63) * NS, "now": 1_700_000_000 * NS}


def dated_tree(root: Path, when_ns: int) -> list[str]:
    """A small tree whose every entry (root included) carries ``when_ns``."""
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "file").write_bytes(b"old\n")
    (root / "sub" / "big").write_bytes(os.urandom(70_000))
    os.symlink("file", root / "sub" / "link")
    names = ["sub/file", "sub/big", "sub/link", "sub", "."]
    for name in names:
        os.utime(root / name, ns=(when_ns, when_ns), follow_symlinks=False)
    os.utime(root / "sub" / "file", ns=(when_ns + 500_000_000,) * 2)
    return names


def test_directory_dated_1960_builds_and_mounts(tmp_path):
    names = dated_tree(tmp_path / "src", T1960 * NS)
    store = tmp_path / "store"
    proc = layerfs(*build_cmd(str(tmp_path / "src"), store))
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    want = {n: os.lstat(tmp_path / "src" / n).st_mtime_ns for n in names}
    assert want["sub/file"] == T1960 * NS + 500_000_000
    assert stored_mtimes(store, tmp_path, names) == want


def test_gnu_tar_of_a_1960_tree_matches_it(tmp_path):
    names = dated_tree(tmp_path / "src", T1960 * NS)
    archive = tmp_path / "old.tar"
    subprocess.run(["tar", "--format=posix", "--numeric-owner", "-C", str(tmp_path / "src"),
                    "-cf", str(archive), "."], check=True)
    store = tmp_path / "store"
    proc = layerfs(*build_cmd(str(archive), store))
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    want = {n: os.lstat(tmp_path / "src" / n).st_mtime_ns for n in names}
    assert stored_mtimes(store, tmp_path, names) == want
