"""What a checked lease manifest grants one sandbox, on either backend (docs/manifest.md).

The broker plays the manifest's in-guest runtime: shared directories, standalone tool endpoints
and a provider credential become read-only binds at their targets; the project environment file
is bound read-only and its variables join every exec; each tool-request lease gets a writable
request spool of its own (where it lives is its backend's choice: `Backend.spool_place`) laid
out as the specification says, and suppresses the bind of the socket endpoint it links.
Provider-environment values are never mounted or stored: a provider launch reads them again
right before it starts (`provider_environment`).

The host mounts behind the grants are host/lease_mounts.py's; the spools are laid out by
commands/spools.py, and what teardown removes is commands/lease_removal.py's.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sandboxer.core import manifest as mf
from sandboxer.core.egress.inside import EGRESS_PORT
from sandboxer.core.plan import (
    SAFE_PATH,
    SANDBOX_GID,
    SANDBOX_UID,
    STATE_DIRS,
    STATE_ROOT,
    Grants,
    Mount,
    MountKind,
    Plan,
)
from sandboxer.core.record import (
    APP_SERVICE,
    LeaseMount,
    LeaseRecord,
    ManifestRecord,
    ServiceRecord,
    ServicesRecord,
    Spool,
)
from sandboxer.errors import PolicyError

MIN_PUBLISHED_PORT = 1024  # below it a port is privileged on the host: never published
MAX_PUBLISHED_PORTS = 16  # each is a listener and up to 256 connections in the service
SPOOL_PENDING_FILES = 16
SPOOL_REQUEST_BYTES = 256 * 1024
SPOOL_TOTAL_BYTES = 1024 * 1024
SPOOL_VOLUME_PREFIX = "sandboxer-spool-"

# Where a spool of this name lives: the source of its mount and the directory it is opened below
# (None when the engine resolves the source itself). A backend's `spool_place` for one sandbox.
SpoolPlace = Callable[[str], tuple[str, str | None]]


def spool_name(run_id: str, lease_id: str) -> str:
    """The spool's name, derived from the run and the lease; its backend places it (a volume of
    this name, a directory of this name: `Backend.spool_place`)."""
    return SPOOL_VOLUME_PREFIX + hashlib.sha256(f"{run_id}\n{lease_id}".encode()).hexdigest()[:40]


@dataclass(frozen=True, slots=True, kw_only=True)
class Assignment:
    """A checked manifest with what create needs of its files, read once through checked
    descriptors: the project environment and each spool's capability (never a provider value)."""

    manifest: mf.Manifest
    owner: int
    project_env: bytes | None
    capabilities: dict[str, bytes] = field(repr=False)

    @property
    def file(self) -> str:
        return self.manifest.file

    @property
    def revision(self) -> str:
        return self.manifest.repository_revision

    @property
    def branch(self) -> str:
        return self.manifest.task_branch

    @property
    def image(self) -> str | None:
        return service_image(self.manifest)

    def grants(self, spool_place: SpoolPlace) -> Grants:
        return grants(self.manifest, spool_place=spool_place, project_env=self.project_env)

    def record(self, plan: Plan) -> ManifestRecord:
        return record(self.manifest, plan.mounts, owner=self.owner)

    def services(self, sandbox_id: str, *, state_dir: str, image_user: bool) -> ServicesRecord | None:
        return services(self.manifest, sandbox_id=sandbox_id, state_dir=state_dir, image_user=image_user)


def admit_assignment(
    path: str, *, forbidden: Sequence[str], images_admitted: bool, repository: str, publish: bool = False
) -> Assignment:
    """The whole manifest check at create: ManifestError (2), LeaseExpiredError or PolicyError (3).
    `images_admitted`: whether the backend honours service images; `publish`: whether the
    profile lets it publish ports."""
    data, info = mf.read_assignment(path)
    checked = mf.parse(data, file=path)
    mf.check_sources(checked, owner=info.st_uid, forbidden=forbidden)
    mf.check_live(checked)
    admit(checked, images_admitted=images_admitted, repository=repository, broker_uid=os.geteuid(), publish=publish)
    project_env = None
    capabilities: dict[str, bytes] = {}
    for lease in checked.leases:
        if lease.scope == mf.PROJECT_ENVIRONMENT:
            project_env = mf.read_material(checked, lease, 0, owner=info.st_uid)
        elif lease.scope == mf.TOOL_REQUEST:
            capabilities[lease.lease_id] = mf.read_material(checked, lease, 0, owner=info.st_uid)
    return Assignment(manifest=checked, owner=info.st_uid, project_env=project_env, capabilities=capabilities)


def admit(
    manifest: mf.Manifest, *, images_admitted: bool, repository: str, broker_uid: int, publish: bool = False
) -> None:
    """What this broker refuses of a valid manifest for this profile (PolicyError, exit 3).
    `publish`: the profile says network.publish: loopback."""
    file = manifest.file
    if os.path.realpath(manifest.repository_path) != os.path.realpath(repository):
        raise PolicyError(f"{file}: repository.path: is not the profile's workspace repository")
    _admit_ports(manifest, publish=publish)
    if manifest.service_images and not images_admitted:
        raise PolicyError(f"{file}: service_images: images need the Docker backend")
    clash = mf.targets_apart(manifest)
    if clash is not None:
        raise PolicyError(f"{file}: {clash}: mount targets must not be equal or nested")
    for lease in manifest.by_scope(mf.PROVIDER_CREDENTIAL):
        target = str(lease.materializations[0].target_path)
        if any(target == t or target.startswith(t + "/") for t in mf.RESERVED_TARGETS):
            raise PolicyError(
                f"{file}: {lease.field}.materializations[0].target_path: "
                "this broker never mounts a lease over a path the sandbox itself mounts (/usr, /proc, /etc/passwd, ...)"
            )
    uid = manifest.workspace_consumer[0] if manifest.workspace_consumer else SANDBOX_UID
    if manifest.workspace_consumer is not None and uid == broker_uid:
        raise PolicyError(f"{file}: workspace_consumer.uid: must differ from the broker's own uid")
    for lease in manifest.by_scope(mf.TOOL_REQUEST):
        if lease.consumer_uid != uid:
            raise PolicyError(f"{file}: {lease.field}.consumer_uid: is not the sandbox user's uid ({uid})")
        if broker_uid != 0:
            raise PolicyError(
                f"{file}: {lease.field}: a request spool needs a root broker (its files must not be the consumer's)"
            )


def _admit_ports(manifest: mf.Manifest, *, publish: bool) -> None:
    """published_ports: only with the profile's consent, at most MAX_PUBLISHED_PORTS, none privileged,
    never onto the egress proxy's port inside (every local account could use the sandbox's
    allowance and its credential routes through it)."""
    file = manifest.file
    if manifest.published_ports and not publish:
        raise PolicyError(
            f"{file}: published_ports: the profile does not publish ports",
            hint="the owner allows it with network.publish: loopback in the profile",
        )
    if len(manifest.published_ports) > MAX_PUBLISHED_PORTS:
        raise PolicyError(f"{file}: published_ports: at most {MAX_PUBLISHED_PORTS} ports are published per sandbox")
    for index, (host, runtime) in enumerate(manifest.published_ports):
        if host < MIN_PUBLISHED_PORT:
            raise PolicyError(f"{file}: published_ports[{index}].host: must be {MIN_PUBLISHED_PORT} or above")
        if runtime == EGRESS_PORT:
            field = f"published_ports[{index}].runtime"
            raise PolicyError(f"{file}: {field}: {EGRESS_PORT} is the sandbox's egress proxy, never published")


def service_image(manifest: mf.Manifest, name: str = APP_SERVICE) -> str | None:
    """The sandbox image a manifest assigns (Docker), if any."""
    return dict(manifest.service_images).get(name)


def services(manifest: mf.Manifest, *, sandbox_id: str, state_dir: str, image_user: bool) -> ServicesRecord | None:
    """A Docker sandbox's service containers as planned (backends/docker/services.py): every
    service_images entry but APP_SERVICE is a sidecar on a network of the sandbox's own (named by
    its id and its broker's state dir: two brokers' sandboxes never share one), and its published
    ports go through port proxies of port_proxy_image; None without service_images."""
    if not manifest.service_images:
        return None
    sidecars = tuple(
        ServiceRecord(name=name, image=image) for name, image in manifest.service_images if name != APP_SERVICE
    )
    digest = hashlib.sha256(state_dir.encode()).hexdigest()[:8]
    return ServicesRecord(
        network=f"sandboxer-{digest}-{sandbox_id}" if sidecars else None,
        image_user=image_user,
        sidecars=sidecars,
        proxy_image=manifest.port_proxy_image if manifest.published_ports else None,
    )


def grants(manifest: mf.Manifest, *, spool_place: SpoolPlace, project_env: bytes | None) -> Grants:
    """The plan's share of the manifest: user, lease mounts in document order, project variables;
    each spool where `spool_place` puts it."""
    suppressed = manifest.linked_endpoints()
    directory = mf.run_dir(manifest)
    mounts: list[Mount] = []
    env: tuple[tuple[str, str], ...] = ()
    for lease in manifest.leases:
        if lease.scope in (mf.SHARED_DIRECTORY, mf.TOOL_ENDPOINT, mf.PROVIDER_CREDENTIAL):
            if lease.lease_id in suppressed:
                continue
            item = lease.materializations[0]
            mounts.append(
                Mount(
                    kind=MountKind.RO_BIND,
                    target=str(item.target_path),
                    source=item.source_path,
                    lease=lease.lease_id,
                    beneath=directory,
                )
            )
        elif lease.scope == mf.PROJECT_ENVIRONMENT and project_env is not None:
            mounts.append(
                Mount(
                    kind=MountKind.FILE,
                    target=mf.PROJECT_ENV_TARGET,
                    content=project_env,
                    mode=0o444,
                    lease=lease.lease_id,
                )
            )
            env = tuple(mf.project_variables(project_env))
        elif lease.scope == mf.TOOL_REQUEST:
            source, beneath = spool_place(spool_name(manifest.run_id, lease.lease_id))
            mounts.append(
                Mount(
                    kind=MountKind.SPOOL,
                    target=str(lease.request_spool_target),
                    source=source,
                    lease=lease.lease_id,
                    beneath=beneath,
                )
            )
    uid, gid = manifest.workspace_consumer or (SANDBOX_UID, SANDBOX_GID)
    return Grants(uid=uid, gid=gid, mounts=tuple(mounts), env=env)


def binding(manifest: mf.Manifest, lease: mf.Lease) -> dict[str, Any]:
    """The spool's `.binding.json`: the non-secret facts of the signed lease."""
    spool = str(lease.request_spool_target)
    return {
        "version": "1",
        "run_id": manifest.run_id,
        "lease_id": lease.lease_id,
        "consumer": lease.consumer,
        "consumer_uid": lease.consumer_uid,
        "request_dir": f"{spool}/requests",
        "response_dir": f"{spool}/responses",
        "request_file": "<request_id>.json (write a temporary file of mode 0600, then rename it)",
        "quotas": {
            "pending_files": SPOOL_PENDING_FILES,
            "request_bytes": SPOOL_REQUEST_BYTES,
            "total_bytes": SPOOL_TOTAL_BYTES,
        },
        "replay_policy": lease.replay_policy,
    }


def record(manifest: mf.Manifest, plan_mounts: tuple[Mount, ...], *, owner: int) -> ManifestRecord:
    """What the registry keeps of the manifest: ids, expiries, targets, paths and digests the
    broker checks again later; never a value or a capability."""
    info = os.lstat(mf.run_dir(manifest))
    return ManifestRecord(
        file=manifest.file,
        sha256=manifest.sha256,
        owner_uid=owner,
        run_dir=mf.run_dir(manifest),
        run_dir_identity=(info.st_dev, info.st_ino),
        version=manifest.version,
        run_id=manifest.run_id,
        published=tuple(manifest.published_ports),
        task_branch=manifest.task_branch,
        revision=manifest.repository_revision,
        expiries=tuple(
            (lease.lease_id, lease.expires_at.timestamp())
            for lease in manifest.leases
            if lease.expires_at is not None and mf.expiry_checked(manifest, lease)
        ),
        leases=tuple(
            LeaseRecord(
                lease_id=lease.lease_id,
                scope=lease.scope,
                consumer=lease.consumer,
                expires_at=None if lease.expires_at is None else lease.expires_at.isoformat(),
            )
            for lease in manifest.leases
        ),
        mounts=tuple(
            LeaseMount(lease_id=m.lease, target=m.target, kind=m.kind.value, source=m.source)
            for m in plan_mounts
            if m.lease is not None
        ),
        spools=tuple(
            Spool(lease_id=str(m.lease), target=m.target, source=str(m.source))
            for m in plan_mounts
            if m.kind is MountKind.SPOOL
        ),
        materializations=tuple(item.source_path for lease in manifest.leases for item in lease.materializations),
    )


def expired(manifest_record: ManifestRecord, now: float) -> str | None:
    """The id of a lease whose expiry has passed, if any."""
    for lease_id, moment in manifest_record.expiries:
        if moment <= now:
            return lease_id
    return None


def provider_environment(
    manifest_record: ManifestRecord, *, consumer: str, executable: str, caller_env: dict[str, str]
) -> dict[str, str]:
    """The whole environment of a provider launch, or PolicyError: the fixed PATH, the private
    state directories, the lease's inherited names from the caller, and the consumer's
    provider-environment values read now (their digests recomputed from these bytes)."""
    file = manifest_record.file
    checked = mf.load(file, forbidden=())
    if checked.sha256 != manifest_record.sha256:
        raise PolicyError(f"{file}: the manifest changed since the sandbox was created")
    identities = [
        lease
        for lease in checked.by_scope(mf.MODEL_IDENTITY)
        if lease.consumer == consumer and lease.executable == executable
    ]
    if len(identities) != 1:
        raise PolicyError(f"no live model-identity lease grants consumer {consumer} the executable {executable}")
    env = {"PATH": SAFE_PATH}
    env.update({name: f"{STATE_ROOT}/{sub}" for name, sub in STATE_DIRS})
    for name in identities[0].inherited_environment:
        if name not in caller_env:
            raise PolicyError(
                f"{identities[0].field}.inherited_environment: {name} is not set in the caller's environment"
            )
        env[name] = caller_env[name]
    owner = manifest_record.owner_uid
    for lease in checked.by_scope(mf.PROVIDER_ENVIRONMENT):
        if lease.consumer != consumer:
            continue
        for index, item in enumerate(lease.materializations):
            data = mf.read_material(checked, lease, index, owner=owner)
            env[str(item.environment_name)] = data.decode("utf-8")
    return env
