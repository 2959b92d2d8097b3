"""Host-side process facts read from /proc: start times, namespace members, sessions, killing."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from sandboxer.core.removal import Removal

if TYPE_CHECKING:
    from sandboxer.core.record import Processes


def _stat(pid: int) -> list[bytes] | None:
    """The fields of /proc/PID/stat after the command's name (state first), None when the
    process does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stream:
            data = stream.read()
    except OSError:
        return None
    return data[data.rindex(b")") + 2 :].split()


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None when it does not exist.

    Recorded with every pid the broker keeps, so that a recycled pid is never mistaken for ours.
    """
    fields = _stat(pid)
    return None if fields is None else int(fields[19])


def alive(pid: int, started: int | None) -> bool:
    """Whether `pid` still runs, not a zombie, and is the same process as when `started` was
    read (one read of its stat: both facts of the same moment)."""
    fields = _stat(pid)
    return fields is not None and int(fields[19]) == started and fields[0] not in (b"Z", b"X")


def state(pid: int) -> str | None:
    """The one-letter state of a process (R, S, T for stopped, Z, ...), None if it is gone."""
    fields = _stat(pid)
    return None if fields is None else fields[0].decode()


def session_of(pid: int) -> int | None:
    """The session id of a process as the host sees it."""
    fields = _stat(pid)
    return None if fields is None else int(fields[3])


def children(pid: int) -> list[int]:
    """Direct children of a process."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children", "rb") as stream:
            return [int(p) for p in stream.read().split()]
    except OSError:
        return []


def namespace_inode(pid: int, kind: str) -> int | None:
    """The inode of one of a process's namespaces (`pid`, `net`, `mnt`, …)."""
    try:
        return os.stat(f"/proc/{pid}/ns/{kind}").st_ino
    except OSError:
        return None


def all_pids() -> list[int]:
    """Every process on the host."""
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def in_pid_namespace(inode: int) -> list[int]:
    """Host pids of every process in the pid namespace with this inode."""
    return [pid for pid in all_pids() if namespace_inode(pid, "pid") == inode]


def with_marker(marker: bytes) -> list[int]:
    """Processes whose command line contains `marker` (finds a bwrap whose record was never written)."""
    found = []
    for pid in all_pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as stream:
                if marker in stream.read():
                    found.append(pid)
        except OSError:
            continue
    return found


def in_session(session: int) -> list[int]:
    """Host pids of every process in a session."""
    return [pid for pid in all_pids() if session_of(pid) == session]


def signal_all(pids: Iterable[int], sig: int) -> None:
    """Send a signal, ignoring processes that are already gone."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            continue
        except PermissionError:
            continue


def kill_all(pids: Iterable[int]) -> None:
    """SIGKILL every one of `pids`, each stopped first: once one has died none of the others runs
    again, so none reports another's death (a shell's "Killed" after a timeout's last line)."""
    victims = list(pids)
    signal_all(victims, signal.SIGSTOP)
    signal_all(victims, signal.SIGKILL)


def wait_gone(pids: Iterable[int], timeout: float) -> list[int]:
    """Wait until none of `pids` runs (zombies count as gone); return those still running."""
    remaining = list(pids)
    deadline = time.monotonic() + timeout
    pause = 0.0005
    while True:
        remaining = [pid for pid in remaining if state(pid) not in (None, "Z", "X")]
        if not remaining or time.monotonic() >= deadline:
            return remaining
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


def terminate(pids: list[int], *, grace: float) -> list[int]:
    """SIGTERM, a grace period, SIGKILL for survivors; returns the pids that still survive."""
    signal_all(pids, signal.SIGTERM)
    survivors = wait_gone(pids, grace)
    if survivors:
        signal_all(survivors, signal.SIGKILL)
        survivors = wait_gone(survivors, 5.0)
    return survivors


def bwrap_marker(sandbox_id: str) -> bytes:
    """What the command line of the sandbox's bwrap (and of its init, a fork of it) carries: the
    option that sets the sandbox's id in its environment (backends/bwrap/argv.py)."""
    return f"\0--setenv\0SANDBOXER_SANDBOX_ID\0{sandbox_id}\0".encode()


def carries(pid: int, marker: bytes) -> bool:
    """Whether the command line of `pid` contains `marker`."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as stream:
            return marker in stream.read()
    except OSError:
        return False


def namespace_pid(pid: int) -> int | None:
    """The pid of `pid` in its own (innermost) pid namespace: NSpid's last field."""
    try:
        with open(f"/proc/{pid}/status", "rb") as stream:
            for line in stream:
                if line.startswith(b"NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError):
        return None
    return None


def sandbox_namespace(sandbox_id: str, processes: Processes | None) -> int | None:
    """The inode of the sandbox's pid namespace, when the record names it truly; else None.

    A record is not believed on its word: its init (checked by start time) must still live, be
    pid 1 of a namespace with the recorded inode, not this process's own namespace, and carry the
    sandbox's bwrap marker on its command line (init is a fork of bwrap). A namespace number is
    reused by the kernel once the namespace is gone, so it is trusted only while that init lives;
    once it is dead, the kernel has already killed every process of the namespace."""
    if processes is None:
        return None
    inode, init_pid, init_start = processes.pid_namespace, processes.init_pid, processes.init_start
    if not (isinstance(inode, int) and isinstance(init_pid, int) and isinstance(init_start, int)):
        return None
    if inode == namespace_inode(os.getpid(), "pid") or not alive(init_pid, init_start):
        return None
    if namespace_inode(init_pid, "pid") != inode or namespace_pid(init_pid) != 1:
        return None
    return inode if carries(init_pid, bwrap_marker(sandbox_id)) else None


def stop_sandbox(sandbox_id: str, processes: Processes | None, *, grace: float = 1.0) -> Removal:
    """Kill every process of the sandbox: all of its pid namespace while its init lives, those its
    record names (bwrap, init, holder), and any bwrap that carries its id (one whose pids never
    reached the record): TERM, grace, KILL.

    The record is not trusted with a pid (a forged one could name any process): a pid it names is
    signalled only while it is the same process (its start time) and is the sandbox's own — in the
    sandbox's verified pid namespace (sandbox_namespace), or carrying the sandbox's bwrap marker on
    its command line."""
    removed: list[str] = []
    residue: list[str] = []
    targets: set[int] = set()
    marker = bwrap_marker(sandbox_id)
    namespace = sandbox_namespace(sandbox_id, processes)
    members = set(in_pid_namespace(namespace)) if namespace is not None else set()
    targets |= members
    named = (
        [
            (processes.bwrap_pid, processes.bwrap_start),
            (processes.init_pid, processes.init_start),
            (processes.holder_pid, processes.holder_start),
        ]
        if processes
        else []
    )
    for pid, started in named:
        if pid is None or started is None or not alive(pid, started):
            continue
        if pid in members or carries(pid, marker):
            targets.add(pid)
    # A bwrap whose pids never reached the record still carries the id in its argv.
    targets.update(with_marker(marker))
    targets.discard(os.getpid())
    if targets:
        survivors = terminate(sorted(targets), grace=grace)
        removed.append(f"processes: {len(targets) - len(survivors)}")
        residue.extend(f"process {pid} still running" for pid in survivors)
    if namespace is not None and sandbox_namespace(sandbox_id, processes) == namespace:  # its init still lives
        late = in_pid_namespace(namespace)
        if late:
            survivors = terminate(late, grace=0.0)
            residue.extend(f"process {pid} still running" for pid in survivors)
    return Removal.of(removed, residue)


def kill_cgroup(group: str) -> None:
    """Kill every process in the exec's cgroup until it is empty."""
    kill_file = os.path.join(group, "cgroup.kill")
    for _ in range(200):
        try:
            with open(os.path.join(group, "cgroup.procs")) as stream:
                members = [int(line) for line in stream if line.strip()]
        except OSError:
            return
        if not members:
            return
        if os.path.exists(kill_file):
            try:
                with open(kill_file, "w") as stream:
                    stream.write("1")
            except OSError:
                pass
        kill_all(members)
        wait_gone(members, 0.2)


def kill_session(command_pid: int) -> None:
    """Kill the exec's session and every descendant of its command, until none is left."""
    for _ in range(100):
        victims = set(in_session(command_pid))
        frontier = [command_pid]
        while frontier:
            pid = frontier.pop()
            victims.add(pid)
            frontier.extend(children(pid))
        victims = {pid for pid in victims if start_time(pid) is not None}
        if not victims:
            return
        kill_all(victims)
        if not wait_gone(victims, 0.5):
            still = [p for p in in_session(command_pid) if start_time(p) is not None]
            if not still:
                return
