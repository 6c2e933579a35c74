"""Which store reads fail at once after a failure, and until when.

A read that failed makes the next ones of the same kind fail fast, so that the
kernel's page-by-page retries of a failed read(2) never wait a timeout each.
Two scopes:

* one **pack** (an object) the store answered for but could not serve (a 500
  from a lost volume, a cut body): reads of that pack fail fast for a backoff
  that doubles with each further failure (``OBJECT_BACKOFF`` up to
  ``OBJECT_BACKOFF_MAX``) and is forgotten after a success; reads of every
  other pack go on;
* the **whole store**, when it did not answer at all (connection refused, no
  answer within the fetch timeout): every uncached read fails fast for
  ``STORE_COOLDOWN``.

Times are the caller's clock (``trio.current_time()``); no I/O, no awaits.
"""

from __future__ import annotations

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
    """The fail-fast windows of one fetcher: the store's and each pack's."""

    store_down_until: float = 0.0
    store_reason: str = ""
    packs: dict[str, PackBackoff] = field(default_factory=dict)

    def refusal(self, pack: str, now: float) -> str | None:
        """Why a read of ``pack`` must fail at once now, or None to try it."""
        if now < self.store_down_until:
            return f"store unavailable (failed just now: {self.store_reason})"
        backoff = self.packs.get(pack)
        if backoff is not None and now < backoff.until:
            return (f"unavailable (failed {backoff.failures} time(s) in a row, next try in"
                    f" {backoff.until - now:.1f}s): {backoff.reason}")
        return None

    def store_failed(self, now: float, reason: str) -> None:
        """The store did not answer: fail every uncached read for a moment."""
        self.store_down_until = now + STORE_COOLDOWN
        self.store_reason = reason

    def pack_failed(self, pack: str, now: float, reason: str) -> None:
        """The store answered but could not serve ``pack``: back off that pack alone."""
        previous = self.packs.get(pack)
        failures = previous.failures + 1 if previous is not None else 1
        delay = min(OBJECT_BACKOFF_MAX, OBJECT_BACKOFF * 2 ** (failures - 1))
        self.packs[pack] = PackBackoff(failures, now + delay, reason)

    def pack_served(self, pack: str) -> None:
        """A read of ``pack`` worked: forget its failures."""
        self.packs.pop(pack, None)
