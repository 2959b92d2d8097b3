"""What a caller other than the owners may do: the entries of grants.yaml that name its account
or one of its groups — as the kernel reports them for the connection (SO_PEERCRED for the uid,
SO_PEERGROUPS for the groups: sandboxer.service.peer) — while grants.yaml is approved with its
current bytes.

The file is read and its approval checked again on every request: a byte changed revokes every
caller at once, until an owner approves the new bytes. A create is admitted under the entries
that grant its profile; its limit is the largest of theirs (each entry is a grant the owner made).
"""

from __future__ import annotations

import grp
import os
import pwd
from dataclasses import dataclass

from sandboxer.commands.export_space import Budget, default_budget
from sandboxer.core.approvals import Ledger, Status
from sandboxer.core.config_types import GRANTS_NAME, Grant
from sandboxer.core.configdir import load_grants
from sandboxer.dirs import Dirs
from sandboxer.errors import SandboxerError
from sandboxer.host.parse_cache import ParseCache


@dataclass(frozen=True, slots=True)
class Rights:
    """A granted caller: its uid and the grant entries that name it."""

    uid: int
    entries: tuple[Grant, ...]

    def limit_for(self, profile: str) -> int | None:
        """The most live sandboxes this caller may have when creating `profile`; None: not granted."""
        limits = [entry.max_sandboxes for entry in self.entries if profile in entry.profiles]
        return max(limits) if limits else None

    def ttl_ceiling_for(self, profile: str) -> int | None:
        """The longest lifetime this caller's sandbox of `profile` may have; None: not granted."""
        ceilings = [entry.max_ttl_seconds for entry in self.entries if profile in entry.profiles]
        return max(ceilings) if ceilings else None

    def exports_budget(self) -> Budget:
        """The caller's export budget: the largest `max_exports_mib` of its entries, else the
        broker's default (sandboxer.commands.export_space)."""
        set_ = [entry.max_exports_mib for entry in self.entries if entry.max_exports_mib is not None]
        return Budget(self.uid, max(set_), "max_exports_mib") if set_ else default_budget(self.uid)


def budget_of_account(dirs: Dirs, uid: int) -> Budget:
    """The export budget of `uid` when no connection of it is at hand (the reaper keeping an
    expired sandbox's work): its grants by its account's groups in the account database; an
    account no grant names has the default."""
    try:
        account = pwd.getpwuid(uid)
        groups = set(os.getgrouplist(account.pw_name, account.pw_gid))
    except (KeyError, OSError):
        groups = set()
    rights = rights_of(uid, groups, dirs)
    return rights.exports_budget() if rights is not None else default_budget(uid)


def rights_of(uid: int, groups: set[int], dirs: Dirs) -> Rights | None:
    """The caller's rights, or None when no approved grant names it."""

    try:
        loaded = load_grants(dirs.config, cache=ParseCache.of_state(dirs.state))
        if loaded is None:
            return None
        _, grants = loaded
        if Ledger(dirs.config).status(GRANTS_NAME, grants.file_sha256) is not Status.APPROVED:
            return None
    except (SandboxerError, OSError):
        return None  # an invalid or unreadable grants file admits nobody
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = None
    group_names = set()
    for gid in groups:
        try:
            group_names.add(grp.getgrgid(gid).gr_name)
        except KeyError:
            continue
    entries = tuple(
        entry
        for entry in grants.grants
        if (user is not None and user in entry.users) or group_names & set(entry.groups)
    )
    return Rights(uid=uid, entries=entries) if entries else None
