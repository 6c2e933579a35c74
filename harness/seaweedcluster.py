"""A real multi-process SeaweedFS cluster for the ``cluster`` tests and bench.

One ``weed master`` (default replication 000), three ``weed volume`` servers
in one data center on three racks, one ``weed filer`` and two ``weed s3``
gateways on it, all on free 127.0.0.1 ports with their data under one
directory. Two buckets: ``rep010`` (``fs.configure``: a copy on another rack,
survives one volume server) and ``rep000`` (one copy: a killed volume server
loses what it held). Every process is started with PR_SET_PDEATHSIG and
stopped by its pid.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import boto3
from botocore.config import Config

from harness.s3server import DUMMY_AWS_ENV, free_ports
from harness.serverprocs import die_with_parent, log_tail

BUCKET_010 = "rep010"
BUCKET_000 = "rep000"
START_TIMEOUT = 90.0
VOLUMES = 3


@dataclass
class Service:
    """One weed process: its name, port and log."""

    name: str
    port: int
    args: list[str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    def start(self, cwd: Path) -> None:
        env = os.environ | DUMMY_AWS_ENV
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=cwd, env=env, preexec_fn=die_with_parent,  # noqa: PLW1509
            )  # fmt: skip

    def pause(self) -> None:
        """SIGSTOP: a hung server, whose port still takes connections but
        never answers (the gateway waits on it, as on a lost machine)."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.running():
            assert self.process is not None
            os.kill(self.process.pid, signal.SIGCONT)

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL (a crash, and weed ignores SIGTERM in practice) and reap."""
        if self.running():
            assert self.process is not None
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Cluster:
    """The running cluster; ``endpoints`` are the two S3 gateways."""

    weed: str
    root: Path
    master: Service
    volumes: list[Service]
    filer: Service
    gateways: list[Service]
    stopped: list[Service] = field(default_factory=list)
    paused: list[Service] = field(default_factory=list)

    @property
    def endpoints(self) -> list[str]:
        return [g.url for g in self.gateways]

    def services(self) -> list[Service]:
        return [self.master, *self.volumes, self.filer, *self.gateways]

    def client(self, endpoint: str | None = None) -> object:
        return boto3.session.Session(
            aws_access_key_id=DUMMY_AWS_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=DUMMY_AWS_ENV["AWS_SECRET_ACCESS_KEY"],
            region_name="us-east-1",
        ).client("s3", endpoint_url=endpoint or self.endpoints[0],
                 config=Config(s3={"addressing_style": "path"},
                               retries={"total_max_attempts": 1}))

    def volume_of(self, bucket: str, key: str) -> Service:
        """The volume server holding the (first chunk of the) object, by the filer's
        metadata and the master's volume lookup (replication 000: the only copy)."""
        path = urllib.parse.quote(f"/buckets/{bucket}/{key}")
        with urllib.request.urlopen(f"{self.filer.url}{path}?metadata=true", timeout=10) as r:
            entry = json.load(r)
        chunks = entry.get("chunks") or entry.get("Chunks") or []
        fid = chunks[0].get("file_id") or chunks[0].get("fileId")
        volume = fid.split(",")[0]
        with urllib.request.urlopen(f"{self.master.url}/dir/lookup?volumeId={volume}",
                                    timeout=10) as r:
            where = json.load(r)["locations"][0]["url"]
        return next(v for v in self.volumes if where.endswith(f":{v.port}"))

    def kill(self, service: Service) -> None:
        service.kill()
        self.stopped.append(service)

    def pause(self, service: Service) -> None:
        service.pause()
        self.paused.append(service)

    def restart_stopped(self) -> None:
        """Resume what a test paused, start again what it killed, and wait
        until the cluster serves."""
        for service in self.paused:
            service.resume()
        self.paused.clear()
        for service in self.stopped:
            service.start(self.root)
        self.stopped.clear()
        self.wait_ready()

    def log_tails(self) -> str:
        return "\n".join(f"--- {s.name}\n{log_tail(s.log_path, 10)}" for s in self.services())

    def _volume_servers_known(self) -> int:
        try:
            with urllib.request.urlopen(self.master.url + "/dir/status", timeout=2) as reply:
                status = json.load(reply)
        except (OSError, ValueError):
            return 0
        centers = status.get("Topology", {}).get("DataCenters") or []
        racks = [rack for center in centers for rack in center.get("Racks") or []]
        return sum(len(rack.get("DataNodes") or []) for rack in racks)

    def _answers(self, url: str) -> bool:
        try:
            with urllib.request.urlopen(url + "/", timeout=2):
                return True
        except urllib.error.HTTPError:
            return True
        except OSError:
            return False

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [s.name for s in self.services() if not s.running()]
            if dead:
                raise RuntimeError(f"weed {dead} exited during start:\n{self.log_tails()}")
            if (self._volume_servers_known() == len(self.volumes)
                    and all(self._answers(u) for u in self.endpoints)):
                return
            time.sleep(0.3)
        raise RuntimeError(f"SeaweedFS cluster not ready in {timeout:.0f}s:\n{self.log_tails()}")

    def shell(self, command: str) -> str:
        """Run one ``weed shell`` command against the cluster."""
        proc = subprocess.run(
            [self.weed, "shell", f"-master=127.0.0.1:{self.master.port}",
             f"-filer=127.0.0.1:{self.filer.port}"],
            input=command + "\nexit\n", capture_output=True, text=True, timeout=60,
            env=os.environ | DUMMY_AWS_ENV,
        )  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"weed shell {command!r}: {proc.stderr}{proc.stdout}")
        return proc.stdout

    def stop(self) -> None:
        for service in reversed(self.services()):
            service.kill()
        for service in self.services():
            for number in (service.port, service.port + 10000):
                for sock in Path("/tmp").glob(f"seaweedfs-*-{number}.sock"):
                    sock.unlink(missing_ok=True)


def _services(weed: str, root: Path) -> tuple[Service, list[Service], Service, list[Service]]:
    master_port, *ports = free_ports(4 + VOLUMES)
    volume_ports, filer_port, s3_ports = ports[:VOLUMES], ports[VOLUMES], ports[VOLUMES + 1:]
    common = [weed, "-logtostderr"]
    master_at = f"127.0.0.1:{master_port}"
    (root / "master").mkdir(parents=True, exist_ok=True)
    master = Service("master", master_port, [
        *common, "master", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-port={master_port}",
        f"-mdir={root / 'master'}", "-defaultReplication=000", "-volumeSizeLimitMB=64",
        "-telemetry=false"], root / "master.log")  # fmt: skip
    volumes = []
    for number, port in enumerate(volume_ports):
        data = root / f"volume{number}"
        data.mkdir(exist_ok=True)
        volumes.append(Service(f"volume{number}", port, [
            *common, "volume", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-port={port}",
            f"-dir={data}", "-max=60", f"-master={master_at}", "-dataCenter=dc1",
            f"-rack=rack{number}"], root / f"volume{number}.log"))  # fmt: skip
    (root / "filer").mkdir(exist_ok=True)
    filer = Service("filer", filer_port, [
        *common, "filer", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-port={filer_port}",
        f"-master={master_at}", f"-defaultStoreDir={root / 'filer'}"],
        root / "filer.log")  # fmt: skip
    gateways = [Service(f"s3-{n}", port, [
        *common, "s3", "-ip.bind=127.0.0.1", f"-port={port}", f"-filer=127.0.0.1:{filer_port}",
        "-port.iceberg=0", "-port.lance=0"], root / f"s3-{n}.log")
        for n, port in enumerate(s3_ports)]  # fmt: skip
    return master, volumes, filer, gateways


def start_cluster(weed: str, root: Path) -> Cluster:
    """Start the cluster under ``root``, create and configure its two buckets."""
    master, volumes, filer, gateways = _services(weed, root)
    cluster = Cluster(weed, root, master, volumes, filer, gateways)
    try:
        for service in cluster.services():
            service.start(root)
            if service is master:
                time.sleep(0.5)  # let it listen before the others dial it
        cluster.wait_ready()
        client = cluster.client()
        for bucket in (BUCKET_010, BUCKET_000):
            client.create_bucket(Bucket=bucket)  # type: ignore[attr-defined]
        cluster.shell(f"fs.configure -locationPrefix=/buckets/{BUCKET_010}/"
                      f" -replication=010 -apply")
    except BaseException:
        cluster.stop()
        raise
    return cluster
