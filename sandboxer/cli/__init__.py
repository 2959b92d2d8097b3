"""The command line: one typer table for every command, its global options, and one handler
that turns every error into one line (or a JSON object) and its exit status.

The commands live in sandboxer.cli.caller (create, exec, teardown, export, cp, gc,
dispatch-tool, warm), sandboxer.cli.watch (list, inspect, usage, work, extend), sandboxer.cli.logs
and sandboxer.cli.owner (ext, runtime, manifest, bootstrap, serve).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Mapping
from typing import Annotated

import typer
from typer import _click as click  # typer 0.29 vendors click
from typer._click.core import Context
from typer._click.exceptions import ClickException, NoArgsIsHelpError
from typer.core import TyperGroup

from sandboxer import __version__
from sandboxer.cli import caller, logs, owner, watch
from sandboxer.cli.options import debug_allowed, dirs_of, remember
from sandboxer.dirs import Dirs, resolve_dirs
from sandboxer.errors import NotPendingError, ResidueError, SandboxerError, UsageError
from sandboxer.invocation import current
from sandboxer.output import emit_error, print_result, report_failure


class _Root(TyperGroup):
    """The root group: Ctrl-C while a command runs is reported, not a silent status 130."""

    def invoke(self, ctx: Context) -> object:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise typer.Abort() from None


app = typer.Typer(
    name="sandboxer",
    cls=_Root,
    help="A sandbox broker: owner-approved profiles, pinned runtimes, bubblewrap and Docker backends.",
    pretty_exceptions_enable=False,  # they print local variables, which may hold secrets
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(caller.app)
app.add_typer(logs.app)
app.add_typer(watch.app)
app.add_typer(owner.app)


def _print_version(value: bool) -> None:
    if value:
        sys.stdout.write(f"sandboxer {__version__}\n")
        raise typer.Exit()


@app.callback()
def main_options(
    ctx: typer.Context,
    config_dir: Annotated[
        str | None, typer.Option("--config-dir", help="Owner config directory (env SANDBOXER_CONFIG).")
    ] = None,
    state_dir: Annotated[
        str | None, typer.Option("--state-dir", help="Live state directory (env SANDBOXER_STATE).")
    ] = None,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks of internal errors.")] = False,
    version: Annotated[
        bool,
        typer.Option("--version", help="Print the version and exit.", is_eager=True, callback=_print_version),
    ] = False,
) -> None:
    """Resolve the broker's directories once for every command."""
    del version  # handled by its callback
    invocation = current()
    if invocation.caller is None or invocation.dirs is None:
        dirs = resolve_dirs(
            config_dir=config_dir,
            state_dir=state_dir,
            environ=invocation.environ,
            euid=os.geteuid(),
            home=os.path.expanduser("~"),
        )
    else:
        owner = invocation.caller.owner
        dirs = _service_dirs(invocation.dirs, config_dir, state_dir, invocation.environ, invocation.cwd, owner=owner)
    remember(ctx, dirs, debug=debug and debug_allowed())


def _service_dirs(
    served: Dirs, config_dir: str | None, state_dir: str | None, environ: Mapping[str, str], cwd: str, *, owner: bool
) -> Dirs:
    """The service's own directories; a client that names others is refused, never served from
    the wrong ones (an owner may run the command in-process instead; a caller uses the service's)."""
    for what, named, own in (
        ("config dir", config_dir or environ.get("SANDBOXER_CONFIG"), served.config),
        ("state dir", state_dir or environ.get("SANDBOXER_STATE"), served.state),
    ):
        if named and os.path.realpath(os.path.join(cwd, named)) != os.path.realpath(own):
            raise UsageError(
                f"this service answers for the {what} {own}, not {named}",
                hint="set SANDBOXER_NO_SERVICE=1 to run in-process"
                if owner
                else "name no directories: a caller uses the service's, which only its owner configures",
            )
    return served


def command_path(argv: list[str]) -> str:
    """The names of the command and subcommand `argv` runs (for the audit log: never an
    argument's value); "" when it names none."""
    group: object = _command()
    names: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in ("--config-dir", "--state-dir"):
            skip = True
            continue
        if arg.startswith("-"):
            continue
        commands = getattr(group, "commands", None)
        if not isinstance(commands, dict) or arg not in commands:
            break
        names.append(arg)
        group = commands[arg]
    return " ".join(names)


@app.command("serve")
def serve(
    ctx: typer.Context,
    socket: Annotated[
        str | None,
        typer.Option(
            "--socket", help="The Unix socket (default: STATE/broker.sock; root's: /run/sandboxer/broker.sock)."
        ),
    ] = None,
    idle_exit: Annotated[
        float | None, typer.Option("--idle-exit", help="Exit after this many seconds without a request.", min=1)
    ] = None,
    keep_exports: Annotated[
        float,
        typer.Option("--keep-exports", help="Seconds to keep what the reaper exports before a teardown.", min=0),
    ] = 7 * 24 * 3600,
) -> None:
    """Run the broker as a service for the state dir: HTTP/JSON on a Unix socket (docs/service.md)."""
    # Here, not at the top: the service (aiohttp, ~120 ms) is this command's alone, and every
    # other command of the table also runs in-process (SANDBOXER_NO_SERVICE=1, docs/performance.md).
    from sandboxer.service.cliserver import CommandTable  # noqa: PLC0415
    from sandboxer.service.serve import serve as run_service  # noqa: PLC0415

    if current().caller is not None:
        raise UsageError("serve runs in its own process, never as a service's command")
    table = CommandTable(run=main, name=command_path)
    run_service(dirs_of(ctx), socket_path=socket, idle_exit=idle_exit, commands=table, keep_exports=keep_exports)


@functools.cache
def _command() -> click.Command:
    """The click command typer builds from the table (~10 ms): built once, for every command a
    service runs. Shared by the service's threads safely: an invocation keeps its state in a
    context of its own; what click fills in lazily (the help option, a parameter's runtime form)
    is the same whoever fills it; two threads building it at once each get a whole one."""
    return typer.main.get_command(app)


def main(argv: list[str] | None = None) -> int:
    """Run one command; every error becomes one line (or a JSON object) and its exit status."""
    args = sys.argv[1:] if argv is None else argv
    head = args[: args.index("--")] if "--" in args else args
    as_json, debug = "--json" in head, "--debug" in head and debug_allowed()
    command = _command()
    try:
        status = command.main(args=args, prog_name="sandboxer", standalone_mode=False)
    except ResidueError as exc:  # the receipt (with its residue) is already the JSON document
        sys.stderr.write(f"sandboxer: {exc}\n")
        return exc.exit_status
    except NotPendingError as exc:  # the contract's retryable answer, not an error object
        sys.stderr.write(f"sandboxer: {exc}\n")
        if as_json:
            print_result({"status": "not-pending", "retryable": True}, "", True)
        return exc.exit_status
    except SandboxerError as exc:
        return report_failure(exc, as_json=as_json, debug=debug)
    except NoArgsIsHelpError as exc:
        exc.show()
        return 2
    except ClickException as exc:
        message = exc.format_message()
        emit_error(kind="usage", message=message[:1].lower() + message[1:], as_json=as_json)
        return 2
    except typer.Abort:
        emit_error(kind="interrupted", message="interrupted", as_json=as_json)
        return 130
    except Exception as exc:  # a bug: say so without dumping locals; --debug shows the traceback
        return report_failure(exc, as_json=as_json, debug=debug)
    return status if isinstance(status, int) else 0  # a typer.Exit's status (exec's, --help's)
