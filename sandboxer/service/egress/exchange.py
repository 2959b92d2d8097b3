"""One HTTP request relayed upstream and its response relayed back, event by event through h11
on both sides (never bytes copied blindly: each side's framing is checked and rewritten by h11,
so a body cannot spill into a second request).

Used for plain-HTTP forwarding (one request per client connection) and inside a credential
route's terminated TLS (one request per upstream connection, the client's kept alive). Upstream
always gets `Connection: close`: one request per upstream connection keeps the state small and
the policy re-read per request meaningful.
"""

from __future__ import annotations

from collections.abc import Callable

import h11

from sandboxer.service.egress.heads import HttpPeer, Refusal

# Hop-by-hop headers (RFC 9110 7.6.1) and the proxy's own: never passed on. Expect is answered
# here (100 Continue) rather than forwarded, since the body is read before the upstream answers.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authorization",
        b"proxy-authenticate",
        b"te",
        b"trailer",
        b"upgrade",
        b"expect",
    }
)

Headers = list[tuple[bytes, bytes]]
Screen = Callable[[bytes], None]  # sees each part of a response before the client does; raises Refusal
MAX_UPSTREAM_HEAD = 64 * 1024


class ResponseStarted(Exception):
    """The upstream failed after the client had part of its response: nothing can be answered."""


def _passed_on(headers: Headers) -> Headers:
    """The end-to-end headers: hop-by-hop ones and those the Connection header names dropped."""
    named = {token.strip().lower() for key, value in headers if key == b"connection" for token in value.split(b",")}
    return [(key, value) for key, value in headers if key not in HOP_BY_HOP and key not in named]


def upstream_connection() -> h11.Connection:
    """The h11 state machine for an upstream: heads up to MAX_UPSTREAM_HEAD (servers' cookies and
    CSP headers outgrow the 16 KiB a sandbox's request may have)."""
    return h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_UPSTREAM_HEAD)


def upstream_request(
    request: h11.Request, path: bytes, *, host: str, set_headers: tuple[tuple[bytes, bytes], ...] = ()
) -> h11.Request:
    """The request as sent upstream: origin-form `path`, end-to-end headers, each of `set_headers`
    replacing every header of its name, a Host (`host` when the client sent none, as HTTP/1.0
    may) and `Connection: close`."""
    headers = _passed_on(list(request.headers))
    for set_header in set_headers:
        name = set_header[0].lower()
        headers = [(key, value) for key, value in headers if key != name] + [set_header]
    if not any(key == b"host" for key, _ in headers):
        headers.insert(0, (b"host", host.encode("ascii")))
    return h11.Request(method=request.method, target=path, headers=[*headers, (b"connection", b"close")])


async def relay(
    client: HttpPeer, upstream: HttpPeer, outgoing: h11.Request, *, keep_alive: bool, screen: Screen | None = None
) -> None:
    """Send `outgoing` and the client's body upstream, then the upstream's response to the client
    (every part of it shown to `screen` first). `Refusal` before the response started
    (answerable), `ResponseStarted` after."""
    if client.conn.client_is_waiting_for_100_continue:
        await client.send(h11.InformationalResponse(status_code=100, headers=[]))
    try:
        await _send_body(client, upstream, outgoing)
    except (OSError, h11.LocalProtocolError):
        raise Refusal(502, "upstream failed") from None  # h11's message may quote a header value
    started: list[bool] = []
    try:
        await _relay_response(client, upstream, started, keep_alive=keep_alive, screen=screen)
    except Refusal as exc:
        if started:
            raise ResponseStarted(exc.reason) from None
        raise Refusal(502, exc.reason if exc.status == 502 else "upstream answered malformed HTTP") from None
    except (OSError, h11.LocalProtocolError):
        if started:
            raise ResponseStarted("upstream failed") from None
        raise Refusal(502, "upstream failed") from None  # h11's message may quote a header value


async def _send_body(client: HttpPeer, upstream: HttpPeer, outgoing: h11.Request) -> None:
    await upstream.send(outgoing)
    while True:
        event = await client.next_event()
        if isinstance(event, h11.Data):
            await upstream.send(h11.Data(data=event.data))
        elif isinstance(event, h11.EndOfMessage):
            await upstream.send(h11.EndOfMessage())
            return
        else:
            raise Refusal(400, "request body ended early")


async def _relay_response(
    client: HttpPeer, upstream: HttpPeer, started: list[bool], *, keep_alive: bool, screen: Screen | None
) -> None:
    """Relay the response; `started` gets an item once the client has its head."""
    look = screen if screen is not None else _unscreened
    while True:
        event = await upstream.next_event()
        if isinstance(event, h11.InformationalResponse):
            continue  # 100 Continue was answered here; other 1xx are not passed on
        if isinstance(event, h11.Response):
            headers = _passed_on(list(event.headers))
            look(b"\n".join([event.reason, *(key + b": " + value for key, value in headers)]))
            if not keep_alive:
                headers.append((b"connection", b"close"))
            started.append(True)
            await client.send(h11.Response(status_code=event.status_code, headers=headers, reason=event.reason))
        elif isinstance(event, h11.Data):
            look(bytes(event.data))
            await client.send(h11.Data(data=event.data))
        elif isinstance(event, h11.EndOfMessage):
            await client.send(h11.EndOfMessage())
            return
        else:
            raise Refusal(502, "upstream closed before its response")


def _unscreened(_: bytes) -> None:
    return None
