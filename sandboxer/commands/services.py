"""What the commands are given to work with, instead of reaching for process globals: the
engines (`Backends`), where background fills run (`Fills`) and who serves sandboxes' egress
(`Egress`).

One `Services` is made per process that runs commands — the service at its start, an
in-process CLI command or an embedded `Broker` on their first use — and handed down to every
command that starts, stops or tops up a sandbox. A test builds one over a fake engine."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Protocol

from sandboxer.backends import Backends
from sandboxer.commands.warm import Fills
from sandboxer.errors import PolicyError

EGRESS_HINT = "run it through the service (sandboxer serve; unset SANDBOXER_NO_SERVICE), or use sandboxer.Client"


class Egress(Protocol):
    """Who runs the egress proxies of sandboxes whose profile lists network.egress: the service
    (sandboxer/service/egress/proxies.py). In-process there is none (`NoEgress`)."""

    def require(self, profile: str) -> None:
        """Refuse (PolicyError, 3) a create of `profile` that nobody could serve, before anything
        is made."""

    def open(self, sandbox_id: str, profile: str, listener: socket.socket) -> None:
        """Serve the sandbox's egress on `listener` (inside its network namespace) from now on."""

    def close(self, sandbox_id: str) -> None:
        """The sandbox ended: stop its proxy and close its connections."""

    def status(self, sandbox_id: str) -> str | None:
        """ "up", "down (why)", or None when this process serves no egress for the sandbox."""


class NoEgress:
    """A process without a service (the CLI with SANDBOXER_NO_SERVICE=1, an embedded Broker): its
    proxies would end with it while the sandbox lives on, so a profile with egress is refused."""

    def require(self, profile: str) -> None:
        raise PolicyError(
            f"profile {profile} reaches the network through the broker's egress proxy, which only "
            "the service runs: this command runs in-process",
            hint=EGRESS_HINT,
        )

    def open(self, sandbox_id: str, profile: str, listener: socket.socket) -> None:
        listener.close()
        self.require(profile)

    def close(self, sandbox_id: str) -> None:
        return None

    def status(self, sandbox_id: str) -> str | None:
        return None


@dataclass(frozen=True)
class Services:
    """The engines and the warm fills of one process."""

    backends: Backends
    fills: Fills
    egress: Egress = field(default_factory=NoEgress)

    @classmethod
    def of(cls, backends: Backends | None = None, egress: Egress | None = None) -> Services:
        """The built-in engines (or `backends`), fills in detached processes until a service
        hands them an executor (Fills.run_on), and no egress unless the service gives its own."""
        backends = backends if backends is not None else Backends()
        return cls(backends=backends, fills=Fills(backends), egress=egress or NoEgress())
