"""The access report of one sandbox's proxy: `network.jsonl`, one JSON line per connection.

A line is written when a connection ends (a refusal ends it at once): the time, the host and
port asked for, the decision and its reason, the credential route used, and the bytes each way.
Never a header value, a body, a URL path or a secret: the sandbox chooses those, and a secret
must not reach a file the report's readers see. The file is the owner's (0600), opened without
following a link planted at its path, and bounded: past `max_bytes` it is renamed to `.1` (one
generation kept), so a sandbox that hammers the proxy costs the disk at most twice that.
"""

from __future__ import annotations

import datetime
import json
import os
import stat
import threading
from dataclasses import dataclass
from typing import Literal

MAX_BYTES = 1024 * 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class Access:
    """One connection's line in the report."""

    host: str
    port: int
    decision: Literal["allowed", "refused"]
    reason: str
    route: str | None = None
    sent: int = 0
    received: int = 0

    def to_json(self, when: datetime.datetime) -> str:
        """The line, with `when` as RFC 3339 UTC."""
        stamp = when.astimezone(datetime.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        document = {
            "time": stamp,
            "host": self.host,
            "port": self.port,
            "decision": self.decision,
            "reason": self.reason,
            "route": self.route,
            "sent": self.sent,
            "received": self.received,
        }
        return json.dumps(document, separators=(",", ":"))


@dataclass(frozen=True, slots=True, kw_only=True)
class Counters:
    """What `inspect` shows of a sandbox's egress: connections allowed and refused, bytes both ways."""

    allowed: int
    refused: int
    bytes: int


class AccessLog:
    """Appends `Access` lines to `path`, rotating it by size; counts them. A lock keeps lines and
    counters whole: the proxy writes from its loop while `inspect` reads from another thread."""

    def __init__(self, path: str, *, max_bytes: int = MAX_BYTES) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._allowed = 0
        self._refused = 0
        self._bytes = 0

    def write(self, access: Access) -> None:
        """Append the line for one ended connection."""
        line = (access.to_json(datetime.datetime.now(datetime.UTC)) + "\n").encode()
        with self._lock:
            if access.decision == "allowed":
                self._allowed += 1
            else:
                self._refused += 1
            self._bytes += access.sent + access.received
            self._append(line)

    def counters(self) -> Counters:
        """The counts since this log was made."""
        with self._lock:
            return Counters(allowed=self._allowed, refused=self._refused, bytes=self._bytes)

    def _append(self, line: bytes) -> None:
        fd = self._open()
        try:
            if os.fstat(fd).st_size + len(line) > self.max_bytes:
                os.close(fd)
                fd = -1
                os.replace(self.path, self.path + ".1")
                fd = self._open()
            os.write(fd, line)
        finally:
            if fd >= 0:
                os.close(fd)

    def _open(self) -> int:
        # O_NONBLOCK: a FIFO planted at the path fails with ENXIO instead of hanging the proxy.
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        fd = os.open(self.path, flags, 0o600)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise OSError(f"{self.path}: not a regular file")
        if stat.S_IMODE(info.st_mode) != 0o600:
            os.fchmod(fd, 0o600)
        return fd
