"""The command line: global options, one handler for every error, commands that print results."""

from __future__ import annotations

import os
import sys
import traceback
from typing import Annotated, Any

import typer
from typer._click.exceptions import ClickException, NoArgsIsHelpError  # typer 0.29 vendors click

from sandboxer.dirs import Dirs, resolve_dirs
from sandboxer.errors import SandboxerError
from sandboxer.output import emit_error, emit_json

app = typer.Typer(
    name="sandboxer",
    help="A sandbox broker: owner-approved profiles, pinned runtimes, bubblewrap and Docker backends.",
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


def _print(document: dict[str, Any], human: str, as_json: bool) -> None:
    if as_json:
        emit_json(document)
    elif human:
        sys.stdout.write(human if human.endswith("\n") else human + "\n")


@ext_app.command("check")
def ext_check(
    file: Annotated[str, typer.Argument(help="An extension config or profile YAML file.")], json: JsonOption = False
) -> None:
    """Validate an extension config or profile and print what it means."""
    from sandboxer.commands import owner

    result = owner.check(file)
    lines = [f"{file}: valid {result['kind']} (sha256 {result['sha256']})"]
    shown = {key: value for key, value in result.items() if key not in ("file", "sha256", "valid", "kind")}
    lines += [f"  {key}: {value}" for key, value in _flatten(shown)]
    _print(result, "\n".join(lines), json)


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


@app.command("create")
def create_command(
    ctx: typer.Context,
    profile: Annotated[str, typer.Option("--profile", help="An approved profile name.")],
    manifest: Annotated[str | None, typer.Option("--manifest", help="A lease manifest (not yet supported).")] = None,
    bootstrap: Annotated[
        str | None, typer.Option("--bootstrap", help="A runtime bootstrap (not yet supported).")
    ] = None,
    json: JsonOption = False,
) -> None:
    """Create a sandbox from an approved profile and print its id."""
    from sandboxer.commands import sandbox
    from sandboxer.errors import UsageError

    if manifest is not None or bootstrap is not None:
        raise UsageError("--manifest and --bootstrap are not supported yet")
    result = sandbox.create(_dirs(ctx), profile)
    _print(result, result["id"], json)


@app.command(
    "exec",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def exec_command(ctx: typer.Context) -> None:
    """Run ARGV in a sandbox: exec ID [--cwd DIR] [--consumer NAME] [--executable NAME] [--timeout S] -- ARGV..."""
    del ctx  # `exec` is served by sandboxer.fastexec before this CLI is even imported


@app.command("inspect")
def inspect_command(
    ctx: typer.Context, sandbox_id: Annotated[str, typer.Argument(metavar="ID")], json: JsonOption = False
) -> None:
    """Evidence observed from a live sandbox, compared with its plan."""
    from sandboxer.commands import sandbox

    result = sandbox.inspect(_dirs(ctx), sandbox_id)
    human = [f"{key}: {value}" for key, value in _flatten(result)]
    _print(result, "\n".join(human), json)


@app.command("list")
def list_command(ctx: typer.Context, json: JsonOption = False) -> None:
    """List the sandboxes of this state dir."""
    from sandboxer.commands import sandbox

    result = sandbox.list_sandboxes(_dirs(ctx))
    rows = [("ID", "PROFILE", "BACKEND", "STATUS", "CREATED")]
    rows += [
        (e["id"], str(e["profile"]), str(e["backend"]), e["status"], str(e["created_at"])) for e in result["sandboxes"]
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    human = "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)
    _print(result, human if result["sandboxes"] else "no sandboxes", json)


@app.command("teardown")
def teardown_command(
    ctx: typer.Context, sandbox_id: Annotated[str, typer.Argument(metavar="ID")], json: JsonOption = False
) -> None:
    """Remove everything a sandbox owns and print the receipt (exit 6 if anything is left)."""
    from sandboxer.commands import sandbox

    receipt = sandbox.teardown(_dirs(ctx), sandbox_id)
    lines = [f"removed {item}" for item in receipt["removed"]] + [f"RESIDUE {item}" for item in receipt["residue"]]
    _print(receipt, "\n".join(lines) or f"{sandbox_id}: nothing to remove", json)
    sandbox.receipt_or_raise(receipt)


@app.command("gc")
def gc_command(ctx: typer.Context, json: JsonOption = False) -> None:
    """Tear down sandboxes whose creating or tearing-down broker died; leave healthy ones alone."""
    from sandboxer.commands import sandbox

    result = sandbox.gc(_dirs(ctx))
    lines = [f"collected {r['id']}" + (" (RESIDUE)" if r["residue"] else "") for r in result["collected"]]
    _print(result, "\n".join(lines) or "nothing to collect", json)
    for receipt in result["collected"]:
        sandbox.receipt_or_raise(receipt)


def _flatten(value: Any, prefix: str = "") -> list[tuple[str, str]]:
    if isinstance(value, dict):
        pairs: list[tuple[str, str]] = []
        for key, item in value.items():
            pairs += _flatten(item, f"{prefix}.{key}" if prefix else str(key))
        return pairs
    if isinstance(value, list):
        return [(prefix, "[" + ", ".join(str(v) for v in value) + "]")]
    return [(prefix, str(value).lower() if isinstance(value, bool) else str(value))]


def _wants_json(argv: list[str]) -> bool:
    head = argv[: argv.index("--")] if "--" in argv else argv
    return "--json" in head


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; every error becomes one line (or a JSON object) and its exit status."""
    args = sys.argv[1:] if argv is None else argv
    head = args[: args.index("--")] if "--" in args else args
    as_json = _wants_json(args)
    command = typer.main.get_command(app)
    try:
        command.main(args=args, prog_name="sandboxer", standalone_mode=False)
    except SandboxerError as exc:
        if "--debug" in head:
            traceback.print_exc()
        emit_error(kind=exc.kind, message=str(exc), as_json=as_json)
        return exc.exit_status
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
        if "--debug" in head:
            traceback.print_exc()
        emit_error(
            kind="internal", message=f"internal error ({type(exc).__name__}); rerun with --debug", as_json=as_json
        )
        return 1
    return 0
