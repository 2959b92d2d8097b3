"""Laying out a lease manifest's request spools before the sandbox starts: each on the directory
its backend makes for it, a bounded tmpfs of its own (the engine binds it from there, and
dispatch-tool reads it there), with the layout the specification gives (docs/manifest.md)."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from sandboxer.core.leases import binding
from sandboxer.core.plan import MountKind
from sandboxer.host import lease_mounts

if TYPE_CHECKING:
    from sandboxer.backends.protocol import Spools
    from sandboxer.core.leases import Assignment
    from sandboxer.core.plan import Plan


def make_spools(
    assignment: Assignment, plan: Plan, backend: Spools, state_dir: str, *, consumer: tuple[int, int]
) -> None:
    """Each tool-request lease's spool of the plan, made, mounted and laid out; `consumer`: the
    sandbox user's host uid and gid."""
    for mount in plan.mounts:
        if mount.kind is not MountKind.SPOOL:
            continue
        lease = next(item for item in assignment.manifest.leases if item.lease_id == mount.lease)
        root = backend.make_spool_root(
            str(mount.source), sandbox_id=plan.sandbox_id, state_dir=state_dir, group=consumer[1]
        )
        lease_mounts.mount_spool_tmpfs(root)
        lay_out_spool(
            root,
            binding_doc=binding(assignment.manifest, lease),
            capability=assignment.capabilities[lease.lease_id],
            consumer=consumer,
        )


def lay_out_spool(root: str, *, binding_doc: dict[str, Any], capability: bytes, consumer: tuple[int, int]) -> None:
    """The spool's layout in an empty directory the broker (root) owns: `.binding.json` and
    `.capability` 0444, `requests/` 0700 the consumer's, `responses/` 0755, `.processing/` 0700."""
    os.chmod(root, 0o755)  # noqa: S103 - the consumer traverses it; only requests/ is its to write
    for name, data in (
        (".binding.json", json.dumps(binding_doc, indent=2).encode() + b"\n"),
        (".capability", capability),
    ):
        fd = os.open(
            os.path.join(root, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o444
        )
        try:
            os.write(fd, data)
            os.fchmod(fd, 0o444)
        finally:
            os.close(fd)
    for name, mode in (("requests", 0o700), ("responses", 0o755), (".processing", 0o700)):
        os.mkdir(os.path.join(root, name), mode)
        os.chmod(os.path.join(root, name), mode)
    os.lchown(os.path.join(root, "requests"), *consumer)
