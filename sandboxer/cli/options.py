"""What every command of the CLI shares: the --json option, what the root's global options
resolved (the broker's directories, --debug) before the command runs, and — when the service
runs the command for a CLI client — the rules for that caller (sandboxer.service.access)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Annotated

import typer

from sandboxer.core.reading import CallerFile
from sandboxer.dirs import Dirs, require_state_dir
from sandboxer.invocation import current

if TYPE_CHECKING:
    from sandboxer.commands.export_space import Budget
    from sandboxer.service.access import Access

JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON document.")]

_DEBUG = "sandboxer.debug"
_STATE_CHECKED = "sandboxer.state-checked"


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
    if state and access() is None and not ctx.meta.get(_STATE_CHECKED):
        require_state_dir(dirs.state)
        ctx.meta[_STATE_CHECKED] = True
    return dirs


def debug_of(ctx: typer.Context) -> bool:
    """Whether --debug was given: show the traceback of an internal error."""
    return bool(ctx.meta.get(_DEBUG, False))


# ------------------------------------------------------------------- the caller, in the service


def access() -> Access | None:
    """The service's rules for the client this command runs for; None in-process, where the
    account's own rights are all there is."""
    return current().access


def debug_allowed() -> bool:
    """--debug's tracebacks may hold values of the broker's: in the service, owners' only."""
    rules = access()
    return rules is None or rules.owner


def require_owner(what: str) -> None:
    """An owner verb: refused to a granted caller of the service."""
    rules = access()
    if rules is not None:
        rules.require_owner(what)


# Why a service takes a lease manifest from its own account only.
MANIFEST_PATHS = "a lease manifest names host paths the broker binds into the sandbox and later removes"


def caller_path(path: str, what: str, *, why: str | None = None) -> str:
    """The path to open for a file the caller named: as given in-process; in the service only
    for a caller of the service's own account, relative to the client's working directory
    (`why`: the reason another account is refused, when it is more than the general rule)."""
    rules = access()
    if rules is None:
        return path
    rules.require_own_files(what, why=why)
    return os.path.join(current().cwd, path)


def caller_file(path: str, what: str) -> str | CallerFile:
    """A file the command reads as it is (never binds or removes): the client's own open of it
    when it made one (read with the caller's rights, whoever the caller), else caller_path's."""
    opened = current().files.get(path)
    return opened if opened is not None else caller_path(path, what)


def export_budget() -> Budget:
    """The export budget of the caller this command runs for: its grant's in a service (an
    owner's: the default, by its uid); in-process, the default for this process's account."""
    from sandboxer.commands.export_space import default_budget

    rules = access()
    return default_budget() if rules is None else rules.export_budget()


def require_own(sandbox_id: str, unknown: Exception) -> None:
    """A sandbox the caller may name: in the service, its own (another's raises `unknown`).
    The id goes into the command's audit line."""
    invocation = current()
    invocation.sandboxes.append(sandbox_id)
    if invocation.access is not None:
        invocation.access.require_own(sandbox_id, unknown)


def interrupted() -> bool:
    """In the service: whether the client passed on a signal (its Ctrl-C) or went away while the
    command ran. In-process the signal interrupts the command itself (KeyboardInterrupt)."""
    from sandboxer.host.stdio import Control

    control = current().control
    if control is None:
        return False
    client = Control(control)
    return bool(client.signals()) or client.gone


def made_sandbox(sandbox_id: str) -> None:
    """The sandbox a command made, for its audit line."""
    current().sandboxes.append(sandbox_id)
