"""What a warm container is on the Engine: started from a plan and probed ahead of a create,
fingerprinted by its rendered settings, and checked again before a create takes it.

The pool itself (which containers are warm, claiming one, filling, draining) is the core's:
sandboxer.commands.warmpool. This module is the Docker half it reaches through DockerBackend.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from sandboxer.backends.docker import container, engine
from sandboxer.backends.docker.render import create_body, verify
from sandboxer.core.record import WorkspaceFs
from sandboxer.errors import BackendError
from sandboxer.host import workspace_volume
from sandboxer.host.observe import ProbeSeen, process_differences

if TYPE_CHECKING:
    from sandboxer.backends.protocol import Note, Site
    from sandboxer.core.plan import Plan
    from sandboxer.core.record import SandboxRecord

    class Starter(Protocol):
        """backend.start_docker: start, note and verify the container of a plan."""

        def __call__(
            self, plan: Plan, record: SandboxRecord, *, image: str, site: Site, note: Note
        ) -> tuple[SandboxRecord, ProbeSeen, list[str]]: ...


def fingerprint(plan: Plan, *, site: Site, image: str) -> str:
    """The sha256 of the container settings the plan renders to: a warm container is taken only
    by a create that would ask the Engine for exactly the same container."""

    body = create_body(plan, image=image, etc_dir=site.path("etc"), state_dir=site.state_dir)
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def start(
    plan: Plan, record: SandboxRecord, *, site: Site, image: str, note: Note, start_docker: Starter
) -> tuple[SandboxRecord, dict[str, Any]]:
    """Start (with `start_docker`, as every create) and verify a warm container for `plan` (its
    workspace an empty, sized filesystem, the container root's): its record, and what its pid 1
    and the Engine showed, to be checked again when a create takes it."""

    since = int(time.time()) - 1  # whole seconds: the Engine's event history is asked from here on
    # Its own sized filesystem (as every create's), empty until a create clones into it, and the
    # container root's (who enters it as the container's working directory before becoming the
    # sandbox user, who cannot).
    workspace_volume.make(site.directory, size_mib=plan.limits.workspace_mib)
    record = replace(record, workspace_fs=WorkspaceFs(mib=plan.limits.workspace_mib, enforced=True))
    os.chown(str(plan.workspace_source), *container.remap().root)
    record, probe, interfaces = start_docker(plan, record, image=image, site=site, note=note)
    state = container.inspect(str(record.container_id)).get("State") or {}
    return record, {
        "probe": probe.fields(),
        "interfaces": interfaces,
        "pid": state.get("Pid"),
        "started_at": state.get("StartedAt"),
        "since": since,
    }


def problems(record: SandboxRecord, plan: Plan, *, site: Site) -> list[str]:
    """Every reason the warm container may not become the sandbox of `plan`: what its pid 1 saw
    when it started, and the container as the Engine shows it now."""

    if record.warm is None:
        return ["it has no warm record"]
    try:
        probe = ProbeSeen.of_fields(record.warm.probe)
        interfaces = list(record.warm.interfaces)
    except (KeyError, TypeError, ValueError):
        return ["its warm record has an unexpected shape"]
    return process_differences(plan, interfaces, probe) + container_problems(record, plan, site=site)


def container_problems(record: SandboxRecord, plan: Plan, *, site: Site) -> list[str]:
    """The final inspection of a warm container: the Engine's view against the plan, and the
    same pid 1 that was probed when it started, with no exec ever run in it."""

    try:
        attrs = container.inspect(str(record.container_id))
    except BackendError as exc:
        return [exc.message]
    found = verify(attrs, plan, etc_dir=site.path("etc"))
    found += container.host_problems(attrs, plan)
    state = attrs.get("State") or {}
    stamp = record.warm
    if not state.get("Running"):
        found.append("the container is not running")
    if stamp is None or state.get("Pid") != stamp.pid or state.get("StartedAt") != stamp.started_at:
        found.append("the container was restarted after it was verified")
    if attrs.get("ExecIDs") or _execs_since(str(record.container_id), stamp.since if stamp else None):
        found.append("something was executed in the warm container")
    return found


def _execs_since(container_id: str, since: object) -> bool:
    """Whether the Engine's event history shows an exec created in the container since it was
    warmed (or cannot say: then it is taken as yes). The history is bounded (the Engine keeps
    its last 256 events), so this catches what a running-exec check alone would miss, not all."""

    if not isinstance(since, int):
        return True
    filters = engine.quote(json.dumps({"type": ["container"], "container": [container_id], "event": ["exec_create"]}))
    try:
        status, content = engine.request(
            "GET",
            f"/events?since={since}&until={time.time():.9f}&filters={filters}",  # now: never a wait
        )
    except (OSError, engine.EngineError):
        return True
    return status != 200 or bool(content.strip())
