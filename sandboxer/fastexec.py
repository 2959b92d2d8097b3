"""`sandboxer exec`: the hot path, kept free of typer, YAML and netlink imports.

    sandboxer [--config-dir D] [--state-dir S] [--debug] exec ID [--cwd DIR] [--consumer NAME]
              [--executable NAME] [--timeout S] -- ARGV…

Exit status: the command's own, 128+N when it died of signal N, 124 when --timeout expired (the
exec's whole session is killed), 125 when the broker failed (unknown id, bad usage, a sandbox
that is not running), 126 not executable, 127 not found.
"""

from __future__ import annotations

import os
import sys
import time

from sandboxer.backends import enter_for
from sandboxer.core.fastjson import loads
from sandboxer.core.record_exec import ExecView, ExecViewError
from sandboxer.dirs import resolve_dirs
from sandboxer.errors import EntryError, ExecUsage

TYPE_CHECKING = False  # `typing` itself costs ~1.5 ms to import on this path; mypy knows the name
if TYPE_CHECKING:
    from sandboxer.dirs import Dirs
    from sandboxer.host.stdio import Program

BROKER_FAILED = 125
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


def _load(state_dir: str, sandbox_id: str) -> ExecView:
    if not _is_id(sandbox_id):
        raise ExecUsage("exec: no such sandbox (ids are 24 lowercase hex digits)")
    try:
        with open(os.path.join(state_dir, "sandboxes", sandbox_id, "record.json"), "rb") as stream:
            record = ExecView(loads(stream.read()))
    except FileNotFoundError:
        raise ExecUsage(f"exec: no such sandbox: {sandbox_id}") from None
    except ExecViewError as exc:
        raise ExecUsage(f"exec: sandbox {sandbox_id}: its record is out of shape at {exc}") from None
    except (OSError, ValueError):
        raise ExecUsage(f"exec: sandbox {sandbox_id}: its record cannot be read") from None
    if record.state in ("warming", "warm"):  # record.HIDDEN_STATES: nobody's sandbox yet
        raise ExecUsage(f"exec: no such sandbox: {sandbox_id}")
    if record.state != "ready":
        raise ExecUsage(f"exec: sandbox {sandbox_id} is not ready (state {record.state})")
    return record


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


def execute(dirs: Dirs, options: dict[str, str], command: list[str], program: Program | None = None) -> int:
    """Run `command` in the sandbox `options["id"]` with the exec options of the CLI (cwd,
    consumer, executable, timeout, as strings), on this process's stdio or `program`'s."""
    timeout = _validate(options)
    record = _load(dirs.state, options["id"])
    env = record.env
    for lease_id, moment in record.expiries:
        if moment <= time.time():
            raise ExecUsage(f"exec: lease {lease_id} has expired")
    if "consumer" in options and "executable" in options:
        env = _provider_environment(dirs, options["id"], record, options["consumer"], options["executable"])
    elif "consumer" in options:
        env["SANDBOXER_CONSUMER"] = options["consumer"]
    enter = enter_for(record.backend)
    return enter(record, options, command, env, timeout, program=program, state_dir=dirs.state)


def _provider_environment(
    dirs: Dirs, sandbox_id: str, view: ExecView, consumer: str, executable: str
) -> dict[str, str]:
    """A provider launch's whole environment, granted by the sandbox's manifest or refused. (Not
    the hot path: it reads the typed record, and the manifest's files.)"""
    if not view.has_manifest:
        raise ExecUsage(
            "exec: a provider launch (--consumer with --executable) needs a sandbox created with a manifest"
        )
    from sandboxer.core import leases
    from sandboxer.errors import SandboxerError
    from sandboxer.host.registry import Registry

    try:
        manifest = Registry(dirs.state).read(sandbox_id).manifest
        if manifest is None:
            raise ExecUsage("exec: the sandbox's manifest record is gone")
        return leases.provider_environment(
            manifest, consumer=consumer, executable=executable, caller_env=dict(os.environ)
        )
    except SandboxerError as exc:
        raise ExecUsage(f"exec: provider launch refused: {exc.message}") from None


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
