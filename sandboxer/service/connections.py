"""The service's socket: each connection accepted and sent where it belongs — an HTTP client's
to aiohttp, a CLI client's (its first byte is NUL) to cliserver — and the service's activity,
which `serve --idle-exit` watches."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import time
from concurrent.futures import Executor
from typing import Any

from sandboxer.service.admission import CallerSlots
from sandboxer.service.cliserver import Serving, serve_client
from sandboxer.service.peer import peer_of

FIRST_BYTE_SECONDS = 10.0  # a connection that says nothing this long is closed
ACCEPT_RETRY = 0.5  # seconds before accepting again after accept() failed


class Activity:
    """How many requests run, and since when none has."""

    def __init__(self) -> None:
        self.running = 0
        self.since = time.monotonic()

    def begin(self) -> None:
        self.running += 1

    def end(self) -> None:
        self.running -= 1
        self.since = time.monotonic()

    def idle_for(self) -> float:
        """Seconds without a request (0 while one runs)."""
        return 0.0 if self.running else time.monotonic() - self.since


class Connections:
    """Accepts on the listener until stopped; knows the CLI clients whose commands run."""

    def __init__(
        self,
        listener: socket.socket,
        http: Any,
        serving: Serving,
        *,
        activity: Activity,
        slots: CallerSlots,
        workers: Executor,
    ) -> None:
        self.listener = listener
        self.http = http  # aiohttp's protocol factory (AppRunner.server)
        self.serving = serving
        self.activity = activity
        self.slots = slots  # shared with the HTTP API: one limit per account
        self.workers = workers  # the pool that runs commands (as long as they take)
        self.clients: set[socket.socket] = set()
        self.tasks: set[asyncio.Task[None]] = set()

    async def accept(self) -> None:
        """Accept forever; each connection is routed in a task of its own."""
        loop = asyncio.get_running_loop()
        self.listener.setblocking(False)
        while True:
            try:
                conn, _ = await loop.sock_accept(self.listener)
            except OSError as exc:  # out of descriptors, say: wait, then accept again
                sys.stderr.write(f"sandboxer: accept failed ({exc.strerror}); retrying\n")
                await asyncio.sleep(ACCEPT_RETRY)
                continue
            task = asyncio.create_task(self._route(conn))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _route(self, conn: socket.socket) -> None:
        first = await _first_byte(conn)
        if first == b"\0":
            await self._cli(conn)
        elif first:
            await asyncio.get_running_loop().connect_accepted_socket(self.http, conn)
        else:
            conn.close()

    async def _cli(self, conn: socket.socket) -> None:
        """A CLI client's command, in a worker thread — within its account's share (CallerSlots);
        a client past it is closed at once (it says the service went away, status 125)."""
        uid = peer_of(conn).uid
        if not self.slots.take(uid):
            conn.close()
            return
        self.activity.begin()
        self.clients.add(conn)
        try:
            await asyncio.get_running_loop().run_in_executor(self.workers, serve_client, conn, self.serving)
        finally:
            self.clients.discard(conn)
            self.activity.end()
            self.slots.give(uid)

    async def close(self) -> None:
        """Stop: a running exec sees its client gone and ends; other commands finish."""
        for conn in list(self.clients):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RD)
        if self.tasks:
            await asyncio.wait(list(self.tasks))


async def _first_byte(conn: socket.socket) -> bytes:
    """The connection's first byte, left in place (b"" when the client sends nothing in time)."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(conn.fileno(), readable)
    try:
        await asyncio.wait_for(ready, timeout=FIRST_BYTE_SECONDS)
        return conn.recv(1, socket.MSG_PEEK)
    except (TimeoutError, OSError):
        return b""
    finally:
        loop.remove_reader(conn.fileno())
