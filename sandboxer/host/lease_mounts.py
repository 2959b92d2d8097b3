"""The host mounts the broker (as root) makes for a sandbox's leases, on either engine.

Staged lease sources: bwrap (0.8) resolves a --ro-bind-fd source back to its path and walks it as
the sandbox's own unprivileged uid, which cannot pass the run directory (0700, the assignment
owner's), and Docker resolves a bind source by path. So a root broker binds each lease source,
opened symlink-free below the run directory, read-only onto a mount point in the sandbox's own
directory (0711) first (`stage`); the engine binds from there. teardown and gc unmount them
before anything else (`unstage`).

Spools: each request spool is a bounded tmpfs of its own (`mount_spool_tmpfs`), on the directory
its backend made for it.
"""

from __future__ import annotations

import ctypes
import os
import stat
from dataclasses import replace as replaced
from typing import TYPE_CHECKING, Any

from sandboxer.core.plan import Mount, MountKind, Plan
from sandboxer.core.reading import open_beneath
from sandboxer.errors import BackendError, PolicyError
from sandboxer.host.fsutil import mount_points, unmount
from sandboxer.host.observe import parse_mountinfo

if TYPE_CHECKING:
    from sandboxer.host.observe import MountSeen

# A spool is a tmpfs of its own (root brokers; on Docker mounted over its volume's directory):
# room for the pending quota and the responses, and nothing a consumer could use to fill the
# state dir's or the Engine's filesystem.
SPOOL_FS_OPTIONS = "size=64m,nr_inodes=4096,mode=0755"

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT, _MS_BIND, _MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 1 << 18


def _libc() -> Any:

    return ctypes.CDLL(None, use_errno=True)


def _mount_call(source: str | None, target: str, flags: int) -> None:

    result = _libc().mount(None if source is None else source.encode(), target.encode(), None, flags, None)
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), target)


def stage(plan: Plan, sandbox_dir: str, *, owner: int) -> Plan:
    """The plan with each lease bind's source replaced by a read-only staged bind of it.

    The staging directory is root's and 0710 with the sandbox's own host group, so that only
    bwrap (run as the sandbox's uid and gid) passes it, and it is a private mount of its own, so
    nothing bound below it propagates to other mount namespaces."""

    staging = os.path.join(sandbox_dir, "leases")
    mounts = []
    for index, mount in enumerate(plan.mounts):
        if mount.kind is not MountKind.RO_BIND or mount.lease is None or mount.beneath is None:
            mounts.append(mount)
            continue
        point = os.path.join(staging, str(index))
        try:
            if not os.path.isdir(staging):
                os.mkdir(staging, 0o700)
                os.chown(staging, 0, plan.host_gid)
                os.chmod(staging, 0o710)  # noqa: S103 - root's, passable by the sandbox's own group only
                _mount_call(staging, staging, _MS_BIND)
                _mount_call(None, staging, _MS_PRIVATE)
            fd = open_beneath_checked(mount)
        except OSError as exc:
            raise PolicyError(
                f"lease {mount.lease}: its source {mount.source} cannot be opened ({exc.strerror})"
            ) from None
        try:
            info = os.fstat(fd)
            if info.st_uid != owner:
                raise PolicyError(f"lease {mount.lease}: its source {mount.source} changed owner since it was checked")
            if stat.S_ISDIR(info.st_mode):
                os.mkdir(point, 0o755)
            else:
                os.close(os.open(point, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644))
            _mount_call(f"/proc/self/fd/{fd}", point, _MS_BIND)
            _mount_call(None, point, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
        except OSError as exc:
            raise BackendError(f"lease {mount.lease}: staging its source failed ({exc.strerror})") from None
        finally:
            os.close(fd)
        mounts.append(replaced(mount, source=point, beneath=staging))
    return replaced(plan, mounts=tuple(mounts))


def staged_mismatches(staged: Plan, inside: list[MountSeen]) -> list[str]:
    """Lease binds of a staged plan that the sandbox does not see as their staged mount.

    The staged mounts exist in the broker's mount namespace. A Docker daemon in another one would
    bind the empty point beneath them instead, and the sandbox would see an empty lease: the
    mount at each lease target inside must show the filesystem and root the staged mount has."""

    with open("/proc/self/mountinfo") as stream:
        host = {m.target: m for m in parse_mountinfo(stream.read())}  # the last at a point is on top
    seen = {m.target: m for m in inside}
    problems = []
    for mount in staged.mounts:
        staged_bind = mount.lease is not None and mount.kind is MountKind.RO_BIND
        if not staged_bind or os.path.basename(str(mount.beneath)) != "leases":
            continue
        ours, theirs = host.get(str(mount.source)), seen.get(mount.target)
        if ours is None or theirs is None or (ours.device, ours.root) != (theirs.device, theirs.root):
            problems.append(f"lease {mount.lease}: {mount.target} is not its staged source inside the sandbox")
    return problems


def check_lease_fd(fd: int, mount: Mount) -> None:
    """The source a lease mount opened is what was checked: no symlink, and a directory, socket or
    regular file (a spool: a directory)."""
    info = os.fstat(fd)
    kinds = (stat.S_ISDIR,) if mount.kind is MountKind.SPOOL else (stat.S_ISDIR, stat.S_ISSOCK, stat.S_ISREG)
    if not any(kind(info.st_mode) for kind in kinds):
        raise PolicyError(f"lease {mount.lease}: its source {mount.source} changed since it was checked")


def open_beneath_checked(mount: Mount) -> int:
    """A lease source or spool opened below its directory without following symlinks on the
    whole path from /, and still of a kind the check allowed."""

    fd = open_beneath(str(mount.beneath), str(mount.source), strict_root=True)
    try:
        check_lease_fd(fd, mount)
    except BaseException:
        os.close(fd)
        raise
    return fd


def unstage(sandbox_dir: str) -> list[str]:
    """Unmount every staged lease source of a sandbox and the staging mount itself; returns what
    could not be unmounted."""
    return unmount_below(os.path.join(sandbox_dir, "leases"))


def unmount_below(directory: str) -> list[str]:
    """Unmount (lazily) every mount at or below `directory`, deepest first; what could not be."""

    left = []
    points = {p for p in mount_points() if p == directory or p.startswith(directory + "/")}
    for point in sorted(points, key=len, reverse=True):
        try:
            unmount(point, detach=True)
        except OSError:
            left.append(f"mount {point}")
    return left


def mount_spool_tmpfs(root: str) -> None:
    """A private tmpfs of SPOOL_FS_OPTIONS at the spool's directory: no exec, setuid or devices."""

    flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
    if _libc().mount(b"tmpfs", root.encode(), b"tmpfs", flags, SPOOL_FS_OPTIONS.encode()) != 0:
        code = ctypes.get_errno()
        raise BackendError(f"spool {os.path.basename(root)}: its tmpfs cannot be mounted ({os.strerror(code)})")
    _mount_call(None, root, _MS_PRIVATE)
