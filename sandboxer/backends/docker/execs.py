"""Execs in a Docker sandbox's container, through the Engine: made, streamed, waited for.

An exec's command runs under `env -i`, so its environment is exactly the plan's: nothing of the
container's (Docker adds HOSTNAME) or of the caller's. It is started on an upgraded (hijacked)
connection; stdin is pumped in and the multiplexed stdout/stderr frames are handed out as they
arrive, then the exit code is read. Create also uses this for its probe of a new container.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable

from sandboxer.backends.docker.engine import EngineError, frames, hijack, inspect_exec, request
from sandboxer.execio.stdio import CANCEL_POLL, Watchdog, to_fds
from sandboxer.host.ready import wait_ready

Socket = socket.socket


# Every exec is a Landlock domain of its own, as on bwrap (privileges.own_landlock_domain): the kernel
# then refuses it ptrace access — ptrace, /proc/PID/mem, environ, fd — to every process outside
# its own tree (the container's pid 1, other execs, a provider launch), whatever uid they share.
# The container's no-new-privileges lets an unprivileged process make one. 444 and 446 are
# landlock_create_ruleset and landlock_restrict_self; the domain handles making device nodes
# (bits 6 and 11), and the ruleset's descriptor is close-on-exec.
#
# A plain exec enters it with Perl, the one interpreter every Debian system has (perl-base is
# essential) that can make a system call and starts in ~1 ms: Python costs ~10 ms, which showed
# in every Docker exec (docs/performance.md). It runs under `env -i`, so no PERL5OPT or PERL5LIB
# of the plan's environment can load code into it before the domain exists. Then it becomes the
# shell below.
_PERL_DOMAIN = (
    'my $handled = pack("Q", 1 << 6 | 1 << 11); my $ruleset = syscall(444, $handled, 8, 0);'
    " if ($ruleset < 0 || syscall(446, $ruleset, 0) != 0) {"
    ' print STDERR "sandboxer: exec: cannot enter a Landlock domain of its own\n"; exit 125 }'
    " exec { $ARGV[0] } @ARGV; exit 127"
)
_ENTER_DOMAIN = ("/usr/bin/env", "-i", "/usr/bin/perl", "-e", _PERL_DOMAIN)

# `exec --executable` (a provider launch) needs argv[0] apart from the program, which env(1)
# cannot do, and the values of a provider's variables apart from the command line (in the exec's
# own environment, so `env -i` cannot come first): a few lines of the host's Python (its /usr is
# in the container) enter the same domain, set cwd and execute with exactly the plan's
# environment, restoring the signal dispositions Python changes at start-up. `-I` keeps every
# PYTHON* variable of that environment from reaching it.
_DOMAIN = """import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
handled = ctypes.c_uint64(1 << 6 | 1 << 11)
ruleset = libc.syscall(444, ctypes.byref(handled), 8, 0)
if ruleset < 0 or libc.syscall(446, ruleset, 0) != 0:
    sys.stderr.write("sandboxer: exec: cannot enter a Landlock domain of its own\\n")
    os._exit(125)
os.close(ruleset)
import signal
for s in (signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores them; what it executes must not
    signal.signal(s, signal.SIG_DFL)
"""

_LAUNCHER = (
    _DOMAIN
    + """gate, cwd, count = sys.argv[1] == "gate", sys.argv[2], int(sys.argv[3])
env = dict(item.split("=", 1) if "=" in item else (item, os.environ[item]) for item in sys.argv[4 : 4 + count])
program, argv = sys.argv[4 + count], sys.argv[5 + count :]
try:
    os.chdir(cwd)
except OSError as exc:
    sys.stderr.write(f"sandboxer: exec: --cwd {cwd}: not a directory inside the sandbox ({exc.strerror})\\n")
    os._exit(125)
if gate:
    os.kill(os.getpid(), signal.SIGSTOP)
try:
    os.execvpe(program, argv, env)
except OSError as exc:
    status = 127 if exc.errno in (2, 20) else 126
    what = "not found" if status == 127 else f"not executable ({exc.strerror})"
    sys.stderr.write(f"sandboxer: exec: {program}: {what}\\n")
    os._exit(status)
"""
)


# The shell in front of `env -i` on the plain exec path: $0 is the cwd, $1 the program, $2 the
# plan's PATH, the rest the command to become. It enters the cwd and looks the program up as
# execvp will, so that the failures the bwrap path reports itself are the same `sandboxer:` lines
# and statuses here: 125 a cwd it cannot enter (the reason told from what the path is), 127 a
# program found nowhere, 126 one found but not executable. What it cannot foresee (a file that
# changes meanwhile, an exec format error) env(1) still reports, with the same status.
_ENTER = """cd -- "$0" 2>/dev/null || {
  if [ ! -e "$0" ]; then r="No such file or directory"; elif [ ! -d "$0" ]; then r="Not a directory"
  else r="Permission denied"; fi
  printf 'sandboxer: exec: --cwd %s: not a directory inside the sandbox (%s)\\n' "$0" "$r" >&2; exit 125; }
p=$1 search=$2 s=; shift 2
l=
case $p in
*/*) [ -e "$p" ] && s=1; [ -f "$p" ] && [ -x "$p" ] && s=2; [ -L "$p" ] && [ ! -e "$p" ] && l=$p ;;
*) set -f; IFS=:
   for d in $search; do f=${d:-.}/$p; [ -e "$f" ] && s=${s:-1}; if [ -f "$f" ] && [ -x "$f" ]; then s=2; break; fi
     [ -L "$f" ] && [ ! -e "$f" ] && l=${l:-$f}; done
   unset IFS; set +f ;;
esac
[ -z "$s" ] && [ -n "$l" ] && {
  printf 'sandboxer: exec: %s: %s is a dangling link (to %s)\\n' "$p" "$l" "$(readlink -- "$l")" >&2; exit 127; }
case $s in
'') printf 'sandboxer: exec: %s: not found\\n' "$p" >&2; exit 127 ;;
1) printf 'sandboxer: exec: %s: not executable (Permission denied)\\n' "$p" >&2; exit 126 ;;
esac
exec "$@"
"""


def create_exec(
    container: str,
    argv: list[str],
    *,
    env: dict[str, str],
    user: str,
    cwd: str,
    executable: str | None = None,
    values_apart: bool = False,
    gate: bool = False,
    tty: bool = False,
) -> str:
    """Create an exec of `argv` (of `executable` with `argv` when given) under exactly `env`;
    returns its id. With `values_apart` (a provider launch) the command line names the variables
    and their values travel in the exec's own environment, which the Engine does not show. With
    `gate` the exec stops itself (SIGSTOP) before it runs the command, so that the broker can put
    it in a cgroup of its own before anything forks; SIGCONT lets it go on. With `tty` the
    Engine gives it a terminal of its own in the container (exec -t)."""
    pairs = [f"{k}={v}" for k, v in env.items()]
    extra: dict[str, object] = {}
    if executable is not None:
        items = list(env) if values_apart else pairs
        if values_apart:
            extra["Env"] = pairs
        mode = "gate" if gate else "go"
        command = [
            "/usr/bin/python3",
            "-I",
            "-S",
            "-c",
            _LAUNCHER,
            mode,
            cwd,
            str(len(items)),
            *items,
            executable,
            *argv,
        ]
    else:
        if "=" in argv[0]:
            raise EngineError("a program name with '=' cannot be run through env -i")
        # The shell enters the cwd and finds the program (or says why not, as the bwrap path
        # does), then env -i builds the environment from nothing and executes the command.
        search = env.get("PATH", "")
        command = [
            *_ENTER_DOMAIN,
            *("/bin/sh", "-c", _ENTER, cwd, argv[0], search, "/usr/bin/env", "-i", "--", *pairs, *argv),
        ]
        if gate:  # dash exports PWD to what it runs: unset it, stop, then become the command
            command[-len(argv) :] = ["/bin/sh", "-c", 'unset PWD; kill -STOP $$; exec "$@"', "sh", *argv]
    body = {
        "AttachStdin": True,
        "AttachStdout": True,
        "AttachStderr": True,
        "Tty": tty,
        "Cmd": command,
        "User": user,
        "WorkingDir": "/",
        "Privileged": False,
        **extra,
    }
    status, content = request("POST", f"/containers/{container}/exec", body)
    if status != 201:
        raise EngineError(f"exec create: HTTP {status}")
    return str(json.loads(content)["Id"])


def _pump_stdin(sock: Socket, stdin: int, stop: int, tty: bool) -> None:
    """Copy `stdin` into the exec until its end, or until `stop` is readable (the exec ended: a
    caller's terminal, which never ends, holds no thread of a service). At its end the exec's
    terminal (exec -t) gets its end-of-file key, ^D; otherwise the exec's stdin is closed."""
    with contextlib.suppress(OSError):
        while wait_ready([stdin, stop])[0] and not wait_ready([stop], timeout=0)[0]:
            data = os.read(stdin, 65536)
            if not data:
                if tty:
                    sock.sendall(b"\x04")
                    return  # the stream stays open both ways: the terminal's output goes on
                break
            sock.sendall(data)
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)


def run(
    exec_id: str,
    *,
    stdin: int,
    output: Callable[[int, bytes], None],
    timeout: float | None,
    started: Callable[[], None] | None = None,
    cancelled: Callable[[], bool] | None = None,
    kill: Callable[[], None] | None = None,
    tty: bool = False,
) -> bool:
    """Start the exec and stream until it ends; False if `timeout` expired first. What it
    writes goes to `output` (stream 1 or 2, bytes) as it arrives. `started` is called once the
    exec runs, before any of its output is read. `kill` kills what the exec started: when
    `output` blocks past the deadline (a caller that stopped reading), a watchdog calls it and
    closes the stream — the Engine, whose writes to it would block, lets the container be."""
    sock, buffer = hijack(f"/exec/{exec_id}/start", json.dumps({"Detach": False, "Tty": tty}).encode())
    stop_r, stop_w = os.pipe2(os.O_CLOEXEC)
    pump = threading.Thread(target=_pump_stdin, args=(sock, stdin, stop_r, tty), daemon=True)

    def overdue() -> None:
        if kill is not None:
            kill()
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)

    watchdog = Watchdog(timeout, overdue)
    try:
        if started is not None:
            started()
        pump.start()
        with watchdog:
            return _stream(sock, buffer, output, timeout, cancelled, raw=tty) and not watchdog.fired
    except (OSError, EngineError):
        if watchdog.fired:
            return False  # the watchdog closed the stream under it
        raise
    finally:
        os.write(stop_w, b"x")
        if pump.is_alive():
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # a pump blocked in sendall returns
            pump.join()
        os.close(stop_r)
        os.close(stop_w)
        sock.close()


def _stream(
    sock: socket.socket,
    buffer: bytes,
    output: Callable[[int, bytes], None],
    timeout: float | None,
    cancelled: Callable[[], bool] | None,
    *,
    raw: bool = False,
) -> bool:
    """Hand the exec's output on until its end (True) or its deadline or cancellation (False).
    `raw`: a terminal's output, one stream (1) not framed."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        if raw:
            ready_frames, buffer = ([(1, buffer)] if buffer else []), b""
        else:
            ready_frames, buffer = frames(buffer)
        for stream, payload in ready_frames:
            output(stream, payload)
        remaining = None if deadline is None else deadline - time.monotonic()
        if (remaining is not None and remaining <= 0) or (cancelled is not None and cancelled()):
            return False
        if cancelled is not None:
            remaining = CANCEL_POLL if remaining is None else min(remaining, CANCEL_POLL)
        ready, _ = wait_ready([sock.fileno()], timeout=remaining)
        if not ready:
            continue
        data = sock.recv(65536)
        if not data:
            if buffer:
                raise EngineError("the Engine closed the stream in the middle of a frame")
            return True
        buffer += data


def resize(exec_id: str, size: tuple[int, int]) -> None:
    """Give an exec's terminal (exec -t) the window size (rows, columns); ignored once it ended."""
    with contextlib.suppress(OSError, EngineError):
        request("POST", f"/exec/{exec_id}/resize?h={size[0]}&w={size[1]}")


def capture(container: str, argv: list[str], *, env: dict[str, str], user: str, cwd: str = "/") -> bytes:
    """Run a short command in the container and return its stdout (the create-time probe)."""
    exec_id = create_exec(container, argv, env=env, user=user, cwd=cwd)
    output = os.memfd_create("sandboxer-probe", os.MFD_CLOEXEC)
    devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        finished = run(exec_id, stdin=devnull, output=to_fds(output, devnull), timeout=30)
        os.lseek(output, 0, os.SEEK_SET)
        data = os.read(output, 1 << 20)
    finally:
        os.close(output)
        os.close(devnull)
    if not finished or exit_code(exec_id) != 0:
        raise EngineError(f"probe {argv[0]} failed in the container")
    return data


def exit_code(exec_id: str, *, wait: float = 10.0) -> int:
    """The exit code of a finished exec (the Engine may need a moment to record it)."""
    deadline = time.monotonic() + wait
    while True:
        state = inspect_exec(exec_id)
        if not state.get("Running") or time.monotonic() > deadline:
            code = state.get("ExitCode")
            return int(code) if isinstance(code, int) else 125
        time.sleep(0.002)
