"""An env out as an OCI image: an image layout directory or an archive of one.

``oci:DIR[:TAG]`` writes an OCI image layout (``oci-layout``, ``index.json``
naming the manifest under ``org.opencontainers.image.ref.name`` = TAG,
``blobs/sha256/...``); ``oci-archive:FILE[:TAG]`` a tar of such a layout. The
tag defaults to ``latest``.

One OCI layer per layerfs layer, bottom first (an env lists its layers top
first), each a gzip'd (or zstd) tar written by
:func:`~layerfs.builder.oci.layertar.write_layer_tar` straight into the
layout's blob directory: the tar is hashed (the diff_id) and compressed, and
the compressed stream hashed and written to a temporary file renamed to its
digest, so no layer is ever whole in memory. An image layer imported with a
tar-split record (:mod:`~layerfs.builder.oci.tarsplit`) is written from the
record instead, its original tar byte for byte, checked against its diff_id
(a mismatch fails the export). ``fold`` writes one layer of the
merged tree instead. The image config carries the env's
:class:`~layerfs.manifest.ImageConfig`.

Trees are read from the layers' meta images, checked against their digests
and structure, and file bytes through the chunk tables, every chunk
sha256-checked: nothing is mounted. Nothing is half-written: a new layout is
built in a temporary directory beside DIR and renamed; into an existing
layout the blobs go first and ``index.json`` is replaced last (new blobs are
removed again if the export fails); an archive is written to a temporary
file and linked into place.

Everything is written by descriptor (:mod:`.destfiles`): DEST's directory is
opened once, DEST and ``blobs/sha256`` without following symlinks, and a
symlink where the export writes is refused, so an existing layout cannot send
the blobs elsewhere. Temporaries (``.DEST.tmp-<pid>-<random>`` beside DEST,
``.tmp-<pid>-<random>`` in a layout) are locked by their exporter; the next
export to the same place removes those a killed export left.
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import json
import os
import re
import shutil
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import zstandard

from layerfs.errors import DestinationExists, IntegrityError, UsageError
from layerfs.formats.erofsread import read_meta_image
from layerfs.manifest import EnvManifest, ImageConfig, TarSplitRef
from layerfs.refstore import ENVS, RefStore
from layerfs.safeopen import open_error, open_regular
from layerfs.store.base import Store
from layerfs.tree import FileTree, FsNode

from .destfiles import (
    check_regular_or_missing,
    new_temp_dir,
    new_temp_file,
    open_dir,
    remove_quietly,
    remove_stale_temps,
    tar_directory,
    write_atomic,
)
from .image import MAX_DOCUMENT, OCI_CONFIG, OCI_INDEX, OCI_MANIFEST, Descriptor
from .layertar import BlobRanges, LayerTree, TarStats, fold_layers, write_layer_tar
from .tarsplit import read_record, write_tar_from_record

REF_NAME = "org.opencontainers.image.ref.name"
LAYOUT_FILE = "oci-layout"
LAYOUT_VERSION = {"imageLayoutVersion": "1.0.0"}
TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
DEFAULT_TAG = "latest"
LAYER_TYPES = {
    "gzip": "application/vnd.oci.image.layer.v1.tar+gzip",
    "zstd": "application/vnd.oci.image.layer.v1.tar+zstd",
}
GZIP_LEVEL = 6
ZSTD_LEVEL = 3
GOARCH = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "i686": "386",
          "ppc64le": "ppc64le", "s390x": "s390x", "riscv64": "riscv64"}


def host_architecture() -> str:
    """The host's architecture as OCI names it (Go's GOARCH)."""
    machine = os.uname().machine
    return GOARCH.get(machine, machine)


@dataclass(frozen=True)
class Destination:
    """Where an export goes: ``oci`` (a layout directory) or ``oci-archive``."""

    transport: str
    path: str
    tag: str

    def __str__(self) -> str:
        return f"{self.transport}:{self.path}:{self.tag}"


def parse_destination(text: str) -> Destination:
    """``oci:DIR[:TAG]`` or ``oci-archive:FILE[:TAG]``."""
    transport, sep, rest = text.partition(":")
    if not sep or transport not in ("oci", "oci-archive") or not rest:
        raise UsageError(f"destination {text!r}: expected oci:DIR[:TAG] or oci-archive:FILE[:TAG]")
    path, tag = rest, DEFAULT_TAG
    head, colon, tail = rest.rpartition(":")
    if colon and head and "/" not in tail:
        path, tag = head, tail
    if not TAG_RE.fullmatch(tag):
        raise UsageError(f"destination {text!r}: {tag!r} is not a valid tag")
    return Destination(transport, path, tag)


@dataclass
class ExportedLayer:
    """One layer of the exported image."""

    source: str  # the layerfs layer(s) it was made from
    digest: str  # the compressed blob
    size: int
    diff_id: str  # sha256 of the uncompressed tar
    stats: TarStats


@dataclass
class ExportResult:
    env: str
    destination: str
    manifest_digest: str
    config_digest: str
    layers: list[ExportedLayer] = field(default_factory=list)


# -- streaming a blob into a layout --

class _HashingSink:
    """A write-only stream that hashes and counts what passes, then forwards it."""

    def __init__(self, out: BinaryIO | None = None) -> None:
        self.out = out
        self.hash = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        self.hash.update(data)
        self.size += len(data)
        if self.out is not None:
            self.out.write(data)
        return len(data)

    def flush(self) -> None:
        if self.out is not None:
            self.out.flush()

    @property
    def digest(self) -> str:
        return "sha256:" + self.hash.hexdigest()


class Layout:
    """An OCI image layout being written in the directory ``fd`` (the caller's
    descriptor, opened without following a symlink); ``where`` names it in
    errors. ``blobs/sha256`` is opened (or made) without following symlinks,
    files are made relative to these descriptors, and a symlink or a special
    file where the export writes (``oci-layout``, ``index.json``, a blob) is
    refused before anything is written. Stale temporaries of killed exports
    are removed. ``created`` lists the blobs this export added (removed again
    by :meth:`discard_new`)."""

    def __init__(self, fd: int, where: str) -> None:
        self.fd, self.where = fd, where
        for name in (LAYOUT_FILE, "index.json"):
            check_regular_or_missing(fd, name, where)
        blobs = open_dir(fd, "blobs", where, create=True)
        try:
            self.blob_fd = open_dir(blobs, "sha256", where, create=True)
        finally:
            os.close(blobs)
        remove_stale_temps(fd)
        remove_stale_temps(self.blob_fd)
        self.created: list[str] = []

    def close(self) -> None:
        os.close(self.blob_fd)

    def _place(self, tmp: str, digest: str) -> None:
        final = digest.removeprefix("sha256:")
        if check_regular_or_missing(self.blob_fd, final, self.where):
            os.unlink(tmp, dir_fd=self.blob_fd)
            return
        os.rename(tmp, final, src_dir_fd=self.blob_fd, dst_dir_fd=self.blob_fd)
        self.created.append(final)

    def put_json(self, doc: dict[str, Any], media_type: str) -> Descriptor:
        data = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        return Descriptor(media_type, digest, self.put_stream(lambda out: out.write(data))[1])

    def put_stream(self, write: Callable[[BinaryIO], object]) -> tuple[str, int]:
        """Run ``write`` on a temporary blob file; the blob is named by its digest."""
        fd, tmp = new_temp_file(self.blob_fd)
        try:
            with os.fdopen(fd, "wb") as f:
                sink = _HashingSink(f)
                write(sink)  # type: ignore[arg-type]
                f.flush()
                os.fsync(f.fileno())
            self._place(tmp, sink.digest)
        except BaseException:
            remove_quietly(self.blob_fd, tmp)
            raise
        return sink.digest, sink.size

    def discard_new(self) -> None:
        for name in self.created:
            remove_quietly(self.blob_fd, name)
        self.created.clear()

    # -- oci-layout and index.json --
    def read_index(self) -> dict[str, Any]:
        try:
            fd = open_regular(self.fd, "index.json")
        except FileNotFoundError:
            return {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": []}
        except OSError as exc:
            raise DestinationExists(self.where, f"index.json: {open_error(exc)}") from None
        with os.fdopen(fd, "rb") as f:
            try:
                doc = json.loads(f.read(MAX_DOCUMENT + 1))
            except ValueError:
                doc = None
        if not isinstance(doc, dict) or not isinstance(doc.get("manifests"), list):
            raise DestinationExists(self.where, "index.json is not an OCI image index")
        return doc

    def write_index(self, doc: dict[str, Any]) -> None:
        """``oci-layout``, then ``index.json`` replaced atomically (last)."""
        if not check_regular_or_missing(self.fd, LAYOUT_FILE, self.where):
            write_atomic(self.fd, LAYOUT_FILE, json.dumps(LAYOUT_VERSION).encode())
        write_atomic(self.fd, "index.json",
                     json.dumps(doc, indent=2, sort_keys=True).encode() + b"\n")


# -- layers --

@dataclass
class _SourceLayer:
    ref: str
    tree: FileTree
    ranges: BlobRanges
    chunk_size: int
    tar_split: TarSplitRef | None = None  # an image layer's own tar, kept at import


@dataclass
class _OutputLayer:
    """One layer tar to write: rebuilt from ``tree``, or, where ``kept`` is
    given, the image layer's original tar from its tar-split record."""

    source: str
    tree: LayerTree
    kept: _SourceLayer | None = None


def _load_layers(refstore: RefStore, env: EnvManifest) -> list[_SourceLayer]:
    """The env's layers bottom first, each tree read from its checked meta image."""
    out = []
    for layer in reversed(env.layers):
        manifest = refstore.layer(layer.digest)
        meta = read_meta_image(refstore.meta_image(manifest))
        table = refstore.chunk_table(manifest)
        out.append(_SourceLayer(layer.ref, meta.tree, BlobRanges(table), manifest.chunk_size,
                                manifest.tar_split))
    return out


def _layer_trees(layers: list[_SourceLayer], fold: bool) -> list[_OutputLayer]:
    if not fold:
        return [_OutputLayer(layer.ref, LayerTree(layer.tree, _constant_source(layer)),
                             layer if layer.tar_split else None) for layer in layers]
    tree, origin = fold_layers([layer.tree for layer in layers])

    def source_of(node: FsNode) -> tuple[BlobRanges, int]:
        layer = layers[origin[id(node)]]
        return layer.ranges, layer.chunk_size

    return [_OutputLayer("+".join(layer.ref for layer in reversed(layers)),
                         LayerTree(tree, source_of))]


def _constant_source(layer: _SourceLayer) -> Callable[[FsNode], tuple[BlobRanges, int]]:
    return lambda _node: (layer.ranges, layer.chunk_size)


def _write_layer(store: Store, layout: Layout, layer: _OutputLayer,
                 compression: str) -> ExportedLayer:
    diff = _HashingSink()
    write_tar = _tar_writer(store, layer)

    def write(out: BinaryIO) -> None:
        if compression == "zstd":
            with zstandard.ZstdCompressor(level=ZSTD_LEVEL).stream_writer(
                    out, closefd=False) as packed:  # type: ignore[arg-type]
                diff.out = packed  # type: ignore[assignment]
                write_tar(diff)
            _check_kept(layer, diff)
            return
        with gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0,
                           compresslevel=GZIP_LEVEL) as packed:
            diff.out = packed  # type: ignore[assignment]
            write_tar(diff)
        _check_kept(layer, diff)

    digest, size = layout.put_stream(write)
    return ExportedLayer(layer.source, digest, size, diff.digest, layer.tree.stats)


def _tar_writer(store: Store, layer: _OutputLayer) -> Callable[[_HashingSink], TarStats]:
    """How the layer's tar is written: from its tar-split record (checked and
    parsed now, before anything is written), or rebuilt from its tree."""
    kept = layer.kept
    if kept is None or kept.tar_split is None:
        return lambda out: write_layer_tar(store, layer.tree, out)  # type: ignore[arg-type]
    split = read_record(store, kept.tar_split, kept.tree, kept.chunk_size, kept.ref)
    layer.tree.stats = split.stats

    def write(out: _HashingSink) -> TarStats:
        write_tar_from_record(store, split, kept.ranges, kept.chunk_size,
                              out, kept.ref)  # type: ignore[arg-type]
        return split.stats

    return write


def _check_kept(layer: _OutputLayer, diff: _HashingSink) -> None:
    """A tar written from a record must be the image layer's: its diff_id."""
    ref = layer.kept.tar_split if layer.kept else None
    if ref is not None and (diff.digest != ref.diff_id or diff.size != ref.tar_size):
        raise IntegrityError(f"tar-split record of {layer.source}",
                             f"the tar written has {diff.digest}, not its diff_id {ref.diff_id}")


# -- config and manifest --

def image_config(env: EnvManifest, diff_ids: list[str]) -> dict[str, Any]:
    """The OCI image config of an env: its ImageConfig and the layers' diff_ids."""
    config = env.config or ImageConfig()
    run: dict[str, Any] = {}
    if config.env:
        run["Env"] = config.env
    if config.entrypoint is not None:
        run["Entrypoint"] = config.entrypoint
    if config.cmd is not None:
        run["Cmd"] = config.cmd
    for key, value in (("WorkingDir", config.working_dir), ("User", config.user),
                       ("StopSignal", config.stop_signal)):
        if value:
            run[key] = value
    if config.labels:
        run["Labels"] = config.labels
    if config.exposed_ports:
        run["ExposedPorts"] = {port: {} for port in config.exposed_ports}
    return {
        "created": env.created,
        "architecture": config.architecture or host_architecture(),
        "os": config.os or "linux",
        "config": run,
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }


def _descriptor_doc(desc: Descriptor) -> dict[str, Any]:
    return {"mediaType": desc.media_type, "digest": desc.digest, "size": desc.size}


def _write_image(store: Store, layout: Layout, env: EnvManifest, layers: list[_SourceLayer],
                 fold: bool, compression: str) -> tuple[Descriptor, Descriptor,
                                                         list[ExportedLayer]]:
    exported = [_write_layer(store, layout, layer, compression)
                for layer in _layer_trees(layers, fold)]
    config = layout.put_json(image_config(env, [x.diff_id for x in exported]), OCI_CONFIG)
    manifest = layout.put_json({
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": _descriptor_doc(config),
        "layers": [{"mediaType": LAYER_TYPES[compression], "digest": x.digest, "size": x.size}
                   for x in exported],
        "annotations": {"org.opencontainers.image.created": env.created},
    }, OCI_MANIFEST)
    return manifest, config, exported


def _tagged_index(index: dict[str, Any], manifest: Descriptor, tag: str,
                  where: str) -> dict[str, Any]:
    """``index`` with ``manifest`` under ``tag``; a tag naming another image is refused."""
    for entry in index["manifests"]:
        if isinstance(entry, dict) and entry.get("annotations", {}).get(REF_NAME) == tag:
            if entry.get("digest") == manifest.digest:
                return index
            raise DestinationExists(where, f"tag {tag!r} names another image")
    entry = _descriptor_doc(manifest)
    entry["annotations"] = {REF_NAME: tag}
    return {**index, "manifests": [*index["manifests"], entry]}


# -- the whole export --

def check_destination(dest: Destination) -> None:
    """Refuse what the export would overwrite: an existing archive, or an
    existing directory that is not an OCI image layout, or a symlink; the
    parent directory must exist."""
    parent = os.path.dirname(os.path.abspath(dest.path))
    if not os.path.isdir(parent):
        raise UsageError(f"destination {dest.path}: directory {parent} does not exist")
    if os.path.islink(dest.path):
        raise DestinationExists(dest.path, "is a symlink (refused)")
    if dest.transport == "oci-archive":
        if os.path.lexists(dest.path):
            raise DestinationExists(dest.path, "file exists")
        return
    if os.path.lexists(dest.path):
        if not os.path.isdir(dest.path):
            raise DestinationExists(dest.path, "exists and is not a directory")
        has_layout = os.path.lexists(os.path.join(dest.path, LAYOUT_FILE))
        if os.listdir(dest.path) and not has_layout:
            raise DestinationExists(dest.path, "exists and is not an OCI image layout")


def export_env(refstore: RefStore, env_ref: str, dest: Destination, fold: bool = False,
               compression: str = "gzip") -> ExportResult:
    """Export env ``env_ref`` of ``refstore``'s store to ``dest`` (see the module docstring)."""
    if compression not in LAYER_TYPES:
        raise UsageError(f"compression {compression!r}: expected gzip or zstd")
    store = refstore.store
    env_digest = refstore.resolve(ENVS, env_ref)
    env = refstore.env(env_digest)
    check_destination(dest)
    layers = _load_layers(refstore, env)
    parent_fd = os.open(os.path.dirname(os.path.abspath(dest.path)),
                        os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return _export_at(store, env, layers, dest, parent_fd, fold, compression)
    finally:
        os.close(parent_fd)


def _export_at(store: Store, env: EnvManifest, layers: list[_SourceLayer], dest: Destination,
               parent_fd: int, fold: bool, compression: str) -> ExportResult:
    """The export, everything written relative to ``parent_fd`` (DEST's directory)."""
    name = os.path.basename(os.path.abspath(dest.path))
    remove_stale_temps(parent_fd, f".{name}")
    if dest.transport == "oci":
        try:
            dest_fd = open_dir(parent_fd, name, dest.path)
        except FileNotFoundError:
            pass
        else:
            try:
                return _into_layout(store, env, layers, dest, dest_fd, fold, compression)
            finally:
                os.close(dest_fd)
    staging_fd, staging = new_temp_dir(parent_fd, f".{name}")
    try:
        layout = Layout(staging_fd, dest.path)
        try:
            manifest, config, exported = _write_image(store, layout, env, layers, fold,
                                                      compression)
            layout.write_index(_tagged_index(layout.read_index(), manifest, dest.tag,
                                             dest.path))
            if dest.transport == "oci":
                os.fchmod(staging_fd, 0o755)
                _rename_into_place(parent_fd, staging, name, dest.path)
            else:
                _archive(staging_fd, parent_fd, name, dest.path)
        finally:
            layout.close()
    finally:
        os.close(staging_fd)
        shutil.rmtree(staging, dir_fd=parent_fd, ignore_errors=True)
    return ExportResult(f"{env.name}@{env.version}", str(dest), manifest.digest, config.digest,
                        exported)


def _rename_into_place(parent_fd: int, staging: str, name: str, where: str) -> None:
    try:
        os.rename(staging, name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
            raise DestinationExists(where, "appeared during the export") from None
        raise


def _into_layout(store: Store, env: EnvManifest, layers: list[_SourceLayer], dest: Destination,
                 dest_fd: int, fold: bool, compression: str) -> ExportResult:
    layout = Layout(dest_fd, dest.path)
    try:
        index = layout.read_index()
        manifest, config, exported = _write_image(store, layout, env, layers, fold,
                                                  compression)
        layout.write_index(_tagged_index(index, manifest, dest.tag, dest.path))
    except BaseException:
        layout.discard_new()
        raise
    finally:
        layout.close()
    return ExportResult(f"{env.name}@{env.version}", str(dest), manifest.digest, config.digest,
                        exported)


def _archive(layout_fd: int, parent_fd: int, name: str, where: str) -> None:
    """Tar the layout into a temporary file beside DEST, then link it into place."""
    fd, tmp = new_temp_file(parent_fd, f".{name}")
    try:
        with os.fdopen(fd, "wb") as f:
            tar_directory(layout_fd, [LAYOUT_FILE, "index.json", "blobs"], f, _archive_entry)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd,
                    follow_symlinks=False)
        except FileExistsError:
            raise DestinationExists(where, "file exists") from None
    finally:
        remove_quietly(parent_fd, tmp)


def _archive_entry(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mode = 0o755 if info.isdir() else 0o644
    return info
