"""Render a plan as a bubblewrap argv: a pure function, pinned by golden tests.

Each option and its values stay on one line so diffs read well. Host directories and generated
files reach bwrap as file descriptors (`--ro-bind-fd`, `--bind-fd`, `--ro-bind-data`), opened
by the broker after its checks, so a path swapped in between cannot be mounted instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sandboxer.core.plan import RUNTIME_TARGET, Mount, MountKind, Plan

# The holder: the long-lived process whose namespaces every exec joins. bwrap executes it from
# an execute-only copy of sleep(1) (bwrap's own data file: no host path), which the sandbox user
# cannot read, so the kernel makes the holder non-dumpable: no ptrace, no /proc/PID/mem, fd or environ for the
# sandbox user. Besides, every exec is a Landlock domain of its own, which the kernel keeps from
# ptrace access to the holder (joiner).
HOLDER_SOURCE = "/usr/bin/sleep"
HOLDER_TARGET = "/run/sandboxer/holder"
HOLDER = (HOLDER_TARGET, "infinity")
SHM_BYTES = 64 * 1024 * 1024  # /dev/shm: its own sized tmpfs, as Docker's default shm size
PROC_MASKED = ("keys", "key-users")


@dataclass(frozen=True, slots=True, kw_only=True)
class BwrapFds:
    """File descriptor numbers the broker opened for bwrap: one per target that needs one."""

    by_target: Mapping[str, int]
    info: int
    holder: int = -1  # the execute-only copy of the holder program
    seccomp: int = -1  # the compiled syscall policy (docs/seccomp.md)


def needs_fd(mount: Mount) -> bool:
    """Whether a mount is passed to bwrap by file descriptor."""
    # The runtime and the workspace are checked by the broker just before start: bind exactly
    # what was checked. /usr and host /etc entries are the host's own system files.
    # Lease sources and spools are opened below their run or sandbox directory, symlink-free.
    return (
        mount.kind in (MountKind.FILE, MountKind.BIND, MountKind.SPOOL)
        or mount.target == RUNTIME_TARGET
        or mount.lease is not None
    )


def _mount_args(mount: Mount, fds: BwrapFds) -> list[list[str]]:
    kind, target = mount.kind, mount.target
    match kind:
        case MountKind.RO_BIND:
            if needs_fd(mount):
                return [["--ro-bind-fd", str(fds.by_target[target]), target]]
            return [["--ro-bind", str(mount.source), target]]
        case MountKind.BIND | MountKind.SPOOL:
            return [["--bind-fd", str(fds.by_target[target]), target]]
        case MountKind.TMPFS:
            args: list[str] = []
            if mount.mode is not None:
                args += ["--perms", f"{mount.mode:04o}"]
            if mount.size_bytes is not None:
                args += ["--size", str(mount.size_bytes)]
            return [[*args, "--tmpfs", target]]
        case MountKind.PROC:
            # /proc/keys lists every key the reader may view, whoever's keyring holds it (as Docker
            # does, mask it and its per-user counts).
            masks = [["--ro-bind", "/dev/null", f"{target}/{name}"] for name in PROC_MASKED]
            return [["--proc", target], *masks]
        case MountKind.DEV:
            # bwrap's /dev is a tmpfs the sandbox user could fill, with shm a directory on it:
            # shm gets a sized tmpfs of its own, and the rest of /dev is made read-only.
            shm = ["--perms", "1777", "--size", str(SHM_BYTES), "--tmpfs", f"{target}/shm"]
            return [["--dev", target], shm, ["--remount-ro", target]]
        case MountKind.DIR:
            perms = ["--perms", f"{mount.mode:04o}"] if mount.mode is not None else []
            return [[*perms, "--dir", target]]
        case MountKind.SYMLINK:
            return [["--symlink", str(mount.source), target]]
        case MountKind.FILE:
            perms = ["--perms", f"{mount.mode:04o}"] if mount.mode is not None else []
            return [[*perms, "--ro-bind-data", str(fds.by_target[target]), target]]


def render_lines(plan: Plan, fds: BwrapFds) -> list[list[str]]:
    """The argv as lines of one option each (what golden tests compare)."""
    lines: list[list[str]] = [
        ["bwrap"],
        ["--unshare-user", "--uid", str(plan.uid), "--gid", str(plan.gid)],
        ["--unshare-pid"],
        ["--unshare-net"],
        ["--unshare-ipc"],
        ["--unshare-uts"],
        ["--unshare-cgroup-try"],
        ["--hostname", plan.hostname],
        ["--disable-userns"],
        ["--new-session"],
        ["--cap-drop", "ALL"],
        ["--clearenv"],
        ["--setenv", "SANDBOXER_SANDBOX_ID", plan.sandbox_id],
        ["--info-fd", str(fds.info)],
    ]
    if fds.seccomp >= 0:
        lines.append(["--seccomp", str(fds.seccomp)])
    for mount in plan.mounts:
        lines += _mount_args(mount, fds)
    if fds.holder >= 0:
        lines.append(["--perms", "0111", "--ro-bind-data", str(fds.holder), HOLDER_TARGET])
    lines += [["--remount-ro", "/"], ["--chdir", "/"], ["--", *HOLDER]]
    return lines


def render(plan: Plan, fds: BwrapFds) -> list[str]:
    """The bwrap argv that starts the sandbox's long-lived namespace."""
    return [arg for line in render_lines(plan, fds) for arg in line]
