"""Sandbox lifetimes: the service tears down every sandbox whose `create --ttl` has run out
(audit verb `expire`) or that went unused for its profile's `lifetime.idle_seconds` — no exec
running, none started or ended for that long (verb `idle`) — and says so in the audit log, as
the service's own uid and pid. Without a running service nothing expires; the sandbox waits for
the next service (or a teardown).

Work no export took out is not lost with it: the reaper first exports it into
`<state>/exports/<id>/` (a bundle of the new commits, a tar of a changed tree, summary.json),
kept for `serve --keep-exports` seconds, and the audit line names that directory. A sandbox whose
work cannot be exported (its git fails) is left running and audited as such, to be tried again.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from sandboxer.commands.export import EXPORTS, Format, discard_quarantine, prepare
from sandboxer.commands.work import GIT_SECONDS, work_state
from sandboxer.dirs import Dirs
from sandboxer.errors import SandboxerError
from sandboxer.host.fstree import remove_tree
from sandboxer.host.registry import Registry, check_id
from sandboxer.service.audit import AuditLog

REAP_EVERY = 1.0  # seconds between two looks at the registry
KEEP_EXPORTS = 7 * 24 * 3600  # seconds the reaper's exports are kept (serve --keep-exports)
RETRY_EXPORT = 300  # seconds before the reaper tries again to export a sandbox it could not


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


class Reaper:
    """The service's reaper: `reap()` once a REAP_EVERY."""

    def __init__(self, dirs: Dirs, audit: AuditLog, *, keep_exports: float = KEEP_EXPORTS) -> None:
        self.dirs = dirs
        self.audit = audit
        self.keep_exports = keep_exports
        self.failed: dict[str, float] = {}  # sandbox id: when its export last failed

    def reap(self) -> list[str]:
        """Tear down what expired, its work exported first; the ids torn down (with or without
        residue, each audited). Kept exports whose time is up go too."""
        from sandboxer.commands.teardown import teardown

        now = time.time()
        prune_kept(self.dirs, now)
        done = []
        for sandbox_id, why in expired(self.dirs, now):
            if now - self.failed.get(sandbox_id, -RETRY_EXPORT) < RETRY_EXPORT:
                continue
            kept = None
            try:
                kept = keep_for_reaper(self.dirs, sandbox_id, self.keep_exports)
                receipt = teardown(self.dirs, sandbox_id)
                outcome, status = ("ResidueError", 6) if receipt["residue"] else ("ok", 0)
                self.failed.pop(sandbox_id, None)
            except SandboxerError as exc:
                outcome, status = type(exc).__name__, exc.status
                self.failed[sandbox_id] = now
            self.audit.record(
                uid=os.geteuid(),
                pid=os.getpid(),
                verb=why,
                sandbox=sandbox_id,
                outcome=outcome,
                status=status,
                kept=kept,
            )
            done.append(sandbox_id)
        return done


def keep_for_reaper(dirs: Dirs, sandbox_id: str, keep_seconds: float) -> str | None:
    """Before the service tears an expired sandbox down: take out whatever work it holds into
    `<state>/exports/<id>/` (a bundle of its new commits, a tar of a changed tree, and
    summary.json with when it may go); that directory, or None when there was nothing to keep."""
    registry = Registry(dirs.state)
    record = registry.read_or_none(check_id(sandbox_id))
    if record is None or record.work is None or record.state != "ready":
        return None
    state, work = work_state(dirs, sandbox_id)
    lost = state.unexported(work)
    if not lost:
        return None
    kept = os.path.join(dirs.state, EXPORTS, sandbox_id)
    remove_tree(kept)
    os.makedirs(kept, mode=0o700)
    summary: dict[str, Any] = {"id": sandbox_id, "kept_until": time.time() + keep_seconds, "files": []}
    formats: tuple[Format, ...] = ("bundle", "tar")
    for fmt in formats:
        if (fmt == "bundle" and state.ahead == 0) or (fmt == "tar" and not state.dirty):
            continue
        export = prepare(dirs, sandbox_id, fmt)
        try:
            for name, source in export.files:
                target = "work.bundle" if fmt == "bundle" else name
                os.replace(source, os.path.join(kept, target))
                summary["files"].append(target)
            summary.update({k: v for k, v in export.summary().items() if k not in ("files", "destination", "format")})
        finally:
            discard_quarantine(export)
    with open(os.path.join(kept, "summary.json"), "x") as out:
        json.dump(summary, out, indent=2, sort_keys=True)
    return kept


def prune_kept(dirs: Dirs, now: float) -> list[str]:
    """Remove what the reaper kept once its time is up (and quarantines an export left behind
    when its broker died); the ids whose exports went."""
    root = os.path.join(dirs.state, EXPORTS)
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    gone = []
    for name in names:
        path = os.path.join(root, name)
        if name.startswith(".export-"):
            if _older_than(path, now, GIT_SECONDS * 2):
                remove_tree(path)
            continue
        try:
            with open(os.path.join(path, "summary.json"), "rb") as stream:
                until = float(json.loads(stream.read())["kept_until"])
        except (OSError, ValueError, KeyError, TypeError):
            until = 0.0 if _older_than(path, now, 3600) else now + 1
        if until <= now:
            remove_tree(path)
            gone.append(name)
    return gone


def _older_than(path: str, now: float, seconds: float) -> bool:
    try:
        return os.lstat(path).st_mtime + seconds < now
    except OSError:
        return False
