"""The engines a sandbox runs on, behind one interface.

The core (sandboxer/commands) asks a `Backend` (protocol.py) for everything that differs between
bubblewrap and Docker, and never branches on the backend's name: `backend_for` is the one place
that maps a name to its implementation. Each implementation is a package of its own (`bwrap/`,
`docker/`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sandboxer.backends.protocol import Backend

NAMES = ("bwrap", "docker")  # every backend, in the order gc asks each for its orphans


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
