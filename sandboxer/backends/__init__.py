"""The engines a sandbox runs on, behind one interface.

The core (sandboxer/commands) asks a `Backend` (protocol.py) for everything that differs between
bubblewrap and Docker, and never branches on the backend's name: `backend_for` is the one place
that maps a name to its implementation (and `execution_for` its exec part, on exec's hot path).
Each implementation is a package of its own (`bwrap/`, `docker/`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sandboxer.backends.protocol import Backend, Execution
    from sandboxer.core.plan import Backend as Name

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


def execution_for(name: object) -> Execution:
    """How `sandboxer exec` runs a command in a sandbox of this backend: the engine's exec part
    alone (sandboxer.backends.protocol.Execution), which loads none of its create-time code."""
    match name:
        case "bwrap":
            from sandboxer.backends.bwrap.enter import BwrapExecution

            return BwrapExecution()
        case "docker":
            from sandboxer.backends.docker.enter import DockerExecution

            return DockerExecution()
        case _:
            from sandboxer.errors import ExecUsage

            raise ExecUsage(f"exec: the sandbox's record names no known backend ({str(name)[:32]!r})")


def service_helpers(started: bool) -> None:
    """A service starts (True) or stops (False): the helpers a backend keeps for one (bwrap's
    spawner: sandboxer/backends/bwrap/spawner.py)."""
    from sandboxer.backends.bwrap import spawner

    if started:
        spawner.activate()
    else:
        spawner.deactivate()
