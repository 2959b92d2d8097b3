"""The bubblewrap backend's start: one long-lived namespace per sandbox, started inside its limits.

As root, bwrap runs as the sandbox's unprivileged host uid, so the user namespace it makes is
owned by that uid and nothing the sandbox writes belongs to host root. As an ordinary user,
bwrap runs as that user. Either way the broker never mounts anything on the host. What the
broker does with a running sandbox (probes, deliveries, confinement checks) is in `live`.
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import resource
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator

from sandboxer.backends.bwrap import privileges, stop
from sandboxer.backends.bwrap.argv import HOLDER_SOURCE, HOLDER_TARGET, BwrapFds, needs_fd, render
from sandboxer.backends.bwrap.live import SECCOMP_FILE, Live, host_ids
from sandboxer.core.plan import Mount, MountKind, Plan
from sandboxer.errors import BackendError, PolicyError, UsageError
from sandboxer.host import procs
from sandboxer.host.lease_mounts import open_beneath_checked
from sandboxer.host.limits import LimitSetup
from sandboxer.host.ready import wait_ready

START_TIMEOUT = 20.0


# As root, each sandbox runs as a host uid of its own from this range: no account has it and
# no process runs as it, so no host user can enter or touch the sandbox, nor one sandbox another.
HOST_ID_RANGE = (1_700_000_000, 1_900_000_000)


def allocate_host_ids() -> tuple[int, int]:
    """A fresh unprivileged host uid/gid for one sandbox (as root); the broker's own otherwise."""

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


BWRAP_PATH = "/usr/bin:/bin:/usr/local/bin"  # where bwrap is looked for: never a caller's PATH


def find_bwrap() -> str:
    """The bwrap executable, or a backend error with the install hint."""
    path = shutil.which("bwrap", path=BWRAP_PATH)
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
        ready, _ = wait_ready([fd], timeout=remaining)
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
    executes (RLIMIT_NPROC once the namespace exists: _limit_processes), writes its errors to a
    pipe the broker reads (never a host file a sandbox process could reach), and hands the
    syscall policy to the holder, which runs from an execute-only copy (non-dumpable). Every
    exec installs the same policy itself and enters a Landlock domain of its own (joiner), which
    keeps it from ptrace access to bwrap's init and the holder.
    """
    stop.reap()
    program = find_bwrap()
    keyring = privileges.keyring_name(plan.sandbox_id)
    uid, gid = host_ids(plan)
    as_root = os.geteuid() == 0
    info_r, info_w = os.pipe2(os.O_CLOEXEC)
    errors_r, errors_w = os.pipe2(os.O_CLOEXEC)
    own: list[int] = []
    before_start = [pair for pair in limit_setup.rlimits if pair[0] != resource.RLIMIT_NPROC]
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
                # Between fork and exec, so bwrap is confined before it runs. Safe in the
                # service's threads too: confine only makes system calls (os, resource, ctypes,
                # all imported already), so the child takes no lock another thread may hold.
                preexec_fn=lambda: privileges.confine(groups, before_start, keyring),  # noqa: PLW1509
            )
            stop.keep(process)
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
        _limit_processes((process.pid, init_pid, holder_pid), limit_setup.rlimits)
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


def _limit_processes(pids: tuple[int, ...], rlimits: tuple[tuple[int, int], ...]) -> None:
    """Give bwrap, its init and the holder the sandbox's RLIMIT_NPROC, now that its user namespace
    exists. The kernel checks a fork against the forking process's limit, counting the
    processes of its uid in its user namespace, and against the limit in force when each user
    namespace above it was made, counting them there: made under the sandbox's limit, the host's
    count of the broker's account (its shells, its services, its other sandboxes) would count
    against it, and a busy account could not start a sandbox at all. Made without it, a
    sandbox's processes count only against each other. Nothing of the sandbox's own has run
    yet: the holder waits, and execs (which set the limit themselves: command.py) come after."""
    for which, limit in rlimits:
        if which != resource.RLIMIT_NPROC:
            continue
        for pid in pids:
            try:
                resource.prlimit(pid, which, (limit, limit))
            except OSError as exc:
                raise BackendError(f"cannot apply the sandbox's pids limit ({exc.strerror})") from None


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
