"""Running one command in a sandbox: what `sandboxer exec` (sandboxer/cli/caller.py), the Python
API and the service share, below any parsing of a command line.

execute() takes the exec options as strings (cwd, consumer, executable, timeout), checks them,
reads the sandbox's record and hands the command to its backend's entry. Every refusal is an
ExecUsage (one line, status 125); a command that cannot start is an EntryError (125, 126, 127).
Otherwise the status is the command's own, 128+N when it died of signal N, 124 when the timeout
expired (the exec's whole session is killed).

Kept free of typer, YAML and netlink imports: it runs on every exec.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from sandboxer.backends import enter_for, limit_groups, root_pid
from sandboxer.core.record_exec import ExecView, ExecViewError
from sandboxer.errors import ExecUsage
from sandboxer.host import activity
from sandboxer.host.limit_events import LimitWatch, full_filesystems
from sandboxer.host.stdio import TIMED_OUT, Program
from sandboxer.invocation import current

if TYPE_CHECKING:
    from sandboxer.dirs import Dirs
    from sandboxer.host.stdio import CallerStdio

BROKER_FAILED = 125  # the exec status of every broker failure
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
            record = ExecView(json.loads(stream.read()))
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


def execute(
    dirs: Dirs,
    options: dict[str, str],
    command: list[str],
    program: Program | CallerStdio | None = None,
    *,
    caller_env: Mapping[str, str] | None = None,
    exec_env: Mapping[str, str] | None = None,
    for_broker: bool = False,
) -> int:
    """Run `command` in the sandbox `options["id"]` with the exec options of the CLI (cwd,
    consumer, executable, timeout, as strings), on this process's stdio or `program`'s.
    `caller_env` is where a provider launch's inherited names come from (default: the
    invocation's environment — this process's, or a CLI client's in the service). `exec_env`:
    the variables `exec --env` sets, each a name the profile's exec.caller_env lists.
    `for_broker`: the broker's own command (export's git), which an expired lease does not stop."""
    timeout = _validate(options)
    record = _load(dirs.state, options["id"])
    env = record.env
    if exec_env:
        if "consumer" in options and "executable" in options:
            raise ExecUsage("exec: --env: a provider launch's environment is exactly what its lease grants")
        env = {**env, **_checked_env(record, exec_env)}
        options = {**options, "caller_env": "1"}  # values a backend keeps off command lines
    for lease_id, moment in record.expiries:
        if moment <= time.time() and not for_broker:  # the broker's own git (export) is no lease's use
            raise ExecUsage(f"exec: lease {lease_id} has expired")
    if "consumer" in options and "executable" in options:
        inherited = current().environ if caller_env is None else caller_env
        consumer, executable = options["consumer"], options["executable"]
        env = _provider_environment(dirs, options["id"], record, consumer, executable, caller_env=inherited)
    elif "consumer" in options:
        env["SANDBOXER_CONSUMER"] = options["consumer"]
    if options.get("tty") == "1":  # exec -t: the terminal type the caller's is, among known ones
        from sandboxer.host.terminal import term_of

        env["TERM"] = term_of(current().environ if caller_env is None else caller_env)
    enter = enter_for(record.backend)
    limits = LimitWatch(record, limit_groups(record))
    started = time.monotonic()
    with activity.in_use(os.path.join(dirs.state, "sandboxes", options["id"])):
        status = int(
            enter(record, options, command, env, timeout, program=program, state_dir=dirs.state, limits=limits)
        )
    # Why it died, on the broker's lines: a limit that acted meanwhile, and the timeout (124 from
    # a command of its own, GNU timeout's, ends before the deadline and is left alone).
    why = limits.why(status)
    if status not in (0, TIMED_OUT):  # a write that failed for room may be why
        why += full_filesystems(root_pid(record), workspace_sized=record.workspace_sized)
    for line in why:
        _tell(program, f"sandboxer: exec: {line}\n")
    if status == TIMED_OUT and timeout is not None and time.monotonic() - started >= timeout:
        _tell(program, f"sandboxer: exec: timed out after {timeout:g} s\n")
    return status


def _checked_env(record: ExecView, exec_env: Mapping[str, str]) -> dict[str, str]:
    """The caller's variables, each a name the profile lets a caller set and the sandbox's own
    environment does not already hold."""
    for name, value in exec_env.items():
        if name not in record.caller_env:
            raise ExecUsage(
                f"exec: --env {name[:64]}: not a name this sandbox's profile lets a caller set (exec.caller_env)"
            )
        if name in record.env:
            raise ExecUsage(f"exec: --env {name}: set by the sandbox itself, not by a caller")
        if not isinstance(value, str) or "\0" in value:
            raise ExecUsage(f"exec: --env {name}: a value must be a string without NUL bytes")
    return dict(exec_env)


def _tell(program: Program | CallerStdio | None, line: str) -> None:
    """A line of the broker's on the exec's stderr, wherever that goes."""
    data = line.encode()
    try:
        if isinstance(program, Program):
            program.output("stderr", data)
        else:
            os.write(2 if program is None else program.fds[2], data)
    except OSError:
        pass  # the caller's stderr is gone: the status says it all the same


def _provider_environment(
    dirs: Dirs, sandbox_id: str, view: ExecView, consumer: str, executable: str, *, caller_env: Mapping[str, str]
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
            manifest, consumer=consumer, executable=executable, caller_env=dict(caller_env)
        )
    except SandboxerError as exc:
        raise ExecUsage(f"exec: provider launch refused: {exc.message}") from None
