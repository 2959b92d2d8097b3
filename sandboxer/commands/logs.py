"""`logs ID --network`: a sandbox's egress decisions, read back from its access report.

The service's proxy appends one JSON line per connection to `<state>/sandboxes/<id>/network.jsonl`
(allowed) or `network-refused.jsonl` (refused; repeats counted), each rotated by size to `.1`
(sandboxer/service/egress/report.py). This reads all four, oldest first, checking each line's
shape: a line that does not parse (a write cut short by a crash) is skipped, never shown half.
The files are the broker's, in the sandbox's directory on the host, out of the sandbox's reach;
what they hold was chosen not to need hiding from the sandbox's caller (names, ports, decisions,
byte counts: no header value, body or secret).
"""

from __future__ import annotations

import json
import os
from typing import Any

from sandboxer.api.results import NetworkAccess, NetworkLog
from sandboxer.core.record import SandboxRecord
from sandboxer.dirs import Dirs
from sandboxer.errors import NotFoundError
from sandboxer.host.registry import Registry, check_id

ACCESS_LOG = "network.jsonl"  # the service's proxy writes them (sandboxer/service/egress/proxies.py)
REFUSED_LOG = "network-refused.jsonl"
MAX_ENTRIES = 20_000  # the report is bounded (four files of 1 MiB); this bounds an answer too


def has_egress(record: SandboxRecord) -> bool:
    """Whether the sandbox reaches the network through the egress proxy (its plan says so to its
    programs: SANDBOXER_NETWORK=proxy)."""
    return record.plan is not None and dict(record.plan.env).get("SANDBOXER_NETWORK") == "proxy"


def network_log(dirs: Dirs, sandbox_id: str, *, last: int | None = None) -> NetworkLog:
    """The sandbox's egress decisions, oldest first (the `last` N when given)."""
    registry = Registry(dirs.state)
    record = registry.read_or_none(check_id(sandbox_id))
    if record is None or record.hidden:
        raise NotFoundError(f"no such sandbox: {sandbox_id}")
    entries = read_report(registry.path(sandbox_id))[-MAX_ENTRIES:]
    if last is not None:
        entries = entries[-last:] if last > 0 else []
    return NetworkLog(id=sandbox_id, entries=tuple(entries))


def read_report(directory: str) -> list[NetworkAccess]:
    """Every line of the report in `directory`, oldest first (allowed and refused interleaved by
    time; a stable sort keeps each file's order within a millisecond)."""
    entries: list[NetworkAccess] = []
    for name in (ACCESS_LOG, REFUSED_LOG):
        path = os.path.join(directory, name)
        entries += _read(path + ".1") + _read(path)
    return sorted(entries, key=lambda entry: entry.time)


def counts(dirs: Dirs, sandbox_id: str) -> dict[str, int]:
    """What inspect shows: connections allowed and refused, bytes both ways (from the report)."""
    entries = network_log(dirs, sandbox_id).entries
    return {
        "allowed": sum(entry.count for entry in entries if entry.decision == "allowed"),
        "refused": sum(entry.count for entry in entries if entry.decision == "refused"),
        "sent": sum(entry.sent for entry in entries),
        "received": sum(entry.received for entry in entries),
    }


def _read(path: str) -> list[NetworkAccess]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return []
    with open(fd, "rb") as report:
        lines = report.read().splitlines()
    found = []
    for line in lines:
        entry = _entry(line)
        if entry is not None:
            found.append(entry)
    return found


def _entry(line: bytes) -> NetworkAccess | None:
    try:
        document: Any = json.loads(line)
        if not isinstance(document, dict):
            return None
        return NetworkAccess.from_json(document)
    except ValueError:  # not JSON, or not the shape (pydantic's ValidationError is a ValueError)
        return None
