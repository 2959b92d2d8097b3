"""Destroying a sandbox: its processes or container, limits, mounts and directory (teardown,
gc, a failed create, a stale warm container)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from sandboxer import workspace
from sandboxer.registry import Registry

if TYPE_CHECKING:
    pass


def destroy(registry: Registry, sandbox_id: str, record: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Remove everything a sandbox owns: processes, cgroups, clone, directory. (removed, residue)."""
    from sandboxer.backends import backend_for

    record = {**record, "id": sandbox_id}
    backend = backend_for(record.get("backend") or "bwrap")  # a record cut short is a bwrap create's
    # A create killed mid-clone: git died with it, a helper of git may still write below.
    stray = workspace.stop_git(registry.path(sandbox_id, workspace.GIT_HOME))
    removed, residue = backend.stop(registry, record)
    residue += [f"host git process {pid}" for pid in stray]
    still_running = list(residue)  # processes that survived, a container the Engine kept
    if os.path.isdir(registry.path(sandbox_id, "leases")):  # no process or container uses them now
        from sandboxer import lease_mounts

        lease_mounts.unstage(registry.path(sandbox_id))  # what stays mounted is residue, found below
    if isinstance(record.get("bootstrap"), dict) and not residue:
        removed.append(f"bootstrap file {record['bootstrap'].get('target')} (with the sandbox's private state)")
    if isinstance(record.get("manifest"), dict):
        from sandboxer import lease_removal

        # The assignment's own files go only once the sandbox had consumed it (it was ready).
        lease_removed, lease_residue = lease_removal.remove(
            record["manifest"],
            backend=backend,
            sandbox_id=sandbox_id,
            materializations=record.get("state") == "ready" or bool(record.get("consumed")),
        )
        removed.extend(lease_removed)
        residue.extend(lease_residue)
    limits_removed, limits_residue = backend.release(record)
    removed.extend(limits_removed)
    residue.extend(limits_residue)
    if not still_running:  # no process or container can hold the workspace filesystem now
        from sandboxer import workspace_volume

        fs_removed, fs_residue = workspace_volume.unmount(registry.path(sandbox_id))
        removed.extend(fs_removed)
        residue.extend(fs_residue)
    more_removed, more_residue = _remove_directory(registry.path(sandbox_id))
    return removed + more_removed, residue + more_residue


def _remove_directory(directory: str) -> tuple[list[str], list[str]]:
    """The sandbox's own directory: its clone, replay ledger and the rest, unless something is
    still mounted below it (then all of it is residue)."""
    removed: list[str] = []
    mounted = _host_mounts_below(directory)
    residue = [f"mount {m}" for m in mounted]
    clone_dir = os.path.join(directory, "workspace")
    if os.path.lexists(clone_dir):
        if workspace.remove_tree(clone_dir):
            removed.append(f"workspace {clone_dir}")
        else:
            residue.append(f"workspace {clone_dir}")
    ledger = os.path.join(directory, "ledger")
    if os.path.isdir(ledger) and not mounted and workspace.remove_tree(ledger):
        removed.append(f"replay ledger {ledger}")
    if not mounted and workspace.remove_tree(directory):
        removed.append(f"sandbox dir {directory}")
    elif os.path.lexists(directory):
        residue.append(f"sandbox dir {directory}")
    return removed, residue


def _host_mounts_below(directory: str) -> list[str]:
    from sandboxer.fsutil import mount_points

    return [point for point in mount_points() if point == directory or point.startswith(directory + "/")]
