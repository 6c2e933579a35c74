"""A throwaway containerd (Debian's 1.6) for tests that take it as the reference.

:func:`running_containerd` starts ``containerd`` on its own root, state and
socket under a test directory (no network, the CRI plugin and the snapshotters
and plugins that need more than a plain directory disabled) and stops it by
its pid. :class:`ContainerdServer` drives it with ``ctr --address``: import an
image archive (OCI layout or docker-archive tar) and unpack it with the
overlayfs snapshotter, mount an image's unpacked tree read-only.

``extra_config`` is appended to the generated ``config.toml``, for tests that
add plugins: :func:`proxy_snapshotter_config` (layerfs's snapshotter) and
:func:`cri_config` (the CRI plugin, with ``cri=True``: what Kubernetes pulls
through; :func:`cri_pull` is its PullImage, the one call the tests make).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from harness.serverprocs import die_with_parent, log_tail, stop_process, wait_ready

START_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0
CTR_TIMEOUT = 120.0
NAMESPACE = "layerfs-test"
SNAPSHOTTER = "overlayfs"
DISABLED_PLUGINS = ["io.containerd.grpc.v1.cri", "io.containerd.internal.v1.opt",
                    "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
                    "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper",
                    "io.containerd.tracing.processor.v1.otlp"]
UNPACKED = re.compile(r"^unpacking (\S+) \(sha256:[0-9a-f]{64}\)\.\.\.done$", re.M)


def find_containerd() -> str | None:
    return shutil.which("containerd") if shutil.which("ctr") else None


def config_text(directory: Path, extra_config: str = "", cri: bool = False) -> str:
    disabled = ", ".join(f'"{p}"' for p in DISABLED_PLUGINS
                         if not (cri and p == "io.containerd.grpc.v1.cri"))
    return (f'version = 2\nroot = "{directory / "root"}"\nstate = "{directory / "state"}"\n'
            f"disabled_plugins = [{disabled}]\n\n"
            f'[grpc]\n  address = "{directory / "containerd.sock"}"\n'
            f'[ttrpc]\n  address = "{directory / "containerd.sock.ttrpc"}"\n'
            '[debug]\n  address = ""\n[metrics]\n  address = ""\n' + extra_config)


@dataclass
class ContainerdServer:
    """A running containerd and the ``ctr`` that talks to it."""

    directory: Path
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def address(self) -> Path:
        return self.directory / "containerd.sock"

    def ctr(self, *args: str, check: bool = True,
            namespace: str = NAMESPACE) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(["ctr", "--address", str(self.address), "--namespace", namespace,
                               *args], capture_output=True, text=True, timeout=CTR_TIMEOUT)
        if check and proc.returncode != 0:
            raise RuntimeError(f"ctr {' '.join(args)}: {proc.stderr.strip()}")
        return proc

    def import_image(self, archive: Path, check: bool = True
                     ) -> subprocess.CompletedProcess[str]:
        """``ctr image import`` (unpacked with the overlayfs snapshotter)."""
        return self.ctr("image", "import", "--snapshotter", SNAPSHOTTER, str(archive),
                        check=check)

    def imported_names(self, proc: subprocess.CompletedProcess[str]) -> list[str]:
        """The image names an import unpacked."""
        return UNPACKED.findall(proc.stdout)

    @contextmanager
    def mounted(self, image: str, target: Path) -> Iterator[Path]:
        """The image's unpacked tree mounted read-only at ``target``."""
        target.mkdir(parents=True, exist_ok=True)
        self.ctr("image", "mount", "--snapshotter", SNAPSHOTTER, image, str(target))
        try:
            yield target
        finally:
            self.ctr("image", "unmount", "--rm", str(target))

    def log_tail(self, lines: int = 30) -> str:
        return log_tail(self.log_path, lines)

    def wait_ready(self) -> None:
        wait_ready(self.process, self.answers, "containerd", self.log_tail, START_TIMEOUT,
                   self.stop)

    def answers(self) -> bool:
        return self.address.exists() and self.ctr("version", check=False).returncode == 0

    def stop(self) -> None:
        """SIGTERM containerd's pid (SIGKILL if it lingers)."""
        stop_process(self.process, STOP_TIMEOUT)


def start_containerd(binary: str, directory: Path, extra_config: str = "",
                     cri: bool = False) -> ContainerdServer:
    """Start containerd with its files under ``directory`` and wait until it answers."""
    directory.mkdir(parents=True, exist_ok=True)
    config_path = directory / "config.toml"
    config_path.write_text(config_text(directory, extra_config, cri))
    log_path = directory / "containerd.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [binary, "--config", str(config_path)], stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, cwd=directory, preexec_fn=die_with_parent,  # noqa: PLW1509
        )
    server = ContainerdServer(directory, process, log_path)
    server.wait_ready()
    return server


@contextmanager
def running_containerd(directory: Path, extra_config: str = "",
                       cri: bool = False) -> Iterator[ContainerdServer]:
    """A containerd for the ``with`` block (a module-scoped fixture's body)."""
    binary = find_containerd()
    if binary is None:
        raise RuntimeError("containerd is not installed (make deps installs it)")
    server = start_containerd(binary, directory, extra_config, cri)
    try:
        yield server
    finally:
        server.stop()


def proxy_snapshotter_config(name: str, socket: Path) -> str:
    """A ``proxy_plugins`` entry: the snapshotter ``name`` served at ``socket``."""
    return (f'[proxy_plugins]\n  [proxy_plugins.{name}]\n    type = "snapshot"\n'
            f'    address = "{socket}"\n')


def cri_config(directory: Path, snapshotter: str, plain_http_registry: str) -> str:
    """The CRI plugin pulling with ``snapshotter``, from ``plain_http_registry``
    (HOST:PORT) over HTTP, serving nothing on TCP, with empty CNI directories."""
    for sub in ("cni-bin", "cni-conf"):
        (directory / sub).mkdir(parents=True, exist_ok=True)
    cri = '[plugins."io.containerd.grpc.v1.cri"'
    return (f'{cri}]\n  disable_tcp_service = true\n  stream_server_address = "127.0.0.1"\n'
            '  stream_server_port = "0"\n'
            f'{cri}.containerd]\n  snapshotter = "{snapshotter}"\n'
            '  disable_snapshot_annotations = false\n'
            f'{cri}.cni]\n  bin_dir = "{directory / "cni-bin"}"\n'
            f'  conf_dir = "{directory / "cni-conf"}"\n'
            f'{cri}.registry.mirrors."{plain_http_registry}"]\n'
            f'  endpoint = ["http://{plain_http_registry}"]\n')


def _cri_messages() -> tuple[type, type]:
    """CRI's PullImageRequest and PullImageResponse (runtime.v1), the fields
    used: a request's image.image, a response's image_ref (wire-compatible
    with the whole of Kubernetes' api.proto)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    field = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(name="layerfs_test_cri.proto",
                                               package="runtime.v1", syntax="proto3")
    spec = proto.message_type.add(name="ImageSpec")
    spec.field.add(name="image", number=1, type=field.TYPE_STRING, label=field.LABEL_OPTIONAL)
    request = proto.message_type.add(name="PullImageRequest")
    request.field.add(name="image", number=1, type=field.TYPE_MESSAGE,
                      type_name=".runtime.v1.ImageSpec", label=field.LABEL_OPTIONAL)
    response = proto.message_type.add(name="PullImageResponse")
    response.field.add(name="image_ref", number=1, type=field.TYPE_STRING,
                       label=field.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return (message_factory.GetMessageClass(pool.FindMessageTypeByName(
                "runtime.v1.PullImageRequest")),
            message_factory.GetMessageClass(pool.FindMessageTypeByName(
                "runtime.v1.PullImageResponse")))


def cri_pull(address: Path, image: str, timeout: float = CTR_TIMEOUT) -> str:
    """The CRI's PullImage of ``image`` from the containerd at ``address``
    (what the kubelet asks): its image ref."""
    import grpc

    request_type, response_type = _cri_messages()
    with grpc.insecure_channel(f"unix:{address}") as channel:
        pull = channel.unary_unary("/runtime.v1.ImageService/PullImage",
                                   request_serializer=lambda m: m.SerializeToString(),
                                   response_deserializer=response_type.FromString)
        request = request_type()
        request.image.image = image
        return str(pull(request, timeout=timeout).image_ref)
