"""What the service lets one caller do — the same rules for the HTTP API and the CLI client.

Owners (root and the config dir's owner) may do everything. A granted caller creates only the
profiles its grants name, within their limits (live sandboxes, a TTL ceiling: its sandboxes
always end), sees and uses only the sandboxes it created — anyone else's answers exactly as an
unknown id does — and runs no owner verb. The service opens a file a caller names only for a
caller of its own account: a root service never reads a path on another account's say-so.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from sandboxer.commands.export_space import Budget, default_budget
from sandboxer.dirs import Dirs
from sandboxer.errors import NotFoundError, PolicyError, UnapprovedError
from sandboxer.service.grants import Rights
from sandboxer.service.peer import Peer

T = TypeVar("T")

# Why a caller's create of a profile that is not approved (or changed since) is refused.
CALLER_UNAPPROVED = "only the owner approves a profile, and a sandbox starts only from approved bytes"

# A caller's count of live sandboxes and of its creates under way, taken under one lock: two
# creates at once cannot both pass the count, and neither waits for the other's create.
_CREATE_LOCK = threading.Lock()
_CREATING: dict[int, int] = {}  # uid -> creates under way in this service


@dataclass(frozen=True, slots=True)
class Access:
    """One connection's caller (as the kernel reported it) and its rights."""

    dirs: Dirs
    peer: Peer
    rights: Rights | None  # None: an owner
    groups: frozenset[int] = frozenset()  # its groups as the kernel reported them (grants name groups)

    @property
    def owner(self) -> bool:
        return self.rights is None

    def require_owner(self, what: str) -> None:
        """Refuse an owner verb to a granted caller."""
        if self.rights is not None:
            raise PolicyError(f"{what} is for the broker's owners")

    def require_own(self, sandbox_id: str, unknown: Exception) -> None:
        """A granted caller may name its own sandboxes only; another's raises `unknown`, the very
        error an id nobody has gets."""
        from sandboxer.host.registry import Registry, check_id

        if self.rights is None:
            return
        try:
            checked = check_id(sandbox_id)
        except NotFoundError:
            return  # a malformed id: the command's own answer, the same for everyone
        record = Registry(self.dirs.state).read_or_none(checked)
        if record is None or record.caller_uid != self.rights.uid:
            raise _with_kept(unknown, self.dirs, checked, self.rights.uid) if record is None else unknown

    def export_budget(self) -> Budget:
        """The budget this caller's exports share (under way and kept): its grant's, or the
        default for an owner (by the uid the kernel reported)."""
        return default_budget(self.peer.uid) if self.rights is None else self.rights.exports_budget()

    def own_ids(self) -> set[str] | None:
        """The ids a granted caller may see (None: an owner sees all)."""
        return None if self.rights is None else set(sandboxes_of(self.dirs, self.rights.uid))

    def create(self, profile: str, ttl: float | None, make: Callable[[int | None, float | None], T]) -> T:
        """Run `make(caller_uid, ttl)` when this caller may create `profile` now: its grant names
        the profile, `ttl` is within the ceiling (which is the lifetime when none is asked), and
        it has fewer live sandboxes than its limit."""
        rights = self.rights
        if rights is None:
            return make(None, ttl)
        limit = rights.limit_for(profile)
        ceiling = rights.ttl_ceiling_for(profile)
        if limit is None or ceiling is None:
            raise PolicyError(f"profile {profile[:64]!r} is not granted to uid {rights.uid}")
        if ttl is not None and ttl > ceiling:
            raise PolicyError(f"ttl: {ttl:g} seconds is past the granted ceiling of {ceiling} (max_ttl_seconds)")
        from sandboxer.commands.making import checked_by

        uid = rights.uid
        with _CREATE_LOCK:
            if len(sandboxes_of(self.dirs, uid, creating=False)) + _CREATING.get(uid, 0) >= limit:
                raise PolicyError(f"uid {uid} has its {limit} live sandboxes (max_sandboxes)")
            _CREATING[uid] = _CREATING.get(uid, 0) + 1
        try:
            with checked_by(lambda step: self.recheck(step, profile)):
                return make(uid, ceiling if ttl is None else ttl)
        except UnapprovedError as exc:  # its hint is the owner's command: a caller cannot run it
            raise PolicyError(exc.message, hint=f"ask the owner: {CALLER_UNAPPROVED}") from None
        finally:
            with _CREATE_LOCK:
                _CREATING[uid] -= 1

    def checking(self, function: Callable[..., T]) -> Callable[..., T]:
        """`function`, run with this caller's grant checked again before each step that makes
        something (recheck)."""

        def checked(*args: Any) -> T:
            from sandboxer.commands.making import checked_by

            with checked_by(self.recheck):
                return function(*args)

        return checked

    def recheck(self, step: str, profile: str | None = None) -> None:
        """Before `step` of a request that makes something: a granted caller is still granted
        (and `profile`, when given) by grants.yaml as it is now, approved — it may have changed
        since the request was admitted. PolicyError otherwise."""
        if self.rights is None:
            return
        from sandboxer.service.grants import rights_of

        now = rights_of(self.peer, set(self.groups), self.dirs)
        if now is None or (profile is not None and now.limit_for(profile) is None):
            what = "this broker" if profile is None else f"profile {profile[:64]!r}"
            raise PolicyError(
                f"uid {self.rights.uid} is no longer granted {what}: grants.yaml changed while the request ran "
                f"(refused before {step}; nothing of it is left)",
                hint="ask the broker's owner",
            )

    def require_own_files(self, what: str, *, why: str | None = None) -> None:
        """Refuse to open a path this caller named unless the service runs as the caller's own
        account (a private service, or root's for root). `why`: a reason of the file's own."""
        if self.peer.uid == os.geteuid():
            return
        if why is not None:
            raise PolicyError(f"{what}: {why}: the service takes one from its own account only")
        if self.rights is not None:  # a caller: the sandboxer command opens such files itself
            hint = "name it to the sandboxer command, which opens it with your own rights and passes it on"
        else:
            hint = "run this command with SANDBOXER_NO_SERVICE=1: it reads the file with your own rights"
        raise PolicyError(f"{what}: the service does not open files for another account", hint=hint)


def _with_kept(unknown: Exception, dirs: Dirs, sandbox_id: str, uid: int) -> Exception:
    """`unknown`, saying where the work is when the sandbox expired and the reaper kept its work
    for this caller (another's kept work is never mentioned)."""
    from sandboxer.commands.kept import expiry_notice
    from sandboxer.errors import SandboxerError

    notice = expiry_notice(dirs, sandbox_id, uid)
    if notice is None:
        return unknown
    if isinstance(unknown, SandboxerError):
        return type(unknown)(unknown.message, hint=notice)
    return type(unknown)(f"{unknown} ({notice})")


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


def owner_by_uid(dirs: Dirs, peer: Peer) -> Access | None:
    """Root's and the service's own account's access: owners by their uid alone, with nothing
    to read (so the event loop may settle it itself). None: admit() decides."""
    return Access(dirs, peer, None) if peer.uid in (0, os.geteuid()) else None


def admit(dirs: Dirs, sock: socket.socket) -> Access:
    """The access of the process at the other end of `sock`: an owner's, or a granted caller's;
    PolicyError for anyone else."""
    from sandboxer.service.grants import peer_groups, rights_of
    from sandboxer.service.peer import is_owner, peer_of

    peer = peer_of(sock)
    if is_owner(peer, dirs.config):
        return Access(dirs, peer, None)
    groups = peer_groups(sock, peer)
    rights = rights_of(peer, groups, dirs)
    if rights is None:
        raise Refused(
            peer,
            f"uid {peer.uid} is not granted this broker",
            hint="ask the owner: only the owner grants an account (grants.yaml)",
        )
    return Access(dirs, peer, rights, frozenset(groups))


class Refused(PolicyError):
    """A caller no grant admits (the audit log names it by its uid and pid)."""

    def __init__(self, peer: Peer, message: str, *, hint: str) -> None:
        super().__init__(message, hint=hint)
        self.peer = peer


def sandboxes_of(dirs: Dirs, uid: int, *, creating: bool = True) -> list[str]:
    """The live sandboxes a caller created (through this or an earlier service); with `creating`
    false, not those whose create is under way."""
    from sandboxer.host.registry import Registry

    registry = Registry(dirs.state)
    found = []
    for sandbox_id in registry.ids():
        record = registry.read_or_none(sandbox_id)
        if record is None or record.caller_uid != uid or record.hidden or record.state == "failed":
            continue
        if creating or record.state != "creating":
            found.append(sandbox_id)
    return found


def visible(document: dict[str, Any], own: set[str] | None) -> dict[str, Any]:
    """A list document with only the sandboxes `own` names (None: all of them)."""
    if own is None:
        return document
    return {**document, "sandboxes": [entry for entry in document["sandboxes"] if entry["id"] in own]}
