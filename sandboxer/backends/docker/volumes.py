"""The named volumes of Docker spools: made at create (its tmpfs goes on the volume's own
directory), found by dispatch, checked against what the container sees, and removed at teardown
or by gc when their sandbox is gone. Each volume is labelled with its sandbox and state dir."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import quote

from sandboxer.backends.docker import engine
from sandboxer.backends.docker.render import LABEL, STATE_LABEL
from sandboxer.core.leases import SPOOL_VOLUME_PREFIX
from sandboxer.core.plan import MountKind
from sandboxer.errors import BackendError, PolicyError
from sandboxer.host.lease_mounts import unmount_below
from sandboxer.host.observe import parse_mountinfo

if TYPE_CHECKING:
    from sandboxer.core.plan import Plan
    from sandboxer.host.observe import MountSeen


def create_volume(name: str, *, sandbox_id: str, state_dir: str) -> str:
    """Create the named volume of a spool; returns its host mount point (the broker is root)."""

    body: dict[str, object] = {"Name": name, "Driver": "local", "Labels": {LABEL: sandbox_id, STATE_LABEL: state_dir}}
    try:
        status, content = engine.request("GET", f"/volumes/{name}")
        if status == 200:
            raise PolicyError(f"spool volume {name} already exists: a run's spool belongs to one sandbox")
        status, content = engine.request("POST", "/volumes/create", body)
    except (OSError, engine.EngineError) as exc:
        raise BackendError(f"docker: the spool volume could not be created ({exc})") from None
    if status != 201:
        raise BackendError(f"docker: the spool volume could not be created (HTTP {status})")
    mountpoint = json.loads(content).get("Mountpoint")
    if not isinstance(mountpoint, str) or not os.path.isdir(mountpoint):
        raise BackendError(f"docker: spool volume {name} has no local mount point")
    return mountpoint


def volume_mountpoint(name: str) -> str:
    """The host directory of a live sandbox's spool volume (dispatch reads and writes there)."""

    try:
        status, content = engine.request("GET", f"/volumes/{name}")
        mountpoint = json.loads(content).get("Mountpoint") if status == 200 else None
    except (OSError, ValueError, engine.EngineError) as exc:
        raise BackendError(f"docker: the spool volume cannot be inspected ({exc})") from None
    if not isinstance(mountpoint, str):
        raise BackendError(f"docker: spool volume {name} is gone")
    return mountpoint


def orphan_volumes(state_dir: str, present: Callable[[], set[str]]) -> list[tuple[str, str]]:
    """(volume, sandbox id) of spool volumes this state dir made whose sandbox directory is gone.

    `present` lists the sandbox directories; it is asked only after the volumes are listed: a
    create makes its directory before its volumes, so one in progress is never taken for gone.
    """

    filters = quote(json.dumps({"label": [f"{STATE_LABEL}={state_dir}"]}))
    try:
        status, content = engine.request("GET", f"/volumes?filters={filters}")
        found = json.loads(content).get("Volumes") or [] if status == 200 else []
    except (OSError, ValueError, engine.EngineError):
        return []
    orphans = []
    present_ids = present()
    for volume in found:
        owner = (volume.get("Labels") or {}).get(LABEL)
        if (
            isinstance(owner, str)
            and owner not in present_ids
            and str(volume.get("Name", "")).startswith(SPOOL_VOLUME_PREFIX)
        ):
            orphans.append((str(volume["Name"]), owner))
    return orphans


def remove_volume(name: str, *, sandbox_id: str) -> str | None:
    """Remove this sandbox's spool volume: None when removed, "gone" when it was not there (or is
    another sandbox's, which is never touched), else what went wrong."""

    try:
        status, content = engine.request("GET", f"/volumes/{name}")
        if status == 404:
            return "gone"
        document = json.loads(content) if status == 200 else {}
        if status == 200 and (document.get("Labels") or {}).get(LABEL) != sandbox_id:
            return "gone"
        mountpoint = document.get("Mountpoint")
        # Its tmpfs goes first: the Engine removes a volume's directory, not what is mounted on it.
        if isinstance(mountpoint, str) and mountpoint.startswith("/") and unmount_below(mountpoint):
            return f"its tmpfs at {mountpoint} cannot be unmounted"
        status, _ = engine.request("DELETE", f"/volumes/{name}")
    except (OSError, ValueError, engine.EngineError) as exc:
        return f"the Engine cannot be reached ({exc})"
    return None if status in (204, 404) else f"the Engine answered HTTP {status}"


def spool_mismatches(plan: Plan, inside: list[MountSeen]) -> list[str]:
    """Spools the sandbox does not see as the broker's tmpfs on their volume: the mount at each
    spool target inside must be that tmpfs (same filesystem and root)."""

    spools = [m for m in plan.mounts if m.kind is MountKind.SPOOL]
    if not spools:
        return []

    with open("/proc/self/mountinfo") as stream:
        host = {m.target: m for m in parse_mountinfo(stream.read())}  # the last at a point is on top
    seen = {m.target: m for m in inside}
    problems = []
    for mount in spools:
        try:
            status, content = engine.request("GET", f"/volumes/{mount.source}")
            mountpoint = json.loads(content).get("Mountpoint") if status == 200 else None
        except (OSError, ValueError, engine.EngineError):
            mountpoint = None
        ours, theirs = host.get(str(mountpoint)), seen.get(mount.target)
        if (
            ours is None
            or theirs is None
            or ours.fstype != "tmpfs"
            or (ours.device, ours.root, ours.fstype) != (theirs.device, theirs.root, theirs.fstype)
        ):
            problems.append(f"lease {mount.lease}: {mount.target} is not its spool's bounded tmpfs inside the sandbox")
    return problems
