"""From an image source to one checked single-platform :class:`Image`.

:func:`resolve_image` reads the manifest the reference names, checks its
digest where one is known (a ``@sha256:`` reference, a layout's or an
index's descriptor), picks the platform of an index (``--platform``, by
default the host's), reads the config through a digest check and pairs each
layer with its diff_id. :func:`image_config` turns the config into the
:class:`~layerfs.manifest.ImageConfig` an env carries. Everything the
documents say is type-checked; what does not fit is one ``SourceError``.
"""

from __future__ import annotations

import hashlib
import json
import platform as host
from typing import Any

from layerfs.bounds import cut, summary
from layerfs.errors import IntegrityError, SourceError, UsageError
from layerfs.manifest import ImageConfig, check_image_config
from layerfs.names import DIGEST_RE

from .image import (
    INDEX_TYPES,
    LAYER_COMPRESSION,
    MANIFEST_TYPES,
    MAX_DOCUMENT,
    Descriptor,
    DigestCheckedReader,
    Image,
    ImageLayer,
    ImageSource,
    Platform,
)

MAX_INDEX_DEPTH = 3  # an index naming an index naming a manifest, at most
HOST_ARCH = {"x86_64": ("amd64", ""), "amd64": ("amd64", ""), "aarch64": ("arm64", "v8"),
             "arm64": ("arm64", "v8"), "armv7l": ("arm", "v7"), "armv6l": ("arm", "v6"),
             "ppc64le": ("ppc64le", ""), "s390x": ("s390x", ""), "riscv64": ("riscv64", "")}
DEFAULT_VARIANT = {"arm64": "v8"}  # the variant an image without one means


def host_platform() -> Platform:
    """The platform this machine runs: linux/amd64 on x86_64, linux/arm64 on aarch64."""
    arch, variant = HOST_ARCH.get(host.machine(), (host.machine(), ""))
    return Platform("linux", arch, variant)


def parse_platform(text: str) -> Platform:
    """``OS/ARCH[/VARIANT]``."""
    parts = text.split("/")
    if len(parts) not in (2, 3) or not all(parts):
        raise UsageError(f"invalid platform {text!r} (expected OS/ARCH[/VARIANT])")
    return Platform(*parts)


def _field(doc: dict, key: str, kind: type | tuple[type, ...], what: str,
           default: Any = None) -> Any:
    value = doc.get(key)
    if value is None:  # missing or null
        return default
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise SourceError(what, f"field {key!r} has the wrong type")
    return value


def _strings(value: object, what: str, key: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SourceError(what, f"field {key!r} must be a list of strings")
    return list(value)


def parse_descriptor(doc: object, what: str) -> Descriptor:
    """A content descriptor from its JSON, its fields type-checked."""
    if not isinstance(doc, dict):
        raise SourceError(what, "a descriptor is not an object")
    media = _field(doc, "mediaType", str, what, "")
    digest = _field(doc, "digest", str, what, "")
    size = _field(doc, "size", int, what, -1)
    if not digest or size < 0:
        raise SourceError(what, "a descriptor lacks its digest or size")
    if not DIGEST_RE.fullmatch(digest):
        raise SourceError(what, f"unsupported or malformed digest {digest[:80]!r}")
    plat = _field(doc, "platform", dict, what)
    annotations = _field(doc, "annotations", dict, what) or {}
    if not all(isinstance(v, str) for v in annotations.values()):
        raise SourceError(what, "annotations must be strings")
    platform = None
    if plat is not None:
        platform = Platform(_field(plat, "os", str, what, ""),
                            _field(plat, "architecture", str, what, ""),
                            _field(plat, "variant", str, what, ""))
    return Descriptor(media, digest, size, platform, dict(annotations))


def load_document(data: bytes, what: str) -> dict:
    if len(data) > MAX_DOCUMENT:
        raise SourceError(what, f"larger than {MAX_DOCUMENT >> 20} MiB")
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise SourceError(what, f"not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise SourceError(what, "not a JSON object")
    return doc


def check_digest(data: bytes, digest: str, what: str) -> None:
    got = "sha256:" + hashlib.sha256(data).hexdigest()
    if got != digest:
        raise IntegrityError(what, f"digest {got}, expected {digest}")


def platform_matches(have: Platform | None, want: Platform) -> bool:
    if have is None or have.os != want.os or have.architecture != want.architecture:
        return False
    if not want.variant:
        return True
    default = DEFAULT_VARIANT.get(want.architecture, "")
    return (have.variant or default) == want.variant


def pick_platform(index: dict, want: Platform, what: str) -> Descriptor:
    """The index entry for ``want``; without a requested variant an exact
    variant match (the host's) is preferred over any other."""
    entries = index.get("manifests")
    if not isinstance(entries, list):
        raise SourceError(what, "an index without a manifests list")
    descs = [parse_descriptor(e, what) for e in entries]
    matching = [d for d in descs if platform_matches(d.platform, want)]
    if not matching:
        have = sorted({_show(d.platform) for d in descs if d.platform})
        listed = f"{len(have)}: {summary(have)}" if have else "none"
        raise SourceError(what, f"no image for platform {_show(want)} (the index's platforms, "
                                f"{listed})")
    exact = [d for d in matching if d.platform and d.platform.variant == want.variant]
    return (exact or matching)[0]


def _show(p: Platform | None) -> str:
    if p is None:
        return "?"
    return cut("/".join(x for x in (p.os, p.architecture, p.variant) if x), 80)


def read_manifest(source: ImageSource, want: Platform, what: str) -> tuple[str, bytes, dict]:
    """The single-platform manifest: digest, bytes and parsed document."""
    data, media = source.get_manifest()
    expected = source.pinned_digest()
    for _ in range(MAX_INDEX_DEPTH):
        if expected:
            check_digest(data, expected, f"{what} manifest")
        digest = expected or "sha256:" + hashlib.sha256(data).hexdigest()
        doc = load_document(data, f"{what} manifest")
        media = media or _field(doc, "mediaType", str, what, "")
        if not media and "manifests" in doc:
            media = INDEX_TYPES[0]
        if media in MANIFEST_TYPES:
            return digest, data, doc
        if media not in INDEX_TYPES:
            raise SourceError(what, f"unknown manifest media type {media[:100]!r}")
        chosen = pick_platform(doc, want, what)
        expected = chosen.digest
        data, media = source.get_manifest(expected)
        media = media or chosen.media_type
    raise SourceError(what, f"indexes nested deeper than {MAX_INDEX_DEPTH}")


def read_config(source: ImageSource, desc: Descriptor, what: str) -> bytes:
    if desc.size > MAX_DOCUMENT:
        raise SourceError(what, f"config of {desc.size} bytes (at most {MAX_DOCUMENT >> 20} MiB)")
    with source.open_blob(desc) as raw:
        reader = DigestCheckedReader(raw, desc.digest, desc.size, f"{what} config")
        data = b""
        while chunk := reader.read(1 << 16):
            data += chunk
    return data


def resolve_image(source: ImageSource, want: Platform | None = None) -> Image:
    """The image ``source`` names, for ``want`` (default: the host's platform)."""
    what = source.describe()
    explicit = want is not None
    want = want or host_platform()
    digest, data, doc = read_manifest(source, want, what)
    config_desc = parse_descriptor(doc.get("config"), what)
    layer_docs = doc.get("layers")
    if not isinstance(layer_docs, list):
        raise SourceError(what, "the manifest has no layers list")
    blobs = [parse_descriptor(d, what) for d in layer_docs]
    for blob in blobs:
        if blob.media_type not in LAYER_COMPRESSION:
            raise SourceError(what, f"unknown layer media type {blob.media_type[:100]!r}")
    config = read_config(source, config_desc, what)
    cdoc = load_document(config, f"{what} config")
    if explicit:
        have = Platform(str(cdoc.get("os", "")), str(cdoc.get("architecture", "")),
                        str(cdoc.get("variant", "")))
        if not platform_matches(have, want):
            raise SourceError(what, f"the image is for {_show(have)}, not {_show(want)}")
    diff_ids = _diff_ids(cdoc, what)
    if len(diff_ids) != len(blobs):
        raise SourceError(what, f"the config lists {len(diff_ids)} diff_ids for "
                                f"{len(blobs)} layers")
    layers = tuple(ImageLayer(b, d) for b, d in zip(blobs, diff_ids, strict=True))
    return Image(digest, data, config_desc.digest, config, layers)


def _diff_ids(cdoc: dict, what: str) -> list[str]:
    rootfs = cdoc.get("rootfs")
    if not isinstance(rootfs, dict):
        raise SourceError(what, "the config has no rootfs")
    diff_ids = _strings(rootfs.get("diff_ids"), what, "rootfs.diff_ids")
    for d in diff_ids:
        if not DIGEST_RE.fullmatch(d):
            raise SourceError(what, f"malformed diff_id {d[:80]!r} (not sha256:<64 hex>)")
    return diff_ids


def image_config(image: Image) -> ImageConfig:
    """What the image config says about running the image."""
    what = "image config"
    doc = load_document(image.config, what)
    run = doc.get("config") or {}
    if not isinstance(run, dict):
        raise SourceError(what, "field 'config' is not an object")

    def opt_list(key: str) -> list[str] | None:
        value = run.get(key)
        return None if value is None else _strings(value, what, key)

    labels = _field(run, "Labels", dict, what) or {}
    if not all(isinstance(v, str) for v in labels.values()):
        raise SourceError(what, "field 'Labels' must map strings to strings")
    ports = _field(run, "ExposedPorts", dict, what) or {}
    config = ImageConfig(
        env=opt_list("Env") or [],
        entrypoint=opt_list("Entrypoint"),
        cmd=opt_list("Cmd"),
        working_dir=_field(run, "WorkingDir", str, what, ""),
        user=_field(run, "User", str, what, ""),
        labels=dict(labels),
        exposed_ports=sorted(str(p) for p in ports),
        stop_signal=_field(run, "StopSignal", str, what, ""),
        os=_field(doc, "os", str, what, "linux"),
        architecture=_field(doc, "architecture", str, what, ""),
    )
    check_image_config(config, what)  # what an env manifest can hold, before any layer is built
    return config
