"""What a caller asks `exec` to run (`ExecRequest`), checked once when it is made.

Each front end parses its own wire format into one: the CLI's strings (`from_cli`, for
sandboxer/cli/caller.py), the Python API's keywords (`of`, for sandboxer/api/broker.py) and the HTTP
body, which the service checks for its JSON shape first (sandboxer/service/exec_route.py). The
core (sandboxer/commands/execute.py) and the engines' exec paths read its typed fields only.

Every refusal is an ExecUsage: one line, exec's status 125 (the Python API raises ExecError with
its message). Pure: no I/O, and light to import (`re` is slow to import: none here) — it is made
on every exec.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from sandboxer.errors import ExecUsage

WORKSPACE = "/workspace"  # an exec's working directory unless it names one (core.plan.WORKSPACE_TARGET)
MAX_TIMEOUT = 7 * 24 * 3600  # seconds: a week
_HEX = frozenset("0123456789abcdef")


def is_sandbox_id(value: str) -> bool:
    """Whether `value` has the shape of a sandbox id: 24 lowercase hex digits."""
    return len(value) == 24 and set(value) <= _HEX


def is_consumer(name: str) -> bool:
    """A manifest's consumer label: 1-128 printable characters without whitespace, '=' or '//'."""
    return (
        0 < len(name) <= 128
        and name.isprintable()
        and not any(c.isspace() for c in name)
        and "=" not in name
        and "//" not in name
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class ExecRequest:
    """One exec: the command `argv` in the sandbox `sandbox_id`, in `cwd`, as the manifest
    consumer `consumer` (launching its provider `executable` when both are given), killed with
    its whole session after `timeout` seconds (status 124), on a terminal of its own (`tty`),
    with the caller's variables `env` (exec --env: each a name the profile's exec.caller_env
    lists, which the core checks against the sandbox's record)."""

    sandbox_id: str
    argv: tuple[str, ...]
    cwd: str = WORKSPACE
    consumer: str | None = None
    executable: str | None = None
    timeout: float | None = None
    tty: bool = False
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        # In the order the CLI has always reported them: the command, the options, then the id.
        if not self.argv:
            raise ExecUsage("exec: no command")
        if not all(isinstance(arg, str) and "\0" not in arg for arg in self.argv):
            raise ExecUsage("exec: the command must be strings without NUL characters")
        cwd = self.cwd
        if not isinstance(cwd, str) or not cwd.startswith("/") or os.path.normpath(cwd) != cwd or "\0" in cwd:
            raise ExecUsage("exec: --cwd must be a normalized absolute path inside the sandbox")
        if self.consumer is not None and not (isinstance(self.consumer, str) and is_consumer(self.consumer)):
            raise ExecUsage("exec: --consumer must be 1-128 characters without whitespace, '=' or '//'")
        executable = self.executable
        if executable is not None and (not isinstance(executable, str) or not executable or "\0" in executable):
            raise ExecUsage("exec: --executable must be a program name or an absolute path")
        if self.timeout is not None and not 0 < self.timeout <= MAX_TIMEOUT:
            raise ExecUsage(f"exec: --timeout must be between 0 and {MAX_TIMEOUT} seconds")
        for name, value in self.env.items():  # its names: the record's to judge (commands/execute.py)
            if not isinstance(value, str) or "\0" in value:
                raise ExecUsage(f"exec: --env {name}: a value must be a string without NUL bytes")
        if not is_sandbox_id(self.sandbox_id):
            raise ExecUsage("exec: no such sandbox (ids are 24 lowercase hex digits)")

    @property
    def provider_launch(self) -> bool:
        """Whether this exec launches a consumer's provider (--consumer with --executable): its
        whole environment is then what the sandbox's lease grants."""
        return self.consumer is not None and self.executable is not None

    @property
    def values_apart(self) -> bool:
        """Whether the command's environment holds values to keep off command lines another
        process of the sandbox could read: a provider's, or a caller's (exec --env)."""
        return self.provider_launch or bool(self.env)

    @classmethod
    def of(
        cls,
        sandbox_id: str,
        argv: Sequence[str],
        *,
        cwd: str | None = None,
        consumer: str | None = None,
        executable: str | None = None,
        timeout: float | None = None,
        tty: bool = False,
        env: Mapping[str, str] | None = None,
    ) -> ExecRequest:
        """A request from typed values (the Python API's keywords, the HTTP body's fields): None
        is an option not given."""
        if timeout is not None:
            try:
                timeout = float(timeout)
            except (TypeError, ValueError):
                raise ExecUsage("exec: --timeout must be a number of seconds") from None
        return cls(
            sandbox_id=sandbox_id,
            argv=tuple(argv),
            cwd=WORKSPACE if cwd is None else cwd,
            consumer=consumer,
            executable=executable,
            timeout=timeout,
            tty=tty,
            env=MappingProxyType(dict(env or {})),
        )

    @classmethod
    def from_cli(
        cls,
        sandbox_id: str,
        argv: Sequence[str],
        *,
        cwd: str | None,
        consumer: str | None,
        executable: str | None,
        timeout: str | None,
        tty: bool,
        env: Sequence[str],
    ) -> ExecRequest:
        """A request from `sandboxer exec`'s command line: the option values as typed (a
        --timeout in seconds, each --env as NAME=VALUE)."""
        assignments = _assignments(env)
        seconds = None
        if timeout is not None:
            try:
                seconds = float(timeout)
            except ValueError:
                raise ExecUsage("exec: --timeout must be a number of seconds") from None
        return cls.of(
            sandbox_id,
            argv,
            cwd=cwd,
            consumer=consumer,
            executable=executable,
            timeout=seconds,
            tty=tty,
            env=assignments,
        )


def _assignments(pairs: Sequence[str]) -> dict[str, str]:
    """exec --env's NAME=VALUE pairs (each name once)."""
    found: dict[str, str] = {}
    for pair in pairs:
        name, equals, value = pair.partition("=")
        if not equals or not name:
            raise ExecUsage("exec: --env must be NAME=VALUE")
        if name in found:
            raise ExecUsage(f"exec: --env {name[:64]}: given twice")
        found[name] = value
    return found
