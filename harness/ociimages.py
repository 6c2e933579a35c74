"""Test images made with the real tools: ``umoci`` builds OCI image layouts from
tree changes, ``skopeo`` turns them into ``oci-archive:`` and ``docker-archive:``
files.

:func:`make_image` takes a list of :class:`LayerChange` (files written,
directories made, symlinks, hard links, paths deleted — umoci writes whiteouts
for them — or a directory made opaque and refilled) and an
:class:`ImageSettings` for the config. Each change is one image layer:
``umoci unpack``, the change, ``umoci repack``; an opaque directory goes in
as a tar written here, added with ``umoci raw add-layer``.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class LayerChange:
    """What one image layer changes in the tree below it."""

    files: dict[str, bytes] = field(default_factory=dict)  # path -> content
    dirs: list[str] = field(default_factory=list)
    symlinks: dict[str, str] = field(default_factory=dict)  # path -> target
    hardlinks: dict[str, str] = field(default_factory=dict)  # new path -> existing path
    delete: list[str] = field(default_factory=list)  # files or whole directories
    modes: dict[str, int] = field(default_factory=dict)  # path -> permission bits
    xattrs: dict[str, dict[str, bytes]] = field(default_factory=dict)  # path -> name -> value
    copy_tree: str | None = None  # a directory copied onto the root first
    opaque_dir: str | None = None  # this directory made opaque, then ``files`` put in it


@dataclass
class ImageSettings:
    """The image config ``umoci config`` writes."""

    env: list[str] = field(default_factory=list)
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    working_dir: str = ""
    user: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    exposed_ports: list[str] = field(default_factory=list)
    stop_signal: str = ""
    architecture: str = ""


def run(*argv: str) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{' '.join(argv)}: {proc.stderr}"
    return proc.stdout


def make_image(layout: Path, tag: str, layers: list[LayerChange],
               settings: ImageSettings | None = None, base: str | None = None) -> Path:
    """Tag ``tag`` in the layout (made if missing): ``base``'s layers (or none)
    plus one image layer per change, with ``settings`` as its config."""
    if not (layout / "index.json").exists():
        run("umoci", "init", "--layout", str(layout))
    image = f"{layout}:{tag}"
    if base:
        run("umoci", "tag", "--image", f"{layout}:{base}", tag)
    else:
        run("umoci", "new", "--image", image)
    for change in layers:
        _add_layer(image, change)
    if settings:
        run("umoci", "config", "--image", image, *_config_args(settings))
    return layout


def _add_layer(image: str, change: LayerChange) -> None:
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as work:
        if change.opaque_dir:
            tar = _opaque_tar(Path(work) / "layer.tar", change.opaque_dir, change.files)
            run("umoci", "raw", "add-layer", "--image", image, str(tar))
            return
        bundle = Path(work) / "bundle"
        run("umoci", "unpack", "--image", image, str(bundle))
        _write(bundle / "rootfs", change)
        run("umoci", "repack", "--image", image, str(bundle))


def _opaque_tar(path: Path, directory: str, files: dict[str, bytes]) -> Path:
    """A layer tar: ``directory``, its opaque marker, then ``files`` in it.
    (umoci 0.4.7's ``insert --opaque`` writes a tar without its end blocks.)"""
    now = int(time.time())
    top = directory.strip("/")
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(top)
        info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, now
        tar.addfile(info)
        tar.addfile(tarfile.TarInfo(f"{top}/.wh..wh..opq"))
        for name, data in files.items():
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size, info.mode, info.mtime = len(data), 0o644, now
            tar.addfile(info, io.BytesIO(data))
    return path


def _write(root: Path, change: LayerChange) -> None:
    if change.copy_tree:
        shutil.copytree(change.copy_tree, root, symlinks=True, dirs_exist_ok=True)
    for path in change.delete:
        target = root / path
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        else:
            target.unlink()
    for path in change.dirs:
        (root / path).mkdir(parents=True, exist_ok=True)
    for path, data in change.files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)
    for path, target in change.symlinks.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).symlink_to(target)
    for path, existing in change.hardlinks.items():
        os.link(root / existing, root / path)
    for path, mode in change.modes.items():
        (root / path).chmod(mode)
    for path, attrs in change.xattrs.items():
        for name, value in attrs.items():
            os.setxattr(root / path, name, value, follow_symlinks=False)


def _config_args(s: ImageSettings) -> list[str]:
    args = [f"--config.env={e}" for e in s.env]
    args += [f"--config.entrypoint={e}" for e in s.entrypoint]
    args += [f"--config.cmd={c}" for c in s.cmd]
    args += [f"--config.label={k}={v}" for k, v in s.labels.items()]
    args += [f"--config.exposedports={p}" for p in s.exposed_ports]
    for flag, value in (("--config.workingdir", s.working_dir), ("--config.user", s.user),
                        ("--config.stopsignal", s.stop_signal),
                        ("--architecture", s.architecture)):
        if value:
            args.append(f"{flag}={value}")
    return args


def to_oci_archive(layout: Path, tag: str, path: Path) -> Path:
    run("skopeo", "--insecure-policy", "copy", f"oci:{layout}:{tag}", f"oci-archive:{path}")
    return path


def to_docker_archive(layout: Path, tag: str, path: Path, name: str = "test/image") -> Path:
    run("skopeo", "--insecure-policy", "copy", f"oci:{layout}:{tag}",
        f"docker-archive:{path}:{name}:{tag}")
    return path


def busybox_rootfs(root: Path, applets: tuple[str, ...] = ("sh", "ls", "cat", "echo", "env",
                                                             "pwd", "id")) -> Path:
    """A minimal rootfs: the static busybox and a few applets, /etc/passwd."""
    for sub in ("bin", "etc", "proc", "dev", "tmp", "root"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    shutil.copy("/bin/busybox", root / "bin" / "busybox")
    for applet in applets:
        (root / "bin" / applet).symlink_to("busybox")
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (root / "etc" / "group").write_text("root:x:0:\n")
    return root


def manifest_of(layout: Path, tag: str) -> tuple[Path, dict]:
    """The path and parsed manifest of a tag in the layout."""
    index = json.loads((layout / "index.json").read_text())
    for desc in index["manifests"]:
        if desc.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag:
            path = blob(layout, desc["digest"])
            return path, json.loads(path.read_bytes())
    raise KeyError(tag)


def blob(layout: Path, digest: str) -> Path:
    return layout / "blobs" / "sha256" / digest.removeprefix("sha256:")


def tiny_layers_image(layout: Path, tag: str, layers: list[dict[str, bytes] | Path],
                      config: dict | None = None) -> Path:
    """Tag ``tag`` in a layout written here, without umoci (fast for hundreds of
    layers): one gzip layer per dict of files (path -> content) or directory
    tree, bottom first; equal dicts are one blob the manifest names twice.
    ``config`` goes into the image config's ``config``."""
    (layout / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    descs, diff_ids = [], []
    for files in layers:
        tar = _tree_tar(files) if isinstance(files, Path) else _files_tar(files)
        descs.append({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                      **_put(layout, gzip.compress(tar, 1, mtime=0))})
        diff_ids.append("sha256:" + hashlib.sha256(tar).hexdigest())
    image_config = {"architecture": "amd64", "os": "linux", "config": config or {},
                    "rootfs": {"type": "layers", "diff_ids": diff_ids}}
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                           **_put(layout, json.dumps(image_config).encode())},
                "layers": descs}
    index_path = layout / "index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else {
        "schemaVersion": 2, "manifests": []}
    index["manifests"].append({"mediaType": "application/vnd.oci.image.manifest.v1+json",
                               **_put(layout, json.dumps(manifest).encode()),
                               "annotations": {"org.opencontainers.image.ref.name": tag}})
    index_path.write_text(json.dumps(index))
    return layout


def _files_tar(files: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _tree_tar(root: Path) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for child in sorted(root.iterdir()):
            tar.add(child, arcname=child.name)
    return out.getvalue()


def _put(layout: Path, data: bytes) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256" / digest).write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}
