"""Every error sandboxer reports, each carrying the exit status the contract fixes.

    SandboxerError                 (1, never raised directly)
    ├── UsageError                 2  bad usage or invalid input
    │   ├── ConfigError            2  an owner YAML file breaks a rule (file:line:col: key.path: rule)
    │   ├── DocumentError          2  a manifest or bootstrap file breaks a rule (file: field: rule)
    │   └── UnexportedWorkError    2  teardown would lose work not exported (--discard loses it)
    ├── PolicyError                3  refused: unapproved, digest mismatch, forbidden setting
    │   ├── UnapprovedError        3  an owner file not approved, or changed since
    │   └── UntrustedServiceError  3  a socket another account answers on: nothing was sent
    ├── NotFoundError              4  no such sandbox
    ├── BackendError               5  bwrap or Docker failed, or the live state differs from the plan
    ├── ResidueError               6  teardown left something behind
    ├── ExecError                125  the broker could not run an exec (the Python API; the CLI prints it)
    ├── NotPendingError           75  dispatch-tool found nothing yet (retryable)
    └── Interrupted              130  the one who asked went away (Ctrl-C): what was made is removed

Messages name the file, the field and the rule. They never carry a value read from a config,
manifest, bootstrap or secret file: callers may log them anywhere.
"""

from __future__ import annotations


class SandboxerError(Exception):
    """Base of every error the CLI turns into one line and an exit status."""

    exit_status = 1
    kind = "error"

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if self.hint is None else f"{self.message} (hint: {self.hint})"

    @property
    def status(self) -> int:
        """The CLI's exit status for this error (the Python API's name for it)."""
        return self.exit_status


class UsageError(SandboxerError):
    """Bad usage or invalid input."""

    exit_status = 2
    kind = "usage"


class ConfigError(UsageError):
    """An owner configuration file breaks a rule; the message is `file:line:col: key.path: rule`."""

    kind = "config"

    def __init__(self, file: str, line: int, column: int, key_path: str, rule: str) -> None:
        location = f"{file}:{line}:{column}"
        super().__init__(f"{location}: {key_path}: {rule}" if key_path else f"{location}: {rule}")
        self.file = file
        self.line = line
        self.column = column
        self.key_path = key_path
        self.rule = rule


class DocumentError(UsageError):
    """A document from outside (a lease manifest, a bootstrap file) breaks a rule: the message is
    `file: field.path: rule`, or `file: rule` for the whole document; never a value from it."""

    def __init__(self, file: str, field: str, rule: str) -> None:
        super().__init__(f"{file}: {field}: {rule}" if field else f"{file}: {rule}")
        self.file = file
        self.field = field
        self.rule = rule


class UnexportedWorkError(UsageError):
    """teardown refused: the sandbox holds commits or changes no export has taken out (its
    message says which, `unexported` lists them); `teardown --discard` removes them anyway."""

    kind = "unexported-work"

    def __init__(self, message: str, *, hint: str | None = None, unexported: tuple[str, ...] = ()) -> None:
        super().__init__(message, hint=hint)
        # Each thing teardown would lose ("2 new commits on main (made from main)", "changes not
        # committed"), or why the work cannot be checked.
        self.unexported = unexported


class PolicyError(SandboxerError):
    """Refused by policy: unapproved, digest mismatch, forbidden setting, expired lease."""

    exit_status = 3
    kind = "policy"


class UnapprovedError(PolicyError):
    """A profile or extension config that is not approved, or changed since it was: the hint is
    the owner's command; a caller of the service is told to ask the owner instead
    (sandboxer.api.caller)."""


class UntrustedServiceError(PolicyError):
    """sandboxer.Client refused a socket: the kernel says a process of neither root nor this
    account answers on it, so nothing was sent (sandboxer.dirs.check_peer)."""


class ForbiddenSettingError(PolicyError):
    """A well-formed configuration asks for something its extension refuses."""

    kind = "forbidden-setting"

    def __init__(self, file: str, line: int, column: int, key_path: str, rule: str) -> None:
        super().__init__(f"{file}:{line}:{column}: {key_path}: {rule}")
        self.file = file
        self.key_path = key_path
        self.rule = rule


class NotFoundError(SandboxerError):
    """No such sandbox."""

    exit_status = 4
    kind = "not-found"


class BackendError(SandboxerError):
    """The backend failed, or the live sandbox differs from its plan."""

    exit_status = 5
    kind = "backend"


class ResidueError(SandboxerError):
    """Teardown left residue; the Python API attaches the teardown's receipt."""

    exit_status = 6
    kind = "residue"
    receipt: object = None


class ExecError(SandboxerError):
    """The broker could not run an exec (unknown or stopped sandbox, bad options, the Engine
    failing): the CLI's exec status 125, raised by the Python API."""

    exit_status = 125
    kind = "exec"


class NotPendingError(SandboxerError):
    """dispatch-tool found no pending request yet; the caller may retry."""

    exit_status = 75
    kind = "not-pending"


class Interrupted(SandboxerError):
    """The one who asked went away (Ctrl-C at a client, a closed connection) while it was being
    done; whatever was made for it is removed."""

    exit_status = 130
    kind = "interrupted"


class EntryError(Exception):
    """Starting an exec's command failed; `status` is the exit status to report (125, 126, 127)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class ExecUsage(Exception):
    """An exec the broker refuses or cannot run, as the exec path reports it: one line, status 125
    (the CLI prints it; the Python API raises ExecError with its message)."""


def not_running(sandbox_id: str, state: str = "ready") -> str:
    """Why a sandbox cannot answer, in the same words for every verb: a create or teardown under
    way (its state), or a ready sandbox whose processes are gone, which its caller tears down
    (gc is the owners')."""
    if state != "ready":
        return f"sandbox {sandbox_id} is not running (state {state})"
    return f"sandbox {sandbox_id} is not running: its processes are gone (sandboxer teardown {sandbox_id} removes it)"
