"""Receiving descriptors passed over a Unix socket (SCM_RIGHTS), close-on-exec from the start.

A module of its own, importing two standard modules: the service's spawner process uses it, and
what that process imports it pays for at every fork (backends/bwrap/spawner_process.py).
"""

from __future__ import annotations

import array
import socket


def receive_fds(sock: socket.socket, bufsize: int, maxfds: int) -> tuple[bytes, list[int], int]:
    """One message and the descriptors passed with it (SCM_RIGHTS), each close-on-exec from the
    start; and the message's flags (MSG_CTRUNC: more descriptors were passed, and closed by the
    kernel). socket.recv_fds in Python 3.11 drops its `flags` argument, so MSG_CMSG_CLOEXEC
    cannot be asked of it: a descriptor would be inheritable until set otherwise, in a process
    whose other threads may be forking."""
    fds = array.array("i")
    message, ancillary, flags, _ = sock.recvmsg(
        bufsize, socket.CMSG_LEN(maxfds * fds.itemsize), socket.MSG_CMSG_CLOEXEC
    )
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return message, list(fds), flags
