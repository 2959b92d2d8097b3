"""Evidence read from a live sandbox, and its comparison with the plan.

Everything here is observed, not echoed: the mount table from the namespace's own mountinfo,
the interfaces and routes of its network namespace, and what a probe process started through
the same path as `exec` reports about itself.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from sandboxer.core.plan import MountKind, Plan


@dataclass(frozen=True, slots=True, kw_only=True)
class MountSeen:
    """One line of the sandbox's mountinfo."""

    target: str
    read_only: bool
    fstype: str
    device: str = ""  # major:minor of the filesystem
    root: str = ""  # the path within that filesystem the mount shows at `target`
    size_kib: int | None = None  # a tmpfs's size=, as the kernel reports it


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeSeen:
    """What the probe process reported about itself."""

    uid: int
    gid: int
    groups: tuple[int, ...]
    cap_eff: int
    cap_prm: int
    cap_bnd: int
    no_new_privs: bool
    env_names: tuple[str, ...]
    cgroups: tuple[str, ...]
    seccomp: int = 0  # the kernel's Seccomp: line: 2 when a filter is installed

    def fields(self) -> dict[str, Any]:
        """As a JSON object (a warm sandbox's record keeps what its probe saw)."""
        return {
            "uid": self.uid,
            "gid": self.gid,
            "groups": list(self.groups),
            "cap_eff": self.cap_eff,
            "cap_prm": self.cap_prm,
            "cap_bnd": self.cap_bnd,
            "no_new_privs": self.no_new_privs,
            "env_names": list(self.env_names),
            "cgroups": list(self.cgroups),
            "seccomp": self.seccomp,
        }

    @classmethod
    def of_fields(cls, seen: dict[str, Any]) -> ProbeSeen:
        """Back from `fields`; KeyError, TypeError or ValueError when `seen` is not its shape."""
        return cls(
            uid=int(seen["uid"]),
            gid=int(seen["gid"]),
            groups=tuple(int(g) for g in seen["groups"]),
            cap_eff=int(seen["cap_eff"]),
            cap_prm=int(seen["cap_prm"]),
            cap_bnd=int(seen["cap_bnd"]),
            no_new_privs=bool(seen["no_new_privs"]),
            env_names=tuple(str(n) for n in seen["env_names"]),
            cgroups=tuple(str(c) for c in seen["cgroups"]),
            seccomp=int(seen["seccomp"]),
        )


_OCTAL = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo.
    return _OCTAL.sub(lambda match: chr(int(match.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[MountSeen]:
    """The mounts of a mountinfo file, in order."""
    mounts = []
    for line in text.splitlines():
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 6:
            continue
        options = fields[5].split(",")
        fstype, _, rest = right.partition(" ")
        sizes = [o[5:-1] for o in rest.partition(" ")[2].split(",") if o.startswith("size=") and o.endswith("k")]
        mounts.append(
            MountSeen(
                target=_unescape(fields[4]),
                read_only="ro" in options,
                fstype=fstype,
                device=fields[2],
                root=_unescape(fields[3]),
                size_kib=int(sizes[0]) if sizes and sizes[0].isdigit() else None,
            )
        )
    return mounts


def read_mountinfo(pid: int) -> list[MountSeen]:
    """The mount table of the mount namespace `pid` lives in."""
    with open(f"/proc/{pid}/mountinfo") as stream:
        return parse_mountinfo(stream.read())


def interfaces_from_proc(pid: int) -> list[str]:
    """Interface names of the network namespace of `pid`, from /proc/<pid>/net/dev."""
    with open(f"/proc/{pid}/net/dev") as stream:
        lines = stream.read().splitlines()[2:]
    return sorted(line.split(":", 1)[0].strip() for line in lines if ":" in line)


def _inside(host_id: int, id_map: str | None) -> int:
    """Translate an id as the host sees it into the sandbox's own view, through its id map.

    Read by the host, /proc/PID/uid_map lines are "<id inside> <id on the host> <count>".
    An id the map does not cover is the overflow id, 65534.
    """
    if id_map is None:
        return host_id
    for line in id_map.splitlines():
        fields = line.split()
        if len(fields) == 3:
            inside, outside, count = (int(f) for f in fields)
            if outside <= host_id < outside + count:
                return inside + host_id - outside
    return 65534


def parse_probe(
    status_text: str, env_text: bytes, cgroup_text: str, *, uid_map: str | None = None, gid_map: str | None = None
) -> ProbeSeen:
    """Parse the probe's status, its NUL-separated environment and its cgroups, as read by the host.

    Ids are translated into the sandbox's view through its id maps. Only environment *names*
    are kept; values are dropped here and never stored.
    """
    fields: dict[str, str] = {}
    for line in status_text.splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    names = sorted({entry.split(b"=", 1)[0].decode(errors="replace") for entry in env_text.split(b"\0") if entry})
    return ProbeSeen(
        uid=_inside(int(fields["Uid"].split()[0]), uid_map),
        gid=_inside(int(fields["Gid"].split()[0]), gid_map),
        groups=tuple(_inside(int(g), gid_map) for g in fields.get("Groups", "").split()),
        cap_eff=int(fields["CapEff"], 16),
        cap_prm=int(fields["CapPrm"], 16),
        cap_bnd=int(fields["CapBnd"], 16),
        no_new_privs=fields.get("NoNewPrivs") == "1",
        seccomp=int(fields.get("Seccomp", "0") or 0),
        env_names=tuple(names),
        cgroups=tuple(line.strip() for line in cgroup_text.splitlines() if line.strip()),
    )


# Mounts a sandbox has beyond the plan's own: the kernel filesystems bwrap makes below /proc
# (its read-only covers over /proc/sys and friends) and /dev (device nodes, pts, shm).
_KERNEL_PREFIXES = ("/proc", "/dev")


def differences(
    plan: Plan, mounts: list[MountSeen], interfaces: list[str], probe: ProbeSeen, *, backend_files: tuple[str, ...] = ()
) -> list[str]:
    """Every way the live sandbox differs from its plan (empty: it matches). `backend_files` are
    read-only files the backend itself places (the bwrap holder's program)."""
    return _mount_differences(plan, mounts, backend_files) + process_differences(plan, interfaces, probe)


def process_differences(
    plan: Plan, interfaces: list[str], probe: ProbeSeen, *, network: tuple[str, ...] = ()
) -> list[str]:
    """How what a probe process saw differs from the plan: network, user, privileges, environment.
    `network`: the interfaces besides lo its backend gave it (a Docker sandbox's own network of
    service containers)."""
    problems: list[str] = []
    planned = sorted(("lo", *network))
    if interfaces != planned:
        problems.append(f"network: interfaces are {', '.join(interfaces) or 'none'}, planned {', '.join(planned)}")
    if (probe.uid, probe.gid) != (plan.uid, plan.gid):
        problems.append(f"user: uid/gid {probe.uid}/{probe.gid}, planned {plan.uid}/{plan.gid}")
    if probe.uid == 0:
        problems.append("user: the sandbox user is root")
    if probe.cap_eff or probe.cap_prm or probe.cap_bnd:
        problems.append("capabilities: the probe holds capabilities")
    if not probe.no_new_privs:
        problems.append("no_new_privs: not set")
    if probe.seccomp != 2:
        problems.append("seccomp: the probe runs without a syscall filter")
    if probe.env_names != tuple(sorted(name for name, _ in plan.env)):
        problems.append("environment: the names seen differ from the plan")
    return problems


def _mount_differences(plan: Plan, mounts: list[MountSeen], backend_files: tuple[str, ...] = ()) -> list[str]:
    problems: list[str] = []
    by_target = {mount.target: mount for mount in mounts}  # the last mount at a target is the visible one
    expected_writable = set()
    for planned in plan.mounts:
        if planned.kind in (MountKind.DIR, MountKind.SYMLINK):
            continue
        seen = by_target.get(planned.target)
        if seen is None:
            problems.append(f"mount {planned.target}: planned but not mounted")
        elif planned.read_only and not seen.read_only:
            problems.append(f"mount {planned.target}: planned read-only but writable")
        elif planned.kind is MountKind.TMPFS and planned.size_bytes is not None:
            wanted = -(-planned.size_bytes // 4096) * 4  # the kernel counts whole pages, in KiB
            if (seen.fstype, seen.size_kib) != ("tmpfs", wanted):
                problems.append(
                    f"mount {planned.target}: planned a tmpfs of {wanted} KiB, found {seen.fstype} of {seen.size_kib}"
                )
        if not planned.read_only:
            expected_writable.add(planned.target)
    for planned in plan.mounts:  # a lease mount exactly once: never shadowed, never doubled
        count = sum(1 for mount in mounts if mount.target == planned.target)
        if planned.lease is not None and count > 1:
            problems.append(f"mount {planned.target}: lease {planned.lease} mounted {count} times")
    root = by_target.get("/")
    if root is None or not root.read_only:
        problems.append("mount /: the root must be read-only")
    planned_targets = {planned.target for planned in plan.mounts}
    problems += _unplanned(by_target, planned_targets, expected_writable, backend_files)
    return problems


def _unplanned(
    by_target: dict[str, MountSeen],
    planned_targets: set[str],
    expected_writable: set[str],
    backend_files: tuple[str, ...],
) -> list[str]:
    """Mounts the plan did not name, or writable where it planned them read-only."""
    problems: list[str] = []
    for target, seen in by_target.items():
        kernel = any(target == p or target.startswith(p + "/") for p in _KERNEL_PREFIXES)
        if target == "/" or kernel:
            continue
        if target in backend_files:
            if not seen.read_only:
                problems.append(f"mount {target}: the backend's file is writable")
        elif target not in planned_targets:
            problems.append(f"mount {target}: not in the plan")
        elif not seen.read_only and target not in expected_writable:
            problems.append(f"mount {target}: writable but planned read-only")
    return problems
