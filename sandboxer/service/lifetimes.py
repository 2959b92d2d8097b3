"""Sandbox lifetimes: the service tears down every sandbox whose `create --ttl` has run out
(audit verb `expire`) or that went unused for its profile's `lifetime.idle_seconds` — no exec
running, none started or ended for that long (verb `idle`) — and says so in the audit log, as
the service's own uid and pid. Without a running service nothing expires; the sandbox waits for
the next service (or a teardown)."""

from __future__ import annotations

import os
import time

from sandboxer.dirs import Dirs
from sandboxer.errors import SandboxerError
from sandboxer.service.audit import AuditLog

REAP_EVERY = 1.0  # seconds between two looks at the registry


def expired(dirs: Dirs, now: float) -> list[tuple[str, str]]:
    """The ready sandboxes whose lifetime ended by `now`, each with why (`expire` or `idle`)."""
    from sandboxer.host import activity
    from sandboxer.host.registry import Registry

    registry = Registry(dirs.state)
    found = []
    for sandbox_id in registry.ids():
        record = registry.read_or_none(sandbox_id)
        if record is None or record.state != "ready":
            continue
        if record.expires_at is not None and record.expires_at <= now:
            found.append((sandbox_id, "expire"))
        elif record.idle_seconds is not None:
            unused = activity.idle_seconds(registry.path(sandbox_id), now)
            if unused is not None and unused >= record.idle_seconds:
                found.append((sandbox_id, "idle"))
    return found


def reap(dirs: Dirs, audit: AuditLog) -> list[str]:
    """Tear down what expired; the ids torn down (with or without residue, each audited)."""
    from sandboxer.commands.teardown import teardown

    done = []
    for sandbox_id, why in expired(dirs, time.time()):
        try:
            receipt = teardown(dirs, sandbox_id)
            outcome, status = ("ResidueError", 6) if receipt["residue"] else ("ok", 0)
        except SandboxerError as exc:
            outcome, status = type(exc).__name__, exc.status
        audit.record(uid=os.geteuid(), pid=os.getpid(), verb=why, sandbox=sandbox_id, outcome=outcome, status=status)
        done.append(sandbox_id)
    return done
