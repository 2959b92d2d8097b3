"""The service's audit log: `<state-dir>/audit.log`, one JSON object per line, owner-only.

Each request the service answers is one line: the time, the caller's uid and pid (as the kernel
reported them), the verb, the sandbox id when there is one, the outcome ("ok" or the error's
class) and the status (the CLI's exit status; an exec's own exit status). Never an argv, an
environment value, a file's content, a message or a credential: what a caller sends stays out.
When the log passes `MAX_BYTES` it is rotated (audit.log.1 … audit.log.KEEP; the oldest goes).
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

MAX_BYTES = 8 * 1024 * 1024
KEEP = 3


class AuditLog:
    """Appends lines to the state dir's audit.log (0600), rotating it by size."""

    def __init__(self, state_dir: str, *, max_bytes: int = MAX_BYTES, keep: int = KEEP) -> None:
        self.path = os.path.join(state_dir, "audit.log")
        self.max_bytes = max_bytes
        self.keep = keep
        self._lock = threading.Lock()

    def record(
        self,
        *,
        uid: int,
        pid: int,
        verb: str,
        sandbox: str | None,
        outcome: str,
        status: int | None,
        kept: str | None = None,
        fetch: str | None = None,
    ) -> None:
        """One line; `kept`: where the reaper kept a sandbox's work it exported before teardown,
        `fetch`: the command its caller takes it out with."""
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "uid": uid,
            "pid": pid,
            "verb": verb,
            "sandbox": sandbox,
            "outcome": outcome,
            "status": status,
        }
        if kept is not None:
            entry["kept"] = kept
        if fetch is not None:
            entry["fetch"] = fetch
        line = json.dumps(entry, sort_keys=True).encode() + b"\n"
        with self._lock:
            self._rotate_if_full()
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
            fd = os.open(self.path, flags, 0o600)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)

    def _rotate_if_full(self) -> None:
        try:
            if os.lstat(self.path).st_size < self.max_bytes:
                return
        except FileNotFoundError:
            return
        for index in range(self.keep - 1, 0, -1):
            older = f"{self.path}.{index}"
            if os.path.lexists(older):
                os.replace(older, f"{self.path}.{index + 1}")
        os.replace(self.path, f"{self.path}.1")
