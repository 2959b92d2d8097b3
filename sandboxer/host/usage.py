"""What a live sandbox uses now: memory (now and its peak), processes, CPU time, and the space
its workspace, private state and /tmp take. `inspect` and `sb.usage()` report it
(docs/reference.md, "inspect").

The counters are the kernel's for the sandbox's cgroups (v1: memory, pids, cpuacct; v2: the one
group), which count every process of the sandbox, gone ones' CPU time too. Under rlimits (no
cgroup the broker may make) they are summed from the processes in the sandbox's pid namespace
now, with psutil: no peak, and CPU time of processes still running only.

Space is read through the sandbox's own root (/proc/PID/root: its mounts as it sees them): a
filesystem of the sandbox's own (a tmpfs, the workspace's sized image) by statvfs; a workspace
on the host's disk by walking it, never following a link, bounded by WALK_LIMIT entries (then
the figure is a floor and says so).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

import psutil

from sandboxer.host import procs
from sandboxer.host.limit_events import flat_key

WALK_LIMIT = 200_000  # entries of a workspace walked for its size before the figure is a floor
NANOSECONDS = 1_000_000_000


@dataclass(frozen=True, slots=True, kw_only=True)
class Counters:
    """The sandbox's processes: memory in use now and at most so far (bytes), processes now,
    CPU time used (seconds); None where it cannot be known."""

    memory_bytes: int | None = None
    memory_peak_bytes: int | None = None
    pids: int | None = None
    cpu_seconds: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    """A backend's view of a running sandbox for its usage: its counters, where they come from
    ("cgroup": the kernel's for the sandbox's groups; "processes": summed over those running
    now), and a process whose /proc/PID/root is the sandbox's filesystem (None: there is none
    any more)."""

    counters: Counters
    source: str
    root_pid: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Space:
    """Bytes used on one of the sandbox's filesystems; `at_least` when a walk stopped early."""

    used_bytes: int
    at_least: bool = False


def cgroup_counters(groups: list[str] | tuple[str, ...]) -> Counters:
    """The counters of a sandbox's cgroup directories, v1 (one per controller) or v2."""
    memory = peak = pids = None
    cpu: float | None = None
    for group in groups:
        memory = _first(memory, _number(group, "memory.usage_in_bytes"), _number(group, "memory.current"))
        peak = _first(peak, _number(group, "memory.max_usage_in_bytes"), _number(group, "memory.peak"))
        pids = _first(pids, _number(group, "pids.current"))
        nanoseconds = _number(group, "cpuacct.usage")
        microseconds = flat_key(os.path.join(group, "cpu.stat"), "usage_usec")
        if cpu is None and nanoseconds is not None:
            cpu = nanoseconds / NANOSECONDS
        elif cpu is None and microseconds is not None:
            cpu = microseconds / 1_000_000
    return Counters(memory_bytes=memory, memory_peak_bytes=peak, pids=pids, cpu_seconds=cpu)


def process_counters(root_pid: int) -> Counters:
    """The counters summed over the processes in `root_pid`'s pid namespace (no peak)."""
    inode = procs.namespace_inode(root_pid, "pid")
    if inode is None:
        return Counters()
    memory = count = 0
    cpu = 0.0
    for pid in procs.in_pid_namespace(inode):
        try:
            process = psutil.Process(pid)
            with process.oneshot():
                memory += process.memory_info().rss
                times = process.cpu_times()
                cpu += times.user + times.system
            count += 1
        except psutil.Error:
            continue  # gone meanwhile
    return Counters(memory_bytes=memory, pids=count, cpu_seconds=round(cpu, 3))


def filesystem_used(root_pid: int, target: str) -> Space | None:
    """Bytes used on the filesystem mounted at `target` as the sandbox sees it (statvfs)."""
    try:
        seen = os.statvfs(f"/proc/{root_pid}/root{target}")
    except OSError:
        return None
    return Space(used_bytes=(seen.f_blocks - seen.f_bfree) * seen.f_frsize)


def tree_used(root_pid: int, target: str, *, limit: int = WALK_LIMIT) -> Space | None:
    """Bytes the files below `target` (as the sandbox sees it) take on disk, summed from their
    allocated blocks; links are never followed, nor other filesystems entered."""
    top = f"/proc/{root_pid}/root{target}"
    try:
        device = os.lstat(top).st_dev
    except OSError:
        return None
    used = entries = 0
    # os.fwalk enters each directory by a descriptor opened from its parent's and checked to be
    # the directory it listed: one the sandbox swaps for a link meanwhile is not entered, so no
    # path of the host's is ever walked. A directory it cannot read is left out of the figure.
    for _path, directories, files, directory_fd in os.fwalk(top, follow_symlinks=False):
        subdirectories = set(directories)
        entered = []
        for name in directories + files:
            entries += 1
            if entries > limit:
                return Space(used_bytes=used, at_least=True)
            try:
                seen = os.stat(name, dir_fd=directory_fd, follow_symlinks=False)
            except OSError:
                continue  # gone meanwhile
            if seen.st_dev != device:
                continue
            used += seen.st_blocks * 512
            if name in subdirectories and stat.S_ISDIR(seen.st_mode):
                entered.append(name)
        directories[:] = entered  # another filesystem's is not entered
    return Space(used_bytes=used)


def _number(group: str, name: str) -> int | None:
    try:
        with open(os.path.join(group, name)) as stream:
            return int(stream.read().strip())
    except (OSError, ValueError):
        return None


def _first(current: int | None, *values: int | None) -> int | None:
    """The value found already, else the first of `values` found now."""
    if current is not None:
        return current
    return next((value for value in values if value is not None), None)
