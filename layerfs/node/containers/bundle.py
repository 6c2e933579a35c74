"""OCI runtime bundles for sandboxes: the ``config.json`` a runtime (runc, crun)
runs a sandbox's rootfs with, and the bundle directory that holds it.

The configuration follows the OCI runtime spec 1.0.2 and sets Docker's safe
defaults: pivot_root into the rootfs, new pid, mount, ipc and uts namespaces
(and a new, empty network namespace unless the host's is asked for), Docker's
default capability set with ``noNewPrivileges``, masked and read-only /proc
paths, a private /dev, /sys read-only, and a seccomp profile that refuses the
system calls Docker's default profile refuses to a container without
CAP_SYS_ADMIN (new user namespaces, keyrings, bpf, kernel modules, ...).

A bundle is written only once the image cannot redirect it: every path the
runtime mounts over on the rootfs is a real directory (or, for a file mount,
a regular file) there (:func:`make_mount_points`), and the bundle directory
is root's alone to change (:func:`open_bundle_dir`).
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import re
import signal
import stat
from collections.abc import Mapping, Sequence

from ...errors import BundleError, UnsafeBundleDir
from ...imageconfig import ImageConfig
from ...records import Record, field, fields
from ...safeopen import DIR_FLAGS
from .imageuser import ImageUser, resolve_user

TYPE_CHECKING = False  # typing is not imported at run time: a client starts faster
if TYPE_CHECKING:
    from typing import Any

OCI_VERSION = "1.0.2"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DEFAULT_NOFILE = (1024, 1024)  # soft, hard: Docker's default

# Docker's default capability set (moby's oci/caps/defaults.go).
DEFAULT_CAPABILITIES = (
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
)
MASKED_PATHS = (
    "/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
    "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi",
    "/sys/firmware", "/sys/devices/virtual/powercap",
)
READONLY_PATHS = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger")

NETWORK_MODES = ("none", "host")
ENV_NAME = re.compile(r"[^=\s\x00-\x1f\x7f]+")  # an environment variable's name

# System calls refused with EPERM: those Docker's default seccomp profile does not
# allow a container without CAP_SYS_ADMIN and friends, and that reach kernel state
# shared with the host (keyrings, bpf, perf, modules, clocks, swap, accounting).
DENIED_SYSCALLS = (
    "acct", "add_key", "bpf", "clock_adjtime", "clock_settime", "create_module",
    "delete_module", "finit_module", "fsconfig", "fsmount", "fsopen", "fspick",
    "get_kernel_syms", "init_module", "io_uring_enter", "io_uring_register",
    "io_uring_setup", "ioperm", "iopl", "kcmp", "kexec_file_load", "kexec_load", "keyctl",
    "lookup_dcookie", "mount", "mount_setattr", "move_mount", "nfsservctl",
    "open_by_handle_at", "open_tree", "perf_event_open", "pivot_root", "quotactl", "reboot",
    "request_key", "setdomainname", "sethostname", "setns", "settimeofday", "stime",
    "swapoff", "swapon", "syslog", "umount", "umount2", "uselib", "userfaultfd", "ustat",
    "vhangup",
)
# Namespace flags of clone(2)/unshare(2) (CLONE_NEWNS ... CLONE_NEWNET, CLONE_NEWCGROUP,
# CLONE_NEWTIME): a container without CAP_SYS_ADMIN makes no namespaces, in particular
# no user namespace that would hand it every capability over a new set of mounts.
NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000,
                   0x40000000, 0x00000080)
EPERM, ENOSYS = 1, 38
SECCOMP_ARCHES = {"x86_64": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
                  "aarch64": ["SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"]}


class ProcessSpec(Record):
    """What runs in the container: argv, environment, working directory and user.
    An image's config (Env, Entrypoint + Cmd, WorkingDir, User) maps onto it."""

    args: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str = "/"
    uid: int = 0
    gid: int = 0
    additional_gids: tuple[int, ...] = ()
    terminal: bool = False

    def env_list(self) -> list[str]:
        """The environment as the spec's ``KEY=value`` list, with a default PATH."""
        env = {"PATH": DEFAULT_PATH, **self.env}
        return [f"{key}={value}" for key, value in env.items()]


STOP_SIGNAL_ANNOTATION = "org.opencontainers.image.stopSignal"


def image_config_from(data: Mapping[str, Any] | None) -> ImageConfig | None:
    """The ImageConfig of a sandbox record (the daemon's answer), or None."""
    if not data:
        return None
    known = {f.name for f in fields(ImageConfig)}
    return ImageConfig(**{key: value for key, value in data.items() if key in known})


def process_args(config: ImageConfig | None, command: Sequence[str] = (),
                 entrypoint: str | None = None) -> tuple[str, ...]:
    """Docker's rules: Entrypoint + Cmd; a command given replaces Cmd and keeps
    the Entrypoint; ``entrypoint`` replaces the Entrypoint ("" for none) and
    drops Cmd. Nothing at all is an error, not a guessed shell."""
    if entrypoint is not None:
        head = [entrypoint] if entrypoint else []
        tail = list(command)
    else:
        head = list(config.entrypoint or []) if config else []
        tail = list(command) if command else list((config.cmd if config else None) or [])
    args = tuple(head + tail)
    if not args:
        raise BundleError("no command: the env's image config sets neither Entrypoint nor Cmd "
                          "(`layerfs run ID -- CMD` gives one)")
    return args


def image_env(config: ImageConfig | None, user: ImageUser, hostname: str,
              term: str | None) -> dict[str, str]:
    """The process environment: HOSTNAME, TERM and HOME (the user's passwd
    entry), then the image's Env over them; PATH defaults if the image sets none."""
    env = {"PATH": DEFAULT_PATH, "HOSTNAME": hostname, "TERM": term or "dumb",
           "HOME": user.home}
    for item in (config.env if config else []):
        key, sep, value = item.partition("=")
        if sep and key:
            env[key] = value
    return env


def checked_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` as given, if every name is non-empty, without ``=``, whitespace
    (a newline would forge another ``NAME=value`` line in what reads the
    environment as lines) or another control character, and no value holds a
    NUL (which the process could not receive)."""
    for key, value in env.items():
        if not ENV_NAME.fullmatch(key) or "\0" in value:
            raise BundleError(f"bad environment variable {key!r}: a name must be non-empty, "
                              "without '=', whitespace or control characters, and a value "
                              "may not hold a NUL")
    return dict(env)


def image_process(rootfs: str, config: ImageConfig | None, hostname: str, *,
                  command: Sequence[str] = (), entrypoint: str | None = None,
                  user: str | None = None, term: str | None = None,
                  terminal: bool = False, env: Mapping[str, str] | None = None,
                  cwd: str | None = None) -> ProcessSpec:
    """The process an image's config describes, in ``rootfs``: args, env (``env``
    added over the image's Env), cwd (``cwd``, else WorkingDir, default /) and
    the user (``user`` over the image's User), resolved against the rootfs's
    /etc/passwd and /etc/group."""
    args = process_args(config, command, entrypoint)
    spec = user if user is not None else (config.user if config else "")
    resolved = resolve_user(rootfs, spec)
    environment = {**image_env(config, resolved, hostname, term), **checked_env(env or {})}
    if cwd is not None and not cwd.startswith("/"):
        raise BundleError(f"the working directory {cwd!r} is not an absolute path")
    workdir = cwd if cwd is not None else (config.working_dir if config else "")
    return ProcessSpec(args=args, env=environment,
                       cwd=posixpath.normpath(posixpath.join("/", workdir)),
                       uid=resolved.uid, gid=resolved.gid,
                       additional_gids=resolved.additional_gids, terminal=terminal)


def image_annotations(config: ImageConfig | None) -> dict[str, str]:
    """The image's Labels, and its StopSignal, as config.json annotations."""
    if config is None:
        return {}
    annotations = dict(config.labels)
    if config.stop_signal:
        annotations[STOP_SIGNAL_ANNOTATION] = config.stop_signal
    return annotations


def stop_signal(config: ImageConfig | None) -> signal.Signals:
    """The image's StopSignal (``SIGUSR1``, ``USR1`` or ``10``), SIGTERM if unset."""
    given = config.stop_signal if config else ""
    name = given.strip().upper()
    if not name:
        return signal.SIGTERM
    try:
        if name.isdigit():
            return signal.Signals(int(name))
        return signal.Signals[name if name.startswith("SIG") else "SIG" + name]
    except (KeyError, ValueError):
        raise BundleError(f"unknown StopSignal {given!r} in the image config") from None


def runtime_config(rootfs: str, process: ProcessSpec, hostname: str,
                   network: str = "none",
                   nofile: tuple[int, int] = DEFAULT_NOFILE,
                   annotations: Mapping[str, str] | None = None,
                   resources: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The OCI runtime config.json for running ``process`` in ``rootfs``;
    ``resources``: the sandbox's cgroup limits (``linux.resources`` entries
    beside the device rule, :func:`.sandboxes.limits.resources`)."""
    if network not in NETWORK_MODES:
        raise ValueError(f"network must be one of {NETWORK_MODES}, not {network!r}")
    config: dict[str, Any] = {
        "ociVersion": OCI_VERSION,
        "process": _process(process, nofile),
        "root": {"path": rootfs, "readonly": False},
        "hostname": hostname,
        "mounts": _mounts(),
        "linux": _linux(network),
    }
    if resources:
        config["linux"]["resources"].update(resources)
    if annotations:
        config["annotations"] = dict(annotations)
    return config


def _process(process: ProcessSpec, nofile: tuple[int, int]) -> dict[str, Any]:
    if not process.args:
        raise ValueError("a container process needs at least one argument")
    caps = list(DEFAULT_CAPABILITIES)
    user: dict[str, Any] = {"uid": process.uid, "gid": process.gid}
    if process.additional_gids:
        user["additionalGids"] = list(process.additional_gids)
    return {
        "terminal": process.terminal,
        "user": user,
        "args": list(process.args),
        "env": process.env_list(),
        "cwd": process.cwd,
        "capabilities": {"bounding": caps, "effective": caps, "permitted": caps},
        "rlimits": [{"type": "RLIMIT_NOFILE", "soft": nofile[0], "hard": nofile[1]}],
        "noNewPrivileges": True,
    }


def _mounts() -> list[dict[str, Any]]:
    return [
        {"destination": "/proc", "type": "proc", "source": "proc",
         "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620",
                     "gid=5"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
         "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
         "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs",
         "options": ["nosuid", "noexec", "nodev", "ro"]},
    ]


def _linux(network: str) -> dict[str, Any]:
    namespaces = [{"type": kind} for kind in ("pid", "mount", "ipc", "uts")]
    if network == "none":
        namespaces.append({"type": "network"})
    return {
        "namespaces": namespaces,
        "maskedPaths": list(MASKED_PATHS),
        "readonlyPaths": list(READONLY_PATHS),
        "resources": {"devices": [{"allow": False, "access": "rwm"}]},
        "rootfsPropagation": "private",
        "seccomp": seccomp_profile(),
    }


def seccomp_profile() -> dict[str, Any]:
    """Allow by default; refuse calls on host kernel state, and new namespaces."""
    rules: list[dict[str, Any]] = [
        {"names": list(DENIED_SYSCALLS), "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM},
        # clone3 passes its flags in memory a filter cannot read: ENOSYS makes
        # libc fall back to clone(2), whose flags the rules below check.
        {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS},
    ]
    for flag in NAMESPACE_FLAGS:  # one rule per flag: refused when (flags & flag) == flag
        arg = {"index": 0, "value": flag, "valueTwo": flag, "op": "SCMP_CMP_MASKED_EQ"}
        rules.append({"names": ["clone", "unshare"], "action": "SCMP_ACT_ERRNO",
                      "errnoRet": EPERM, "args": [arg]})
    profile: dict[str, Any] = {"defaultAction": "SCMP_ACT_ALLOW", "syscalls": rules}
    arches = SECCOMP_ARCHES.get(os.uname().machine)
    if arches:
        profile["architectures"] = arches
    return profile


class MountPoint(Record):
    """A path of the rootfs a bundle mounts over: a directory, or a file (a
    bind mount of one)."""

    path: str
    file: bool = False


def rootfs_mount_points(mounts: Sequence[Mapping[str, Any]]) -> list[MountPoint]:
    """The destinations of ``mounts`` that lie on the rootfs itself, in order:
    a destination inside an earlier one (``/dev/pts`` in ``/dev``) is on that
    mount's fresh file system, not in the image, and so are the entries a
    runtime makes in ``/dev`` and the masked and read-only paths it mounts
    over in ``/proc`` and ``/sys`` (after pivot_root). The process's cwd is
    made and entered after pivot_root too, so a symlink there resolves in the
    container."""
    points: list[MountPoint] = []
    covered: list[str] = []
    for m in mounts:
        dest = posixpath.normpath(posixpath.join("/", m["destination"]))
        if dest != "/" and not any(dest == c or dest.startswith(c.rstrip("/") + "/")
                                   for c in covered):
            points.append(MountPoint(path=dest, file=_mounts_a_file(m)))
        covered.append(dest)
    return points


def _mounts_a_file(mount: Mapping[str, Any]) -> bool:
    """Whether ``mount`` binds a file (the runtime makes its target a file)."""
    bind = mount.get("type") == "bind" or {"bind", "rbind"} & set(mount.get("options", ()))
    return bool(bind) and os.path.isfile(mount.get("source", ""))


def make_mount_points(rootfs: str, mounts: Sequence[Mapping[str, Any]]) -> list[str]:
    """Make each path of the rootfs that ``mounts`` mount over a real directory
    (or empty regular file) before a runtime runs the bundle; the paths
    replaced. A runtime resolves a destination inside the rootfs but then
    makes entries under it (``/dev/fd``, ``/dev/null``, ...) by a path the
    host resolves: an image's ``/dev -> /host/dir`` would have root write
    there. Walked from a descriptor of the rootfs with ``O_NOFOLLOW``, each
    component that is a symlink or not a directory (for the last of a file
    mount: not a regular file) is removed and made anew, through the overlay
    (a whiteout and a new directory in the upper); an image's symlink is
    never followed. A missing path is left to the runtime, which makes it
    inside the rootfs (nothing on the way can redirect it)."""
    replaced: list[str] = []
    root_fd = os.open(rootfs, DIR_FLAGS)
    try:
        for point in rootfs_mount_points(mounts):
            replaced += _make_mount_point(root_fd, point)
    finally:
        os.close(root_fd)
    return replaced


def _make_mount_point(root_fd: int, point: MountPoint) -> list[str]:
    names = point.path.strip("/").split("/")
    replaced: list[str] = []
    fd = os.dup(root_fd)
    try:
        for k, name in enumerate(names):
            want_file = point.file and k == len(names) - 1
            path = "/" + "/".join(names[:k + 1])
            kind = _entry_kind(fd, name)
            if kind is None:
                break  # the runtime makes it and what is below, inside the rootfs
            if kind != ("file" if want_file else "dir"):
                _replace_entry(fd, name, kind, want_file)
                replaced.append(path)
            if want_file:
                break
            try:
                next_fd = os.open(name, DIR_FLAGS, dir_fd=fd)
            except OSError as exc:  # changed under us since: refuse rather than follow
                raise BundleError(f"{path} in the rootfs is not a directory: "
                                  f"{exc.strerror}") from None
            os.close(fd)
            fd = next_fd
    finally:
        os.close(fd)
    return replaced


def _entry_kind(dir_fd: int, name: str) -> str | None:
    """``dir``, ``file`` (regular), ``other`` (a symlink, device, ...) or None if absent."""
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return None
    return "dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"


def _replace_entry(dir_fd: int, name: str, kind: str, want_file: bool) -> None:
    """Remove ``name`` (a directory with what it holds, without following a
    symlink) and make an empty directory (0755) or regular file (0644) there."""
    if kind == "dir":
        import shutil  # (only here: a client starts faster without it)

        shutil.rmtree(name, dir_fd=dir_fd)
    else:
        os.unlink(name, dir_fd=dir_fd)
    if want_file:
        os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o644, dir_fd=dir_fd))
    else:
        os.mkdir(name, 0o755, dir_fd=dir_fd)


def open_bundle_dir(directory: str, create: bool = True) -> int | None:
    """A descriptor of bundle directory ``directory`` (made 0700 where missing
    if ``create``; without, None if it is missing), walked from ``/`` with
    ``O_NOFOLLOW``. Root runs what is in it later, by name, so only root may
    change it: every existing component must be root's, not a symlink, and
    writable by group or others only if sticky (``/tmp``); the directory itself
    root's and not writable by group or others. Anything else is
    :class:`UnsafeBundleDir`. The path is walked as the kernel resolves it
    (``link/..`` is not read as nothing)."""
    path = os.path.join(os.getcwd(), directory)
    names = [n for n in path.split("/") if n not in ("", ".")]
    fd = os.open("/", DIR_FLAGS)
    try:
        unsafe = _unsafe_component(fd, "/", last=not names)
        for k, name in enumerate(names):
            if unsafe:
                break
            sub = "/" + "/".join(names[:k + 1])
            next_fd, unsafe = _open_component(fd, name, sub, create)
            if next_fd is None:
                if unsafe:
                    break
                os.close(fd)
                return None  # missing, and not to be made
            os.close(fd)
            fd = next_fd
            unsafe = _unsafe_component(fd, sub, last=k == len(names) - 1)
    except BaseException:
        os.close(fd)
        raise
    if unsafe:
        os.close(fd)
        raise UnsafeBundleDir(path, unsafe)
    return fd


def _open_component(dir_fd: int, name: str, path: str,
                    create: bool) -> tuple[int | None, str | None]:
    """The directory ``name`` in ``dir_fd`` opened without following a symlink
    (made 0700 if missing and ``create``), or None if it is missing; or why
    it cannot be."""
    for _ in range(2):  # a second time after making it
        try:
            return os.open(name, DIR_FLAGS, dir_fd=dir_fd), None
        except FileNotFoundError:
            if not create:
                return None, None
            with contextlib.suppress(FileExistsError):  # made meanwhile: checked as found
                os.mkdir(name, 0o700, dir_fd=dir_fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                if stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                    return None, f"{path} is a symlink"
            return None, f"{path}: {exc.strerror}"
    return None, f"{path} vanished while it was made"


def _unsafe_component(fd: int, path: str, last: bool) -> str | None:
    """Why a user other than root could change what directory ``fd`` holds, or None."""
    st = os.fstat(fd)
    if st.st_uid != 0:
        return f"{path} is owned by uid {st.st_uid}, not root"
    if st.st_mode & 0o022 and (last or not st.st_mode & stat.S_ISVTX):
        return f"{path} is writable by group or others"
    return None


def write_bundle(directory: str, config: Mapping[str, Any], private: bool = True) -> str:
    """Write ``config`` as ``directory/config.json``; return the path. First
    the mount points of the config's rootfs are made real
    (:func:`make_mount_points`), and the directory opened as
    :func:`open_bundle_dir` does (missing parts made 0700); ``private`` makes
    an existing one 0700 too (the runner's own directories, not a directory
    the caller names). The file is written new, through that descriptor
    (0600, ``O_EXCL | O_NOFOLLOW``), and renamed over config.json, so a
    config.json that is a symlink is replaced, never written through."""
    make_mount_points(config["root"]["path"], config["mounts"])
    fd = open_bundle_dir(directory)
    assert fd is not None  # (made if missing)
    try:
        if private:
            os.fchmod(fd, 0o700)
        _write_config(fd, config)
    finally:
        os.close(fd)
    return os.path.join(os.path.abspath(directory), "config.json")


def _write_config(dir_fd: int, config: Mapping[str, Any]) -> None:
    temporary = f".config.json.{os.getpid()}.{os.urandom(4).hex()}"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                 | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(config, f, indent=1)
        os.replace(temporary, "config.json", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary, dir_fd=dir_fd)
        raise
