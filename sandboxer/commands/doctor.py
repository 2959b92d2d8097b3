"""`sandboxer doctor`: whether this host can run sandboxes, and what to do where it cannot —
one line per check, for the account that runs it.

Each check is "ok", "warn" (a part only some setups need, or a risk) or "fail" (no sandbox can be
made until it is fixed); a check that is not ok says what to do. Nothing is changed.
"""

from __future__ import annotations

import ctypes
import grp
import os
import pwd
import shutil
import stat
from typing import Any

from sandboxer.api.results import CallerView
from sandboxer.backends import Backends
from sandboxer.backends.protocol import Check
from sandboxer.clients.service import Client
from sandboxer.commands.owner import list_entries, status_of
from sandboxer.core.approvals import Status
from sandboxer.core.config_types import GRANTS_NAME
from sandboxer.core.configdir import load_grants
from sandboxer.dirs import ROOT_SOCKET, Dirs, find_service, state_dir_problem
from sandboxer.errors import PolicyError, SandboxerError, UntrustedServiceError
from sandboxer.host.limits import mechanism

TOOLS_PATH = "/usr/bin:/bin:/usr/local/bin"  # where the broker looks for git, whatever PATH says
MIN_FREE_MIB = 1024  # free space below this on the state dir's filesystem is a warning


def doctor(dirs: Dirs, *, backends: Backends) -> dict[str, Any]:
    """Every check, in order, and whether all of them passed (warnings allowed): this host's,
    then the broker's (the service, and the approvals and grants an owner keeps, or what the
    service lets a caller do)."""

    sandboxes = [check for name in backends.names for check in backends.backend(name).health()]
    checks = [
        sandboxes[0],  # the namespace engine first: every other check says what it needs
        _user_namespaces(),
        _landlock(),
        _cgroups(),
        _git(),
        _directory(dirs.config, "config dir"),
        _directory(dirs.state, "state dir"),
        _free_space(dirs.state),
        *sandboxes[1:],
        *_broker(dirs),
    ]
    return {
        "ok": all(check.status != "fail" for check in checks),
        "checks": [{"name": c.name, "status": c.status, "detail": c.detail, "fix": c.fix} for c in checks],
        "lines": [check.line() for check in checks],
    }


def _read(path: str) -> str | None:
    try:
        with open(path) as stream:
            return stream.read().strip()
    except OSError:
        return None


def _user_namespaces() -> Check:
    if _read("/proc/sys/kernel/apparmor_restrict_unprivileged_userns") == "1":
        return Check(
            "user namespaces",
            "fail",
            "AppArmor restricts unprivileged user namespaces (Ubuntu 23.10 and later)",
            "allow them for bwrap with an AppArmor profile (see docs/owner-guide.md), or "
            "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0",
        )
    if _read("/proc/sys/kernel/unprivileged_userns_clone") == "0":
        return Check(
            "user namespaces", "fail", "disabled (kernel.unprivileged_userns_clone=0)",
            "sysctl -w kernel.unprivileged_userns_clone=1",
        )  # fmt: skip
    if _read("/proc/sys/user/max_user_namespaces") == "0":
        return Check(
            "user namespaces", "fail", "disabled (user.max_user_namespaces=0)",
            "sysctl -w user.max_user_namespaces=15000",
        )  # fmt: skip
    return Check("user namespaces", "ok", "allowed")


def _landlock() -> Check:
    abi = _landlock_abi()
    if abi is None:
        return Check(
            "landlock",
            "fail",
            "not available (each exec is a Landlock domain of its own)",
            "boot a kernel with Landlock (5.13 or later; lsm=landlock,... on the kernel command line)",
        )
    return Check("landlock", "ok", f"ABI {abi}")


def _landlock_abi() -> int | None:

    libc = ctypes.CDLL(None, use_errno=True)
    version = libc.syscall(444, None, 0, 1)  # landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION)
    return int(version) if version > 0 else None


def _cgroups() -> Check:

    found = mechanism()
    if found is None:
        return Check(
            "cgroups",
            "warn",
            "no writable memory and pids controllers: limits fall back to rlimits, which profiles must allow "
            "(limits.best_effort)",
            "as root, mount cgroup v2 (or v1 memory and pids); otherwise run the broker as root",
        )
    return Check("cgroups", "ok", f"{found} (memory and pids)")


def _git() -> Check:
    path = shutil.which("git", path=TOOLS_PATH)
    if path is None:
        return Check("git", "fail", "not installed (every workspace is a clone)", "apt-get install git")
    return Check("git", "ok", path)


def _directory(path: str, what: str) -> Check:
    if what == "state dir":
        problem = state_dir_problem(path, euid=os.geteuid())
        if problem is not None:
            return Check(what, "fail", problem, "use a directory of this account's own (--state-dir, SANDBOXER_STATE)")
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return Check(what, "ok", f"{path} does not exist yet (made owner-only on first use)")
    except OSError as exc:
        return Check(what, "fail", f"{path} cannot be read ({exc.strerror})", "check its parent directories")
    if not stat.S_ISDIR(info.st_mode):
        return Check(what, "fail", f"{path} is not a directory", f"move it away: the broker makes {path}")
    if info.st_uid != os.geteuid():
        return Check(what, "fail", f"{path} belongs to uid {info.st_uid}", f"chown {os.geteuid()} {path}")
    if info.st_mode & 0o022:
        return Check(
            what, "fail", f"{path} is writable by others (mode {info.st_mode & 0o777:o})", f"chmod go-w {path}"
        )
    if what == "config dir" and info.st_mode & 0o077:
        return Check(what, "warn", f"{path} is readable by others (mode {info.st_mode & 0o777:o})", f"chmod 700 {path}")
    return Check(what, "ok", f"{path} (mode {info.st_mode & 0o777:o})")


def _free_space(path: str) -> Check:
    probe = path
    while not os.path.exists(probe) and probe != "/":
        probe = os.path.dirname(probe)
    try:
        room = os.statvfs(probe)
    except OSError as exc:
        return Check("disk space", "warn", f"{probe} cannot be measured ({exc.strerror})")
    free = room.f_bavail * room.f_frsize // (1024 * 1024)
    if free < MIN_FREE_MIB:
        return Check(
            "disk space", "warn", f"{free} MiB free for {path}", "free some, or move the state dir (--state-dir)"
        )
    return Check("disk space", "ok", f"{free} MiB free for {path}")


SERVICE_SECONDS = 10.0  # how long doctor waits for the service's answer


def _broker(dirs: Dirs) -> list[Check]:
    """The service this account's commands reach, and then, for an owner, the approvals and
    grants in the config dir; for a caller, what the service lets it do."""
    path = find_service(dirs, os.environ)  # as this account's commands find it
    mine = _owns(dirs.config)
    seen: CallerView | None = None
    try:
        seen = Client(path, timeout=SERVICE_SECONDS).whoami()
    except UntrustedServiceError as exc:
        return [Check("service", "fail", exc.message, "remove that socket, or point SANDBOXER_SOCKET at the broker's")]
    except PolicyError:
        return [
            Check("service", "ok", f"answers on {path}"),
            Check(
                "access",
                "fail",
                f"uid {os.geteuid()} is not granted this broker",
                "ask the broker's owner to grant this account profiles in grants.yaml",
            ),
        ]
    except SandboxerError:
        if not mine and path == ROOT_SOCKET:
            return [Check("service", "fail", f"none answers on {path}", "ask the broker's owner to start it")]
        idle = Check("service", "ok", f"none answers on {path} yet: the first command starts one on demand")
        return [idle, *(_owner_files(dirs) if mine else [])]
    service = Check("service", "ok", f"answers on {path}" + (" (as an owner)" if seen.owner else ""))
    if seen.owner:
        return [service, *(_owner_files(dirs) if mine else [])]
    return [service, _access(seen)]


def _owns(config_dir: str) -> bool:
    try:
        return os.geteuid() == 0 or os.stat(config_dir).st_uid == os.geteuid()
    except OSError:
        return False


def _owner_files(dirs: Dirs) -> list[Check]:
    """The approvals ledger against the files, and each grant's profiles."""
    try:
        entries = list_entries(dirs).entries
    except SandboxerError as exc:
        return [Check("approvals", "fail", exc.message, "repair it (docs/owner-guide.md)")]
    by_status: dict[str, list[str]] = {}
    for entry in entries:
        by_status.setdefault(entry.status, []).append(entry.name)
    approved = by_status.get(Status.APPROVED.value, [])
    waiting = [
        f"{status} {', '.join(names)}" for status, names in sorted(by_status.items()) if status != Status.APPROVED.value
    ]
    if not entries:
        approvals = Check(
            "approvals",
            "warn",
            f"no extension config or profile in {dirs.config}: no sandbox can be created",
            "docs/owner-guide.md, Quickstart",
        )
    elif waiting:
        approvals = Check(
            "approvals",
            "warn",
            f"{len(approved)} approved; {'; '.join(waiting)}",
            "review each with sandboxer ext check NAME, then sandboxer ext approve NAME",
        )
    else:
        approvals = Check("approvals", "ok", f"{len(approved)} approved ({', '.join(approved)})")
    return [approvals, _grants(dirs)]


def _grants(dirs: Dirs) -> Check:
    try:
        loaded = load_grants(dirs.config)
    except SandboxerError as exc:
        return Check("grants", "fail", exc.message, "mend grants.yaml, then sandboxer ext approve grants")
    if loaded is None:
        return Check("grants", "ok", "no grants.yaml: only the owners may call the service")
    _, grants = loaded
    status = status_of(dirs, GRANTS_NAME)
    if status != Status.APPROVED.value:
        return Check("grants", "warn", f"grants.yaml is {status}: it admits nobody", "sandboxer ext approve grants")
    problems, strangers = [], []
    for number, entry in enumerate(grants.grants, 1):
        who = ", ".join([*entry.users, *(f"group {group}" for group in entry.groups)])
        for profile in entry.profiles:
            profile_status = status_of(dirs, profile)
            if profile_status != Status.APPROVED.value:
                problems.append(f"grant {number} ({who}): profile {profile} is {profile_status}")
        # A name the host does not know admits nobody until an account (or group) takes it.
        strangers += [
            f"grant {number}: no account named {name} on this host" for name in entry.users if not _is_user(name)
        ]
        strangers += [
            f"grant {number}: no group named {name} on this host" for name in entry.groups if not _is_group(name)
        ]
    fixes = []
    if problems:
        fixes.append("approve those profiles, or take them out of the grant")
    if strangers:
        fixes.append("create the account or group, or take the name out (a name admits whoever takes it later)")
    if fixes:
        return Check("grants", "warn", "; ".join([*problems, *strangers]), "; ".join(fixes))
    return Check("grants", "ok", f"{len(grants.grants)} grant(s), every profile they name approved")


def _is_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def _is_group(name: str) -> bool:
    try:
        grp.getgrnam(name)
    except KeyError:
        return False
    return True


def _access(seen: CallerView) -> Check:
    """What the service lets this caller create."""
    usable = [p for p in seen.profiles if p.status == Status.APPROVED.value]
    parts = [f"{p.name} (up to {p.max_sandboxes} live, lifetime up to {p.max_ttl_seconds} s)" for p in usable]
    others = [f"{p.name} ({p.status})" for p in seen.profiles if p not in usable]
    detail = f"uid {seen.uid} has {seen.live} live sandbox(es); may create " + (", ".join(parts) or "nothing")
    if others:
        detail += f"; granted but not usable now: {', '.join(others)}"
        return Check("access", "warn", detail, "ask the broker's owner to approve them")
    if not usable:
        return Check("access", "fail", detail, "ask the broker's owner to grant this account a profile")
    return Check("access", "ok", detail)
