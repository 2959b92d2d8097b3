"""The command line: global options, one handler for every error, commands that print results."""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer
from typer._click.exceptions import ClickException, NoArgsIsHelpError  # typer 0.29 vendors click

from sandboxer.dirs import Dirs, resolve_dirs
from sandboxer.errors import SandboxerError
from sandboxer.output import emit_error, flatten, report_failure
from sandboxer.output import print_result as _print

app = typer.Typer(
    name="sandboxer",
    help="A sandbox broker: owner-approved profiles, pinned runtimes, bubblewrap and Docker backends.",
    epilog=(
        "Caller commands (each has --help): create --profile NAME, exec ID -- ARGV..., inspect ID --json, "
        "list, teardown ID, gc."
    ),
    pretty_exceptions_enable=False,  # they print local variables, which may hold secrets
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
)
ext_app = typer.Typer(
    help="Owner: check, approve, revoke and list extension configs and profiles.", no_args_is_help=True
)
runtime_app = typer.Typer(help="Owner: the runtime pin.", no_args_is_help=True)
app.add_typer(ext_app, name="ext")
app.add_typer(runtime_app, name="runtime")
manifest_app = typer.Typer(help="Lease manifests (docs/manifest.md).", no_args_is_help=True)
app.add_typer(manifest_app, name="manifest")
bootstrap_app = typer.Typer(help="Runtime bootstrap files (docs/bootstrap.md).", no_args_is_help=True)
app.add_typer(bootstrap_app, name="bootstrap")

JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON document.")]


def _dirs(ctx: typer.Context) -> Dirs:
    obj: Dirs = ctx.find_root().obj
    return obj


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
) -> None:
    """Resolve the broker's directories once for every command."""
    del debug  # read by main() before the command runs
    ctx.obj = resolve_dirs(
        config_dir=config_dir,
        state_dir=state_dir,
        environ=os.environ,
        euid=os.geteuid(),
        home=os.path.expanduser("~"),
    )


@ext_app.command("check")
def ext_check(
    file: Annotated[str, typer.Argument(help="An extension config or profile YAML file.")], json: JsonOption = False
) -> None:
    """Validate an extension config or profile and print what it means."""
    from sandboxer.commands import owner

    result = owner.check(file)
    lines = [f"{file}: valid {result['kind']} (sha256 {result['sha256']})"]
    shown = {key: value for key, value in result.items() if key not in ("file", "sha256", "valid", "kind")}
    lines += [f"  {key}: {value}" for key, value in flatten(shown)]
    _print(result, "\n".join(lines), json)


@manifest_app.command("check")
def manifest_check(
    ctx: typer.Context,
    file: Annotated[str, typer.Argument(help="A lease manifest (the assignment file in its run directory).")],
    json: JsonOption = False,
) -> None:
    """Validate a lease manifest and its sources; print what it grants (never a value)."""
    from sandboxer.core import manifest

    dirs = _dirs(ctx)
    checked = manifest.load(os.path.abspath(file), forbidden=(dirs.config, dirs.state))
    result = {"valid": True, **manifest.meaning(checked)}
    lines = [f"{checked.file}: valid lease manifest, version {checked.version}, run {checked.run_id}"]
    lines += [
        f"  {lease['lease_id']}: {lease['scope']} for {lease['consumer']}"
        + (f", expires {lease['expires_at']}" if lease["expires_at"] else "")
        for lease in result["leases"]
    ]
    _print(result, "\n".join(lines), json)


@bootstrap_app.command("check")
def bootstrap_check(
    file: Annotated[str, typer.Argument(help="A runtime bootstrap file (one JSON object, owner-only).")],
    json: JsonOption = False,
) -> None:
    """Validate a runtime bootstrap file; print its fields but never the credential."""
    from sandboxer.core import bootstrap

    document, _ = bootstrap.load(file)
    result = {"valid": True, "file": os.path.abspath(file), **document.meaning()}
    human = [f"{result['file']}: valid runtime bootstrap, version {document.version}"]
    human += [f"  {key}: {value}" for key, value in document.meaning().items() if key != "version"]
    _print(result, "\n".join(human), json)


@ext_app.command("approve")
def ext_approve(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="ext.bwrap, ext.docker or a profile name.")],
    json: JsonOption = False,
) -> None:
    """Approve the exact current bytes of an extension config or profile."""
    from sandboxer.commands import owner

    result = owner.approve(_dirs(ctx), name)
    _print(result, f"approved {name} (sha256 {result['sha256']})", json)


@ext_app.command("revoke")
def ext_revoke(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="ext.bwrap, ext.docker or a profile name.")],
    json: JsonOption = False,
) -> None:
    """Withdraw an approval."""
    from sandboxer.commands import owner

    result = owner.revoke(_dirs(ctx), name)
    _print(result, f"revoked {name}" if result["revoked"] else f"{name} was not approved", json)


@ext_app.command("list")
def ext_list(ctx: typer.Context, json: JsonOption = False) -> None:
    """List every extension config and profile with its approval status."""
    from sandboxer.commands import owner

    result = owner.list_entries(_dirs(ctx))
    rows = [("NAME", "KIND", "STATUS", "VALID")]
    rows += [(e["name"], e["kind"], e["status"], "yes" if e["valid"] else "no") for e in result["entries"]]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    human = "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)
    if not result["entries"]:
        human = f"no extension configs or profiles in {result['config_dir']}"
    _print(result, human, json)


@runtime_app.command("digest")
def runtime_digest(
    ctx: typer.Context,
    path: Annotated[str, typer.Argument(help="The runtime directory (canonical absolute path).")],
    full: Annotated[bool, typer.Option("--full", help="Re-read every file; ignore the stat cache.")] = False,
    json: JsonOption = False,
) -> None:
    """Print the tree digest v1 of a runtime directory."""
    from sandboxer.commands import owner

    result = owner.runtime_digest(_dirs(ctx), path, full=full)
    _print(result, result["sha256"], json)


@app.command("serve")
def serve(
    ctx: typer.Context,
    socket: Annotated[
        str | None,
        typer.Option(
            "--socket", help="The Unix socket (default: /run/sandboxer/broker.sock as root, else STATE/broker.sock)."
        ),
    ] = None,
    idle_exit: Annotated[
        float | None, typer.Option("--idle-exit", help="Exit after this many seconds without a request.", min=1)
    ] = None,
) -> None:
    """Run the broker as a service for the state dir: HTTP/JSON on a Unix socket (docs/service.md)."""
    from sandboxer.service.serve import serve as run_service

    run_service(_dirs(ctx), socket_path=socket, idle_exit=idle_exit)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; every error becomes one line (or a JSON object) and its exit status."""
    args = sys.argv[1:] if argv is None else argv
    head = args[: args.index("--")] if "--" in args else args
    as_json = "--json" in head
    command = typer.main.get_command(app)
    try:
        command.main(args=args, prog_name="sandboxer", standalone_mode=False)
    except SandboxerError as exc:
        return report_failure(exc, as_json=as_json, debug="--debug" in head)
    except NoArgsIsHelpError as exc:
        exc.show()
        return 2
    except ClickException as exc:
        message = exc.format_message()
        emit_error(kind="usage", message=message[:1].lower() + message[1:], as_json=as_json)
        return 2
    except typer.Exit as exc:
        return int(exc.exit_code)
    except typer.Abort:
        emit_error(kind="interrupted", message="interrupted", as_json=as_json)
        return 130
    except Exception as exc:  # a bug: say so without dumping locals; --debug shows the traceback
        return report_failure(exc, as_json=as_json, debug="--debug" in head)
    return 0
