"""Image sources on local disk: an OCI image layout (``oci:DIR[:TAG]``), a tar
of one (``oci-archive:FILE[:TAG]``) and ``docker save`` output
(``docker-archive:FILE[:NAME:TAG]``), plus :func:`open_source`, which turns
what the user wrote into an :class:`ImageSource` (``docker://`` goes to the
registry client).

Archives are read in place: their headers are scanned once (through the
bounded tar reader the layer builder uses) and a blob is a seek to its member,
so an archive is never unpacked to disk. Nothing here checks a digest; the
resolver and the importer do, as they stream.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import tarfile
from dataclasses import dataclass
from typing import BinaryIO

from layerfs.errors import SourceError
from layerfs.safeopen import open_error, open_regular, open_regular_path

from ..tarsource import BoundedTarFile, TarFormatError
from .image import (
    DOCKER_CONFIG,
    DOCKER_MANIFEST,
    MAX_DOCUMENT,
    Descriptor,
    ImageSource,
)
from .resolve import parse_descriptor as descriptor

REF_NAME = "org.opencontainers.image.ref.name"
DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
MAX_LINK_HOPS = 8
LAYOUT_SCHEMES = ("oci:", "oci-archive:", "docker-archive:")


@dataclass(frozen=True)
class SourceSpec:
    """A parsed ``scheme:PATH[:REF]``."""

    scheme: str  # "oci", "oci-archive", "docker-archive"
    path: str
    ref: str  # "" when none was given


def split_path_ref(rest: str) -> tuple[str, str]:
    """``PATH[:REF]``: the shortest prefix at a colon that exists on disk is the
    path (a path may hold colons; a reference like ``name:tag`` does too)."""
    if os.path.exists(rest):
        return rest, ""
    for pos, char in enumerate(rest):
        if char == ":" and os.path.exists(rest[:pos]):
            return rest[:pos], rest[pos + 1 :]
    return rest, ""


def parse_spec(text: str) -> SourceSpec:
    for scheme in LAYOUT_SCHEMES:
        if text.startswith(scheme):
            path, ref = split_path_ref(text[len(scheme) :])
            return SourceSpec(scheme[:-1], path, ref)
    raise SourceError(text, "expected docker://HOST/REPO:TAG, oci:DIR[:TAG], "
                            "oci-archive:FILE or docker-archive:FILE")


def open_source(text: str, plain_http: bool = False, timeout: float | None = None
                ) -> ImageSource:
    """The image source ``text`` names; ``timeout``: a registry's (seconds
    without progress, see :mod:`.registry`)."""
    if text.startswith("docker://"):
        from .registry import DEFAULT_TIMEOUT, RegistrySource  # urllib3 and TLS: registries only

        return RegistrySource(text, plain_http=plain_http,
                              timeout=DEFAULT_TIMEOUT if timeout is None else timeout)
    spec = parse_spec(text)
    if not os.path.exists(spec.path):
        raise SourceError(text, "no such file or directory")
    if spec.scheme == "oci":
        files = DirectoryFiles(spec.path, text)
        try:
            return LayoutSource(text, files, spec.ref)
        except BaseException:
            files.close()
            raise
    archive = ArchiveFiles(spec.path, text)
    if spec.scheme == "oci-archive":
        return LayoutSource(text, archive, spec.ref)
    return DockerArchiveSource(text, archive, spec.ref)


def blob_path(digest: str, what: str) -> str:
    """``blobs/sha256/<hex>`` for a well-formed sha256 digest."""
    if not DIGEST_RE.fullmatch(digest):
        raise SourceError(what, f"unsupported or malformed digest {digest[:80]!r}")
    return "blobs/sha256/" + digest[len("sha256:") :]


def read_document(stream: BinaryIO, what: str) -> bytes:
    """A JSON document, at most :data:`MAX_DOCUMENT` bytes."""
    with stream:
        data = stream.read(MAX_DOCUMENT + 1)
    if len(data) > MAX_DOCUMENT:
        raise SourceError(what, f"larger than {MAX_DOCUMENT >> 20} MiB")
    return data


def _strings(value: object, what: str) -> list[str]:
    """A list of strings (None: empty), or one error."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SourceError(what, "manifest.json: RepoTags must be a list of strings")
    return value


def parse_json(data: bytes, what: str) -> object:
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise SourceError(what, f"not valid JSON ({exc})") from None


class DirectoryFiles:
    """Files of a layout directory, by relative path. The layout is not
    trusted: each file is opened from a descriptor of the directory with no
    symlink on the way (``blobs/sha256`` a symlink, a blob linked to a host
    file) and must be a regular file (a FIFO would hang the import)."""

    def __init__(self, root: str, what: str) -> None:
        self.root = root
        try:
            self.fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise SourceError(what, f"{root}: {open_error(exc)}") from None

    def open(self, path: str, what: str) -> BinaryIO:
        try:
            fd = open_regular(self.fd, path)
        except OSError as exc:
            raise SourceError(what, f"{path}: {open_error(exc)}") from None
        return os.fdopen(fd, "rb")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class ArchiveFiles:
    """Members of an uncompressed tar, by normalised path; each open is a seek."""

    def __init__(self, path: str, what: str) -> None:
        self.what = what
        try:
            fd = open_regular_path(path)
        except OSError as exc:
            raise SourceError(what, open_error(exc)) from None
        self.file = os.fdopen(fd, "rb")
        try:
            self.tar = BoundedTarFile.open(fileobj=self.file, mode="r:")
            members = self.tar.getmembers()
        except (TarFormatError, tarfile.TarError, OSError) as exc:
            self.file.close()
            raise SourceError(what, f"not a readable uncompressed tar archive ({exc})") from None
        self.members = {posixpath.normpath(m.name).lstrip("/"): m for m in members}

    def member(self, path: str, what: str) -> tarfile.TarInfo:
        name = posixpath.normpath(path)
        for _ in range(MAX_LINK_HOPS):
            info = self.members.get(name)
            if info is None:
                raise SourceError(what, f"{path}: no such member in the archive")
            if info.islnk():  # a hard link names its target from the archive's root
                name = posixpath.normpath(info.linkname)
            elif info.issym():
                name = posixpath.normpath(posixpath.join(posixpath.dirname(name), info.linkname))
            else:
                return info
        raise SourceError(what, f"{path}: too many symlinks in the archive")

    def open(self, path: str, what: str) -> BinaryIO:
        info = self.member(path, what)
        stream = self.tar.extractfile(info) if info.isreg() else None
        if stream is None:
            raise SourceError(what, f"{path}: not a regular file in the archive")
        return stream  # type: ignore[return-value]

    def close(self) -> None:
        self.tar.close()
        self.file.close()


Files = DirectoryFiles | ArchiveFiles


class LayoutSource(ImageSource):
    """An OCI image layout: ``index.json`` names the images, ``blobs/`` holds them."""

    def __init__(self, text: str, files: Files, tag: str) -> None:
        self.text = text
        self.files = files
        self.tag = tag
        self.chosen = self._choose()

    def describe(self) -> str:
        return self.text

    def _choose(self) -> Descriptor:
        """The index.json entry the tag names (or its only entry)."""
        data = read_document(self.files.open("index.json", self.text), self.text)
        doc = parse_json(data, f"{self.text} index.json")
        entries = doc.get("manifests") if isinstance(doc, dict) else None
        if not isinstance(entries, list):
            raise SourceError(self.text, "index.json has no manifests list")
        descs = [descriptor(e, f"{self.text} index.json") for e in entries]
        if self.tag:
            named = [d for d in descs if d.annotations.get(REF_NAME) == self.tag]
            if not named:
                raise SourceError(self.text, f"no image tagged {self.tag!r} in the layout")
            return named[0]
        if len(descs) != 1:
            tags = sorted(d.annotations.get(REF_NAME, "?") for d in descs)
            raise SourceError(self.text, f"the layout holds {len(descs)} images; name one "
                                         f"with :TAG (tags: {', '.join(tags) or 'none'})")
        return descs[0]

    def pinned_digest(self) -> str | None:
        return self.chosen.digest

    def get_manifest(self, digest: str | None = None) -> tuple[bytes, str]:
        desc_type = self.chosen.media_type if digest is None else ""
        digest = digest or self.chosen.digest
        stream = self.files.open(blob_path(digest, self.text), self.text)
        return read_document(stream, f"{self.text} manifest {digest}"), desc_type

    def open_blob(self, desc: Descriptor) -> BinaryIO:
        return self.files.open(blob_path(desc.digest, self.text), self.text)

    def close(self) -> None:
        self.files.close()


class DockerArchiveSource(ImageSource):
    """``docker save`` output: ``manifest.json`` lists each image's config and
    layer tars. There is no image manifest, so one is made (Docker schema 2):
    the config's digest is its sha256; an uncompressed layer's digest is its
    diff_id (checked as it streams); a layer stored as ``blobs/sha256/<hex>``
    (newer ``docker save``) has that digest."""

    def __init__(self, text: str, files: ArchiveFiles, ref: str) -> None:
        self.text = text
        self.files = files
        self.paths: dict[str, str] = {}  # digest -> member path
        self.manifest = self._make_manifest(self._entry(ref))

    def describe(self) -> str:
        return self.text

    def _entry(self, ref: str) -> dict:
        data = read_document(self.files.open("manifest.json", self.text), self.text)
        doc = parse_json(data, f"{self.text} manifest.json")
        if not isinstance(doc, list) or not all(isinstance(e, dict) for e in doc) or not doc:
            raise SourceError(self.text, "manifest.json is not a list of images")
        if ref:
            named = [e for e in doc if ref in _strings(e.get("RepoTags"), self.text)]
            if not named:
                raise SourceError(self.text, f"no image tagged {ref!r} in the archive")
            return named[0]
        if len(doc) != 1:
            raise SourceError(self.text, f"the archive holds {len(doc)} images; name one "
                                         "with :NAME:TAG")
        return doc[0]

    def _make_manifest(self, entry: dict) -> bytes:
        config_path, layer_paths = entry.get("Config"), entry.get("Layers")
        if not isinstance(config_path, str) or not isinstance(layer_paths, list):
            raise SourceError(self.text, "manifest.json entry lacks Config or Layers")
        config = read_document(self.files.open(config_path, self.text), self.text)
        config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
        self.paths[config_digest] = config_path
        doc = parse_json(config, f"{self.text} config")
        rootfs = doc.get("rootfs") if isinstance(doc, dict) else None
        diff_ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
        if not isinstance(diff_ids, list) or len(diff_ids) != len(layer_paths):
            raise SourceError(self.text, f"config lists {len(diff_ids or [])} diff_ids for "
                                         f"{len(layer_paths)} layers")
        layers = [self._layer(str(p), str(d)) for p, d in zip(layer_paths, diff_ids, strict=True)]
        manifest = {"schemaVersion": 2, "mediaType": DOCKER_MANIFEST,
                    "config": {"mediaType": DOCKER_CONFIG, "digest": config_digest,
                               "size": len(config)},
                    "layers": layers}
        return json.dumps(manifest).encode()

    def _layer(self, path: str, diff_id: str) -> dict:
        info = self.files.member(path, self.text)
        with self.files.open(path, self.text) as stream:
            head = stream.read(4)
        compressed = head.startswith((b"\x1f\x8b", b"\x28\xb5\x2f\xfd"))
        named = re.fullmatch(r"blobs/sha256/([0-9a-f]{64})", posixpath.normpath(path))
        if named:
            digest = "sha256:" + named.group(1)
        elif compressed:
            raise SourceError(self.text, f"{path}: a compressed layer whose digest is unknown")
        else:
            digest = diff_id
        kind = ("gzip" if head.startswith(b"\x1f\x8b")
                else "zstd" if compressed else "")
        media = "application/vnd.docker.image.rootfs.diff.tar" + (f".{kind}" if kind else "")
        self.paths[digest] = path
        return {"mediaType": media, "digest": digest, "size": info.size}

    def get_manifest(self, digest: str | None = None) -> tuple[bytes, str]:
        return self.manifest, DOCKER_MANIFEST

    def open_blob(self, desc: Descriptor) -> BinaryIO:
        path = self.paths.get(desc.digest)
        if path is None:
            raise SourceError(self.text, f"no blob {desc.digest} in the archive")
        return self.files.open(path, self.text)

    def close(self) -> None:
        self.files.close()
