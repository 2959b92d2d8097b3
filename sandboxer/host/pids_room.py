"""Whether a sandbox's pids limit has room for a process that enters it from outside.

The kernel holds a fork to a cgroup's pids.max, but not a process moved into the group, and an
exec's entry into a sandbox is such a move (a bwrap exec writes itself into the sandbox's
cgroups; Docker's runc moves each exec's process into the container's). Unchecked, each exec in
flight would be one process past a full sandbox's limit. Small and standard library only: the
spawner's forked children run it (backends/bwrap/joiner.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterable


def full_message(limit: int) -> str:
    """Why an exec could not start in a sandbox whose pids limit is reached."""
    return f"the sandbox is at its pids limit ({limit}): no new process can start in it until one of its processes ends"


def over_limit(groups: Iterable[str], *, starting: int) -> int | None:
    """The pids limit (pids.max) of one of `groups`, or of a group above one, that the processes
    there with `starting` more would exceed; None when there is room (or no pids group). A group
    above the sandbox's is counted too (the kernel nests the limits): a systemd slice's TasksMax
    reached is reported as the sandbox's limit."""
    for joined in groups:
        group = joined
        while (limit := _value(group, "pids.max")) is not None:  # none: not (or no longer) a pids group
            if limit.isdigit() and _count(group) + starting > int(limit):
                return int(limit)
            group = os.path.dirname(group)
    return None


def _count(group: str) -> int:
    value = _value(group, "pids.current")
    return int(value) if value is not None and value.isdigit() else 0


def _value(group: str, name: str) -> str | None:
    """A cgroup file's one value; None when it cannot be read (the group has no such file, or is
    gone): no room is refused on a file that is not there."""
    try:
        fd = os.open(os.path.join(group, name), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, 64).decode("ascii", "replace").strip()
    except OSError:
        return None
    finally:
        os.close(fd)
