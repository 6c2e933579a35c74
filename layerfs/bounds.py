"""The bounds of what a manifest (or a control message) may hold: one table, for
writers and readers alike, applied by the one typed parse (:mod:`layerfs.schema`).

A writer (``import``, ``build``, ``commit``, ``env create``, ``disk commit``)
runs the same typed parse every reader runs (:mod:`layerfs.manifest`) on the
bytes it is about to publish, so whatever the store holds, ``ls``, ``env ls``,
``gc`` and ``up`` read back. A field over a bound is refused by the writer as
:class:`~layerfs.errors.OverLimit` (an input error: one line naming the field
and the limit, nothing published) and by a reader as an
:class:`~layerfs.errors.IntegrityError` (what the store holds is corrupt).

The limits are what a real image needs and then some: an image's Env, Cmd,
Entrypoint and Labels strings may be long (certificates, JSON in a label, a
long ``PATH``); the whole image config is bounded so that an env manifest stays
small enough to read on every ``up``.
"""

from __future__ import annotations

MAX_STRING = 64 << 10  # characters of any one string of a manifest (an env value, a label)
MAX_ITEMS = 1 << 16  # items of one list or object (layers of an env, labels, env values)
MAX_CONFIG = 1 << 20  # bytes of an env's image config, as canonical JSON
MAX_ERROR_LINE = 1024  # characters of an error or warning line the CLI prints


def cut(text: str, limit: int) -> str:
    """``text``, or its start and a marker saying how much was left out."""
    if len(text) <= limit:
        return text
    left_out = len(text) - limit
    while True:  # (the marker's own length decides how much it leaves out)
        marker = f"... [{left_out} more characters]"
        keep = max(limit - len(marker), 0)
        if len(text) - keep == left_out:
            return text[:keep] + marker
        left_out = len(text) - keep


def summary(items: list[str], shown: int = 5) -> str:
    """The first ``shown`` of ``items`` and how many more (a bounded list for a message)."""
    head = ", ".join(items[:shown])
    rest = len(items) - shown
    return f"{head} and {rest} more" if rest > 0 else head
