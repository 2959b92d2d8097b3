"""What the Python API returns: frozen dataclasses, each built from the JSON form the CLI prints.

The CLI's `--json` documents are the contract (docs/cli.md); these types give programs the same
fields as attributes. Where a document has parts that differ by backend or are open-ended (a
Docker sandbox's `docker` section, a manifest's leases), the part is kept as a read-only
mapping, and `json` always holds the whole document as the CLI would print it (`thawed`
turns either back into plain dicts and lists).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, Protocol

Stream = Literal["stdout", "stderr"]


class OutputStream(Protocol):
    """An exec's output as it arrives: ("stdout" | "stderr", bytes); `.status` once it ended;
    `signal(signum)` for its command while it runs (False when it does not)."""

    status: int | None

    def __iter__(self) -> Iterator[tuple[Stream, bytes]]: ...

    def signal(self, signum: int) -> bool: ...


def _frozen(value: Any) -> Any:
    """A read-only view of a JSON value: mappings become mappingproxies, lists tuples."""
    if isinstance(value, dict):
        return MappingProxyType({key: _frozen(item) for key, item in value.items()})
    if isinstance(value, list):
        return tuple(_frozen(item) for item in value)
    return value


def thawed(value: Any) -> Any:
    """A result's read-only part as plain JSON values again (dicts and lists), e.g. to dump it."""
    if isinstance(value, Mapping):
        return {key: thawed(item) for key, item in value.items()}
    if isinstance(value, tuple):
        return [thawed(item) for item in value]
    return value


@dataclass(frozen=True, slots=True)
class ExecResult:
    """How one exec ended: its exit status (the CLI's, 124 on timeout, 125 a broker failure,
    128+N for signal N) and everything it wrote."""

    status: int
    stdout: bytes
    stderr: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class Created:
    """What `create --json` reports of a new sandbox."""

    id: str
    profile: str
    backend: str
    runtime_sha256: str
    workspace: str
    limits: str  # the mechanism: "cgroup-v1", "cgroup-v2", "rlimits", "docker"
    manifest: Mapping[str, Any] | None = None
    bootstrap: Mapping[str, Any] | None = None
    json: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, document: Mapping[str, Any]) -> Created:
        return cls(
            id=document["id"],
            profile=document["profile"],
            backend=document["backend"],
            runtime_sha256=document["runtime_sha256"],
            workspace=document["workspace"],
            limits=document["limits"],
            manifest=_frozen(document.get("manifest")),
            bootstrap=_frozen(document.get("bootstrap")),
            json=_frozen(dict(document)),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class MountEvidence:
    target: str
    read_only: bool
    fstype: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Evidence:
    """What `inspect --json` observes of a live sandbox, against its plan."""

    id: str
    profile: str
    backend: str
    status: str
    matches_plan: bool
    differences: tuple[str, ...]
    runtime: Mapping[str, Any]
    mounts: tuple[MountEvidence, ...]
    user: Mapping[str, Any]
    capabilities: Mapping[str, Any]
    seccomp: Mapping[str, Any]
    env_names: tuple[str, ...]
    limits: Mapping[str, Any]
    network: Mapping[str, Any]
    leases: Mapping[str, Any] | None
    json: Mapping[str, Any] = field(repr=False)

    @classmethod
    def from_json(cls, document: Mapping[str, Any]) -> Evidence:
        return cls(
            id=document["id"],
            profile=document["profile"],
            backend=document["backend"],
            status=document["status"],
            matches_plan=bool(document["matches_plan"]),
            differences=tuple(document["differences"]),
            runtime=_frozen(document["runtime"]),
            mounts=tuple(
                MountEvidence(target=m["target"], read_only=m["read_only"], fstype=m["fstype"])
                for m in document["mounts"]
            ),
            user=_frozen(document["user"]),
            capabilities=_frozen(document["capabilities"]),
            seccomp=_frozen(document["seccomp"]),
            env_names=tuple(document["env_names"]),
            limits=_frozen(document["limits"]),
            network=_frozen(document.get("network") or {}),
            leases=_frozen(document.get("leases")),
            json=_frozen(dict(document)),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Receipt:
    """What a teardown (or gc, for one sandbox) removed, and what it could not."""

    id: str
    removed: tuple[str, ...]
    residue: tuple[str, ...]

    @classmethod
    def from_json(cls, document: Mapping[str, Any]) -> Receipt:
        return cls(id=document["id"], removed=tuple(document["removed"]), residue=tuple(document["residue"]))


@dataclass(frozen=True, slots=True, kw_only=True)
class Exported:
    """What an export took out (export --json): the new commits (a bundle, a patch series) or
    the working tree (a tar), written at `destination`."""

    id: str
    format: str  # bundle, patch, tar
    destination: str | None
    files: tuple[str, ...]  # the patch series' file names; the one file otherwise
    head: str  # the sandbox's HEAD commit
    branch: str | None  # its branch (None: a detached HEAD)
    base: str  # the commit create checked out
    ref: str  # what that was made from (the profile's ref, a manifest's revision)
    ahead: int | None  # commits on HEAD since `base` (None: `base` is gone from its history)
    dirty: bool  # the working tree has changes not committed

    @classmethod
    def from_json(cls, document: Mapping[str, Any]) -> Exported:
        return cls(
            id=document["id"],
            format=document["format"],
            destination=document.get("destination"),
            files=tuple(document["files"]),
            head=document["head"],
            branch=document.get("branch"),
            base=document["base"],
            ref=document["ref"],
            ahead=document.get("ahead"),
            dirty=bool(document["dirty"]),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class KeptExport:
    """One line of `exports`: the work the service's reaper kept of an expired sandbox (its id),
    the caller's to fetch (`format` "bundle": the commits; "tar": the changed tree) and remove."""

    id: str
    uid: int  # whose it is (counted against that caller's export budget)
    files: tuple[str, ...]  # work.bundle, tree.tar
    bytes: int | None
    kept_until: str | None  # when the service removes it
    directory: str  # where it is (the service's, owner-only)
    head: str | None
    branch: str | None
    base: str | None
    ref: str | None
    ahead: int | None
    dirty: bool | None

    @classmethod
    def from_json(cls, document: Mapping[str, Any]) -> KeptExport:
        return cls(
            id=document["id"],
            uid=int(document["uid"]),
            files=tuple(document["files"]),
            bytes=document.get("bytes"),
            kept_until=document.get("kept_until"),
            directory=document["directory"],
            head=document.get("head"),
            branch=document.get("branch"),
            base=document.get("base"),
            ref=document.get("ref"),
            ahead=document.get("ahead"),
            dirty=document.get("dirty"),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class SandboxInfo:
    """One line of `list`."""

    id: str
    profile: str | None
    backend: str | None
    status: str  # running, dead, creating, tearing-down, failed, unknown
    created_at: str | None
    expires_at: str | None = None  # when the service tears it down (create --ttl)

    @classmethod
    def from_json(cls, document: Mapping[str, Any]) -> SandboxInfo:
        return cls(
            id=document["id"],
            profile=document["profile"],
            backend=document["backend"],
            status=document["status"],
            created_at=document["created_at"],
            expires_at=document.get("expires_at"),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class GcReport:
    """What `gc` did: the sandboxes it collected, and those it left (healthy, busy, warm); the
    quarantines of exports whose exporter died, which it removed (`exports`)."""

    collected: tuple[Receipt, ...]
    healthy: tuple[str, ...]
    busy: tuple[str, ...]
    warm: tuple[str, ...]
    exports: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, document: Mapping[str, Any]) -> GcReport:
        return cls(
            collected=tuple(Receipt.from_json(item) for item in document["collected"]),
            healthy=tuple(document["healthy"]),
            busy=tuple(document["busy"]),
            warm=tuple(document["warm"]),
            exports=tuple(document.get("exports", ())),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class OwnerEntry:
    """One owner file (or an approval whose file is gone), as `ext list` shows it."""

    name: str
    kind: Literal["extension", "profile"]
    file: str | None
    valid: bool
    problem: str | None
    present: bool
    sha256: str | None
    approved_sha256: str | None
    status: str  # approved, unapproved, changed

    @classmethod
    def from_json(cls, document: Mapping[str, Any]) -> OwnerEntry:
        return cls(**{name: document[name] for name in cls.__dataclass_fields__})


@dataclass(frozen=True, slots=True, kw_only=True)
class Approval:
    """The ledger's answer to `ext approve` or `ext revoke`."""

    name: str
    file: str
    status: str
    sha256: str | None = None
    revoked: bool | None = None

    @classmethod
    def from_json(cls, document: Mapping[str, Any]) -> Approval:
        return cls(
            name=document["name"],
            file=document["file"],
            status=document["status"],
            sha256=document.get("sha256"),
            revoked=document.get("revoked"),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeDigest:
    """`runtime digest`: the tree digest v1 of a runtime directory and what computing it took."""

    path: str
    sha256: str
    full: bool
    entries: int
    files: int
    bytes: int
    bytes_read: int
    reused: int

    @classmethod
    def from_json(cls, document: Mapping[str, Any]) -> RuntimeDigest:
        return cls(**{name: document[name] for name in cls.__dataclass_fields__})


def owner_entries(document: Mapping[str, Any]) -> list[OwnerEntry]:
    """The entries of `ext list --json`'s document, in its order."""
    return [OwnerEntry.from_json(entry) for entry in document["entries"]]


@dataclass(frozen=True, slots=True, kw_only=True)
class Dispatched:
    """What `dispatch-tool --json` reports of one relayed request: where its response is inside the
    sandbox, and whether it came from the replay ledger (`cached`) rather than the endpoint."""

    sandbox: str
    lease_id: str
    request_id: str
    fingerprint: str
    cached: bool
    attempts: int
    response: str  # the response file's path inside the sandbox
    json: Mapping[str, Any] = field(repr=False)

    @classmethod
    def from_json(cls, document: Mapping[str, Any]) -> Dispatched:
        return cls(
            sandbox=document["sandbox"],
            lease_id=document["lease_id"],
            request_id=document["request_id"],
            fingerprint=document["fingerprint"],
            cached=bool(document["cached"]),
            attempts=int(document["attempts"]),
            response=document["response"],
            json=_frozen(dict(document)),
        )
