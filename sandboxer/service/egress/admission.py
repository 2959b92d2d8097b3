"""How a sandbox's connections are let in: paced, and turned away past its limits at the cost of
a descriptor for a moment at most.

A sandbox could otherwise open connections as fast as its CPU allows, each one a descriptor and a
task in the service, which serves every other sandbox too. So the proxy takes new connections at
ACCEPT_RATE a second (bursts of ACCEPT_BURST); the rest wait in the kernel's listen queue, which
is the sandbox's (inside its network namespace), not the service's. A connection past the
sandbox's limits (concurrent connections, bytes) is answered and closed at once; the first
LINGERING of them at a time are read until the client closes (at most LINGER_SECONDS: closing
with a request unread resets the connection, and the reset can overtake the answer), the others
closed without waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable

from sandboxer.host.inside_sockets import readable
from sandboxer.service.egress.heads import READ_CHUNK

Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]

ACCEPT_RATE = 1000.0  # new connections a second, per sandbox
ACCEPT_BURST = 200
LINGERING = 8  # turned-away connections answered and drained at once, per sandbox
LINGER_SECONDS = 1.0


class Pace:
    """A token bucket: `delay` says how long until the next connection may be taken."""

    def __init__(
        self, rate: float = ACCEPT_RATE, burst: int = ACCEPT_BURST, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._tokens = float(burst)
        self._stamp = clock()

    def delay(self) -> float:
        """0 when a connection may be taken now (and it is counted), else the seconds to wait."""
        now = self._clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now
        if self._tokens >= 1:
            self._tokens -= 1
            return 0.0
        return (1 - self._tokens) / self.rate


class TurnAway:
    """Answers and closes the connections a proxy will not serve, lingering on a few at a time."""

    def __init__(self) -> None:
        self._lingering: set[asyncio.Task[None]] = set()

    def __call__(self, conn: socket.socket, answer: bytes) -> None:
        """Answer `conn` with `answer` and close it (now, or after a short linger)."""
        if len(self._lingering) >= LINGERING:
            _close_at_once(conn, answer)
            return
        task = asyncio.create_task(_linger(conn, answer))
        self._lingering.add(task)
        task.add_done_callback(self._lingering.discard)

    @property
    def lingering(self) -> int:
        """Turned-away connections being drained now."""
        return len(self._lingering)

    async def close(self) -> None:
        """Stop lingering: every connection still answered is closed."""
        for task in self._lingering:
            task.cancel()
        await asyncio.gather(*self._lingering, return_exceptions=True)


async def server_streams(conn: socket.socket, *, limit: int = 2**16) -> Streams:
    """Streams over an accepted connection, the server's side (so `start_tls` on its writer
    terminates TLS: asyncio.open_connection would make them a client's)."""
    loop = asyncio.get_running_loop()
    connected: asyncio.Future[asyncio.StreamWriter] = loop.create_future()
    reader = asyncio.StreamReader(limit=limit)
    protocol = asyncio.StreamReaderProtocol(reader, lambda _, writer: connected.set_result(writer))
    await loop.connect_accepted_socket(lambda: protocol, sock=conn)  # closes it when cancelled
    return reader, connected.result()  # made in connection_made, before the call above returns


async def accept(listener: socket.socket) -> socket.socket:
    """The next connection on `listener` (non-blocking), taken only once the caller will have it:
    the accept is made synchronously (at once when one is queued, else after waiting for the
    listener to be readable), so a cancelled wait never loses an accepted connection (as one can
    with loop.sock_accept, whose result may arrive together with the cancellation)."""
    while True:
        try:
            conn, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            await readable(listener)
            continue
        conn.setblocking(False)
        return conn


def reading(writer: asyncio.StreamWriter, *, on: bool) -> None:
    """Resume or pause reading the client's socket (a stream's transport reads as well)."""
    transport = writer.transport
    if isinstance(transport, asyncio.ReadTransport):
        if on:
            transport.resume_reading()
        else:
            transport.pause_reading()


async def answer_and_linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, answer: bytes) -> None:
    """Write a refusal, end our side, and read what the client still sends until it closes (at
    most LINGER_SECONDS), so the answer is not overtaken by a reset."""
    with contextlib.suppress(OSError, RuntimeError, TimeoutError):
        reading(writer, on=True)
        writer.write(answer)
        if writer.can_write_eof():
            writer.write_eof()
        async with asyncio.timeout(LINGER_SECONDS):
            while await reader.read(READ_CHUNK):
                pass


async def _linger(conn: socket.socket, answer: bytes) -> None:
    try:
        reader, writer = await server_streams(conn)
    except OSError:
        conn.close()
        return
    try:
        await answer_and_linger(reader, writer, answer)
    finally:
        writer.transport.abort()  # our answer left with write_eof; nothing more is owed


def _close_at_once(conn: socket.socket, answer: bytes) -> None:
    """Read what has arrived (so the close is a FIN where it can be), answer, close."""
    with conn, contextlib.suppress(OSError):
        conn.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            conn.recv(READ_CHUNK)
        conn.send(answer)
        conn.shutdown(socket.SHUT_WR)
