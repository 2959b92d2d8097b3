"""The approvals ledger: which owner files are approved, each bound to the sha256 of its bytes.

`<config-dir>/approvals.json` is owner-only. Every change happens under an exclusive lock on
`<config-dir>/approvals.lock` and is written atomically (`approve` and `revoke` in
sandboxer/commands/owner.py; this module reads the ledger and renders it), so concurrent
approvers never lose an entry and a reader never sees half a file. A ledger that is not owner-only, not ours or not
well formed is refused; it is never reset, because resetting would silently revoke or, worse,
let a forged file stand.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum

from sandboxer.errors import PolicyError

LEDGER = "approvals.json"
LOCK = "approvals.lock"
_FORMAT = 1
_MAX_BYTES = 4 * 1024 * 1024


class LedgerError(PolicyError):
    """The ledger cannot be trusted; nothing is approved until the owner repairs it."""

    kind = "ledger"


class Status(StrEnum):
    """Where an owner file stands against the ledger."""

    APPROVED = "approved"
    UNAPPROVED = "unapproved"
    CHANGED = "changed-since-approval"


@dataclass(frozen=True, slots=True, kw_only=True)
class Approval:
    """One ledger entry."""

    name: str
    sha256: str
    approved_at: str


class Ledger:
    """The approvals of one config directory (read here; changed by the owner's commands)."""

    def __init__(self, config_dir: str) -> None:
        self.config_dir = config_dir
        self.path = os.path.join(config_dir, LEDGER)
        self.lock_path = os.path.join(config_dir, LOCK)

    def read(self) -> dict[str, Approval]:
        """All approvals; an absent ledger means none."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise LedgerError(f"{self.path}: cannot be opened ({exc.strerror}); it must be a regular file") from None
        with os.fdopen(fd, "rb") as stream:
            st = os.fstat(stream.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise LedgerError(f"{self.path}: must be a regular file")
            if st.st_uid != os.geteuid():
                raise LedgerError(f"{self.path}: must be owned by uid {os.geteuid()}")
            if st.st_mode & 0o077:
                raise LedgerError(f"{self.path}: must be owner-only (mode 0600); refusing to trust it")
            data = stream.read(_MAX_BYTES + 1)
        if len(data) > _MAX_BYTES:
            raise LedgerError(f"{self.path}: larger than {_MAX_BYTES} bytes")
        return _parse(self.path, data)

    def status(self, name: str, file_sha256: str | None) -> Status:
        """The standing of a file whose bytes hash to `file_sha256` (None: file is absent)."""
        approval = self.read().get(name)
        if approval is None:
            return Status.UNAPPROVED
        return Status.APPROVED if approval.sha256 == file_sha256 else Status.CHANGED


def approval(name: str, file_sha256: str) -> Approval:
    """The approval of the file `name` with exactly these bytes, as of now."""
    return Approval(name=name, sha256=file_sha256, approved_at=_now())


def render(approvals: dict[str, Approval]) -> bytes:
    """The ledger's bytes for these approvals (sorted by name)."""
    document = {
        "format": _FORMAT,
        "approvals": {
            name: {"sha256": a.sha256, "approved_at": a.approved_at} for name, a in sorted(approvals.items())
        },
    }
    return (json.dumps(document, indent=2) + "\n").encode()


def check_owner_dir(path: str) -> None:
    """Refuse to change the ledger of a config dir anyone but its owner could write to."""
    # Root's config dir is conventionally /etc/sandboxer, 0755: readable is fine, writable by
    # anyone but the owner is not, since they could swap files or the ledger under us.
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise LedgerError(f"{path}: config dir does not exist") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise LedgerError(
            f"{path}: config dir must be a directory owned by uid {os.geteuid()}, not group/world-writable"
        )


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse(path: str, data: bytes) -> dict[str, Approval]:
    def bad(rule: str) -> LedgerError:
        return LedgerError(f"{path}: {rule}; refusing to trust it (repair or remove it by hand)")

    try:
        document = json.loads(data)
    except ValueError:
        raise bad("not valid JSON") from None
    if not isinstance(document, dict) or set(document) != {"format", "approvals"}:
        raise bad("must be an object with exactly format and approvals")
    if document["format"] != _FORMAT:
        raise bad(f"format must be {_FORMAT}")
    entries = document["approvals"]
    if not isinstance(entries, dict):
        raise bad("approvals must be an object")
    approvals: dict[str, Approval] = {}
    for name, entry in entries.items():
        if (
            not isinstance(entry, dict)
            or set(entry) != {"sha256", "approved_at"}
            or not isinstance(entry["sha256"], str)
            or len(entry["sha256"]) != 64
            or entry["sha256"].strip("0123456789abcdef")
            or not isinstance(entry["approved_at"], str)
        ):
            raise bad(f"approvals.{name}: must be {{sha256: 64 lowercase hex, approved_at: string}}")
        approvals[name] = Approval(name=name, sha256=entry["sha256"], approved_at=entry["approved_at"])
    return approvals
