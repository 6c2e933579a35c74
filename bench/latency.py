"""A TCP relay that adds a fixed delay to every request: a store on this
machine made to answer like one across a network (the round trip), without
spending the node's CPU on waiting.

``python -m bench.latency --to HOST:PORT --delay-ms D`` listens on a free
port of 127.0.0.1, prints it, and relays each connection to ``HOST:PORT``:
what the client sends is held ``D`` ms before it goes on, the answer comes
back at once. Used by ``bench.image_start --store-latency-ms``; stopped by
SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import subprocess
import sys
from collections.abc import Iterator


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
               delay: float) -> None:
    try:
        while data := await reader.read(1 << 16):
            if delay:
                await asyncio.sleep(delay)
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(ConnectionError, OSError):
            writer.close()


async def serve(host: str, port: int, delay: float) -> None:
    async def relay(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(host, port)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(pipe(client_r, up_w, delay), pipe(up_r, client_w, 0))

    server = await asyncio.start_server(relay, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with server:
        await stop.wait()


@contextlib.contextmanager
def relay(endpoint: str, delay_ms: float) -> Iterator[str]:
    """A relay to ``endpoint`` (``http://HOST:PORT``) in a process of its own:
    its endpoint."""
    target = endpoint.split("://", 1)[1].rstrip("/")
    proc = subprocess.Popen([sys.executable, "-m", "bench.latency", "--to", target,
                             "--delay-ms", str(delay_ms)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--to", required=True, help="HOST:PORT")
    ap.add_argument("--delay-ms", type=float, default=0.0)
    args = ap.parse_args()
    host, port = args.to.rsplit(":", 1)
    asyncio.run(serve(host, int(port), args.delay_ms / 1000))


if __name__ == "__main__":
    main()
