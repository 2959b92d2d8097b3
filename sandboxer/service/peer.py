"""Who is calling: the kernel's word for the process at the other end of a Unix socket
(SO_PEERCRED, read when the connection is accepted; never a header, token or argument), and
whether that account is one of the broker's owners.

Owners are root, the account that owns the config dir, and the service's own account. Every
other account is refused until grants (an approved owner file naming users, groups and profiles) admit it as a caller.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux 4.13; the Python module may lack the name
MAX_GROUPS = 65536


@dataclass(frozen=True, slots=True)
class Peer:
    """The calling process as the kernel reported it when it connected."""

    pid: int
    uid: int
    gid: int


def peer_of(sock: socket.socket) -> Peer:
    """The credentials of the process that connected `sock`."""
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return Peer(pid=pid, uid=uid, gid=gid)


def is_owner(peer: Peer, config_dir: str) -> bool:
    """Root, the account that owns the config dir, or the service's own account (a user's private
    service before the user has a config dir)."""
    if peer.uid in (0, os.geteuid()):
        return True
    try:
        return peer.uid == os.stat(config_dir).st_uid
    except OSError:
        return False


def peer_groups(sock: socket.socket, peer: Peer) -> set[int]:
    """The connecting process's groups as the kernel has them (its primary gid included)."""
    size = 256
    while True:
        try:
            data = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * size)
        except OSError as exc:
            if exc.errno == 34 and size < MAX_GROUPS:  # ERANGE: more groups than room
                size *= 4
                continue
            return {peer.gid}
        return {peer.gid, *struct.unpack(f"{len(data) // 4}I", data)}
