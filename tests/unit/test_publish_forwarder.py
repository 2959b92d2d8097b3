"""A published port's connections end when nobody uses them, and the service's ports together hold
at most a budget of them: the real PortForwarder and splice on real loopback sockets, with a
server on 127.0.0.1 standing in for the sandbox's side (host/inside_sockets.py makes that socket
in a real sandbox: tests/integration/test_publish.py)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import pytest

from sandboxer.service.publish import forwarder as forwarding
from sandboxer.service.publish.forwarder import Budget, PortForwarder
from sandboxer.service.splice import splice


class Loopback:
    """The sandbox's side, played by a listener on the host's 127.0.0.1 that echoes what it reads
    and keeps each connection open until the client ends it."""

    def __init__(self) -> None:
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._echo, "127.0.0.1", 0)
        self.port = int(self.server.sockets[0].getsockname()[1])

    async def _echo(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(4096):
            writer.write(data)
            await writer.drain()
        writer.close()

    async def connect(self, port: int) -> socket.socket:
        made = socket.create_connection(("127.0.0.1", self.port))
        made.setblocking(False)
        return made

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def run(body: Callable[[Loopback], Awaitable[None]]) -> None:
    async def main() -> None:
        inside = Loopback()
        await inside.start()
        try:
            await body(inside)
        finally:
            inside.close()

    asyncio.run(main())


def forwarder_of(inside: Loopback, budget: Budget) -> PortForwarder:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    made = PortForwarder(listener, 8000, inside, budget)  # type: ignore[arg-type]  # duck-typed inside
    made.start()
    return made


async def ended(reader: asyncio.StreamReader, within: float) -> bool:
    """Whether the connection ends (EOF or a reset) within `within` seconds."""
    try:
        return await asyncio.wait_for(reader.read(4096), within) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_a_connection_that_passes_no_byte_ends_after_the_idle_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(forwarding, "IDLE_SECONDS", 0.3)

    async def body(inside: Loopback) -> None:
        port = forwarder_of(inside, Budget())
        reader, writer = await asyncio.open_connection("127.0.0.1", port.host)
        for _ in range(4):  # used: kept past the idle time
            writer.write(b"ping")
            await writer.drain()
            assert await reader.readexactly(4) == b"ping"
            await asyncio.sleep(0.15)
        assert await ended(reader, 2.0)  # then quiet: ended
        writer.close()
        await port.close()

    run(body)


def test_a_half_closed_connection_ends_after_its_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(forwarding, "HALF_CLOSED_SECONDS", 0.3)

    async def body(inside: Loopback) -> None:
        port = forwarder_of(inside, Budget())
        reader, writer = await asyncio.open_connection("127.0.0.1", port.host)
        writer.write(b"bye")
        writer.write_eof()  # the client is done; the stand-in never ends its side of the pair
        assert await reader.readexactly(3) == b"bye"
        assert await ended(reader, 2.0)
        writer.close()
        await port.close()

    run(body)


def test_the_services_budget_refuses_connections_past_it() -> None:
    async def body(inside: Loopback) -> None:
        budget = Budget(limit=1)
        first, second = forwarder_of(inside, budget), forwarder_of(inside, budget)
        reader, writer = await asyncio.open_connection("127.0.0.1", first.host)
        writer.write(b"one")
        assert await reader.readexactly(3) == b"one"
        assert budget.used == 1
        refused_reader, refused_writer = await asyncio.open_connection("127.0.0.1", second.host)
        assert await ended(refused_reader, 2.0)  # another port of the same service: no room
        assert second.refused == 1
        writer.close()
        refused_writer.close()
        deadline = asyncio.get_running_loop().time() + 2
        while budget.used and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        assert budget.used == 0  # given back when the connection ended
        await first.close()
        await second.close()

    run(body)


def test_splice_without_limits_waits_for_both_ends() -> None:
    """The egress proxy's tunnels pass no limits: a quiet connection is not ended by splice."""

    async def body(inside: Loopback) -> None:
        server_side: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        server = await asyncio.start_server(lambda r, w: server_side.append((r, w)), "127.0.0.1", 0)
        port = int(server.sockets[0].getsockname()[1])
        client = await asyncio.open_connection("127.0.0.1", port)
        upstream = await asyncio.open_connection("127.0.0.1", inside.port)
        accepted = await _first(server_side)
        spliced = asyncio.create_task(splice(accepted, upstream))
        await asyncio.sleep(0.5)
        assert not spliced.done()
        client[1].close()
        await asyncio.wait_for(spliced, 5)
        for _, writer in (accepted, upstream):
            writer.close()
        server.close()
        await server.wait_closed()

    run(body)


async def _first(
    accepted: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]],
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    while not accepted:
        await asyncio.sleep(0.01)
    return accepted[0]
