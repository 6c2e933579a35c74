"""Errors a user can cause or meet.

Each class's docstring is its message (formatted with the constructor's
arguments) and each carries the process exit code the CLI uses for it: one
code per meaning, the same in every command (README.md, Errors and exit
codes, lists them; tests/test_errors.py checks the table against these
classes). Its ``kind`` is the class's name, what ``--json`` errors and the
node's control protocol carry.

Every error class a user of the Python API (``layerfs.node.Client``) can
catch is importable from here, those of the node's client included
(:class:`DaemonNotRunning`, :class:`RemoteError`, :class:`SandboxNotUp`,
:class:`BadMessage`, the bundle and image-user errors of ``run`` and ``up
--bundle``); their older homes (``layerfs.node.control``, ``.client``,
``.protocol``, ``.bundle``, ``.imageuser``) import them from here, so that
both paths name the same class. This module imports nothing.
"""

from __future__ import annotations


class LayerfsError(Exception):
    """Error: {}"""

    exit_code = 2
    kind = "LayerfsError"

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls.kind = cls.__name__

    def message(self) -> str:
        doc = (type(self).__doc__ or "{}").strip().splitlines()[0]
        try:
            return doc.format(*self.args)
        except (IndexError, KeyError):
            return f"{doc} {self.args}"

    def __str__(self) -> str:
        return self.message()


class UsageError(LayerfsError):
    """{}"""

    exit_code = 2


class InvalidName(LayerfsError):
    """invalid {}: {!r} (expected {})"""

    exit_code = 2


class TooManyLayers(LayerfsError):
    """{} has {} distinct layers, more than the {} a sandbox can mount: fold consecutive image layers into fewer with `layerfs import --fold SIZE`"""  # noqa: E501

    exit_code = 2


class InvalidReference(LayerfsError):
    """invalid reference {!r}: expected name@version or sha256:<hex>"""

    exit_code = 2


class SourceError(LayerfsError):
    """source {}: {}"""

    exit_code = 3


class UnsafeTarEntry(LayerfsError):
    """unsafe tar entry {!r}: {}"""

    exit_code = 3


class UnsupportedEntry(LayerfsError):
    """cannot store {!r}: {}"""

    exit_code = 3


class DiskError(LayerfsError):
    """disk {}: {}"""

    exit_code = 9  # the base of the disk errors at the end: raise one of those


class VmError(LayerfsError):
    """vm {}: {}"""

    exit_code = 9  # the base of the vm errors at the end: raise one of those


class VersionExists(LayerfsError):
    """{} already exists with other content; versions are immutable"""

    exit_code = 4


class SnapshotExists(LayerfsError):
    """{} already exists: a suspend never writes over a ref (give another version)"""

    exit_code = 4


class DestinationExists(LayerfsError):
    """destination {}: {}"""

    exit_code = 4


class RefNotFound(LayerfsError):
    """no such {}: {}"""

    exit_code = 5


class Revoked(LayerfsError):
    """{} is revoked{}: a node brings up nothing of it (`layerfs unrevoke` lifts it)"""

    exit_code = 5  # withdrawn: as good as gone for a new up


class IntegrityError(LayerfsError):
    """integrity check failed for {}: {}"""

    exit_code = 6  # corrupt data: a digest mismatch, a malformed object


class StoreError(LayerfsError):
    """store error: {}"""

    exit_code = 7  # and the base of the five kinds below


class ObjectNotFound(StoreError):
    """object not found in store: {}"""

    exit_code = 5


class AccessDenied(StoreError):
    """access denied by store: {}"""

    exit_code = 12


class BlobVanished(StoreError):
    """{} vanished from the store while {}; nothing was published, build again"""

    exit_code = 7


class TransientStoreError(StoreError):
    """transient store error: {}"""

    exit_code = 8  # what the store's retries retry: the two kinds below


class StoreUnreachable(TransientStoreError):
    """store unreachable: {}"""

    exit_code = 8  # no connection, or no answer in time


class NoProgress(StoreUnreachable):
    """store unreachable: no progress for {}s (--timeout), giving up: {}"""

    exit_code = 8


class ObjectUnavailable(TransientStoreError):
    """object unavailable (the store answers but cannot serve it now): {}"""

    exit_code = 11  # a 5xx or throttling reply, EIO: a lost volume, an overloaded server


class RegistryError(LayerfsError):
    """registry {}: {}"""

    exit_code = 7


class RegistryAuthRequired(RegistryError):
    """registry {}: authentication required for {}"""

    exit_code = 7


class RegistryUnreachable(RegistryError):
    """registry {} unreachable: {}"""

    exit_code = 8


class RegistryNoProgress(RegistryUnreachable):
    """registry {} unreachable: no progress for {}s (--timeout), giving up: {}"""

    exit_code = 8


class RefMismatch(IntegrityError):
    """integrity check failed for {} ref {}: it points at a manifest of {}"""

    exit_code = 6


class VerifyFailed(LayerfsError):
    """verify {}: {}"""

    def __init__(self, refs: str, summary: str, exit_code: int) -> None:
        super().__init__(refs, summary)
        self.exit_code = exit_code  # that of the worst kind of object found


class BadMetaImage(IntegrityError):
    """integrity check failed for the meta image of {}: {}"""

    exit_code = 6


class CheckerTimeout(LayerfsError):
    """the meta image of {} was not checked: the checker gave no verdict within {}s; try again"""

    exit_code = 14  # node-side trouble, nothing found corrupt: the check is to be asked again


class OverLimit(LayerfsError):
    """{}: field {} is over the limit: {} (at most {}); nothing was published"""

    exit_code = 3  # an input error: what the store would hold is beyond layerfs.bounds



class LimitUnsupported(LayerfsError):
    """{}: this node cannot enforce it ({}); nothing was brought up"""

    exit_code = 17  # a limit asked for that the node has no means to enforce


# -- node objects: a sandbox, disk or vm that is missing (5), exists (9) or is busy (15)

class SandboxError(LayerfsError):
    """sandbox {}: {}"""

    exit_code = 9  # the base of the sandbox errors below: raise one of those


class SandboxNotFound(SandboxError):
    """sandbox {}: no such sandbox"""

    exit_code = 5


class SandboxExists(SandboxError):
    """sandbox {}: already exists"""

    exit_code = 9


class SandboxBusy(SandboxError):
    """sandbox {}: container {} runs in it (stop it first, or `down --force` kills it)"""

    exit_code = 15


class SandboxInUse(SandboxError):
    """sandbox {}: busy (another request is bringing it up, taking it down or committing it)"""

    exit_code = 15


class DiskNotFound(DiskError):
    """disk {}: no such disk"""

    exit_code = 5


class DiskExists(DiskError):
    """disk {}: already exists"""

    exit_code = 9


class DiskBusy(DiskError):
    """disk {}: busy"""

    exit_code = 15


class DiskBroken(DiskError):
    """disk {} cannot be opened: {}"""

    exit_code = 6  # what an earlier run left does not load: see the daemon's log


class DiskInUse(DiskError):
    """disk {}: the writable disk of vm {}: take the vm down first (`layerfs vm down`)"""

    exit_code = 15


class VmNotFound(VmError):
    """vm {}: no such vm"""

    exit_code = 5


class VmExists(VmError):
    """vm {}: already exists"""

    exit_code = 9


class VmBusy(VmError):
    """vm {}: busy (another request is bringing it up or taking it down)"""

    exit_code = 15


class ControlSocketDenied(LayerfsError):
    """permission denied on {}: only root drives the node daemon (run this as root)"""

    exit_code = 2  # as `layerfs daemon` run by another user: a command root must run


class NodeFull(LayerfsError):
    """ROOT is full: {} has {} free, {} needs {}; free space (`down` sandboxes whose upper directories grew, remove files) and try again"""  # noqa: E501

    exit_code = 16  # the node's file system has no room for a new sandbox or container


class MountBusy(SandboxBusy):
    """sandbox {}: {} is busy (a process has its working directory or a file open in it); \
down stopped there: run it again once that process is gone"""


class DownIncomplete(LayerfsError):
    """sandbox {}: down stopped while {}: {} (run it again)"""

    exit_code = 14  # node-side trouble (the replica or the file system failed it): ask again


class NoProgressUnavailable(ObjectUnavailable):
    """object unavailable: no progress for {}s (--timeout), giving up: {}"""

    exit_code = 11  # every failed attempt of the stall was answered "unavailable" (5xx, EIO)


class NoAnswerInTime(StoreUnreachable):
    """store unreachable: {}"""

    exit_code = 8  # an attempt still running when the time without progress ran out


class LayerInUse(LayerfsError):
    """layer {} is in use by {}: remove those envs first, or rm --force"""

    exit_code = 15  # busy: an env names the layer


# -- the node's client (layerfs.node.Client): raised in the caller's process

class DaemonNotRunning(LayerfsError):
    """no layerfs daemon answers at {} (start one with `layerfs daemon --root {}`)"""

    exit_code = 10


class RemoteError(LayerfsError):
    """{}"""

    def __init__(self, message: str, code: int, kind: str = "RemoteError") -> None:
        LayerfsError.__init__(self, message)  # (not the kind's own constructor: remote_error)
        self.exit_code = code
        self.kind = kind


class SandboxNotUp(UsageError):
    """sandbox {} is not up"""


class BadMessage(UsageError):
    """bad request {}: {}"""


class BundleError(LayerfsError):
    """cannot make the container's process: {}"""

    exit_code = 2


class UnsafeBundleDir(LayerfsError):
    """unsafe bundle directory {}: {}"""

    exit_code = 2


class ImageUserError(LayerfsError):
    """image user {!r}: {}"""

    exit_code = 2


class ImageFileError(LayerfsError):
    """the image's {}: {}"""

    exit_code = 2
