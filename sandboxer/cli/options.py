"""What every command of the CLI shares: the --json option, what the root's global options
resolved (the broker's directories, --debug) before the command runs, and the core API bound to
the caller the command runs for (`broker_of`): in-process this process's account, in the service
the CLI client's, as the kernel reported it. The core decides what that caller may do."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from sandboxer.api.broker import Broker
from sandboxer.api.caller import Caller, require_own_files
from sandboxer.commands.services import Services
from sandboxer.core.reading import CallerFile
from sandboxer.dirs import Dirs, require_state_dir
from sandboxer.execio.stdio import Control
from sandboxer.invocation import current

JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON document.")]
IdArgument = Annotated[str, typer.Argument(metavar="ID", help="A sandbox id (24 lowercase hex digits).")]

_DEBUG = "sandboxer.debug"
_STATE_CHECKED = "sandboxer.state-checked"
_BROKER = "sandboxer.broker"


def remember(ctx: typer.Context, dirs: Dirs, *, debug: bool) -> None:
    """Keep the root's resolved options for the command (its context shares the root's meta)."""
    ctx.obj = dirs
    ctx.meta[_DEBUG] = debug


def dirs_of(ctx: typer.Context, *, state: bool = True) -> Dirs:
    """The config and state directories the global options (or their defaults) name.

    In-process (SANDBOXER_NO_SERVICE=1, root without a service, a client whose private service
    could not start, `serve` itself) the state dir is first held to the rule of
    sandboxer.dirs.state_dir_problem — its records say what teardown and gc remove and signal —
    and refused (PolicyError, 3) when another account could have written in it. A command that
    never reads or writes the state passes `state=False` (manifest check, doctor, which reports
    the problem instead). A service's own state dir was checked when it started."""
    dirs: Dirs = ctx.find_root().obj
    if state and caller() is None and not ctx.meta.get(_STATE_CHECKED):
        require_state_dir(dirs.state)
        ctx.meta[_STATE_CHECKED] = True
    return dirs


def debug_of(ctx: typer.Context) -> bool:
    """Whether --debug was given: show the traceback of an internal error."""
    return bool(ctx.meta.get(_DEBUG, False))


# ---------------------------------------------------------------------------------- the caller


def caller() -> Caller | None:
    """The caller the service runs this command for; None in-process, where this process's own
    account (an owner) is the caller."""
    return current().caller


def services() -> Services:
    """The engines and fills the command runs on: the service's, or in-process this command's own."""
    return current().services or Services.of()


def broker_of(ctx: typer.Context) -> Broker:
    """The core API for the command's caller (created once per command)."""

    broker: Broker | None = ctx.meta.get(_BROKER)
    if broker is None:
        dirs = dirs_of(ctx)
        served = caller()
        if served is None:
            served = Caller.this_process()
        broker = Broker.serving(dirs, served, services(), environ=current().environ)
        ctx.meta[_BROKER] = broker
    return broker


def debug_allowed() -> bool:
    """--debug's tracebacks may hold values of the broker's: in the service, owners' only."""
    served = caller()
    return served is None or served.owner


def caller_path(path: str, what: str, *, why: str | None = None) -> str:
    """The path a caller named, as the broker opens it: as given in-process; in the service only
    for a caller of the service's own account (sandboxer.api.caller.require_own_files; `why`: the
    reason another account is refused, when it is more than the general rule), relative to the
    client's working directory."""
    served = caller()
    if served is None:
        return path
    require_own_files(served, what, why=why)
    return os.path.join(current().cwd, path)


def client_path(path: str) -> str:
    """A path the caller named, relative to its own working directory (the core decides whether
    the broker may open it for this caller)."""
    return path if caller() is None else os.path.join(current().cwd, path)


def caller_file(path: str, what: str) -> str | CallerFile:
    """A file the command reads as it is (never binds or removes): the client's own open of it
    when it made one (read with the caller's rights, whoever the caller), else caller_path's."""
    opened = current().files.get(path)
    return opened if opened is not None else caller_path(path, what)


def named(sandbox_id: str) -> str:
    """The sandbox a command names or made, for its audit line."""
    current().sandboxes.append(sandbox_id)
    return sandbox_id


def interrupted() -> bool:
    """In the service: whether the client passed on a signal (its Ctrl-C) or went away while the
    command ran. In-process the signal interrupts the command itself (KeyboardInterrupt)."""

    control = current().control
    if control is None:
        return False
    client = Control(control)
    return bool(client.signals()) or client.gone
