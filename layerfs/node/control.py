"""The control API: one JSON request line, one JSON response line, over
``ROOT/control.sock`` (mode 0600, root only). The server runs in the daemon's
trio loop and hands its handler parsed requests (:mod:`.protocol`); the
client is plain blocking code for the CLI that reads answers back into their
dataclasses."""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import trio

from ..errors import LayerfsError
from .protocol import Message, Ping, Request, parse_request

log = logging.getLogger(__name__)
MAX_REQUEST = 1 << 20

Handler = Callable[[Request], Awaitable[Message]]
A = TypeVar("A", bound=Message)


class DaemonNotRunning(LayerfsError):
    """no layerfs daemon answers at {} (start one with `layerfs daemon --root {}`)"""

    exit_code = 10


class RemoteError(LayerfsError):
    """{}"""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.exit_code = code


def exit_code_of(exc: LayerfsError) -> int:
    """The exit code of an error's first cause that is a layerfs error: a read
    that failed because a chunk is damaged exits as an integrity error (6), one
    whose store is down as unreachable (8)."""
    while isinstance(exc.__cause__, LayerfsError):
        exc = exc.__cause__
    return exc.exit_code


def socket_path(root: str | os.PathLike[str]) -> Path:
    return Path(root) / "control.sock"


class ControlServer:
    def __init__(self, root: Path, handler: Handler) -> None:
        self.path = socket_path(root)
        self.handler = handler

    async def serve(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self.path.unlink(missing_ok=True)
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            await sock.bind(str(self.path))
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        sock.listen(128)
        listener = trio.SocketListener(sock)
        task_status.started()
        await trio.serve_listeners(self._connection, [listener])

    async def _connection(self, stream: trio.SocketStream) -> None:
        async with stream:
            buf = b""
            while b"\n" not in buf and len(buf) < MAX_REQUEST:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    return
                buf += chunk
            response = await self._answer(buf)
            try:
                await stream.send_all(json.dumps(response).encode() + b"\n")
            except trio.BrokenResourceError:
                pass

    async def _answer(self, raw: bytes) -> dict[str, Any]:
        try:
            request = json.loads(raw)
            if not isinstance(request, dict):
                raise ValueError("not an object")
        except ValueError:
            return {"ok": False, "error": "bad request: not a JSON object", "code": 2}
        try:
            answer = await self.handler(parse_request(request))
            return {"ok": True, **answer.to_json()}
        except LayerfsError as exc:
            return {"ok": False, "error": str(exc), "code": exit_code_of(exc)}
        except OSError as exc:
            log.error("%s: %s", request.get("op"), exc)
            return {"ok": False, "error": str(exc), "code": 1}
        except Exception as exc:  # the daemon keeps serving; the cause is logged
            log.exception("%s failed", request.get("op"))
            return {"ok": False, "error": f"internal error: {exc!r}", "code": 1}


def call(root: str | os.PathLike[str], request: Request, answer: type[A],
         timeout: float | None = None) -> A:
    """Send one request to the daemon at ``root``; its answer, or its error
    raised as ours."""
    return answer.from_json(call_raw(root, request.to_json(), timeout), request.op)


def call_raw(root: str | os.PathLike[str], request: dict[str, Any],
             timeout: float | None = None) -> dict[str, Any]:
    """Send one request, as JSON, to the daemon at ``root``; the answer as JSON,
    or its error raised as ours."""
    path = socket_path(root)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        raise DaemonNotRunning(root, root) from None
    with sock:
        sock.sendall(json.dumps(request).encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            buf += chunk
    if not buf:
        raise DaemonNotRunning(root, root)
    response = json.loads(buf)
    if not response.pop("ok", False):
        raise RemoteError(response.get("error", "unknown error"), int(response.get("code", 1)))
    return response


def wait_ready(root: str | os.PathLike[str], alive: Callable[[], bool],
               timeout: float = 60.0) -> bool:
    """Wait until a daemon answers at ``root``; False if ``alive()`` turns false
    (the process died) or the time runs out."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            call_raw(root, Ping().to_json(), timeout=5)
            return True
        except (LayerfsError, OSError, ValueError):
            if not alive() or time.monotonic() > deadline:
                return False
            time.sleep(0.05)
