"""Entering a live sandbox: join its namespaces, shed every privilege, and execute a command.

The sequence, for root and for an ordinary broker alike:

    broker ── fork ──► A: drop to the sandbox's host uid/gid (no supplementary groups),
                          join the cgroups, setns(user) then pid, ipc, uts, net, cgroup, mnt
                          ── fork ──► B: in the sandbox's pid namespace; new session; cwd;
                                         rlimits; the sandbox's session keyring; bounding set,
                                         ambient and all capabilities dropped; no_new_privs;
                                         a Landlock domain of its own; fds > 2 closed; signals
                                         reset; the syscall policy; execve with the plan's
                                         environment
    A relays B's end (exit status, or 128+N for signal N); the broker waits on A.

B's own steps are command.py's.

A root service's spawner needs no A (fork_command): it sets the pid namespace of its next child
to the sandbox's, forks the command straight into it (which then takes A's steps and B's itself,
in that order), sets it back to its own, and passes the command's end on itself.

Joining the user namespace as its owner uid gives A full capabilities inside it (needed for the
other setns calls) and none outside; B throws them all away before execve.

Each exec is a Landlock domain of its own: the kernel then refuses it ptrace and the /proc
files that need ptrace access (mem, environ, fd) of every process outside its own tree — the
holder, bwrap's init, other execs, a provider launch — whatever the syscall policy allows.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal

from sandboxer.backends.bwrap.command import become_command, report_line
from sandboxer.backends.bwrap.entry import Entry
from sandboxer.backends.bwrap.privileges import (
    CLONE_NEWCGROUP,
    CLONE_NEWIPC,
    CLONE_NEWNET,
    CLONE_NEWNS,
    CLONE_NEWPID,
    CLONE_NEWUSER,
    CLONE_NEWUTS,
    PR_SET_PDEATHSIG,
    owning_user_namespace,
    prctl,
    setns,
)
from sandboxer.backends.bwrap.started import Started
from sandboxer.errors import EntryError
from sandboxer.host import pids_room

# bwrap makes two user namespaces: an outer one that owns every other namespace of the
# sandbox, and an inner one (where the sandbox uid is mapped) that its processes live in. Join
# the outer first (found with NS_GET_USERNS; it grants the capabilities the other setns calls
# need), then the others with mount last (it changes our root), then the inner one.
NAMESPACES: tuple[tuple[str, int], ...] = (
    ("pid", CLONE_NEWPID),
    ("ipc", CLONE_NEWIPC),
    ("uts", CLONE_NEWUTS),
    ("net", CLONE_NEWNET),
    ("cgroup", CLONE_NEWCGROUP),
    ("mnt", CLONE_NEWNS),
)


def _open_namespaces(holder_pid: int, holder_start: int | None) -> list[tuple[int, int]]:
    """The holder's namespaces, opened through one descriptor of its /proc directory: once the
    start time read through it is the recorded one, a pid recycled meanwhile cannot be joined."""
    opened: list[tuple[int, int]] = []
    flags = os.O_RDONLY | os.O_CLOEXEC
    proc = os.open(f"/proc/{holder_pid}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if holder_start is not None:
            stat = os.open("stat", flags, dir_fd=proc)
            try:
                data = os.read(stat, 4096)
            finally:
                os.close(stat)
            if int(data[data.rindex(b")") + 2 :].split()[19]) != holder_start:
                raise OSError(errno.ESRCH, "the sandbox's holder is gone")
        mnt = os.open("ns/mnt", flags, dir_fd=proc)
        try:
            outer = owning_user_namespace(mnt)
        finally:
            os.close(mnt)
        opened.append((outer, CLONE_NEWUSER))
        for name, nstype in NAMESPACES:
            opened.append((os.open(f"ns/{name}", flags, dir_fd=proc), nstype))
        inner = os.open("ns/user", flags, dir_fd=proc)
        opened.append((inner, CLONE_NEWUSER))
        if os.fstat(inner).st_ino == os.fstat(outer).st_ino:
            opened.pop()
            os.close(inner)
    except OSError:
        for fd, _ in opened:
            os.close(fd)
        raise
    finally:
        os.close(proc)
    return opened


def start(entry: Entry, *, stdin: int = 0, stdout: int = 1, stderr: int = 2) -> Started:
    """Start `entry.argv` in the sandbox from this process; raise EntryError if it could not be
    executed."""
    report_r, report_w = os.pipe2(os.O_CLOEXEC)
    try:
        relay = fork_relay(entry, (stdin, stdout, stderr), report_w, None)
    except BaseException:
        os.close(report_r)
        raise
    finally:
        os.close(report_w)
    try:
        command_pid = read_report(report_r)
    except EntryError:
        os.waitpid(relay, 0)
        raise
    return Started(relay_pid=relay, command_pid=command_pid)


def fork_relay(entry: Entry, stdio: tuple[int, int, int], report: int, status: int | None) -> int:
    """Fork A for `entry` (its namespaces and cgroups opened here first): its pid. A reports on
    `report` (read_report) and, when `status` is given, writes the command's exit status there
    before it ends. EntryError (125) when the sandbox cannot be opened."""
    namespaces, cgroups = _open_sandbox(entry)
    try:
        relay = os.fork()
    except OSError as exc:
        _close_all(namespaces, cgroups)
        raise EntryError(125, f"cannot start the command ({exc.strerror})") from None
    if relay == 0:  # A: never returns, whatever happens in it
        try:
            _relay(entry, namespaces, cgroups, report, stdio, status_fd=status)
        finally:
            os._exit(125)
    _close_all(namespaces, cgroups)
    return relay


def fork_command(entry: Entry, stdio: tuple[int, int, int], report: int, own_pid_namespace: int) -> int:
    """A root spawner's exec, with no relay: fork the command straight into the sandbox's pid
    namespace and let it join the rest as A does; its pid, which the caller reaps and whose end it
    passes on. `own_pid_namespace`: this process's own, which its children are born into again
    right after the fork. EntryError (125) when the sandbox cannot be opened.

    Setting the pid namespace of one's children to another's takes CAP_SYS_ADMIN where this
    process lives, so only a root spawner does this; the command, still root for a moment, is
    in the sandbox's pid namespace only, and drops to the sandbox's host uid before it joins any
    other namespace (`_enter`), exactly as A does."""
    namespaces, cgroups = _open_sandbox(entry)
    pid_namespace = next(fd for fd, nstype in namespaces if nstype == CLONE_NEWPID)
    try:
        setns(pid_namespace, CLONE_NEWPID)
        command = os.fork()
    except OSError as exc:
        _own_pid_namespace_again(own_pid_namespace)
        _close_all(namespaces, cgroups)
        raise EntryError(125, f"cannot start the command ({exc.strerror})") from None
    if command == 0:  # the command: never returns
        try:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the spawner's way of reaping is not its own
            _enter(entry, namespaces, cgroups, {report, *stdio, *cgroups, *(fd for fd, _ in namespaces)}, room=0)
            become_command(entry, report, stdio)
        except EntryError as exc:
            report_line(report, f"setup {exc.status} {exc.message}")
        except OSError as exc:
            report_line(report, f"setup 125 cannot enter the sandbox ({exc.strerror})")
        finally:
            os._exit(125)
    _own_pid_namespace_again(own_pid_namespace)
    _close_all(namespaces, cgroups)
    report_line(report, f"pid {command}")
    return command


def _own_pid_namespace_again(own: int) -> None:
    """Children of this process are born into its own pid namespace again. A spawner that cannot
    say so must not fork another exec (it would land in this sandbox): it ends, and the service
    starts another."""
    try:
        setns(own, CLONE_NEWPID)
    except OSError:
        os._exit(70)


def _open_sandbox(entry: Entry) -> tuple[list[tuple[int, int]], list[int]]:
    """The sandbox's namespaces (the holder's, checked by its start time) and cgroup files,
    opened; EntryError (125) when they cannot be."""
    namespaces: list[tuple[int, int]] = []
    cgroups: list[int] = []
    try:
        namespaces = _open_namespaces(entry.holder_pid, entry.holder_start)
        for path in entry.cgroup_procs:
            cgroups.append(os.open(path, os.O_WRONLY | os.O_CLOEXEC))
    except OSError as exc:
        _close_all(namespaces, cgroups)
        raise EntryError(125, f"cannot open the sandbox's namespaces or cgroups ({exc.strerror})") from None
    return namespaces, cgroups


def _close_all(namespaces: list[tuple[int, int]], cgroups: list[int]) -> None:
    for fd in [fd for fd, _ in namespaces] + cgroups:
        os.close(fd)


def read_report(report: int) -> int:
    """What A and B report on `report` (closed here) until B executes the command: B's host pid;
    EntryError when it could not be executed (A ends by itself then)."""
    with os.fdopen(report, "rb") as reports:
        lines = reports.read(65536).decode(errors="replace").splitlines()
    command_pid = 0
    for line in lines:
        key, _, value = line.partition(" ")
        if key == "pid" and value.isdigit():
            command_pid = int(value)
        elif key in ("setup", "exec"):
            code, _, message = value.partition(" ")
            raise EntryError(int(code) if code.isdigit() else 125, message)
    if command_pid == 0:
        raise EntryError(125, "the sandbox could not be entered")
    return command_pid


def _keep_only(kept: set[int]) -> None:
    """Close every descriptor of this process but `kept` (and 0-2), however high."""
    low = 3
    for fd in sorted(fd for fd in kept if fd >= low):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 0x7FFFFFFF)


def _relay(
    entry: Entry,
    namespaces: list[tuple[int, int]],
    cgroups: list[int],
    report: int,
    stdio: tuple[int, int, int],
    *,
    status_fd: int | None,
) -> None:
    """Process A: never returns."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # a spawner's way of reaping is not A's: it waits for B
    kept = {report, *stdio, *cgroups, *(fd for fd, _ in namespaces)}
    try:
        devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)  # the host's, before any setns
        kept = {*kept, devnull} if status_fd is None else {*kept, devnull, status_fd}
        _enter(entry, namespaces, cgroups, kept, room=1)  # A, in the groups, and B to come
        command = os.fork()
    except EntryError as exc:
        report_line(report, f"setup {exc.status} {exc.message}")
        os._exit(exc.status)
    except OSError as exc:
        report_line(report, f"setup 125 cannot enter the sandbox ({exc.strerror})")
        os._exit(125)
    if command == 0:  # B: never returns either
        try:
            if status_fd is not None:
                os.close(status_fd)  # A's to write, never the command's
            become_command(entry, report, stdio)
        finally:
            os._exit(125)
    report_line(report, f"pid {command}")
    os.close(report)
    _relay_end(command, devnull, status_fd)


def _enter(entry: Entry, namespaces: list[tuple[int, int]], cgroups: list[int], kept: set[int], *, room: int) -> None:
    """In a child of the broker (or of its spawner): keep only the descriptors `kept`, join the
    sandbox's cgroups, become its host uid and gid, and join its namespaces. OSError when one
    step fails, EntryError when the sandbox's pids limit has no room for this process and `room`
    more (a relay's command); exits (125) when the broker died meanwhile."""
    broker = os.getppid()
    # First of all, keep only what A and B use: the broker's other descriptors (a sandbox's lock
    # above all) must not outlive the broker in a process that is slow to follow it.
    _keep_only(kept)
    for fd in cgroups:
        os.write(fd, b"0")  # "0" moves the writer; its children inherit the cgroups
        os.close(fd)
    # The host's cgroup files, read before any setns: the kernel holds forks to pids.max, not a
    # process moved into the group as this one was.
    groups = (os.path.dirname(path) for path in entry.cgroup_procs)
    if (limit := pids_room.over_limit(groups, starting=room)) is not None:
        raise EntryError(125, pids_room.full_message(limit))
    if os.geteuid() == 0:
        os.setgroups([])
        os.setresgid(entry.host_gid, entry.host_gid, entry.host_gid)
        os.setresuid(entry.host_uid, entry.host_uid, entry.host_uid)
    for fd, nstype in namespaces:
        setns(fd, nstype)
        os.close(fd)
    # Only now: every credential change above (setresuid, setns into a user namespace) clears
    # the parent-death signal. If the broker died meanwhile, stop here.
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != broker:
        os._exit(125)


def _relay_end(command: int, devnull: int, status_fd: int | None) -> None:
    """The rest of A, once B runs: wait for B and end with its status (never returns)."""
    for target in (0, 1, 2):  # A keeps none of the caller's streams: B has them
        os.dup2(devnull, target)
    # Nor anything else of the broker's: a pipe end the broker feeds the command's stdin through
    # would otherwise stay open here, and the command would never see its end.
    _keep_only(set() if status_fd is None else {status_fd})
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_IGN)  # the broker decides; A only relays B's end
    while True:
        try:
            _, status = os.waitpid(command, 0)
            break
        except InterruptedError:
            continue
    code = os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
    if status_fd is not None:  # a spawner's relay: its broker learns the status from this
        with contextlib.suppress(OSError):  # the broker went away: nobody to tell
            os.write(status_fd, b"%d\n" % code)
    os._exit(code)
