"""The relay forked into a sandbox keeps only the descriptors it uses: a sandbox's lock (or any
other descriptor of the broker) never outlives a killed broker in a relay that is slow to die."""

from __future__ import annotations

import json
import os
import socket

from sandboxer.backends.bwrap.joiner import _keep_only
from sandboxer.host.fdpass import receive_fds


def _open_after_keep_only(kept: set[int], candidates: list[int]) -> set[int]:
    """Fork, keep only `kept` in the child, and return which of `candidates` it still has open."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            _keep_only({*kept, write_end})
            still = []
            for fd in candidates:
                try:
                    os.fstat(fd)
                except OSError:
                    continue
                still.append(fd)
            os.write(write_end, json.dumps(still).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as stream:
        data = stream.read()
    os.waitpid(child, 0)
    return set(json.loads(data))


def test_keep_only_closes_everything_else_however_high() -> None:
    opened = [os.open(os.devnull, os.O_RDONLY) for _ in range(6)]
    high = os.dup2(opened[0], 900)
    try:
        kept = {opened[1], opened[4]}
        assert _open_after_keep_only(kept, [0, 1, 2, *opened, high]) == {0, 1, 2, *kept}
    finally:
        for fd in [*opened, high]:
            os.close(fd)


def test_descriptors_received_are_close_on_exec_from_the_start() -> None:
    """receive_fds asks the kernel for MSG_CMSG_CLOEXEC (Python 3.11's socket.recv_fds drops its
    flags): a descriptor a client passes is never inherited by what the service starts."""

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    read_end, write_end = os.pipe()
    os.set_inheritable(read_end, True)
    try:
        socket.send_fds(theirs, [b"x"], [read_end, write_end])
        message, fds, flags = receive_fds(ours, 16, 2)
        assert (message, len(fds), flags & socket.MSG_CTRUNC) == (b"x", 2, 0)
        assert not any(os.get_inheritable(fd) for fd in fds)
        for fd in fds:
            os.close(fd)
        socket.send_fds(theirs, [b"y"], [read_end, write_end, read_end])
        _, fds, flags = receive_fds(ours, 16, 2)
        assert flags & socket.MSG_CTRUNC  # more than asked for: the kernel closed the rest
        for fd in fds:
            os.close(fd)
    finally:
        for fd in (read_end, write_end):
            os.close(fd)
        ours.close()
        theirs.close()
