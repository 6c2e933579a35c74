"""The daemon's end of the control API: a trio server on ``ROOT/control.sock``
(mode 0600, root only) that reads one JSON request line per connection, hands
its handler the parsed request (:mod:`.protocol`) and writes one JSON answer
line. The wire format and the client are in :mod:`.control`."""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from ... import schema
from ...errors import LayerfsError
from ..control import socket_path
from ..protocol import Message, Request, parse_request

log = logging.getLogger(__name__)
MAX_REQUEST = 1 << 20

Handler = Callable[[Request], Awaitable[Message]]


def deciding_error(exc: LayerfsError) -> LayerfsError:
    """An error's first cause that is a layerfs error, whose exit code and kind
    the answer carries: a read that failed because a chunk is damaged exits as
    an integrity error (6), one whose store is down as unreachable (8)."""
    while isinstance(exc.__cause__, LayerfsError):
        exc = exc.__cause__
    return exc


def exit_code_of(exc: LayerfsError) -> int:
    """The exit code a refused request's answer carries for ``exc``."""
    return deciding_error(exc).exit_code


def error_answer(exc: LayerfsError) -> dict[str, Any]:
    """A refused request's answer: the message, the exit code and the kind
    (the error class's name) the client raises it as (:func:`.control.remote_error`)."""
    cause = deciding_error(exc)
    return {"ok": False, "error": str(exc), "code": cause.exit_code, "kind": cause.kind}


class ControlServer:
    def __init__(self, root: Path, handler: Handler) -> None:
        self.path = Path(socket_path(root))
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
            request = schema.loads(raw)
            if not isinstance(request, dict):
                raise schema.SchemaError("", "not an object")
        except schema.SchemaError:
            return {"ok": False, "error": "bad request: not a JSON object", "code": 2,
                    "kind": "BadMessage"}
        try:
            answer = await self.handler(parse_request(request))
            return {"ok": True, **answer.to_json()}
        except LayerfsError as exc:
            return error_answer(exc)
        except OSError as exc:
            log.error("%s: %s", request.get("op"), exc)
            return {"ok": False, "error": str(exc), "code": 1, "kind": type(exc).__name__}
        except Exception as exc:  # the daemon keeps serving; the cause is logged
            log.exception("%s failed", request.get("op"))
            return {"ok": False, "error": f"internal error: {exc!r}", "code": 1,
                    "kind": "InternalError"}
