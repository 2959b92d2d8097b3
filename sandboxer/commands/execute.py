"""Running one command in a sandbox: what `sandboxer exec` (sandboxer/cli/caller.py), the Python
API and the service share, below any parsing of a command line.

execute() takes an ExecRequest (sandboxer.core.exec_request: its options checked when it was
made), reads the sandbox's record and hands the command to its engine's exec part
(sandboxer.backends.Backends.execution), on the caller's stdio (sandboxer.execio.stdio.Stdio). Every
refusal is an ExecUsage (one line, status 125); a command that cannot start is an EntryError
(125, 126, 127). Otherwise the status is the command's own, 128+N when it died of signal N, 124
when the timeout expired (the exec's whole session is killed).

Kept free of typer, YAML and netlink imports: it runs on every exec.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from sandboxer.backends import Backends
from sandboxer.core.record_exec import ExecView, ExecViewError
from sandboxer.errors import ExecUsage
from sandboxer.execio.stdio import TIMED_OUT
from sandboxer.host import activity
from sandboxer.host.limit_events import LimitWatch, full_filesystems

if TYPE_CHECKING:
    from sandboxer.core.exec_request import ExecRequest
    from sandboxer.dirs import Dirs
    from sandboxer.execio.stdio import Stdio

BROKER_FAILED = 125  # the exec status of every broker failure


def _load(state_dir: str, sandbox_id: str) -> ExecView:
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
    request: ExecRequest,
    stdio: Stdio,
    *,
    backends: Backends,
    caller_env: Mapping[str, str],
    for_broker: bool = False,
) -> int:
    """Run `request` in its sandbox on `stdio`, on `backends`. `caller_env` is the caller's
    environment, where a provider launch's inherited names and exec -t's terminal type come from
    (the CLI's: this process's, or a CLI client's in the service; an HTTP client sends none).
    `for_broker`: the broker's own command (export's git), which an expired lease does not stop."""
    sandbox_id = request.sandbox_id
    record = _load(dirs.state, sandbox_id)
    env = record.env
    if request.env:
        if request.provider_launch:
            raise ExecUsage("exec: --env: a provider launch's environment is exactly what its lease grants")
        env = {**env, **_checked_env(record, request.env)}
    for lease_id, moment in record.expiries:
        if moment <= time.time() and not for_broker:  # the broker's own git (export) is no lease's use
            raise ExecUsage(f"exec: lease {lease_id} has expired")
    if request.consumer is not None and request.executable is not None:
        env = _provider_environment(
            dirs, sandbox_id, record, request.consumer, request.executable, caller_env=caller_env
        )
    elif request.consumer is not None:
        env["SANDBOXER_CONSUMER"] = request.consumer
    if request.tty:  # exec -t: the terminal type the caller's is, among known ones
        from sandboxer.execio.terminal import term_of

        env["TERM"] = term_of(caller_env)
    execution = backends.execution(record.backend)
    limits = LimitWatch(record, execution.limit_groups(record))
    started = time.monotonic()
    # The broker's own git (list's and work's look at the work, an export) watches the sandbox:
    # it is no use of it, and never holds off its idle timeout.
    in_use = (
        contextlib.nullcontext() if for_broker else activity.in_use(os.path.join(dirs.state, "sandboxes", sandbox_id))
    )
    with in_use:
        status = execution.run(request, record, stdio, env=env, state_dir=dirs.state, limits=limits)
    # Why it died, on the broker's lines: a limit that acted meanwhile, and the timeout (124 from
    # a command of its own, GNU timeout's, ends before the deadline and is left alone).
    why = limits.why(status)
    if status not in (0, TIMED_OUT):  # a write that failed for room may be why
        why += full_filesystems(execution.root_pid(record), workspace_sized=record.workspace_sized)
    for line in why:
        _tell(stdio, f"sandboxer: exec: {line}\n")
    timeout = request.timeout
    if status == TIMED_OUT and timeout is not None and time.monotonic() - started >= timeout:
        _tell(stdio, f"sandboxer: exec: timed out after {timeout:g} s\n")
    return status


def _checked_env(record: ExecView, exec_env: Mapping[str, str]) -> dict[str, str]:
    """The caller's variables, each a name the profile lets a caller set and the sandbox's own
    environment does not already hold."""
    for name in exec_env:
        if name not in record.caller_env:
            raise ExecUsage(
                f"exec: --env {name[:64]}: not a name this sandbox's profile lets a caller set (exec.caller_env)"
            )
        if name in record.env:
            raise ExecUsage(f"exec: --env {name}: set by the sandbox itself, not by a caller")
    return dict(exec_env)


def _tell(stdio: Stdio, line: str) -> None:
    """A line of the broker's on the exec's stderr, wherever that goes."""
    with contextlib.suppress(OSError):  # the caller's stderr is gone: the status says it all the same
        stdio.tell(line.encode())


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
