"""`create`: a new sandbox from an approved profile, or a warm container taken for it."""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any

from sandboxer import procs
from sandboxer.commands.destroy import destroy
from sandboxer.commands.making import CreateRequest, clone_workspace, deliver_requested, plan_for
from sandboxer.errors import SandboxerError
from sandboxer.record import now_text
from sandboxer.registry import Registry

if TYPE_CHECKING:
    from sandboxer.dirs import Dirs


def create(
    dirs: Dirs, profile_name: str, *, manifest_path: str | None = None, bootstrap_path: str | None = None
) -> dict[str, Any]:
    """Create a sandbox from an approved profile (a lease manifest, a runtime bootstrap);
    nothing is left behind if any step fails."""
    from sandboxer.plan import WORKSPACE_TARGET

    request = CreateRequest(dirs, profile_name, manifest_path, bootstrap_path)
    registry = Registry(dirs.state)
    from sandboxer.commands import warm

    warm_count = warm.wanted(request)  # 0 unless the backend keeps warm sandboxes for the profile
    taken = warm.claim(request, registry) if warm_count else None
    if taken is None:
        sandbox_id, lock = registry.allocate()
        record: dict[str, Any] = {}
    else:
        sandbox_id, lock, record, plan = taken
    record.update(
        {
            "id": sandbox_id,
            "profile": request.profile.name,
            "backend": request.backend,
            "state": "creating",
            "created_at": now_text(),
            "owner_pid": os.getpid(),
            "owner_start": procs.start_time(os.getpid()),
            "warm_profile": bool(warm_count),  # its teardown tops the profile's warm containers up
        }
    )
    try:
        registry.write(sandbox_id, record)
        if taken is None:
            _make(request, registry, record)
        else:
            warm.finish(request, registry, record, plan)
        record["state"] = "ready"
        registry.write(sandbox_id, record)
    except BaseException as exc:
        record["state"] = "failed"
        with contextlib.suppress(OSError, SandboxerError):
            registry.write(sandbox_id, record)
        _, residue = destroy(registry, sandbox_id, record)
        if residue and isinstance(exc, SandboxerError):
            exc.message += f" (and cleanup left residue: {'; '.join(residue)})"
        raise
    finally:
        os.close(lock)
    if warm_count and taken is None:
        # None was warm (the first create of the profile, or a burst took them all): fill now.
        # A taken one is replaced when its sandbox is torn down, not while the caller uses it.
        warm.spawn_fill(dirs, request.profile.name)
    result = {
        "id": sandbox_id,
        "profile": request.profile.name,
        "backend": record["backend"],
        "runtime_sha256": request.extension.runtime.sha256,
        "workspace": WORKSPACE_TARGET,
        "limits": record["limits"]["mechanism"],
    }
    if request.assignment is not None:
        manifest = request.assignment.manifest
        result["manifest"] = {"run_id": manifest.run_id, "leases": len(manifest.leases)}
    if "bootstrap" in record:
        result["bootstrap"] = record["bootstrap"]
    return result


def _make(request: CreateRequest, registry: Registry, record: dict[str, Any]) -> None:
    """Plan, clone, spools, start and verify, deliver: the body of a create."""
    from sandboxer.backends import backend_for

    sandbox_id = str(record["id"])
    assignment = request.assignment
    plan = plan_for(request, registry, sandbox_id)
    backend = backend_for(plan.backend)
    from sandboxer import workspace_volume

    if plan.workspace_in_memory:
        record["workspace_fs"] = {"mib": plan.limits.workspace_mib, "enforced": True, "kind": "tmpfs"}
    else:
        bounded = workspace_volume.make(registry.path(sandbox_id), size_mib=plan.limits.workspace_mib)
        record["workspace_fs"] = {"mib": plan.limits.workspace_mib, "enforced": bounded, "kind": "ext4"}
    clone_workspace(request, plan)
    if assignment is not None:
        record["manifest"] = assignment.record(plan)
        registry.write(sandbox_id, record)
        assignment.make_spools(plan, backend, request.state_dir, consumer=(plan.host_uid, plan.host_gid))
    backend.start(plan, registry, record, image=request.image, profile_file=request.profile_file)
    deliver_requested(request, plan, record)
