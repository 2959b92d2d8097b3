"""Reading a client's request head with h11 and finding what it asks the proxy for.

h11 does the HTTP/1.1 grammar (and refuses a second Host header, a malformed line, a head past
MAX_HEAD); what a proxy must refuse on top of it is written here: Transfer-Encoding together with
Content-Length (h11 lets the first win, but a proxy in front of a server that picks the other
is the classic smuggling gap), an absolute URI whose authority disagrees with Host (which of the
two would the upstream obey?), userinfo in a URI, and origin-form requests, which name no target.
A refusal carries a fixed phrase, never something the client sent: it is reported and answered.
"""

from __future__ import annotations

import asyncio
import http
from collections.abc import Callable
from dataclasses import dataclass

import h11

from sandboxer.core.egress.policy import normalise_host

MAX_HEAD = 16 * 1024
READ_CHUNK = 64 * 1024
# What HttpPeer asks its stream for: more than the stream ever buffers (flow control pauses it
# well before), so each read empties the buffer and every byte the client sent so far is in
# h11's hands (`trailing_data`) when a CONNECT head is parsed; none is left behind in the stream.
DRAIN = 1024 * 1024


class Refusal(Exception):
    """A request the proxy answers with `status` and reports with `reason` (a fixed phrase)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class LimitReached(Exception):
    """The sandbox's byte allowance is spent: the connection is closed, not answered."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """What a request asks the proxy for: CONNECT's authority, or an absolute URI's host, port
    and the origin-form path to send upstream."""

    host: str
    port: int
    connect: bool
    path: bytes = b""


def error_response(status: int, reason: str) -> bytes:
    """A whole `Connection: close` answer, written raw: it must go out even after h11 gave up."""
    body = f"sandboxer egress: {reason}\n".encode()
    phrase = http.HTTPStatus(status).phrase
    head = f"HTTP/1.1 {status} {phrase}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
    return head.encode() + b"Connection: close\r\n\r\n" + body


def _h11_refusal(exc: h11.RemoteProtocolError) -> Refusal:
    """A fixed phrase for what h11 refused (its own message may quote the client's bytes)."""
    text = str(exc)
    if exc.error_status_hint == 431 or "exceeded" in text:
        return Refusal(431, "header block too large")
    if "multiple Host" in text:
        return Refusal(400, "two Host headers")
    if "Missing mandatory Host" in text:
        return Refusal(400, "no Host header")
    if "Content-Length" in text or "Transfer-Encoding" in text:
        return Refusal(400, "bad message framing")
    return Refusal(400, "malformed request")


class HttpPeer:
    """One side of an HTTP/1.1 conversation: a stream and its h11 state machine. Every byte read
    is passed to `count` first (the proxy's byte accounting, which may raise to stop it)."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        conn: h11.Connection,
        count: Callable[[int], None],
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.conn = conn
        self.count = count

    async def next_event(self) -> h11.Event | type[h11.PAUSED]:
        """The next event, reading as much as it takes; h11's refusals become `Refusal`."""
        while True:
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError as exc:
                raise _h11_refusal(exc) from None
            if event is not h11.NEED_DATA:
                return event  # type: ignore[return-value]
            data = await self.reader.read(DRAIN)
            self.count(len(data))
            self.conn.receive_data(data)

    async def send(self, event: h11.Event) -> None:
        """Write one event and wait until the stream takes it (backpressure)."""
        data = self.conn.send(event)
        if data:
            self.writer.write(data)
            await self.writer.drain()


def split_authority(text: str, *, default_port: int | None) -> tuple[str, int]:
    """(host, port) of `host:port`, `[v6]:port` (or without the port when there is a default)."""
    if "@" in text:
        raise Refusal(400, "userinfo in authority")
    host, port_text = text, ""
    if text.startswith("["):
        end = text.find("]")
        after = text[end + 1 :]
        if end < 0 or (after and not after.startswith(":")):
            raise Refusal(400, "malformed authority")
        host, port_text = text[: end + 1], after[1:]
    elif ":" in text:
        host, _, port_text = text.partition(":")
    if not host or ":" in port_text or (":" in host and not host.startswith("[")):
        raise Refusal(400, "malformed authority")
    if not port_text:
        if default_port is None or text.endswith(":"):
            raise Refusal(400, "no port in authority")
        return host, default_port
    if not port_text.isascii() or not port_text.isdigit() or len(port_text) > 5 or not 0 < int(port_text) < 65536:
        raise Refusal(400, "malformed port")
    return host, int(port_text)


def _header_values(request: h11.Request, name: bytes) -> list[bytes]:
    return [value for key, value in request.headers if key == name]


def _same_authority(a: tuple[str, int], b: tuple[str, int]) -> bool:
    return normalise_host(a[0]) == normalise_host(b[0]) and a[1] == b[1]


def request_target(request: h11.Request) -> Target:
    """What the request asks the proxy for, refusing the ambiguous forms (module docstring)."""
    if _header_values(request, b"transfer-encoding") and _header_values(request, b"content-length"):
        raise Refusal(400, "Transfer-Encoding with Content-Length")
    hosts = _header_values(request, b"host")
    if len(hosts) > 1:
        raise Refusal(400, "two Host headers")
    try:
        raw = request.target.decode("ascii")
        host_header = hosts[0].decode("ascii") if hosts else None
    except UnicodeDecodeError:
        raise Refusal(400, "malformed request target") from None
    if request.method == b"CONNECT":
        host, port = split_authority(raw, default_port=None)
        if host_header is not None:
            named = split_authority(host_header, default_port=port)
            if not _same_authority(named, (host, port)):
                raise Refusal(400, "CONNECT target disagrees with Host")
        return Target(host=host, port=port, connect=True)
    if raw.startswith("/") or raw == "*":
        raise Refusal(400, "no proxy target (origin-form request)")
    scheme, separator, rest = raw.partition("://")
    if not separator or scheme.lower() != "http":
        raise Refusal(400, "only http:// URIs are forwarded; use CONNECT for TLS")
    if "#" in rest:
        raise Refusal(400, "fragment in request target")
    cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    authority, path = rest[:cut], rest[cut:]
    host, port = split_authority(authority, default_port=80)
    if host_header is not None and not _same_authority(split_authority(host_header, default_port=80), (host, port)):
        raise Refusal(400, "absolute URI disagrees with Host")
    if not path.startswith("/"):
        path = "/" + path
    return Target(host=host, port=port, connect=False, path=path.encode("ascii"))
