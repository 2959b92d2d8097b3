"""The owner's egress keys, parsed strictly: a profile's `network` section (default, egress,
routes, limits, publish) and an extension config's `config.routes` (docs/egress.md, "The owner's
keys"). Hosts are judged by the proxy's own rules (core/egress/policy.py: `host_problem`), so
nothing the proxy would refuse to match can be approved. The secret files are named, never read.
"""

from __future__ import annotations

import re
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Literal, TypeVar

from sandboxer.core.config_doc import Doc
from sandboxer.core.egress.addresses import parse_address
from sandboxer.core.egress.policy import EgressRule, Limits, Route, host_problem
from sandboxer.core.yamlstrict import YMap, YNode, YSeq

T = TypeVar("T")

ROUTE_NAME = re.compile(r"[a-z0-9_-]{1,63}")
PORT_RANGE = (1, 65535)
# network.limits: what one sandbox's proxy allows at once, in all, and per connection.
CONNECTIONS_RANGE = (1, 4096)  # concurrent client connections
EGRESS_MIB_RANGE = (1, 1024 * 1024)  # MiB both ways over the proxy's life: up to 1 TiB
EGRESS_SECONDS_RANGE = (1, 24 * 3600)  # each connection, tunnel or request: up to a day
LIMIT_RANGES = {"connections": CONNECTIONS_RANGE, "mib": EGRESS_MIB_RANGE, "seconds": EGRESS_SECONDS_RANGE}
PUBLISH_VALUES = ("none", "loopback")

HTTP_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}")  # RFC 9110's token, at most 64 long
# Headers a route may not set: they frame or route the request (a second Host or Content-Length
# is a smuggling primitive), or are hop-by-hop and dropped by the proxy anyway.
RESERVED_HEADERS = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "te", "trailer", "upgrade", "expect"}
)
SECRET_FIELD = "{secret}"  # noqa: S105 - the placeholder a route's format puts the secret at
FORMAT = re.compile(r"[ -~]{1,1024}")  # printable ASCII: a header value, before the secret is put in
RFC3339_UTC = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]{1,6})?(?:Z|\+00:00)")


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True, slots=True, kw_only=True)
class NetworkKeys:
    """A profile's `network` section beside `default` (always deny)."""

    egress: tuple[EgressRule, ...] = ()
    routes: tuple[str, ...] = ()
    limits: Limits = DEFAULT_LIMITS
    publish: Literal["none", "loopback"] = "none"


def parse_network(doc: Doc, node: YNode, extension: str) -> NetworkKeys:
    """`network`: default (deny only), egress rules, the routes the profile opts into by name, the
    proxy's limits, and publish (none, or loopback: a manifest's published_ports). A well-formed
    setting nothing can honour is recorded on `doc.forbidden` (exit 3), after every structural
    check."""
    network = doc.mapping(node, "network", ("default", "egress"), ("routes", "limits", "publish"))
    default_node = network["default"]
    default = doc.string(default_node, "network.default")
    if default not in ("deny", "allow"):
        raise doc.fail(default_node.mark, "network.default", "must be deny or allow")
    if default != "deny":
        doc.forbid(
            default_node.mark,
            "network.default",
            f"must be deny for {extension}: there is no allow-everything; list hosts in network.egress",
        )
    egress = _egress(doc, network["egress"])
    routes = _route_names(doc, network["routes"]) if "routes" in network else ()
    limits = _limits(doc, network["limits"]) if "limits" in network else DEFAULT_LIMITS
    publish: Literal["none", "loopback"] = "none"
    if "publish" in network:
        publish_node = network["publish"]
        value = doc.string(publish_node, "network.publish")
        if value not in PUBLISH_VALUES:
            raise doc.fail(publish_node.mark, "network.publish", "must be none or loopback")
        publish = "loopback" if value == "loopback" else "none"
    return NetworkKeys(egress=egress, routes=routes, limits=limits, publish=publish)


def _host(doc: Doc, node: YNode, path: str, *, exact: bool) -> str:
    """A rule's or route's host, lower-cased: a DNS name the proxy can match, a `*.suffix` (not
    `exact`), or a canonical IP literal (not `exact`)."""
    value = doc.string(node, path)
    if value.strip() == "*":
        raise doc.fail(node.mark, path, "there is no allow-everything: name each host (exact, or *.suffix)")
    host = value.lower()
    if host.startswith("*."):
        if exact:
            raise doc.fail(node.mark, path, "must be one exact DNS name (no *. wildcard)")
        suffix = host[2:]
        problem = "an IP literal" if parse_address(suffix) is not None else host_problem(suffix)
        if problem is not None:
            raise doc.fail(node.mark, path, f"a *.suffix must be followed by a DNS name (here: {problem})")
        if "." not in suffix:
            raise doc.fail(node.mark, path, "a *.suffix must keep at least two labels (*.example.com, not *.com)")
        return host
    address = parse_address(host)
    if address is not None:
        if exact:
            raise doc.fail(node.mark, path, "must be a DNS name, not an IP literal")
        if str(address) != host:
            raise doc.fail(node.mark, path, "an IP literal must be in canonical form (no brackets, zeros or zone)")
        return host
    problem = host_problem(host)
    if problem is not None:
        rule = "must be a DNS name" if exact else "must be a DNS name, *.suffix or canonical IP literal"
        raise doc.fail(node.mark, path, f"{rule} ({problem})")
    return host


def _egress(doc: Doc, node: YNode) -> tuple[EgressRule, ...]:
    seen: dict[str, str] = {}

    def rule(entry: YNode, path: str) -> EgressRule:
        body = doc.mapping(entry, path, ("host", "ports"), ("addresses",))
        host = _host(doc, body["host"], f"{path}.host", exact=False)
        if host in seen:
            raise doc.fail(body["host"].mark, f"{path}.host", f"duplicate host (also in {seen[host]}): merge the ports")
        seen[host] = path
        ports = _unique(doc, body["ports"], f"{path}.ports", lambda n, p: doc.integer(n, p, PORT_RANGE), "port")
        if not ports:
            raise doc.fail(body["ports"].mark, f"{path}.ports", "must list at least one port")
        addresses: tuple[str, ...] = ()
        if "addresses" in body:
            if parse_address(host) is not None:
                raise doc.fail(body["addresses"].mark, f"{path}.addresses", "an IP literal host is its own address")
            listed = body["addresses"]
            addresses = _unique(doc, listed, f"{path}.addresses", lambda n, p: _address(doc, n, p), "address")
            if not addresses:
                raise doc.fail(body["addresses"].mark, f"{path}.addresses", "must list an address, or be left out")
        return EgressRule(host=host, ports=ports, addresses=addresses)

    return doc.sequence(node, "network.egress", rule)


def _address(doc: Doc, node: YNode, path: str) -> str:
    value = doc.string(node, path)
    address = parse_address(value)
    if address is None or str(address) != value:
        raise doc.fail(node.mark, path, "must be an IP address in canonical form (no brackets, zeros or zone)")
    return value


def _route_names(doc: Doc, node: YNode) -> tuple[str, ...]:
    def name(entry: YNode, path: str) -> str:
        return doc.string(entry, path, ROUTE_NAME, "must be a route name: 1-63 of a-z 0-9 _ -")

    return _unique(doc, node, "network.routes", name, "route")


def _limits(doc: Doc, node: YNode) -> Limits:
    raw = doc.mapping(node, "network.limits", (), tuple(LIMIT_RANGES))
    found = {key: doc.integer(raw[key], f"network.limits.{key}", LIMIT_RANGES[key]) for key in raw}
    default = DEFAULT_LIMITS
    return Limits(
        connections=found.get("connections", default.connections),
        mib=found.get("mib", default.mib),
        seconds=found.get("seconds", int(default.seconds)),
    )


def _unique(doc: Doc, node: YNode, path: str, item: Callable[[YNode, str], T], what: str) -> tuple[T, ...]:
    """A list read item by item, refusing an item equal to one before it."""
    values = doc.sequence(node, path, item)
    entries = node.items if isinstance(node, YSeq) else ()  # doc.sequence refused anything else
    for index, (value, entry) in enumerate(zip(values, entries, strict=True)):
        if value in values[:index]:
            raise doc.fail(entry.mark, f"{path}[{index}]", f"duplicate {what}")
    return values


def parse_routes(doc: Doc, node: YNode) -> Mapping[str, Route]:
    """`config.routes`: the extension's credential routes by name. Each names its secret file;
    the file is read by the proxy per request, and only checked (never read) at approval."""
    if not isinstance(node, YMap):
        raise doc.fail(node.mark, "config.routes", "must be a mapping of route names to routes")
    routes: dict[str, Route] = {}
    hosts: dict[str, str] = {}
    for name, name_mark, value in node.items:
        path = f"config.routes.{name}"
        if not ROUTE_NAME.fullmatch(name):
            raise doc.fail(name_mark, path, "a route name must be 1-63 of a-z 0-9 _ -")
        body = doc.mapping(value, path, ("host", "header", "secret_file"), ("format", "expires_at"))
        host = _host(doc, body["host"], f"{path}.host", exact=True)
        if host in hosts:
            raise doc.fail(body["host"].mark, f"{path}.host", f"another route ({hosts[host]}) has this host")
        hosts[host] = name
        routes[name] = Route(
            name=name,
            host=host,
            header=_header(doc, body["header"], f"{path}.header"),
            format=_format(doc, body["format"], f"{path}.format") if "format" in body else SECRET_FIELD,
            secret_file=doc.absolute_path(body["secret_file"], f"{path}.secret_file"),
            expires_at=_moment(doc, body["expires_at"], f"{path}.expires_at") if "expires_at" in body else None,
        )
    return types.MappingProxyType(routes)


def _header(doc: Doc, node: YNode, path: str) -> str:
    value = doc.string(node, path, HTTP_TOKEN, "must be an HTTP header name (a token: letters, digits, - and the like)")
    lower = value.lower()
    if lower in RESERVED_HEADERS or lower.startswith("proxy-"):
        raise doc.fail(node.mark, path, "must not be Host, Content-Length, Transfer-Encoding, Proxy-* or hop-by-hop")
    return value


def _format(doc: Doc, node: YNode, path: str) -> str:
    value = doc.string(node, path, FORMAT, "must be 1-1024 printable ASCII characters")
    if value.count(SECRET_FIELD) != 1:
        raise doc.fail(node.mark, path, f"must contain {SECRET_FIELD} exactly once")
    return value


def _moment(doc: Doc, node: YNode, path: str) -> float:
    rule = 'must be an RFC 3339 time in UTC, quoted ("2099-01-01T00:00:00Z")'
    value = doc.string(node, path, RFC3339_UTC, rule)
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:  # the right shape, not a real date (a 13th month, a 31st of April)
        raise doc.fail(node.mark, path, rule) from None
