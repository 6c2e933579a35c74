"""The ``store`` command group: questions about a store itself (``store init``,
``store check``)."""

from __future__ import annotations

import click

from layerfs.store import open_store
from layerfs.store.check import (
    CheckPlan,
    QuickCheck,
    StoreNotSafe,
    init_store,
    quick_check,
    run_check,
)

from .common import Output, check_store_url, warn


@click.group()
def store() -> None:
    """Questions about a store itself."""


INIT_TIMEOUT = 10.0  # seconds without progress before init gives up on the store


@store.command()
@click.argument("url", metavar="URL")
@click.option("--s3-endpoint", envvar="AWS_ENDPOINT_URL", metavar="URL",
              help="S3 endpoint(s) for s3:// stores, comma separated [env: AWS_ENDPOINT_URL].")
@click.option("--timeout", type=click.FloatRange(0.1, 3600), default=INIT_TIMEOUT,
              show_default=True, help="Seconds without progress before giving up.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def init(url: str, s3_endpoint: str | None, timeout: float, as_json: bool) -> None:
    """Set up the store at URL and say whether it is usable.

    Creates the bucket (s3://) or directory (file://) unless it exists, then
    checks that the credentials list it, that a conditional put creates a key
    and refuses a second create of it, and that a put is read back and listed.
    A file store's directory, its folders or a directory above it that a user
    other than root (and you) owns or others may write is named in a warning
    line (they could plant objects every node reads). Idempotent. Exit 0 if
    usable, else the store error's code (12: access
    denied, 8: unreachable, 13: not safe to share, 7: another error).
    """
    check_store_url(url)
    opened = open_store(url, s3_endpoint=s3_endpoint, timeout=timeout)
    try:
        result = init_store(opened)
    finally:
        opened.close()
    _report(result, as_json)


def _report(result: QuickCheck, as_json: bool) -> None:
    """The verdict on stdout (text, or a JSON document that is also the error's)."""
    doc: dict[str, object] = {"usable": result.usable, "url": result.url,
                              "created": result.created, "passed": list(result.passed),
                              "failed": result.failed or None, "advice": result.advice or None,
                              "warnings": list(result.warnings)}
    refusal = result.refusal()
    if refusal is not None:
        doc |= {"error": str(refusal), "exit": refusal.exit_code, "kind": refusal.kind}
    if not as_json:
        for line in result.warnings:
            warn(line)
    if as_json or refusal is None:
        Output(as_json).emit(doc, result.verdict())
    if refusal is not None:
        raise refusal


@store.command()
@click.argument("urls", nargs=-1, required=True, metavar="URL [URL...]")
@click.option("--writers", type=click.IntRange(2, 64), default=4, show_default=True,
              help="Writer processes racing each round.")
@click.option("--rounds", type=click.IntRange(1, 10_000), default=50, show_default=True,
              help="Rounds of races.")
@click.option("--payload", type=click.IntRange(1, 64 << 20), default=64 << 10,
              show_default=True, help="Bytes each writer puts in a replace race.")
@click.option("--s3-endpoint", envvar="AWS_ENDPOINT_URL", metavar="URL",
              help="S3 endpoint(s) for s3:// stores, comma separated [env: AWS_ENDPOINT_URL].")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def check(urls: tuple[str, ...], writers: int, rounds: int, payload: int,
          s3_endpoint: str | None, as_json: bool) -> None:
    """Race writers against the store at URL and say whether it is safe to share.

    Each round, every writer creates one new key with put_if_absent (exactly one
    may win, and all must read the winner's bytes) and puts its own bytes to
    another (every read must be one writer's bytes whole). Give several URLs
    (e.g. two mounts of one shared file system) to spread the writers over them.
    The quick checks of `store init` run first. Exit 0 if safe, 13 if not.
    """
    for url in urls:
        check_store_url(url)
    plan = CheckPlan(urls, writers, rounds, payload, s3_endpoint)
    first = open_store(urls[0], s3_endpoint=s3_endpoint)
    try:
        usable = quick_check(first)  # a missing bucket or bad credentials: one line first
        if not usable.usable:
            _report(usable, as_json)
        result = run_check(plan, first)
    finally:
        first.close()
    doc = {"safe": result.safe, "urls": list(urls), "writers": writers, "rounds": rounds,
           "double_wins": result.double_wins, "no_wins": result.no_wins,
           "wrong_reads": result.wrong_reads, "torn_reads": result.torn_reads,
           "errors": result.errors}
    refusal = None if result.safe else StoreNotSafe(result.verdict())
    if refusal is not None:  # the verdict's document is the JSON error too
        doc |= {"error": str(refusal), "exit": refusal.exit_code, "kind": refusal.kind}
    if as_json or refusal is None:
        Output(as_json).emit(doc, result.verdict())
    if refusal is not None:
        raise refusal
