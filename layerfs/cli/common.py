"""Options and output helpers shared by every command group (import-light: the
node commands use them without click, see :mod:`.fastpath`; click is imported
where an option is declared, the store and registry when opened)."""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Callable

TYPE_CHECKING = False  # (typing is not imported at run time)
if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any


def write_store_options(fn: Callable) -> Callable:
    """:func:`store_options` and ``--timeout SECONDS``, on a command that writes."""
    import click

    @click.option("--timeout", "store_timeout", type=click.FloatRange(min=0.1), metavar="SECONDS",
                  envvar="LAYERFS_TIMEOUT", default=None,
                  help="Give up when the store (or, importing, the registry) has made "
                       "no progress for this long [env: LAYERFS_TIMEOUT; default: 60].")
    @functools.wraps(fn)
    def wrapper(out: Output, refstore: Any, store_timeout: float | None, **kw: Any):
        if store_timeout is not None:  # else the store's DEFAULT_TIMEOUT
            refstore.store.set_timeout(store_timeout)
        return fn(out, refstore, **kw)

    return store_options(wrapper, writes=True)


def store_options(fn: Callable, writes: bool = False) -> Callable:
    """``--store URL``, ``--s3-endpoint URL`` and ``--json`` on a command; one
    that does not ``writes`` finds a file store whose directory is missing
    unreachable, not empty."""
    import click

    @click.option("--store", "store_url", envvar="LAYERFS_STORE", metavar="URL",
                  help="file:///path or s3://bucket/prefix [env: LAYERFS_STORE; default: "
                       "/var/lib/layerfs/store as root].")
    @click.option("--s3-endpoint", envvar="AWS_ENDPOINT_URL", metavar="URL",
                  help="S3 endpoint for s3:// stores; several, comma separated, to fail "
                       "over between [env: AWS_ENDPOINT_URL].")
    @click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
    @functools.wraps(fn)
    def wrapper(store_url: str | None, s3_endpoint: str | None, as_json: bool, **kw: Any):
        from layerfs.refstore import RefStore
        from layerfs.store import open_store

        check_store_url(store_url)
        store = open_store(store_url, s3_endpoint=s3_endpoint, must_exist=not writes)
        try:
            return fn(Output(as_json), RefStore(store), **kw)
        finally:
            store.close()

    return wrapper


def check_store_url(url: str | None) -> None:
    """A ``--store`` URL (or ``$LAYERFS_STORE``) names its scheme: a bare path
    such as ``layerfs/prod`` is refused, not taken for a directory here."""
    scheme, sep, _ = (url or "").partition("://")
    if url is not None and not (sep and scheme.isalnum() and scheme[:1].isalpha()):
        from layerfs.errors import UsageError

        raise UsageError(f"store URL {url!r} needs a scheme: file:///path or "
                         "s3://bucket/prefix")


class Output:
    """Writes either human text or one JSON document to stdout."""

    json_emitted = False  # a JSON document went to stdout (then no JSON error follows)

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json

    def emit(self, doc: Any, text: str | Callable[[], str]) -> None:
        if self.as_json:
            Output.json_emitted = True
        out = json.dumps(doc, indent=2, sort_keys=True) if self.as_json else (
            text() if callable(text) else text)
        try:
            print(out, flush=True)
        except BrokenPipeError:  # the reader left (`layerfs ps | head -1`): quietly, as
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # click does


def json_requested(args: Sequence[str]) -> bool:
    """Whether ``--json`` is among the arguments (before a ``--``, after which
    they are a command's): then an error is also a JSON document."""
    head = args[:list(args).index("--")] if "--" in args else args
    return "--json" in head


def json_error(error: object, exit_code: int, kind: str) -> None:
    """An error as one JSON document on stdout, ``{"error": MESSAGE, "exit":
    CODE, "kind": KIND}`` (KIND: the error class's name), unless the command
    already printed its JSON document (whose exit code then tells)."""
    if Output.json_emitted:
        return
    from layerfs.bounds import MAX_ERROR_LINE, cut

    doc = {"error": cut(str(error), MAX_ERROR_LINE), "exit": exit_code, "kind": kind}
    try:
        print(json.dumps(doc, sort_keys=True), flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def parse_size(text: str) -> int:
    """``1M``, ``4KiB``, ``1048576`` → bytes; a bad size is a usage error."""
    from layerfs import sizes

    try:
        return sizes.parse_size(text)
    except ValueError:
        import click

        raise click.BadParameter(f"not a size: {text!r}") from None


def diagnostic(kind: str, text: object) -> str:
    """``layerfs: KIND: TEXT``, cut to :data:`~layerfs.bounds.MAX_ERROR_LINE`
    characters (with a marker): every error and warning line the CLI prints."""
    from layerfs.bounds import MAX_ERROR_LINE, cut

    return cut(f"layerfs: {kind}: {text}", MAX_ERROR_LINE)


def warn(text: object) -> None:
    """One bounded warning line on stderr."""
    print(diagnostic("warning", text), file=sys.stderr, flush=True)


def warn_offline(used: Sequence[Any]) -> None:
    """A warning line for each ref the node resolved itself (its store away)."""
    for ref in used:
        warn(ref.note())


def report_unreadable(problems: list[Any]) -> None:
    """Each ref or manifest a store-wide command skipped: one error line on stderr."""
    for problem in problems:
        print(diagnostic("error", problem), file=sys.stderr, flush=True)


def exit_if_unreadable(problems: list[Any]) -> None:
    """After a store-wide command's output: the integrity error's exit code if it
    skipped anything (each already named by :func:`report_unreadable`)."""
    if problems:
        from layerfs.errors import IntegrityError

        sys.exit(IntegrityError.exit_code)


def stderr_is_tty() -> bool:
    return sys.stderr.isatty()


class ProgressLine:
    """Counts files and bytes; redraws at most ten times a second on a terminal."""

    def __init__(self, label: str, enabled: bool) -> None:
        self.label = label
        self.enabled = enabled
        self.files = 0
        self.bytes = 0
        self.start = time.monotonic()
        self._drawn = 0.0

    def on_file(self) -> None:
        self.files += 1
        self._maybe_draw()

    def on_bytes(self, n: int) -> None:
        self.bytes += n
        self._maybe_draw()

    def _maybe_draw(self) -> None:
        now = time.monotonic()
        if self.enabled and now - self._drawn >= 0.1:
            self._drawn = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        rate = self.bytes / max(now - self.start, 1e-6)
        line = (f"{self.label}: {self.files} files, {human_bytes(self.bytes)}, "
                f"{human_bytes(rate)}/s")
        sys.stderr.write("\r\033[K" + line)
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.monotonic())
            sys.stderr.write("\n")
            sys.stderr.flush()
