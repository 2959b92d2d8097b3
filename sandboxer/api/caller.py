"""Who asks the core (`Caller`) and what it may do (`Authority`): the one place that decides.

Every front end binds a caller and goes through the core API (sandboxer.api.broker): the service the
account the kernel reported for its connection (SO_PEERCRED, sandboxer.service.peer), the CLI
and the embedded `Broker` in-process the owner — the process's own account, whose rights are
all there is. No front end checks anything itself.

Owners (root and the config dir's owner) may do everything. A granted caller creates only the
profiles its grants name, within their limits (live sandboxes, a TTL ceiling: its sandboxes
always end), sees and uses only the sandboxes it created — anyone else's answers exactly as an
unknown id does — and runs no owner verb. The service opens a file a caller names only for a
caller of its own account: a root service never reads a path on another account's say-so.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

from sandboxer.commands.export_space import Budget, default_budget
from sandboxer.commands.kept import expiry_notice
from sandboxer.commands.making import checked_by
from sandboxer.dirs import Dirs
from sandboxer.errors import NotFoundError, PolicyError, SandboxerError, UnapprovedError
from sandboxer.grants import Rights, rights_of
from sandboxer.host.registry import Registry, check_id

T = TypeVar("T")

# Why a caller's create of a profile that is not approved (or changed since) is refused.
CALLER_UNAPPROVED = "only the owner approves a profile, and a sandbox starts only from approved bytes"

# A caller's count of live sandboxes and of its creates under way, taken under one lock: two
# creates at once cannot both pass the count, and neither waits for the other's create.
_CREATE_LOCK = threading.Lock()
_CREATING: dict[int, int] = {}  # uid -> creates under way in this process


@dataclass(frozen=True, slots=True, kw_only=True)
class Caller:
    """Who asks: an account as the kernel reported it (its uid, pid and groups), and what the
    grants give it (`rights`; None: an owner)."""

    uid: int
    pid: int = 0
    gid: int = -1
    groups: frozenset[int] = frozenset()
    rights: Rights | None = None

    @property
    def owner(self) -> bool:
        return self.rights is None

    @classmethod
    def this_process(cls) -> Caller:
        """The owner running the core in-process (the CLI without a service, the embedded API)."""
        return cls(uid=os.geteuid(), pid=os.getpid(), gid=os.getegid())


@dataclass(frozen=True, slots=True)
class Authority:
    """What `caller` may do with the broker of `dirs`."""

    dirs: Dirs
    caller: Caller

    def require_owner(self, what: str) -> None:
        """Refuse an owner verb to a granted caller."""
        if not self.caller.owner:
            raise PolicyError(f"{what} is for the broker's owners")

    def require_own(self, sandbox_id: str, unknown: Exception | None = None) -> None:
        """A granted caller may name its own sandboxes only; another's raises `unknown` (by
        default "no such sandbox"), the very error an id nobody has gets."""
        rights = self.caller.rights
        if rights is None:
            return
        error = unknown if unknown is not None else NotFoundError(f"no such sandbox: {sandbox_id}")
        try:
            checked = check_id(sandbox_id)
        except NotFoundError:
            return  # a malformed id: the command's own answer, the same for everyone
        record = Registry(self.dirs.state).read_or_none(checked)
        if record is None:
            raise _with_kept(error, self.dirs, checked, rights.uid)
        if record.caller_uid != rights.uid:
            raise error

    def caller_uid(self) -> int | None:
        """The uid a new sandbox's record names as its caller's (None: an owner's)."""
        return None if self.caller.rights is None else self.caller.rights.uid

    def ttl_ceiling(self, sandbox_id: str) -> int | None:
        """The longest lifetime this caller's grant gives a sandbox of the profile `sandbox_id`
        was made from (None: an owner's, unbounded; PolicyError: no longer granted at all)."""
        rights = self.caller.rights
        if rights is None:
            return None
        record = Registry(self.dirs.state).read_caller(check_id(sandbox_id))
        ceiling = rights.ttl_ceiling_for(record.profile)
        if ceiling is None:
            raise PolicyError(f"profile {record.profile[:64]!r} is not granted to uid {rights.uid}")
        return ceiling

    def export_budget(self) -> Budget:
        """The budget this caller's exports share (under way and kept): its grant's, or the
        default for an owner (by its uid)."""
        rights = self.caller.rights
        return default_budget(self.caller.uid) if rights is None else rights.exports_budget()

    def kept_viewer(self) -> int | None:
        """Whose kept exports the caller sees and names: a granted caller's own (by the kernel's
        uid), an owner's every one (None)."""
        return None if self.caller.owner else self.caller.uid

    def visible(self, sandbox_ids: list[str]) -> set[str] | None:
        """Which of `sandbox_ids` the caller may see (None: an owner sees all)."""
        rights = self.caller.rights
        return None if rights is None else set(sandboxes_of(self.dirs, rights.uid)) & set(sandbox_ids)

    @contextmanager
    def creating(self, profile: str, ttl: float | None) -> Iterator[float | None]:
        """Admit a create of `profile`: its grant names the profile, `ttl` is within the ceiling
        (which is the lifetime when none is asked: the block gets the lifetime to give), and the
        caller has fewer live sandboxes than its limit. The block runs with the grant checked
        again before each step that makes something (recheck)."""
        rights = self.caller.rights
        if rights is None:
            yield ttl
            return
        limit = rights.limit_for(profile)
        ceiling = rights.ttl_ceiling_for(profile)
        if limit is None or ceiling is None:
            raise PolicyError(f"profile {profile[:64]!r} is not granted to uid {rights.uid}")
        if ttl is not None and ttl > ceiling:
            raise PolicyError(f"ttl: {ttl:g} seconds is past the granted ceiling of {ceiling} (max_ttl_seconds)")
        uid = rights.uid
        with _CREATE_LOCK:
            if len(sandboxes_of(self.dirs, uid, creating=False)) + _CREATING.get(uid, 0) >= limit:
                raise PolicyError(f"uid {uid} has its {limit} live sandboxes (max_sandboxes)")
            _CREATING[uid] = _CREATING.get(uid, 0) + 1
        try:
            with checked_by(lambda step: self.recheck(step, profile)):
                yield ceiling if ttl is None else ttl
        except UnapprovedError as exc:  # its hint is the owner's command: a caller cannot run it
            raise PolicyError(exc.message, hint=f"ask the owner: {CALLER_UNAPPROVED}") from None
        finally:
            with _CREATE_LOCK:
                _CREATING[uid] -= 1

    def checking(self, function: Callable[[], T]) -> T:
        """`function()`, run with this caller's grant checked again before each step that makes
        something (recheck)."""
        with checked_by(self.recheck):
            return function()

    def recheck(self, step: str, profile: str | None = None) -> None:
        """Before `step` of a request that makes something: a granted caller is still granted
        (and `profile`, when given) by grants.yaml as it is now, approved — it may have changed
        since the request was admitted. PolicyError otherwise."""
        rights = self.caller.rights
        if rights is None:
            return
        now = rights_of(self.caller.uid, set(self.caller.groups), self.dirs)
        if now is None or (profile is not None and now.limit_for(profile) is None):
            what = "this broker" if profile is None else f"profile {profile[:64]!r}"
            raise PolicyError(
                f"uid {rights.uid} is no longer granted {what}: grants.yaml changed while the request ran "
                f"(refused before {step}; nothing of it is left)",
                hint="ask the broker's owner",
            )

    def require_own_files(self, what: str, *, why: str | None = None) -> None:
        """Refuse to open a path this caller named unless the broker runs as its own account."""
        require_own_files(self.caller, what, why=why)


def require_own_files(caller: Caller, what: str, *, why: str | None = None) -> None:
    """Refuse to open a path `caller` named unless the broker runs as the caller's own account
    (in-process, a private service, or root's for root). `why`: a reason of the file's own."""
    if caller.uid == os.geteuid():
        return
    if why is not None:
        raise PolicyError(f"{what}: {why}: the service takes one from its own account only")
    if not caller.owner:  # a caller: the sandboxer command opens such files itself
        hint = "name it to the sandboxer command, which opens it with your own rights and passes it on"
    else:
        hint = "run this command with SANDBOXER_NO_SERVICE=1: it reads the file with your own rights"
    raise PolicyError(f"{what}: the service does not open files for another account", hint=hint)


def _with_kept(unknown: Exception, dirs: Dirs, sandbox_id: str, uid: int) -> Exception:
    """`unknown`, saying where the work is when the sandbox expired and the reaper kept its work
    for this caller (another's kept work is never mentioned)."""
    notice = expiry_notice(dirs, sandbox_id, uid)
    if notice is None:
        return unknown
    if isinstance(unknown, SandboxerError):
        return type(unknown)(unknown.message, hint=notice)
    return type(unknown)(f"{unknown} ({notice})")


def sandboxes_of(dirs: Dirs, uid: int, *, creating: bool = True) -> list[str]:
    """The live sandboxes a caller created (through this or an earlier service); with `creating`
    false, not those whose create is under way."""
    registry = Registry(dirs.state)
    found = []
    for sandbox_id in registry.ids():
        record = registry.read_or_none(sandbox_id)
        if record is None or record.caller_uid != uid or record.hidden or record.state == "failed":
            continue
        if creating or record.state != "creating":
            found.append(sandbox_id)
    return found
