"""The control API's wire format and its client: one JSON request line, one
JSON response line, over ``ROOT/control.sock``. The client is plain blocking
sockets and json (no trio: a node command starts in a few tens of ms) and reads
answers back into their records (:mod:`.protocol`); the daemon's end is
:mod:`.daemon.controlserver`. The socket is the interpreter's own ``_socket`` object:
the ``socket`` module around it (its enums, ``selectors``) would add ~5 ms to
every command's start and nothing this client uses."""

from __future__ import annotations

import _socket
import json
import os
import time
from collections.abc import Callable

from ..errors import ControlSocketDenied, DaemonNotRunning, LayerfsError, RemoteError
from .protocol import Ping, Request

TYPE_CHECKING = False  # (typing is not imported at run time)
if TYPE_CHECKING:
    from typing import Any, TypeVar

    from .protocol import Message

    A = TypeVar("A", bound=Message)

DEFAULT_ROOT = "/var/lib/layerfs"


_REMOTE_CLASSES: dict[str, type[RemoteError]] = {}


def remote_error(message: str, code: int, kind: str) -> RemoteError:
    """A daemon's error as the client raises it: a :class:`RemoteError` that is
    also an instance of the error class named ``kind``, if this process knows
    one (``except SandboxNotFound`` and ``except RemoteError`` both catch it),
    its message and exit code the daemon's."""
    cls = _REMOTE_CLASSES.get(kind)
    if cls is None:
        known = error_classes().get(kind)
        if known is None:
            return RemoteError(message, code, kind)
        cls = _REMOTE_CLASSES[kind] = type(kind, (RemoteError, known), {
            "__doc__": "{}", "__module__": __name__, "__qualname__": kind})
    return cls(message, code, kind)


def error_classes() -> dict[str, type[LayerfsError]]:
    """Every layerfs error class this process has imported, by kind (remote
    copies left out)."""
    found: dict[str, type[LayerfsError]] = {}
    todo: list[type[LayerfsError]] = [LayerfsError]
    while todo:
        cls = todo.pop()
        if not issubclass(cls, RemoteError):
            found.setdefault(cls.kind, cls)
        todo += cls.__subclasses__()
    return found


def socket_path(root: str | os.PathLike[str]) -> str:
    """Where the daemon at ``root`` listens (a str: a client needs no pathlib)."""
    return os.path.join(root, "control.sock")


def call(root: str | os.PathLike[str], request: Request, answer: type[A],
         timeout: float | None = None) -> A:
    """Send one request to the daemon at ``root``; its answer, or its error
    raised as ours. Fields of the answer that ``answer`` does not know (a newer
    daemon's) are ignored."""
    return answer.from_json(call_raw(root, request.to_json(), timeout), request.op,
                            extra_fields=True)


def call_raw(root: str | os.PathLike[str], request: dict[str, Any],
             timeout: float | None = None) -> dict[str, Any]:
    """Send one request, as JSON, to the daemon at ``root``; the answer as JSON,
    or its error raised as ours."""
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(socket_path(root))
        except (FileNotFoundError, ConnectionRefusedError):
            raise DaemonNotRunning(root, root) from None
        except PermissionError:
            raise ControlSocketDenied(socket_path(root)) from None
        sock.sendall(json.dumps(request).encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            buf += chunk
    finally:
        sock.close()
    if not buf:
        raise DaemonNotRunning(root, root)
    response = json.loads(buf)
    if not response.pop("ok", False):
        raise remote_error(str(response.get("error", "unknown error")),
                           int(response.get("code", 1)), str(response.get("kind", "RemoteError")))
    return response


def wait_ready(root: str | os.PathLike[str], alive: Callable[[], bool],
               timeout: float = 60.0) -> bool:
    """Wait until a daemon answers at ``root``; False if ``alive()`` turns false
    (the process died) or the time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            call_raw(root, Ping().to_json(), timeout=5)
            return True
        except (LayerfsError, OSError, ValueError):
            if not alive() or time.monotonic() > deadline:
                return False
            time.sleep(0.05)
