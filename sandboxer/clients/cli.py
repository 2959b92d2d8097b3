"""The `sandboxer` command: a small client of the service that answers for the state dir.

It forwards its argv, working directory and environment, with its stdin, stdout and stderr
themselves (SCM_RIGHTS), to the service's socket; the service runs the command table for it,
printing on those descriptors, and answers the exit status, which this process exits with. A
signal this process gets (SIGINT, SIGTERM, SIGHUP) is passed on for an exec's command; if this
process dies, the service kills the exec. Protocol: sandboxer/service/cliserver.py.

Where the command runs:
- `SANDBOXER_NO_SERVICE=1`, `serve` itself, the file checks, help and the version: in this
  process (sandboxer.cli).
- `cp`: in this process too, which reaches the service as a program does (sandboxer.Client)
  and reads or writes the local files with the caller's own rights; `doctor` (this host, for
  this account).
- A service answers on `SANDBOXER_SOCKET`, else on the state dir's `broker.sock`: there.
- An account other than root with no broker of its own (no SANDBOXER_SOCKET, SANDBOXER_CONFIG,
  SANDBOXER_STATE, --config-dir, --state-dir, and no config dir at its default place) is a
  caller of the system service: root's on /run/sandboxer/broker.sock when it answers; when
  neither that nor a service of its own state dir answers, it is told to ask the owner (125).
- None answers: the client starts the service for its state dir (`serve --idle-exit`, in a
  session of its own, logging to `<state>/service.log`) and uses it — an unprivileged user's
  private service, or root's (for /var/lib/sandboxer, the system service on
  /run/sandboxer/broker.sock), so root pays what a caller pays.

Standard library only, and few modules of it (tests/unit/test_cli_client_imports.py): every
command of every caller pays for what this module imports.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import stat
import sys
from collections.abc import Iterator

from sandboxer.dirs import (
    ROOT_SOCKET,
    Untrusted,
    connect,
    no_service,
    own_configuration,
    resolve_dirs,
    service_socket,
)
from sandboxer.execio.pumps import Pumps

IDLE_EXIT = 600  # seconds a private service waits for its next command before it exits
START_SECONDS = 15.0  # how long a private service may take to answer
SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")
SERVICE_FAILED = 125  # the service went away before it answered a status
MAX_FILES = 4  # files one command line may name for this process to open (the service's limit)
# Commands that never go to a service: serve itself, and the checks of a file the caller names,
# which read it with the caller's own rights (and need nothing of the broker's).
FILE_CHECKS = {("ext", "check"), ("manifest", "check"), ("bootstrap", "check")}
# Commands that run in this process: cp reaches the service as a program does (sandboxer.Client)
# and reads and writes the caller's local files with the caller's own rights; doctor checks the
# host for this account.
OWN_PROCESS = {"cp", "doctor"}
# Files a command reads or writes that this process opens itself, with the caller's own rights,
# and passes to the service (which opens no path on another account's say-so): a file to read,
# a new file to write, a directory to write new files in (made when missing).
READ, NEW_FILE, NEW_FILES_IN = "read", "new-file", "new-files-in"
CALLER_FILES = {
    "create": {"--bootstrap": READ},
    "export": {"--bundle": NEW_FILE, "--tar": NEW_FILE, "--patch": NEW_FILES_IN},
}
# The same for a file a command names by position: (its command words, which of its arguments
# — options, all flags, not counted — and for what). `exports get ID FILE`.
CALLER_ARGUMENTS: dict[tuple[str, ...], tuple[int, str]] = {("exports", "get"): (1, NEW_FILE)}


def main() -> None:
    """The console script: run the command line and exit with its status."""
    sys.exit(run(sys.argv[1:]))


def run(argv: list[str]) -> int:
    """Run one command line where it belongs (see the module's docstring)."""
    environ = os.environ
    words = _words(argv)
    if (
        environ.get("SANDBOXER_NO_SERVICE") == "1"
        or words[:1] in (("serve",), *((name,) for name in OWN_PROCESS))
        or words[:2] in FILE_CHECKS
        or _help_or_version(words)
    ):
        return _in_process(argv)
    config_dir, state_dir = _global_dirs(argv)
    euid, home = os.geteuid(), os.path.expanduser("~")
    dirs = resolve_dirs(config_dir=config_dir, state_dir=state_dir, environ=environ, euid=euid, home=home)
    path = service_socket(dirs, environ)
    # An account with no broker of its own is a caller of the system service, when root's answers.
    caller = euid != 0 and not own_configuration(config_dir=config_dir, state_dir=state_dir, environ=environ, home=home)
    try:
        conn = connect(ROOT_SOCKET, root_only=True) if caller else None
        if conn is None:
            conn = connect(path)
    except Untrusted as exc:
        sys.stderr.write(f"sandboxer: {exc}; refused\n")
        return SERVICE_FAILED
    if conn is None:
        if environ.get("SANDBOXER_SOCKET"):
            sys.stderr.write(
                f"sandboxer: no service answers on {path} (SANDBOXER_SOCKET): ask its owner whether it runs, "
                "or unset SANDBOXER_SOCKET to use your default service\n"
            )
            return SERVICE_FAILED
        if caller:
            sys.stderr.write(f"sandboxer: {no_service(dirs.config)}\n")
            return SERVICE_FAILED
        conn = _start_service(dirs.config, dirs.state, path)
        if conn is None:
            return _in_process(argv)  # it could not start: the same command, only slower
    return _forward(conn, argv, words)


def _in_process(argv: list[str]) -> int:
    from sandboxer.cli import main as run_cli

    return run_cli(argv)


def _words(argv: list[str]) -> tuple[str, ...]:
    """The command line after the global options (which take a value unless written NAME=VALUE)."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--config-dir", "--state-dir"):
            i += 2
        elif arg.startswith(("--config-dir=", "--state-dir=")) or arg == "--debug":
            i += 1
        else:
            return tuple(argv[i:])
    return ()


def _help_or_version(words: tuple[str, ...]) -> bool:
    """Whether the command line asks for help or the version (no command; `--help` before any
    `--`): the parser answers it, and nothing of the broker is needed, so no service is asked or
    started for it."""
    before = words[: words.index("--")] if "--" in words else words
    return not words or words[0].startswith("-") or "--help" in before


def _global_dirs(argv: list[str]) -> tuple[str | None, str | None]:
    """--config-dir and --state-dir when given before the command."""
    found: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--config-dir", "--state-dir") and i + 1 < len(argv):
            found[arg] = argv[i + 1]
            i += 2
        elif arg.startswith(("--config-dir=", "--state-dir=")):
            name, _, value = arg.partition("=")
            found[name] = value
            i += 1
        elif arg == "--debug":
            i += 1
        else:
            break
    return found.get("--config-dir"), found.get("--state-dir")


def _start_service(config: str, state: str, path: str) -> socket.socket | None:
    """Start this account's service for its state dir (root's too: the system service when the
    state dir is root's default) and connect to it (None: it did not answer)."""
    import subprocess
    import time

    try:
        with contextlib.suppress(FileExistsError):
            os.makedirs(state, mode=0o700)
            if os.geteuid() == 0:  # as the registry makes root's: the sandboxes' uid passes through
                os.chmod(state, 0o711)  # noqa: S103 - passable, not listable (Registry.ensure)
        seen = os.lstat(state)
        if not stat.S_ISDIR(seen.st_mode) or seen.st_uid != os.geteuid() or seen.st_mode & 0o022:
            return None  # not this account's own directory: the command runs in-process, which says why
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW
        log = os.open(os.path.join(state, "service.log"), flags, 0o600)
    except OSError:
        return None
    try:
        argv = [sys.executable, "-m", "sandboxer", "--config-dir", config, "--state-dir", state]
        argv += ["serve", "--socket", path, "--idle-exit", str(IDLE_EXIT)]
        service = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, cwd="/"
        )
    except OSError:
        return None
    finally:
        os.close(log)
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        conn = connect(path)
        if conn is not None:
            return conn
        if service.poll() not in (None, 0, 3):  # 3: another client's service won the state dir
            return None
        time.sleep(0.01)
    return None


def _forward(conn: socket.socket, argv: list[str], words: tuple[str, ...]) -> int:
    """Send the command line with this process's stdio (its terminal and files behind pipes:
    Pumps.for_client) and the files it names; pass signals on; copy until the status comes;
    return it."""
    import signal

    files, opened, made = _open_files(words)
    pumps = Pumps.for_client()
    request: dict[str, object] = {"argv": argv, "cwd": _cwd(), "env": dict(os.environ), "files": files}
    terminal = _wants_terminal(words)
    if terminal:
        from sandboxer.execio.terminal import caller_size

        request["window"] = caller_size((0, 1, 2))
    header = json.dumps(request).encode()
    try:
        socket.send_fds(conn, [b"\0" + header + b"\n"], [*pumps.given, *opened])
    except OSError as exc:
        sys.stderr.write(f"sandboxer: the service did not take the command ({exc.strerror})\n")
        pumps.given_away()
        pumps.close()
        _remove_made(made)
        return SERVICE_FAILED
    finally:
        for fd in opened:
            os.close(fd)
    pumps.given_away()

    def pass_on(signum: int, _frame: object) -> None:
        with contextlib.suppress(OSError):
            conn.send(bytes([signum]))

    for name in SIGNALS:
        signal.signal(getattr(signal, name), pass_on)
    try:
        with _terminal_passed_on(conn) if terminal else contextlib.nullcontext():
            answer = _copy_until_answer(conn, pumps)
        pumps.finish()  # what the command wrote before it ended
    finally:
        pumps.close()
    if not answer.endswith(b"\n"):
        sys.stderr.write("sandboxer: the service went away before the command ended\n")
        _remove_made(made)
        return SERVICE_FAILED
    status = json.loads(answer)["status"]
    if status != 0:
        _remove_made(made)  # what it made for the command to write in: the command failed
    return status if isinstance(status, int) else SERVICE_FAILED


def _wants_terminal(words: tuple[str, ...]) -> bool:
    """Whether the command line is an `exec -t` (its options come before `--`)."""
    if words[:1] != ("exec",):
        return False
    options = words[1 : words.index("--")] if "--" in words else words[1:]
    return "-t" in options or "--tty" in options


@contextlib.contextmanager
def _terminal_passed_on(conn: socket.socket) -> Iterator[None]:
    """exec -t: this process's terminal in raw mode while the command runs (its keys, Ctrl-C
    included, go to the command's own terminal), and each change of its window size sent to the
    service (sandboxer.execio.terminal)."""
    import signal

    from sandboxer.execio.terminal import caller_size, raw, winch_message

    def resized(_signum: int, _frame: object) -> None:
        size = caller_size((0, 1, 2))
        if size is not None:
            with contextlib.suppress(OSError):
                conn.send(winch_message(size))

    previous = signal.signal(signal.SIGWINCH, resized)
    try:
        with raw(0):
            yield
    finally:
        signal.signal(signal.SIGWINCH, previous)


def _copy_until_answer(conn: socket.socket, pumps: Pumps) -> bytes:
    """Copy between this process's stdio and the pipes until the service's answer line (b"" or
    part of it if the service went away)."""
    import select

    answer = b""
    while not answer.endswith(b"\n"):
        try:
            readable, writable, _ = select.select([conn.fileno(), *pumps.readers()], pumps.writers(), [])
        except InterruptedError:
            continue
        pumps.pump(readable, writable)
        if conn.fileno() in readable:
            try:
                data = conn.recv(4096)
            except InterruptedError:
                continue
            except OSError:
                data = b""
            if not data:
                return answer
            answer += data
    return answer


def _open_files(words: tuple[str, ...]) -> tuple[list[dict[str, object]], list[int], list[tuple[str, os.stat_result]]]:
    """Open the files the command line names for the service (CALLER_FILES) as this process
    may: not following a symlink, not blocking on a FIFO. Each is listed by the name the command
    line gives it, with its absolute path and the errno of a failed open (0: its descriptor is
    passed). Also returned: what this process made for the command to write in (removed again
    when the command fails)."""
    options = CALLER_FILES.get(words[0], {}) if words else {}
    files: list[dict[str, object]] = []
    opened: list[int] = []
    made: list[tuple[str, os.stat_result]] = []
    i = 1
    while i < len(words) and words[i] != "--" and len(files) < MAX_FILES:
        name, is_option, value = words[i].partition("=")
        if name in options and not is_option and i + 1 < len(words):
            value, i = words[i + 1], i + 1
        i += 1
        if name not in options or not value:
            continue
        error = 0
        try:
            fd = _open_for(options[name], value, made)
            opened.append(fd)
        except OSError as exc:
            error = exc.errno or errno.EIO
        files.append({"name": value, "path": os.path.normpath(os.path.join(_cwd(), value)), "errno": error})
    positional = CALLER_ARGUMENTS.get(words[:2])
    if positional is not None:
        arguments = [word for word in words[2:] if not word.startswith("-")]
        index, use = positional
        if index < len(arguments) and arguments[index]:
            value, error = arguments[index], 0
            try:
                opened.append(_open_for(use, value, made))
            except OSError as exc:
                error = exc.errno or errno.EIO
            files.append({"name": value, "path": os.path.normpath(os.path.join(_cwd(), value)), "errno": error})
    return files, opened, made


def _open_for(use: str, path: str, made: list[tuple[str, os.stat_result]]) -> int:
    """A descriptor of `path` for `use` (READ, NEW_FILE, NEW_FILES_IN), opened as this process may."""
    if use == READ:
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    if use == NEW_FILE:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC
        fd = os.open(path, flags, 0o666)
        made.append((path, os.fstat(fd)))
        return fd
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o777)
        made.append((path, os.lstat(path)))
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def _remove_made(made: list[tuple[str, os.stat_result]]) -> None:
    """Remove what this process made for a command that failed (each only while it is still the
    file or directory made: never another one put in its place)."""
    for path, seen in made:
        with contextlib.suppress(OSError):
            now = os.lstat(path)
            if (now.st_dev, now.st_ino) == (seen.st_dev, seen.st_ino):
                (os.rmdir if stat.S_ISDIR(now.st_mode) else os.unlink)(path)


def _cwd() -> str:
    try:
        return os.getcwd()
    except OSError:
        return "/"  # a removed working directory: relative paths resolve against the root
