"""The interface the commands ask of an engine, in roles (`Admission`, `Lifecycle`, `Warming`,
`Spools`, `Collector`, and `Execution`, which runs a command in a live sandbox; `Backend` is all
of them), and what inspect gets from one (`Observed`). The implementations are
backends/bwrap/backend.py and backends/docker/backend.py; sandboxer.backends.backend_for picks
one. A caller that needs one role takes that role: the warm pool a `Warming`, lease removal and
dispatch-tool a `Spools`; exec, on its hot path, asks sandboxer.backends.execution_for for the
engine's `Execution` alone (backends/bwrap/enter.py, backends/docker/enter.py), which loads none
of its other code.

A backend returns what it made (the record with the engine's part) and what it removed
(`Removal`); it never reads or writes the registry. It is told where a sandbox's files are (a
`Site`), and a start that must have its record persisted before anything could outlive it hands
each version of the record to a `Note` the caller gives (the registry's write, in commands)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from collections.abc import Mapping

    from sandboxer.core.config_types import ExtensionConfig
    from sandboxer.core.exec_request import ExecRequest
    from sandboxer.core.plan import Plan
    from sandboxer.core.record import SandboxRecord
    from sandboxer.core.record_exec import ExecView
    from sandboxer.core.removal import Removal
    from sandboxer.execio.stdio import Stdio
    from sandboxer.host.inside_sockets import InsideSockets
    from sandboxer.host.limit_events import LimitWatch
    from sandboxer.host.observe import MountSeen, ProbeSeen
    from sandboxer.host.usage import Sample

# Persists a version of the sandbox's record at once (create and the warm pool pass the registry's
# write): a backend calls it before anything the record names could outlive the caller.
Note = Callable[["SandboxRecord"], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class Site:
    """Where one sandbox's host files are: the broker's state dir, and the sandbox's own
    directory in it (commands take both from the registry; a backend never opens the registry)."""

    state_dir: str
    directory: str

    def path(self, *parts: str) -> str:
        """A path inside the sandbox's directory."""
        return os.path.join(self.directory, *parts)


@dataclass(frozen=True, slots=True, kw_only=True)
class Observed:
    """What a backend sees of a live sandbox, for inspect: its mounts, the probe of a process
    started as an exec is, the differences from the plan it found, and its own parts of the
    evidence (network, extra limit fields, backend sections)."""

    mounts: list[MountSeen]
    probe: ProbeSeen
    problems: list[str]
    network: dict[str, Any]
    limits: dict[str, Any] = field(default_factory=dict)
    sections: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Check:
    """One line of `sandboxer doctor`: "ok", "warn" (a part only some setups need, or a risk) or
    "fail" (no sandbox can be made until it is fixed), and what to do when it is not ok."""

    name: str
    status: Literal["ok", "warn", "fail"]
    detail: str
    fix: str | None = None

    def line(self) -> str:
        text = f"{self.status:<4} {self.name}: {self.detail}"
        return text if self.fix is None else f"{text} — {self.fix}"


class Execution(Protocol):
    """What `exec` needs of an engine: run a command in a live sandbox, and where to look for what
    its limits did meanwhile (sandboxer/commands/execute.py)."""

    def run(
        self,
        request: ExecRequest,
        sandbox: ExecView,
        stdio: Stdio,
        *,
        env: Mapping[str, str],
        state_dir: str,
        limits: LimitWatch,
    ) -> int:
        """Run `request` in the ready sandbox `sandbox` with the environment `env` (the core's:
        the sandbox's, a lease's, the caller's), on `stdio`; its exit status (TIMED_OUT at the
        timeout, CALLER_GONE when the caller went away). A cgroup made for the exec is removed
        through `limits` (which keeps its counts). Refusals are ExecUsage (125); a command that
        cannot start is an EntryError."""
        ...

    def limit_groups(self, sandbox: ExecView) -> list[str]:
        """The cgroup directories that hold the sandbox's limits, whose counters say what the
        limits did during an exec (none under the rlimit mechanism)."""
        ...

    def root_pid(self, sandbox: ExecView) -> int | None:
        """A process whose /proc/PID/root is the sandbox's filesystem; None when there is none."""
        ...


class Admission(Protocol):
    """Whether and how a sandbox of this engine may be made on this host (doctor, approval, the
    checks of a create before anything is made)."""

    def health(self) -> list[Check]:
        """What `doctor` checks of this backend on this host (it changes nothing)."""
        ...

    def check_extension(self, extension: ExtensionConfig, file: str) -> None:
        """At approval: refuse (UsageError naming `file` and the key) a config this backend
        could not start a sandbox from on this host."""
        ...

    def preflight(self, extension: ExtensionConfig) -> None:
        """Refuse (BackendError) before anything is checked further or made: the engine cannot
        be used by this broker at all."""

    def admit(self, extension: ExtensionConfig, *, state_dir: str) -> None:
        """Refuse (BackendError) a create whose pinned runtime or state dir the sandbox could not
        reach; called once the runtime's pin is verified."""

    def host_ids(self, inside: tuple[int, int], *, known: tuple[int, int] | None = None) -> tuple[int, int]:
        """The host uid and gid of the sandbox user (`inside` in the sandbox); `known` are those
        of a sandbox already started for it (a warm container), checked again, not asked for."""

    def admits_service_images(self) -> bool:
        """Whether a lease manifest's service_images can be honoured (an engine of images)."""

    def workspace_in_memory(self) -> bool:
        """Whether the workspace must be a tmpfs of the sandbox's own (no sized host filesystem)."""


class Lifecycle(Protocol):
    """Starting a sandbox, watching it, and ending it."""

    def start(
        self, plan: Plan, record: SandboxRecord, *, site: Site, image: str, profile_file: str, note: Note
    ) -> SandboxRecord:
        """Start the sandbox of `plan` (its workspace cloned at plan.workspace_source; `image` for
        an engine of images), and refuse it (BackendError) unless what runs is the plan and its
        workspace is in place; `profile_file` is named in a refusal of the profile. Returns the
        record with the engine's part (limits, processes or container, the plan as started),
        which it has also handed to `note` before anything could outlive it."""

    def fill_workspace(self, plan: Plan, record: SandboxRecord, *, profile_file: str) -> None:
        """Put the clone at plan.workspace_source where the started sandbox sees it, when that is
        not already so (an unprivileged bwrap sandbox's own tmpfs); `profile_file` is named when
        it does not fit."""

    def deliver(self, plan: Plan, record: SandboxRecord, data: bytes, target: str) -> None:
        """Write `data` at `target` inside the started sandbox, as its user, before anything else
        runs there (a runtime bootstrap)."""

    def stop(self, record: SandboxRecord, *, site: Site) -> Removal:
        """End every process (or the container) of the sandbox."""

    def release(self, record: SandboxRecord) -> Removal:
        """Remove what held the sandbox's limits once its processes are gone."""

    def is_running(self, record: SandboxRecord) -> bool | None:
        """Whether the sandbox runs; None when that cannot be known (an Engine that is silent)."""

    def observe(self, record: SandboxRecord, *, site: Site) -> Observed:
        """Observe the live sandbox against its plan."""

    def sample(self, record: SandboxRecord) -> Sample:
        """What the running sandbox uses now (its cgroups' counters, or its processes'), and the
        process its filesystem is seen through (sandboxer.host.usage)."""

    def listen_inside(self, record: SandboxRecord, address: tuple[str, int]) -> socket.socket:
        """A socket listening on `address` in the running sandbox's own network namespace, made by
        the broker from the host (the egress proxy's: docs/egress.md); BackendError when the
        sandbox is gone or the address is taken inside."""

    def inside_sockets(self, record: SandboxRecord) -> InsideSockets:
        """What makes sockets in the running sandbox's network namespace on demand (a published
        port's inner side: docs/publish.md), until closed; BackendError when the sandbox is gone."""


class Warming(Protocol):
    """Sandboxes started ahead of the create that takes one (sandboxer.commands.warmpool)."""

    def warm_fingerprint(self, plan: Plan, *, site: Site, image: str) -> str:
        """What the engine would be asked for to start `plan`, as a digest: a warm sandbox is
        taken only by a create whose plan has the same."""

    def start_warm(
        self, plan: Plan, record: SandboxRecord, *, site: Site, image: str, note: Note
    ) -> tuple[SandboxRecord, dict[str, Any]]:
        """Start and verify a warm sandbox of `plan` (its workspace empty), its record handed to
        `note` as `start` does: its record, and what it showed, for `warm_problems` to compare
        when a create takes it."""

    def warm_problems(self, record: SandboxRecord, plan: Plan, *, site: Site) -> list[str]:
        """Every reason the warm sandbox of `record` may not become the sandbox of `plan`."""

    def taken_warm_problems(self, record: SandboxRecord, plan: Plan, *, site: Site) -> list[str]:
        """The final inspection of a warm sandbox a create took (after `warm_problems`)."""


class Spools(Protocol):
    """The request spools of a lease manifest's tool leases: where each lives, making it,
    finding it for dispatch-tool, removing it."""

    def spool_place(self, name: str, *, sandbox_dir: str) -> tuple[str, str | None]:
        """Where the request spool `name` of the sandbox whose directory is `sandbox_dir` lives:
        the source of its mount (a host path, or a name the engine resolves) and the directory
        it is opened below without following symlinks (None for a name)."""

    def make_spool_root(self, source: str, *, sandbox_id: str, state_dir: str, group: int) -> str:
        """Make the empty host directory of a spool (`source` as spool_place gave it) that its
        bounded tmpfs goes on, before the sandbox starts; returns its path. `group` is the
        sandbox user's host gid."""

    def spool_directory(self, name: str, *, sandbox_dir: str) -> str:
        """The host directory of a live sandbox's spool `name` (dispatch-tool works there);
        BackendError when it cannot be found."""

    def remove_spool(self, source: str, *, sandbox_id: str) -> Removal:
        """Remove a spool (its tmpfs first) of a sandbox being destroyed."""


class Collector(Protocol):
    """gc's question to an engine: what does it still hold of sandboxes that are gone?"""

    def collect_orphans(self, *, state_dir: str, present: Callable[[], set[str]]) -> dict[str, Removal]:
        """Remove what the engine still holds of sandboxes of `state_dir` whose directory is gone
        (`present`: the ids whose directory is there, asked again whenever it matters): what went
        and what is left, by sandbox id; nothing when it cannot tell what that is."""


class Backend(Admission, Lifecycle, Warming, Spools, Collector, Execution, Protocol):
    """Everything the commands ask of an engine: each of its roles."""
