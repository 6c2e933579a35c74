"""Opening the object store named by a URL.

``open_store(url)`` picks the backend from the URL scheme: ``file:///path``
(or a bare path) → :class:`~layerfs.store.file.FileStore`, ``s3://bucket/prefix``
→ :class:`~layerfs.store.s3.S3Store`. With no URL, ``$LAYERFS_STORE`` is used,
else a per-machine (root) or per-user default directory.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

from ..errors import UsageError
from .base import ObjectInfo, RetryPolicy, Store, blob_key, sha256_digest

__all__ = [
    "ObjectInfo",
    "RetryPolicy",
    "Store",
    "blob_key",
    "default_store_url",
    "open_store",
    "sha256_digest",
]

ROOT_STORE = "/var/lib/layerfs/store"
USER_STORE = ".local/share/layerfs/store"  # under $HOME


def default_store_url() -> str:
    """``$LAYERFS_STORE``, else the root or per-user store directory."""
    env = os.environ.get("LAYERFS_STORE")
    if env:
        return env
    if os.geteuid() == 0:
        return "file://" + ROOT_STORE
    return "file://" + str(Path.home() / USER_STORE)


def open_store(url: str | None = None, s3_endpoint: str | None = None,
               timeout: float | None = None, must_exist: bool = False) -> Store:
    """The store named by ``url`` (default: :func:`default_store_url`).

    ``s3_endpoint`` applies to ``s3://`` URLs only (default ``$AWS_ENDPOINT_URL``);
    a comma-separated list names several gateways to fail over between.
    ``timeout``: seconds without progress before calls give up (``Store.set_timeout``).
    ``must_exist``: a file store whose directory is missing is unreachable (a reader's
    view), not a new store that its first write creates (a writer's).
    """
    store = _open(url, s3_endpoint, must_exist)
    if timeout is not None:
        store.set_timeout(timeout)
    return store


def _open(url: str | None, s3_endpoint: str | None, must_exist: bool) -> Store:
    url = url or default_store_url()
    scheme = urlsplit(url).scheme
    if scheme == "":
        from .file import FileStore

        return FileStore(Path(url).expanduser(), must_exist=must_exist)
    if scheme == "file":
        from .file import FileStore

        return FileStore.from_url(url, must_exist=must_exist)
    if scheme == "s3":
        from .s3failover import open_s3

        return open_s3(url, s3_endpoint)
    raise UsageError(
        f"unknown store URL scheme {scheme!r} in {url!r}: use file:///path or s3://bucket/prefix"
    )
