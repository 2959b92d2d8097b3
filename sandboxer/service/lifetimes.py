"""Sandbox lifetimes: the service tears down every sandbox whose `create --ttl` has run out, and
says so in the audit log (verb `expire`, the service's own uid and pid). Without a running
service nothing expires; the sandbox waits for the next service (or a teardown)."""

from __future__ import annotations

import os
import time

from sandboxer.dirs import Dirs
from sandboxer.errors import SandboxerError
from sandboxer.service.audit import AuditLog

REAP_EVERY = 1.0  # seconds between two looks at the registry


def expired(dirs: Dirs, now: float) -> list[str]:
    """The ready sandboxes whose lifetime ended by `now`."""
    from sandboxer.host.registry import Registry

    registry = Registry(dirs.state)
    found = []
    for sandbox_id in registry.ids():
        record = registry.read_or_none(sandbox_id)
        ends = record.expires_at if record is not None and record.state == "ready" else None
        if ends is not None and ends <= now:
            found.append(sandbox_id)
    return found


def reap(dirs: Dirs, audit: AuditLog) -> list[str]:
    """Tear down what expired; the ids torn down (with or without residue, each audited)."""
    from sandboxer.commands.teardown import teardown

    done = []
    for sandbox_id in expired(dirs, time.time()):
        try:
            receipt = teardown(dirs, sandbox_id)
            outcome, status = ("ResidueError", 6) if receipt["residue"] else ("ok", 0)
        except SandboxerError as exc:
            outcome, status = type(exc).__name__, exc.status
        audit.record(
            uid=os.geteuid(), pid=os.getpid(), verb="expire", sandbox=sandbox_id, outcome=outcome, status=status
        )
        done.append(sandbox_id)
    return done
