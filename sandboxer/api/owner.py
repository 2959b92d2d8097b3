"""The owner's verbs of the embedded API (`broker.owner`): the owner-file and runtime commands,
each authorized for the broker's caller first."""

from __future__ import annotations

from sandboxer.api.caller import Authority
from sandboxer.api.results import Approval, OwnerCheck, OwnerEntry, OwnerListing, RuntimeDigest, RuntimePin
from sandboxer.backends import Backends
from sandboxer.commands import owner as owner_commands
from sandboxer.dirs import Dirs

__all__ = ["Owner"]


class Owner:
    """The owner's verbs: check, approve, revoke and list owner files; digest and pin a runtime.
    Each is refused (PolicyError, 3) to a granted caller."""

    def __init__(self, dirs: Dirs, authority: Authority, backends: Backends) -> None:
        self.dirs = dirs
        self._authority = authority
        self._backends = backends

    def _require(self, what: str) -> None:
        self._authority.require_owner(what)

    def check(self, path: str) -> OwnerCheck:
        """Validate one owner file; its normalized meaning (ConfigError, 2, when invalid)."""
        return owner_commands.check(path)

    def approve(self, name: str) -> Approval:
        """Approve the exact current bytes of one owner file."""
        self._require("ext approve")
        return owner_commands.approve(self.dirs, name, backends=self._backends)

    def revoke(self, name: str) -> Approval:
        """Withdraw an approval."""
        self._require("ext revoke")
        return owner_commands.revoke(self.dirs, name)

    def listing(self) -> OwnerListing:
        """Every owner file with its approval status (ext list --json)."""
        self._require("ext list")
        return owner_commands.list_entries(self.dirs)

    def list(self) -> list[OwnerEntry]:
        """The entries of `listing()`."""
        return list(self.listing().entries)

    def runtime_digest(self, path: str, *, full: bool = False) -> RuntimeDigest:
        """The tree digest v1 of the runtime directory `path` (read with the broker's rights: only
        for a caller of the broker's own account)."""
        self._require("runtime digest")
        self._authority.require_own_files("runtime digest")
        return owner_commands.runtime_digest(self.dirs, path, full=full)

    def runtime_pin(self, path: str, extension: str) -> RuntimePin:
        """Write a runtime directory and its digest into an extension config, for the owner to
        review and approve."""
        self._require("runtime pin")
        self._authority.require_own_files("runtime pin")
        return owner_commands.runtime_pin(self.dirs, path, extension)
