"""`sandboxer exec`: the hot path, kept free of typer, YAML and netlink imports.

    sandboxer [--config-dir D] [--state-dir S] [--debug] exec ID [--cwd DIR] [--consumer NAME]
              [--executable NAME] [--timeout S] -- ARGV…

Exit status: the command's own, 128+N when it died of signal N, 124 when --timeout expired (the
exec's whole session is killed), 125 when the broker failed (unknown id, bad usage, a sandbox
that is not running), 126 not executable, 127 not found.
"""

from __future__ import annotations

import os
import select
import stat
import sys
import time

from sandboxer import procs
from sandboxer.dirs import resolve_dirs
from sandboxer.errors import EntryError
from sandboxer.fastjson import loads

TYPE_CHECKING = False  # `typing` itself costs ~1.5 ms to import on this path; mypy knows the name
if TYPE_CHECKING:
    import signal
    from collections.abc import Callable

    from sandboxer import joiner
    from sandboxer.dirs import Dirs
    from sandboxer.results import Stream
else:
    import _signal as signal  # the same calls and numbers; `signal` imports enum (~3 ms)

BROKER_FAILED = 125
TIMED_OUT = 124
_HEX = frozenset("0123456789abcdef")


def _is_consumer(name: str) -> bool:
    """A manifest's consumer label: 1-128 printable characters without whitespace, '=' or '//'
    (no `re`: it is slow to import)."""
    return (
        0 < len(name) <= 128
        and name.isprintable()
        and not any(c.isspace() for c in name)
        and "=" not in name
        and "//" not in name
    )


def _is_id(value: str) -> bool:
    return len(value) == 24 and set(value) <= _HEX


_GLOBAL_WITH_VALUE = ("--config-dir", "--state-dir")


class ExecUsage(Exception):
    """Bad exec usage (reported with status 125)."""


def _parse(argv: list[str]) -> tuple[dict[str, str], dict[str, str], list[str]]:
    globals_: dict[str, str] = {}
    options: dict[str, str] = {}
    i = 0
    while argv[i] != "exec":
        arg = argv[i]
        if arg == "--debug":
            globals_["debug"] = "1"
            i += 1
        elif "=" in arg:
            key, value = arg.split("=", 1)
            globals_[key] = value
            i += 1
        else:
            globals_[arg] = argv[i + 1]
            i += 2
    rest = argv[i + 1 :]
    if "--" not in rest:
        raise ExecUsage("exec: put -- before the command: sandboxer exec ID [OPTIONS] -- ARGV...")
    split = rest.index("--")
    head, command = rest[:split], rest[split + 1 :]
    if not command:
        raise ExecUsage("exec: no command after --")
    options.update(_parse_exec_options(head))
    return globals_, options, command


def _parse_exec_options(head: list[str]) -> dict[str, str]:
    options: dict[str, str] = {}
    positional: list[str] = []
    j = 0
    while j < len(head):
        arg = head[j]
        if arg in ("--cwd", "--consumer", "--executable", "--timeout"):
            if j + 1 >= len(head):
                raise ExecUsage(f"exec: {arg} needs a value")
            options[arg[2:]] = head[j + 1]
            j += 2
        elif arg.startswith(("--cwd=", "--consumer=", "--executable=", "--timeout=")):
            key, value = arg[2:].split("=", 1)
            options[key] = value
            j += 1
        elif arg.startswith("-"):
            raise ExecUsage(f"exec: no such option: {arg}")
        else:
            positional.append(arg)
            j += 1
    if len(positional) != 1:
        raise ExecUsage("exec: exactly one sandbox ID is expected before --")
    options["id"] = positional[0]
    return options


def _validate(options: dict[str, str]) -> float | None:
    cwd = options.get("cwd")
    if cwd is not None and (not cwd.startswith("/") or os.path.normpath(cwd) != cwd or "\0" in cwd):
        raise ExecUsage("exec: --cwd must be a normalized absolute path inside the sandbox")
    consumer = options.get("consumer")
    if consumer is not None and not _is_consumer(consumer):
        raise ExecUsage("exec: --consumer must be 1-128 characters without whitespace, '=' or '//'")
    executable = options.get("executable")
    if executable is not None and (not executable or "\0" in executable):
        raise ExecUsage("exec: --executable must be a program name or an absolute path")
    timeout = options.get("timeout")
    if timeout is None:
        return None
    try:
        seconds = float(timeout)
    except ValueError:
        raise ExecUsage("exec: --timeout must be a number of seconds") from None
    if not 0 < seconds <= 7 * 24 * 3600:
        raise ExecUsage("exec: --timeout must be between 0 and 604800 seconds")
    return seconds


def _load(state_dir: str, sandbox_id: str) -> dict[str, object]:
    if not _is_id(sandbox_id):
        raise ExecUsage("exec: no such sandbox (ids are 24 lowercase hex digits)")
    try:
        with open(os.path.join(state_dir, "sandboxes", sandbox_id, "record.json"), "rb") as stream:
            record: dict[str, object] = loads(stream.read())
    except FileNotFoundError:
        raise ExecUsage(f"exec: no such sandbox: {sandbox_id}") from None
    except (OSError, ValueError):
        raise ExecUsage(f"exec: sandbox {sandbox_id}: its record cannot be read") from None
    if record.get("state") in ("warming", "warm"):  # registry.HIDDEN_STATES: nobody's sandbox yet
        raise ExecUsage(f"exec: no such sandbox: {sandbox_id}")
    if record.get("state") != "ready":
        raise ExecUsage(f"exec: sandbox {sandbox_id} is not ready (state {record.get('state')})")
    if record.get("backend") == "docker":
        return record  # the Engine answers for the container; a gone one fails the exec with 125
    for key in ("init", "holder"):
        pid, started = record.get(f"{key}_pid"), record.get(f"{key}_start")
        if not isinstance(pid, int) or not isinstance(started, int) or not procs.alive(pid, started):
            raise ExecUsage(f"exec: sandbox {sandbox_id} is not running (see sandboxer gc)")
    return record


def _kill_group(group: str) -> None:
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
        procs.signal_all(members, signal.SIGKILL)
        procs.wait_gone(members, 0.2)


def _kill_session(command_pid: int) -> None:
    """Kill the exec's session and every descendant of its command, until none is left."""
    for _ in range(100):
        victims = set(procs.in_session(command_pid))
        frontier = [command_pid]
        while frontier:
            pid = frontier.pop()
            victims.add(pid)
            frontier.extend(procs.children(pid))
        victims = {pid for pid in victims if procs.start_time(pid) is not None}
        if not victims:
            return
        procs.signal_all(victims, signal.SIGKILL)
        if not procs.wait_gone(victims, 0.5):
            still = [p for p in procs.in_session(command_pid) if procs.start_time(p) is not None]
            if not still:
                return


def run(argv: list[str]) -> int:
    """Run one exec with this process's stdio; returns its exit status."""
    globals_, options, command = _parse(argv)
    dirs = resolve_dirs(
        config_dir=globals_.get("--config-dir"),
        state_dir=globals_.get("--state-dir"),
        environ=os.environ,
        euid=os.geteuid(),
        home=os.path.expanduser("~"),
    )
    return execute(dirs, options, command)


class Program:
    """The stdio of an exec a program runs (the Python API): `stdin` is all of its input, and
    `output(stream, chunk)` receives what it writes as it arrives ("stdout" or "stderr"). Signals
    to the calling process are its own business then: none are forwarded."""

    __slots__ = ("output", "stdin")

    def __init__(self, stdin: bytes, output: Callable[[Stream, bytes], None]) -> None:
        self.stdin = stdin
        self.output = output


def execute(dirs: Dirs, options: dict[str, str], command: list[str], program: Program | None = None) -> int:
    """Run `command` in the sandbox `options["id"]` with the exec options of the CLI (cwd,
    consumer, executable, timeout, as strings), on this process's stdio or `program`'s."""
    timeout = _validate(options)
    record = _load(dirs.state, options["id"])
    env = {str(k): str(v) for k, v in record["env"]}  # type: ignore[attr-defined]
    assignment = record.get("manifest")
    if isinstance(assignment, dict):
        for lease_id, moment in assignment.get("expiries", []):
            if float(moment) <= time.time():
                raise ExecUsage(f"exec: lease {lease_id} has expired")
    if "consumer" in options and "executable" in options:
        env = _provider_environment(assignment, options["consumer"], options["executable"])
    elif "consumer" in options:
        env["SANDBOXER_CONSUMER"] = options["consumer"]
    if record.get("backend") == "docker":
        return _run_docker(record, options, command, env, timeout, program=program)
    return _run_bwrap(record, options, command, env, timeout, program=program, state_dir=dirs.state)


def _run_bwrap(
    record: dict[str, object],
    options: dict[str, str],
    command: list[str],
    env: dict[str, str],
    timeout: float | None,
    *,
    program: Program | None,
    state_dir: str,
) -> int:
    """exec by joining the sandbox's namespaces (joiner)."""
    from sandboxer import joiner  # ctypes and the namespace code: bwrap sandboxes only

    limit_record = record["limits"]
    if not isinstance(limit_record, dict):
        raise ExecUsage(f"exec: sandbox {options['id']}: its record has no limits")
    entry = joiner.Entry(
        holder_pid=int(record["holder_pid"]),  # type: ignore[call-overload]
        host_uid=int(record["host_uid"]),  # type: ignore[call-overload]
        host_gid=int(record["host_gid"]),  # type: ignore[call-overload]
        cwd=options.get("cwd", "/workspace"),
        argv=command,
        executable=options.get("executable"),
        env=env,
        cgroup_procs=tuple(limit_record["procs_files"]),
        rlimits=tuple((int(a), int(b)) for a, b in limit_record["rlimits"]),
        seccomp=_seccomp_program(state_dir, options["id"]),
        holder_start=int(record["holder_start"]),  # type: ignore[call-overload]
        keyring=joiner.keyring_name(options["id"]),
    )
    exec_group = _exec_group(limit_record) if timeout is not None else None
    if exec_group is not None:
        parent = os.path.dirname(exec_group)
        procs_files = tuple(
            os.path.join(exec_group, os.path.basename(f)) if os.path.dirname(f) == parent else f
            for f in entry.cgroup_procs
        )
        entry.cgroup_procs = procs_files
    pumps = Pumps.for_caller_stdio() if program is None else Pumps.for_program(program)
    try:
        try:
            started = joiner.start(entry, stdin=pumps.given[0], stdout=pumps.given[1], stderr=pumps.given[2])
        finally:
            pumps.given_away()
        return _wait(started, timeout, exec_group, pumps, forward_signals=program is None)
    finally:
        pumps.close()
        if exec_group is not None:
            try:
                os.rmdir(exec_group)  # kept while a background process of this exec still runs
            except OSError:
                pass


class Pumps:
    """Pipes in front of the caller's stdio where handing it over would give the command more
    than a stream, and the copying between them (the exec's hot path: plain os calls).

    A terminal: the command could go on reading the caller's keystrokes after the exec returned
    (a background process keeps the descriptor) and drive the terminal. A regular file: the
    command could reopen it through /proc/self/fd for reading (what the caller wrote there
    before) or, as the same uid, for writing. Pipes, sockets and other character devices
    (/dev/null) are handed over as they are; a directory or a block device is refused.
    """

    def __init__(self) -> None:
        self.given = [0, 1, 2]  # what the command gets as its fds 0, 1, 2
        self.stdin_source: int | None = 0  # where more input comes from; None: `pending` is all
        self.stdin_sink = -1  # our end of the command's stdin pipe
        self.pending = b""  # read from the caller's stdin, not yet in the pipe
        self.outputs: dict[int, Callable[[bytes], None]] = {}  # our read end -> where its bytes go
        self._theirs: list[int] = []  # the ends the command holds copies of, once started

    def _pipe_in(self) -> None:
        read_end, write_end = os.pipe2(os.O_CLOEXEC)
        self.given[0], self.stdin_sink = read_end, write_end
        os.set_blocking(write_end, False)
        self._theirs.append(read_end)

    def _pipe_out(self, target: int, sink: Callable[[bytes], None]) -> None:
        read_end, write_end = os.pipe2(os.O_CLOEXEC)
        self.given[target] = write_end
        self.outputs[read_end] = sink
        self._theirs.append(write_end)

    @classmethod
    def for_program(cls, program: Program) -> Pumps:
        """Pipes for all three: the input given at once, the output to the program's sink."""
        pumps = cls()
        try:
            pumps._pipe_in()
            pumps.stdin_source, pumps.pending = None, program.stdin
            if not pumps.pending:
                pumps._end_stdin()
            pumps._pipe_out(1, lambda chunk: program.output("stdout", chunk))
            pumps._pipe_out(2, lambda chunk: program.output("stderr", chunk))
        except BaseException:
            pumps.given_away()
            pumps.close()
            raise
        return pumps

    @classmethod
    def for_caller_stdio(cls) -> Pumps:
        """The pumps this process's fds 0-2 need."""
        pumps = cls()
        try:
            for target in (0, 1, 2):
                try:
                    mode = os.fstat(target).st_mode
                except OSError:
                    continue  # closed: the command gets it closed too
                if stat.S_ISDIR(mode) or stat.S_ISBLK(mode):
                    what = "a directory" if stat.S_ISDIR(mode) else "a block device"
                    raise ExecUsage(
                        f"exec: {('stdin', 'stdout', 'stderr')[target]} is {what}: give it a file or a pipe"
                    )
                if not (stat.S_ISREG(mode) or os.isatty(target)):
                    continue
                if target == 0:
                    pumps._pipe_in()
                else:
                    pumps._pipe_out(target, _writer(target))
        except BaseException:
            pumps.given_away()
            pumps.close()
            raise
        return pumps

    def given_away(self) -> None:
        """The command has its copies: close ours of its ends."""
        for fd in self._theirs:
            os.close(fd)
        self._theirs = []

    def readers(self) -> list[int]:
        """What to wait on for reading."""
        source = self.stdin_source
        waiting = [source] if source is not None and self.stdin_sink >= 0 and not self.pending else []
        return [*waiting, *self.outputs]

    def writers(self) -> list[int]:
        """What to wait on for writing."""
        return [self.stdin_sink] if self.stdin_sink >= 0 and self.pending else []

    def pump(self, readable: list[int], writable: list[int]) -> None:
        """Copy what is ready."""
        for fd in readable:
            if fd in self.outputs and not _copy(fd, self.outputs[fd]):
                os.close(fd)
                del self.outputs[fd]
            elif fd == self.stdin_source and self.stdin_sink >= 0:
                try:
                    self.pending = os.read(fd, 65536)
                except OSError:
                    self.pending = b""
                if not self.pending:
                    self._end_stdin()
        if self.stdin_sink in writable:
            try:
                self.pending = self.pending[os.write(self.stdin_sink, self.pending) :]
            except BlockingIOError:
                pass
            except OSError:  # the command closed its stdin
                self._end_stdin()
            if not self.pending and self.stdin_source is None:
                self._end_stdin()  # all of it is in: the command reads its end

    def _end_stdin(self) -> None:
        if self.stdin_sink >= 0:
            os.close(self.stdin_sink)
        self.stdin_sink, self.pending = -1, b""

    def finish(self) -> None:
        """The command ended: no more of the caller's stdin reaches what it left behind, and its
        output written before it ended is copied; a background process of the exec that still
        holds a pipe does not hold the caller up (it gets EOF and EPIPE from now on)."""
        self._end_stdin()
        for read_end, target in self.outputs.items():
            os.set_blocking(read_end, False)
            while _copy(read_end, target):
                try:
                    if not select.select([read_end], [], [], 0)[0]:
                        break
                except InterruptedError:
                    continue

    def close(self) -> None:
        """Close every end of ours."""
        self._end_stdin()
        for read_end in self.outputs:
            os.close(read_end)
        self.outputs = {}


def _copy(read_end: int, sink: Callable[[bytes], None]) -> bool:
    """Hand what one output pipe holds to its sink; False at its end."""
    try:
        data = os.read(read_end, 65536)
    except BlockingIOError:
        return True
    if not data:
        return False
    sink(data)
    return True


def _writer(target: int) -> Callable[[bytes], None]:
    """A sink writing to the caller's fd `target`."""

    def write(data: bytes) -> None:
        while data:
            try:
                data = data[os.write(target, data) :]
            except OSError:
                return  # the caller's file or terminal refuses: the command's output is dropped

    return write


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


def _provider_environment(assignment: object, consumer: str, executable: str) -> dict[str, str]:
    """A provider launch's whole environment, granted by the sandbox's manifest or refused."""
    if not isinstance(assignment, dict):
        raise ExecUsage(
            "exec: a provider launch (--consumer with --executable) needs a sandbox created with a manifest"
        )
    from sandboxer import leases
    from sandboxer.errors import SandboxerError

    try:
        return leases.provider_environment(
            assignment, consumer=consumer, executable=executable, caller_env=dict(os.environ)
        )
    except SandboxerError as exc:
        raise ExecUsage(f"exec: provider launch refused: {exc.message}") from None


def _run_docker(
    record: dict[str, object],
    options: dict[str, str],
    command: list[str],
    env: dict[str, str],
    timeout: float | None,
    *,
    program: Program | None,
) -> int:
    """exec through the Engine API; statuses as on bwrap (env -i gives 126/127 for us)."""
    from sandboxer import dockerexec

    user = f"{record['uid']}:{record['gid']}"
    try:
        exec_id = dockerexec.create_exec(
            str(record["container_id"]),
            command,
            env=env,
            user=user,
            cwd=options.get("cwd", "/workspace"),
            executable=options.get("executable"),
            # A provider's values travel in the exec's environment, never on a command line.
            values_apart="consumer" in options and "executable" in options,
            gate=timeout is not None,
        )
    except (OSError, dockerexec.EngineError) as exc:
        raise ExecUsage(f"exec: the Docker Engine failed ({exc})") from None

    def interrupted(signum: int, _frame: object) -> None:
        raise _Interrupted(signum)

    if program is None:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, interrupted)
    groups: list[str] = []

    def started() -> None:
        group = _docker_exec_group(exec_id)
        if group is not None:
            groups.append(group)

    stdin = 0
    if program is None:
        output = dockerexec.to_fds(1, 2)
    else:
        stdin = _feeder(program.stdin)

        def output(stream: int, chunk: bytes) -> None:
            program.output("stdout" if stream == 1 else "stderr", chunk)

    try:
        finished = dockerexec.run(
            exec_id, stdin=stdin, output=output, timeout=timeout, started=started if timeout is not None else None
        )
        if not finished:
            _kill_docker_exec(exec_id, groups)
            return TIMED_OUT
        return dockerexec.exit_code(exec_id)
    except _Interrupted as stop:
        _kill_docker_exec(exec_id, groups)  # the caller gave up: nothing of this exec outlives it
        return 128 + stop.signum
    except (OSError, dockerexec.EngineError) as exc:
        _kill_docker_exec(exec_id, groups)
        raise ExecUsage(f"exec: the Docker Engine failed or the caller went away ({exc})") from None
    finally:
        if stdin != 0:
            os.close(stdin)
        for group in groups:
            try:
                os.rmdir(group)  # kept while a background process of this exec still runs
            except OSError:
                pass


def _feeder(data: bytes) -> int:
    """A descriptor to read `data` from, then its end: a sealed memfd (no thread, no pipe limit)."""
    fd = os.memfd_create("sandboxer-stdin", os.MFD_CLOEXEC)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _docker_exec_group(exec_id: str) -> str | None:
    """Move a gated exec (stopped before its command runs) into a pids cgroup of its own below
    the container's, then let it go on: --timeout then finds every process it makes, even one
    that made its own session and was re-parented. None (and the exec let go) where that cannot
    be done; the timeout then kills the exec's session and its command's descendants."""
    from sandboxer import dockerexec

    pid = 0
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            state = dockerexec.inspect_exec(exec_id)
            pid = state.get("Pid") if isinstance(state.get("Pid"), int) else 0  # type: ignore[assignment]
            if pid and procs.state(pid) == "T":
                break
            if not state.get("Running") and isinstance(state.get("ExitCode"), int):
                return None  # it ended before its gate (a bad --cwd): nothing to move
            time.sleep(0.001)
        else:
            return None
        return _own_pids_group(pid)
    except (OSError, dockerexec.EngineError):
        return None
    finally:
        if pid:
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass


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
    from sandboxer import dockerexec

    for group in groups or []:
        _kill_group(group)
    try:
        state = dockerexec.inspect_exec(exec_id)
    except (OSError, dockerexec.EngineError):
        return
    pid = state.get("Pid")
    if state.get("Running") and isinstance(pid, int) and pid > 0:  # not running: the pid may be reused
        _kill_session(pid)


def _exec_group(limit_record: dict[str, object]) -> str | None:
    """A cgroup of this exec's own, below the sandbox's pids group, when cgroups are in use.

    Made only for an exec with --timeout (making and removing a cgroup costs milliseconds): it
    lets the timeout find every process of the exec, even one that made its own session and was
    re-parented. The sandbox's limits still apply to it through the parent group.
    """
    groups = limit_record.get("groups")
    if limit_record.get("mechanism") not in ("cgroup-v1", "cgroup-v2") or not isinstance(groups, list):
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


def _wait(
    started: joiner.Started, timeout: float | None, exec_group: str | None, pumps: Pumps, *, forward_signals: bool
) -> int:
    def forward(signum: int, _frame: object) -> None:
        procs.signal_all(procs.in_session(started.command_pid) or [started.command_pid], signum)

    if forward_signals:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, forward)
    pidfd = os.pidfd_open(started.relay_pid)
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                readable, writable, _ = select.select([pidfd, *pumps.readers()], pumps.writers(), [], remaining)
            except InterruptedError:
                continue
            pumps.pump(readable, writable)
            if pidfd in readable:
                break
            if deadline is not None and time.monotonic() >= deadline:
                if exec_group is not None:
                    _kill_group(exec_group)
                _kill_session(started.command_pid)
                os.waitpid(started.relay_pid, 0)
                return TIMED_OUT
    finally:
        os.close(pidfd)
        pumps.finish()
    _, status = os.waitpid(started.relay_pid, 0)
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def main(argv: list[str]) -> int:
    """Entry point for `sandboxer … exec …`: every broker failure is one line and status 125."""
    try:
        return run(argv)
    except ExecUsage as exc:
        sys.stderr.write(f"sandboxer: {exc}\n")
        return BROKER_FAILED
    except EntryError as exc:
        sys.stderr.write(f"sandboxer: exec: {exc.message}\n")
        return exc.status
    except Exception as exc:
        if "--debug" in argv[: argv.index("exec")]:
            raise
        sys.stderr.write(f"sandboxer: exec: internal error ({type(exc).__name__}); rerun with --debug\n")
        return BROKER_FAILED
