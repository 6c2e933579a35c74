"""The library fetch-ahead (layerfs/node/reads/libraryahead.py) and what it
reads: an ELF file's interpreter, ``DT_NEEDED`` names and search path
(layerfs/formats/elfdeps.py, real programs and crafted files, hostile ones
too), path lookups in a meta image (``MetaLookup``), and a miss at the start
of a real program fetching its libraries, and theirs, from a real layer in a
file store.

Tier: fast (no mounts, no daemon: a fetcher over a file store in trio), but
the last test's: node (a real daemon, kernel EROFS and overlay mounts; root).
"""

from __future__ import annotations

import os
import random
import re
import struct
from pathlib import Path

import pytest
import trio
from support import build, need_root
from support.chunkstores import fetcher
from support.nodes import NodeDaemon, serving, up_lazy
from support.programs import (
    PROGRAM,
    STORE_GONE,
    fetched_settles,
    needs_debian_amd64,
    program_env,
    program_tree,
    readable,
)

from layerfs.formats.elfdeps import MAX_NEEDED, NeedBytes, needs
from layerfs.formats.erofsread import MetaLookup
from layerfs.node.reads.blobfiles import BlobFile
from layerfs.node.reads.prefetch import Prefetcher
from layerfs.refstore import RefStore
from layerfs.store.file import FileStore


def elf(needed: list[bytes], *, interp: bytes | None = b"/lib/ld.so", runpath: bytes = b"",
        wide: bool = True, big: bool = False, strtab_at: int | None = None,
        phnum: int | None = None) -> bytes:
    """A crafted dynamically linked ELF file: one PT_LOAD mapping it all at
    vaddr 0x10000, PT_INTERP, PT_DYNAMIC (DT_NEEDED..., DT_RUNPATH, DT_STRTAB,
    DT_STRSZ, DT_NULL) and the string table."""
    e = ">" if big else "<"
    head, ph_size = (64, 56) if wide else (52, 32)
    strings = b"\0" + b"".join(n + b"\0" for n in needed)
    run_at = len(strings)
    strings += runpath + b"\0"
    interp_bytes = (interp + b"\0") if interp else b""
    dyn_entry = struct.Struct(e + ("qQ" if wide else "iI"))
    dyn_tags = [(1, 1 + sum(len(n) + 1 for n in needed[:k])) for k in range(len(needed))]
    phs = 3 if interp else 2
    base = 0x10000
    interp_off = head + ph_size * phs
    str_off = interp_off + len(interp_bytes)
    dyn_off = str_off + len(strings)
    dyn_off += -dyn_off % 8
    tags = dyn_tags + ([(29, run_at)] if runpath else []) + [
        (5, base + (str_off if strtab_at is None else strtab_at)), (10, len(strings)), (0, 0)]
    dynamic = b"".join(dyn_entry.pack(t, v) for t, v in tags)
    total = dyn_off + len(dynamic)
    ident = b"\x7fELF" + bytes([2 if wide else 1, 2 if big else 1, 1]) + bytes(9)
    count = phs if phnum is None else phnum
    if wide:
        header = ident + struct.pack(e + "HHIQQQIHHHHHH", 3, 62, 1, 0, head, 0, 0, head,
                                     ph_size, count, 64, 0, 0)
        ph = struct.Struct(e + "IIQQQQQQ")
        load = ph.pack(1, 5, 0, base, base, total, total, 0x1000)
        dyn = ph.pack(2, 6, dyn_off, base + dyn_off, base + dyn_off, len(dynamic),
                      len(dynamic), 8)
        itp = ph.pack(3, 4, interp_off, base + interp_off, 0, len(interp_bytes),
                      len(interp_bytes), 1)
    else:
        header = ident + struct.pack(e + "HHIIIIIHHHHHH", 3, 3, 1, 0, head, 0, 0, head,
                                     ph_size, count, 40, 0, 0)
        ph = struct.Struct(e + "IIIIIIII")
        load = ph.pack(1, 0, base, base, total, total, 5, 0x1000)
        dyn = ph.pack(2, dyn_off, base + dyn_off, 0, len(dynamic), len(dynamic), 6, 4)
        itp = ph.pack(3, interp_off, base + interp_off, 0, len(interp_bytes),
                      len(interp_bytes), 4, 1)
    out = header + load + dyn + (itp if interp else b"") + interp_bytes + strings
    out += bytes(dyn_off - len(out)) + dynamic
    return out


def whole(data: bytes):
    """``read(offset, length)`` over ``data`` (a file held whole)."""
    return lambda offset, length: data[offset:offset + length]


# -- elfdeps ---------------------------------------------------------------

@needs_debian_amd64
def test_a_real_program_names_its_loader_and_libraries():
    got = needs(whole(Path(PROGRAM).read_bytes()))
    assert got is not None
    assert got.interp == "/lib64/ld-linux-x86-64.so.2"
    assert "libc.so.6" in got.needed and "libselinux.so.1" in got.needed
    assert got.multiarch == "x86_64-linux-gnu"


@pytest.mark.parametrize("wide,big", [(True, False), (False, False), (True, True),
                                      (False, True)])
def test_crafted_files_of_each_class_and_byte_order(wide, big):
    data = elf([b"liba.so.1", b"libb.so.2"], runpath=b"$ORIGIN/../lib:/opt/x", wide=wide,
               big=big)
    got = needs(whole(data))
    assert got is not None
    assert (got.interp, got.needed, got.search) == (
        "/lib/ld.so", ["liba.so.1", "libb.so.2"], ["$ORIGIN/../lib", "/opt/x"])


def test_bytes_not_held_are_asked_for_by_offset():
    data = elf([b"liba.so.1"], interp=None)
    held = 100  # the header and program headers, not the string table

    def read(offset, length):
        if offset + length > held:
            raise NeedBytes(offset)
        return data[offset:offset + length]

    with pytest.raises(NeedBytes) as need:
        needs(read)
    assert need.value.offset >= held - 64


NOISE = random.Random(36).randbytes(4096)


@pytest.mark.parametrize("data", [b"", b"\x7fELF", NOISE, b"\x7fELF" + NOISE[4:],
                                  b"#!/bin/sh\necho hello\n"],
                         ids=["empty", "magic", "noise", "magic-noise", "script"])
def test_what_does_not_parse_has_no_needs(data):
    got = needs(whole(data))
    assert got is None or got.needed == []


def test_hostile_counts_and_offsets_are_bounded():
    assert needs(whole(elf([b"liba.so"], phnum=60000))) is None  # past MAX_PHDRS
    assert needs(whole(elf([b"liba.so"], strtab_at=1 << 40))).needed == []  # mapped nowhere
    many = needs(whole(elf([b"l%d.so" % k for k in range(300)])))
    assert len(many.needed) == MAX_NEEDED
    odd = needs(whole(elf([b"ok.so", b"bad\x01name.so", b"\xff\xfe.so", b"x" * 400])))
    assert odd.needed == ["ok.so"]


@needs_debian_amd64
def test_mutated_programs_parse_or_have_no_needs_quickly():
    """Random bytes changed in a real program's tables: never an exception
    (but NeedBytes, not raised here: the file is whole), never slow."""
    import time

    rng = random.Random(35)
    data = Path(PROGRAM).read_bytes()
    head = bytearray(data[:64 << 10])
    layout = needs(whole(data))
    assert layout is not None
    started = time.perf_counter()
    for _ in range(2000):
        mutant = bytearray(head)
        for _ in range(rng.randint(1, 12)):
            at = rng.randrange(0, 4096) if rng.random() < 0.8 else rng.randrange(len(mutant))
            mutant[at] = rng.randrange(256)
        got = needs(whole(bytes(mutant) + data[len(head):]))
        assert got is None or all(isinstance(n, str) and len(n) <= 255 for n in got.needed)
    assert time.perf_counter() - started < 20


# -- MetaLookup --------------------------------------------------------------

def build_meta(tmp_path, tree: Path) -> tuple[FileStore, str, bytes]:
    store = FileStore(str(tmp_path / "store"))
    digest = build(store, str(tree)).digest
    refstore = RefStore(store)
    return store, digest, refstore.meta_image(refstore.layer(digest))


def test_lookups_follow_symlinks_inside_the_image(tmp_path):
    tree = tmp_path / "tree"
    (tree / "usr/lib/x").mkdir(parents=True)
    (tree / "usr/lib/x/libbig.so.1.0").write_bytes(os.urandom(3 << 20 | 5))
    (tree / "usr/lib/x/small").write_bytes(b"tiny")
    os.symlink("libbig.so.1.0", tree / "usr/lib/x/libbig.so.1")
    os.symlink("usr/lib", tree / "lib")
    os.symlink("/usr/lib/x/../x/libbig.so.1", tree / "abs")
    os.symlink("loop2", tree / "loop1")
    os.symlink("loop1", tree / "loop2")
    os.symlink("/../../../etc", tree / "up")
    (tree / "etc").mkdir()
    (tree / "etc/passwd").write_bytes(os.urandom(9000))  # the image's own /etc
    _, _, image = build_meta(tmp_path, tree)
    lookup = MetaLookup(whole(image))
    where, blocks = lookup.file_chunks("/lib/x/libbig.so.1")
    assert where == "/usr/lib/x/libbig.so.1.0" and len(blocks) == 4
    assert lookup.file_chunks("/abs") == (where, blocks)
    assert lookup.file_chunks("/lib/x/small") is None  # inline: no chunks
    assert lookup.file_chunks("/lib/x") is None  # a directory
    assert lookup.file_chunks("/lib/x/small/more") is None
    assert lookup.file_chunks("/loop1") is None
    assert lookup.file_chunks("/up/passwd")[0] == "/etc/passwd"  # the image's root is the top
    assert lookup.file_chunks("/nowhere/libc.so.6") is None
    assert lookup.file_chunks("/" + "./" * 70 + "abs") is None  # past MAX_STEPS
    assert lookup.file_chunks("/" + "./" * 10 + "abs") == (where, blocks)


# -- the fetch-ahead over a real layer -----------------------------------------

def blob_of(tmp_path, tree: Path, libraries: bool) -> tuple:
    """``tree`` built into a file store, and its blob over a fetcher whose
    policy has the library fetch-ahead on or off, the meta image handed over:
    (the fetcher, the blob, the meta image)."""
    store, digest, image = build_meta(tmp_path, tree)
    refstore = RefStore(store)
    table = refstore.chunk_table(refstore.layer(digest))
    (tmp_path / "meta.erofs").write_bytes(image)
    f = fetcher(tmp_path, store)
    blob = BlobFile(digest, table, f, 1, Prefetcher(f, libraries=libraries))
    blob.know_files(tmp_path / "meta.erofs")
    return f, blob, image


def first_chunks(lookup: MetaLookup, blob: BlobFile, paths: list[str]) -> dict[str, list]:
    """Each file's chunk entries, by path."""
    at = {e.blob_offset: e for e in blob.table.entries}
    return {p: [at[b * 4096] for b in lookup.file_chunks(p)[1]] for p in paths}


async def settled(f, wanted: list, quiet: float = 0.3) -> None:
    """Until every chunk of ``wanted`` is fetched (at most 20 s), then
    ``quiet`` seconds more in which nothing else is fetched."""
    with trio.move_on_after(20):
        while any(f.absent(e.sha256) for e in wanted):
            await trio.sleep(0.01)
    await trio.sleep(quiet)
    await f.writes_done()


@needs_debian_amd64
@pytest.mark.parametrize("on", [True, False], ids=["on", "off"])
def test_a_program_missed_from_its_start_brings_its_libraries_and_theirs(tmp_path, on):
    tree = tmp_path / "tree"
    libs = program_tree(tree)
    f, blob, image = blob_of(tmp_path, tree, on)
    lookup = MetaLookup(whole(image))
    files = first_chunks(lookup, blob, ["/usr/bin/prog", *libs])
    prog = files.pop("/usr/bin/prog")[0]

    wanted = [e for chunks in files.values() for e in chunks]

    async def main() -> None:
        async with f.tasks.open() as group:
            data = await blob.read(prog.blob_offset, 4096)  # the loader reads its header
            assert bytes(data[:4]) == b"\x7fELF"
            await settled(f, wanted if on else [])
            group.cancel_scope.cancel()

    trio.run(main)
    fetched = {path: not f.absent(chunks[0].sha256) for path, chunks in files.items()}
    if on:  # libpcre2 is libselinux's: a second level
        assert all(fetched.values()), fetched
        assert all(not f.absent(e.sha256) for chunks in files.values() for e in chunks)
    else:
        assert not any(fetched.values()), fetched


def test_files_that_name_themselves_or_escape_are_followed_once(tmp_path):
    tree = tmp_path / "tree"
    (tree / "usr/lib").mkdir(parents=True)
    (tree / "etc").mkdir()
    (tree / "etc/secret").write_bytes(os.urandom(9000))
    pad = os.urandom(8192)  # not inline: chunked files
    (tree / "usr/lib/liba.so").write_bytes(elf([b"liba.so", b"libb.so"]) + pad)
    (tree / "usr/lib/libb.so").write_bytes(elf([b"liba.so", b"../../etc/secret",
                                                b"/etc/secret"]) + pad)
    (tree / "prog").write_bytes(elf([b"liba.so"], interp=b"/usr/lib/libb.so") + pad)
    f, blob, image = blob_of(tmp_path, tree, True)
    files = first_chunks(MetaLookup(whole(image)), blob, ["/prog", "/usr/lib/liba.so",
                                                   "/usr/lib/libb.so", "/etc/secret"])
    asked: list[bytes] = []
    fetch_ahead = blob.prefetcher.fetch_ahead
    blob.prefetcher.fetch_ahead = lambda entries: (  # type: ignore[method-assign]
        asked.extend(e.sha256 for e in entries), fetch_ahead(entries))

    async def main() -> None:
        async with f.tasks.open() as group:
            await blob.read(files["/prog"][0].blob_offset, 4096)
            await settled(f, [files["/etc/secret"][0]])
            group.cancel_scope.cancel()

    trio.run(main)
    assert blob.libraries is not None and len(blob.libraries.followed) == 4
    assert len(asked) == len(set(asked)) == 3  # liba, libb, the secret: each asked once
    # an absolute name is a path in the layer (as the loader takes it); "../" is no name
    assert not f.absent(files["/etc/secret"][0].sha256)


@needs_debian_amd64
@pytest.mark.daemon_log(r"library fetch-ahead of a file failed: RuntimeError\('a bug'\)")
def test_a_failing_lookup_costs_its_hint_only(tmp_path, caplog, monkeypatch):
    tree = tmp_path / "tree"
    libs = program_tree(tree)
    f, blob, image = blob_of(tmp_path, tree, True)
    files = first_chunks(MetaLookup(whole(image)), blob, ["/usr/bin/prog", *libs])

    def broken(path):
        raise RuntimeError("a bug")

    assert blob.libraries is not None
    monkeypatch.setattr(MetaLookup, "file_chunks", lambda self, path: broken(path))

    async def main() -> None:
        async with f.tasks.open() as group:
            data = await blob.read(files["/usr/bin/prog"][0].blob_offset, 4096)
            assert bytes(data[:4]) == b"\x7fELF"
            await settled(f, [])
            group.cancel_scope.cancel()

    trio.run(main)
    assert "library fetch-ahead of a file failed" in caplog.text
    assert all(f.absent(chunks[0].sha256) for path, chunks in files.items() if path in libs)


# -- a real daemon ------------------------------------------------------------

@needs_debian_amd64
@pytest.mark.parametrize("on,partial", [(True, False), (False, False), (True, True)],
                         ids=["on", "off", "on-partial-file"])
def test_a_sandbox_that_opens_a_program_finds_its_libraries_held(tmp_path, on, partial):
    """Node tier (root: a daemon, EROFS and overlay mounts). A sandbox reads
    the first page of a program, as the kernel's exec and the loader do; then
    the store goes away. Its libraries read whole through the sandbox with
    the library fetch-ahead (the daemon fetched them), fail without it; a
    file the program does not name fails either way (the store is gone).
    Over FUSE blob files, and over partial blob files (``--kernel-reads``)."""
    need_root()
    tree, libs, store_dir = program_env(tmp_path)
    node = NodeDaemon(tmp_path / "node", ["--store", f"file://{store_dir}"], read_timeout=2.0,
                      kernel_reads=partial)
    node.extra_args = [] if on else ["--no-library-ahead"]
    node.expected = [re.compile(p) for p in STORE_GONE]
    for _ in serving(node):
        rootfs = up_lazy(node, "s1")
        layers = node.request("stats")["layers"]
        assert [layer.get("partial", False) for layer in layers.values()] == [partial]
        with open(rootfs / "usr/bin/prog", "rb") as f:
            assert f.read(4096)[:4] == b"\x7fELF"
        sizes = sum((tree / p.lstrip("/")).stat().st_size for p in ["/usr/bin/prog", *libs])
        fetched_settles(node, sizes if on else 0)
        store_dir.rename(tmp_path / "gone")
        got = {lib: readable(rootfs / lib.lstrip("/"), tree / lib.lstrip("/")) for lib in libs}
        assert got == dict.fromkeys(libs, on), got
        assert not readable(rootfs / "usr/share/other.bin", tree / "usr/share/other.bin")
        (tmp_path / "gone").rename(store_dir)
        node.cli("down", "s1")
