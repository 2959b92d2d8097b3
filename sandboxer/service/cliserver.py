"""The CLI client's side of the service socket: a command line run for a client, on its stdio.

A connection whose first byte is NUL is a CLI client's (an HTTP request starts with a method
name). Its protocol, one message each way (docs/service.md):

    client → service   NUL, a JSON line {"argv": [...], "cwd": "...", "env": {...}, "files":
                       [...]}, with the client's fds 0, 1 and 2 attached (SCM_RIGHTS), then one
                       per file it opened for the command; then, while the command runs, one
                       byte per signal the client received (SIGINT, SIGTERM, SIGHUP)
    service → client   a JSON line {"status": N} once the command has ended, then the end

The service runs the one typer command table (sandboxer.cli) for the client in a worker thread
— printing on the client's own descriptors, under the rules for the caller the kernel names
(access.py) — so every command prints and exits exactly as it would in-process. An exec's
command gets the client's descriptors; when the client goes away, it is killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TextIO

from sandboxer.api.caller import Caller
from sandboxer.commands.services import Services
from sandboxer.core.reading import CallerFile
from sandboxer.dirs import Dirs
from sandboxer.errors import UsageError
from sandboxer.host.fdpass import receive_fds
from sandboxer.host.registry import ID_PATTERN
from sandboxer.invocation import Invocation, running
from sandboxer.service.admission import Refused, admit
from sandboxer.service.audit import AuditLog
from sandboxer.service.peer import Peer

MAGIC = b"\0"
MAX_HEADER = 1024 * 1024  # argv, cwd and environment: more than any command line may hold
HEADER_SECONDS = 10.0  # a client that sends less than its header in this time is dropped
FIELDS = {"argv", "cwd", "env"}  # and "files", when the client opened any; "window" for exec -t
OPTIONAL = {"files", "window"}
FILE_FIELDS = {"name", "path", "errno"}
MAX_FILES = 4  # files a command line names for the client to open (create --bootstrap: one)
MAX_ERRNO = 4096  # errno values are small; Linux's are below 4096
SERVICE_FAILED = 125  # a command whose output could not be written: the client says so too


@dataclass(frozen=True, slots=True)
class CommandTable:
    """The CLI's command table as the service runs it: `run(argv)` is its exit status, with the
    invocation's stdio; `name(argv)` names the command for the audit log."""

    run: Callable[[list[str]], int]
    name: Callable[[list[str]], str]


@dataclass(frozen=True, slots=True)
class Serving:
    """What the service runs a client's command with."""

    dirs: Dirs
    services: Services
    audit: AuditLog
    commands: CommandTable


def serve_client(conn: socket.socket, serving: Serving) -> None:
    """Run one CLI client's command and answer its exit status (blocking: a worker thread).

    Who is calling is settled first, from the connection alone: a caller no grant admits gets
    its refusal on its stderr and an audit line before the service reads anything it sent."""
    fds: list[int] = []
    try:
        conn.setblocking(True)
        caller: Caller | Refused
        try:
            caller = admit(serving.dirs, conn)
        except Refused as refused:
            caller = refused
        try:
            request, fds = _receive(conn, time.monotonic() + HEADER_SECONDS)
        except (OSError, ValueError, UsageError) as exc:
            # No stdio to tell it on: the client sees the end and says so; the audit log has it.
            who = caller.peer if isinstance(caller, Refused) else caller
            outcome = type(exc).__name__ if isinstance(exc, UsageError) else "UsageError"
            serving.audit.record(uid=who.uid, pid=who.pid, verb="cli", sandbox=None, outcome=outcome, status=2)
            return
        conn.settimeout(None)
        if isinstance(caller, Refused):
            status = _refuse(serving.audit, caller, fds[2])
        elif caller.uid != os.geteuid() and not all(_is_pipe(fd) for fd in fds[:3]):
            # The service writes and reads these with its own rights: for another account, only
            # pipes (the client puts its files and terminal behind pipes itself).
            status = _refuse(serving.audit, StdioRefused(Peer(pid=caller.pid, uid=caller.uid, gid=caller.gid)), fds[2])
        else:
            status = _run(conn, serving, caller, request, fds)
        with contextlib.suppress(OSError):  # the client went away; its exec was killed
            conn.sendall(json.dumps({"status": status}).encode() + b"\n")
    finally:
        for fd in fds:
            os.close(fd)
        conn.close()


def _receive(conn: socket.socket, deadline: float) -> tuple[dict[str, Any], list[int]]:
    """The client's request and its descriptors (stdin, stdout, stderr and the files it opened),
    all of it by `deadline`."""
    conn.settimeout(HEADER_SECONDS)
    data, fds, flags = receive_fds(conn, 65536, 3 + MAX_FILES)
    if flags & socket.MSG_CTRUNC:
        for fd in fds:
            os.close(fd)
        raise UsageError(f"more descriptors than stdio and {MAX_FILES} files were passed")
    try:
        if len(fds) < 3 or not data.startswith(MAGIC):
            raise UsageError("a CLI request starts with NUL and passes stdin, stdout and stderr")
        while b"\n" not in data:
            if len(data) > MAX_HEADER:
                raise UsageError(f"the request is longer than {MAX_HEADER} bytes")
            left = deadline - time.monotonic()
            if left <= 0:
                raise UsageError(f"the request took longer than {HEADER_SECONDS:g} s")
            conn.settimeout(left)
            more = conn.recv(65536)
            if not more:
                raise UsageError("the client ended its request early")
            data += more
        request = json.loads(data[len(MAGIC) : data.index(b"\n")])  # after it: signals, too early
        _check(request, opened=len(fds) - 3)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return request, fds


def _check(request: object, *, opened: int) -> None:
    if not isinstance(request, dict) or set(request) - OPTIONAL != FIELDS:
        raise UsageError(f"a CLI request is an object of {sorted(FIELDS)} and optionally {sorted(OPTIONAL)}")
    window = request.setdefault("window", None)
    if window is not None and not (
        isinstance(window, list) and len(window) == 2 and all(type(n) is int and 0 < n < 65536 for n in window)
    ):
        raise UsageError("window: must be [rows, columns], each 1-65535")
    files = request.setdefault("files", [])
    if not isinstance(files, list) or not all(_file_entry(entry) for entry in files):
        raise UsageError(f"files: must be a list of objects of exactly {sorted(FILE_FIELDS)}")
    if sum(1 for entry in files if entry["errno"] == 0) != opened:
        raise UsageError("files: one descriptor is passed for each file opened (errno 0)")
    argv, cwd, env = request["argv"], request["cwd"], request["env"]
    if not isinstance(argv, list) or not all(isinstance(arg, str) for arg in argv):
        raise UsageError("argv: must be a list of strings")
    if not isinstance(cwd, str) or not os.path.isabs(cwd):
        raise UsageError("cwd: must be an absolute path")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise UsageError("env: must map names to strings")


def _file_entry(entry: object) -> bool:
    """One file the client opened (errno 0) or could not open: {"name", "path", "errno"}."""
    return (
        isinstance(entry, dict)
        and set(entry) == FILE_FIELDS
        and isinstance(entry["name"], str)
        and isinstance(entry["path"], str)
        and os.path.isabs(entry["path"])
        and type(entry["errno"]) is int
        and 0 <= entry["errno"] < MAX_ERRNO
    )


def _files(request: dict[str, Any], fds: list[int]) -> dict[str, CallerFile]:
    """The files the client opened for the command, by the name its command line gives them;
    their descriptors follow stdio's, in order."""
    passed = iter(fds[3:])
    return {
        entry["name"]: CallerFile(entry["path"], fd=next(passed) if entry["errno"] == 0 else None, errno=entry["errno"])
        for entry in request["files"]
    }


def _refuse(audit: AuditLog, refusal: Refused, stderr_fd: int) -> int:
    """A caller refused before its command runs: one line on its stderr (when that is a pipe),
    one in the audit log; its status."""
    audit.record(
        uid=refusal.peer.uid, pid=refusal.peer.pid, verb="refused", sandbox=None, outcome="PolicyError", status=3
    )
    if _is_pipe(stderr_fd):
        with _text(stderr_fd) as stderr, contextlib.suppress(OSError):
            stderr.write(f"sandboxer: {refusal}\n")
    return refusal.status


class StdioRefused(Refused):
    """Another account's client passed something other than pipes for its stdio."""

    def __init__(self, peer: Peer) -> None:
        super().__init__(peer, "stdin, stdout and stderr must be pipes", hint="use the sandboxer command")


def _is_pipe(fd: int) -> bool:
    try:
        return stat.S_ISFIFO(os.fstat(fd).st_mode)
    except OSError:
        return False


def _run(conn: socket.socket, serving: Serving, caller: Caller, request: dict[str, Any], fds: list[int]) -> int:
    """The command's exit status; its output went to the client's descriptors. The audit line
    is written however the command ended."""
    status: int | None = None
    outcome = "failed"
    invocation: Invocation | None = None
    try:
        with _text(fds[1]) as stdout, _text(fds[2]) as stderr:
            invocation = Invocation(
                environ=request["env"],
                cwd=request["cwd"],
                stdio=(fds[0], fds[1], fds[2]),
                control=conn.fileno(),
                caller=caller,
                dirs=serving.dirs,
                services=serving.services,
                files=_files(request, fds),
                window=None if request["window"] is None else (request["window"][0], request["window"][1]),
            )
            with running(invocation, stdout, stderr):
                status = serving.commands.run(list(request["argv"]))
            outcome = "ok" if status == 0 else "failed"
    except OSError:  # the client's stdout or stderr refused what was printed: its output is lost
        outcome = "OSError"
    finally:
        verb = "cli " + serving.commands.name(request["argv"])
        named = invocation.sandboxes if invocation is not None else []
        sandbox = next((s for s in named if ID_PATTERN.fullmatch(s)), None)  # an id, never other text
        serving.audit.record(uid=caller.uid, pid=caller.pid, verb=verb, sandbox=sandbox, outcome=outcome, status=status)
    return SERVICE_FAILED if status is None else status


@contextlib.contextmanager
def _text(fd: int) -> Iterator[TextIO]:
    """A line-buffered text stream on a copy of a client's descriptor, closed (its unwritten text
    dropped) when the block ends: nothing of it outlives the command. (The close closes the copy
    even when its flush fails; the descriptor is never closed a second time, when another
    thread may hold its number already.)"""
    stream = open(os.dup(fd), "w", buffering=1, encoding="utf-8", errors="replace", closefd=True)  # noqa: SIM115
    try:
        yield stream
    finally:
        with contextlib.suppress(OSError):
            stream.close()
