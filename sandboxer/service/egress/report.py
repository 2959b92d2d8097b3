"""The access report of one sandbox's proxy: one JSON line per connection, in two files.

A line is written when a connection ends (a refusal ends it at once): the time, the host and
port asked for, the decision and its reason, the credential route used, and the bytes each way.
Never a header value, a body, a URL path or a secret: the sandbox chooses those, and a secret
must not reach a file the report's readers see.

Allowed connections go to `network.jsonl`, refusals to `network-refused.jsonl`: a sandbox that
floods the proxy with refused connections rotates only its refusals away, never the record of
where it did connect. Refusals repeating one another (the same host, port and reason within
REPEAT_SECONDS) are written once and then counted: the line for the first is written at once,
one more line with `count` says how many followed when the window ends (`flush_due`, which the
proxy calls) or the log is closed. Each file is the owner's (0600), opened without following a
link planted at its path, and bounded: past `max_bytes` it is renamed to `.1` (one generation
kept), so the disk a sandbox can fill with its report is at most four times that.
"""

from __future__ import annotations

import datetime
import json
import os
import stat
import threading
import time
from dataclasses import dataclass, replace
from typing import Literal

MAX_BYTES = 1024 * 1024
REPEAT_SECONDS = 1.0
MAX_REPEATING = 64  # distinct refusals counted at once; past it the oldest count is written


@dataclass(frozen=True, slots=True, kw_only=True)
class Access:
    """One connection's line in the report (`count` > 1: that many identical refusals)."""

    host: str
    port: int
    decision: Literal["allowed", "refused"]
    reason: str
    route: str | None = None
    sent: int = 0
    received: int = 0
    count: int = 1

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
            "count": self.count,
        }
        return json.dumps(document, separators=(",", ":"))


@dataclass(slots=True)
class _Repeats:
    """Refusals like one just written, counted since (written when the window ends)."""

    first: Access
    until: float
    count: int = 0
    sent: int = 0
    received: int = 0


class AccessLog:
    """Appends `Access` lines to `allowed_path` or `refused_path`, each rotated by size, merging
    repeated refusals. A lock keeps lines whole: the proxy writes from its loop while a flush may
    come from another thread."""

    def __init__(self, allowed_path: str, refused_path: str, *, max_bytes: int = MAX_BYTES) -> None:
        self.allowed_path = allowed_path
        self.refused_path = refused_path
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._repeats: dict[tuple[str, int, str, str | None], _Repeats] = {}

    def write(self, access: Access) -> None:
        """Record one ended connection (a refusal like a recent one only counted)."""
        now = time.monotonic()
        with self._lock:
            if access.decision == "allowed":
                self._append(self.allowed_path, access)
                return
            key = (access.host, access.port, access.reason, access.route)
            repeats = self._repeats.get(key)
            if repeats is not None and now < repeats.until:
                repeats.count += 1
                repeats.sent += access.sent
                repeats.received += access.received
                return
            self._write_repeats(now, force=False)  # this key's too, when its window has ended
            if len(self._repeats) >= MAX_REPEATING:
                self._write_one(next(iter(self._repeats)))
            self._append(self.refused_path, access)
            self._repeats[key] = _Repeats(first=access, until=now + REPEAT_SECONDS)

    def flush_due(self) -> bool:
        """Write the counts whose window has ended; whether any are still being counted."""
        with self._lock:
            self._write_repeats(time.monotonic(), force=False)
            return bool(self._repeats)

    def close(self) -> None:
        """Write every count still open."""
        with self._lock:
            self._write_repeats(time.monotonic(), force=True)

    def _write_repeats(self, now: float, *, force: bool) -> None:
        for key in [key for key, repeats in self._repeats.items() if force or now >= repeats.until]:
            self._write_one(key)

    def _write_one(self, key: tuple[str, int, str, str | None]) -> None:
        repeats = self._repeats.pop(key)
        if repeats.count:
            merged = replace(repeats.first, count=repeats.count, sent=repeats.sent, received=repeats.received)
            self._append(self.refused_path, merged)

    def _append(self, path: str, access: Access) -> None:
        line = (access.to_json(datetime.datetime.now(datetime.UTC)) + "\n").encode()
        fd = _open(path)
        try:
            if os.fstat(fd).st_size + len(line) > self.max_bytes:
                os.close(fd)
                fd = -1
                os.replace(path, path + ".1")
                fd = _open(path)
            os.write(fd, line)
        finally:
            if fd >= 0:
                os.close(fd)


def _open(path: str) -> int:
    # O_NONBLOCK: a FIFO planted at the path fails with ENXIO instead of hanging the proxy.
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    fd = os.open(path, flags, 0o600)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise OSError(f"{path}: not a regular file")
    if stat.S_IMODE(info.st_mode) != 0o600:
        os.fchmod(fd, 0o600)
    return fd
