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
) -> None:
    """Copy both ways until both sides are done (`sent`: each count of bytes from the client,
    `received`: from the upstream); each direction's end is passed on as EOF. The first failure
    (a limit, a reset) ends both and is raised as itself, not in a group."""
    tasks = {
        asyncio.create_task(_pipe(client[0], upstream[1], sent)),
        asyncio.create_task(_pipe(upstream[0], client[1], received)),
    }
    try:
        pending = tasks
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, count: Callable[[int], None]) -> None:
    while data := await reader.read(READ_CHUNK):
        count(len(data))
        writer.write(data)
        await writer.drain()
    if writer.can_write_eof() and not writer.is_closing():
        writer.write_eof()
