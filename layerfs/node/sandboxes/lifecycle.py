"""A sandbox's lifecycle: its states and the moves allowed between them.

::

    up ──► STARTING ──mounted, recorded──► UP ──down──► STOPPING ──done──► DOWN
              │                            │  ▲            │  ▲
              └──failed, cancelled: rolled │  │restore     │  │down again
                 back through STOPPING     ▼  │            ▼  │
                                           LOST         DOWN_FAILED

``STARTING`` is recorded before the first mount and ``UP`` once every mount is
in place, so a daemon killed during an ``up`` leaves a record the next start
rolls back. ``STOPPING`` is recorded before a ``down`` changes anything; a step
that fails (a busy mount, an LMDB error) leaves ``DOWN_FAILED`` with the
reason, and a ``down`` again repeats the steps not done (each one is
idempotent). ``LOST``: a restart could not bring the sandbox back.
"""

from __future__ import annotations

from enum import StrEnum

from ..protocol import SandboxRecord


class SandboxState(StrEnum):
    STARTING = "starting"
    UP = "up"
    LOST = "lost"
    STOPPING = "stopping"
    DOWN_FAILED = "down_failed"
    DOWN = "down"


S = SandboxState
MOVES: dict[SandboxState, frozenset[SandboxState]] = {
    S.STARTING: frozenset({S.UP, S.STOPPING}),
    S.UP: frozenset({S.STOPPING, S.LOST}),
    S.LOST: frozenset({S.UP, S.STOPPING}),
    S.STOPPING: frozenset({S.DOWN, S.DOWN_FAILED}),
    S.DOWN_FAILED: frozenset({S.STOPPING}),
    S.DOWN: frozenset(),
}


class IllegalMove(RuntimeError):
    """A move the lifecycle does not allow: a bug, not a user's error."""


def state_of(record: SandboxRecord) -> SandboxState:
    """The record's state (ValueError for a state this version does not know)."""
    return SandboxState(record.state)


def move(record: SandboxRecord, to: SandboxState, error: str | None = None) -> None:
    """Move ``record`` to state ``to`` (its error: ``error``), if the lifecycle allows it."""
    now = state_of(record)
    if to not in MOVES[now]:
        raise IllegalMove(f"sandbox {record.id}: no move from {now} to {to}")
    record.state = to
    record.error = error
