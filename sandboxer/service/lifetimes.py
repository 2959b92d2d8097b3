"""Sandbox lifetimes: the service tears down every sandbox whose `create --ttl` has run out
(audit verb `expire`) or that went unused for its profile's `lifetime.idle_seconds` — no exec
running, none started or ended for that long (verb `idle`) — and says so in the audit log, as
the service's own uid and pid. Without a running service nothing expires; the sandbox waits for
the next service (or a teardown).

Work no export took out is not lost with it: the reaper first exports it into
`<state>/exports/<id>/` (a bundle of the new commits, a tar of a changed tree, summary.json),
kept for `serve --keep-exports` seconds as the sandbox's caller's (`sandboxer exports` lists,
fetches and removes it; it counts against the caller's export budget, within which it must fit),
and the audit line names that directory. Each git
command of it has REAPER_GIT_SECONDS. A sandbox whose work cannot be exported (its git fails or
takes too long) is audited so and tried once more a minute later; then it is torn down without
its work: a lifetime is the owner's limit, which a sandbox cannot stretch by making its work
unexportable.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from sandboxer.backends import Backends
from sandboxer.commands.export import Export, Format, discard_quarantine, prepare
from sandboxer.commands.export_space import EXPORTS, SUMMARY, default_budget, ledger, reclaim_abandoned
from sandboxer.commands.kept import fetch_hint
from sandboxer.commands.services import Services
from sandboxer.commands.teardown import residue_error, teardown
from sandboxer.commands.work import work_state
from sandboxer.dirs import Dirs
from sandboxer.errors import SandboxerError
from sandboxer.grants import budget_of_account
from sandboxer.host import activity
from sandboxer.host.fstree import remove_tree
from sandboxer.host.registry import Registry, check_id
from sandboxer.service.audit import AuditLog

log = logging.getLogger("sandboxer.service")

REAP_EVERY = 1.0  # seconds between two looks at the registry
KEEP_EXPORTS = 7 * 24 * 3600  # seconds the reaper's exports are kept (serve --keep-exports)
RETRY_EXPORT = 60  # seconds before the reaper tries once more to export a sandbox's work
REAPER_GIT_SECONDS = 30  # each git command of the reaper's export: a sandbox cannot hold the reaper


def expired(dirs: Dirs, now: float) -> list[tuple[str, str]]:
    """The ready sandboxes whose lifetime ended by `now`, each with why (`expire` or `idle`)."""

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

    def __init__(self, dirs: Dirs, services: Services, audit: AuditLog, *, keep_exports: float = KEEP_EXPORTS) -> None:
        self.dirs = dirs
        self.services = services
        self.audit = audit
        self.keep_exports = keep_exports
        self.failed: dict[str, float] = {}  # sandbox id: when the export of its work first failed

    def reap(self) -> list[str]:
        """Tear down what expired, its work exported first; the ids torn down or tried (each
        audited). Kept exports whose time is up go too. Nothing here stops the service: a
        failure is one sandbox's audit line."""
        now = time.time()
        try:
            prune_kept(self.dirs, now)
        except OSError:
            log.exception("the reaper could not prune kept exports")
        done = []
        for sandbox_id, why in expired(self.dirs, now):
            first_failure = self.failed.get(sandbox_id)
            if first_failure is not None and now - first_failure < RETRY_EXPORT:
                continue
            try:
                outcome, status, kept = self._end(sandbox_id, keep_work=first_failure is None)
            except Exception as exc:
                log.exception("the reaper could not end sandbox %s", sandbox_id)
                outcome, status, kept = type(exc).__name__, 5, None
            me = (os.geteuid(), os.getpid())
            fetch = None if kept is None else fetch_hint(sandbox_id)
            self.audit.record(
                uid=me[0],
                pid=me[1],
                verb=why,
                sandbox=sandbox_id,
                outcome=outcome,
                status=status,
                kept=kept,
                fetch=fetch,
            )
            done.append(sandbox_id)
        return done

    def _end(self, sandbox_id: str, *, keep_work: bool) -> tuple[str, int, str | None]:
        """Export what work the sandbox holds, then tear it down: (outcome, status, where its work
        was kept). Work whose export fails is tried once more RETRY_EXPORT later; then the sandbox
        goes without it — its lifetime is the owner's limit, which no sandbox can stretch by making
        its work unexportable."""

        kept = None
        try:
            kept = keep_for_reaper(self.dirs, sandbox_id, self.keep_exports, self.services.backends)
        except (SandboxerError, OSError) as exc:
            if keep_work:
                self.failed[sandbox_id] = time.time()
                return f"export failed ({type(exc).__name__}); tried again later", 5, None
        receipt = teardown(self.dirs, sandbox_id, services=self.services)
        self.failed.pop(sandbox_id, None)
        if receipt.residue:
            error = residue_error(receipt)
            return type(error).__name__, error.exit_status, kept
        return "ok", 0, kept


def keep_for_reaper(dirs: Dirs, sandbox_id: str, keep_seconds: float, backends: Backends) -> str | None:
    """Before the service tears an expired sandbox down: take out whatever work it holds into
    `<state>/exports/<id>/` (a bundle of its new commits, a tar of a changed tree, and
    summary.json with when it may go); that directory, or None when there was nothing to keep.
    Each git command inside has REAPER_GIT_SECONDS. It is the caller's (summary.json keeps its uid
    and the bytes kept) and is made within the caller's export budget (PolicyError past it)."""

    registry = Registry(dirs.state)
    record = registry.read_or_none(check_id(sandbox_id))
    if record is None or record.work is None or record.state != "ready":
        return None
    state, work = work_state(dirs, sandbox_id, backends=backends, seconds=REAPER_GIT_SECONDS)
    if not state.unexported(work):
        return None
    budget = default_budget() if record.caller_uid is None else budget_of_account(dirs, record.caller_uid)
    kept = os.path.join(dirs.state, EXPORTS, sandbox_id)
    remove_tree(kept)
    os.makedirs(kept, mode=0o700)
    exports: list[Export] = []
    try:
        summary: dict[str, Any] = {"id": sandbox_id, "kept_until": time.time() + keep_seconds, "files": []}
        formats: tuple[Format, ...] = ("bundle", "tar")
        for fmt in formats:
            if (fmt == "bundle" and state.ahead == 0) or (fmt == "tar" and not state.dirty):
                continue
            export = prepare(
                dirs, sandbox_id, fmt, backends=backends, budget=budget, state=state, seconds=REAPER_GIT_SECONDS
            )
            exports.append(export)
            for name, source in export.files:
                target = "work.bundle" if fmt == "bundle" else name
                os.replace(source, os.path.join(kept, target))
                summary["files"].append(target)
            leaving = ("files", "destination", "format")
            summary.update({k: v for k, v in export.summary().to_json().items() if k not in leaving})
        summary["uid"] = budget.uid
        summary["bytes"] = sum(os.lstat(os.path.join(kept, name)).st_size for name in summary["files"])
        # The kept bytes count from the moment summary.json says so; the quarantines' reservations
        # go only after that, so the caller's budget never sees them as free in between.
        with ledger(os.path.dirname(kept)), open(os.path.join(kept, SUMMARY), "x") as out:
            json.dump(summary, out, indent=2, sort_keys=True)
    except BaseException:
        remove_tree(kept)
        raise
    finally:
        for export in exports:
            discard_quarantine(export)
    return kept


def prune_kept(dirs: Dirs, now: float) -> list[str]:
    """Remove what the reaper kept once its time is up (and the quarantine of every export whose
    exporter died: sandboxer.commands.export_space); the ids whose exports went."""
    reclaim_abandoned(dirs.state, now)
    root = os.path.join(dirs.state, EXPORTS)
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    gone = []
    for name in names:
        path = os.path.join(root, name)
        if name.startswith("."):
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
