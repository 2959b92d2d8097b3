"""`sandboxer exec` on a Docker sandbox: an exec made and streamed through the Engine
(sandboxer.backends.docker.execs), with a caller's stdio or a program's, its --timeout enforced
through a pids cgroup of its own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from sandboxer.backends.docker import engine, execs
from sandboxer.errors import EntryError, ExecUsage
from sandboxer.execio.stdio import CALLER_GONE, TIMED_OUT, Control, Resize
from sandboxer.host import pids_room, procs

if TYPE_CHECKING:
    from collections.abc import Mapping

    from sandboxer.core.exec_request import ExecRequest
    from sandboxer.core.record_exec import ExecView
    from sandboxer.execio.stdio import Stdio
    from sandboxer.host.limit_events import LimitWatch


class DockerExecution:
    """exec on a Docker sandbox (sandboxer.backends.protocol.Execution)."""

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
        """An exec made and streamed through the Engine."""
        return run(request, sandbox, stdio, env=env, limits=limits)

    def limit_groups(self, sandbox: ExecView) -> list[str]:
        """The groups the record names, else the container's own (the Engine made them)."""
        if sandbox.cgroups:
            return list(sandbox.cgroups)
        return container_groups(sandbox.container_id) if sandbox.container_id else []

    def root_pid(self, sandbox: ExecView) -> int | None:
        """The container's pid 1, as the Engine tells it."""
        if not sandbox.container_id:
            return None
        from sandboxer.backends.docker.container import inspect  # not the hot path: after a failure
        from sandboxer.errors import SandboxerError

        try:
            pid = (inspect(sandbox.container_id).get("State") or {}).get("Pid")
        except (OSError, SandboxerError):
            return None
        return pid if isinstance(pid, int) and pid > 0 else None


def run(request: ExecRequest, record: ExecView, stdio: Stdio, *, env: Mapping[str, str], limits: LimitWatch) -> int:
    """exec through the Engine API on `stdio`; statuses as on bwrap (env -i gives 126/127 for us)."""
    user = _user(record, request.sandbox_id)
    tty = request.tty
    size = stdio.window() if tty else None  # (a program's stdio is refused one)
    cancelled = stdio.cancelled
    resized: Resize = lambda size: execs.resize(exec_id, size)  # noqa: E731
    if (control := stdio.control()) is not None:  # a CLI client's connection, or a program's signals
        cancelled = _caller_gone(control, resized if tty else None, cancelled)
    _check_room(limits)
    # Gated: in a cgroup of its own (to kill all of it), and with a terminal its size before its
    # command reads it.
    gated = request.timeout is not None or cancelled is not None or size is not None
    try:
        exec_id = execs.create_exec(
            str(record.container_id),
            list(request.argv),
            env=dict(env),
            user=user,
            cwd=request.cwd,
            # A provider's values, and a caller's (exec --env), travel in the exec's environment,
            # never on a command line another process of the container could read.
            executable=request.executable or (request.argv[0] if request.values_apart else None),
            values_apart=request.values_apart,
            gate=gated,
            tty=tty,
        )
    except (OSError, engine.EngineError) as exc:
        raise ExecUsage(f"exec: the Docker Engine failed ({exc})") from None

    def interrupted(signum: int, _frame: object) -> None:
        raise _Interrupted(signum)

    if stdio.own_signals:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, interrupted)
    groups: list[str] = []

    def started() -> None:
        if gated:
            group = _docker_exec_group(exec_id, before_go=(lambda: resized(size)) if size is not None else None)
            if group is not None:
                groups.append(group)

    try:
        with stdio.streams() as (stdin, output), stdio.terminal(resized if tty else None):
            finished = execs.run(
                exec_id,
                stdin=stdin,
                output=output,
                timeout=request.timeout,
                started=started if gated else None,
                cancelled=cancelled,
                kill=lambda: _kill_docker_exec(exec_id, groups),
                tty=tty,
            )
        if not finished:
            _kill_docker_exec(exec_id, groups)
            return CALLER_GONE if cancelled is not None and cancelled() else TIMED_OUT
        return execs.exit_code(exec_id)
    except _Interrupted as stop:
        _kill_docker_exec(exec_id, groups)  # the caller gave up: nothing of this exec outlives it
        return 128 + stop.signum
    except (OSError, engine.EngineError) as exc:
        _kill_docker_exec(exec_id, groups)
        raise ExecUsage(f"exec: the Docker Engine failed or the caller went away ({exc})") from None
    finally:
        for group in groups:
            limits.remove_group(group)  # kept while a background process of this exec still runs


def _caller_gone(control: Control, resize: Resize | None, cancelled: Callable[[], bool] | None) -> Callable[[], bool]:
    """`cancelled` for a caller with a connection (a CLI client's; a program's signals pipe): a
    signal it passes on interrupts the exec as this process's own would; its end, or the
    program's own `cancelled`, cancels; a new window size it sends goes to `resize` (exec -t)."""
    applied = [control.size]

    def gone() -> bool:
        for signum in control.signals():
            raise _Interrupted(signum)
        if resize is not None and control.size is not None and control.size != applied[0]:
            applied[0] = control.size
            resize(control.size)
        return control.gone or (cancelled is not None and cancelled())

    return gone


def _check_room(limits: LimitWatch) -> None:
    """Refuse an exec in a container whose pids limit is already reached: runc moves each exec's
    process into the container's cgroups, and the kernel holds a move to no pids.max (it checks
    forks only). Checked before the exec is made, so execs made at the same moment as the last
    process may each still get in (bwrap's check is the entering process's own: exact)."""
    if (limit := pids_room.over_limit(limits.groups, starting=1)) is not None:
        raise EntryError(125, pids_room.full_message(limit))


def container_groups(container_id: str, hierarchies: tuple[str, ...] = ("memory", "pids", "")) -> list[str]:
    """The container's cgroup directories of `hierarchies` (by default memory and pids, and "":
    the unified hierarchy of a v2-only host), where either of the Engine's cgroup drivers puts
    them (cgroupfs: docker/ID; systemd: system.slice/docker-ID.scope)."""
    root = "/sys/fs/cgroup"
    places = (f"docker/{container_id}", f"system.slice/docker-{container_id}.scope")
    found = []
    for hierarchy in hierarchies:
        for place in places:
            path = os.path.join(root, hierarchy, place) if hierarchy else os.path.join(root, place)
            if os.path.isdir(path):
                found.append(path)
    return found


def _docker_exec_group(exec_id: str, *, before_go: Callable[[], None] | None = None) -> str | None:
    """Move a gated exec (stopped before its command runs) into a pids cgroup of its own below
    the container's, call `before_go` (exec -t: the terminal's size), then let it go on:
    --timeout then finds every process it makes, even one that made its own session and was
    re-parented. None (and the exec let go) where that cannot be done; the timeout then kills
    the exec's session and its command's descendants."""
    pid = 0
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            state = engine.inspect_exec(exec_id)
            pid = state.get("Pid") if isinstance(state.get("Pid"), int) else 0  # type: ignore[assignment]
            if pid and procs.state(pid) == "T":
                break
            if not state.get("Running") and isinstance(state.get("ExitCode"), int):
                return None  # it ended before its gate (a bad --cwd): nothing to move
            time.sleep(0.001)
        else:
            return None
        return _own_pids_group(pid)
    except (OSError, engine.EngineError):
        return None
    finally:
        try:
            if before_go is not None:
                before_go()
        finally:
            if pid:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGCONT)


def _own_pids_group(pid: int) -> str | None:
    """A new pids cgroup (v1) below the one `pid` is in, holding `pid`; None if there is none."""
    with open(f"/proc/{pid}/cgroup") as stream:
        lines = stream.read().splitlines()
    parent = next((line.split(":", 2)[2] for line in lines if line.split(":", 2)[1:2] == ["pids"]), None)
    if parent is None:
        return None
    group = os.path.join("/sys/fs/cgroup/pids" + parent, f"sandboxer-exec-{os.urandom(6).hex()}")
    os.mkdir(group, 0o755)
    try:
        with open(os.path.join(group, "cgroup.procs"), "w") as procs_file:
            procs_file.write(str(pid))
    except OSError:
        os.rmdir(group)
        raise
    return group


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _kill_docker_exec(exec_id: str, groups: list[str] | None = None) -> None:
    """Kill what a Docker exec started: everything in its own cgroup when it has one, and its
    session and its command's descendants, by host pid."""
    for group in groups or []:
        procs.kill_cgroup(group)
    try:
        state = engine.inspect_exec(exec_id)
    except (OSError, engine.EngineError):
        return
    pid = state.get("Pid")
    if state.get("Running") and isinstance(pid, int) and pid > 0:  # not running: the pid may be reused
        procs.kill_session(pid)


def _user(record: ExecView, sandbox_id: str) -> str:
    """The container user an exec runs as (uid:gid); the record must name it and the container."""
    if record.uid is None or record.gid is None or record.container_id is None:
        raise ExecUsage(f"exec: sandbox {sandbox_id}: its record names no container or user")
    return f"{record.uid}:{record.gid}"
