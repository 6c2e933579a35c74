"""A sandbox suspended into the store, and resumed from it on any node.

``suspend ID --name N --version V``: the sandbox's ``layerfs run``
containers are frozen with the cgroup freezer (:mod:`..containers.freezer`)
so that nothing writes while its upper directory is committed as layer
``N@V`` (the commit ``layerfs commit`` makes: it reads the upper through the
page cache, so what the processes wrote is in it, fsynced or not); env
``N@V`` is then published, that layer over the sandbox's layers with its
image config, and the sandbox is ended (its containers killed, the sandbox
taken down). ``resume N@V --id ID`` is an ``up`` of that env, on any node
of the store. The processes themselves are not carried over (no process
checkpoint): a resumed sandbox has the files, and runs new processes.

Before anything is frozen, the refs are checked: a layer or env ``N@V``
that exists is :class:`~layerfs.errors.SnapshotExists` (exit 4) and the
sandbox goes on untouched; so does an unknown id (``SandboxNotFound``).
If the commit fails the containers are thawed and the sandbox stays up.
"""

from __future__ import annotations

from ...builder.env import publish_env
from ...errors import SnapshotExists
from ...manifest import EnvLayer
from ...names import check_name, check_version
from ...refstore import ENVS, LAYERS, RefStore
from ..containers.bundle import image_config_from
from ..protocol import SandboxRecord


def check_free(refstore: RefStore, name: str, version: str) -> None:
    """Worker thread: :class:`SnapshotExists` unless neither layer nor env
    ``name@version`` exists (a bad name or version: its usage error)."""
    check_name(name)
    check_version(version)
    for kind in (LAYERS, ENVS):
        if refstore.read_ref(kind, name, version) is not None:
            raise SnapshotExists(f"{kind[:-1]} {name}@{version}")


def snapshot_layers(record: SandboxRecord, top: str, top_ref: str) -> list[EnvLayer]:
    """The suspended sandbox's env layers: its committed upper ``top`` over
    its own layers (by digest), top first."""
    return [EnvLayer(top_ref, top), *(EnvLayer(d, d) for d in record.layers)]


def publish_snapshot(refstore: RefStore, name: str, version: str, record: SandboxRecord,
                     top: str) -> str:
    """Worker thread: env ``name@version`` of the committed upper ``top``
    over the sandbox's layers, with its image config; the env's digest."""
    config = image_config_from(record.config)
    layers = snapshot_layers(record, top, f"{name}@{version}")
    return publish_env(refstore, name, version, layers, config).digest
