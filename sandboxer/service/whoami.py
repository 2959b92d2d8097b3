"""What the service lets the calling account do (`GET /v1/me`): whether it is an owner, and for
a granted caller each profile its grants name — its limits, and whether the profile is approved
now (a granted profile that is not approved cannot be created). `sandboxer doctor` run by a
caller shows it; a program may ask before it tries."""

from __future__ import annotations

from typing import Any

from sandboxer.commands.owner import status_of
from sandboxer.service.access import Access, sandboxes_of


def caller_view(access: Access) -> dict[str, Any]:
    """The calling account's rights as this service sees them now."""
    rights = access.rights
    if rights is None:
        return {"uid": access.peer.uid, "owner": True, "live": None, "profiles": []}
    names = sorted({name for entry in rights.entries for name in entry.profiles})
    profiles = [
        {
            "name": name,
            "max_sandboxes": rights.limit_for(name),
            "max_ttl_seconds": rights.ttl_ceiling_for(name),
            "status": status_of(access.dirs, name),
        }
        for name in names
    ]
    live = len(sandboxes_of(access.dirs, rights.uid))
    return {"uid": rights.uid, "owner": False, "live": live, "profiles": profiles}
