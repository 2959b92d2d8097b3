"""Loopback servers and a running proxy for the egress tests: every socket is on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandboxer.commands.logs import ACCESS_LOG, REFUSED_LOG, read_report
from sandboxer.core.egress.policy import EgressPolicy, EgressRule, Limits
from sandboxer.service.egress.proxy import EgressProxy
from sandboxer.service.egress.report import AccessLog

LOOPBACK = "127.0.0.1"
WAIT = 2.0


def pinned(host: str, port: int, **limits: float) -> EgressPolicy:
    """A policy allowing `host`:`port`, pinned to 127.0.0.1 (the explicit-address exemption)."""
    return EgressPolicy(rules=(EgressRule(host=host, ports=(port,), addresses=(LOOPBACK,)),), limits=Limits(**limits))


@dataclass
class Holder:
    """What `policy_source` returns; a test swaps `policy` to revoke."""

    policy: EgressPolicy
    asked: int = 0

    def __call__(self) -> EgressPolicy:
        self.asked += 1
        return self.policy


async def refusing_resolver(host: str, port: int) -> Sequence[str]:
    """No DNS in the tests: a name the rule does not pin does not resolve."""
    raise OSError(f"no resolution in tests: {host}")


async def loopback_resolver(host: str, port: int) -> Sequence[str]:
    """A resolver that says every name is 127.0.0.1 (a rebinding DNS server, say)."""
    return [LOOPBACK]


@dataclass
class Upstream:
    """A loopback server: `port`, and the raw bytes each connection sent (`seen`)."""

    port: int
    seen: list[bytes] = field(default_factory=list)


async def _read_head(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    length = next((int(line.split(b":")[1]) for line in lines if line.startswith(b"content-length:")), 0)
    return head + (await reader.readexactly(length) if length else b"")


@contextlib.asynccontextmanager
async def http_upstream(
    body: bytes = b"hello",
    *,
    tls: ssl.SSLContext | None = None,
    respond: Callable[[bytes], Sequence[bytes]] | None = None,
) -> AsyncIterator[Upstream]:
    """An HTTP/1.1 server answering every request with 200 and `body` (or with the pieces
    `respond` makes of the request, sent one at a time), keeping what it got."""
    upstream = Upstream(port=0)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await _read_head(reader)
            upstream.seen.append(request)
            ok = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
            for index, piece in enumerate(respond(request) if respond is not None else [ok]):
                if index:
                    await asyncio.sleep(0.05)  # each piece its own read at the other end
                writer.write(piece)
                await writer.drain()
        except Exception:  # noqa: S110 - the client went away: nothing to answer
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, LOOPBACK, 0, ssl=tls)
    upstream.port = server.sockets[0].getsockname()[1]
    async with server:
        yield upstream


@contextlib.asynccontextmanager
async def echo_upstream() -> AsyncIterator[Upstream]:
    """A TCP server echoing every byte until the client's EOF."""
    upstream = Upstream(port=0)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            while data := await reader.read(65536):
                upstream.seen.append(data)
                writer.write(data)
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, LOOPBACK, 0)
    upstream.port = server.sockets[0].getsockname()[1]
    async with server:
        yield upstream


@contextlib.asynccontextmanager
async def running_proxy(holder: Holder, report: Path, **options: object) -> AsyncIterator[tuple[EgressProxy, int]]:
    """An EgressProxy on a loopback listener, its access report in the directory `report`: (the
    proxy, its port)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((LOOPBACK, 0))
    listener.listen()
    options.setdefault("resolver", refusing_resolver)
    proxy = EgressProxy(holder, access_log(report), **options)  # type: ignore[arg-type]
    await proxy.start(listener)
    try:
        yield proxy, listener.getsockname()[1]
    finally:
        await proxy.close()


async def exchange(port: int, data: bytes) -> bytes:
    """Send `data` to the proxy and read until it closes."""
    reader, writer = await asyncio.open_connection(LOOPBACK, port)
    writer.write(data)
    await writer.drain()
    try:
        async with asyncio.timeout(WAIT):
            return await reader.read(-1)
    finally:
        writer.close()


async def connect_tunnel(port: int, authority: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    """CONNECT through the proxy: the streams and the proxy's answer head."""
    reader, writer = await asyncio.open_connection(LOOPBACK, port)
    writer.write(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
    async with asyncio.timeout(WAIT):
        head = await reader.readuntil(b"\r\n\r\n")
    return reader, writer, head


async def wait_until(predicate: Callable[[], bool], seconds: float = WAIT) -> None:
    """Poll a condition until it holds."""
    async with asyncio.timeout(seconds):
        while not predicate():
            await asyncio.sleep(0.005)


def access_log(directory: Path) -> AccessLog:
    """An access report in `directory`, with the service's file names."""
    return AccessLog(str(directory / ACCESS_LOG), str(directory / REFUSED_LOG))


def report_lines(directory: Path) -> list[dict[str, Any]]:
    """The access report in `directory`, oldest first, as its lines' documents."""
    return [entry.to_json() for entry in read_report(str(directory))]


def report_text(directory: Path) -> str:
    """Everything the access report in `directory` holds, both files, as text."""
    return "".join(path.read_text() for path in sorted(directory.glob("network*.jsonl*")))
