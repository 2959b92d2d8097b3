"""`exports`: the work the service's reaper kept of expired sandboxes (sandboxer.service.lifetimes),
listed, fetched and removed by the caller it belongs to.

A kept export is `<state>/exports/<id>/` (the sandbox's id): `work.bundle` (its new commits),
`tree.tar` (its changed tree) or both, and summary.json (what the export summary said, the
caller's uid, the bytes kept, `kept_until`). It counts against its caller's export budget
(sandboxer.commands.export_space) until it is removed or its time is up. A granted caller sees
and names only its own: another's answers exactly as an id nobody has. Owners see every one.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from sandboxer.api.results import KeptExportRemoved, KeptExports
from sandboxer.commands.export_space import EXPORTS, SUMMARY, kept_uid, ledger, read_json
from sandboxer.core.record import expiry_text
from sandboxer.errors import NotFoundError, UsageError
from sandboxer.host.fstree import remove_tree
from sandboxer.host.registry import ID_PATTERN

if TYPE_CHECKING:
    from sandboxer.dirs import Dirs

KEPT_FILES = {"bundle": "work.bundle", "tar": "tree.tar"}  # what `exports get` takes out, by format
_SHOWN = ("head", "branch", "base", "ref", "ahead", "dirty")  # of the export summary


def list_kept(dirs: Dirs, uid: int | None) -> KeptExports:
    """exports --json: the kept exports `uid` may see (None: an owner, every one), by id."""
    root = os.path.join(dirs.state, EXPORTS)
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        names = []
    found = []
    for name in names:
        summary = _summary(root, name)
        if summary is not None and (uid is None or kept_uid(summary) == uid):
            found.append(_entry(root, name, summary))
    return KeptExports.from_json({"exports": found})


def kept_file(dirs: Dirs, export_id: str, fmt: str, uid: int | None) -> str:
    """The path of the kept export's bundle (`fmt` "bundle") or tree's tar ("tar"), for a
    caller that may name it."""
    if fmt not in KEPT_FILES:
        raise UsageError(f"exports get: the format must be one of {', '.join(KEPT_FILES)}")
    root = os.path.join(dirs.state, EXPORTS)
    summary = _own(root, export_id, uid)
    files = [str(name) for name in summary.get("files", [])]
    if KEPT_FILES[fmt] not in files:
        held = " and ".join(f for f, file in KEPT_FILES.items() if file in files) or "nothing"
        what = "new commits (a bundle)" if fmt == "bundle" else "changes not committed (a tree's tar)"
        raise UsageError(f"exports get: {export_id} kept no {what}; it holds: {held}")
    return os.path.join(root, export_id, KEPT_FILES[fmt])


def remove_kept(dirs: Dirs, export_id: str, uid: int | None) -> KeptExportRemoved:
    """exports rm: remove a kept export (its room in its caller's budget is free at once)."""
    root = os.path.join(dirs.state, EXPORTS)
    summary = _own(root, export_id, uid)
    with ledger(root):
        remove_tree(os.path.join(root, export_id))
    return KeptExportRemoved(id=export_id, removed=tuple(str(name) for name in summary.get("files", [])))


def fetch_hint(export_id: str) -> str:
    """How its caller takes a kept export out (the reaper's audit line, the listing)."""
    return f"sandboxer exports get {export_id} FILE [--tar]"


def expiry_notice(dirs: Dirs, sandbox_id: str, uid: int) -> str | None:
    """What a caller is told of its sandbox that expired with work the reaper kept for it (None:
    there is none of this caller's)."""
    try:
        summary = _own(os.path.join(dirs.state, EXPORTS), sandbox_id, uid)
    except NotFoundError:
        return None
    until = summary.get("kept_until")
    when = f" until {expiry_text(until)}" if isinstance(until, (int, float)) else ""
    return f"it ended and its work is kept{when}: {fetch_hint(sandbox_id)}"


def _own(root: str, export_id: str, uid: int | None) -> dict[str, Any]:
    """A kept export's summary, when `uid` may name it; anything else answers as unknown."""
    summary = _summary(root, export_id) if ID_PATTERN.fullmatch(export_id) else None
    if summary is None or (uid is not None and kept_uid(summary) != uid):
        raise NotFoundError(f"no such kept export: {export_id}")
    return summary


def _summary(root: str, name: str) -> dict[str, Any] | None:
    if not ID_PATTERN.fullmatch(name) or not os.path.isdir(os.path.join(root, name)):
        return None
    return read_json(os.path.join(root, name, SUMMARY))


def _entry(root: str, name: str, summary: dict[str, Any]) -> dict[str, Any]:
    until = summary.get("kept_until")
    return {
        "id": name,
        "uid": kept_uid(summary),
        "files": [str(file) for file in summary.get("files", [])],
        "bytes": summary.get("bytes"),
        "kept_until": expiry_text(until) if isinstance(until, (int, float)) else None,
        "directory": os.path.join(root, name),
        **{key: summary.get(key) for key in _SHOWN},
    }
