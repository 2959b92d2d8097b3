"""What the commands are given to work with, instead of reaching for process globals: the
engines (`Backends`), where background fills run (`Fills`), who serves sandboxes' egress
(`Egress`) and who forwards their published ports (`Publish`).

One `Services` is made per process that runs commands — the service at its start, an
in-process CLI command or an embedded `Broker` on their first use — and handed down to every
command that starts, stops or tops up a sandbox. A test builds one over a fake engine."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from sandboxer.backends import Backends
from sandboxer.commands.warm import Fills
from sandboxer.errors import PolicyError
from sandboxer.host.inside_sockets import InsideSockets

EGRESS_HINT = "run it through the service (sandboxer serve; unset SANDBOXER_NO_SERVICE), or use sandboxer.Client"
PortMapping = tuple[int, int]  # (host port on 127.0.0.1, port inside the sandbox)


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


class Publish(Protocol):
    """Who forwards the published ports of sandboxes (a manifest's published_ports): the service
    (sandboxer/service/publish/table.py). In-process there is none (`NoPublish`)."""

    def require(self, profile: str) -> None:
        """Refuse (PolicyError, 3) a create that publishes ports nobody could serve."""

    def reserve(self, file: str, ports: Sequence[PortMapping]) -> list[socket.socket]:
        """The host's 127.0.0.1 ports, bound and listening; PolicyError (3) when one is taken."""

    def open(
        self, sandbox_id: str, ports: Sequence[PortMapping], listeners: Sequence[socket.socket], inside: InsideSockets
    ) -> None:
        """Forward the reserved `listeners` into the sandbox from now on."""

    def close(self, sandbox_id: str) -> None:
        """The sandbox ended: stop its forwarders."""

    def status(self, sandbox_id: str) -> list[dict[str, object]] | None:
        """Each mapping as served now; None when this process publishes nothing for it."""


class NoPublish:
    """A process without a service: its forwarders would end with it, so a create that publishes
    ports is refused."""

    def require(self, profile: str) -> None:
        raise PolicyError(
            f"a create of profile {profile} publishes ports, which only the service forwards: "
            "this command runs in-process",
            hint=EGRESS_HINT,
        )

    def reserve(self, file: str, ports: Sequence[PortMapping]) -> list[socket.socket]:
        self.require("")
        return []

    def open(
        self, sandbox_id: str, ports: Sequence[PortMapping], listeners: Sequence[socket.socket], inside: InsideSockets
    ) -> None:
        inside.close()
        self.require("")

    def close(self, sandbox_id: str) -> None:
        return None

    def status(self, sandbox_id: str) -> list[dict[str, object]] | None:
        return None


@dataclass(frozen=True)
class Services:
    """The engines and the warm fills of one process."""

    backends: Backends
    fills: Fills
    egress: Egress = field(default_factory=NoEgress)
    publish: Publish = field(default_factory=NoPublish)

    @classmethod
    def of(
        cls, backends: Backends | None = None, egress: Egress | None = None, publish: Publish | None = None
    ) -> Services:
        """The built-in engines (or `backends`), fills in detached processes until a service
        hands them an executor (Fills.run_on), and no egress or published ports unless the
        service gives its own."""
        backends = backends if backends is not None else Backends()
        return cls(
            backends=backends, fills=Fills(backends), egress=egress or NoEgress(), publish=publish or NoPublish()
        )
