"""``layerfs run`` for real: a command in a sandbox of a real daemon, run as an
OCI container by runc, and what the container isolates (capabilities,
namespaces, the host's and other sandboxes' files, mounts, devices, /proc)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
from support import build, need_root
from support.nodes import NodeDaemon

from harness.daemonproc import LAYERFS
from layerfs.errors import SandboxNotFound, UsageError
from layerfs.node import Client
from layerfs.node.containers import runner
from layerfs.node.containers.bundle import BundleError
from layerfs.node.containers.runner import RunResult
from layerfs.node.control import RemoteError
from layerfs.store import open_store

APPLETS = ("sh", "cat", "echo", "grep", "hostname", "id", "ls", "mkdir", "mknod", "mount",
           "readlink", "sleep", "true", "tty", "unshare", "head", "wc")
# Docker's default capabilities by their numbers in linux/capability.h.
DOCKER_CAPS = {"CHOWN": 0, "DAC_OVERRIDE": 1, "FOWNER": 3, "FSETID": 4, "KILL": 5, "SETGID": 6,
               "SETUID": 7, "SETPCAP": 8, "NET_BIND_SERVICE": 10, "NET_RAW": 13,
               "SYS_CHROOT": 18, "MKNOD": 27, "AUDIT_WRITE": 29, "SETFCAP": 31}
MASKED = ("/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
          "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi",
          "/sys/firmware", "/sys/devices/virtual/powercap")
RUNTIMES = pytest.mark.parametrize("runtime", ["runc", "crun"])
TIMEOUT_EXPECTED = "expected a positive number of seconds, at most 31622400 (366 days)"
READ_ONLY = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger")

# The classic chroot escape: chroot into a subdirectory while the working
# directory stays outside it, climb with "..", chroot there; then report which
# of the given paths the process reaches.
ESCAPE_C = r"""
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>
int main(int argc, char **argv) {
    mkdir("/.escape", 0700);
    if (chroot("/.escape") != 0) { perror("chroot"); return 2; }
    for (int i = 0; i < 256; i++) chdir("..");
    if (chroot(".") != 0) { perror("chroot ."); return 2; }
    for (int i = 1; i < argc; i++) {
        struct stat st;
        printf("%s %s\n", stat(argv[i], &st) == 0 ? "reachable" : "absent", argv[i]);
    }
    return 0;
}
"""


def make_rootfs(root: Path, work: Path) -> Path:
    """A busybox rootfs with a static chroot-escape helper at /bin/escape."""
    for sub in ("bin", "etc", "proc", "dev", "sys", "tmp", "mnt"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    shutil.copy("/bin/busybox", root / "bin" / "busybox")
    for applet in APPLETS:
        (root / "bin" / applet).symlink_to("busybox")
    (root / "etc" / "os-release").write_text("NAME=run-base\n")
    source = work / "escape.c"
    source.write_text(ESCAPE_C)
    subprocess.run(["gcc", "-static", "-O2", "-o", str(root / "bin" / "escape"), str(source)],
                   check=True, capture_output=True)
    return root


@pytest.fixture(scope="module")
def node(starts_a_server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeDaemon]:
    """A daemon on a file:// store with layer base@1, and sandboxes s1 and s2 up
    (``run`` does not depend on the store backend, which test_node covers)."""
    need_root()
    work = tmp_path_factory.mktemp("run")
    url = "file://" + str(work / "store")
    store = open_store(url, None)
    try:
        build(store, str(make_rootfs(work / "base", work)), name="base")
    finally:
        store.close()
    daemon = NodeDaemon(work / "node", ["--store", url], cache_size="64M").start()
    try:
        for sid in ("s1", "s2"):
            daemon.cli("up", "--layer", "base@1", "--id", sid)
        yield daemon
    finally:
        left = daemon.cleanup()
        assert left == [], f"mounts left behind: {left}"


def run(node: NodeDaemon, script: str, *options: str,
        input: str | None = None) -> subprocess.CompletedProcess:
    """``layerfs run [OPTIONS] s1 -- sh -c SCRIPT``, capturing its output."""
    argv = [*LAYERFS, "run", *options, "--root", str(node.root), "s1", "--", "sh", "-c", script]
    return subprocess.run(argv, capture_output=True, text=True, input=input or "", timeout=120)


def status_fields(text: str) -> dict[str, str]:
    return {k: v.strip() for k, _, v in (line.partition(":") for line in text.splitlines())}


def test_status_and_output_pass_through_and_nothing_is_left(node):
    proc = run(node, "echo out; echo err >&2; cat; exit 7", input="from stdin\n")
    assert proc.returncode == 7, proc.stderr
    assert proc.stdout == "out\nfrom stdin\n"
    assert proc.stderr == "err\n"
    assert os.listdir(node.root / "run" / "bundles") == []  # each run's bundle is removed
    assert os.stat(node.root / "run").st_mode & 0o077 == 0
    listed = subprocess.run(["runc", "--root", str(node.root / "run" / "state" / "runc"),
                             "list", "-q"], capture_output=True, text=True, check=True)
    assert listed.stdout == ""  # and its container deleted


def test_a_missing_command_fails(node):
    argv = [*LAYERFS, "run", "--root", str(node.root), "s1", "--", "/bin/no-such-command"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 127
    assert proc.stderr == "layerfs: run: /bin/no-such-command: no such file or directory\n"
    assert bundles_left(node) == []


def test_capabilities_are_dockers_default_with_no_new_privs(node):
    proc = run(node, "cat /proc/self/status")
    assert proc.returncode == 0, proc.stderr
    fields = status_fields(proc.stdout)
    expected = sum(1 << bit for bit in DOCKER_CAPS.values())
    for name in ("CapEff", "CapPrm", "CapBnd"):
        assert int(fields[name], 16) == expected, (name, fields[name])
    assert int(fields["CapAmb"], 16) == 0 and int(fields["CapInh"], 16) == 0
    assert fields["NoNewPrivs"] == "1"
    assert fields["Seccomp"] == "2"  # a seccomp filter is installed


def test_the_command_has_its_own_namespaces(node):
    proc = run(node, "echo $$; hostname; ls /sys/class/net; "
                     "for ns in pid mnt ipc uts net; do readlink /proc/self/ns/$ns; done")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.split()
    assert lines[0] == "1"  # PID 1 of its own pid namespace
    assert lines[1] != socket.gethostname()
    assert lines[2] == "lo"  # a new network namespace: only loopback
    inside = lines[3:]
    outside = [os.readlink(f"/proc/self/ns/{ns}") for ns in ("pid", "mnt", "ipc", "uts", "net")]
    assert len(inside) == 5 and all(a != b for a, b in zip(inside, outside, strict=True))


def test_host_network_on_request(node):
    proc = run(node, "readlink /proc/self/ns/net", "--network", "host")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == os.readlink("/proc/self/ns/net")


def test_a_chroot_escape_finds_only_the_sandbox(node, tmp_path):
    """Root in the container climbs out of a chroot: it must land in the sandbox's
    own root, not the host's (the old chroot runner let it read everything)."""
    marker = tmp_path / "host-secret"
    marker.write_text("host only")
    rows = {row["id"]: row for row in node.request("ps")["sandboxes"]}
    other = Path(rows["s2"]["rootfs"])
    (other / "other-secret").write_text("s2 only")
    upper = node.root / "sandboxes" / "s2" / "upper" / "other-secret"
    assert upper.exists()
    host_paths = [str(marker), str(upper), str(node.root / "control.sock"),
                  str(node.root / "sandboxes")]
    argv = [*LAYERFS, "run", "--root", str(node.root), "s1", "--", "/bin/escape",
            "/etc/os-release", *host_paths]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    seen = {path: state for state, path in (line.split(" ", 1)
                                            for line in proc.stdout.splitlines())}
    assert seen["/etc/os-release"] == "reachable"  # it did climb, to the sandbox's root
    assert {path: seen[path] for path in host_paths} == dict.fromkeys(host_paths, "absent")


def test_no_mounts_and_no_host_devices(node):
    proc = run(node, "mount -t devtmpfs devtmpfs /mnt && echo mounted; ls /mnt")
    assert "mounted" not in proc.stdout
    assert proc.stdout.strip() == "", proc.stdout  # nothing of the host's /dev
    major, minor = host_disk()
    proc = run(node, f"mknod /dev/hostdisk b {major} {minor} && head -c 512 /dev/hostdisk "
                     "| wc -c")
    assert proc.stdout.strip() in ("", "0"), proc.stdout  # the device cgroup refuses it


def host_disk() -> tuple[int, int]:
    """Major and minor of the host's first block device in /proc/partitions."""
    rows = [line.split() for line in Path("/proc/partitions").read_text().splitlines()[2:]]
    assert rows, "no block device on this host"
    return int(rows[0][0]), int(rows[0][1])


def test_proc_is_masked_and_read_only(node):
    present = [path for path in MASKED if os.path.exists(path)]
    assert present, "none of the masked paths exists on this host"
    script = "; ".join(f"echo {path}: $(ls {path} 2>/dev/null | wc -l) "
                       f"$(cat {path} 2>/dev/null | wc -c)" for path in present)
    # Writes that would change nothing if they went through (the value read back
    # in), so that this test cannot harm a host that fails it.
    proc = run(node, script + "; v=$(cat /proc/sys/vm/swappiness); "
               "echo $v > /proc/sys/vm/swappiness && echo written; "
               "cat /proc/self/mountinfo")
    lines = proc.stdout.splitlines()
    assert "written" not in lines, proc.stdout
    assert "Read-only file system" in proc.stderr
    masked = dict(line.split(": ") for line in lines if line.startswith("/"))
    # A masked file reads as /dev/null; a masked directory is an empty tmpfs.
    assert all(masked[path] in ("0 0", "1 0") for path in present), masked
    mounts = {line.split()[4]: line.split()[5].split(",") for line in lines
              if not line.startswith("/")}
    read_only = ["/sys", *(path for path in READ_ONLY if os.path.exists(path))]
    assert all("ro" in mounts.get(path, ()) for path in read_only), mounts


def test_no_new_user_namespace(node):
    proc = run(node, "unshare -U -r id && echo unshared")
    assert "unshared" not in proc.stdout, proc.stdout


def test_the_runtime_starts_with_the_signals_python_ignores_at_their_defaults():
    """Python ignores SIGPIPE and SIGXFSZ; what ``layerfs run`` spawns (the
    runtime, and a command it hands them on to) must not inherit that."""
    code = ("from layerfs.node.containers import runner; "
            "runner.wait(runner.spawn(['grep', 'SigIgn', '/proc/self/status']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    mask = int(out.split()[1], 16)
    assert not mask & (1 << (signal.SIGPIPE - 1) | 1 << (signal.SIGXFSZ - 1)), out


def test_the_runtime_gets_no_descriptor_but_stdio():
    """An inheritable descriptor of the caller (a Python API user's) stays out
    of what ``layerfs run`` spawns, as with subprocess's ``close_fds``."""
    code = ("import os; from layerfs.node.containers import runner; r, w = os.pipe(); "
            "os.set_inheritable(w, True); print(w, flush=True); "
            "runner.wait(runner.spawn(['ls', '/proc/self/fd']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    leaked, listed = out[0], out[1:]
    assert leaked not in listed and {"0", "1", "2"} <= set(listed), out


def test_signals_reach_the_command(node):
    script = 'trap "echo got-term; exit 5" TERM; echo ready; while :; do sleep 1; done'
    with started(node, script) as proc:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        out, _err = proc.communicate(timeout=60)
    assert proc.returncode == 5
    assert out == "got-term\n"


def test_a_second_signal_kills_the_container(node):
    with started(node, 'trap "" TERM INT; echo ready; sleep 1000') as proc:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)  # ignored by the command
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGKILL


@contextmanager
def started(node: NodeDaemon, script: str) -> Iterator[subprocess.Popen]:
    """``layerfs run s1 -- sh -c SCRIPT`` in the background; stopped if a check fails."""
    argv = [*LAYERFS, "run", "--root", str(node.root), "s1", "--", "sh", "-c", script]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        for _ in range(2):  # two signals: the second kills the container
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)


def runtime_state(node: NodeDaemon, runtime: str, cid: str) -> str:
    """The container's status as the runtime reports it ("gone" if it has none)."""
    proc = subprocess.run(runner.runtime_command(
        runtime, str(node.root / "run" / "state" / runtime), "state", cid),
        capture_output=True, text=True, timeout=60)
    return json.loads(proc.stdout)["status"] if proc.returncode == 0 else "gone"


@contextmanager
def busy_sandbox(node: NodeDaemon, sid: str, runtime: str) -> Iterator[tuple[subprocess.Popen,
                                                                           str]]:
    """Sandbox ``sid`` up with ``layerfs run -- sleep 30`` in it, in the
    background: the run and its container id; everything gone afterwards."""
    node.cli("up", "--layer", "base@1", "--id", sid)
    argv = [*LAYERFS, "run", "--runtime", runtime, "--root", str(node.root), sid, "--",
            "sh", "-c", "echo ready; sleep 30"]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        (cid,) = os.listdir(node.root / "run" / "bundles")
        yield proc, cid
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=60)
        node.cli("down", "--force", sid, check=False)


def refused_down(node: NodeDaemon, sid: str, cid: str, via: str) -> None:
    """``down`` (the CLI's or ``Client.down``) refuses with exit code 15, and
    leaves the sandbox as it was."""
    if via == "cli":
        down = node.cli("down", sid, check=False)
        assert down.returncode == 15
        assert down.stderr == (f"layerfs: error: sandbox {sid}: container {cid} runs in "
                               "it (stop it first, or `down --force` kills it)\n")
    else:
        with pytest.raises(RemoteError, match=f"container {cid} runs in it") as refused:
            Client(node.root).down(sid)
        assert refused.value.exit_code == 15
    assert (node.root / "sandboxes" / sid / "upper").is_dir()
    assert sid in {row["id"] for row in node.request("ps")["sandboxes"]}


@pytest.mark.parametrize(("runtime", "via"), [("runc", "cli"), ("crun", "api")])
def test_down_refuses_a_sandbox_a_container_runs_in(node, runtime, via):
    """`down` while `run` is inside would delete the upper under the
    container: refused with exit code 9, or ``--force`` kills it first."""
    sid = f"busy-{runtime}"
    with busy_sandbox(node, sid, runtime) as (proc, cid):
        refused_down(node, sid, cid, via)
        assert proc.poll() is None and runtime_state(node, runtime, cid) == "running"
        if via == "cli":
            node.cli("down", "--force", sid)
        else:
            assert Client(node.root).down(sid, force=True).state == "down"
        assert proc.wait(timeout=60) == 128 + signal.SIGKILL
        assert runtime_state(node, runtime, cid) == "gone"
        assert not (node.root / "sandboxes" / sid).exists()
        assert sid not in {row["id"] for row in node.request("ps")["sandboxes"]}
    assert os.listdir(node.root / "run" / "bundles") == []


def run_children(pid: int) -> tuple[int, int]:
    """A ``layerfs run``'s two children: its watcher (a fork of it) and the runtime."""
    kids = [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    assert len(kids) == 2, kids
    own = Path(f"/proc/{pid}/exe").resolve()
    (reaper,) = [k for k in kids if Path(f"/proc/{k}/exe").resolve() == own]
    (runtime,) = [k for k in kids if k != reaper]
    return reaper, runtime


def gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie counts as ended), waiting up to 30 s."""
    for _ in range(600):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def container_init(node: NodeDaemon, runtime: str, cid: str) -> int:
    proc = subprocess.run(runner.runtime_command(
        runtime, str(node.root / "run" / "state" / runtime), "state", cid),
        capture_output=True, text=True, timeout=60, check=True)
    return int(json.loads(proc.stdout)["pid"])


@RUNTIMES
def test_a_killed_run_takes_its_container_with_it(node, runtime):
    """SIGKILL of `layerfs run` (no signal forwarded, no cleanup of its own):
    the container's process, the runtime, the container's state and its
    bundle are gone shortly after, and a plain `down` goes through."""
    sid = f"killed-{runtime}"
    with busy_sandbox(node, sid, runtime) as (proc, cid):
        _reaper, runtime_pid = run_children(proc.pid)
        init = container_init(node, runtime, cid)
        proc.kill()
        proc.wait(timeout=60)
        assert gone(init) and gone(runtime_pid)
        for _ in range(200):
            if runtime_state(node, runtime, cid) == "gone" and cid not in bundles_left(node):
                break
            time.sleep(0.05)
        assert runtime_state(node, runtime, cid) == "gone"
        assert cid not in bundles_left(node)
        node.cli("down", sid)


def test_down_force_leaves_no_bundle_behind(node):
    """A run killed with its watcher leaves its container running: `down`
    refuses, `down --force` kills it and leaves neither state nor bundle."""
    sid = "forced"
    with busy_sandbox(node, sid, "runc") as (proc, cid):
        reaper, _runtime = run_children(proc.pid)
        os.kill(reaper, signal.SIGKILL)
        proc.kill()
        proc.wait(timeout=60)
        assert runtime_state(node, "runc", cid) == "running"
        refused_down(node, sid, cid, "cli")
        node.cli("down", "--force", sid)
        assert runtime_state(node, "runc", cid) == "gone"
        assert cid not in bundles_left(node)


def test_a_stopped_containers_state_left_behind_does_not_block_down(node):
    """Busy is what the runtime reports at `down` time: once the container's
    process is gone (its runtime and its run killed too, so that its state is
    left behind, ``stopped``), a plain `down` goes through."""
    sid = "busy-stale"
    state_root = str(node.root / "run" / "state" / "runc")
    with busy_sandbox(node, sid, "runc") as (proc, cid):
        refused_down(node, sid, cid, "cli")
        reaper, runtime_pid = run_children(proc.pid)
        init = json.loads(subprocess.run(["runc", "--root", state_root, "state", cid],
                                         capture_output=True, check=True).stdout)["pid"]
        # the run's watcher and the run first: either would delete the state
        for pid in (reaper, proc.pid, runtime_pid, init):
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=60)
        for _ in range(200):  # until init is reaped (by the host's init)
            if runtime_state(node, "runc", cid) != "running":
                break
            time.sleep(0.05)
        assert runtime_state(node, "runc", cid) == "stopped"
        node.cli("down", sid)
        assert not (node.root / "sandboxes" / sid).exists()
        subprocess.run(["runc", "--root", state_root, "delete", "--force", cid], check=True)
        runner.remove_bundle(str(node.root / "run" / "bundles" / cid))


def test_a_terminal_on_stdin_gives_the_command_a_terminal(node):
    command = " ".join([*LAYERFS, "run", "--root", str(node.root), "s1", "--", "sh", "-c",
                        "'tty; exit 3'"])
    proc = subprocess.run(["script", "-q", "-e", "-c", command, "/dev/null"],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "/dev/pts/" in proc.stdout or "/dev/console" in proc.stdout, proc.stdout


def test_a_missing_runtime_is_one_line(node):
    argv = [*LAYERFS, "run", "--runtime", "crun", "--root", str(node.root), "s1", "--", "true"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PATH": "/nonexistent"})
    assert proc.returncode == 2
    assert proc.stderr == ("layerfs: error: the OCI runtime crun is not on PATH "
                           "(Debian package crun)\n")


def test_a_sandbox_that_is_not_up_is_one_line(node):
    argv = [*LAYERFS, "run", "--root", str(node.root), "nope", "--", "true"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == SandboxNotFound.exit_code == 5
    assert proc.stderr == "layerfs: error: sandbox nope: no such sandbox\n"


def test_crun_runs_the_same_bundle(node):
    """crun runs for real, on a hybrid cgroup host too (in a mount namespace
    without the cgroup2 hierarchy), with the same defaults as runc."""
    major, minor = host_disk()
    proc = run(node, "grep -E '^(CapEff|NoNewPrivs|Seccomp):' /proc/self/status; "
                     f"mknod /dev/hostdisk b {major} {minor} && head -c 512 /dev/hostdisk "
                     "| wc -c; echo pid $$; exit 4", "--runtime", "crun")
    assert proc.returncode == 4, proc.stderr
    fields = status_fields(proc.stdout)
    assert int(fields["CapEff"], 16) == sum(1 << bit for bit in DOCKER_CAPS.values())
    assert fields["NoNewPrivs"] == "1" and fields["Seccomp"] == "2"
    lines = proc.stdout.splitlines()
    assert lines[-1] == "pid 1"
    assert lines[-2].strip() == "0", proc.stdout  # the device cgroup refuses the host disk
    listed = subprocess.run(runner.runtime_command(
        "crun", str(node.root / "run" / "state" / "crun"), "list", "-q"),
        capture_output=True, text=True, check=True)
    assert listed.stdout == ""




def rootfs_of(node: NodeDaemon, sid: str) -> Path:
    rows = {row["id"]: row for row in node.request("ps")["sandboxes"]}
    return Path(rows[sid]["rootfs"])


def no_container_left(node: NodeDaemon, runtime: str, sid: str) -> None:
    """The runtime lists no container of ``sid``, and no bundle is left."""
    state = node.root / "run" / "state" / runtime
    listed = subprocess.run(runner.runtime_command(runtime, str(state), "list", "-q"),
                            capture_output=True, text=True, check=True)
    assert [cid for cid in listed.stdout.split() if runner.is_container_of(sid, cid)] == []
    assert runner.running_containers(str(node.root), sid) == []
    assert bundles_left(node) == []


def bundles_left(node: NodeDaemon) -> list[str]:
    try:
        return os.listdir(node.root / "run" / "bundles")
    except FileNotFoundError:  # no run has written one yet
        return []


@RUNTIMES
def test_env_cwd_and_user_given_to_run_are_what_the_command_sees(node, runtime):
    """``env`` over the image's Env (PATH too), ``cwd`` and ``user`` over the
    image's, through the API and the CLI's ``--env``/``--cwd``/``--user``."""
    script = 'echo "$GREETING|$PATH|$HOSTNAME"; pwd; id -u; id -g'
    result = Client(node.root).run("s1", ["sh", "-c", script], runtime=runtime, capture=True,
                                   env={"GREETING": "hello there", "PATH": "/bin"},
                                   cwd="/tmp", user="1234:4321")
    assert isinstance(result, RunResult)
    assert (result.exit_code, result.stderr) == (0, b"")
    assert result.stdout == b"hello there|/bin|s1\n/tmp\n1234\n4321\n"
    proc = run(node, script, "--runtime", runtime, "--env", "GREETING=a=b", "--env",
               "PATH=/sbin:/bin", "--cwd", "/mnt", "--user", "7")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "a=b|/sbin:/bin|s1\n/mnt\n7\n0\n"


@pytest.mark.parametrize(("options", "message"), [
    (("--env", "NOVALUE"), "--env 'NOVALUE': expected KEY=VALUE"),
    (("--env", "=x"), "--env '=x': expected KEY=VALUE"),
    (("--cwd", "tmp"), "cannot make the container's process: the working directory 'tmp' "
                       "is not an absolute path"),
    (("--timeout", "0"), f"--timeout '0': {TIMEOUT_EXPECTED}"),
    (("--timeout", "soon"), f"--timeout 'soon': {TIMEOUT_EXPECTED}"),
    (("--timeout", "31622401"), f"--timeout '31622401': {TIMEOUT_EXPECTED}"),
    (("--timeout", "1e10"), f"--timeout '1e10': {TIMEOUT_EXPECTED}"),
    (("--timeout", "1e308"), f"--timeout '1e308': {TIMEOUT_EXPECTED}"),
    (("--env", "A\nB=x"), "cannot make the container's process: bad environment variable "
                          "'A\\nB': a name must be non-empty, without '=', whitespace or "
                          "control characters, and a value may not hold a NUL"),
])
def test_bad_run_options_are_one_line(node, options, message):
    proc = run(node, "echo ran", *options)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == f"layerfs: error: {message}\n"
    assert bundles_left(node) == []


@pytest.mark.parametrize(("options", "error", "message"), [
    ({"env": {"": "x"}}, BundleError, "bad environment variable ''"),
    ({"env": {"A=B": "x"}}, BundleError, "bad environment variable 'A=B'"),
    ({"env": {"A": "x\0y"}}, BundleError, "bad environment variable 'A'"),
    ({"env": {"A\nB": "x"}}, BundleError, "bad environment variable 'A\\nB'"),
    ({"env": {"A B": "x"}}, BundleError, "bad environment variable 'A B'"),
    ({"timeout": runner.MAX_TIMEOUT * 2}, UsageError, "timeout must be a positive number of"
                                                      " seconds up to 3.16224e+07"),
    ({"timeout": 0}, UsageError, "timeout must be a positive number of seconds, not 0"),
    ({"timeout": float("inf")}, UsageError, "timeout must be a positive number of seconds"),
    ({"capture": True, "terminal": True}, UsageError, "a run on a terminal neither captures"),
    ({"max_output": -1}, UsageError, "max_output must be at least 0, not -1"),
])
def test_bad_run_arguments_raise_before_anything_runs(node, options, error, message):
    with pytest.raises(error, match=re.escape(message)) as raised:
        Client(node.root).run("s1", ["true"], **options)
    assert raised.value.exit_code == 2
    assert bundles_left(node) == []


def test_captured_output_is_kept_apart_and_bounded(node):
    """stdout and stderr each in their own bytes, at most ``max_output`` of
    each; a command that writes more is not blocked, its output cut and flagged."""
    client = Client(node.root)
    result = client.run("s1", ["sh", "-c", "cat; echo err >&2; exit 3"], capture=True,
                        stdin=b"in\x00put\n")
    assert result == RunResult(exit_code=3, stdout=b"in\x00put\n", stderr=b"err\n")
    big = "head -c 3000000 /dev/zero; echo done >&2; head -c 10 /dev/zero >&2"
    result = client.run("s1", ["sh", "-c", big], capture=True, max_output=1 << 20)
    assert result.exit_code == 0 and not result.timed_out
    assert result.stdout == bytes(1 << 20) and result.stdout_truncated
    assert result.stderr == b"done\n" + bytes(10) and not result.stderr_truncated
    plain = client.run("s1", ["sh", "-c", "exit 0"])
    assert plain == RunResult(exit_code=0)  # nothing captured: None, not b""


def test_stdin_from_a_descriptor(node, tmp_path):
    source = tmp_path / "input"
    source.write_bytes(b"line one\nline two\n")
    fd = os.open(source, os.O_RDONLY)
    try:
        result = Client(node.root).run("s1", ["wc", "-l"], stdin=fd, capture=True)
    finally:
        os.close(fd)
    assert (result.exit_code, result.stdout.strip()) == (0, b"2")


def test_a_run_from_another_thread(node):
    """A scheduler's worker thread runs too (signals are forwarded from the
    main thread only: a worker cannot set handlers)."""
    results: list[RunResult] = []
    worker = threading.Thread(target=lambda: results.append(
        Client(node.root).run("s1", ["sh", "-c", "echo from-thread"], capture=True)))
    worker.start()
    worker.join(120)
    assert [(r.exit_code, r.stdout) for r in results] == [(0, b"from-thread\n")]


def test_runs_from_many_threads_at_once(node):
    """A scheduler runs containers from many threads of one process at once:
    each run's watcher is forked and reaped without racing the others'."""
    client = Client(node.root)
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(
            lambda k: client.run("s1", ["sh", "-c", f"echo run-{k}"], capture=True), range(160)))
    assert [(r.exit_code, r.stdout) for r in results] == [
        (0, f"run-{k}\n".encode()) for k in range(160)]


def processes_with(marker: str) -> list[str]:
    """The host's processes whose command line holds ``marker`` (``ps``)."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True,
                         check=True).stdout
    return [line for line in out.splitlines() if marker in line and "ps -eo" not in line]


@RUNTIMES
def test_a_timeout_kills_the_container_and_every_process_in_it(node, runtime):
    """``sleep`` in the background and in the foreground, timeout 2 s: the
    run returns timed out (124) within seconds, the runtime knows no container
    of the sandbox, no sleep is left, and the sandbox runs again."""
    client = Client(node.root)
    marker = "3599" if runtime == "runc" else "3598"
    started = time.monotonic()
    result = client.run("s1", ["sh", "-c", f"sleep {marker} & echo started; sleep {marker}"],
                        runtime=runtime, timeout=2, capture=True)
    took = time.monotonic() - started
    assert result.timed_out and result.exit_code == 124
    assert result.stdout == b"started\n"
    assert 2 <= took < 8, took
    no_container_left(node, runtime, "s1")
    assert processes_with(f"sleep {marker}") == []
    assert client.run("s1", ["true"], runtime=runtime) == RunResult(exit_code=0)
    quick = client.run("s1", ["sh", "-c", "exit 4"], runtime=runtime, timeout=30)
    assert (quick.exit_code, quick.timed_out) == (4, False)
    proc = run(node, f"sleep {marker}", "--runtime", runtime, "--timeout", "1")
    assert (proc.returncode, proc.stderr) == (124, "")
    no_container_left(node, runtime, "s1")


@RUNTIMES
@pytest.mark.parametrize(("cwd", "why"), [("/bin/busybox", "not a directory"),
                                          ("/etc/os-release/x", "a file on its way")])
def test_a_working_directory_that_cannot_be_made_is_one_line(node, runtime, cwd, why):
    """runc and crun fail with their own line on such a cwd: one ``layerfs:
    run:`` line and 126 instead (a missing cwd is made, as the runtimes do)."""
    proc = run(node, "pwd", "--runtime", runtime, "--cwd", cwd)
    assert (proc.returncode, proc.stdout) == (126, "")
    assert proc.stderr == f"layerfs: run: working directory {cwd}: {why}\n"
    assert bundles_left(node) == []
    made = run(node, "pwd", "--runtime", runtime, "--cwd", f"/tmp/made-{runtime}/here")
    assert (made.returncode, made.stdout) == (0, f"/tmp/made-{runtime}/here\n"), made.stderr


def test_the_longest_timeout_is_taken(node):
    """A timeout as long as the option takes (366 days, beyond what one
    poll(2) can wait) runs the command, through the CLI and the API."""
    proc = run(node, "echo ran; exit 3", "--timeout", "31622400")
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "ran\n", "")
    result = Client(node.root).run("s1", ["sh", "-c", "exit 5"], timeout=runner.MAX_TIMEOUT)
    assert (result.exit_code, result.timed_out) == (5, False)
    assert bundles_left(node) == []


@RUNTIMES
@pytest.mark.parametrize("user", ["4294967294", "7:2147483648"])
def test_an_id_the_runtimes_refuse_is_one_line(node, runtime, user):
    """A uid or gid beyond what runc and crun set up (they fail, runc in its
    own words) is refused first: one ``layerfs:`` line, nothing left behind."""
    proc = run(node, "echo ran", "--runtime", runtime, "--user", user)
    assert (proc.returncode, proc.stdout) == (2, "")
    number = user.rpartition(":")[2]
    assert proc.stderr == (f"layerfs: error: image user {user!r}: "
                           f"{'gid' if ':' in user else 'uid'} {number} is out of range "
                           "(0 to 2147483647, what the OCI runtimes take)\n"), proc.stderr
    assert bundles_left(node) == []
    highest = run(node, "id -u; id -g", "--runtime", runtime, "--user", "2147483647:2147483647")
    assert (highest.returncode, highest.stdout) == (0, "2147483647\n2147483647\n"), highest.stderr


@pytest.fixture(scope="module")
def odd_programs(starts_a_server,
                 node: NodeDaemon, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """In s1: a script without execute bits, a directory, a FIFO, and symlinks
    to a host program (absolute, and climbing out with ``..``) the rootfs lacks."""
    host = tmp_path_factory.mktemp("host") / "host-program"
    host.write_text("#!/bin/sh\necho host\n")
    host.chmod(0o755)
    rootfs = rootfs_of(node, "s1")
    (rootfs / "bin" / "plain").write_text("#!/bin/sh\necho plain\n")
    (rootfs / "bin" / "plain").chmod(0o644)
    (rootfs / "bin" / "adir").mkdir()
    os.mkfifo(rootfs / "bin" / "fifo")
    (rootfs / "bin" / "to-host").symlink_to(host)
    (rootfs / "bin" / "up-to-host").symlink_to("../../../../../../.." + str(host))
    (rootfs / "opt").mkdir()
    (rootfs / "opt" / "plain").write_text("#!/bin/sh\necho opt\n")
    (rootfs / "opt" / "plain").chmod(0o755)
    return host


DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
COMMAND_CODES = [
    (["no-such-command"], 127, f"no-such-command: command not found in PATH {DEFAULT_PATH}"),
    (["/bin/no-such-command"], 127, "/bin/no-such-command: no such file or directory"),
    (["./no-such-command"], 127, "./no-such-command: no such file or directory"),
    (["to-host"], 127, f"to-host: command not found in PATH {DEFAULT_PATH}"),
    (["/bin/up-to-host"], 127, "/bin/up-to-host: no such file or directory"),
    (["/bin/plain"], 126, "/bin/plain: permission denied (not executable)"),
    (["plain"], 126, "/bin/plain: permission denied (not executable)"),
    (["/bin/adir"], 126, "/bin/adir: is a directory"),
    (["adir"], 127, f"adir: command not found in PATH {DEFAULT_PATH}"),
    (["/bin/fifo"], 126, "/bin/fifo: permission denied (not a regular file)"),
]


@RUNTIMES
@pytest.mark.parametrize(("argv", "code", "message"), COMMAND_CODES,
                         ids=[" ".join(c[0]) for c in COMMAND_CODES])
def test_a_program_that_cannot_start_exits_127_or_126(node, odd_programs, runtime, argv, code,
                                                      message):
    """As a shell: 127 for a program that is not there (a symlink to a host
    path resolves in the rootfs, where there is none), 126 for one that is
    not an executable file; the same under runc and crun, from the CLI and the API."""
    proc = subprocess.run([*LAYERFS, "run", "--runtime", runtime, "--root", str(node.root),
                           "s1", "--", *argv],
                          capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (code, "")
    assert proc.stderr == f"layerfs: run: {message}\n"
    result = Client(node.root).run("s1", argv, runtime=runtime, capture=True)
    assert result == RunResult(exit_code=code, stdout=b"",
                               stderr=f"layerfs: run: {message}\n".encode())
    no_container_left(node, runtime, "s1")


@RUNTIMES
def test_the_path_search_takes_the_first_executable(node, odd_programs, runtime):
    """``plain`` in /bin is not executable, in /opt it is: found there (as the
    runtimes and shells search PATH); a relative path runs from the cwd."""
    client = Client(node.root)
    result = client.run("s1", ["plain"], runtime=runtime, env={"PATH": "/bin:/opt"},
                        capture=True)
    assert (result.exit_code, result.stdout) == (0, b"opt\n")
    result = client.run("s1", ["./plain"], runtime=runtime, cwd="/opt", capture=True)
    assert (result.exit_code, result.stdout) == (0, b"opt\n")
