"""Image commands: import (an OCI or Docker image into layers and an env)."""

from __future__ import annotations

import sys
import time

import click

from layerfs.builder.oci.importer import ImportOptions, ImportProgress, ImportResult, import_image
from layerfs.builder.oci.resolve import parse_platform
from layerfs.builder.oci.sources import open_source
from layerfs.refstore import RefStore

from .common import (
    Output,
    human_bytes,
    parse_size,
    stderr_is_tty,
    write_store_options,
)


class ImportBar:
    """``import N@V: 2/5 layers [########    ] 12.3 MiB, 4.5 MiB/s`` on a terminal
    (layers done, blob bytes read, their rate)."""

    WIDTH = 20

    def __init__(self, label: str, enabled: bool) -> None:
        self.label, self.enabled = label, enabled
        self.done = self.total = 0
        self.bytes = 0
        self.start = time.monotonic()
        self.drawn = 0.0

    def on_layer(self, done: int, total: int) -> None:
        self.done, self.total = done, total
        self.draw(force=True)

    def on_bytes(self, n: int) -> None:
        self.bytes += n
        self.draw()

    def draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self.drawn < 0.1):
            return
        self.drawn = now
        filled = self.WIDTH * self.done // max(self.total, 1)
        rate = self.bytes / max(now - self.start, 1e-6)
        sys.stderr.write(f"\r\033[K{self.label}: {self.done}/{self.total} layers "
                         f"[{'#' * filled}{' ' * (self.WIDTH - filled)}] "
                         f"{human_bytes(self.bytes)}, {human_bytes(rate)}/s")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            self.draw(force=True)
            sys.stderr.write("\n")
            sys.stderr.flush()


@click.command("import")
@click.argument("src")
@click.option("--name", required=True, help="Env name, lowercase [a-z0-9][a-z0-9._/-]*.")
@click.option("--version", "version", required=True, help="Env version, [A-Za-z0-9._-]+.")
@click.option("--plain-http", is_flag=True, help="Talk HTTP, not HTTPS, to a docker:// registry.")
@click.option("--platform", "platform", metavar="OS/ARCH[/VARIANT]",
              help="Which image of a multi-platform index [default: this host's].")
@click.option("--fold", "fold", metavar="SIZE", default=None,
              help="Fold consecutive image layers into layers of up to SIZE (e.g. 3G).")
@click.option("--chunk-size", default="1M", show_default=True,
              help="Chunk size, a power of two from 4K to 16M.")
@write_store_options
def import_cmd(out: Output, refstore: RefStore, src: str, name: str, version: str, plain_http: bool,
               platform: str | None, fold: str | None, chunk_size: str) -> None:
    """Import the image SRC as the env NAME@VERSION: each image layer becomes
    the layer oci/sha256/<diff_id> (built once, shared by every image), the
    image config goes with the env. SRC is docker://HOST[:PORT]/REPO:TAG (or
    @sha256:...), oci:DIR[:TAG], oci-archive:FILE[:TAG] or
    docker-archive:FILE[:NAME:TAG]. --timeout bounds a registry too: each
    request, document and 256 KiB of a blob must come within it."""
    opts = ImportOptions(name, version, parse_platform(platform) if platform else None,
                         parse_size(fold) if fold else 0, parse_size(chunk_size))
    opts.check()
    bar = ImportBar(f"import {name}@{version}", enabled=stderr_is_tty() and not out.as_json)
    source = open_source(src, plain_http=plain_http, timeout=refstore.store.timeout)
    try:
        result = import_image(refstore, source, opts, ImportProgress(bar.on_layer, bar.on_bytes))
    finally:
        bar.close()
        source.close()
    out.emit(_doc(result), lambda: _text(result))


def _doc(r: ImportResult) -> dict:
    return {"env": r.env.ref, "digest": r.env.digest, "published": r.env.published,
            "image": {"manifest_digest": r.image.manifest_digest,
                      "config_digest": r.image.config_digest},
            "layers": [{"ref": x.ref, "digest": x.digest, "diff_ids": x.diff_ids,
                        "built": x.built, "uploaded_bytes": x.uploaded_bytes}
                       for x in r.layers],
            "chains": r.chains}


def _text(r: ImportResult) -> str:
    built = sum(x.built for x in r.layers)
    uploaded = sum(x.uploaded_bytes for x in r.layers)
    lines = [f"{r.env.ref} {r.env.digest}",
             f"  image {r.image.manifest_digest}: {len(r.image.layers)} image layers in "
             f"{len(r.layers)} layers ({built} built, {len(r.layers) - built} reused), "
             f"uploaded {human_bytes(uploaded)}"]
    for x in r.layers:
        lines.append(f"  {x.ref:60} {'built' if x.built else 'reused'}")
    return "\n".join(lines)
