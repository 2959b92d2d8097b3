"""Who the service lets in: the caller at the other end of a connection, as the kernel reported
it — an owner by its uid, a granted caller by grants.yaml as it is now (sandboxer.grants) — and
each account's share of the requests under way. What an admitted caller may then do is the
core's to decide (sandboxer.api.caller.Authority)."""

from __future__ import annotations

import os
import socket

from sandboxer.api.caller import Caller
from sandboxer.dirs import Dirs
from sandboxer.errors import PolicyError
from sandboxer.grants import rights_of
from sandboxer.service.peer import Peer, is_owner, peer_groups, peer_of

CALLS_PER_CALLER = 32  # requests one account (not root, not the service's) may have under way at once


class CallerSlots:
    """Requests under way by account — CLI commands and HTTP requests together — so that no one
    account but root and the service's own can take every worker: at most CALLS_PER_CALLER at
    once. Used from the service's event loop only."""

    def __init__(self) -> None:
        self._running: dict[int, int] = {}

    def take(self, uid: int) -> bool:
        """One more request of `uid`, unless it has its limit under way already."""
        if uid in (0, os.geteuid()):
            return True
        if self._running.get(uid, 0) >= CALLS_PER_CALLER:
            return False
        self._running[uid] = self._running.get(uid, 0) + 1
        return True

    def give(self, uid: int) -> None:
        """A request of `uid` that take() let in has ended."""
        if uid not in (0, os.geteuid()):
            self._running[uid] -= 1


def owner_by_uid(peer: Peer) -> Caller | None:
    """Root and the service's own account: owners by their uid alone, with nothing to read (so
    the event loop may settle it itself). None: admit() decides."""
    return Caller(uid=peer.uid, pid=peer.pid, gid=peer.gid) if peer.uid in (0, os.geteuid()) else None


def admit(dirs: Dirs, sock: socket.socket) -> Caller:
    """The process at the other end of `sock` as a caller: an owner, or a granted caller;
    Refused (PolicyError) for anyone else."""
    peer = peer_of(sock)
    if is_owner(peer, dirs.config):
        return Caller(uid=peer.uid, pid=peer.pid, gid=peer.gid)
    groups = peer_groups(sock, peer)
    rights = rights_of(peer.uid, groups, dirs)
    if rights is None:
        raise Refused(
            peer,
            f"uid {peer.uid} is not granted this broker",
            hint="ask the owner: only the owner grants an account (grants.yaml)",
        )
    return Caller(uid=peer.uid, pid=peer.pid, gid=peer.gid, groups=frozenset(groups), rights=rights)


class Refused(PolicyError):
    """A caller no grant admits (the audit log names it by its uid and pid)."""

    def __init__(self, peer: Peer, message: str, *, hint: str) -> None:
        super().__init__(message, hint=hint)
        self.peer = peer
