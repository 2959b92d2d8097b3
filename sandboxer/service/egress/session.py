"""One client connection's account (what it asked for, its bytes, how it ended) and the
sandbox-wide byte allowance it spends from.

Both live on the proxy's event loop only, so they take no lock: the loop runs one callback at a
time. The access report gets a `Session`'s line once, when the connection ends.
"""

from __future__ import annotations

import asyncio
from typing import Literal

from sandboxer.service.egress.heads import LimitReached
from sandboxer.service.egress.report import Access

MIB = 1024 * 1024


class Allowance:
    """The bytes one sandbox's proxy has moved, both ways, against its `limits.mib`."""

    def __init__(self) -> None:
        self.used = 0

    def spent(self, limit_mib: int) -> bool:
        """Whether nothing is left."""
        return self.used >= limit_mib * MIB

    def spend(self, count: int, limit_mib: int) -> None:
        """Count `count` bytes; `LimitReached` once the total passes the limit."""
        self.used += count
        if self.spent(limit_mib) and count:
            raise LimitReached("byte limit")


class Session:
    """A client connection: the target it asked for, the bytes each way, and its outcome."""

    def __init__(self, allowance: Allowance, limit_mib: int, task: asyncio.Task[None] | None) -> None:
        self.allowance = allowance
        self.limit_mib = limit_mib
        self.task = task
        self.host = ""
        self.port = 0
        self.route: str | None = None
        self.sent = 0
        self.received = 0
        self.decision: Literal["allowed", "refused"] = "refused"
        self.reason = "no request"
        self.answered = False  # the client has a status line: an error can no longer be answered
        self.closing: str | None = None  # why the proxy closes it from outside (revocation, shutdown)

    def count_sent(self, count: int) -> None:
        """Bytes read from the client."""
        self.sent += count
        self.allowance.spend(count, self.limit_mib)

    def count_received(self, count: int) -> None:
        """Bytes read from the upstream."""
        self.received += count
        self.allowance.spend(count, self.limit_mib)

    def allow(self, reason: str) -> None:
        """The connection goes ahead."""
        self.decision, self.reason = "allowed", reason

    def refuse(self, reason: str) -> None:
        """The connection (or a request on it) is refused. A connection that already carried an
        upstream's bytes stays allowed, closed by the refusal: its line stays with the allowed
        ones, where a flood of refusals cannot rotate it away."""
        if self.decision == "allowed" and self.received:
            self.reason = f"closed: refused ({reason})"
        else:
            self.decision, self.reason = "refused", reason

    def end(self, reason: str) -> None:
        """An allowed connection was cut short (a limit, a revocation, the upstream)."""
        self.reason = reason if self.decision == "refused" else f"closed: {reason}"

    def access(self) -> Access:
        """Its line in the access report."""
        return Access(
            host=self.host,
            port=self.port,
            decision=self.decision,
            reason=self.reason,
            route=self.route,
            sent=self.sent,
            received=self.received,
        )
