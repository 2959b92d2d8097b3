"""What a sandbox may reach: the egress rules, limits and credential routes, and `decide`.

These values are what the service hands the proxy for one sandbox, made by the profile's and
extension's loader (core/config) once they are approved; the proxy asks for them again for every
connection and request, so a revocation takes effect on the next one. Everything here is pure:
no resolution, no sockets, no clock unless the caller leaves `now` out.

The decision order (docs/egress.md): the host is normalised (lower case, trailing dot and IPv6
brackets stripped) and refused if it is not a well-formed name or a canonical IP literal; an IP
literal must be a rule's `host` (a name's pinned `addresses` do not count); a name must match a rule (exact, or a
`*.suffix` that matches names strictly below the suffix); the port must be one of that rule's;
a route whose host is this name is attached, and refused once expired.
"""

from __future__ import annotations

import re
import socket
import time
import types
from collections.abc import Mapping
from dataclasses import dataclass, field

from sandboxer.core.egress.addresses import IPAddress, address_class, parse_address

MAX_NAME = 253
_LABEL = re.compile(r"^[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?$")
_NUMERIC = re.compile(r"^(?:[0-9]+|0x[0-9a-f]*)$")
PLACEHOLDER_PREFIX = "sandboxer-route:"


@dataclass(frozen=True, slots=True, kw_only=True)
class EgressRule:
    """One `network.egress` entry: a host (exact, or "*.suffix"), its ports, and optionally the
    addresses it is pinned to (no DNS; private and loopback allowed because they are named)."""

    host: str
    ports: tuple[int, ...]
    addresses: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """`network.limits`: concurrent client connections, total MiB both ways, seconds per
    tunnel or request, for one sandbox."""

    connections: int = 64
    mib: int = 1024
    seconds: float = 600  # the profile gives whole seconds; tests use less


@dataclass(frozen=True, slots=True, kw_only=True)
class Route:
    """A credential route from the extension's `config.routes`: for requests to `host`, the proxy
    sets `header` to `format` with `{secret}` replaced by the content of `secret_file`, read at
    request time; past `expires_at` (seconds since the epoch) the route refuses."""

    name: str
    host: str
    header: str
    format: str = "{secret}"
    secret_file: str
    expires_at: float | None = None

    @property
    def placeholder(self) -> str:
        """What the sandbox sees where an SDK insists on a key."""
        return PLACEHOLDER_PREFIX + self.name


@dataclass(frozen=True, slots=True, kw_only=True)
class EgressPolicy:
    """Everything one sandbox's proxy enforces; `routes` by name (the profile's opted-in ones)."""

    rules: tuple[EgressRule, ...]
    limits: Limits = field(default_factory=Limits)
    routes: Mapping[str, Route] = field(default_factory=lambda: types.MappingProxyType({}))


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """Whether a connection to `host` (normalised) and a port may go ahead, and why."""

    allowed: bool
    reason: str
    host: str
    rule: EgressRule | None = None
    route: Route | None = None


def normalise_host(host: str) -> str:
    """`host` in lower case without a trailing dot or IPv6 brackets (not validated)."""
    host = host.strip().lower()
    if host.startswith("[") and host.endswith("]"):
        return host[1:-1]
    return host.removesuffix(".")


def host_problem(host: str) -> str | None:
    """Why a normalised host that is not a canonical IP literal cannot be connected to, or None
    for a well-formed DNS name. Forms a C resolver would read as an IPv4 address (`0x7f.1`,
    `2130706433`, `127.1`, octal) are refused: the name the rules see must be what is dialled."""
    try:
        socket.inet_aton(host)
    except (OSError, ValueError):
        pass
    else:
        return "non-canonical IP literal"
    labels = host.split(".")
    if not host or len(host) > MAX_NAME or not all(_LABEL.match(label) for label in labels):
        return "malformed host"
    if _NUMERIC.match(labels[-1]):  # a URL parser would take it for an IPv4 address
        return "non-canonical IP literal"
    return None


def name_matches(pattern: str, host: str) -> bool:
    """Whether a rule's host (exact, or "*.suffix": strictly below the suffix) covers `host`."""
    pattern = normalise_host(pattern)
    if pattern.startswith("*."):
        return host.endswith(pattern[1:]) and len(host) > len(pattern) - 1
    return host == pattern


def literal_named(rule: EgressRule, address: IPAddress) -> bool:
    """Whether the rule names this IP literal as its host. A name's pinned `addresses` do not:
    they say where the name goes, not that the address may be asked for by itself."""
    return parse_address(rule.host) == address


def route_for(policy: EgressPolicy, host: str) -> Route | None:
    """The route whose host is `host` (normalised), if the policy has one."""
    return next((r for r in policy.routes.values() if normalise_host(r.host) == host), None)


def route_expired(route: Route, now: float) -> bool:
    """Whether the route's `expires_at` has passed."""
    return route.expires_at is not None and now >= route.expires_at


def decide(policy: EgressPolicy, host: str, port: int, *, now: float | None = None) -> Decision:
    """Whether the sandbox may connect to `host`:`port`, before any resolution (module docstring
    for the order)."""
    name = normalise_host(host)
    address = parse_address(name)
    if address is not None:
        name = str(address)
        named = [rule for rule in policy.rules if literal_named(rule, address)]
        if not named:
            return Decision(allowed=False, reason="IP literal not listed", host=name)
    else:
        problem = host_problem(name)
        if problem is not None:
            return Decision(allowed=False, reason=problem, host=name)
        named = [rule for rule in policy.rules if name_matches(rule.host, name)]
        if not named:
            return Decision(allowed=False, reason="host not listed", host=name)
    rule = next((rule for rule in named if port in rule.ports), None)
    if rule is None:
        return Decision(allowed=False, reason="port not listed", host=name)
    route = route_for(policy, name)
    if route is not None and route_expired(route, time.time() if now is None else now):
        return Decision(allowed=False, reason="route expired", host=name, rule=rule, route=route)
    return Decision(allowed=True, reason="listed", host=name, rule=rule, route=route)


def address_allowed(rule: EgressRule, ip: str | IPAddress) -> str | None:
    """None when a connection under `rule` may go to `ip`; else the reason it may not. An address
    the rule names — in `addresses`, or as its host (an IP literal rule) — is always allowed
    (that is how an owner opts into a private or loopback upstream); anything else must be a
    global unicast address."""
    address = ip if not isinstance(ip, str) else parse_address(ip)
    if address is None:
        return "unparsable address"
    if parse_address(rule.host) == address or any(parse_address(listed) == address for listed in rule.addresses):
        return None
    found = address_class(address)
    # The class, never the address: the answer reaches the sandbox, which should not learn where
    # a listed name points inside the host's network.
    return f"{found} not listed" if found else None
