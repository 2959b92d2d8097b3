"""The workspace's own filesystem: a sized ext4 image, so a sandbox cannot fill the host's disk.

As root, each sandbox's workspace is a sparse ext4 image in its directory, loop-mounted
(nosuid, nodev) at `<sandbox dir>/workspace` before the clone: writes past
`limits.workspace_mib` fail with ENOSPC inside the sandbox, and the host's filesystem holds at
most that much for it. Both backends bind that directory, so both get the limit. An ordinary
(unprivileged) broker cannot mount on the host: its sandboxes get a sized tmpfs of their own at
/workspace instead (plan.build_plan, workspace.seed; docs/security.md).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import TYPE_CHECKING

from sandboxer.core.record import WorkspaceFs
from sandboxer.core.removal import Removal
from sandboxer.errors import BackendError
from sandboxer.host import fsutil

if TYPE_CHECKING:
    from sandboxer.core.plan import Plan

IMAGE = "workspace.img"
MOUNT_POINT = "workspace"
_TOOLS = "/usr/sbin:/usr/bin:/sbin:/bin"


def _tool(name: str) -> str:
    path = shutil.which(name, path=_TOOLS)
    if path is None:
        raise BackendError(f"{name} is not installed", hint="apt-get install -y e2fsprogs mount")
    return path


def _run(argv: list[str], what: str) -> None:
    done = subprocess.run(
        argv, stdin=subprocess.DEVNULL, capture_output=True, env={"PATH": _TOOLS, "LANG": "C"}, check=False, timeout=60
    )
    if done.returncode != 0:
        last = done.stderr.decode(errors="replace").strip().splitlines()
        raise BackendError(f"workspace filesystem: {what} failed ({last[-1] if last else done.returncode})")


def prepare(plan: Plan, directory: str) -> WorkspaceFs:
    """The workspace's filesystem for a create of `plan` whose sandbox directory is `directory`:
    a sized tmpfs in the namespace when the plan says so (an unprivileged bwrap broker's; bwrap
    makes it), else the ext4 image `make` mounts here, its size enforced only as root."""
    size = plan.limits.workspace_mib
    if plan.workspace_in_memory:
        return WorkspaceFs(mib=size, enforced=True, kind="tmpfs")
    return WorkspaceFs(mib=size, enforced=make(directory, size_mib=size), kind="ext4")


def make(directory: str, *, size_mib: int) -> bool:
    """Mount a new `size_mib` workspace filesystem at `directory`/workspace.

    Returns False (nothing made) for an unprivileged broker. The mount point is left empty (no
    lost+found) and root's for the clone, which hands it to the sandbox user when it is done;
    teardown unmounts it with `unmount` (umount2 itself: the loop device goes with the mount).
    """
    if os.geteuid() != 0:
        return False
    image = os.path.join(directory, IMAGE)
    target = os.path.join(directory, MOUNT_POINT)
    fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size_mib * 1024 * 1024)  # sparse: the host pays only for what is written
    finally:
        os.close(fd)
    # No journal (the workspace dies with its sandbox), no reserved blocks.
    _run([_tool("mkfs.ext4"), "-q", "-F", "-m", "0", "-O", "^has_journal", image], "mkfs.ext4")
    os.mkdir(target, 0o700)
    _run(
        [_tool("mount"), "-t", "ext4", "-o", "loop,nosuid,nodev,noatime,noinit_itable", image, target],
        "mount",
    )
    os.rmdir(os.path.join(target, "lost+found"))
    os.chmod(target, 0o700)  # the filesystem's root, now at the mount point
    return True


def unmount(directory: str) -> Removal:
    """Unmount a sandbox's workspace filesystem (after its processes are gone)."""
    target = os.path.join(directory, MOUNT_POINT)
    if not os.path.ismount(target):
        return Removal()
    try:
        fsutil.unmount(target)
    except OSError as exc:
        return Removal(residue=(f"workspace filesystem {target}: umount failed ({exc.strerror})",))
    return Removal(removed=(f"workspace filesystem {target}",))
