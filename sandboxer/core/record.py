"""A sandbox's record (`<state>/sandboxes/ID/record.json`): its typed form and its JSON form.

The record is the registry's truth about a sandbox: what create made, what exec enters, what
inspect compares and teardown removes. `SandboxRecord` is frozen: a step of create returns a new
record (`dataclasses.replace`) that the registry then writes. Its JSON form is written and read
here (`SandboxRecord.to_json`) and read back in sandboxer.core.record_reading (`read_record`), which
refuses as a whole (RecordShapeError) a record that does not have the shape below, never
half-reading it; nothing else reads a record by its keys.

A record grows while a create runs: `creating` with only its identity, then the workspace's
filesystem, the manifest's share, the engine's part (limits, processes or container, the plan
it verified) — so everything past the identity is optional, and gc can read a record a crash cut
short. exec reads the few fields it needs through sandboxer.core.record_exec, which a test holds
to this module's reading.

Record format 1 (the `format` key); a record of any other format is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sandboxer.core.config_types import DEFAULT_WORKSPACE_MIB, Limits
from sandboxer.core.plan import Backend, Mount, MountKind, Plan

RECORD_FORMAT = 1


class RecordShapeError(ValueError):
    """A record (or a part of it) that is not what this module writes: `path` names the field."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.path = path


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanShare:
    """The plan as the record keeps it: who the sandbox user is, its environment, runtime and
    mounts (a FILE mount's content is not kept)."""

    uid: int
    gid: int
    host_uid: int
    host_gid: int
    env: tuple[tuple[str, str], ...]
    runtime_path: str
    runtime_sha256: str
    allow_ptrace: bool
    mounts: tuple[Mount, ...]
    caller_env: tuple[str, ...] = ()  # names exec --env may set (the profile's exec.caller_env)

    @classmethod
    def of(cls, plan: Plan) -> PlanShare:
        return cls(
            uid=plan.uid,
            gid=plan.gid,
            host_uid=plan.host_uid,
            host_gid=plan.host_gid,
            env=plan.env,
            runtime_path=plan.runtime_path,
            runtime_sha256=plan.runtime_sha256,
            allow_ptrace=plan.allow_ptrace,
            mounts=tuple(Mount(**{**_mount_fields(m), "content": kept_content(m.kind)}) for m in plan.mounts),
            caller_env=plan.caller_env,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class LimitsRecord:
    """How the sandbox's limits are enforced ("cgroup-v1", "cgroup-v2", "rlimits", "docker"),
    what holds them (cgroup directories, the files a new process joins them by, rlimits), and the
    limits themselves."""

    mechanism: str
    groups: tuple[str, ...] = ()
    procs_files: tuple[str, ...] = ()
    rlimits: tuple[tuple[int, int], ...] = ()
    memory_mib: int
    pids: int
    cpus: float | None = None  # the CPU quota in cores (None: none)


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkspaceFs:
    """The workspace's own filesystem: its size, whether the size is enforced, its kind
    ("ext4" image, "tmpfs"; None for a warm container's)."""

    mib: int
    enforced: bool
    kind: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SeccompRecord:
    """The syscall policy: the compiled program's sha256 (bwrap; Docker's is computed by inspect)
    and whether the profile allows ptrace."""

    allow_ptrace: bool
    sha256: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Processes:
    """A bwrap sandbox's host processes, each pid with its start time (against pid reuse), and
    its pid namespace's inode."""

    bwrap_pid: int | None
    bwrap_start: int | None
    init_pid: int | None
    init_start: int | None
    holder_pid: int | None
    holder_start: int | None
    pid_namespace: int | None


APP_SERVICE = "app"  # service_images' name for the sandbox itself; every other entry is a sidecar


@dataclass(frozen=True, slots=True, kw_only=True)
class ServiceRecord:
    """One service container of a Docker sandbox (a sidecar, service_images), once started."""

    name: str  # its service name: its name on the sandbox's network
    image: str  # the manifest's immutable reference
    container_id: str | None = None
    address: str | None = None  # its IPv4 address on the sandbox's network


@dataclass(frozen=True, slots=True, kw_only=True)
class ServicesRecord:
    """A Docker sandbox's service containers (docs/services.md): its internal network, the
    sidecars on it, and the port proxies that publish its ports from `proxy_image`."""

    network: str | None  # the per-sandbox internal network's name (None: no sidecars)
    image_user: bool  # the owner lets each sidecar run as its image's own user (config.service_user)
    sidecars: tuple[ServiceRecord, ...]
    proxy_image: str | None = None
    proxies: tuple[tuple[int, str], ...] = ()  # (port inside, container id) of each port proxy
    proxy_sockets: str | None = None  # the host directory of the port proxies' Unix sockets


@dataclass(frozen=True, slots=True, kw_only=True)
class WarmStamp:
    """What a warm sandbox was made from and what it showed when it started (warmpool)."""

    profile_sha256: str
    extension_sha256: str
    image: str
    body_sha256: str  # the backend's warm_fingerprint of its plan
    probe: dict[str, Any]  # what its probe saw (observe.ProbeSeen.fields)
    interfaces: tuple[str, ...]
    # Its long-lived process: Docker's pid 1 and the Engine's StartedAt; bwrap's holder and its
    # start time (clock ticks since boot, as text).
    pid: int | None
    started_at: str | None
    since: int  # Docker: the second the Engine's exec history is asked from; bwrap: 0 (unused)
    workspace_refs: str = ""  # workspace.refs_digest of the repository its workspace was cloned from


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkRecord:
    """The workspace's Git history as create made it, and what of the sandbox's work has been
    exported since: `base`, the commit checked out (new commits are counted from it); `ref`,
    what it was made from (the profile's ref, a manifest's revision); `repository`, the profile's
    (a bundle's prerequisite commits are verified against it); `exported`, what each export
    took out, oldest first: ("commits", head) for a bundle or a patch series, ("tree", tree id)
    for a tar — teardown loses nothing that one of them covers (sandboxer.commands.work)."""

    base: str
    ref: str
    repository: str
    exported: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class BootstrapRecord:
    """The runtime bootstrap delivered at create: where, and whether it has suspend control."""

    target: str
    suspend_control: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseRecord:
    lease_id: str
    scope: str
    consumer: str | None
    expires_at: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseMount:
    lease_id: str
    target: str
    kind: str
    source: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Spool:
    lease_id: str
    target: str
    source: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ManifestRecord:
    """What the registry keeps of a lease manifest: ids, expiries, targets, paths and digests the
    broker checks again later; never a value or a capability."""

    file: str
    sha256: str
    owner_uid: int
    run_dir: str
    run_dir_identity: tuple[int, int]  # (st_dev, st_ino) of the run directory create saw
    version: str
    run_id: str
    task_branch: str
    revision: str
    expiries: tuple[tuple[str, float], ...]  # (lease id, POSIX time) of each checked expiry
    leases: tuple[LeaseRecord, ...]
    mounts: tuple[LeaseMount, ...]
    spools: tuple[Spool, ...]
    materializations: tuple[str, ...]
    published: tuple[tuple[int, int], ...] = ()  # published_ports: (host port on 127.0.0.1, port inside)


@dataclass(frozen=True, slots=True, kw_only=True)
class SandboxRecord:
    """Everything the registry knows of one sandbox."""

    id: str
    profile: str
    backend: Backend
    state: str  # creating, ready, tearing-down, failed; warming, warm (warmpool)
    created_at: str
    owner_pid: int | None = None  # the broker process that created it, with its start time
    owner_start: int | None = None
    caller_uid: int | None = None  # the account a service created it for (None: the broker's own)
    expires_at: float | None = None  # POSIX time its lifetime ends (create --ttl): the service tears it down
    max_expires_at: float | None = None  # the latest `extend` may set: its profile's lifetime.max_seconds
    idle_seconds: int | None = None  # its profile's lifetime.idle_seconds: the service tears it down unused
    warm_profile: bool = False  # its teardown tops the profile's warm sandboxes up
    consumed: bool = False  # torn down after its assignment was used: materializations go too
    workspace_fs: WorkspaceFs | None = None
    work: WorkRecord | None = None
    manifest: ManifestRecord | None = None
    bootstrap: BootstrapRecord | None = None
    limits: LimitsRecord | None = None
    seccomp: SeccompRecord | None = None
    plan: PlanShare | None = None
    processes: Processes | None = None  # bwrap
    image: str | None = None  # Docker
    container_id: str | None = None  # Docker
    services: ServicesRecord | None = None  # Docker: service containers (service_images)
    warm: WarmStamp | None = None  # a warm container's stamp (warmpool)

    @property
    def hidden(self) -> bool:
        """A warm sandbox: started ahead, not yet any caller's."""
        return self.state in HIDDEN_STATES

    def to_json(self) -> dict[str, Any]:
        """The JSON form (record.json), plan and processes flattened into the top level."""
        data: dict[str, Any] = {
            "format": RECORD_FORMAT,
            "id": self.id,
            "profile": self.profile,
            "backend": self.backend,
            "state": self.state,
            "created_at": self.created_at,
            "owner_pid": self.owner_pid,
            "owner_start": self.owner_start,
            "warm_profile": self.warm_profile,
        }
        if self.caller_uid is not None:
            data["caller_uid"] = self.caller_uid
        if self.expires_at is not None:
            data["expires_at"] = self.expires_at
        if self.max_expires_at is not None:
            data["max_expires_at"] = self.max_expires_at
        if self.idle_seconds is not None:
            data["idle_seconds"] = self.idle_seconds
        if self.consumed:
            data["consumed"] = True
        for name, part in (
            ("workspace_fs", self.workspace_fs),
            ("work", self.work),
            ("manifest", self.manifest),
            ("bootstrap", self.bootstrap),
            ("limits", self.limits),
            ("seccomp", self.seccomp),
            ("warm", self.warm),
            ("services", self.services),
        ):
            if part is not None:
                data[name] = _plain(part)
        if self.image is not None:
            data["image"] = self.image
        if self.container_id is not None:
            data["container_id"] = self.container_id
        if self.processes is not None:
            data.update(_plain(self.processes))
        if self.plan is not None:
            share = _plain(self.plan)
            if not share["caller_env"]:
                del share["caller_env"]  # as records before exec.caller_env were: older brokers read them
            share["mounts"] = [_mount_json(m) for m in self.plan.mounts]
            data.update(share)
        return data

    def plan_for(self, workspace_source: str) -> Plan:
        """The plan the sandbox was made from, as its record keeps it (what verification
        compares); RecordShapeError when the record has no plan yet."""

        if self.plan is None or self.limits is None:
            raise RecordShapeError("plan")
        share = self.plan
        return Plan(
            sandbox_id=self.id,
            profile=self.profile,
            backend=self.backend,
            runtime_path=share.runtime_path,
            runtime_sha256=share.runtime_sha256,
            workspace_source=workspace_source,
            uid=share.uid,
            gid=share.gid,
            host_uid=share.host_uid,
            host_gid=share.host_gid,
            user="sandbox",
            hostname="sandbox",
            mounts=share.mounts,
            env=share.env,
            limits=Limits(
                memory_mib=self.limits.memory_mib,
                pids=self.limits.pids,
                workspace_mib=self.workspace_fs.mib if self.workspace_fs else DEFAULT_WORKSPACE_MIB,
                cpus=self.limits.cpus,
            ),
            allow_ptrace=share.allow_ptrace,
        )


HIDDEN_STATES = ("warming", "warm")  # started ahead, not yet any caller's sandbox


def expiry_text(moment: float) -> str:
    """A lifetime's end as list and create show it: UTC, to the second."""

    return datetime.fromtimestamp(moment, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_text() -> str:
    """A record's time stamp: UTC, to the second (`created_at`)."""

    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def kept_content(kind: MountKind) -> bytes | None:
    """What the record keeps of a mount's content: nothing (a FILE's is b"", others' None)."""
    return b"" if kind is MountKind.FILE else None


def _mount_fields(mount: Mount) -> dict[str, Any]:
    return {
        "kind": mount.kind,
        "target": mount.target,
        "source": mount.source,
        "mode": mount.mode,
        "size_bytes": mount.size_bytes,
        "lease": mount.lease,
        "beneath": mount.beneath,
    }


def _mount_json(mount: Mount) -> dict[str, Any]:
    return {
        "target": mount.target,
        "kind": mount.kind.value,
        "source": mount.source,
        "read_only": mount.read_only,
        "mode": mount.mode,
        "size_bytes": mount.size_bytes,
        "lease": mount.lease,
        "beneath": mount.beneath,
    }


def _plain(value: Any) -> Any:
    """A record part as JSON: dataclasses as objects (their fields in order), tuples as lists."""
    if hasattr(value, "__dataclass_fields__"):
        return {name: _plain(getattr(value, name)) for name in value.__dataclass_fields__}
    if isinstance(value, tuple | list):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value
