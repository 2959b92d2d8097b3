"""`sandboxer doctor`: whether this host can run sandboxes, and what to do where it cannot —
one line per check, for the account that runs it.

Each check is "ok", "warn" (a part only some setups need, or a risk) or "fail" (no sandbox can be
made until it is fixed); a check that is not ok says what to do. Nothing is changed.
"""

from __future__ import annotations

import os
import shutil
import stat
from typing import Any

from sandboxer.backends.protocol import Check
from sandboxer.dirs import Dirs, state_dir_problem

TOOLS_PATH = "/usr/bin:/bin:/usr/local/bin"  # where the broker looks for git, whatever PATH says
MIN_FREE_MIB = 1024  # free space below this on the state dir's filesystem is a warning


def doctor(dirs: Dirs) -> dict[str, Any]:
    """Every check, in order, and whether all of them passed (warnings allowed)."""
    from sandboxer.backends import NAMES, backend_for

    sandboxes = [check for name in NAMES for check in backend_for(name).health()]
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
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    version = libc.syscall(444, None, 0, 1)  # landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION)
    return int(version) if version > 0 else None


def _cgroups() -> Check:
    from sandboxer.host.limits import mechanism

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
