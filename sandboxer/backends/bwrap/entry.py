"""An exec's entry into a bwrap sandbox: what joiner.py and command.py need to start one command
there, and what the service hands its spawner (as JSON: spawner_process.py)."""

from __future__ import annotations

from collections.abc import Sequence


class Entry:
    """Everything needed to start one command in a sandbox.

    A plain slotted class: the relay and the command read it after fork, and need nothing more.
    """

    __slots__ = (
        "argv",
        "cgroup_procs",
        "cwd",
        "env",
        "executable",
        "holder_pid",
        "holder_start",
        "host_gid",
        "host_uid",
        "keyring",
        "rlimits",
        "seccomp",
        "tty",
    )

    def __init__(
        self,
        *,
        holder_pid: int,
        host_uid: int,
        host_gid: int,
        cwd: str,
        argv: Sequence[str],
        executable: str | None,
        env: dict[str, str],
        cgroup_procs: Sequence[str] = (),
        rlimits: Sequence[tuple[int, int]] = (),
        seccomp: bytes | None = None,
        keyring: str,
        holder_start: int | None = None,
        tty: bool = False,
    ) -> None:
        self.holder_pid = holder_pid  # a process of the sandbox user: the namespaces commands run in
        self.host_uid = host_uid  # the sandbox user's uid as the host sees it (owner of the namespaces)
        self.host_gid = host_gid
        self.cwd = cwd
        self.argv = argv
        self.executable = executable
        self.env = env
        self.cgroup_procs = cgroup_procs  # cgroup.procs files to join (v1 controllers or a v2 group)
        self.rlimits = rlimits  # (resource, limit) when no cgroup enforces limits
        self.seccomp = seccomp  # the sandbox's compiled syscall policy, installed just before execve
        self.holder_start = holder_start  # the holder's start time: a recycled pid is never joined
        self.keyring = keyring  # the sandbox's session keyring (keyring_name)
        self.tty = tty  # stdin is a terminal of the exec's own: it becomes the controlling one
