"""The systemd unit (deploy/systemd/) for real, under systemd as PID 1: a
container booted with ``systemd-nspawn --boot`` (tests/support/nspawn.py) with
/dev/fuse, the loop devices, every capability, this checkout and its venv,
the node's ROOT (on the host's disk) and a file store bound in; the unit and
its environment file installed as `make install` does.

`systemd-analyze verify` passes on every unit, and `systemd-analyze security`
rates the service's exposure at most SECURITY_TARGET, with the capabilities
and system calls it does not use taken away. A start whose configuration is
missing (no environment file, or no LAYERFS_STORE in it) fails with one
line, shown by `systemctl status`, and is not restarted. The service starts as
``Type=notify`` (``systemctl start`` returns once READY=1 came), its STATUS
says the sandbox count and follows `up`. A process reads a sandbox's files in
a loop and checks every byte while the service is restarted
(``systemctl restart``: the live-restart path) and while its daemon is
killed (``Restart=on-failure``: the same path): not one read fails, the
keeper keeps its pid (in a scope of its own), the mounts are the same ones
and the sandbox is still served. ``systemctl stop`` ends it cleanly:
STOPPING=1, the keeper gone, nothing left mounted.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import IN_CI, build, need_root
from support.nspawn import Container, unavailable

from harness.daemonproc import problem_records
from layerfs.builder.env import create_env
from layerfs.refstore import RefStore
from layerfs.store import open_store

pytestmark = pytest.mark.end_to_end  # the CLI and outside tools, end to end

REPO = Path(__file__).resolve().parent.parent
UNITS = sorted(p for p in (REPO / "deploy" / "systemd").iterdir()
               if p.suffix in (".service", ".socket", ".scope", ".slice", ".target"))
MiB = 1 << 20
FILES, FILE_SIZE = 48, 2 * MiB
ROOT = "/var/lib/layerfs"
STORE = "/srv/store"

# a reader in the container: reads every file of the listing (page cache
# dropped first) with a pause between files, pass after pass until STOP
# exists, then one more; counts the reads that fail (an error or a wrong
# sha256) and notes when each read started
READER = textwrap.dedent("""
    import hashlib, json, os, sys, time
    listing, stop, progress = sys.argv[1:]
    files = json.load(open(listing))
    spans, failures = [], []
    def read(path):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            h = hashlib.sha256()
            while chunk := os.read(fd, 256 * 1024):
                h.update(chunk)
            return h.hexdigest()
        finally:
            os.close(fd)
    while True:
        last = os.path.exists(stop)
        for path, want in files:
            start = time.monotonic()
            try:
                got = read(path)
                if got != want:
                    failures.append(f"{path}: sha256 {got}")
            except OSError as exc:
                failures.append(f"{path}: {exc}")
            spans.append((start, time.monotonic()))
            with open(progress + ".new", "w") as f:
                f.write(str(len(spans)))
            os.replace(progress + ".new", progress)
            time.sleep(0.05)
        if last:
            break
    print(json.dumps({"spans": spans, "failures": failures}))
""")


@dataclass
class Machine:
    box: Container
    io: Path  # the host's side of the container's /io


@pytest.fixture(scope="module")
def machine(starts_a_server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Machine]:
    """A booted container with the unit installed and a file store holding
    env e@1 (layer data@1: FILES files of FILE_SIZE random bytes)."""
    need_root()
    why = unavailable()
    if why is not None:
        if IN_CI:
            pytest.fail(f"CI boots systemd in a container: {why}")
        pytest.skip(why)
    work = tmp_path_factory.mktemp("systemd")
    src, store_dir, node, io = work / "src", work / "store", work / "node", work / "io"
    for path in (src / "data", store_dir, node, io):
        path.mkdir(parents=True)
    sums = {}
    for i in range(FILES):
        data = os.urandom(FILE_SIZE)
        (src / "data" / f"f{i:02d}").write_bytes(data)
        sums[f"f{i:02d}"] = hashlib.sha256(data).hexdigest()
    store = open_store(f"file://{store_dir}")
    try:
        build(store, str(src), name="data", chunk_size=MiB)
        create_env(RefStore(store), "e", "1", ["data@1"])
    finally:
        store.close()
    (io / "listing.json").write_text(json.dumps(
        [[f"{ROOT}/sandboxes/s1/rootfs/data/{name}", want] for name, want in sums.items()]))
    readonly = [REPO] + ([] if Path(sys.prefix).is_relative_to(REPO) else [Path(sys.prefix)])
    box = Container([(node, ROOT), (store_dir, STORE), (io, "/io")], readonly)
    try:
        for unit in UNITS:
            box.write(f"etc/systemd/system/{unit.name}", unit.read_text())
        box.write("usr/local/bin/layerfs", link=f"{sys.prefix}/bin/layerfs")
        box.write("etc/layerfs/daemon.env", f"LAYERFS_STORE=file://{STORE}\n"
                  "LAYERFS_DAEMON_ARGS=--cache-size 512M --read-timeout 20\n", mode=0o600)
        box.boot()
        yield Machine(box, io)
    finally:
        box.close()


def show(box: Container, unit: str = "layerfs.service") -> dict[str, str]:
    props = ("ActiveState,SubState,Result,StatusText,MainPID,NRestarts,ExecMainStatus,"
             "TasksMax,MemoryMax")
    out = box.run("systemctl", "show", f"--property={props}", unit).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def journal(box: Container) -> str:
    """The manager's lines on the unit, then the daemons' own (and their keeper's):
    by their identifier, as journald here (v1 cgroups in a container) puts
    the service's output in init.scope."""
    manager = box.run("journalctl", "--no-pager", "-o", "cat", "-u", "layerfs.service").stdout
    return manager + box.run("journalctl", "--no-pager", "-o", "cat", "-t", "layerfs").stdout


def keepers(box: Container) -> list[int]:
    found = box.run("pgrep", "-f", "-x", ".* -m layerfs.node.fuse.keeper .*", check=False)
    return [int(pid) for pid in found.stdout.split()]


def layerfs_mounts(box: Container) -> dict[str, str]:
    """Mount point → mount id of every mount under ROOT in the container."""
    lines = box.run("cat", "/proc/self/mountinfo").stdout.splitlines()
    return {f[4]: f[0] for f in map(str.split, lines) if f[4].startswith(ROOT + "/")}


def wait_for(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_every_unit_verifies(machine: Machine) -> None:
    assert UNITS, "no units in deploy/systemd"
    for unit in UNITS:
        verified = machine.box.run("systemd-analyze", "verify", f"/etc/systemd/system/{unit.name}",
                               check=False)
        assert verified.returncode == 0, verified.stdout + verified.stderr
        assert unit.stem not in verified.stderr, verified.stderr


# `systemd-analyze security`'s exposure of deploy/systemd/layerfs.service: 8.7
# (EXPOSED) before the capability bounding set, system call filter and the
# rest; 5.3 now. What is left is what a daemon making the host's mounts for
# other processes needs: root, the host's mount namespace and devices,
# SYS_ADMIN, the network (an S3 store) (docs/deploy.md, Hardening)
SECURITY_TARGET = 5.5
# what the daemon never uses, each of which the unit must take away
TAKEN_AWAY = ("CAP_SYS_MODULE", "CAP_SYS_BOOT", "CAP_SYS_TIME", "CAP_SYS_RAWIO", "CAP_BPF",
              "CAP_SYS_PTRACE", "CAP_SYS_(NICE|RESOURCE)", "CAP_NET_ADMIN", "CAP_SYS_CHROOT",
              "CAP_LINUX_IMMUTABLE", "CAP_AUDIT_*", "CAP_SYSLOG", "CAP_MAC_*", "CAP_IPC_LOCK",
              "@module", "@reboot", "@raw-io", "@swap", "@clock", "@debug", "@obsolete",
              "RestrictNamespaces=~user", "RestrictNamespaces=~net", "RestrictNamespaces=~pid",
              "RestrictSUIDSGID=", "ProtectHostname=", "NoNewPrivileges=")


def test_the_unit_is_hardened() -> None:
    """`systemd-analyze security --offline=yes` (systemd 250 and later) on the
    unit file as shipped: its overall exposure, and each item it must pass."""
    if shutil.which("systemd-analyze") is None:
        if IN_CI:
            pytest.fail("CI has systemd-analyze (Debian package systemd)")
        pytest.skip("no systemd-analyze")
    unit = REPO / "deploy" / "systemd" / "layerfs.service"
    rated = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--no-pager",
                            str(unit)], capture_output=True, text=True, timeout=60)
    report = rated.stdout + rated.stderr
    overall = re.search(r"Overall exposure level for layerfs\.service: (\d+\.\d+)", report)
    assert overall, report
    assert float(overall[1]) <= SECURITY_TARGET, report
    passed = {line.split()[1] for line in report.splitlines() if line.startswith("✓")}
    missing = [item for item in TAKEN_AWAY
               if not any(p.endswith(item) or p == f"CapabilityBoundingSet=~{item}"
                          or p == f"SystemCallFilter=~{item}" for p in passed)]
    assert not missing, report
    print(f"systemd-analyze security: {overall[1]}")


def test_restart_and_crash_under_reads_then_stop(machine: Machine) -> None:
    try:
        restart_and_crash_under_reads_then_stop(machine.box, machine.io)
    except AssertionError as exc:  # with the service's journal
        daemons = machine.box.run("journalctl", "--no-pager", "-o", "cat", "-t", "layerfs",
                                  check=False).stdout
        raise AssertionError(f"{exc}\n--- the daemons' journal:\n{daemons[-12000:]}") from None


def restart_and_crash_under_reads_then_stop(box: Container, io: Path) -> None:
    box.run("systemctl", "start", "layerfs.service")  # returns once READY=1 came
    state = show(box)
    assert state["ActiveState"] == "active" and state["SubState"] == "running", state
    assert state["StatusText"] == f"serving 0 sandboxes (store file://{STORE})", state
    [keeper] = keepers(box)
    cgroup = box.run("cat", f"/proc/{keeper}/cgroup").stdout
    scope = re.search(r"/(layerfs-keeper-\d+-1\.scope)$", cgroup, re.M)
    assert scope, cgroup
    props = box.run("systemctl", "show", "--property=Before,Description,ActiveState",
                    scope[1]).stdout
    assert "ActiveState=active" in props, props
    assert re.search(r"^Before=.*\blayerfs\.service\b", props, re.M), props
    bounds = show(box, scope[1])  # the keeper's scope is bounded too
    assert (bounds["TasksMax"], bounds["MemoryMax"]) == ("8", str(128 * MiB)), bounds
    assert (state["TasksMax"], state["MemoryMax"]) == ("2048", str(8 << 30)), state
    # the hardening left the daemon in the host's mount namespace (its mounts
    # are for the runtimes) and made no other namespace than the UTS one
    for ns in ("mnt", "pid", "net", "ipc", "cgroup"):
        links = box.run("readlink", f"/proc/1/ns/{ns}", f"/proc/{state['MainPID']}/ns/{ns}",
                        f"/proc/{keeper}/ns/{ns}").stdout.split()
        assert len(set(links)) == 1, (ns, links)

    rootfs = box.run("layerfs", "up", "e@1", "--id", "s1").stdout.strip()
    assert rootfs == f"{ROOT}/sandboxes/s1/rootfs"
    wait_for(lambda: show(box)["StatusText"].startswith("serving 1 sandbox "), "STATUS")
    mounts = layerfs_mounts(box)
    assert f"{ROOT}/sandboxes/s1/rootfs" in mounts

    reader = box.popen("/usr/bin/python3", "-c", READER, "/io/listing.json", "/io/stop",
                       "/io/progress", stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True)
    try:
        def reads() -> int:
            try:
                return int((io / "progress").read_text() or 0)
            except FileNotFoundError:
                return 0

        wait_for(lambda: reads() >= 3, "the reader's first reads")
        windows = []
        # a restart: the old daemon exits leaving every mount; the new one takes over
        pid = state["MainPID"]
        started = time.monotonic()
        box.run("systemctl", "restart", "layerfs.service")
        windows.append((started, time.monotonic()))
        after = show(box)
        assert after["ActiveState"] == "active" and after["MainPID"] != pid, after
        assert after["StatusText"].startswith("serving 1 sandbox "), after
        assert keepers(box) == [keeper]
        assert layerfs_mounts(box) == mounts  # the same mounts, none made again

        # a crash: Restart=on-failure, the same path
        seen = reads()
        wait_for(lambda: reads() >= seen + 3, "reads after the restart")
        pid = after["MainPID"]
        started = time.monotonic()
        box.run("systemctl", "kill", "--signal=SIGKILL", "--kill-who=main", "layerfs.service")

        def restarted() -> bool:
            now = show(box)
            return (now["MainPID"] not in ("0", pid) and now["ActiveState"] == "active"
                    and now["StatusText"].startswith("serving "))

        wait_for(restarted, "the service restarted after a crash")
        windows.append((started, time.monotonic()))
        after = show(box)
        assert after["NRestarts"] == "1" and after["StatusText"].startswith("serving 1 "), after
        assert keepers(box) == [keeper]
        assert layerfs_mounts(box) == mounts

        seen = reads()
        wait_for(lambda: reads() >= seen + 3, "reads after the crash")
        (io / "stop").touch()
        out, err = reader.communicate(timeout=120)
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait(30)
    assert reader.returncode == 0, err
    result = json.loads(out)
    assert result["failures"] == [], result["failures"][:5]
    assert len(result["spans"]) >= FILES
    for begin, end in windows:  # reads went on while the daemon was switched
        assert any(start <= end and done >= begin for start, done in result["spans"]), \
            (begin, end)
    served = box.run("layerfs", "ps").stdout
    assert re.search(r"^s1\s.*\bup\b", served, re.M), served
    box.run("sha256sum", f"{rootfs}/data/f00")

    box.run("systemctl", "stop", "layerfs.service")
    state = show(box)
    assert state["ActiveState"] == "inactive" and state["Result"] == "success", state
    assert state["ExecMainStatus"] == "0", state
    assert keepers(box) == []
    assert layerfs_mounts(box) == {}
    log = journal(box)
    notes = re.findall(r"Got notification message from PID \d+ \((.*)\)$", log, re.M)
    assert any("READY=1" in n for n in notes), notes
    assert any("STATUS=serving 1 sandbox " in n for n in notes), notes
    assert any("STOPPING=1" in n for n in notes), notes
    assert "systemd restarts the daemon" in log
    assert "left-over process" not in log  # KillMode=mixed: nothing stays behind a daemon
    assert "took over the FUSE connection" in log
    assert problem_records(log) == []  # the daemons' own lines: no warning, error, traceback
    print(f"container booted in {box.boot_seconds:.1f} s")


def test_missing_configuration_fails_the_start(machine: Machine) -> None:
    """No LAYERFS_STORE in the environment file: the start fails, `systemctl
    status` says why in one line, and the daemon is not started again. No
    environment file at all: the start fails, systemd's line in the unit's
    journal says why (and `systemctl status` until the next try)."""
    box, env = machine.box, "/etc/layerfs/daemon.env"
    kept = box.run("cat", env).stdout
    try:
        box.write(env.lstrip("/"), "LAYERFS_DAEMON_ARGS=--cache-size 512M\n", mode=0o600)
        started = box.run("systemctl", "start", "layerfs.service", check=False)
        assert started.returncode != 0, started.stdout + started.stderr
        state = show(box)
        assert state["ActiveState"] == "failed" and state["ExecMainStatus"] == "2", state
        assert state["NRestarts"] == "0", state  # exit 2: RestartPreventExitStatus
        error = ("layerfs: error: no store: --store is empty (set LAYERFS_STORE, "
                 "file:///path or s3://bucket/prefix, in the daemon's environment file)")
        assert state["StatusText"] == error, state
        status = box.run("systemctl", "status", "--no-pager", "layerfs.service",
                         check=False).stdout
        assert f'Status: "{error}"' in status, status
        box.run("systemctl", "reset-failed", "layerfs.service")

        box.run("rm", env)
        started = box.run("systemctl", "start", "layerfs.service", check=False)
        assert started.returncode != 0, started.stdout + started.stderr
        state = show(box)
        # (the start fails before any process: Result=resources; Restart=on-failure
        # tries again a second later, up to StartLimitBurst)
        assert state["Result"] == "resources" and state["MainPID"] == "0", state
        line = "Failed to load environment files: No such file or directory"
        deadline = time.monotonic() + 15  # journald writes the manager's line a moment later
        while line not in (said := box.run("journalctl", "--no-pager", "-o", "cat", "-u",
                                           "layerfs.service").stdout):
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert line in said, said
    finally:
        box.run("systemctl", "stop", "layerfs.service", check=False)
        box.write(env.lstrip("/"), kept, mode=0o600)
        box.run("systemctl", "reset-failed", "layerfs.service", check=False)
