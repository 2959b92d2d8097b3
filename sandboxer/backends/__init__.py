"""The engines a sandbox runs on, behind one interface.

The core (sandboxer/commands) asks a `Backend` (protocol.py) for everything that differs between
bubblewrap and Docker, and never branches on the backend's name: `backend_for` is the one place
that maps a name to its implementation. Each implementation is a package of its own (`bwrap/`,
`docker/`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sandboxer.backends.protocol import Backend
    from sandboxer.core.plan import Backend as Name
    from sandboxer.core.record_exec import ExecView

Enter = Callable[..., int]

NAMES: tuple[Name, ...] = ("bwrap", "docker")  # every backend, in the order gc asks each for its orphans


def backend_for(name: object) -> Backend:
    """The backend a sandbox (its plan or record) names."""
    match name:
        case "bwrap":
            from sandboxer.backends.bwrap.backend import BwrapBackend

            return BwrapBackend()
        case "docker":
            from sandboxer.backends.docker.backend import DockerBackend

            return DockerBackend()
        case _:
            from sandboxer.errors import BackendError

            raise BackendError(f"no such backend: {str(name)[:32]!r}")


def limit_groups(record: ExecView) -> list[str]:
    """The cgroup directories that hold a sandbox's limits, whose counters say what the limits did
    during an exec (sandboxer/host/limit_events.py): those a bwrap sandbox's record names, a
    container's own (the Engine made them), none under the rlimit mechanism."""
    if record.cgroups:
        return list(record.cgroups)
    if record.backend == "docker" and record.container_id:
        from sandboxer.backends.docker.enter import container_groups

        return container_groups(record.container_id)
    return []


def root_pid(record: ExecView) -> int | None:
    """A process whose /proc/PID/root is the sandbox's filesystem: a bwrap sandbox's holder, a
    container's pid 1 (asked of the Engine); None when there is none to ask."""
    if record.backend == "docker" and record.container_id:
        from sandboxer.backends.docker.container import inspect
        from sandboxer.errors import SandboxerError

        try:
            pid = (inspect(record.container_id).get("State") or {}).get("Pid")
        except (OSError, SandboxerError):
            return None
        return pid if isinstance(pid, int) and pid > 0 else None
    from sandboxer.host import procs

    holder = record.holder_pid
    if not holder or procs.start_time(holder) != record.holder_start:
        return None  # gone, and its pid may be another process's by now
    return holder


def enter_for(name: object) -> Enter:
    """How `sandboxer exec` runs a command in a sandbox of this backend: exec's own entry, which
    loads none of the backend's create-time code. It is called as
    `enter(record, options, command, env, timeout, *, program, state_dir, limits) -> status`, and
    removes a cgroup made for the exec through `limits` (host/limit_events.py: it keeps the counts)."""
    from sandboxer.errors import ExecUsage

    match name:
        case "bwrap":
            from sandboxer.backends.bwrap.enter import run as bwrap_run

            return bwrap_run
        case "docker":
            from sandboxer.backends.docker.enter import run as docker_run

            return docker_run
        case _:
            raise ExecUsage(f"exec: the sandbox's record names no known backend ({str(name)[:32]!r})")


def service_helpers(started: bool) -> None:
    """A service starts (True) or stops (False): the helpers a backend keeps for one (bwrap's
    spawner: sandboxer/backends/bwrap/spawner.py)."""
    from sandboxer.backends.bwrap import spawner

    if started:
        spawner.activate()
    else:
        spawner.deactivate()
