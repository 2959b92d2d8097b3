"""What an orchestrator watches of a live sandbox: what it uses (`usage`), what its work is
(`work`), and how long it has left (`extend`'s answer). Result types as sandboxer.api.results'
(one JSON shape each); `list` and `inspect` carry them too."""

from __future__ import annotations

from dataclasses import dataclass

from sandboxer.api.jsonresult import JsonResult


@dataclass(frozen=True, slots=True, kw_only=True)
class Usage(JsonResult):
    """What a live sandbox uses now (`sandboxer usage ID`, inspect's `usage`). Memory, processes
    and CPU time are its cgroups' counters (every process of the sandbox, gone ones' CPU time
    too), or under rlimits the sum over its processes now (`source` "processes": no peak).
    Space is what each of its filesystems holds; a workspace on the host's disk is walked, and
    `workspace_complete` is false when the walk stopped at its bound (the figure is a floor).
    None: not known here."""

    id: str
    source: str  # "cgroup" or "processes"
    memory_bytes: int | None
    memory_peak_bytes: int | None
    memory_limit_bytes: int
    pids: int | None
    pids_limit: int
    cpu_seconds: float | None
    cpus: float | None  # the CPU quota in cores (limits.cpus); None: none
    workspace_bytes: int | None
    workspace_complete: bool
    state_bytes: int | None
    tmp_bytes: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkSummary(JsonResult):
    """A sandbox's work as its git reports it now (`sandboxer work ID`, list's `work`): the commits
    on HEAD since create (`commits`; None when the base left HEAD's history), whether the tree
    has changes no commit holds (`dirty`), and what of it no export took out (`unexported`, as
    teardown would name it; empty: teardown loses nothing). `exported`: there is work and every
    part of it was exported as it is now."""

    id: str
    head: str
    branch: str | None
    commits: int | None
    dirty: bool
    exported: bool
    unexported: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Lifetime(JsonResult):
    """When a sandbox's lifetime ends (`sandboxer extend ID SECONDS`): `expires_at` (RFC 3339,
    UTC) and the seconds left; `max_expires_at`, the latest it may be extended to (the profile's
    lifetime.max_seconds, a granted caller's max_ttl_seconds, from its create; None: no bound)."""

    id: str
    expires_at: str
    seconds_left: int
    max_expires_at: str | None
