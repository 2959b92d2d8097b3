"""`sandboxer exec` on a bwrap sandbox: the command joins the sandbox's namespaces (joiner), with
a caller's stdio or a program's, and is waited for, its --timeout enforced.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from sandboxer.errors import ExecUsage, not_running
from sandboxer.execio.pumps import Pumps
from sandboxer.execio.stdio import CALLER_GONE, CANCEL_POLL, TIMED_OUT, Control, Watchdog
from sandboxer.execio.terminal import set_size
from sandboxer.host import procs
from sandboxer.host.ready import wait_ready

if TYPE_CHECKING:
    from collections.abc import Mapping

    from sandboxer.backends.bwrap.started import Started
    from sandboxer.core.exec_request import ExecRequest
    from sandboxer.core.record_exec import ExecView
    from sandboxer.execio.stdio import Stdio
    from sandboxer.host.limit_events import LimitWatch


class BwrapExecution:
    """exec on a bwrap sandbox (sandboxer.backends.protocol.Execution)."""

    def run(
        self,
        request: ExecRequest,
        sandbox: ExecView,
        stdio: Stdio,
        *,
        env: Mapping[str, str],
        state_dir: str,
        limits: LimitWatch,
    ) -> int:
        """Join the sandbox's namespaces (joiner) and wait for the command."""
        return run(request, sandbox, stdio, env=env, state_dir=state_dir, limits=limits)

    def limit_groups(self, sandbox: ExecView) -> list[str]:
        """The cgroups the sandbox's record names (none under the rlimit mechanism)."""
        return list(sandbox.cgroups)

    def root_pid(self, sandbox: ExecView) -> int | None:
        """The sandbox's holder, while it is the process the record names."""
        holder = sandbox.holder_pid
        if not holder or procs.start_time(holder) != sandbox.holder_start:
            return None  # gone, and its pid may be another process's by now
        return holder


def _check_running(record: ExecView, sandbox_id: str) -> tuple[int, int]:
    """The sandbox's init and holder still run (they are the namespaces an exec joins): the
    holder's pid and start time."""
    for pid, started in ((record.init_pid, record.init_start), (record.holder_pid, record.holder_start)):
        if pid is None or started is None or not procs.alive(pid, started):
            raise ExecUsage(f"exec: {not_running(sandbox_id)}")
    return int(record.holder_pid or 0), int(record.holder_start or 0)


def run(
    request: ExecRequest,
    record: ExecView,
    stdio: Stdio,
    *,
    env: Mapping[str, str],
    state_dir: str,
    limits: LimitWatch,
) -> int:
    """exec by joining the sandbox's namespaces (joiner), on `stdio`."""
    sandbox_id = request.sandbox_id
    holder_pid, holder_start = _check_running(record, sandbox_id)
    from sandboxer.backends.bwrap import privileges, pty, spawner  # ctypes and the namespace code
    from sandboxer.backends.bwrap.entry import Entry

    if record.limits_mechanism is None or record.host_uid is None or record.host_gid is None:
        raise ExecUsage(f"exec: sandbox {sandbox_id}: its record has no limits or host ids")
    entry = Entry(
        holder_pid=holder_pid,
        host_uid=record.host_uid,
        host_gid=record.host_gid,
        cwd=request.cwd,
        argv=list(request.argv),
        executable=request.executable,
        env=dict(env),
        cgroup_procs=record.procs_files,
        rlimits=record.rlimits,
        seccomp=_seccomp_program(state_dir, sandbox_id),
        holder_start=holder_start,
        keyring=privileges.keyring_name(sandbox_id),
        tty=request.tty,
    )
    cancelled = stdio.cancelled
    control = stdio.control()  # a CLI client's connection, or the signals a program sends
    sandbox_pty = pty.opener(holder_pid, holder_start, (record.host_uid, record.host_gid))  # its devpts
    pumps = stdio.pumps(tty=request.tty, opener=sandbox_pty)
    watched = cancelled is not None or control is not None  # the caller may go away
    exec_group = None
    forwarder = None
    try:
        exec_group = _exec_group(record) if request.timeout is not None or watched else None
        if exec_group is not None:
            parent = os.path.dirname(exec_group)
            entry.cgroup_procs = tuple(
                os.path.join(exec_group, os.path.basename(f)) if os.path.dirname(f) == parent else f
                for f in entry.cgroup_procs
            )
        forwarder = _SignalForwarder() if stdio.own_signals else None
        terminal = pumps.terminal
        with stdio.terminal(None if terminal is None else lambda size: set_size(terminal, size)):
            try:
                started = spawner.start(entry, stdin=pumps.given[0], stdout=pumps.given[1], stderr=pumps.given[2])
            finally:
                pumps.given_away()
            if forwarder is not None:
                forwarder.found(started.command_pid)
            return _wait(started, request.timeout, exec_group, pumps, cancelled=cancelled, control=control)
    finally:
        if forwarder is not None:
            forwarder.restore()
        pumps.given_away()  # (done already once the command started)
        pumps.close()
        if exec_group is not None:
            limits.remove_group(exec_group)  # kept while a background process of this exec still runs


def _seccomp_program(state_dir: str, sandbox_id: str) -> bytes:
    """The sandbox's compiled syscall policy; no exec runs without it."""
    try:
        with open(os.path.join(state_dir, "sandboxes", sandbox_id, "seccomp.bpf"), "rb") as stream:
            program = stream.read()
    except OSError:
        raise ExecUsage(f"exec: sandbox {sandbox_id}: its syscall policy cannot be read") from None
    if not program or len(program) % 8:
        raise ExecUsage(f"exec: sandbox {sandbox_id}: its syscall policy is damaged")
    return program


def _exec_group(record: ExecView) -> str | None:
    """A cgroup of this exec's own, below the sandbox's pids group, when cgroups are in use.

    Made only for an exec with --timeout (making and removing a cgroup costs milliseconds): it
    lets the timeout find every process of the exec, even one that made its own session and was
    re-parented. The sandbox's limits still apply to it through the parent group.
    """
    groups = record.cgroups
    if record.limits_mechanism not in ("cgroup-v1", "cgroup-v2"):
        return None
    parent = next((g for g in groups if "/pids/" in g), groups[0] if groups else None)
    if not isinstance(parent, str):
        return None
    group = os.path.join(parent, f"exec-{os.urandom(6).hex()}")
    try:
        os.mkdir(group, 0o755)
    except OSError:
        return None
    return group


class _SignalForwarder:
    """SIGINT, SIGTERM and SIGHUP to this process go to the command's session (an in-process
    exec on the caller's own terminal or pipes).

    Installed before the command starts: a signal that arrives while it starts waits for its pid
    instead of ending this process and leaving the command running with the caller's stdout.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.command_pid: int | None = None
        self.pending: list[int] = []
        self.previous = {sig: signal.signal(sig, self.forward) for sig in self.SIGNALS}

    def forward(self, signum: int, _frame: object = None) -> None:
        if self.command_pid is None:
            self.pending.append(signum)
        else:
            procs.signal_all(procs.in_session(self.command_pid) or [self.command_pid], signum)

    def found(self, command_pid: int) -> None:
        self.command_pid = command_pid
        for signum in self.pending:
            self.forward(signum)
        self.pending.clear()

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _wait(
    started: Started,
    timeout: float | None,
    exec_group: str | None,
    pumps: Pumps,
    *,
    cancelled: Callable[[], bool] | None = None,
    control: Control | None = None,
) -> int:
    def forward(signum: int) -> None:
        procs.signal_all(procs.in_session(started.command_pid) or [started.command_pid], signum)

    def caller_gone() -> bool:
        return (cancelled is not None and cancelled()) or (control is not None and control.gone)

    ended = started.ended_fd()
    deadline = None if timeout is None else time.monotonic() + timeout
    watched = [control.fd] if control is not None else []
    # The loop below enforces the deadline too; the watchdog, when output it hands on blocks it.
    watchdog = Watchdog(timeout, lambda: _kill(exec_group, started.command_pid))
    try:
        with watchdog:
            while True:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                if cancelled is not None:
                    remaining = CANCEL_POLL if remaining is None else min(remaining, CANCEL_POLL)
                try:
                    readable, writable = wait_ready([ended, *pumps.readers(), *watched], pumps.writers(), remaining)
                except InterruptedError:
                    continue
                pumps.pump(readable, writable)
                if ended in readable:
                    watchdog.stop()  # the relay has ended: the command's pid may be reused soon
                    break
                if control is not None and control.fd in readable:
                    for signum in control.signals():
                        forward(signum)
                    if pumps.terminal is not None and control.size is not None:
                        set_size(pumps.terminal, control.size)
                gone = caller_gone()
                if gone or (deadline is not None and time.monotonic() >= deadline):
                    watchdog.stop()
                    _kill(exec_group, started.command_pid)
                    started.finish()
                    return CALLER_GONE if gone else TIMED_OUT
    except BaseException:  # nothing of the exec outlives a failure here, and its relay is waited for
        running = not wait_ready([ended], timeout=0)[0]  # else the command's pid may be reused already
        _kill(exec_group, started.command_pid if running else None)
        started.finish()
        raise
    finally:
        _finish_pumps(pumps, started)
    status = started.finish()
    if started.lost or caller_gone():
        # Its relay was killed, or the caller went away as the command ended (its output was
        # nowhere to go): what it left running goes too, never unsupervised.
        _kill(exec_group, None)
    if caller_gone():
        return CALLER_GONE
    return TIMED_OUT if watchdog.fired else status


def _finish_pumps(pumps: Pumps, started: Started) -> None:
    """The output written before the command ended; should that fail, the relay is still waited
    for (a zombie, or a spawner's status pipe, is never left behind)."""
    try:
        pumps.finish()
    except BaseException:
        started.finish()
        raise


def _kill(exec_group: str | None, command_pid: int | None) -> None:
    """Kill everything of an exec: its own cgroup when it has one, and the command's session."""
    if exec_group is not None:
        procs.kill_cgroup(exec_group)
    if command_pid is not None:
        procs.kill_session(command_pid)
