"""Destroying a sandbox: its processes or container, limits, mounts and directory (teardown,
gc, a failed create, a stale warm container)."""

from __future__ import annotations

import os
from dataclasses import replace

from sandboxer.backends import Backends
from sandboxer.commands import lease_removal
from sandboxer.commands.sites import site_of
from sandboxer.core.record import SandboxRecord
from sandboxer.core.removal import Removal
from sandboxer.host import hostgit, lease_mounts, workspace, workspace_volume
from sandboxer.host.fsutil import mount_points
from sandboxer.host.registry import Registry


def destroy(registry: Registry, sandbox_id: str, record: SandboxRecord | None, *, backends: Backends) -> Removal:
    """Remove everything a sandbox owns: processes or container, cgroups, mounts, spools, clone,
    directory. `record` is None when it is missing or unreadable: then every backend removes what
    it finds of the sandbox by its id."""

    # A create killed mid-clone: git died with it, a helper of git may still write below.
    stray_git = hostgit.stop_git(registry.path(sandbox_id, workspace.GIT_HOME))
    stray = Removal.of(residue=[f"host git process {pid}" for pid in stray_git])
    if record is None:
        return _destroy_unrecorded(registry, sandbox_id, stray, backends)
    record = replace(record, id=sandbox_id)
    backend = backends.backend(record.backend)
    done = backend.stop(record, site=site_of(registry, sandbox_id)) + stray
    still_running = not done.clean  # processes that survived, a container the Engine kept
    if os.path.isdir(registry.path(sandbox_id, "leases")):  # no process or container uses them now
        lease_mounts.unstage(registry.path(sandbox_id))  # what stays mounted is residue, found below
    if record.bootstrap is not None and not still_running:
        done += Removal(removed=(f"bootstrap file {record.bootstrap.target} (with the sandbox's private state)",))
    if record.manifest is not None:
        # The assignment's own files go only once the sandbox had consumed it (it was ready).
        done += lease_removal.remove(
            record.manifest,
            backend=backend,
            sandbox_id=sandbox_id,
            sandbox_dir=registry.path(sandbox_id),
            materializations=record.state == "ready" or record.consumed,
        )
    done += backend.release(record)
    if not still_running:  # no process or container can hold the workspace filesystem now
        done += workspace_volume.unmount(registry.path(sandbox_id))
    return done + _remove_directory(registry.path(sandbox_id))


def _destroy_unrecorded(registry: Registry, sandbox_id: str, stray: Removal, backends: Backends) -> Removal:
    """A sandbox without a readable record: each backend stops and releases what it finds by the
    id (processes carrying it, a container labelled with it, leftover cgroups), then the
    directory goes unless something is still mounted below it."""

    done = stray
    for name in backends.names:
        stub = SandboxRecord(id=sandbox_id, profile="", backend=name, state="failed", created_at="")
        backend = backends.backend(name)
        done += backend.stop(stub, site=site_of(registry, sandbox_id))
        done += backend.release(stub)
    if os.path.isdir(registry.path(sandbox_id, "leases")):
        lease_mounts.unstage(registry.path(sandbox_id))
    if done.clean:
        done += workspace_volume.unmount(registry.path(sandbox_id))
    return done + _remove_directory(registry.path(sandbox_id))


def _remove_directory(directory: str) -> Removal:
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
    return Removal.of(removed, residue)


def _host_mounts_below(directory: str) -> list[str]:

    return [point for point in mount_points() if point == directory or point.startswith(directory + "/")]
