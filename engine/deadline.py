"""One deadline per round: every wait of a round counts down to the same instant.

A user who sets ``timeout_s`` expects a stalled peer to be reported within
that bound, whatever the load of the machine and however many waits a round
makes (rendezvous, agreement, each bucket's send and receive, the
end-of-round verdict, the control-plane calls). Per-wait timeouts add up: a
data wait, then the verdict's wait, then an RPC's. A deadline does not: it
is fixed once, when the round (or the init) starts, and every wait gets only
the time left to it.

After the deadline a rank still has to tell the others what went wrong and
hear their reports, so each rank may take a fixed :data:`REPORT_GRACE_S` on
top. The bound every rank keeps is therefore

    a failed round raises on every live rank within ``timeout_s + REPORT_GRACE_S``
    seconds of that rank's own round start,

and a dead peer (its connections close) is reported within
``REPORT_GRACE_S`` of the death. The one thing no deadline can interrupt is
the caller's own code (a source provider that never returns): that rank
reports when it regains control; every other rank keeps the bound.

This module knows no transport and imports nothing heavy; it only measures
time (``time.monotonic``, immune to wall-clock changes).
"""

from __future__ import annotations

import time

__all__ = ["REPORT_GRACE_S", "Deadline"]

#: Seconds a rank may spend after its deadline to report its outcome and
#: collect the others' (the end-of-round verdict). Fixed, not a multiple of
#: ``timeout_s``: reporting costs a few store round trips, not a transfer.
REPORT_GRACE_S = 2.0


class Deadline:
    """A fixed instant (``time.monotonic``) that every wait of one round counts down to.

    Args:
        seconds: the budget from now, seconds (> 0).

    Attributes:
        seconds: the budget it was created with.
        start: when it was created (``time.monotonic``).
        at: ``start + seconds``.

    Raises:
        ValueError: ``seconds`` is not a positive number.
    """

    __slots__ = ("seconds", "start", "at")

    def __init__(self, seconds: float) -> None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
            raise ValueError(f"a deadline needs a positive number of seconds, got {seconds!r}")
        self.seconds = float(seconds)
        self.start = time.monotonic()
        self.at = self.start + self.seconds

    @classmethod
    def of(cls, deadline: "Deadline | None" = None, timeout_s: float | None = None) -> "Deadline":
        """``deadline`` itself, else a fresh one of ``timeout_s`` seconds from now.

        Functions that take either (``deadline=`` for a wait inside a round,
        ``timeout_s=`` for a standalone call) use this.

        Raises:
            ValueError: neither given, or ``timeout_s`` not positive.
        """
        if deadline is not None:
            if not isinstance(deadline, Deadline):
                raise ValueError(f"deadline must be a Deadline, got {type(deadline).__name__}")
            return deadline
        if timeout_s is None:
            raise ValueError("give a deadline or timeout_s")
        return cls(timeout_s)

    def left(self) -> float:
        """Seconds until the deadline, never below 0."""
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        """True once the deadline has passed."""
        return time.monotonic() >= self.at

    def elapsed(self) -> float:
        """Seconds since the deadline was set."""
        return time.monotonic() - self.start

    def describe(self) -> str:
        """``"the deadline (8 s after the start)"``, for messages."""
        return f"the deadline ({self.seconds:g} s after the start)"

    def __repr__(self) -> str:
        return f"Deadline({self.seconds:g} s, {self.at - time.monotonic():+.3f} s left)"
