"""A Backend that starts nothing, for unit tests of the core (create, exec, teardown, list, gc,
leases).

It keeps its "running" sandboxes in memory, records what it was asked to do, and can be told to
fail a start, to lose a sandbox (as if its processes died) or to be unable to tell. Its spools
are plain directories below `spool_base` (no engine, no tmpfs), and gc finds the `orphans` it is
given. Its exec runs no process: it plays a few commands itself on the exec's stdio (FakeBackend.run).
"""

from __future__ import annotations

import os
import shlex
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from sandboxer.backends.protocol import Backend, Check, Note, Observed, Site
from sandboxer.core.config_types import ExtensionConfig
from sandboxer.core.exec_request import ExecRequest
from sandboxer.core.plan import Plan
from sandboxer.core.record import LimitsRecord, PlanShare, SandboxRecord
from sandboxer.core.record_exec import ExecView
from sandboxer.core.removal import Removal
from sandboxer.errors import BackendError, EntryError, ExecUsage, not_running
from sandboxer.execio.stdio import CALLER_GONE, TIMED_OUT, Stdio
from sandboxer.host.inside_sockets import InsideSockets, connected
from sandboxer.host.limit_events import LimitWatch
from sandboxer.host.usage import Counters, Sample
from sandboxer.service.publish.table import reserve

NO_WARM = "the fake backend keeps no warm sandboxes"


@dataclass
class FakeBackend:
    running: set[str] = field(default_factory=set)
    unknown: set[str] = field(default_factory=set)  # is_running cannot tell (a silent Engine)
    fail_start: str | None = None  # the message of a start that fails, after recording itself
    calls: list[tuple[str, str]] = field(default_factory=list)  # (verb, its subject: a sandbox id, spool, state dir)
    images: bool = False  # whether it admits a manifest's service images
    spool_base: Path = Path("/nonexistent/fake-spools")  # where make_spool_root makes a spool's directory
    orphans: dict[str, Removal] = field(default_factory=dict)  # what gc gets once (by sandbox id), then no more
    execs: list[tuple[ExecRequest, dict[str, str]]] = field(default_factory=list)  # each exec, its environment

    def health(self) -> list[Check]:
        return [Check("fake", "ok", "always")]

    def check_extension(self, extension: ExtensionConfig, file: str) -> None:
        return None

    def preflight(self, extension: ExtensionConfig) -> None:
        self.calls.append(("preflight", extension.extension))

    def admit(self, extension: ExtensionConfig, *, state_dir: str) -> None:
        self.calls.append(("admit", extension.extension))

    def host_ids(self, inside: tuple[int, int], *, known: tuple[int, int] | None = None) -> tuple[int, int]:
        return known or (1_700_000_123, 1_700_000_123)

    def workspace_in_memory(self) -> bool:
        return True  # no sized filesystem to mount: the clone stays in the sandbox's directory

    def start(
        self, plan: Plan, record: SandboxRecord, *, site: Site, image: str, profile_file: str, note: Note
    ) -> SandboxRecord:
        self.calls.append(("start", plan.sandbox_id))
        limits = LimitsRecord(mechanism="fake", memory_mib=plan.limits.memory_mib, pids=plan.limits.pids)
        record = replace(record, limits=limits, plan=PlanShare.of(plan))  # as every backend records it
        note(record)
        if self.fail_start is not None:
            raise BackendError(self.fail_start)
        self.running.add(plan.sandbox_id)
        return record

    def fill_workspace(self, plan: Plan, record: SandboxRecord, *, profile_file: str) -> None:
        return None

    def deliver(self, plan: Plan, record: SandboxRecord, data: bytes, target: str) -> None:
        self.calls.append(("deliver", plan.sandbox_id))

    def stop(self, record: SandboxRecord, *, site: Site) -> Removal:
        sandbox_id = record.id
        self.calls.append(("stop", sandbox_id))
        was = sandbox_id in self.running
        self.running.discard(sandbox_id)
        return Removal(removed=("fake processes",) if was else ())

    def release(self, record: SandboxRecord) -> Removal:
        self.calls.append(("release", record.id))
        return Removal()

    def is_running(self, record: SandboxRecord) -> bool | None:
        sandbox_id = record.id
        if sandbox_id in self.unknown:
            return None
        return sandbox_id in self.running

    def listen_inside(self, record: SandboxRecord, address: tuple[str, int]) -> socket.socket:
        """A listener on the host's loopback at a free port (the fake has no namespace of its own)."""
        self.calls.append(("listen_inside", record.id))
        made = socket.create_server(("127.0.0.1", 0))
        made.setblocking(False)
        return made

    def inside_sockets(self, record: SandboxRecord) -> HostSockets:
        """Sockets on the host (the fake has no namespace of its own)."""
        self.calls.append(("inside_sockets", record.id))
        return HostSockets()

    def sample(self, record: SandboxRecord) -> Sample:
        return Sample(counters=Counters(memory_bytes=1 << 20, pids=1, cpu_seconds=0.0), source="cgroup", root_pid=None)

    def observe(self, record: SandboxRecord, *, site: Site) -> Observed:
        raise BackendError("the fake backend observes nothing")

    def warm_fingerprint(self, plan: Plan, *, site: Site, image: str) -> str:
        raise BackendError(NO_WARM)

    def start_warm(
        self, plan: Plan, record: SandboxRecord, *, site: Site, image: str, note: Note
    ) -> tuple[SandboxRecord, dict[str, Any]]:
        raise BackendError(NO_WARM)

    def warm_problems(self, record: SandboxRecord, plan: Plan, *, site: Site) -> list[str]:
        raise BackendError(NO_WARM)

    def taken_warm_problems(self, record: SandboxRecord, plan: Plan, *, site: Site) -> list[str]:
        raise BackendError(NO_WARM)

    def admits_service_images(self) -> bool:
        return self.images

    def spool_place(self, name: str, *, sandbox_dir: str) -> tuple[str, str | None]:
        self.calls.append(("spool_place", name))
        return f"fake:{name}", f"{sandbox_dir}/fake-spools"

    def make_spool_root(self, source: str, *, sandbox_id: str, state_dir: str, group: int) -> str:
        self.calls.append(("make_spool_root", source))
        root = self.spool_base / source.removeprefix("fake:")
        root.mkdir()
        return str(root)

    def spool_directory(self, name: str, *, sandbox_dir: str) -> str:
        self.calls.append(("spool_directory", name))
        return str(self.spool_base / name)

    def remove_spool(self, source: str, *, sandbox_id: str) -> Removal:
        self.calls.append(("remove_spool", source))
        return Removal(removed=(f"fake spool {source}",))

    def collect_orphans(self, *, state_dir: str, present: Callable[[], set[str]]) -> dict[str, Removal]:
        self.calls.append(("collect_orphans", state_dir))
        found, self.orphans = self.orphans, {}
        return found

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
        """Play the command instead of running one: `echo WORDS` (stdout), `say STATUS TEXT`
        (TEXT on stderr, exit STATUS), `cat` (stdin to stdout), `env` (NAME=VALUE lines),
        `sleep SECONDS` (TIMED_OUT at the timeout, CALLER_GONE once the caller went away);
        anything else is not found (127). A sandbox it does not run is refused, as bwrap's is."""
        self.calls.append(("run", request.sandbox_id))
        self.execs.append((request, dict(env)))
        if request.sandbox_id not in self.running:
            raise ExecUsage(f"exec: {not_running(request.sandbox_id)}")
        if request.tty:
            stdio.window()  # a program's stdio is refused a terminal
        name, *args = request.argv
        with stdio.streams() as (stdin, output):
            match name:
                case "echo":
                    output(1, (" ".join(args) + "\n").encode())
                case "say":
                    output(2, (" ".join(args[1:]) + "\n").encode())
                    return int(args[0])
                case "cat":
                    while chunk := os.read(stdin, 65536):
                        output(1, chunk)
                case "env":
                    output(1, "".join(f"{key}={value}\n" for key, value in sorted(env.items())).encode())
                case "sleep":
                    return _sleep(float(args[0]), request.timeout, stdio)
                case _:
                    raise EntryError(127, f"{shlex.quote(name)}: not found")
        return 0

    def limit_groups(self, sandbox: ExecView) -> list[str]:
        return []

    def root_pid(self, sandbox: ExecView) -> int | None:
        return None


def _sleep(seconds: float, timeout: float | None, stdio: Stdio) -> int:
    """The fake's `sleep`: until it is over (0), the timeout (TIMED_OUT) or the caller's leaving."""
    deadline = time.monotonic() + (seconds if timeout is None else min(seconds, timeout))
    while time.monotonic() < deadline:
        if stdio.cancelled is not None and stdio.cancelled():
            return CALLER_GONE
        time.sleep(0.01)
    return 0 if timeout is None or seconds <= timeout else TIMED_OUT


def _conforms(backend: FakeBackend) -> Backend:
    return backend  # mypy checks the fake against the protocol


class FakeEgress:
    """An Egress (sandboxer.commands.services) that serves nothing and records what it was asked:
    the core's part of egress (when a listener is made and handed over, when it is closed) tested
    without a service. Its listeners are closed at once."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def require(self, profile: str) -> None:
        self.calls.append(("require", profile))

    def open(self, sandbox_id: str, profile: str, listener: socket.socket) -> None:
        listener.close()
        self.calls.append(("open", sandbox_id))

    def close(self, sandbox_id: str) -> None:
        self.calls.append(("close", sandbox_id))

    def status(self, sandbox_id: str) -> str | None:
        return "up" if ("open", sandbox_id) in self.calls else None


class HostSockets:
    """The fake backend's inside sockets: plain sockets of the host's namespace."""

    def __init__(self) -> None:
        self.closed = False

    async def connect(self, port: int) -> socket.socket:
        return await connected(socket.socket(socket.AF_INET, socket.SOCK_STREAM), ("127.0.0.1", port))

    def close(self) -> None:
        self.closed = True


class FakePublish:
    """A Publish (sandboxer.commands.services) that reserves the host's ports for real and records
    the rest: the core's part of published ports tested without a service. What it is handed is
    closed at once."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []
        self.reserved: list[socket.socket] = []

    def require(self, profile: str) -> None:
        self.calls.append(("require", profile))

    def reserve(self, file: str, ports: Sequence[tuple[int, int]]) -> list[socket.socket]:
        self.calls.append(("reserve", tuple(ports)))
        self.reserved = reserve(file, ports)
        return self.reserved

    def open(
        self,
        sandbox_id: str,
        ports: Sequence[tuple[int, int]],
        listeners: Sequence[socket.socket],
        inside: InsideSockets,
    ) -> None:
        self.calls.append(("open", sandbox_id))
        for listener in listeners:
            listener.close()
        inside.close()

    def close(self, sandbox_id: str) -> None:
        self.calls.append(("close", sandbox_id))

    def status(self, sandbox_id: str) -> list[dict[str, object]] | None:
        return None
