"""A store that a test can take away and bring back.

file:// — the store directory is renamed away (and back). s3:// — the daemon
talks to the suite's shared SeaweedFS (a session fixture) through
:class:`Relay`, a TCP relay on 127.0.0.1 that, taken away, closes its port
and every connection (a dead port: connection refused) and, brought back,
listens on the same port again.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

# the daemon's line when it finds its store away
STORE_LOST = (r"WARNING layerfs\.node\.replica\.storehealth: store \S+ unreachable \(.*\); "
              r"serving what")


class Relay:
    """127.0.0.1:<port> → ``target`` (host:port), byte for byte."""

    def __init__(self, target: str) -> None:
        parts = urlsplit(target)
        self.target = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.listener: socket.socket | None = None
        self.port = 0
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        self.open()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def open(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self.listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def close(self) -> None:
        """Nothing listens on the port any more; open connections are cut."""
        if self.listener is not None:
            with contextlib.suppress(OSError):
                self.listener.shutdown(socket.SHUT_RDWR)
            self.listener.close()
            self.listener = None
        with self.lock:
            conns, self.conns = self.conns, []
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                return
            upstream.settimeout(None)
            with self.lock:
                self.conns += [client, upstream]
            threading.Thread(target=pump, args=(client, upstream), daemon=True).start()
            threading.Thread(target=pump, args=(upstream, client, self.answer_gate),
                             daemon=True).start()

    def answer_gate(self) -> None:
        """Called before each piece of an answer is passed on: nothing here."""


def pump(src: socket.socket, dst: socket.socket, before: Callable[[], None] | None = None) -> None:
    """``src`` to ``dst`` byte for byte; ``before`` called before each piece."""
    try:
        while data := src.recv(65536):
            if before is not None:
                before()
            dst.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


class GatedRelay(Relay):
    """A relay whose answers stop while ``gate`` is clear: the store hangs in
    the middle of a request (connections open, no bytes); ``held`` is set
    once an answer is being held back."""

    def __init__(self, target: str) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.held = threading.Event()
        super().__init__(target)

    def answer_gate(self) -> None:
        """While the gate is clear, hold the answer back (and say so)."""
        if not self.gate.is_set():
            self.held.set()
            self.gate.wait()


class AwayStore:
    """The test's store, as the daemon reaches it (``cli_args``), that
    :meth:`away` makes unreachable and :meth:`back` reachable again."""

    def __init__(self, url: str, endpoint: str | None) -> None:
        self.url = url
        self.relay = Relay(endpoint) if endpoint else None

    def cli_args(self) -> list[str]:
        args = ["--store", self.url]
        return args + (["--s3-endpoint", self.relay.endpoint] if self.relay else [])

    def away(self) -> None:
        if self.relay is not None:
            self.relay.close()
        else:
            path = Path(self.url.removeprefix("file://"))
            os.rename(path, f"{path}.away")

    def back(self) -> None:
        if self.relay is not None:
            self.relay.open()
        else:
            path = Path(self.url.removeprefix("file://"))
            os.rename(f"{path}.away", path)

    def close(self) -> None:
        if self.relay is not None:
            self.relay.close()
