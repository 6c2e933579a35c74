"""Which store reads fail at once after a failure, and until when.

A read that failed makes the next ones of the same kind fail fast, so that the
kernel's page-by-page retries of a failed read(2) never wait a timeout each.
Two scopes:

* one **pack** (an object) whose read failed, whether the store answered an
  error (a 500 from a lost volume, a cut body) or did not answer in time:
  reads of that pack fail fast for a backoff that doubles with each further
  failure (``OBJECT_BACKOFF`` up to ``OBJECT_BACKOFF_MAX``) and is forgotten
  after a success; reads of every other pack go on;
* the **whole store**, only on evidence that it stopped answering, never on
  one slow request: a read that got no answer (a timeout, a refused
  connection) while no other request was answered since it began makes the
  store *suspect*, and a health request (the fetcher's probe, one at a time)
  decides. If the probe gets no answer either, every uncached read fails
  fast for ``STORE_COOLDOWN``; any answer (a 404 or a 500 included) clears
  the suspicion. Any answer to any read counts as the store answering.

Times are the caller's clock (``trio.current_time()``); no I/O, no awaits.
The state diagram and who holds what: docs/dev/node.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

STORE_COOLDOWN = 2.0  # seconds every uncached read fails fast after the store did not answer
OBJECT_BACKOFF = 1.0  # seconds one pack's reads fail fast after its first failure
OBJECT_BACKOFF_MAX = 8.0  # a pack that keeps failing is tried again at least this often


@dataclass
class PackBackoff:
    """The failures in a row of one pack and when it may be tried again."""

    failures: int
    until: float
    reason: str


@dataclass
class FailFast:
    """The fail-fast windows of one fetcher (the store's and each pack's) and
    the evidence about the store: when it last answered, whether a probe runs."""

    store_down_until: float = 0.0
    store_reason: str = ""
    packs: dict[str, PackBackoff] = field(default_factory=dict)
    last_answer: float = -math.inf  # when the store last answered any request
    probing: bool = False  # a health probe is in flight

    def refusal(self, pack: str, now: float) -> str | None:
        """Why a read of ``pack`` must fail at once now, or None to try it."""
        if now < self.store_down_until:
            return f"store unavailable (failed just now: {self.store_reason})"
        backoff = self.packs.get(pack)
        if backoff is not None and now < backoff.until:
            return (f"unavailable (failed {backoff.failures} time(s) in a row, next try in"
                    f" {backoff.until - now:.1f}s): {backoff.reason}")
        return None

    def answered(self, now: float) -> None:
        """The store answered a request (data, or an error reply)."""
        self.last_answer = max(self.last_answer, now)

    def no_answer(self, pack: str, started: float, now: float, reason: str) -> bool:
        """A read of ``pack`` begun at ``started`` got no answer: back off that
        pack. True if the store is now suspect and the caller must start the
        probe: nothing answered since ``started`` and no probe runs yet."""
        self.pack_failed(pack, now, reason)
        if self.probing or self.last_answer >= started:
            return False
        self.probing = True
        return True

    def probe_answered(self, now: float) -> None:
        """The probe got an answer: the store answers; the suspicion ends."""
        self.probing = False
        self.answered(now)

    def probe_failed(self, now: float, reason: str) -> None:
        """The probe got no answer either: the store is down for a moment."""
        self.probing = False
        self.store_failed(now, reason)

    def store_failed(self, now: float, reason: str) -> None:
        """The store did not answer: fail every uncached read for a moment."""
        self.store_down_until = now + STORE_COOLDOWN
        self.store_reason = reason

    def pack_failed(self, pack: str, now: float, reason: str) -> None:
        """A read of ``pack`` failed: back off that pack alone."""
        previous = self.packs.get(pack)
        failures = previous.failures + 1 if previous is not None else 1
        delay = min(OBJECT_BACKOFF_MAX, OBJECT_BACKOFF * 2 ** (failures - 1))
        self.packs[pack] = PackBackoff(failures, now + delay, reason)

    def pack_served(self, pack: str) -> None:
        """A read of ``pack`` worked: forget its failures."""
        self.packs.pop(pack, None)
