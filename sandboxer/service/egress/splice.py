"""A CONNECT tunnel's bytes, copied both ways between the sandbox's connection and the upstream,
each counted against the sandbox's allowance (session.py) as it passes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from sandboxer.service.egress.heads import READ_CHUNK
from sandboxer.service.egress.session import Session

Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def splice(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, upstream: Streams, session: Session
) -> None:
    """Copy both ways until both sides are done; each direction's end is passed on as EOF. The
    first failure (a limit, a reset) ends both and is raised as itself, not in a group."""
    tasks = {
        asyncio.create_task(_pipe(reader, upstream[1], session.count_sent)),
        asyncio.create_task(_pipe(upstream[0], writer, session.count_received)),
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
