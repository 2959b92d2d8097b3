"""The engines a sandbox runs on, behind one interface.

The core (sandboxer/commands) asks a `Backend` (protocol.py) for everything that differs between
bubblewrap and Docker, and never branches on the backend's name: `Backends` is the one place
that maps a name to its implementation. The core API holds one (`Broker(backends=...)`) and hands
it to every command, so a test gives the core a fake engine by constructing it, not by patching.
Each implementation is a package of its own (`bwrap/`, `docker/`), imported on first use: exec's
hot path loads an engine's exec part alone (`Backends.execution`, tests/unit/test_exec_imports.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from sandboxer.errors import BackendError, ExecUsage

if TYPE_CHECKING:
    from sandboxer.backends.protocol import Backend, Execution
    from sandboxer.core.plan import Backend as Name

NAMES: tuple[Name, ...] = ("bwrap", "docker")  # every backend, in the order gc asks each for its orphans


class Backends:
    """The engines by name: the built-in ones, or those a test (or an embedding program) gives.

    `Backends()` is bubblewrap and Docker; `Backends({"bwrap": fake, "docker": fake})` is a core
    that starts nothing. Instances are cheap and hold no state of a sandbox: the built-in engines
    are made afresh for each call, as they were before injection."""

    def __init__(self, engines: Mapping[Name, Backend] | None = None) -> None:
        self._engines = dict(engines) if engines is not None else None

    @property
    def names(self) -> tuple[Name, ...]:
        """Every engine, in the order gc asks each for its orphans."""
        return NAMES if self._engines is None else tuple(self._engines)

    def backend(self, name: object) -> Backend:
        """The backend a sandbox (its plan or record) names; BackendError for any other name."""
        engine = self._given(name) if self._engines is not None else _built_in_backend(name)
        if engine is None:
            raise BackendError(f"no such backend: {str(name)[:32]!r}")
        return engine

    def execution(self, name: object) -> Execution:
        """How `exec` runs a command in a sandbox of this backend: the engine's exec part alone
        (protocol.Execution), which loads none of its create-time code."""
        engine = self._given(name) if self._engines is not None else _built_in_execution(name)
        if engine is None:
            raise ExecUsage(f"exec: the sandbox's record names no known backend ({str(name)[:32]!r})")
        return engine

    def _given(self, name: object) -> Backend | None:
        engines = self._engines or {}
        return engines.get(name) if isinstance(name, str) else None  # type: ignore[call-overload]

    def serve(self, started: bool) -> None:
        """A service starts (True) or stops (False): the helpers an engine keeps for one (bwrap's
        spawner: sandboxer/backends/bwrap/spawner.py). Injected engines keep none."""
        if self._engines is not None:
            return
        from sandboxer.backends.bwrap import spawner

        if started:
            spawner.activate()
        else:
            spawner.deactivate()


def _built_in_backend(name: object) -> Backend | None:
    match name:
        case "bwrap":
            from sandboxer.backends.bwrap.backend import BwrapBackend

            return BwrapBackend()
        case "docker":
            from sandboxer.backends.docker.backend import DockerBackend

            return DockerBackend()
    return None


def _built_in_execution(name: object) -> Execution | None:
    match name:
        case "bwrap":
            from sandboxer.backends.bwrap.enter import BwrapExecution

            return BwrapExecution()
        case "docker":
            from sandboxer.backends.docker.enter import DockerExecution

            return DockerExecution()
    return None
