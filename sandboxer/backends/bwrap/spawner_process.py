"""The spawner process itself (spawner.py is the service's side): it forks each exec's relay
(as root, the command itself, straight into its sandbox: joiner.fork_command).

Everything this process imports, it pays for at every fork: a fork copies its page tables, and
the child runs every at-fork handler of what is loaded — threading's and logging's above all. So
it imports joiner (what entering a sandbox needs) and little else of the standard library; the
import graph test (tests/unit/test_spawner_imports.py) keeps it so.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from typing import Any

from sandboxer.backends.bwrap import joiner
from sandboxer.backends.bwrap.entry import Entry
from sandboxer.backends.bwrap.privileges import PR_SET_PDEATHSIG, prctl
from sandboxer.errors import EntryError
from sandboxer.host.fdpass import receive_fds

FDS = 6  # the request (a sealed memfd), stdin, stdout, stderr, the report and the status pipe's write ends
MAX_REQUEST = 16 * 1024 * 1024  # an Entry: argv and environment, as large as exec's command line
ENTRY_FIELDS = Entry.__slots__
# This process runs one thread: its state is module-level, changed by serve's loop and _reap
# (SIGCHLD, blocked while _start adds to _status_of).
_own_pid_namespace: int | None = None  # root's: execs are forked straight into their sandbox
_status_of: dict[int, int] = {}  # a command forked straight into its sandbox: its status pipe


def serve(sock: socket.socket) -> None:
    """Start each exec the service asks for, until the service's end of `sock` closes."""
    while True:
        data, fds, flags = receive_fds(sock, 16, FDS)
        if not data:
            return
        try:
            if flags & socket.MSG_CTRUNC or len(fds) != FDS:
                answer: dict[str, Any] = {"error": [125, "the spawner got a request without its descriptors"]}
            else:
                answer = _start(fds)
        finally:
            for fd in fds:
                os.close(fd)
        sock.send(json.dumps(answer).encode())


def _start(fds: list[int]) -> dict[str, Any]:
    """Fork A for one request: the answer."""
    request, stdin, stdout, stderr, report, status = fds
    try:
        size = os.fstat(request).st_size
        if size > MAX_REQUEST:
            raise ValueError("the request is too large")
        data = b""
        while len(data) < size and (chunk := os.pread(request, size - len(data), len(data))):
            data += chunk
        entry = _entry(json.loads(data)["entry"])
        if _own_pid_namespace is None:
            return {"relay": joiner.fork_relay(entry, (stdin, stdout, stderr), report, status)}
        # Root: the command is forked straight into the sandbox (no relay), and its end is passed
        # on from here. SIGCHLD waits until its status pipe is known: it may end at once.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        try:
            command = joiner.fork_command(entry, (stdin, stdout, stderr), report, _own_pid_namespace)
            _status_of[command] = os.dup(status)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        return {"relay": command}
    except EntryError as exc:
        return {"error": [exc.status, exc.message]}
    except (ValueError, KeyError, TypeError, OSError) as exc:
        return {"error": [125, f"the spawner refused the request ({type(exc).__name__})"]}


def _reap(_signum: int = 0, _frame: object = None) -> None:
    """Wait for every child that ended, at once: an unreaped one still counts against its
    sandbox's pids limit. A relay tells the service its command's status itself; a command forked
    straight into its sandbox has its status written to its status pipe here."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        fd = _status_of.pop(pid, None)
        if fd is not None:
            code = os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
            try:
                os.write(fd, b"%d\n" % code)
            except OSError:  # the service no longer waits for it
                pass
            finally:
                os.close(fd)


def main(fd: int) -> None:
    """The spawner process: `fd` is its end of the service's socketpair."""
    parent = os.getppid()
    # Dies with the service; a service gone before this was armed is seen just after.
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        sys.exit(0)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # the service decides; its end of the socket ends this
    global _own_pid_namespace  # noqa: PLW0603 - set once, before the first request
    if os.geteuid() == 0:
        _own_pid_namespace = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    signal.signal(signal.SIGCHLD, _reap)  # each child as it ends (each resets this at once)
    with socket.socket(fileno=fd) as sock:
        serve(sock)


def _entry(plain: dict[str, Any]) -> Entry:
    if set(plain) != set(ENTRY_FIELDS):
        raise ValueError("an entry has other fields")
    seccomp = plain["seccomp"]
    return Entry(
        holder_pid=int(plain["holder_pid"]),
        host_uid=int(plain["host_uid"]),
        host_gid=int(plain["host_gid"]),
        cwd=str(plain["cwd"]),
        argv=[str(arg) for arg in plain["argv"]],
        executable=None if plain["executable"] is None else str(plain["executable"]),
        env={str(k): str(v) for k, v in plain["env"].items()},
        cgroup_procs=tuple(str(path) for path in plain["cgroup_procs"]),
        rlimits=tuple((int(which), int(limit)) for which, limit in plain["rlimits"]),
        seccomp=None if seccomp is None else bytes.fromhex(seccomp),
        keyring=str(plain["keyring"]),
        holder_start=None if plain["holder_start"] is None else int(plain["holder_start"]),
        tty=bool(plain["tty"]),
    )
