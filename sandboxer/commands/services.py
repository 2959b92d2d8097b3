"""What the commands are given to work with, instead of reaching for process globals: the
engines (`Backends`) and where background fills run (`Fills`).

One `Services` is made per process that runs commands — the service at its start, an
in-process CLI command or an embedded `Broker` on their first use — and handed down to every
command that starts, stops or tops up a sandbox. A test builds one over a fake engine."""

from __future__ import annotations

from dataclasses import dataclass

from sandboxer.backends import Backends
from sandboxer.commands.warm import Fills


@dataclass(frozen=True)
class Services:
    """The engines and the warm fills of one process."""

    backends: Backends
    fills: Fills

    @classmethod
    def of(cls, backends: Backends | None = None) -> Services:
        """The built-in engines (or `backends`), fills in detached processes until a service
        hands them an executor (Fills.run_on)."""
        backends = backends if backends is not None else Backends()
        return cls(backends=backends, fills=Fills(backends))
