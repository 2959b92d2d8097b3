"""Credential routes: a CONNECT to a routed host is terminated with TLS by the proxy, with a
certificate from the sandbox's own CA, so the proxy can set the route's header on each request
and the secret never enters the sandbox (there it is only the placeholder
`sandboxer-route:<name>`, which the header replaces).

Each inner request is checked again (`Tunnel.recheck`: the rule, the route, its expiry), its
Host must be the tunnel's host (a tunnel to the routed host is no way to send its secret to
another), the secret is read from the owner's file at that moment, and the request goes to the
real host over a new TLS connection verified against the host's trust store. The secret is never
in an error, a reason or a log line: a bad secret file is reported by the route's name only.

An upstream could send the secret back (an endpoint that echoes request headers, a debugging
page): every response is screened (`SecretScreen`: its head, then its body through a window as
long as the secret, ignoring case) before the client sees it, and the connection is cut where
the secret appears. So that the sandbox cannot have the echo come back in a form the screen does
not read, a routed request asks for no encoding (`Accept-Encoding: identity`) and no range
(`Range`, `If-Range` dropped), and an encoded response is cut. A secret the upstream transforms
of its own accord is not recognised: the route's host is one the owner already trusts with it.
"""

from __future__ import annotations

import asyncio
import os
import re
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import h11

from sandboxer.core.egress.policy import Decision, Route, normalise_host, route_expired
from sandboxer.service.egress.exchange import relay, upstream_connection, upstream_request
from sandboxer.service.egress.heads import MAX_HEAD, HttpPeer, Refusal, split_authority
from sandboxer.service.egress.session import Session

HANDSHAKE_SECONDS = 10.0
# A response head's Content-Encoding other than identity (the screen sees "name: value" lines).
_ENCODED = re.compile(rb"(?m)^content-encoding:[ \t]*(?!identity[ \t]*$)\S")
# What a routed request may not ask of the upstream: a form of the response the screen cannot read.
_UNREADABLE = (b"range", b"if-range")
MAX_SECRET = 64 * 1024
# Control characters (but tab) cannot be in a header value: CR and LF would inject headers, and
# h11 refuses the rest with a message that quotes the value, secret and all.
_FORBIDDEN_IN_HEADER = frozenset(set(range(0x20)) - {0x09} | {0x7F})


@dataclass(frozen=True, slots=True, kw_only=True)
class Tunnel:
    """A routed CONNECT as the proxy hands it over: the host and port, `recheck` (the decision
    for this host now, raising `Refusal` when it no longer allows), `connect` (a verified TLS
    connection to the real host, its addresses found and checked again under that decision),
    and the session whose bytes it counts."""

    host: str
    port: int
    recheck: Callable[[], Decision]
    connect: Callable[[Decision], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]
    session: Session


def read_secret(route: Route) -> bytes:
    """The route's secret, read now (trailing newline stripped); `Refusal` naming the route only."""
    try:
        fd = os.open(route.secret_file, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            data = os.read(fd, MAX_SECRET + 1)
        finally:
            os.close(fd)
    except OSError:
        raise Refusal(502, f"route {route.name}: secret unreadable") from None
    secret = data.strip(b" \t\r\n")  # a field value has no leading or trailing whitespace
    if not secret or len(data) > MAX_SECRET or _FORBIDDEN_IN_HEADER & set(secret):
        raise Refusal(502, f"route {route.name}: secret malformed")
    return secret


def route_header(route: Route, secret: bytes) -> tuple[bytes, bytes]:
    """(name, value) of the header the route sets, `secret` in it."""
    return route.header.strip().lower().encode(), route.format.encode().replace(b"{secret}", secret)


class SecretScreen:
    """Looks at what an upstream sends back, in order, for the secret; `Refusal` where it appears."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret.lower()
        self._tail = b""  # the last bytes seen, one fewer than the secret: it may straddle two parts
        self._head_seen = False

    def __call__(self, part: bytes) -> None:
        window = self._tail + part.lower()
        if not self._head_seen:  # the first part is the response's head (exchange.relay)
            self._head_seen = True
            if _ENCODED.search(window):
                raise Refusal(502, "upstream sent an encoded response to a routed request")
        if self._secret in window:
            raise Refusal(502, "upstream sent the route's secret back")
        self._tail = window[-(len(self._secret) - 1) :] if len(self._secret) > 1 else b""


def _check_inner(request: h11.Request, tunnel: Tunnel) -> None:
    if request.method.upper() in (b"TRACE", b"TRACK"):  # they echo the request, the secret with it
        raise Refusal(405, "TRACE on a routed host")
    if any(k == b"transfer-encoding" for k, _ in request.headers) and any(
        k == b"content-length" for k, _ in request.headers
    ):
        raise Refusal(400, "Transfer-Encoding with Content-Length")
    if not request.target.startswith(b"/"):
        raise Refusal(400, "inner request not in origin-form")
    hosts = [value for key, value in request.headers if key == b"host"]
    try:
        named = split_authority(hosts[0].decode("ascii"), default_port=tunnel.port) if len(hosts) == 1 else None
    except (Refusal, UnicodeDecodeError):
        named = None
    if named is None or normalise_host(named[0]) != tunnel.host or named[1] != tunnel.port:
        raise Refusal(403, "Host differs from the routed tunnel")


async def serve_routed(
    tunnel: Tunnel, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server_ssl: ssl.SSLContext
) -> None:
    """Terminate TLS on the client's tunnel and relay its requests one at a time, each with the
    route's header set, until the client closes or a request is refused."""
    await writer.start_tls(server_ssl, ssl_handshake_timeout=HANDSHAKE_SECONDS)
    client = HttpPeer(
        reader, writer, h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD), tunnel.session.count_sent
    )
    while True:
        event = await client.next_event()
        if isinstance(event, h11.ConnectionClosed):
            return
        if not isinstance(event, h11.Request):
            raise Refusal(400, "malformed request")
        tunnel.session.answered = False
        _check_inner(event, tunnel)
        decision = tunnel.recheck()
        if decision.route is None:  # recheck refuses a host without its route
            raise Refusal(403, "route removed")
        if route_expired(decision.route, time.time()):
            raise Refusal(403, "route expired")
        secret = read_secret(decision.route)
        asked = h11.Request(
            method=event.method,
            target=event.target,
            headers=[(key, value) for key, value in event.headers if key not in _UNREADABLE],
        )
        plain = (b"accept-encoding", b"identity")
        outgoing = upstream_request(
            asked,
            event.target,
            host=f"{tunnel.host}:{tunnel.port}",
            set_headers=(plain, route_header(decision.route, secret)),
        )
        upstream_reader, upstream_writer = await tunnel.connect(decision)
        upstream = HttpPeer(upstream_reader, upstream_writer, upstream_connection(), tunnel.session.count_received)
        try:
            await relay(client, upstream, outgoing, keep_alive=True, screen=SecretScreen(secret))
        finally:
            upstream_writer.close()
        if client.conn.our_state is not h11.DONE or client.conn.their_state is not h11.DONE:
            return
        client.conn.start_next_cycle()
