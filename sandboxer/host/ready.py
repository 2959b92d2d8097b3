"""Waiting for descriptors to be ready, for any descriptor number.

select(2) refuses descriptors past 1023, and a busy service holds thousands (every exec holds a
connection, the client's stdio, pipes and a pidfd), so everything that runs in the service
waits with poll(2) through this one function instead.
"""

from __future__ import annotations

import math
import select
from collections.abc import Collection

_READ = select.POLLIN | select.POLLPRI
_DONE = select.POLLHUP | select.POLLERR | select.POLLNVAL  # ready too: the next read or write says why


def wait_ready(
    readers: Collection[int], writers: Collection[int] = (), timeout: float | None = None
) -> tuple[list[int], list[int]]:
    """(readable, writable) as select(2) answers: `readers` with data or at their end, `writers`
    that take a write now (or failed), after at most `timeout` seconds (None: until one is)."""
    poller = select.poll()
    for fd in set(readers) | set(writers):
        poller.register(fd, (_READ if fd in readers else 0) | (select.POLLOUT if fd in writers else 0))
    events = poller.poll(None if timeout is None else math.ceil(max(timeout, 0.0) * 1000))
    readable = [fd for fd, event in events if fd in readers and event & (_READ | _DONE)]
    writable = [fd for fd, event in events if fd in writers and event & (select.POLLOUT | _DONE)]
    return readable, writable
