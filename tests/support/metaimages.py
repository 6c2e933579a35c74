"""Meta images taken apart and put back together, for the tests of the
structural check; and their sample, a small but feature-rich layer."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import pytest

from layerfs.chunks import materialize_blob
from layerfs.formats import erofscheck
from layerfs.formats.erofs import BLOCK, SB_OFFSET, crc32c
from layerfs.refstore import RefStore
from layerfs.store import open_store
from support import build, need_root
from support.gentree import make_tree


def reseal(image: bytes | bytearray) -> bytes:
    """``image`` with its superblock checksum recomputed (so the structure is what's tested)."""
    img = bytearray(image)
    img[SB_OFFSET + 4 : SB_OFFSET + 8] = b"\0\0\0\0"
    checksum = crc32c(bytes(img[SB_OFFSET:BLOCK])) ^ 0xFFFFFFFF
    img[SB_OFFSET + 4 : SB_OFFSET + 8] = struct.pack("<I", checksum)
    return bytes(img)


@dataclass
class Layout:
    """Where the fields of a checked image are: for field-targeted mutations."""

    inodes: list[int]  # byte offsets of inodes
    chunk_indexes: list[int]  # byte offsets of chunk index entries
    dirents: list[int]  # byte offsets of dirents
    names: dict[int, bytes]  # each dirent's name


class _Recorder(erofscheck._Checker):
    """The checker, noting where inodes, chunk indexes and dirents lie."""

    def __init__(self, img: memoryview, blob_size: int, chunk_size: int) -> None:
        super().__init__(img, blob_size, chunk_size)
        self.layout = Layout([], [], [], {})

    def _inode(self, nid: int) -> erofscheck._Inode:
        self.layout.inodes.append(nid * 32)
        return super()._inode(nid)

    def _chunks(self, node: erofscheck._Inode) -> None:
        start = -(-node.body // 8) * 8
        count = -(-node.size // self.chunk_size)
        self.layout.chunk_indexes += [start + 8 * i for i in range(count)]
        super()._chunks(node)

    def _pieces(self, node: erofscheck._Inode) -> list[memoryview]:
        pieces = super()._pieces(node)
        if node.fmt == 0o040000:
            nblocks = len(pieces)
            for i in range(nblocks):
                inline = node.layout == erofscheck.LAYOUT_FLAT_INLINE and i == nblocks - 1
                at = node.body if inline else (node.i_u + i) * BLOCK
                first = struct.unpack_from("<H", self.img, at + 8)[0]
                self.layout.dirents += [at + 12 * k for k in range(first // 12)]
                for k, (name, _, _) in enumerate(self._dir_block(node.nid, pieces[i])):
                    self.layout.names[at + 12 * k] = name
        return pieces


def layout_of(image: bytes, blob_size: int, chunk_size: int) -> Layout:
    rec = _Recorder(memoryview(image), blob_size, chunk_size)
    rec.run()
    return rec.layout


CHUNK = 65536  # the sample's chunk size


@dataclass
class Sample:
    """A built layer: its meta image, blob file and sizes."""

    image: bytes
    blob: Path
    blob_size: int
    chunk_size: int
    layout: Layout


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> Sample:
    """A small but feature-rich layer (gentree: xattrs, links, devices, holes)."""
    need_root()
    work = tmp_path_factory.mktemp("erofscheck")
    src = make_tree(str(work / "src"), seed=3, chunk_size=CHUNK, big_dir=300,
                    long_names=True)
    store = open_store("file://" + str(work / "store"))
    result = build(store, src, name="s", chunk_size=CHUNK)
    refstore = RefStore(store)
    manifest = refstore.layer(result.digest)
    image = refstore.meta_image(manifest)
    blob = work / "blob.img"
    materialize_blob(store, refstore.chunk_table(manifest), str(blob))
    store.close()
    return Sample(image, blob, manifest.blob_size, manifest.chunk_size,
                  layout_of(image, manifest.blob_size, manifest.chunk_size))
