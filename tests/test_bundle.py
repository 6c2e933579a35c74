"""OCI runtime bundles from an env's image config, for real: ``layerfs up
--bundle DIR`` on a real daemon, the bundle run by ``runc`` and by ``crun``
themselves, ``layerfs run`` through the same config (Docker's Entrypoint/Cmd
rules, StopSignal), and the image user resolved against the image's own
/etc/passwd and /etc/group, which may be hostile (a symlink to a host file, a
FIFO, a huge file). Hostile images whose mount points (/dev, /proc, /sys,
/dev/pts, ...) are symlinks to host directories run under both runtimes without
a file appearing there, and a bundle directory another user could change is
refused."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import build, need_root
from support.nodes import NodeDaemon
from support.users import LocalUser

from harness.daemonproc import LAYERFS
from layerfs.builder.env import create_env
from layerfs.manifest import ImageConfig
from layerfs.node.containers import runner
from layerfs.node.containers.bundle import (
    DEFAULT_PATH,
    STOP_SIGNAL_ANNOTATION,
    ProcessSpec,
    make_mount_points,
    runtime_config,
    write_bundle,
)
from layerfs.node.containers.imageuser import ImageFileError, ImageUserError, resolve_user
from layerfs.refstore import RefStore
from layerfs.store import open_store

APPLETS = ("sh", "cat", "echo", "id", "pwd", "sleep", "true")
PASSWD = ("root:x:0:0:root:/root:/bin/sh\n"
          "app:x:1234:2345:The app:/home/app:/bin/sh\n"
          "broken line\n")
GROUP = ("root:x:0:\n"
         "appgrp:x:2345:\n"
         "staff:x:50:app\n"
         "extra:x:3000:other,app\n")
HOST_PASSWD = "evil:x:4242:4242:host only:/evil:/bin/sh\n"
REPORT = 'echo "$GREETING"; pwd; id -u; id -g; id -G; echo "home=$HOME host=$HOSTNAME"'
IMAGE = ImageConfig(env=["GREETING=hello from the image", "PATH=/bin"],
                    entrypoint=["/bin/sh", "-c"], cmd=[REPORT], working_dir="/srv/work",
                    user="app", labels={"org.example.role": "bundle-test"},
                    stop_signal="SIGUSR1")


def make_rootfs(root: Path) -> Path:
    """A busybox rootfs with an app user in several groups and /srv/work."""
    for sub in ("bin", "etc", "proc", "dev", "sys", "tmp", "srv/work", "home/app"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    shutil.copy("/bin/busybox", root / "bin" / "busybox")
    for applet in APPLETS:
        (root / "bin" / applet).symlink_to("busybox")
    (root / "etc" / "passwd").write_text(PASSWD)
    (root / "etc" / "group").write_text(GROUP)
    return root


# Layers that make the bundle's mount points symlinks to a host directory, as an
# absolute path or as a relative climb out of the rootfs: the ones on the rootfs
# itself (/dev; /proc and /sys) and the ones inside /dev's tmpfs; /work, the
# WorkingDir, too. Each also holds the host directory's path as a directory
# (crun resolves a mount destination inside the rootfs, then writes by the host's path).
MOUNT_POINT_LINKS = {"dev": ("dev", "work"), "procsys": ("proc", "sys"),
                     "nested": ("dev/pts", "dev/shm", "dev/mqueue", "work")}
CLIMB = "../" * 32  # more than the rootfs is deep: a relative link reaches the host's /


def mount_point_variants() -> list[str]:
    return [f"{shape}-{kind}" for shape in MOUNT_POINT_LINKS for kind in ("abs", "rel")]


def host_dir(work: Path, variant: str, link: str) -> Path:
    """The host directory layer ``variant`` points ``link`` at."""
    return work / "host" / variant / link.replace("/", "_")


def hostile_mount_points(root: Path, work: Path, variant: str) -> Path:
    """The layer of ``variant``: its links, and their host directories' paths."""
    shape, kind = variant.split("-")
    for link in MOUNT_POINT_LINKS[shape]:
        host = host_dir(work, variant, link)
        host.mkdir(parents=True, exist_ok=True)
        (root / str(host).lstrip("/")).mkdir(parents=True, exist_ok=True)
        path = root / link
        path.parent.mkdir(parents=True, exist_ok=True)
        path.symlink_to(str(host) if kind == "abs" else CLIMB + str(host).lstrip("/"))
    return root


def hostile_etc(root: Path, kind: str, host_file: Path) -> Path:
    """A layer whose /etc/passwd is a symlink to a host file, a FIFO or 100 MB."""
    (root / "etc").mkdir(parents=True)
    passwd = root / "etc" / "passwd"
    if kind == "symlink":
        passwd.symlink_to(host_file)
    elif kind == "fifo":
        os.mkfifo(passwd)
    else:
        with open(passwd, "wb") as f:
            f.truncate(100 << 20)
    return root


@pytest.fixture(scope="module")
def node(starts_a_server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeDaemon]:
    """A daemon on a file:// store (bundles do not depend on the store backend,
    which test_node covers) with envs over one busybox layer."""
    need_root()
    work = tmp_path_factory.mktemp("bundle")
    host_file = work / "host-passwd"
    host_file.write_text(HOST_PASSWD)
    url = "file://" + str(work / "store")
    store = open_store(url, None)
    refstore = RefStore(store)
    try:
        build(store, str(make_rootfs(work / "base")), name="base")
        create_env(refstore, "img", "1", ["base@1"], config=IMAGE)
        create_env(refstore, "numeric", "1", ["base@1"], config=ImageConfig(
            user="4321:4322", cmd=["/bin/sh", "-c", "id -u; id -g; pwd; echo $HOME $PATH"]))
        create_env(refstore, "bare", "1", ["base@1"])
        create_env(refstore, "ghost", "1", ["base@1"], config=ImageConfig(user="ghost",
                                                                      cmd=["true"]))
        for variant in mount_point_variants():
            build(store, str(hostile_mount_points(work / variant, work, variant)),
                  name=f"mp-{variant}")
            for who, user in (("root", ""), ("user", "1234:2345")):
                create_env(refstore, f"mp-{variant}-{who}", "1", [f"mp-{variant}@1", "base@1"],
                           config=ImageConfig(user=user, working_dir="/work",
                                              cmd=["/bin/sh", "-c", "echo ran $(id -u)"]))
        for kind in ("symlink", "fifo", "huge"):
            build(store, str(hostile_etc(work / kind, kind, host_file)), name=f"etc-{kind}")
            create_env(refstore, f"hostile-{kind}", "1", [f"etc-{kind}@1", "base@1"],
                       config=ImageConfig(cmd=["/bin/sh", "-c", "echo $HOME"]))
    finally:
        store.close()
    daemon = NodeDaemon(work / "node", ["--store", url], cache_size="64M").start()
    daemon.work = work
    try:
        daemon.cli("up", "img@1", "--id", "img")
        yield daemon
    finally:
        left = daemon.cleanup()
        assert left == [], f"mounts left behind: {left}"


def runtime_run(node: NodeDaemon, runtime: str, bundle: Path, cid: str,
                ) -> subprocess.CompletedProcess:
    """``RUNTIME run -b BUNDLE CID`` itself (crun in its cgroup-v1 view on a hybrid host)."""
    state = str(node.work / "state" / runtime)
    argv = runner.runtime_command(runtime, state, "run", "--bundle", str(bundle), cid)
    return subprocess.run(argv, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


def layerfs_run(node: NodeDaemon, sid: str, *args: str) -> subprocess.CompletedProcess:
    return node.cli("run", sid, *args, check=False)


def report(sid: str) -> list[str]:
    """What REPORT prints as the image's app user in /srv/work (groups sorted)."""
    return ["hello from the image", "/srv/work", "1234", "2345", "50 2345 3000",
            f"home=/home/app host={sid}"]


def parsed_report(stdout: str) -> list[str]:
    lines = stdout.splitlines()
    if len(lines) > 4:  # id -G: the set of groups, in the order the kernel keeps them
        lines[4] = " ".join(sorted(lines[4].split(), key=int))
    return lines


@pytest.mark.parametrize("runtime", ["runc", "crun"])
def test_up_bundle_runs_the_image_config(node, runtime, tmp_path):
    sid = f"up-{runtime}"
    bundle = tmp_path / "bundle"
    out = json.loads(node.cli("up", "img@1", "--id", sid, "--bundle", str(bundle),
                              "--json").stdout)
    try:
        assert out["bundle"] == str(bundle / "config.json")
        config = json.loads((bundle / "config.json").read_text())
        assert config["root"]["path"] == out["rootfs"]
        assert config["process"]["args"] == ["/bin/sh", "-c", REPORT]  # Entrypoint + Cmd
        assert config["process"]["user"] == {"uid": 1234, "gid": 2345,
                                             "additionalGids": [50, 3000]}
        assert config["annotations"] == {"org.example.role": "bundle-test",
                                         STOP_SIGNAL_ANNOTATION: "SIGUSR1"}
        assert config["process"]["noNewPrivileges"] is True
        assert "network" in {ns["type"] for ns in config["linux"]["namespaces"]}
        proc = runtime_run(node, runtime, bundle, f"{sid}-c")
        assert proc.returncode == 0, proc.stderr
        assert parsed_report(proc.stdout) == report(sid)
    finally:
        node.cli("down", sid)


def test_a_numeric_user_needs_no_passwd_entry(node, tmp_path):
    bundle = tmp_path / "bundle"
    node.cli("up", "numeric@1", "--id", "numeric", "--bundle", str(bundle))
    try:
        proc = runtime_run(node, "runc", bundle, "numeric-c")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines() == ["4321", "4322", "/", f"/ {DEFAULT_PATH}"]
    finally:
        node.cli("down", "numeric")


def test_run_without_a_command_runs_the_image_default(node):
    proc = layerfs_run(node, "img")
    assert proc.returncode == 0, proc.stderr
    assert parsed_report(proc.stdout) == report("img")


def test_run_command_replaces_cmd_and_keeps_the_entrypoint(node):
    proc = layerfs_run(node, "img", "--", "echo replaced; id -u; pwd")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["replaced", "1234", "/srv/work"]


def test_run_entrypoint_and_user_options(node):
    proc = layerfs_run(node, "img", "--entrypoint", "", "--user", "0", "--", "id", "-u")
    assert (proc.returncode, proc.stdout) == (0, "0\n"), proc.stderr
    proc = layerfs_run(node, "img", "--entrypoint", "/bin/id", "--user", "app:staff")
    assert proc.returncode == 0, proc.stderr  # the image's Cmd is dropped with its Entrypoint
    assert proc.stdout.startswith("uid=1234(app) gid=50(staff)"), proc.stdout


@pytest.mark.parametrize(("user", "ids"), [
    ("app", "1234 2345"), ("1234", "1234 2345"), ("app:staff", "1234 50"),
    ("app:7777", "1234 7777"), ("1234:extra", "1234 3000"), ("4321", "4321 0"),
    ("4321:extra", "4321 3000"), ("root", "0 0"),
])
def test_user_forms(node, user, ids):
    proc = layerfs_run(node, "img", "--entrypoint", "", "--user", user, "--",
                       "sh", "-c", 'echo $(id -u) $(id -g)')
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ids


@pytest.mark.parametrize(("user", "message"), [
    ("ghost", "no user 'ghost' in the image's /etc/passwd"),
    ("app:nogroup", "no group 'nogroup' in the image's /etc/group"),
])
def test_a_user_that_does_not_resolve_is_one_line(node, user, message):
    proc = layerfs_run(node, "img", "--user", user, "--", "true")
    assert proc.returncode == 2
    assert proc.stderr == f"layerfs: error: image user {user!r}: {message}\n"


def sandbox_ids(node: NodeDaemon) -> set[str]:
    return {row["id"] for row in node.request("ps")["sandboxes"]}


@pytest.mark.parametrize(("env", "message"), [
    ("bare@1", "cannot make the container's process: no command: the env's image config "
               "sets neither Entrypoint nor Cmd (`layerfs run ID -- CMD` gives one)"),
    ("ghost@1", "image user 'ghost': no user 'ghost' in the image's /etc/passwd"),
])
def test_a_bundle_that_cannot_be_made_leaves_no_sandbox(node, tmp_path, env, message):
    bundle = tmp_path / "bundle"
    proc = node.cli("up", env, "--id", "nobundle", "--bundle", str(bundle), check=False)
    assert proc.returncode == 2
    assert proc.stderr == f"layerfs: error: {message}\n"
    assert "nobundle" not in sandbox_ids(node)
    assert not (bundle / "config.json").exists()
    assert not (node.root / "sandboxes" / "nobundle").exists()


def test_the_stop_signal_is_what_sigterm_sends(node):
    script = ('trap "echo got-usr1; exit 6" USR1; trap "echo got-term; exit 7" TERM; '
              'echo ready; while :; do sleep 1; done')
    argv = [*LAYERFS, "run", "--root", str(node.root), "img", "--", script]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        for _ in range(2):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert (proc.returncode, out) == (6, "got-usr1\n"), err


@pytest.mark.parametrize(("kind", "error"), [
    ("symlink", None),
    ("fifo", "the image's /etc/passwd: not a regular file"),
    ("huge", "the image's /etc/passwd: larger than 4194304 bytes"),
])
def test_a_hostile_passwd_in_a_sandbox(node, kind, error):
    """The symlink to a host file resolves inside the rootfs (where nothing is):
    the host file's user does not exist and HOME is root's default."""
    sid = f"hostile-{kind}"
    node.cli("up", f"hostile-{kind}@1", "--id", sid)
    try:
        proc = layerfs_run(node, sid)
        if error is None:
            assert (proc.returncode, proc.stdout) == (0, "/root\n"), proc.stderr
            proc = layerfs_run(node, sid, "--user", "evil", "--", "true")
            assert proc.stderr == ("layerfs: error: image user 'evil': no user 'evil' in "
                                   "the image's /etc/passwd\n")
        else:
            assert proc.returncode == 2
            assert proc.stderr == f"layerfs: error: {error}\n"
    finally:
        node.cli("down", sid)


def host_files(work: Path) -> dict[str, list[str]]:
    """What appeared in the host directories the hostile layers point at."""
    found = {}
    for variant in mount_point_variants():
        for link in MOUNT_POINT_LINKS[variant.split("-")[0]]:
            names = os.listdir(host_dir(work, variant, link))
            if names:
                found[f"{variant} {link}"] = sorted(names)
    return found


@pytest.mark.parametrize("who", ["root", "user"])
@pytest.mark.parametrize("runtime", ["runc", "crun"])
def test_mount_points_that_link_to_the_host_are_not_followed(node, runtime, who):
    """runc made /dev/fd, /dev/ptmx, ... and crun device nodes in the host
    directory an image's /dev pointed at; now the runtime meets real
    directories, and the container runs, as root and as the image's user."""
    for variant in mount_point_variants():
        sid = f"mp-{variant}-{runtime}-{who}"
        node.cli("up", f"mp-{variant}-{who}@1", "--id", sid)
        try:
            proc = layerfs_run(node, sid, "--runtime", runtime)
            assert (proc.returncode, proc.stdout, host_files(node.work)) == (
                0, f"ran {0 if who == 'root' else 1234}\n", {}), (variant, proc.stderr)
            rootfs = node.root / "sandboxes" / sid / "rootfs"
            for link in MOUNT_POINT_LINKS[variant.split("-")[0]]:
                if link != "work" and "/" not in link:
                    assert (rootfs / link).is_dir() and not (rootfs / link).is_symlink()
            if "work" in MOUNT_POINT_LINKS[variant.split("-")[0]]:
                assert (rootfs / "work").is_symlink()  # the cwd resolves in the container
        finally:
            node.cli("down", sid)


@pytest.mark.parametrize("runtime", ["runc", "crun"])
def test_an_up_bundle_of_a_hostile_image_writes_nothing_on_the_host(node, runtime, tmp_path):
    for variant in mount_point_variants():
        sid = f"mpb-{variant}-{runtime}"
        bundle = tmp_path / sid
        node.cli("up", f"mp-{variant}-root@1", "--id", sid, "--bundle", str(bundle))
        try:
            proc = runtime_run(node, runtime, bundle, f"{sid}-c")
            assert (proc.returncode, proc.stdout, host_files(node.work)) == (
                0, "ran 0\n", {}), (variant, proc.stderr)
        finally:
            node.cli("down", sid)


def test_mount_points_are_made_real_without_following_links(tmp_path):
    """On a plain directory: a symlinked, a file and a missing mount point; a
    bind-mounted file whose target is a symlink, and one that is a directory."""
    host = tmp_path / "host"
    (host / "etc").mkdir(parents=True)
    (host / "etc" / "hosts").write_text("host's own\n")
    rootfs = tmp_path / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    (rootfs / "dev").symlink_to(host)
    (rootfs / "proc").write_text("a file\n")
    (rootfs / "etc" / "hosts").symlink_to(CLIMB + str(host / "etc" / "hosts").lstrip("/"))
    (rootfs / "etc" / "hostname" / "sub").mkdir(parents=True)
    source = tmp_path / "hosts"
    source.write_text("127.0.0.1 localhost\n")
    mounts = runtime_config(str(rootfs), ProcessSpec(args=("true",)), "h")["mounts"]
    mounts += [{"destination": f"/etc/{name}", "type": "bind", "source": str(source),
                "options": ["rbind", "ro"]} for name in ("hosts", "hostname")]
    replaced = make_mount_points(str(rootfs), mounts)
    assert replaced == ["/proc", "/dev", "/etc/hosts", "/etc/hostname"]
    assert [p.name for p in rootfs.iterdir() if p.is_symlink()] == []
    assert (rootfs / "dev").is_dir() and (rootfs / "proc").is_dir()
    assert not (rootfs / "sys").exists()  # the runtime makes it, inside the rootfs
    for name in ("hosts", "hostname"):
        target = rootfs / "etc" / name
        assert target.is_file() and not target.is_symlink() and target.stat().st_size == 0
    assert sorted(os.listdir(host)) == ["etc"]
    assert (host / "etc" / "hosts").read_text() == "host's own\n"
    assert make_mount_points(str(rootfs), mounts) == []  # real now: nothing to do


# -- the resolution itself, on plain directories --

def etc_rootfs(tmp_path: Path) -> Path:
    rootfs = tmp_path / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    return rootfs


def test_symlinks_resolve_inside_the_rootfs(tmp_path):
    host = tmp_path / "host"
    host.mkdir()
    (host / "passwd").write_text(HOST_PASSWD)
    rootfs = etc_rootfs(tmp_path)
    (rootfs / "etc" / "real").write_text("app:x:1234:2345::/home/app:/bin/sh\n")
    for target in (str(host / "passwd"), "../" * 12 + str(host / "passwd").lstrip("/")):
        (rootfs / "etc" / "passwd").unlink(missing_ok=True)
        (rootfs / "etc" / "passwd").symlink_to(target)
        with pytest.raises(ImageUserError, match="no user 'evil'"):
            resolve_user(str(rootfs), "evil")
        assert resolve_user(str(rootfs), "").home == "/root"
    (rootfs / "etc" / "passwd").unlink()
    (rootfs / "etc" / "passwd").symlink_to("/etc/real")  # absolute, inside the rootfs
    assert resolve_user(str(rootfs), "app").uid == 1234


def test_etc_itself_a_symlink_to_the_host(tmp_path):
    host = tmp_path / "host"
    host.mkdir()
    (host / "passwd").write_text(HOST_PASSWD)
    rootfs = tmp_path / "rootfs"
    rootfs.mkdir()
    (rootfs / "etc").symlink_to(host)
    with pytest.raises(ImageUserError, match="no user 'evil'"):
        resolve_user(str(rootfs), "evil")


def test_a_fifo_does_not_block(tmp_path):
    rootfs = etc_rootfs(tmp_path)
    os.mkfifo(rootfs / "etc" / "passwd")
    outcome: list[BaseException] = []

    def resolve() -> None:
        try:
            resolve_user(str(rootfs), "0")
        except BaseException as exc:  # noqa: BLE001 (handed to the test's thread)
            outcome.append(exc)

    worker = threading.Thread(target=resolve, daemon=True)
    worker.start()
    worker.join(60)  # a guard against a hang, not a timing check
    if worker.is_alive():
        with open(rootfs / "etc" / "passwd", "w"):  # let the blocked open finish
            pass
        pytest.fail("reading a FIFO /etc/passwd blocked")
    assert len(outcome) == 1 and isinstance(outcome[0], ImageFileError)
    assert "not a regular file" in str(outcome[0])


def test_a_huge_or_odd_passwd_is_refused(tmp_path):
    rootfs = etc_rootfs(tmp_path)
    with open(rootfs / "etc" / "passwd", "wb") as f:
        f.truncate(100 << 20)
    with pytest.raises(ImageFileError, match="larger than"):
        resolve_user(str(rootfs), "0")
    (rootfs / "etc" / "passwd").unlink()
    (rootfs / "etc" / "passwd").mkdir()
    with pytest.raises(ImageFileError, match="not a regular file"):
        resolve_user(str(rootfs), "0")


def test_a_missing_passwd_allows_numbers_only(tmp_path):
    rootfs = etc_rootfs(tmp_path)
    user = resolve_user(str(rootfs), "77:88")
    assert (user.uid, user.gid, user.additional_gids, user.home) == (77, 88, (), "/")
    with pytest.raises(ImageUserError):
        resolve_user(str(rootfs), "app")
    with pytest.raises(ImageUserError):
        resolve_user(str(rootfs), "4294967296")  # beyond uid_t


def test_a_non_root_image_user_has_no_effective_capabilities(node):
    proc = layerfs_run(node, "img", "--", "grep -E '^Cap(Eff|Prm|Bnd):' /proc/self/status")
    assert proc.returncode == 0, proc.stderr
    caps = {k: int(v, 16) for k, _, v in (line.partition(":\t")
                                           for line in proc.stdout.splitlines())}
    assert caps["CapEff"] == 0 and caps["CapPrm"] == 0 and caps["CapBnd"] != 0


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A sticky world-writable directory (like /tmp) for an attacker's files."""
    path = Path(tempfile.mkdtemp(prefix="layerfs-bundle-", dir="/tmp"))  # not 0700 tmp_path
    path.chmod(0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def make_as(user: LocalUser, *paths: Path) -> None:
    """The user makes directories ``paths`` (0755), in order."""
    proc = user.python("import os, sys; [os.mkdir(p, 0o755) for p in sys.argv[1:]]",
                       *map(str, paths))
    assert proc.returncode == 0, proc.stderr


def refused_bundle(node: NodeDaemon, bundle: Path, message: str) -> None:
    """``up --bundle`` refuses the directory with one line, before anything is up."""
    proc = node.cli("up", "img@1", "--id", "refused", "--bundle", str(bundle), check=False)
    assert proc.returncode == 2
    assert proc.stderr == f"layerfs: error: unsafe bundle directory {bundle}: {message}\n"
    assert "refused" not in sandbox_ids(node)
    assert not (node.root / "sandboxes" / "refused").exists()


def test_up_bundle_refuses_a_directory_a_user_owns(node, local_user, shared_dir, tmp_path):
    """The owner of the bundle directory could swap config.json (``root.path
    "/"``) before root's `runc run -b DIR` reads it: refused, and a planted
    config.json symlink to a root file is neither followed nor replaced."""
    victim = tmp_path / "victim"
    victim.write_text("root's own file\n")
    bundle = shared_dir / "attacker"
    make_as(local_user, bundle)
    planted = local_user.python("import os, sys; os.symlink(sys.argv[1], sys.argv[2])",
                                str(victim), str(bundle / "config.json"))
    assert planted.returncode == 0, planted.stderr
    refused_bundle(node, bundle, f"{bundle} is owned by uid {local_user.uid}, not root")
    assert victim.read_text() == "root's own file\n"
    assert (bundle / "config.json").is_symlink()


def test_up_bundle_refuses_a_path_a_user_can_change(node, local_user, shared_dir):
    """Root's own directory inside a user's (who can rename it away and put
    another there), a symlink on the way, a directory writable by others
    (sticky or not), one writable by a group."""
    owned = shared_dir / "owned"
    make_as(local_user, owned)
    inner = owned / "bundle"
    inner.mkdir()  # root's, in the user's directory
    refused_bundle(node, inner, f"{owned} is owned by uid {local_user.uid}, not root")
    refused_bundle(node, owned / "missing" / "bundle",
                   f"{owned} is owned by uid {local_user.uid}, not root")
    link = shared_dir / "link"
    link.symlink_to(inner)
    refused_bundle(node, link / "sub", f"{link} is a symlink")
    refused_bundle(node, link, f"{link} is a symlink")
    refused_bundle(node, link / ".." / "open", f"{link} is a symlink")  # not read as ./open
    for mode in (0o777, 0o1777, 0o775):
        bundle = shared_dir / f"open-{mode:o}"
        bundle.mkdir()
        bundle.chmod(mode)
        refused_bundle(node, bundle, f"{bundle} is writable by group or others")
    loose = shared_dir / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    refused_bundle(node, loose / "bundle", f"{loose} is writable by group or others")


def test_up_bundle_in_roots_directory_under_tmp(node, shared_dir):
    """A root-owned directory in a sticky world-writable one (/tmp) is root's
    to change alone: accepted; a missing one is made 0700, an existing one keeps its mode."""
    for name, mode in (("made", None), ("kept", 0o755)):
        bundle = shared_dir / name / "bundle"
        if mode is not None:
            bundle.mkdir(parents=True)
            bundle.chmod(mode)
        node.cli("up", "img@1", "--id", f"tmp-{name}", "--bundle", str(bundle))
        try:
            assert os.stat(bundle).st_mode & 0o777 == (mode or 0o700)
            assert os.stat(bundle).st_uid == 0
            assert json.loads((bundle / "config.json").read_text())["process"]["user"][
                "uid"] == 1234
            assert sorted(os.listdir(bundle)) == ["config.json"]
        finally:
            node.cli("down", f"tmp-{name}")


def test_write_bundle_replaces_a_config_json_symlink(tmp_path):
    """(Root's own directory, where a link could only be root's.) Replaced,
    never written through."""
    victim = tmp_path / "victim"
    victim.write_text("root's own file\n")
    rootfs = tmp_path / "rootfs"
    rootfs.mkdir()
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").symlink_to(victim)
    config = runtime_config(str(rootfs), ProcessSpec(args=("true",)), "h")
    assert write_bundle(str(bundle), config, private=False) == str(bundle / "config.json")
    assert victim.read_text() == "root's own file\n"
    assert not (bundle / "config.json").is_symlink()
    assert json.loads((bundle / "config.json").read_text())["root"]["path"] == str(rootfs)
