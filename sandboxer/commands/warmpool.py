"""The warm pool: sandboxes started ahead of the create that takes one.

Most of a create is starting the sandbox and cloning its workspace (a Docker container's start
alone is about 150 ms here; see docs/performance.md). An owner who sets `config.warm: N` in an
extension has the broker keep N sandboxes of each of its profiles started, verified, cloned and
idle. Each is made exactly as a create makes one, from the same plan under an id of its own,
with its workspace cloned from the profile's ref; a create that takes it has the backend
inspect it again against the plan. A clone made earlier is the clone a create would make now
while the repository's refs are the same (what a clone copies follows from them alone): a
warm sandbox is stale once they changed.

Registry states: `warming` (a fill is starting it) → `warm` (started, verified, idle) → taken by
a create: `creating` → `ready`. Callers never see a warm sandbox: `list` leaves it out, and
`exec`, `inspect` and `teardown` answer "no such sandbox".

A warm sandbox is taken only while everything it was made from still holds: the approved bytes
of the profile and of the extension (their sha256), the image, the engine's fingerprint of the
taker's plan, the repository's refs, and what the engine showed when it started
(`Backend.warm_problems`). Anything else is stale: the create that meets it, the next fill, or
`gc` removes it.

This module is the pool's bookkeeping over the registry; it takes plans (a `Planner`) and asks
the sandbox's Backend for everything engine-specific. sandboxer.commands.warm is the `warm`
command and create's use of the pool.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from sandboxer.backends import Backends
from sandboxer.commands.destroy import destroy
from sandboxer.commands.sites import site_of
from sandboxer.core.record import HIDDEN_STATES, SandboxRecord, WarmStamp, now_text
from sandboxer.errors import NotFoundError, SandboxerError
from sandboxer.host import procs
from sandboxer.host.registry import Registry

if TYPE_CHECKING:
    from sandboxer.backends.protocol import Warming
    from sandboxer.core.plan import Backend as BackendName
    from sandboxer.core.plan import Plan

WARMING, WARM = HIDDEN_STATES

# The plan of a profile's sandbox under the given id; the host ids when a sandbox already runs
# for it (a warm one's, from its record).
Planner = Callable[[str, "tuple[int, int] | None"], "Plan"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Kind:
    """What the warm sandboxes of one profile are made from, as a create of it would make them."""

    profile: str
    profile_sha256: str
    extension_sha256: str
    image: str
    backend_name: BackendName
    backend: Warming
    backends: Backends  # every engine: what destroys a stale one
    planner: Planner
    # The repository's refs now (workspace.refs_digest), for the plan's sandbox directory.
    workspace_refs: Callable[[Plan], str]
    # The workspace cloned into a started warm sandbox, as a create would clone it.
    clone: Callable[[Plan, SandboxRecord], SandboxRecord]

    def made_from(self, registry: Registry, plan: Plan) -> dict[str, Any]:
        """What a warm sandbox was made from, to compare with what a create would make."""
        site = site_of(registry, plan.sandbox_id)
        return {
            "profile_sha256": self.profile_sha256,
            "extension_sha256": self.extension_sha256,
            "image": self.image,
            "body_sha256": self.backend.warm_fingerprint(plan, site=site, image=self.image),
        }


def candidates(registry: Registry, profile: str) -> list[str]:
    """Ids of the profile's warm sandboxes, oldest first."""
    found = []
    for sandbox_id in registry.ids():
        record = registry.read_or_none(sandbox_id)
        if record and record.state == WARM and record.profile == profile:
            found.append((record.created_at, sandbox_id))
    return [sandbox_id for _, sandbox_id in sorted(found)]


def claim(registry: Registry, kind: Kind) -> tuple[int, SandboxRecord, Plan] | None:
    """Take a warm sandbox of the kind: (its held lock, its record, its plan). Stale ones met on
    the way are removed; None when there is none to take."""
    for sandbox_id in candidates(registry, kind.profile):
        lock = _try_lock(registry, sandbox_id)
        if lock is None:
            continue
        record = registry.read_or_none(sandbox_id)
        if record is None or record.state != WARM:
            os.close(lock)
            continue
        plan = kind.planner(sandbox_id, _host_ids(record))
        if problems(registry, kind, record, plan):
            with contextlib.suppress(SandboxerError, OSError):
                destroy(registry, sandbox_id, replace(record, state="failed"), backends=kind.backends)
            os.close(lock)
            continue
        return lock, record, plan
    return None


def refill(registry: Registry, kind: Kind, want: int) -> tuple[list[str], list[str], list[str]]:
    """Bring the kind's warm sandboxes to `want`: remove the stale and the surplus, start the
    missing. Returns (kept, started, removed)."""
    kept: list[str] = []
    removed: list[str] = []
    for sandbox_id in candidates(registry, kind.profile):
        lock = _try_lock(registry, sandbox_id)
        if lock is None:
            continue
        try:
            record = registry.read_or_none(sandbox_id)
            if record is None or record.state != WARM:
                continue
            plan = kind.planner(sandbox_id, _host_ids(record))
            stale = len(kept) >= want or bool(problems(registry, kind, record, plan))
            if stale:
                destroy(registry, sandbox_id, replace(record, state="failed"), backends=kind.backends)
                removed.append(sandbox_id)
            else:
                kept.append(sandbox_id)
        finally:
            os.close(lock)
    started: list[str] = []
    while len(kept) < want:
        started.append(start_one(registry, kind))
        kept.append(started[-1])
    return kept, started, removed


def start_one(registry: Registry, kind: Kind) -> str:
    """Start, verify and record one warm sandbox; nothing is left of it if any step fails."""
    sandbox_id, lock = registry.allocate()
    record = SandboxRecord(
        id=sandbox_id,
        profile=kind.profile,
        backend=kind.backend_name,
        state=WARMING,
        created_at=now_text(),
        owner_pid=os.getpid(),
        owner_start=procs.start_time(os.getpid()),
    )
    try:
        registry.write(record)
        plan = kind.planner(sandbox_id, None)
        refs = kind.workspace_refs(plan)  # before the clone: a change while it runs makes it stale
        record, seen = kind.backend.start_warm(
            plan, record, site=site_of(registry, sandbox_id), image=kind.image, note=registry.write
        )
        record = kind.clone(plan, record)
        stamp = WarmStamp(**kind.made_from(registry, plan), **seen, workspace_refs=refs)
        record = replace(record, warm=stamp, state=WARM)
        registry.write(record)
    except BaseException:
        record = replace(record, state="failed")
        with contextlib.suppress(OSError, SandboxerError):
            registry.write(record)
        destroy(registry, sandbox_id, record, backends=kind.backends)
        raise
    finally:
        os.close(lock)
    return sandbox_id


def problems(registry: Registry, kind: Kind, record: SandboxRecord, plan: Plan) -> list[str]:
    """Every reason the warm sandbox may not become a sandbox of this kind with this plan."""
    stamp = record.warm
    if stamp is None:
        return ["it has no warm record"]
    made_from = kind.made_from(registry, plan)
    stale = [f"stale: {key} changed" for key, value in made_from.items() if getattr(stamp, key) != value]
    if not stale and stamp.workspace_refs != kind.workspace_refs(plan):
        stale.append("stale: the repository's refs changed since its workspace was cloned")
    return stale or kind.backend.warm_problems(record, plan, site=site_of(registry, record.id))


def drain(registry: Registry, profile: str, backends: Backends) -> list[str]:
    """Remove every warm sandbox of the profile; the ids removed."""
    removed = []
    for sandbox_id in candidates(registry, profile):
        lock = _try_lock(registry, sandbox_id)
        if lock is None:
            continue
        try:
            record = registry.read_or_none(sandbox_id)
            if record is not None and record.state == WARM:
                destroy(registry, sandbox_id, replace(record, state="failed"), backends=backends)
                removed.append(sandbox_id)
        finally:
            os.close(lock)
    return removed


def _host_ids(record: SandboxRecord) -> tuple[int, int] | None:
    """The host uid and gid a warm sandbox was planned with (for Docker: the daemon's remapping
    as it was when the container started). Taking it is checked where it matters: the backend
    checks its running process is still those ids, no account's."""
    return (record.plan.host_uid, record.plan.host_gid) if record.plan else None


def _try_lock(registry: Registry, sandbox_id: str) -> int | None:
    try:
        return registry.lock(sandbox_id, wait=False)
    except NotFoundError:
        return None
