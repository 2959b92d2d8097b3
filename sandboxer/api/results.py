"""What the core returns: frozen dataclasses, one per JSON document the CLI prints with `--json`.

One type is one JSON shape: `to_json()` renders it (the CLI's `--json`, the service's response
body), `from_json()` parses it back (the HTTP client), and `json_schema()` describes it (the
service's OpenAPI document, sandboxer.service.openapi). All three come from the type's fields
through pydantic's TypeAdapter, so they cannot drift apart. Parts that differ by backend or are
open-ended (inspect's backend sections, a manifest's leases) are read-only mappings (`frozen`
makes one); `thawed` turns one back into plain dicts and lists.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import ClassVar, Literal, Protocol

# Re-exported: the front ends take every result type, and the JSON form's helpers, from here.
from sandboxer.api.jsonresult import JsonObject as JsonObject  # noqa: PLC0414
from sandboxer.api.jsonresult import JsonResult as JsonResult  # noqa: PLC0414
from sandboxer.api.jsonresult import frozen as frozen  # noqa: PLC0414
from sandboxer.api.jsonresult import thawed as thawed  # noqa: PLC0414
from sandboxer.api.usage_results import Lifetime as Lifetime  # noqa: PLC0414
from sandboxer.api.usage_results import Usage as Usage  # noqa: PLC0414
from sandboxer.api.usage_results import WorkSummary as WorkSummary  # noqa: PLC0414

Stream = Literal["stdout", "stderr"]


class OutputStream(Protocol):
    """An exec's output as it arrives: ("stdout" | "stderr", bytes); `.status` once it ended;
    `signal(signum)` for its command while it runs (False when it does not)."""

    status: int | None

    def __iter__(self) -> Iterator[tuple[Stream, bytes]]: ...

    def signal(self, signum: int) -> bool: ...


@dataclass(frozen=True, slots=True)
class ExecResult:
    """How one exec ended: its exit status (the CLI's, 124 on timeout, 125 a broker failure,
    128+N for signal N) and everything it wrote. (Not a JSON document: exec's output is bytes.)"""

    status: int
    stdout: bytes
    stderr: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class ManifestSummary(JsonResult):
    run_id: str
    leases: int


@dataclass(frozen=True, slots=True, kw_only=True)
class BootstrapSummary(JsonResult):
    target: str
    suspend_control: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Created(JsonResult):
    """What `create --json` reports of a new sandbox (`expires_at`: when a service tears it down,
    for a sandbox with a lifetime)."""

    _absent_when_none: ClassVar[tuple[str, ...]] = ("expires_at", "manifest", "bootstrap")

    id: str
    profile: str
    backend: str
    runtime_sha256: str
    workspace: str
    limits: str | None  # the mechanism: "cgroup-v1", "cgroup-v2", "rlimits", "docker"
    expires_at: str | None = None
    manifest: ManifestSummary | None = None
    bootstrap: BootstrapSummary | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class MountEvidence(JsonResult):
    target: str
    read_only: bool
    fstype: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Evidence(JsonResult):
    """What `inspect --json` observes of a live sandbox, against its plan. A backend's own
    sections (a container's `docker`) are `sections`; in the document they are top-level keys."""

    _sections_field: ClassVar[str | None] = "sections"

    id: str
    profile: str
    backend: str
    status: str
    matches_plan: bool
    differences: tuple[str, ...]
    runtime: JsonObject
    mounts: tuple[MountEvidence, ...]
    user: JsonObject
    capabilities: JsonObject
    seccomp: JsonObject
    env_names: tuple[str, ...]
    limits: JsonObject
    network: JsonObject = field(default_factory=lambda: MappingProxyType({}))
    leases: JsonObject | None = None
    usage: Usage | None = None
    sections: JsonObject = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True, slots=True, kw_only=True)
class Receipt(JsonResult):
    """What a teardown (or gc, for one sandbox) removed, and what it could not."""

    id: str
    removed: tuple[str, ...]
    residue: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Exported(JsonResult):
    """What an export took out (export --json): the new commits (a bundle, a patch series) or
    the working tree (a tar), written at `destination`."""

    id: str
    format: Literal["bundle", "patch", "tar"]
    destination: str | None
    files: tuple[str, ...]  # the patch series' file names; the one file otherwise
    head: str  # the sandbox's HEAD commit
    branch: str | None  # its branch (None: a detached HEAD)
    base: str  # the commit create checked out
    ref: str  # what that was made from (the profile's ref, a manifest's revision)
    ahead: int | None  # commits on HEAD since `base` (None: `base` is gone from its history)
    dirty: bool  # the working tree has changes not committed


@dataclass(frozen=True, slots=True, kw_only=True)
class KeptExport(JsonResult):
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


@dataclass(frozen=True, slots=True, kw_only=True)
class NetworkAccess(JsonResult):
    """One connection through a sandbox's egress proxy, as its access report has it (never a
    header value, a body or a secret)."""

    time: str  # RFC 3339, UTC
    host: str
    port: int
    decision: Literal["allowed", "refused"]
    reason: str
    route: str | None
    sent: int  # bytes from the sandbox
    received: int  # bytes to it
    count: int = 1  # refusals this line stands for (repeats within a second are counted, not listed)


@dataclass(frozen=True, slots=True, kw_only=True)
class NetworkLog(JsonResult):
    """`logs ID --network --json`: the sandbox's egress decisions, oldest first."""

    id: str
    entries: tuple[NetworkAccess, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class KeptExports(JsonResult):
    """`exports --json`."""

    exports: tuple[KeptExport, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class KeptExportFetched(JsonResult):
    """`exports get --json`: which kept file was written where."""

    id: str
    format: Literal["bundle", "tar"]
    destination: str


@dataclass(frozen=True, slots=True, kw_only=True)
class KeptExportRemoved(JsonResult):
    """`exports rm --json`: the files the kept export held."""

    id: str
    removed: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class SandboxInfo(JsonResult):
    """One line of `list`: the sandbox, whose it is (`caller`: the account it was made for; the
    broker's own for an owner's), how old it is and how long it has left (seconds; None: no end
    set), and its work as its git reports it (None: not running, or it could not be checked)."""

    id: str
    profile: str | None
    backend: str | None
    status: str  # running, dead, creating, tearing-down, failed, unknown
    created_at: str | None
    expires_at: str | None = None  # when the service tears it down (create --ttl, extend)
    caller_uid: int | None = None
    caller: str | None = None  # caller_uid's account name
    age_seconds: int | None = None
    seconds_left: int | None = None
    work: WorkSummary | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SandboxList(JsonResult):
    """`list --json`."""

    sandboxes: tuple[SandboxInfo, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class GcReport(JsonResult):
    """What `gc` did: the sandboxes it collected, and those it left (healthy, busy, warm); the
    quarantines of exports whose exporter died, which it removed (`exports`)."""

    collected: tuple[Receipt, ...]
    healthy: tuple[str, ...]
    busy: tuple[str, ...]
    warm: tuple[str, ...]
    exports: tuple[str, ...] = ()


OwnerKind = Literal["extension", "profile", "grants"]


@dataclass(frozen=True, slots=True, kw_only=True)
class OwnerCheck(JsonResult):
    """`ext check --json`: a valid owner file, its digest and what it means (`meaning`: shaped like
    the file, defaults filled in; in the document, top-level keys after `kind`)."""

    _sections_field: ClassVar[str | None] = "meaning"

    file: str
    sha256: str
    valid: bool = True
    kind: OwnerKind
    meaning: JsonObject = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True, slots=True, kw_only=True)
class OwnerEntry(JsonResult):
    """One owner file (or an approval whose file is gone), as `ext list` shows it."""

    name: str
    kind: OwnerKind
    file: str | None
    valid: bool
    problem: str | None
    present: bool
    sha256: str | None
    approved_sha256: str | None
    status: str  # approved, unapproved, changed


@dataclass(frozen=True, slots=True, kw_only=True)
class OwnerListing(JsonResult):
    """`ext list --json`."""

    config_dir: str
    entries: tuple[OwnerEntry, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Approval(JsonResult):
    """The ledger's answer to `ext approve` or `ext revoke`."""

    name: str
    file: str
    status: str
    sha256: str | None = None
    revoked: bool | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeDigest(JsonResult):
    """`runtime digest`: the tree digest v1 of a runtime directory and what computing it took."""

    path: str
    format: str = "tree-digest-v1"
    sha256: str
    full: bool
    entries: int
    files: int
    bytes: int
    bytes_read: int
    reused: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimePin(JsonResult):
    """`runtime pin`: the extension config whose config.runtime now pins `path` at `sha256`, and
    where its approval stands (`status`: approved only when the file did not change)."""

    extension: str
    file: str
    path: str
    sha256: str
    status: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Dispatched(JsonResult):
    """What `dispatch-tool --json` reports of one relayed request: where its response is inside the
    sandbox, and whether it came from the replay ledger (`cached`) rather than the endpoint."""

    status: Literal["dispatched"] = "dispatched"
    sandbox: str
    lease_id: str
    request_id: str
    fingerprint: str
    cached: bool
    attempts: int
    response: str  # the response file's path inside the sandbox


@dataclass(frozen=True, slots=True, kw_only=True)
class WarmFill(JsonResult):
    """`warm --json`: the profile's warm sandboxes after a fill, and what it started and removed
    (`busy`: another fill was running, so this one did nothing)."""

    profile: str
    warm: int
    started: tuple[str, ...]
    removed: tuple[str, ...]
    busy: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class GrantedProfile(JsonResult):
    name: str
    max_sandboxes: int | None
    max_ttl_seconds: int | None
    status: str  # the profile's approval now: approved, unapproved, changed, missing


@dataclass(frozen=True, slots=True, kw_only=True)
class CallerView(JsonResult):
    """`GET /v1/me`: what the calling account may do — an owner everything; a granted caller its
    profiles, with its live sandboxes (`live`)."""

    uid: int
    owner: bool
    live: int | None
    profiles: tuple[GrantedProfile, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class ExportNoted(JsonResult):
    """The service's answer to an export's confirmation: whether the record noted it."""

    id: str
    noted: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Signalled(JsonResult):
    """The service's answer to a running exec's signal: the signal it passed on."""

    signal: str  # SIGINT, SIGTERM or SIGHUP


@dataclass(frozen=True, slots=True, kw_only=True)
class Version(JsonResult):
    """`GET /v1/version`."""

    version: str
    api: str
