"""A sandbox's `Site` from the registry: where its host files are, which is all a backend is told
of the registry (it never reads or writes one)."""

from __future__ import annotations

from sandboxer.backends.protocol import Site
from sandboxer.host.registry import Registry


def site_of(registry: Registry, sandbox_id: str) -> Site:
    """The state dir and the sandbox's own directory in it."""
    return Site(state_dir=registry.state_dir, directory=registry.path(sandbox_id))
