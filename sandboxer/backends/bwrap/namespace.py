"""The bubblewrap backend: start one long-lived namespace per sandbox, probe it, stop it.

As root, bwrap runs as the sandbox's unprivileged host uid, so the user namespace it makes is
owned by that uid and nothing the sandbox writes belongs to host root. As an ordinary user,
bwrap runs as that user. Either way the broker never mounts anything on the host.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

from sandboxer import joiner, procs
from sandboxer.backends.bwrap import stop
from sandboxer.backends.bwrap.argv import HOLDER_SOURCE, HOLDER_TARGET, BwrapFds, needs_fd, render
from sandboxer.errors import BackendError, EntryError, PolicyError, UsageError
from sandboxer.limits import CGROUP_ROOT, LimitSetup
from sandboxer.observe import ProbeSeen, parse_probe
from sandboxer.plan import Mount, MountKind, Plan

START_TIMEOUT = 20.0
_PROBE_SETTLE_SECONDS = 5.0  # how long a probe may take to finish its execve under load


@dataclass(frozen=True, slots=True, kw_only=True)
class Live:
    """The host processes of a running sandbox."""

    bwrap_pid: int
    init_pid: int  # pid 1 of the sandbox (bwrap's reaper): killing it ends the pid namespace
    holder_pid: int  # the long-lived process whose namespaces every exec joins
    pid_namespace: int
    holder_start: int | None = None  # the holder's start time, against pid reuse

    def as_record(self) -> dict[str, int | None]:
        """JSON-ready form, each pid with its start time against pid reuse."""
        return {
            "bwrap_pid": self.bwrap_pid,
            "bwrap_start": procs.start_time(self.bwrap_pid),
            "init_pid": self.init_pid,
            "init_start": procs.start_time(self.init_pid),
            "holder_pid": self.holder_pid,
            "holder_start": procs.start_time(self.holder_pid),
            "pid_namespace": self.pid_namespace,
        }


def host_ids(plan: Plan) -> tuple[int, int]:
    """The host uid/gid the sandbox user is."""
    return plan.host_uid, plan.host_gid


# As root, each sandbox runs as a host uid of its own from this range: no account has it and
# no process runs as it, so no host user can enter or touch the sandbox, nor one sandbox another.
HOST_ID_RANGE = (1_700_000_000, 1_900_000_000)


def allocate_host_ids() -> tuple[int, int]:
    """A fresh unprivileged host uid/gid for one sandbox (as root); the broker's own otherwise."""
    import grp
    import pwd
    import secrets

    if os.geteuid() != 0:
        return os.getuid(), os.getgid()
    running = set()
    for pid in procs.all_pids():
        with contextlib.suppress(OSError):
            running.add(os.stat(f"/proc/{pid}").st_uid)
    low, high = HOST_ID_RANGE
    for _ in range(64):
        candidate = low + secrets.randbelow(high - low)
        if candidate in running:
            continue
        try:
            pwd.getpwuid(candidate)
            continue
        except KeyError:
            pass
        try:
            grp.getgrgid(candidate)
            continue
        except KeyError:
            return candidate, candidate
    raise BackendError("no free unprivileged host uid for the sandbox")


def check_reachable(path: str, *, uid: int, gid: int, what: str) -> None:
    """As root, bwrap runs as the sandbox's uid and opens sources by path: every ancestor of
    `path` must grant it search permission, and `path` itself read and search."""
    if os.geteuid() != 0:
        return
    current = "/"
    parts = [part for part in path.split("/") if part]
    for depth, part in enumerate(["", *parts]):
        current = os.path.join(current, part) if part else "/"
        try:
            st = os.stat(current)
        except OSError:
            return  # reported where the path is used
        if st.st_uid == uid:
            bits = (st.st_mode >> 6) & 0o7
        elif st.st_gid == gid:
            bits = (st.st_mode >> 3) & 0o7
        else:
            bits = st.st_mode & 0o7
        needed = 0o5 if depth == len(parts) else 0o1
        if bits & needed != needed:
            raise UsageError(
                f"{what} {path}: not reachable by the sandbox uid {uid} ({current} denies it)",
                hint="make the directories on the way world-searchable (chmod o+x) or move it",
            )


def find_bwrap() -> str:
    """The bwrap executable, or a backend error with the install hint."""
    path = shutil.which("bwrap", path="/usr/bin:/bin:/usr/local/bin")
    if path is None:
        raise BackendError("bwrap is not installed", hint="apt-get install -y bubblewrap")
    return path


@contextlib.contextmanager
def _opened_fds(plan: Plan) -> Iterator[dict[str, int]]:
    fds: dict[str, int] = {}
    try:
        for mount in plan.mounts:
            if not needs_fd(mount):
                continue
            if mount.kind is MountKind.FILE:
                fd = os.memfd_create("sandboxer-etc", 0)
                os.write(fd, mount.content or b"")
                os.lseek(fd, 0, os.SEEK_SET)
            elif mount.beneath is not None:  # a lease source or spool: checked again on this very fd
                fd = _open_lease(mount)
            else:
                fd = os.open(str(mount.source), os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            fds[mount.target] = fd
        yield fds
    finally:
        for fd in fds.values():
            os.close(fd)


def _open_lease(mount: Mount) -> int:
    """A lease source or spool, opened below its run or sandbox directory without following any
    symlink, and refused unless it still is what the manifest check saw."""
    from sandboxer.lease_mounts import open_beneath_checked

    try:
        return open_beneath_checked(mount)
    except OSError as exc:
        raise PolicyError(f"lease {mount.lease}: its source {mount.source} cannot be opened ({exc.strerror})") from None


def _read_info(fd: int, bwrap: subprocess.Popen[bytes], errors: int) -> dict[str, int]:
    data = b""
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise BackendError("bwrap did not start within its time limit")
        ready, _, _ = select.select([fd], [], [], remaining)
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        data += chunk
        with contextlib.suppress(ValueError):
            info = json.loads(data)
            if isinstance(info, dict) and "child-pid" in info:
                return info
    bwrap.wait(timeout=5)
    raise BackendError(f"bwrap failed to start the sandbox (status {bwrap.returncode}): {_last_line(errors)}")


def _last_line(fd: int) -> str:
    """The last line bwrap wrote to its error pipe (read without blocking)."""
    data = b""
    with contextlib.suppress(OSError):
        while chunk := os.read(fd, 65536):
            data += chunk
            if len(data) > 65536:
                data = data[-4096:]
    lines = data.decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else "no message"


def _executed_holder(pid: int) -> bool:
    """Whether the holder has executed and settled: asleep (`sleep infinity` is pause(), 34 on
    x86_64; a finite sleep is clock_nanosleep, 230).
    As it starts it opens its loader's and locale files; checked meanwhile, it would seem to
    hold a host file. An unprivileged broker cannot read the syscall of the (non-dumpable)
    holder: there, having executed is all it waits for."""
    try:
        with open(f"/proc/{pid}/comm") as stream:
            if stream.read().strip() != os.path.basename(HOLDER_TARGET):
                return False
    except OSError:
        return False
    try:
        with open(f"/proc/{pid}/syscall") as stream:
            return stream.read().split()[:1] in (["34"], ["230"])
    except OSError:
        return True


def _holder_fd() -> int:
    """The holder program's bytes, which bwrap places execute-only (see bwrap_argv.HOLDER_TARGET)."""
    with open(HOLDER_SOURCE, "rb") as stream:
        return _data_fd("sandboxer-holder", stream.read())


def _data_fd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def start(plan: Plan, *, seccomp_program: bytes, limit_setup: LimitSetup) -> Live:
    """Start the sandbox's namespace inside its limits; the caller registers cleanup first.

    bwrap joins the sandbox's cgroups, its rlimits and its own session keyring before it
    executes, writes its errors to a pipe the broker reads (never a host file a sandbox process
    could reach), and hands the syscall policy to the holder, which runs from an execute-only
    copy (non-dumpable). Every exec installs the same policy itself and enters a Landlock domain
    of its own (joiner), which keeps it from ptrace access to bwrap's init and the holder.
    """
    stop.reap()
    program = find_bwrap()
    keyring = joiner.keyring_name(plan.sandbox_id)
    uid, gid = host_ids(plan)
    as_root = os.geteuid() == 0
    info_r, info_w = os.pipe2(os.O_CLOEXEC)
    errors_r, errors_w = os.pipe2(os.O_CLOEXEC)
    own: list[int] = []
    try:
        groups = [os.open(path, os.O_WRONLY | os.O_CLOEXEC) for path in limit_setup.procs_files]
        own += groups
        holder = _holder_fd()
        own.append(holder)
        seccomp = _data_fd("sandboxer-seccomp", seccomp_program)
        own.append(seccomp)
        with _opened_fds(plan) as fds:
            argv = render(plan, BwrapFds(by_target=fds, info=info_w, holder=holder, seccomp=seccomp))
            argv[0] = program
            process = subprocess.Popen(
                argv,
                executable=program,
                pass_fds=(*fds.values(), info_w, holder, seccomp),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=errors_w,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                start_new_session=True,  # outlives the create command; out of the caller's process group
                user=uid if as_root else None,
                group=gid if as_root else None,
                extra_groups=[] if as_root else None,
                # Between fork and exec, so bwrap is confined before it runs. Safe here: the
                # broker that starts bwrap has one thread (a threaded one must spawn differently).
                preexec_fn=lambda: joiner.confine(groups, limit_setup.rlimits, keyring),  # noqa: PLW1509
            )
            stop.STARTED[process.pid] = process
        os.close(info_w)
        info_w = -1
        os.close(errors_w)
        errors_w = -1
        os.set_blocking(errors_r, False)
        info = _read_info(info_r, process, errors_r)
        init_pid = int(info["child-pid"])
        holder_pid = 0
        deadline = time.monotonic() + START_TIMEOUT
        while not holder_pid and time.monotonic() < deadline and process.poll() is None:
            kids = procs.children(init_pid)
            # The child is bwrap's own code until it has executed the holder program.
            holder_pid = kids[0] if kids and _executed_holder(kids[0]) else 0
            if not holder_pid:
                time.sleep(0.001)
        if not holder_pid:
            raise BackendError(f"bwrap failed to start the sandbox: {_last_line(errors_r)}")
    finally:
        for fd in (info_r, info_w, errors_r, errors_w, *own):
            if fd >= 0:
                os.close(fd)
    return Live(
        bwrap_pid=process.pid,
        init_pid=init_pid,
        holder_pid=holder_pid,
        pid_namespace=int(info["pid-namespace"]),
        holder_start=procs.start_time(holder_pid),
    )


SECCOMP_FILE = "seccomp.bpf"  # in the sandbox's directory: the compiled policy every exec installs


def save_seccomp(directory: str, program: bytes) -> None:
    """Keep the sandbox's compiled syscall policy for its execs (owner-only, never in the sandbox)."""
    fd = os.open(
        os.path.join(directory, SECCOMP_FILE),
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
        0o600,
    )
    try:
        os.write(fd, program)
    finally:
        os.close(fd)


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
) -> joiner.Entry:
    """A command of the broker's own, entered exactly as an exec is: the sandbox user, cwd /,
    the plan's environment, the syscall policy."""
    uid, gid = host_ids(plan)
    return joiner.Entry(
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
        keyring=joiner.keyring_name(plan.sandbox_id),
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


def confinement_problems(live: Live, limit_setup: LimitSetup) -> list[str]:
    """How the sandbox's own processes (bwrap, its init, the holder) escape their confinement:
    outside the sandbox's cgroups, holding a host file open, or (the holder) dumpable or without
    the syscall policy. (bwrap and its init must stay dumpable: bwrap writes its own
    /proc/self/uid_map. No exec can reach them: each is a Landlock domain of its own.)"""
    problems: list[str] = []
    wanted = _cgroup_lines(limit_setup.groups)
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
        problems += _fd_problems(name, base, must_read=os.geteuid() == 0)
    return problems


def _cgroup_lines(groups: tuple[str, ...]) -> list[str]:
    """The /proc/PID/cgroup lines of a process inside these cgroup directories."""
    lines = []
    for group in groups:
        relative = os.path.relpath(group, CGROUP_ROOT)
        controller, _, path = relative.partition("/")
        if controller in ("memory", "pids"):  # v1: one hierarchy per controller
            lines.append(f"{controller}:/{path}")
        else:  # v2: the unified hierarchy
            lines.append(f":/{relative}")
    return lines


def _fd_problems(name: str, base: str, *, must_read: bool) -> list[str]:
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
                problems.append(f"{name}: descriptor {fd} is open on a host file")
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
