"""A connection's bytes, copied both ways between two streams, each direction counted as it
passes: a CONNECT tunnel's against the sandbox's allowance (session.py), a published port's
(sandboxer/service/publish/)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from sandboxer.service.egress.heads import READ_CHUNK

Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def splice(
    client: Streams,
    upstream: Streams,
    *,
    sent: Callable[[int], None] = lambda _: None,
    received: Callable[[int], None] = lambda _: None,
    idle_seconds: float | None = None,
    half_closed_seconds: float | None = None,
) -> None:
    """Copy both ways until both sides are done (`sent`: each count of bytes from the client,
    `received`: from the upstream); each direction's end is passed on as EOF. The first failure
    (a limit, a reset) ends both and is raised as itself, not in a group. `idle_seconds`: both
    end once no byte has passed either way for that long; `half_closed_seconds`: once one
    direction has ended, the other has that long to end too (TimeoutError either way)."""
    loop = asyncio.get_running_loop()
    last = [loop.time()]  # when a byte last passed, either way

    def counted(count: Callable[[int], None]) -> Callable[[int], None]:
        def note(size: int) -> None:
            last[0] = loop.time()
            count(size)

        return note

    tasks = {
        asyncio.create_task(_pipe(client[0], upstream[1], counted(sent))),
        asyncio.create_task(_pipe(upstream[0], client[1], counted(received))),
    }
    half_closed_at: float | None = None
    try:
        pending = tasks
        while pending:
            deadline = _deadline(last[0], idle_seconds, half_closed_at, half_closed_seconds)
            wait = None if deadline is None else max(0.0, deadline - loop.time())
            done, pending = await asyncio.wait(pending, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
            if done and pending and half_closed_at is None:
                half_closed_at = loop.time()
            deadline = _deadline(last[0], idle_seconds, half_closed_at, half_closed_seconds)  # bytes may have passed
            if not done and deadline is not None and loop.time() >= deadline:
                raise TimeoutError("the connection was idle, or half-closed, too long")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _deadline(last: float, idle: float | None, half_closed_at: float | None, half_closed: float | None) -> float | None:
    """When the connection ends unless a byte passes (idle) or its other direction ends too."""
    found = [] if idle is None else [last + idle]
    if half_closed_at is not None and half_closed is not None:
        found.append(half_closed_at + half_closed)
    return min(found, default=None)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, count: Callable[[int], None]) -> None:
    while data := await reader.read(READ_CHUNK):
        count(len(data))
        writer.write(data)
        await writer.drain()
    if writer.can_write_eof() and not writer.is_closing():
        writer.write_eof()
