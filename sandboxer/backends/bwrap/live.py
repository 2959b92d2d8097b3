"""A running bwrap sandbox: its host processes (`Live`), the commands the broker itself runs in
it (a file delivered, a probe), and the checks that its own processes stay confined.

Each broker command enters exactly as an exec does (joiner), so what a probe sees is what an
exec gets. Starting the sandbox is `namespace.start`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import time
from dataclasses import dataclass

from sandboxer.backends.bwrap import joiner, privileges
from sandboxer.backends.bwrap.entry import Entry
from sandboxer.core.plan import Plan
from sandboxer.core.record import Processes
from sandboxer.errors import BackendError, EntryError
from sandboxer.host import procs
from sandboxer.host.limits import CGROUP_ROOT, LimitSetup
from sandboxer.host.observe import ProbeSeen, parse_probe

_PROBE_SETTLE_SECONDS = 5.0  # how long a probe may take to finish its execve under load


@dataclass(frozen=True, slots=True, kw_only=True)
class Live:
    """The host processes of a running sandbox."""

    bwrap_pid: int
    init_pid: int  # pid 1 of the sandbox (bwrap's reaper): killing it ends the pid namespace
    holder_pid: int  # the long-lived process whose namespaces every exec joins
    pid_namespace: int
    holder_start: int | None = None  # the holder's start time, against pid reuse

    def processes(self) -> Processes:
        """What the record keeps: each pid with its start time, against pid reuse."""
        return Processes(
            bwrap_pid=self.bwrap_pid,
            bwrap_start=procs.start_time(self.bwrap_pid),
            init_pid=self.init_pid,
            init_start=procs.start_time(self.init_pid),
            holder_pid=self.holder_pid,
            holder_start=procs.start_time(self.holder_pid),
            pid_namespace=self.pid_namespace,
        )

    @classmethod
    def of(cls, processes: Processes | None) -> Live:
        """The live sandbox a record's processes name; BackendError when they are incomplete."""
        if processes is None or None in (processes.bwrap_pid, processes.init_pid, processes.holder_pid):
            raise BackendError("the sandbox's record names no processes")
        return cls(
            bwrap_pid=int(processes.bwrap_pid or 0),
            init_pid=int(processes.init_pid or 0),
            holder_pid=int(processes.holder_pid or 0),
            pid_namespace=int(processes.pid_namespace or 0),
            holder_start=processes.holder_start,
        )


def host_ids(plan: Plan) -> tuple[int, int]:
    """The host uid/gid the sandbox user is."""
    return plan.host_uid, plan.host_gid


SECCOMP_FILE = "seccomp.bpf"  # in the sandbox's directory: the compiled policy every exec installs


def load_seccomp(directory: str) -> bytes:
    """The compiled syscall policy of the sandbox in `directory`; a backend error when missing."""
    try:
        with open(os.path.join(directory, SECCOMP_FILE), "rb") as stream:
            program = stream.read()
    except OSError as exc:
        raise BackendError(f"the sandbox's syscall policy cannot be read ({exc.strerror})") from None
    if not program or len(program) % 8:
        raise BackendError("the sandbox's syscall policy is damaged")
    return program


def _broker_entry(
    live: Live,
    plan: Plan,
    argv: tuple[str, ...],
    *,
    executable: str,
    procs_files: tuple[str, ...],
    seccomp: bytes,
    rlimits: tuple[tuple[int, int], ...] = (),
) -> Entry:
    """A command of the broker's own, entered exactly as an exec is: the sandbox user, cwd /,
    the plan's environment, the syscall policy."""
    uid, gid = host_ids(plan)
    return Entry(
        holder_pid=live.holder_pid,
        host_uid=uid,
        host_gid=gid,
        cwd="/",
        argv=argv,
        executable=executable,
        env=dict(plan.env),
        cgroup_procs=procs_files,
        rlimits=rlimits,
        seccomp=seccomp,
        holder_start=live.holder_start,
        keyring=privileges.keyring_name(plan.sandbox_id),
    )


def deliver(live: Live, plan: Plan, data: bytes, target: str, *, procs_files: tuple[str, ...], seccomp: bytes) -> None:
    """Write `data` to `target` inside the sandbox as the sandbox user (mode 0600, a new file),
    through the stdin of a command started like an exec: never argv, environment or host disk."""
    argv = ("sh", "-c", 'umask 077 && set -C && exec cat > "$0"', target)
    entry = _broker_entry(live, plan, argv, executable="/bin/sh", procs_files=procs_files, seccomp=seccomp)
    source = os.memfd_create("sandboxer-delivery", os.MFD_CLOEXEC)
    devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        os.write(source, data)
        os.lseek(source, 0, os.SEEK_SET)
        started = joiner.start(entry, stdin=source, stdout=devnull, stderr=devnull)
    except EntryError as exc:
        raise BackendError(f"delivery of {target}: {exc.message}") from None
    finally:
        os.close(source)
        os.close(devnull)
    _, status = os.waitpid(started.relay_pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise BackendError(f"delivery of {target} failed inside the sandbox")


def probe(
    live: Live,
    plan: Plan,
    *,
    procs_files: tuple[str, ...],
    rlimits: tuple[tuple[int, int], ...],
    seccomp: bytes,
) -> ProbeSeen:
    """Start a probe exactly as `exec` starts commands, and read what the kernel says of it.

    The probe is `sleep`; once it has executed, its status, environment and cgroups are read
    from the host's /proc (one start instead of three), then it is killed.
    """
    entry = _broker_entry(
        live,
        plan,
        ("sleep", "30"),
        executable="/usr/bin/sleep",
        procs_files=procs_files,
        rlimits=rlimits,
        seccomp=seccomp,
    )
    devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        started = joiner.start(entry, stdin=devnull, stdout=devnull, stderr=devnull)
    except EntryError as exc:
        raise BackendError(f"probe: {exc.message}") from None
    finally:
        os.close(devnull)
    try:
        base = f"/proc/{started.command_pid}"
        env_bytes = _settled_environ(base)
        texts = {}
        for name in ("status", "cgroup", "uid_map", "gid_map"):
            with open(f"{base}/{name}") as stream:
                texts[name] = stream.read()
        seen = parse_probe(
            texts["status"], env_bytes, texts["cgroup"], uid_map=texts["uid_map"], gid_map=texts["gid_map"]
        )
    except OSError as exc:
        raise BackendError(f"probe: cannot read the probe process ({exc.strerror})") from None
    finally:
        procs.signal_all([started.command_pid], signal.SIGKILL)
        os.waitpid(started.relay_pid, 0)
    return seen


# What a descriptor of bwrap, its init or the holder may refer to: nothing on the host's disk.
_HARMLESS_FDS = ("/dev/null", "pipe:", "anon_inode:", "/memfd:")
# How a problem names what another descriptor is open on (never its path: the caller reads it).
_KINDS = {stat.S_IFSOCK: "socket", stat.S_IFDIR: "directory", stat.S_IFCHR: "device", stat.S_IFREG: "file"}


def confinement_problems(live: Live, limit_setup: LimitSetup) -> list[str]:
    """How the sandbox's own processes (bwrap, its init, the holder) escape their confinement:
    outside the sandbox's cgroups, holding a host file open, or (the holder) dumpable or without
    the syscall policy. (bwrap and its init must stay dumpable: bwrap writes its own
    /proc/self/uid_map. No exec can reach them: each is a Landlock domain of its own.)"""
    problems: list[str] = []
    wanted = _cgroup_lines(limit_setup)
    for name, pid in (("bwrap", live.bwrap_pid), ("init", live.init_pid), ("holder", live.holder_pid)):
        base = f"/proc/{pid}"
        try:
            with open(f"{base}/cgroup") as stream:
                lines = {line.split(":", 1)[1] for line in stream.read().split() if ":" in line}
            with open(f"{base}/status") as stream:
                status = dict(line.split(":", 1) for line in stream.read().splitlines() if ":" in line)
            owner = os.stat(f"{base}/status").st_uid
        except OSError:
            problems.append(f"{name}: process {pid} is gone")
            continue
        missing = [line for line in wanted if line not in lines]
        if missing:
            problems.append(f"{name}: outside the sandbox's cgroups ({', '.join(missing)} missing)")
        dumpable = owner == int(status["Uid"].split()[1])  # a dumpable process's /proc files are its euid's
        if name == "holder" and dumpable:
            problems.append("holder: dumpable (the sandbox user could ptrace it)")
        if name == "holder" and status.get("Seccomp", "").strip() != "2":
            problems.append("holder: runs without the syscall policy")
        problems += _fd_problems(name, base, must_read=os.geteuid() == 0, settle=name == "init")
    return problems


def _cgroup_lines(limit_setup: LimitSetup) -> list[str]:
    """The /proc/PID/cgroup lines of a process inside the sandbox's cgroup directories."""
    lines = []
    for group in limit_setup.groups:
        relative = os.path.relpath(group, CGROUP_ROOT)
        hierarchy, _, path = relative.partition("/")
        if limit_setup.mechanism == "cgroup-v1":  # named by its controllers ("memory", "cpu,cpuacct")
            lines.append(f"{hierarchy}:/{path}")
        else:  # v2: the unified hierarchy
            lines.append(f":/{relative}")
    return lines


def _fd_problems(name: str, base: str, *, must_read: bool, settle: bool = False) -> list[str]:
    """What host objects the process's descriptors are open on. `settle`: bwrap's init closes
    what it inherited (its /proc descriptor among them) just after its fork, while the sandbox
    starts beside it; under load the holder can be ready first, so a descriptor it still holds
    is looked at again, briefly and boundedly, before it is called a leak."""
    deadline = time.monotonic() + (_PROBE_SETTLE_SECONDS if settle else 0)
    while (problems := _open_fds(name, base, must_read=must_read)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return problems


def _open_fds(name: str, base: str, *, must_read: bool) -> list[str]:
    try:
        fds = os.listdir(f"{base}/fd")
    except PermissionError:  # a non-dumpable process, seen by an unprivileged broker
        return [f"{name}: its descriptors cannot be read"] if must_read else []
    except OSError:
        return []
    problems = []
    for fd in fds:
        with contextlib.suppress(OSError):
            target = os.readlink(f"{base}/fd/{fd}")
            if not target.startswith(_HARMLESS_FDS):
                kind = _KINDS.get(stat.S_IFMT(os.stat(f"{base}/fd/{fd}").st_mode), "file")
                problems.append(f"{name}: descriptor {fd} is open on a host {kind}")
    return problems


def _settled_environ(base: str) -> bytes:
    """The probe's environment once its execve has finished.

    The report pipe closes (close-on-exec) while the kernel is still inside execve, before it
    has laid out the new environment: a read then sees none. The plan's environment is never
    empty (PATH is fixed), so wait, briefly and boundedly, for the kernel to finish; its
    credentials are committed before the environment, so status read afterwards is final too.
    """
    deadline = time.monotonic() + _PROBE_SETTLE_SECONDS
    while True:
        with open(f"{base}/environ", "rb") as environ:
            env_bytes = environ.read()
        if env_bytes or time.monotonic() > deadline:
            return env_bytes
        time.sleep(0.001)
