"""What a sandbox's limits did while an exec ran, for the broker's line on why it died.

Its sized filesystems are looked at too, after an exec that failed: one that is full (the state
tmpfs, /tmp, /var/tmp, the workspace) is named with the profile key that sizes it, since a
program's own "No space left on device" names neither.

The kernel counts, per cgroup, the processes the memory limit killed (`oom_kill` in cgroup v1's
memory.oom_control, v2's memory.events) and the forks the pids limit refused (`max` in
pids.events). They are read before and after an exec: a count that grew names the limit that
stopped it. The counts are the sandbox's, its exec groups' included, so an exec running beside
another that hit a limit is usually told about it too (not when that other exec's own group is
removed before this one ends: its count goes with it). Without cgroups (the rlimit mechanism)
there is nothing to count: an allocation past RLIMIT_AS fails inside, where the program says so
itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sandboxer.core.record_exec import ExecView

_MEMORY_FILES = ("memory.oom_control", "memory.events")  # cgroup v1, v2: an "oom_kill N" line
_PIDS_FILE = "pids.events"  # a "max N" line: forks refused at pids.max


@dataclass(frozen=True, slots=True)
class Counts:
    oom_kills: int
    pid_refusals: int

    def __add__(self, other: Counts) -> Counts:
        return Counts(self.oom_kills + other.oom_kills, self.pid_refusals + other.pid_refusals)


class LimitWatch:
    """The counts of one sandbox's cgroups, taken when an exec starts; why() after it ended."""

    def __init__(self, view: ExecView, groups: list[str]) -> None:
        self._view = view
        self.groups = groups  # the sandbox's cgroup directories (Execution.limit_groups, sandboxer.backends.protocol)
        self._before = _counts(self.groups)
        self._gone = Counts(oom_kills=0, pid_refusals=0)  # of the exec's own groups, removed since

    def remove_group(self, group: str) -> None:
        """Remove an exec's own cgroup below the sandbox's, keeping what it counted: the kernel
        counts a refused fork in the group that forked, and the count goes with the group. One a
        background process of the exec still runs in stays, and is counted where it is."""
        counts = _counts([group])
        try:
            os.rmdir(group)
        except OSError:
            return
        self._gone += counts

    def why(self, status: int) -> list[str]:
        """The broker's lines for the limits that acted during the exec (none: none did)."""
        after = _counts(self.groups) + self._gone
        lines = []
        if after.oom_kills > self._before.oom_kills:
            limit = f"the memory limit ({self._view.memory_mib} MiB)"
            lines.append(f"killed by {limit}" if status == 128 + 9 else f"{limit} killed a process of the sandbox")
        if after.pid_refusals > self._before.pid_refusals:
            lines.append(f"the pids limit ({self._view.pids}) refused a new process")
        return lines


def _counts(groups: list[str]) -> Counts:
    """The counts of the sandbox's groups and of every group below them: an exec's own group
    (made to find all of an exec's processes) counts the forks refused in it itself, not its
    parent, whose pids.max refused them (cgroup v1)."""
    oom = refused = 0
    for group in groups:
        for directory, _, files in os.walk(group):
            for name in set(files).intersection(_MEMORY_FILES):  # a controller's own files only
                oom += flat_key(os.path.join(directory, name), "oom_kill") or 0
            if _PIDS_FILE in files:
                refused += flat_key(os.path.join(directory, _PIDS_FILE), "max") or 0
    return Counts(oom_kills=oom, pid_refusals=refused)


def flat_key(path: str, key: str) -> int | None:
    """The number after `key` on its line of a cgroup's flat-keyed file (None: no such file or line)."""
    try:
        with open(path) as stream:
            for line in stream:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        return None
    return None


# The sandbox's sized filesystems and the profile key that sizes each.
SIZED = (
    ("/run/sandboxer/state", "limits.state_mib"),
    ("/tmp", "limits.tmp_mib"),  # noqa: S108 - inside the sandbox
    ("/var/tmp", "limits.tmp_mib"),  # noqa: S108 - inside the sandbox
    ("/workspace", "limits.workspace_mib"),
)
FULL_BYTES = 64 * 1024  # less free than this: full (a failed write leaves at most a partial block)


def full_filesystems(root_pid: int | None, *, workspace_sized: bool = True) -> list[str]:
    """The broker's lines for the sandbox's sized filesystems that are full now, seen through
    `root_pid`'s root (its mount namespace). A workspace without a size of its own (where it
    cannot be enforced) is the host's filesystem: its being full is not the profile's limit."""
    if root_pid is None:
        return []
    lines = []
    for target, key in SIZED:
        if target == "/workspace" and not workspace_sized:
            continue
        try:
            seen = os.statvfs(f"/proc/{root_pid}/root{target}")
        except OSError:
            continue
        if seen.f_blocks and seen.f_bavail * seen.f_frsize < FULL_BYTES:
            size = round(seen.f_blocks * seen.f_frsize / 2**20)
            lines.append(f"{target} is full ({key}: {size} MiB)")
    return lines
