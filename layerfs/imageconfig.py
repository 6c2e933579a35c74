"""What an OCI image's config says about running it: the record an env
manifest carries (:mod:`layerfs.manifest`) and a runtime bundle is made from
(:mod:`layerfs.node.containers.bundle`). A module of its own (on :mod:`layerfs.records`
only), so that ``layerfs run`` reads it without loading the manifest classes."""

from __future__ import annotations

from .records import Record, field


class ImageConfig(Record):
    """The ``config`` object of the OCI image config, names in snake case.
    ``entrypoint`` and ``cmd`` are None where the image sets none, so a runtime
    can tell an empty list from a missing one."""

    env: list[str] = field(default_factory=list)  # KEY=value
    entrypoint: list[str] | None = None
    cmd: list[str] | None = None
    working_dir: str = ""
    user: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    exposed_ports: list[str] = field(default_factory=list)  # "80/tcp"
    stop_signal: str = ""
    os: str = "linux"
    architecture: str = ""

    def to_json(self) -> dict[str, object]:
        return dict(vars(self))
