"""Resource limits: cgroups where the host offers a writable hierarchy, otherwise rlimits.

cgroup v1 (as on hybrid hosts): a group named sandboxer/<id> under the memory and pids
controllers, and under the cpu and cpuacct ones where the host mounts them (CPU time, and
`limits.cpus` as a CFS quota). cgroup v2: sandboxer/<id> below the unified root, or below the
broker's own cgroup when that subtree is delegated to it (with the cpu controller where it is
available). Without either, per-process rlimits (RLIMIT_AS for memory, RLIMIT_NPROC for
processes) are applied to every command started in the sandbox; a CPU quota needs a cgroup.
"""

from __future__ import annotations

import contextlib
import os
import resource
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator

    from sandboxer.core.config_types import Limits
from sandboxer.core.reading import open_dir_nofollow
from sandboxer.core.record import LimitsRecord
from sandboxer.errors import BackendError, PolicyError

CGROUP_ROOT = "/sys/fs/cgroup"
CFS_PERIOD_US = 100_000  # the CFS period a quota is a share of: the kernel's default, 100 ms


@dataclass(frozen=True, slots=True, kw_only=True)
class LimitSetup:
    """How a sandbox's limits are enforced, and what to remove at teardown."""

    mechanism: str  # "cgroup-v1", "cgroup-v2" or "rlimit"
    groups: tuple[str, ...] = ()  # cgroup directories, made by us
    procs_files: tuple[str, ...] = ()  # the files a new command writes "0" to, to join (tasks on v1)
    rlimits: tuple[tuple[int, int], ...] = field(default_factory=tuple)
    cpus: float | None = None  # the CPU quota set, in cores (None: none, best_effort without a cpu controller)

    def recorded(self, limits: Limits) -> LimitsRecord:
        """What the record keeps of these limits."""

        return LimitsRecord(
            mechanism=self.mechanism,
            groups=self.groups,
            procs_files=self.procs_files,
            rlimits=self.rlimits,
            memory_mib=limits.memory_mib,
            pids=limits.pids,
            cpus=self.cpus,
        )

    @classmethod
    def of(cls, recorded: LimitsRecord) -> LimitSetup:
        """The setup a record's limits describe."""
        return cls(
            mechanism=recorded.mechanism,
            groups=recorded.groups,
            procs_files=recorded.procs_files,
            rlimits=recorded.rlimits,
            cpus=recorded.cpus,
        )


def _is_cgroup2(path: str) -> bool:
    return os.path.exists(os.path.join(path, "cgroup.controllers"))


def _v1_usable() -> bool:
    return all(
        os.path.isdir(os.path.join(CGROUP_ROOT, c)) and os.access(os.path.join(CGROUP_ROOT, c), os.W_OK)
        for c in ("memory", "pids")
    ) and not _is_cgroup2(CGROUP_ROOT)


def _v2_parent() -> str | None:
    if not _is_cgroup2(CGROUP_ROOT):
        return None
    candidates = []
    if os.geteuid() == 0:
        candidates.append(CGROUP_ROOT)
    try:
        with open("/proc/self/cgroup") as stream:
            for line in stream:
                if line.startswith("0::"):
                    candidates.append(os.path.join(CGROUP_ROOT, line[3:].strip().lstrip("/")))
    except OSError:
        pass
    for parent in candidates:
        try:
            with open(os.path.join(parent, "cgroup.controllers")) as stream:
                available = stream.read().split()
        except OSError:
            continue
        if {"memory", "pids"} <= set(available) and os.access(os.path.join(parent, "cgroup.subtree_control"), os.W_OK):
            return parent
    return None


def _v1_cpu_hierarchies() -> list[str]:
    """The v1 hierarchies holding the cpu and cpuacct controllers, each once, by its real name
    (`cpu` and `cpuacct` are often links to one `cpu,cpuacct`); those this process may write in."""
    found: list[str] = []
    for controller in ("cpu", "cpuacct"):
        hierarchy = os.path.realpath(os.path.join(CGROUP_ROOT, controller))
        if os.path.dirname(hierarchy) != CGROUP_ROOT or not os.path.isdir(hierarchy):
            continue
        if hierarchy not in found and os.access(hierarchy, os.W_OK):
            found.append(hierarchy)
    return found


def quota(cpus: float) -> int:
    """A CFS quota of `cpus` cores, in microseconds per CFS_PERIOD_US (the kernel's least is 1 ms)."""
    return max(1000, round(cpus * CFS_PERIOD_US))


def mechanism() -> str | None:
    """What would hold a new sandbox's limits here: "cgroup-v1", "cgroup-v2", or None (rlimits)."""
    if _v1_usable():
        return "cgroup-v1"
    return "cgroup-v2" if _v2_parent() is not None else None


def _write(path: str, value: str) -> None:
    with open(path, "w") as stream:
        stream.write(value)


def setup(sandbox_id: str, limits: Limits) -> LimitSetup:
    """Prepare the limits of a new sandbox; fail closed unless the profile allows best effort."""
    made: list[str] = []  # each group as it is made: removed again when setting up fails
    try:
        if _v1_usable():
            return _setup_v1(sandbox_id, limits, made)
        parent = _v2_parent()
        if parent is not None:
            return _setup_v2(parent, sandbox_id, limits, made)
    except _NoCpuController:  # (only without best_effort)
        remove(tuple(made))
        raise PolicyError(
            "limits.cpus: this host offers the broker no cpu cgroup controller; set limits.best_effort"
        ) from None
    except OSError as exc:
        remove(tuple(made))
        if not limits.best_effort:
            raise BackendError(f"cannot set up cgroup limits ({exc.strerror})") from None
    if limits.cpus is not None and not limits.best_effort:  # an rlimit caps CPU time, it is no quota
        raise PolicyError("limits.cpus: a CPU quota needs a cgroup, and this host offers none; set limits.best_effort")
    pairs = ((resource.RLIMIT_AS, limits.memory_mib * 1024 * 1024), (resource.RLIMIT_NPROC, limits.pids))
    for which, value in pairs:
        _soft, hard = resource.getrlimit(which)
        if hard != resource.RLIM_INFINITY and hard < value and not limits.best_effort:
            raise PolicyError(f"limits: the host caps rlimit {which} below the profile's limit; set limits.best_effort")
    return LimitSetup(mechanism="rlimit", rlimits=pairs)


def _setup_v1(sandbox_id: str, limits: Limits, made: list[str]) -> LimitSetup:
    for controller in ("memory", "pids"):
        group = os.path.join(CGROUP_ROOT, controller, "sandboxer", sandbox_id)
        os.makedirs(group, mode=0o755)
        made.append(group)
    _write(os.path.join(made[0], "memory.limit_in_bytes"), str(limits.memory_mib * 1024 * 1024))
    _write(os.path.join(made[1], "pids.max"), str(limits.pids))
    held = False
    for hierarchy in _v1_cpu_hierarchies():  # CPU time, and the quota
        group = os.path.join(hierarchy, "sandboxer", sandbox_id)
        os.makedirs(group, mode=0o755)
        made.append(group)
        if limits.cpus is not None and os.path.exists(os.path.join(group, "cpu.cfs_quota_us")):
            with _unless_best_effort(limits):
                _write(os.path.join(group, "cpu.cfs_period_us"), str(CFS_PERIOD_US))
                _write(os.path.join(group, "cpu.cfs_quota_us"), str(quota(limits.cpus)))
                held = True
    if limits.cpus is not None and not held and not limits.best_effort:
        raise _NoCpuController()
    return LimitSetup(
        mechanism="cgroup-v1",
        groups=tuple(made),
        # "tasks", not "cgroup.procs": moving one thread (ours, single-threaded, writing "0")
        # skips the kernel's global threadgroup lock and its RCU grace period, about 8 ms on
        # every exec.
        procs_files=tuple(os.path.join(g, "tasks") for g in made),
        cpus=limits.cpus if held else None,
    )


def _setup_v2(parent: str, sandbox_id: str, limits: Limits, made: list[str]) -> LimitSetup:
    base = os.path.join(parent, "sandboxer")
    with contextlib.suppress(OSError):
        _write(os.path.join(parent, "cgroup.subtree_control"), "+memory +pids")
    with contextlib.suppress(OSError):  # CPU time and the quota where the cpu controller is offered
        _write(os.path.join(parent, "cgroup.subtree_control"), "+cpu")
    os.makedirs(base, exist_ok=True)
    _write(os.path.join(base, "cgroup.subtree_control"), "+memory +pids")
    with contextlib.suppress(OSError):
        _write(os.path.join(base, "cgroup.subtree_control"), "+cpu")
    group = os.path.join(base, sandbox_id)
    os.mkdir(group, 0o755)
    made.append(group)
    _write(os.path.join(group, "memory.max"), str(limits.memory_mib * 1024 * 1024))
    _write(os.path.join(group, "pids.max"), str(limits.pids))
    held = False
    if limits.cpus is not None and os.path.exists(os.path.join(group, "cpu.max")):
        with _unless_best_effort(limits):
            _write(os.path.join(group, "cpu.max"), f"{quota(limits.cpus)} {CFS_PERIOD_US}")
            held = True
    elif limits.cpus is not None and not limits.best_effort:
        raise _NoCpuController()
    return LimitSetup(
        mechanism="cgroup-v2",
        groups=(group,),
        procs_files=(os.path.join(group, "cgroup.procs"),),
        cpus=limits.cpus if held else None,
    )


class _NoCpuController(Exception):
    """limits.cpus, and no cpu controller to hold it."""


@contextlib.contextmanager
def _unless_best_effort(limits: Limits) -> Iterator[None]:
    """Setting the CPU quota: under best_effort a quota the kernel refuses is left out (the
    memory and pids limits stay); otherwise its OSError refuses the sandbox."""
    try:
        yield
    except OSError:
        if not limits.best_effort:
            raise


def remove(groups: tuple[str, ...]) -> list[str]:
    """Remove cgroup directories; returns those that could not be removed."""
    left = []
    for group in groups:
        try:
            names = os.listdir(group)
        except OSError:
            names = []
        for name in names:
            if name.startswith("exec-"):  # each on its own: an exec's thread may be removing it too
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(group, name))
        try:
            os.rmdir(group)
        except FileNotFoundError:
            continue
        except OSError:
            left.append(group)
    return left


def of_sandbox(group: str, sandbox_id: str) -> bool:
    """Whether `group` is a cgroup of the broker's naming for this sandbox (`sandboxer/<id>` below
    the cgroup hierarchy, as `setup` makes it), reached without a symlink: teardown and gc remove
    only these, whatever a record says."""
    parts = group.split("/")
    if not group.startswith(CGROUP_ROOT + "/") or os.path.normpath(group) != group:
        return False
    if parts[-2:] != ["sandboxer", sandbox_id] or any(part in ("", ".", "..") for part in parts[1:]):
        return False

    try:
        os.close(open_dir_nofollow(group))
    except FileNotFoundError:
        return True  # gone already: nothing to remove, nothing to refuse
    except OSError:
        return False
    return True


def members(group: str) -> list[int]:
    """The pids in a cgroup."""
    try:
        with open(os.path.join(group, "cgroup.procs")) as stream:
            return [int(line) for line in stream if line.strip()]
    except OSError:
        return []


def leftover_groups(sandbox_id: str) -> tuple[str, ...]:
    """cgroup directories named after a sandbox whose record never listed them (crash mid-create)."""
    hierarchies = [os.path.join(CGROUP_ROOT, c) for c in ("memory", "pids")] + _v1_cpu_hierarchies()
    candidates = [os.path.join(hierarchy, "sandboxer", sandbox_id) for hierarchy in hierarchies]
    candidates.append(os.path.join(CGROUP_ROOT, "sandboxer", sandbox_id))
    return tuple(path for path in candidates if os.path.isdir(path))
