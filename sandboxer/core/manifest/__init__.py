"""Lease manifests: the assignment an orchestrator signs off for one run (docs/manifest.md).

`load` is the whole check a caller gets from `manifest check` and `create --manifest`: the
assignment file, the document (`parse`: pure, parsing.py and lease_parsing.py on the types and
rules of schema.py), every source on the filesystem (modes, owners, digests, value contents:
sources.py), then expiry (`check_live`). Errors name the file, the field path and the rule; they
never carry a value read from the manifest's value files, a capability or a digest of either.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sandboxer.core.manifest.lease_parsing import targets_apart
from sandboxer.core.manifest.parsing import parse
from sandboxer.core.manifest.schema import (
    MODEL_IDENTITY,
    PROJECT_ENV_TARGET,
    PROJECT_ENVIRONMENT,
    PROVIDER_CREDENTIAL,
    PROVIDER_ENVIRONMENT,
    RESERVED_TARGETS,
    SHARED_DIRECTORY,
    TOOL_ENDPOINT,
    TOOL_REQUEST,
    Lease,
    LeaseExpiredError,
    Manifest,
    expiry_checked,
    run_dir,
)
from sandboxer.core.manifest.sources import check_sources, project_variables, read_assignment, read_material

# The entry points: what callers reach as `manifest.NAME`.
__all__ = ["check_live", "load", "meaning"]
# sandboxer/core/leases.py still reaches these as `mf.NAME` (it is being changed alongside this split);
# once it imports them from their own modules, they leave this list.
__all__ += [
    "MODEL_IDENTITY",
    "PROJECT_ENVIRONMENT",
    "PROJECT_ENV_TARGET",
    "PROVIDER_CREDENTIAL",
    "PROVIDER_ENVIRONMENT",
    "RESERVED_TARGETS",
    "SHARED_DIRECTORY",
    "TOOL_ENDPOINT",
    "TOOL_REQUEST",
    "Lease",
    "Manifest",
    "check_sources",
    "expiry_checked",
    "parse",
    "project_variables",
    "read_assignment",
    "read_material",
    "run_dir",
    "targets_apart",
]


def load(path: str, *, now: datetime | None = None, forbidden: Sequence[str] = ()) -> Manifest:
    """The whole check of an assignment file: ManifestError (2) or LeaseExpiredError (3)."""
    data, info = read_assignment(path)
    manifest = parse(data, file=path)
    check_sources(manifest, owner=info.st_uid, forbidden=forbidden)
    check_live(manifest, now=now)
    return manifest


def check_live(manifest: Manifest, *, now: datetime | None = None) -> None:
    """Every lease whose expiry is checked must expire strictly after `now` (LeaseExpiredError)."""
    moment = now or datetime.now(UTC)
    for lease in manifest.leases:
        if expiry_checked(manifest, lease) and lease.expires_at is not None and lease.expires_at <= moment:
            raise LeaseExpiredError(manifest.file, f"{lease.field}.expires_at", "the lease has expired")


def meaning(manifest: Manifest) -> dict[str, Any]:
    """What `manifest check --json` prints: ids, scopes, targets and expiries; never a value,
    a capability or a digest."""
    return {
        "file": manifest.file,
        "version": manifest.version,
        "run_id": manifest.run_id,
        "lease_id": manifest.lease_id,
        "outer_runtime_id": manifest.outer_runtime_id,
        "repository": {"path": manifest.repository_path, "revision": manifest.repository_revision},
        "task_branch": manifest.task_branch,
        "published_ports": [{"host": h, "runtime": p} for h, p in manifest.published_ports],
        "workspace_consumer": (
            None
            if manifest.workspace_consumer is None
            else {"uid": manifest.workspace_consumer[0], "gid": manifest.workspace_consumer[1]}
        ),
        "service_images": dict(manifest.service_images),
        "leases": [
            {
                "lease_id": lease.lease_id,
                "scope": lease.scope,
                "consumer": lease.consumer,
                "expires_at": None if lease.expires_at is None else lease.expires_at.isoformat(),
                "targets": [m.target_path for m in lease.materializations if m.target_path is not None],
                "environment_names": [m.environment_name for m in lease.materializations if m.environment_name],
                **({"executable": lease.executable} if lease.executable else {}),
                **({"inherited_environment": list(lease.inherited_environment)} if lease.executable else {}),
                **(
                    {"request_spool_target": lease.request_spool_target, "consumer_uid": lease.consumer_uid}
                    if lease.scope == TOOL_REQUEST
                    else {}
                ),
            }
            for lease in manifest.leases
        ],
    }
