"""One published port: a listener on the host's 127.0.0.1:HOST whose every connection is forwarded
to 127.0.0.1:RUNTIME inside one sandbox's network namespace.

The inner socket is made in the sandbox's namespace (host/inside_sockets.py) and connected from
here; the bytes are copied both ways (splice.py) and counted. A connection that finds nothing
listening inside is closed at once (the client sees a reset, as it would connecting to a closed
port). At most MAX_CONNECTIONS at a time per port and MAX_SERVICE_CONNECTIONS on all the
service's published ports together (a Budget the table shares); new ones are paced
(admission.py): the host's other users share the service with the sandbox. Any local account
can connect to a port on 127.0.0.1, so no connection is held for ever: one that passes no byte
either way for IDLE_SECONDS ends, and so does one whose other direction has not ended
HALF_CLOSED_SECONDS after the first did.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket

from sandboxer.errors import BackendError
from sandboxer.host.inside_sockets import InsideSockets
from sandboxer.service.egress.admission import Pace, accept
from sandboxer.service.splice import splice

MAX_CONNECTIONS = 256
MAX_SERVICE_CONNECTIONS = 2048  # two descriptors each: well within the service's descriptor limit
IDLE_SECONDS = 900.0  # a dev server's quiet websocket survives a quarter of an hour without a byte
HALF_CLOSED_SECONDS = 60.0
ACCEPT_RETRY_SECONDS = 0.1
log = logging.getLogger(__name__)


class Budget:
    """Connections forwarded at once by every published port of one service (on its loop)."""

    def __init__(self, limit: int = MAX_SERVICE_CONNECTIONS) -> None:
        self.limit = limit
        self.used = 0

    def take(self) -> bool:
        """One more connection, if there is room for it."""
        if self.used >= self.limit:
            return False
        self.used += 1
        return True

    def give(self) -> None:
        self.used -= 1


class PortForwarder:
    """Forwards `listener`'s connections (the host side, bound and listening) to `runtime` inside."""

    def __init__(self, listener: socket.socket, runtime: int, inside: InsideSockets, budget: Budget) -> None:
        self.listener = listener
        self.budget = budget
        self.host = int(listener.getsockname()[1])
        self.runtime = runtime
        self.inside = inside
        self.pace = Pace()
        self.forwarded = 0  # connections that reached the port inside
        self.refused = 0  # connections that found nothing listening inside, or came past the limit
        self._tasks: set[asyncio.Task[None]] = set()
        self._accepting: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Serve from now on (on the running loop)."""
        self.listener.setblocking(False)
        self._accepting = asyncio.create_task(self._accept())

    async def close(self) -> None:
        """Stop listening; every open connection is closed."""
        if self._accepting is not None:
            self._accepting.cancel()
            await asyncio.gather(self._accepting, return_exceptions=True)
        self.listener.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    @property
    def open_connections(self) -> int:
        """Connections being forwarded now."""
        return len(self._tasks)

    async def _accept(self) -> None:
        while True:
            while (wait := self.pace.delay()) > 0:
                await asyncio.sleep(wait)
            try:
                conn = await accept(self.listener)
            except OSError as exc:
                log.warning("published port %d cannot accept: %s", self.host, exc.strerror)
                await asyncio.sleep(ACCEPT_RETRY_SECONDS)
                continue
            if len(self._tasks) >= MAX_CONNECTIONS or not self.budget.take():
                self.refused += 1
                conn.close()
                continue
            task = asyncio.create_task(self._forward(conn))
            self._tasks.add(task)
            task.add_done_callback(functools.partial(self._ended, conn))

    def _ended(self, conn: socket.socket, task: asyncio.Task[None]) -> None:
        conn.close()
        self._tasks.discard(task)
        self.budget.give()

    async def _forward(self, conn: socket.socket) -> None:
        inner = await self._connect_inside()
        if inner is None:
            self.refused += 1
            return
        self.forwarded += 1
        try:
            client = await asyncio.open_connection(sock=conn)
        except BaseException:  # cancelled (the port closes): the inner socket goes now, not at collection
            inner.close()
            raise
        try:
            upstream = await asyncio.open_connection(sock=inner)
        except BaseException:
            inner.close()
            client[1].close()
            raise
        try:
            with contextlib.suppress(OSError):  # TimeoutError among them: idle, or half-closed, too long
                await splice(client, upstream, idle_seconds=IDLE_SECONDS, half_closed_seconds=HALF_CLOSED_SECONDS)
        finally:
            for _, writer in (client, upstream):
                writer.transport.abort()

    async def _connect_inside(self) -> socket.socket | None:
        """A socket connected to 127.0.0.1:runtime inside, or None when nothing answers there."""
        try:
            return await self.inside.connect(self.runtime)
        except BackendError as exc:
            log.warning("published port %d: %s", self.host, exc.message)
        except (OSError, TimeoutError):
            pass
        return None
