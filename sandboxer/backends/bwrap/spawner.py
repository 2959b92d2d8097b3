"""The service's spawner: a small process of its own that forks each exec's relay (joiner's A).

Forking copies the forking process's page tables, and a service has many: its imports, and a
thread (with a stack mapping) for each of the hundreds of requests it may serve at once. An exec
forked from the service itself pays for all of that twice (A, then B from A's copy) — several
milliseconds, and more as the service's thread pools grow. The spawner is a separate Python
process that imports only what entering a sandbox needs and runs one thread, so its forks are
cheap, and its children are never forked from a threaded process at all.

    service ── socketpair (SOCK_SEQPACKET), one request at a time ──► spawner ── fork ──► A …

A request is one message with six descriptors attached (SCM_RIGHTS): the exec's Entry as JSON in
a sealed memfd, the command's stdin, stdout and stderr, and the write ends of its report pipe
and of its status pipe. The spawner (spawner_process.py) opens the sandbox's namespaces and
cgroups as the service would, forks A, closes its copies and answers `{"relay": PID}` or
`{"error": [STATUS, MESSAGE]}`. A reports to the service directly (joiner.read_report) and, once
the command ends, writes its exit status to the status pipe before it ends: the service waits on
that pipe (its end of file, should A be killed, says so too), never on A's pid, which the
spawner reaps as soon as it ends (SIGCHLD). A root spawner forks no A: the command itself goes
straight into its sandbox (joiner.fork_command), and the spawner writes its status when it
reaps it; the answer's "relay" is then the command's pid. The spawner runs as the service's own account, is
reached only through the socket the service made for it (no path), and dies with the service
(PR_SET_PDEATHSIG).

Only the service uses it: an exec run in-process (the CLI with SANDBOXER_NO_SERVICE, the embedded
API) forks its relay itself, as a process that small pays little for it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from sandboxer.backends.bwrap import joiner
from sandboxer.backends.bwrap.entry import Entry
from sandboxer.backends.bwrap.spawner_process import ENTRY_FIELDS, MAX_REQUEST
from sandboxer.backends.bwrap.started import Started
from sandboxer.errors import EntryError

ANSWER_SECONDS = 10.0  # a spawner that does not answer a request in this time is replaced
FAILED_STARTS = 3  # spawners that die at once before the service forks its execs itself again
log = logging.getLogger("sandboxer.service")
_BOOTSTRAP = (
    "import sys\n"
    "sys.path.insert(0, sys.argv[1])\n"
    "from sandboxer.backends.bwrap.spawner_process import main\n"
    "main(int(sys.argv[2]))\n"
)


class Spawner:
    """The service's side: starts the spawner process and hands it execs to start."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # -I: none of the service's PYTHON* variables, no user site; the package from where the
        # service has it (installed, or a checkout on PYTHONPATH).
        package_root = str(Path(__file__).resolve().parents[3])  # above sandboxer/backends/bwrap/
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-I", "-c", _BOOTSTRAP, package_root, str(theirs.fileno())],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                close_fds=True,
                cwd="/",
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.set_inheritable(False)
        ours.settimeout(ANSWER_SECONDS)
        self.socket = ours
        self._lock = threading.Lock()

    def start(self, entry: Entry, *, stdin: int, stdout: int, stderr: int) -> Started:
        """joiner.start, with A forked by the spawner; EntryError as there. OSError when the
        spawner did not answer (gone, or stalled past ANSWER_SECONDS: it is killed then)."""
        opened: list[int] = []
        try:
            request = _request_file(entry)
            opened.append(request)
            report_r, report_w = os.pipe2(os.O_CLOEXEC)
            opened += [report_r, report_w]
            status_r, status_w = os.pipe2(os.O_CLOEXEC)
            opened += [status_r, status_w]
            with self._lock:
                try:
                    socket.send_fds(self.socket, [b"x"], [request, stdin, stdout, stderr, report_w, status_w])
                    answer = self.socket.recv(65536)
                except OSError:  # its answers cannot be paired with requests any more
                    self.process.kill()
                    raise
            for fd in (request, report_w, status_w):
                opened.remove(fd)
                os.close(fd)
            if not answer:
                raise OSError("the spawner went away")
            said = json.loads(answer)
            if "error" in said:
                status, message = said["error"]
                raise EntryError(int(status), str(message))
            relay = int(said["relay"])
            opened.remove(report_r)
            command_pid = joiner.read_report(report_r)  # closes it
        except BaseException:
            for fd in opened:
                os.close(fd)
            raise
        return Started(relay_pid=relay, command_pid=command_pid, status_fd=status_r)

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        self.socket.close()  # its end of the socket ends: it exits
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _request_file(entry: Entry) -> int:
    """The entry as JSON in a sealed memfd (a message of the socket holds only ~200 KB)."""
    data = json.dumps({"entry": _plain(entry)}, ensure_ascii=False).encode()
    if len(data) > MAX_REQUEST:
        raise EntryError(125, f"the command and its environment are larger than {MAX_REQUEST // 2**20} MiB")
    fd = os.memfd_create("sandboxer-exec", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.write(fd, data)  # a memfd takes all of it at once
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return fd


class Slot:
    """The service's spawner, and when spawners died: one object, read and replaced under its
    lock by every exec thread of the service (and by serve.py, which activates it at its start
    and deactivates it at its stop). A request to the spawner itself runs outside this lock,
    under the spawner's own (one request at a time on its socket)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spawner: Spawner | None = None
        self._failed: list[float] = []  # when spawners died (FAILED_STARTS of them: execs are forked here)

    def activate(self) -> None:
        with self._lock:
            if self._spawner is None:
                self._spawner = Spawner()

    def deactivate(self) -> None:
        with self._lock:
            spawner, self._spawner = self._spawner, None
            if spawner is not None:
                spawner.close()

    def current(self) -> Spawner | None:
        """The live spawner (a new one if it died), or None: fork the exec here."""
        with self._lock:
            spawner = self._spawner
            if spawner is not None and not spawner.alive():
                spawner.close()
                self._spawner = spawner = None
                self._failed.append(time.monotonic())
                if len(self._failed) < FAILED_STARTS:
                    self._spawner = spawner = Spawner()
                else:
                    log.error("the exec spawner keeps dying: the service forks its execs itself")
            return spawner


_SLOT = Slot()  # this process's: the service's spawner, once it started one (activate)


def activate() -> None:
    """Start the service's spawner (serve.py, once): its execs are forked by it from now on."""
    _SLOT.activate()


def deactivate() -> None:
    _SLOT.deactivate()


def start(entry: Entry, *, stdin: int, stdout: int, stderr: int) -> Started:
    """Start an exec: through the active spawner (a new one if it died), or from this process
    when there is none (an exec in-process), or when spawners keep dying at once. A spawner that
    goes away in the middle of a request fails that exec (EntryError, 125): whether it had
    started cannot be known."""
    spawner = _SLOT.current()
    if spawner is None:
        return joiner.start(entry, stdin=stdin, stdout=stdout, stderr=stderr)
    try:
        return spawner.start(entry, stdin=stdin, stdout=stdout, stderr=stderr)
    except OSError as exc:
        raise EntryError(125, f"the service's spawner went away ({exc.strerror or exc})") from None


def _plain(entry: Entry) -> dict[str, Any]:
    plain = {name: getattr(entry, name) for name in ENTRY_FIELDS}
    plain["seccomp"] = None if entry.seccomp is None else entry.seccomp.hex()
    return plain
