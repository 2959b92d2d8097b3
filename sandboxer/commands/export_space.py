"""The exports directory (`<state>/exports/`): each export's quarantine while it runs, the work
the reaper kept of expired sandboxes, and one budget per caller across both.

- A quarantine, `.export-XXXXXXXX/`, is made together with its `held` file under the directory's
  lock (`.lock`); its exporter holds an exclusive flock on `held` until the quarantine is gone.
  The kernel drops that lock when the exporter dies (kill -9 included), so a quarantine whose
  lock can be taken is abandoned: `gc` and the service's reaper remove it at once.
- `held` says whose export it is (the caller's uid: the kernel's, through a service; the
  process's own in-process) and how many bytes it has reserved. An export reserves room before
  it writes, RESERVE_STEP at a time, under the lock, and only while all the caller's
  reservations and kept exports together stay within the caller's budget; past it the export
  is refused (PolicyError, 3) and its quarantine removed. So the caller's exports at once, and
  what is kept for it, never hold more of the broker's disk than its budget.
- A kept export, `<id>/` (sandboxer.service.lifetimes), has summary.json with the caller's uid
  and its size in bytes; it counts against that caller's budget until it is removed
  (`sandboxer exports rm ID`) or its time is up.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sandboxer.errors import PolicyError
from sandboxer.host.fstree import remove_tree

EXPORTS = "exports"  # in the state dir
QUARANTINE_PREFIX = ".export-"
SUMMARY = "summary.json"  # of a kept export
MIB = 1024 * 1024
RESERVE_STEP = 8 * MIB  # what an export reserves at a time
DEFAULT_BUDGET_MIB = 16384  # a caller's budget when no grant sets max_exports_mib (and an owner's)
OLD_QUARANTINE_SECONDS = 1200  # a quarantine without `held` (an older broker's) is abandoned after this
_LOCK = ".lock"
_HELD = "held"


@dataclass(frozen=True, slots=True)
class Budget:
    """How many bytes of exports one caller (`uid`) may hold at once, and what set it (named in
    a refusal)."""

    uid: int
    mib: int
    source: str  # "max_exports_mib" (its grant) or "the default"

    @property
    def bytes(self) -> int:
        return self.mib * MIB


def default_budget(uid: int | None = None) -> Budget:
    """An owner's budget (the process's own account in-process, the caller's uid in a service)."""
    return Budget(os.geteuid() if uid is None else uid, DEFAULT_BUDGET_MIB, "the default")


@dataclass(frozen=True, slots=True)
class Usage:
    """What one caller holds in the exports directory: reserved by exports under way, and kept."""

    in_flight: int
    kept: int

    @property
    def total(self) -> int:
        return self.in_flight + self.kept


def root_of(state: str) -> str:
    """The exports directory of a state dir (made owner-only when missing)."""
    root = os.path.join(state, EXPORTS)
    os.makedirs(root, mode=0o700, exist_ok=True)
    return root


@contextlib.contextmanager
def ledger(root: str) -> Iterator[None]:
    """The exports directory's lock: every reservation, every new quarantine and every removal of
    an abandoned one happens under it (short steps only)."""
    fd = os.open(os.path.join(root, _LOCK), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class Quarantine:
    """One export's directory while it runs, held by this process, with the room it reserved
    against its caller's budget."""

    def __init__(self, state: str, budget: Budget) -> None:
        self.root = root_of(state)
        self.budget = budget
        self.used = 0  # bytes this export has written or is about to (what it must have reserved)
        self.reserved = 0
        with ledger(self.root):
            self._check(RESERVE_STEP)
            self.path = tempfile.mkdtemp(prefix=QUARANTINE_PREFIX, dir=self.root)
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            self._held = os.open(os.path.join(self.path, _HELD), flags, 0o600)
            fcntl.flock(self._held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # new: nobody else has it
            self._note(RESERVE_STEP)

    def need(self, size: int) -> None:
        """Room for `size` more bytes in the quarantine, reserved before they are written;
        PolicyError when the caller's budget has no more."""
        self._reserve(self.used + size)
        self.used += size

    def settle(self) -> None:
        """Reserve what the quarantine holds now, measured (what a host git wrote in it)."""
        measured = _size_of(self.path)
        if measured > self.reserved:
            self._reserve(measured)
        self.used = max(self.used, measured)

    def remove(self) -> None:
        """Remove the quarantine, then let go of its lock (idempotent)."""
        if self._held < 0:
            return
        try:
            remove_tree(self.path)
        finally:
            os.close(self._held)
            self._held = -1

    def _reserve(self, total: int) -> None:
        if total <= self.reserved:
            return
        wanted = -(-total // RESERVE_STEP) * RESERVE_STEP
        with ledger(self.root):
            self._check(wanted)
            self._note(wanted)

    def _check(self, wanted: int) -> None:
        """Refuse `wanted` bytes for this export when the caller's other reservations and kept
        exports leave less room in its budget."""
        besides = getattr(self, "path", None)
        usage = usage_of(self.root, self.budget.uid, besides=besides)
        if usage.total + wanted > self.budget.bytes:
            in_flight = usage.in_flight + self.reserved  # this one's so far included
            raise PolicyError(
                f"export: uid {self.budget.uid}'s export budget of {self.budget.mib} MiB ({self.budget.source}) "
                f"has no room: {_mib(in_flight)} MiB held by exports under way, {_mib(usage.kept)} MiB "
                "by kept exports",
                hint="wait for the exports under way to end, or remove kept ones "
                "(sandboxer exports lists them, sandboxer exports rm ID removes one)",
            )

    def _note(self, reserved: int) -> None:
        data = json.dumps({"uid": self.budget.uid, "reserved": reserved}).encode()
        os.ftruncate(self._held, 0)
        os.pwrite(self._held, data, 0)
        self.reserved = reserved


def usage_of(root: str, uid: int, *, besides: str | None = None) -> Usage:
    """What `uid` holds in the exports directory `root` (read under its lock): the room its
    exports under way reserved (an abandoned one's counts until it is removed), and the size of
    its kept exports. `besides`: a quarantine not to count."""
    in_flight = kept = 0
    for name in _names(root):
        path = os.path.join(root, name)
        if name.startswith(QUARANTINE_PREFIX):
            if path == besides:
                continue
            held = read_json(os.path.join(path, _HELD))
            if held is not None and held.get("uid") == uid:
                in_flight += _count(held.get("reserved"))
        elif not name.startswith("."):
            summary = read_json(os.path.join(path, SUMMARY))
            if summary is not None and kept_uid(summary) == uid:
                kept += _count(summary.get("bytes"))
    return Usage(in_flight, kept)


def kept_uid(summary: dict[str, Any]) -> int:
    """Whose a kept export is: its caller's uid (an older one without it: the broker's own)."""
    uid = summary.get("uid")
    return uid if isinstance(uid, int) and not isinstance(uid, bool) else os.geteuid()


def reclaim_abandoned(state: str, now: float | None = None) -> list[str]:
    """Remove every quarantine whose exporter is gone (its lock can be taken); the names removed.
    One without `held` (an older broker's) goes once it is OLD_QUARANTINE_SECONDS old."""
    root = os.path.join(state, EXPORTS)
    if not os.path.isdir(root):
        return []
    now = time.time() if now is None else now
    removed = []
    with ledger(root):
        for name in _names(root):
            if not name.startswith(QUARANTINE_PREFIX):
                continue
            path = os.path.join(root, name)
            if _abandoned(path, now) and remove_tree(path):
                removed.append(name)
    return removed


def _abandoned(path: str, now: float) -> bool:
    try:
        fd = os.open(os.path.join(path, _HELD), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        try:
            return os.lstat(path).st_mtime + OLD_QUARANTINE_SECONDS < now
        except OSError:
            return False
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False  # its exporter holds it: an export under way
        raise
    finally:
        os.close(fd)
    return True


def _names(root: str) -> list[str]:
    try:
        return os.listdir(root)
    except FileNotFoundError:
        return []


def read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as stream:
            document = json.loads(stream.read(65536))
    except (OSError, ValueError):
        return None
    return document if isinstance(document, dict) else None


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _size_of(path: str) -> int:
    """The bytes of every file below `path` (not following links)."""
    total = 0
    for top, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(top, name)).st_size
    return total


def _mib(size: int) -> int:
    return -(-size // MIB)
