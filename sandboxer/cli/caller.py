"""The caller's commands: create, exec, inspect, list, teardown, export, exports (what the
reaper kept), cp, gc, dispatch-tool (and the owner's warm, which fills what create takes from).

Each command imports only its own module when it runs. `exec` keeps its own contract: the
command after `--` is taken verbatim, and every broker failure — bad usage included — is one
line on stderr and status 125 (sandboxer.commands.execute).
"""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer
from typer._click.core import Context
from typer._click.exceptions import BadOptionUsage, NoSuchOption
from typer._click.exceptions import UsageError as ClickUsageError
from typer.core import TyperCommand

from sandboxer.cli.files import deliver, deliver_kept, sandbox_of, sandbox_path
from sandboxer.cli.options import (
    MANIFEST_PATHS,
    JsonOption,
    access,
    caller_file,
    caller_path,
    debug_of,
    dirs_of,
    export_budget,
    interrupted,
    made_sandbox,
    require_own,
    require_owner,
)
from sandboxer.errors import EntryError, ExecUsage, NotFoundError, UsageError
from sandboxer.invocation import current
from sandboxer.output import flatten, print_result

app = typer.Typer()
exports_app = typer.Typer(
    help="The work the service kept of your expired sandboxes: list (no command), get, rm.",
    invoke_without_command=True,
)
app.add_typer(exports_app, name="exports")

IdArgument = Annotated[str, typer.Argument(metavar="ID", help="A sandbox id (24 lowercase hex digits).")]


@app.command("create")
def create(
    ctx: typer.Context,
    *,
    profile: Annotated[str, typer.Option("--profile", help="An approved profile name.")],
    manifest: Annotated[str | None, typer.Option("--manifest", help="A lease manifest (docs/manifest.md).")] = None,
    bootstrap: Annotated[
        str | None, typer.Option("--bootstrap", help="A runtime bootstrap file (docs/bootstrap.md).")
    ] = None,
    ttl: Annotated[
        float | None, typer.Option("--ttl", help="Seconds until a running service tears it down (docs/service.md).")
    ] = None,
    ref: Annotated[
        str | None, typer.Option("--ref", help="Check out this ref instead of the profile's (workspace.refs).")
    ] = None,
    branch: Annotated[str | None, typer.Option("--branch", help="On a new branch of this name.")] = None,
    json: JsonOption = False,
) -> None:
    """Create a sandbox from an approved profile and print its id."""
    from sandboxer.commands.create import create as create_sandbox

    dirs = dirs_of(ctx)
    manifest = None if manifest is None else caller_path(manifest, "--manifest", why=MANIFEST_PATHS)
    source = None if bootstrap is None else caller_file(bootstrap, "--bootstrap")

    def make(caller_uid: int | None, lifetime: float | None) -> dict[str, Any]:
        return create_sandbox(
            dirs,
            profile,
            manifest_path=manifest,
            bootstrap=source,
            ttl=lifetime,
            caller_uid=caller_uid,
            ref=ref,
            branch=branch,
        )

    rules = access()
    result = make(None, ttl) if rules is None else rules.create(profile, ttl, make)
    made_sandbox(result["id"])
    if interrupted():  # Ctrl-C at a client of the service: as in-process, no sandbox is left
        from sandboxer.commands.teardown import teardown

        teardown(dirs, result["id"])
        raise typer.Abort
    print_result(result, result["id"], json)


_COMMAND = "sandboxer.exec.command"  # where exec's parser leaves the command for exec_()


class _ExecCommand(TyperCommand):
    """exec's command line: the ID and options before `--`, the command verbatim after it; a
    usage error is one line and status 125, like every other broker failure of exec."""

    def collect_usage_pieces(self, ctx: Context) -> list[str]:
        return [*super().collect_usage_pieces(ctx), "-- ARGV..."]

    def parse_args(self, ctx: Context, args: list[str]) -> list[str]:
        head = args[: args.index("--")] if "--" in args else args
        if "--help" in head:
            return super().parse_args(ctx, head)
        try:
            return self._parse(ctx, args, head)
        except ExecUsage as exc:
            raise typer.Exit(_exec_failure(exc, debug=False)) from None

    def _parse(self, ctx: Context, args: list[str], head: list[str]) -> list[str]:
        if "--" not in args:
            raise ExecUsage("exec: put -- before the command: sandboxer exec ID [OPTIONS] -- ARGV...")
        command = args[len(head) + 1 :]
        if not command:
            raise ExecUsage("exec: no command after --")
        ctx.meta[_COMMAND] = command
        try:
            return super().parse_args(ctx, head)
        except NoSuchOption as exc:
            raise ExecUsage(f"exec: no such option: {exc.option_name}") from None
        except BadOptionUsage as exc:
            raise ExecUsage(f"exec: {exc.option_name} needs a value") from None
        except ClickUsageError:  # a missing ID, or more than one
            raise ExecUsage("exec: exactly one sandbox ID is expected before --") from None


@app.command("exec", cls=_ExecCommand)
def exec_(
    ctx: typer.Context,
    *,
    sandbox_id: IdArgument,
    cwd: Annotated[
        str | None, typer.Option("--cwd", metavar="DIR", help="The working directory inside the sandbox.")
    ] = None,
    consumer: Annotated[
        str | None, typer.Option("--consumer", metavar="NAME", help="The manifest consumer this command runs as.")
    ] = None,
    executable: Annotated[
        str | None,
        typer.Option(
            "--executable",
            metavar="NAME",
            help="With --consumer: the provider this command launches (docs/manifest.md).",
        ),
    ] = None,
    timeout: Annotated[
        str | None,
        typer.Option(
            "--timeout", metavar="SECONDS", help="Seconds until the exec's whole session is killed (status 124)."
        ),
    ] = None,
    env: Annotated[
        list[str] | None,
        typer.Option(
            "--env",
            metavar="NAME=VALUE",
            help="Set NAME for the command (names in the profile's exec.caller_env only).",
        ),
    ] = None,
    tty: Annotated[
        bool, typer.Option("-t", "--tty", help="Give the command a terminal of its own (an interactive shell).")
    ] = False,
) -> None:
    """Run ARGV in a sandbox on this terminal's stdio; exit with its status.

    Everything after -- is the command. Exit status: the command's own, 128+N when it died of
    signal N, 124 when --timeout expired, 125 when the broker failed, 126 not executable, 127 not found.
    """
    from sandboxer.commands.execute import execute
    from sandboxer.host.stdio import CallerStdio, Control

    options = {"id": sandbox_id}
    for name, value in (("cwd", cwd), ("consumer", consumer), ("executable", executable), ("timeout", timeout)):
        if value is not None:
            options[name] = value
    if tty:
        options["tty"] = "1"
    invocation = current()
    program = None  # this process's own stdio and signals
    if invocation.stdio is not None:
        control = None if invocation.control is None else Control(invocation.control, invocation.window)
        program = CallerStdio(invocation.stdio, control)
    try:
        require_own(sandbox_id, ExecUsage(f"exec: no such sandbox: {sandbox_id}"))
        exec_env = _assignments(env or [])
        status = execute(dirs_of(ctx), options, ctx.meta[_COMMAND], program, exec_env=exec_env)
    except Exception as exc:
        status = _exec_failure(exc, debug=debug_of(ctx))
    raise typer.Exit(status)


def _assignments(pairs: list[str]) -> dict[str, str]:
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


def _exec_failure(exc: Exception, *, debug: bool) -> int:
    """Report an exec's failure as its contract wants (one line on stderr); return its status."""
    from sandboxer.commands.execute import BROKER_FAILED

    if isinstance(exc, ExecUsage):
        sys.stderr.write(f"sandboxer: {exc}\n")
        return BROKER_FAILED
    if isinstance(exc, EntryError):
        sys.stderr.write(f"sandboxer: exec: {exc.message}\n")
        return exc.status
    if debug:
        import traceback

        traceback.print_exception(exc)
    sys.stderr.write(f"sandboxer: exec: internal error ({type(exc).__name__}); rerun with --debug\n")
    return BROKER_FAILED


@app.command("inspect")
def inspect(ctx: typer.Context, sandbox_id: IdArgument, json: JsonOption = False) -> None:
    """Evidence observed from a live sandbox."""
    from sandboxer.commands.inspect import inspect as inspect_sandbox

    require_own(sandbox_id, NotFoundError(f"no such sandbox: {sandbox_id}"))
    result = inspect_sandbox(dirs_of(ctx), sandbox_id)
    print_result(result, "\n".join(f"{k}: {v}" for k, v in flatten(result)), json)


@app.command("list")
def list_(ctx: typer.Context, json: JsonOption = False) -> None:
    """List the sandboxes of this state dir."""
    from sandboxer.commands.teardown import list_sandboxes
    from sandboxer.service.access import visible

    rules = access()
    result = list_sandboxes(dirs_of(ctx))
    if rules is not None:
        result = visible(result, rules.own_ids())
    rows = [("ID", "PROFILE", "BACKEND", "STATUS", "CREATED", "EXPIRES")]
    rows += [
        (e["id"], str(e["profile"]), str(e["backend"]), e["status"], str(e["created_at"]), e["expires_at"] or "-")
        for e in result["sandboxes"]
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    table = "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)
    print_result(result, table if result["sandboxes"] else "no sandboxes", json)


@app.command("teardown")
def teardown(
    ctx: typer.Context,
    sandbox_id: IdArgument,
    discard: Annotated[
        bool, typer.Option("--discard", help="Remove it even with work no export took out (that work is lost).")
    ] = False,
    json: JsonOption = False,
) -> None:
    """Remove everything a sandbox owns; print the receipt. A sandbox with commits or changes no
    export took out is refused (2) unless --discard."""
    from sandboxer.commands.teardown import receipt_or_raise
    from sandboxer.commands.teardown import teardown as teardown_sandbox

    require_own(sandbox_id, NotFoundError(f"no such sandbox: {sandbox_id}"))
    receipt = teardown_sandbox(dirs_of(ctx), sandbox_id, keep_work=not discard)
    lines = [f"removed {item}" for item in receipt["removed"]]
    lines += [f"RESIDUE {item}" for item in receipt["residue"]]
    print_result(receipt, "\n".join(lines) or f"{sandbox_id}: nothing to remove", json)
    receipt_or_raise(receipt)


@app.command("export")
def export(
    ctx: typer.Context,
    sandbox_id: IdArgument,
    *,
    bundle: Annotated[
        str | None, typer.Option("--bundle", metavar="FILE", help="Its new commits as a Git bundle.")
    ] = None,
    patch: Annotated[
        str | None,
        typer.Option("--patch", metavar="DIR", help="Its new commits as a patch series (a new or empty DIR)."),
    ] = None,
    tar: Annotated[str | None, typer.Option("--tar", metavar="FILE", help="Its working tree as a tar.")] = None,
    json: JsonOption = False,
) -> None:
    """Take a sandbox's work out: its new commits (--bundle, --patch) or its tree (--tar), made by
    git inside the sandbox and verified on the host before it is written (a new file or
    directory). teardown then loses nothing that was exported."""
    from sandboxer.commands.export import finished, prepare

    chosen = [(fmt, value) for fmt, value in (("bundle", bundle), ("patch", patch), ("tar", tar)) if value is not None]
    if len(chosen) != 1:
        raise UsageError("export: give exactly one of --bundle FILE, --patch DIR, --tar FILE")
    fmt, destination = chosen[0]
    if not destination:
        raise UsageError(f"export: --{fmt}: must name a file or directory")
    require_own(sandbox_id, NotFoundError(f"no such sandbox: {sandbox_id}"))
    dirs = dirs_of(ctx)
    made = prepare(
        dirs, sandbox_id, "bundle" if fmt == "bundle" else "patch" if fmt == "patch" else "tar", budget=export_budget()
    )
    try:
        deliver(made, f"--{fmt}", destination)
    except BaseException:
        from sandboxer.commands.export import discard_quarantine

        discard_quarantine(made)
        raise
    finished(dirs, made)
    summary = made.summary(destination)
    what = f"{summary['ahead']} commit(s)" if fmt != "tar" else "the working tree"
    print_result(summary, f"exported {what} of {sandbox_id} to {destination}", json)


@exports_app.callback()
def exports(ctx: typer.Context, json: JsonOption = False) -> None:
    """List the work the service kept of your expired sandboxes (docs/service.md, Lifetimes)."""
    if ctx.invoked_subcommand is not None:
        return
    from sandboxer.commands.kept import fetch_hint, list_kept

    result = list_kept(dirs_of(ctx), _kept_viewer())
    rows = [("ID", "FILES", "MIB", "KEPT UNTIL")]
    rows += [
        (e["id"], ",".join(e["files"]), str(-(-int(e["bytes"] or 0) // (1024 * 1024))), str(e["kept_until"]))
        for e in result["exports"]
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    table = "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)
    if result["exports"]:
        table += f"\nget one with: {fetch_hint('ID')}; remove it with: sandboxer exports rm ID"
    print_result(result, table if result["exports"] else "no kept exports", json)


@exports_app.command("get")
def exports_get(
    ctx: typer.Context,
    export_id: Annotated[str, typer.Argument(metavar="ID", help="A kept export's id (its sandbox's).")],
    destination: Annotated[str, typer.Argument(metavar="FILE", help="A new file to write it to.")],
    *,
    tar: Annotated[
        bool, typer.Option("--tar", help="Its tree's tar (changes not committed), not its commits' bundle.")
    ] = False,
    json: JsonOption = False,
) -> None:
    """Write a kept export's commits as a Git bundle (or, with --tar, its changed tree as a tar)
    to FILE, a new file made with your own rights."""
    from sandboxer.commands.kept import kept_file

    invocation = current()
    invocation.sandboxes.append(export_id)
    source = kept_file(dirs_of(ctx), export_id, "tar" if tar else "bundle", _kept_viewer())
    if not destination:
        raise UsageError("exports get: FILE must name a file")
    deliver_kept(source, destination)
    result = {"id": export_id, "format": "tar" if tar else "bundle", "destination": destination}
    print_result(result, f"wrote the kept {result['format']} of {export_id} to {destination}", json)


@exports_app.command("rm")
def exports_rm(
    ctx: typer.Context,
    export_id: Annotated[str, typer.Argument(metavar="ID", help="A kept export's id (its sandbox's).")],
    json: JsonOption = False,
) -> None:
    """Remove a kept export: its room in your export budget is free at once."""
    from sandboxer.commands.kept import remove_kept

    current().sandboxes.append(export_id)
    result = remove_kept(dirs_of(ctx), export_id, _kept_viewer())
    print_result(result, f"removed the kept export {export_id}", json)


def _kept_viewer() -> int | None:
    """Whose kept exports the caller sees: a granted caller's own (by the kernel's uid); an
    owner's (and in-process) every one."""
    rules = access()
    return None if rules is None or rules.owner else rules.peer.uid


@app.command("cp")
def cp(
    ctx: typer.Context,
    source: Annotated[str, typer.Argument(metavar="SRC", help="A local path, or ID:/path inside a sandbox.")],
    destination: Annotated[str, typer.Argument(metavar="DST", help="A local path, or ID:/path inside a sandbox.")],
) -> None:
    """Copy a file or directory into a sandbox (DST is ID:/path) or out of one (SRC is ID:/path,
    DST a local path that does not exist yet): tar streams over the sandbox's exec, as the API's
    put and get. Runs in the caller's own process, with its rights on the local files."""
    inside = [(end, sandbox_path(value)) for end, value in (("source", source), ("destination", destination))]
    remote = [(end, found) for end, found in inside if found is not None]
    if len(remote) != 1:
        raise UsageError("cp: exactly one of SRC and DST must be ID:/path (a sandbox id, a colon, an absolute path)")
    end, (sandbox_id, path) = remote[0]
    if access() is not None:
        raise UsageError("cp runs in the caller's own process, never as a service's command")
    sandbox = sandbox_of(dirs_of(ctx), sandbox_id)
    if end == "destination":
        sandbox.put(source, path)
    else:
        sandbox.get(path, destination)


@app.command("gc")
def gc(ctx: typer.Context, json: JsonOption = False) -> None:
    """Finish sandboxes whose broker died mid-way."""
    from sandboxer.commands.teardown import gc as collect
    from sandboxer.commands.teardown import receipt_or_raise

    require_owner("gc")
    result = collect(dirs_of(ctx))
    lines = [f"collected {r['id']}" + (" (RESIDUE)" if r["residue"] else "") for r in result["collected"]]
    lines += [f"removed the quarantine of an abandoned export ({name})" for name in result["exports"]]
    print_result(result, "\n".join(lines) or "nothing to collect", json)
    for receipt in result["collected"]:
        receipt_or_raise(receipt)


@app.command("dispatch-tool")
def dispatch_tool(
    ctx: typer.Context,
    *,
    sandbox_id: IdArgument,
    lease: Annotated[str, typer.Option("--lease", help="The tool-request lease.")],
    request_id: Annotated[str, typer.Option("--request-id", help="The request id (requests/<id>.json).")],
    wait_seconds: Annotated[int, typer.Option("--wait-seconds", help="How long to wait for it (0-300).")],
    json: JsonOption = False,
) -> None:
    """Relay one tool request from a sandbox's spool to its endpoint."""
    from sandboxer.commands.dispatch import dispatch

    require_own(sandbox_id, NotFoundError(f"no such sandbox: {sandbox_id}"))
    result = dispatch(dirs_of(ctx).state, sandbox_id, lease_id=lease, request_id=request_id, wait_seconds=wait_seconds)
    print_result(result, f"dispatched {result['request_id']} ({result['response']})", json)


@app.command("warm")
def warm(
    ctx: typer.Context,
    profile: Annotated[str, typer.Argument(metavar="PROFILE", help="A profile name.")],
    json: JsonOption = False,
) -> None:
    """Start the warm sandboxes a profile keeps (its extension's config.warm); remove stale ones."""
    from sandboxer.commands.warm import fill

    require_owner("warm")
    result = fill(dirs_of(ctx), profile)
    text = f"{result['profile']}: " + (
        "another fill is running"
        if result["busy"]
        else f"{result['warm']} warm (started {len(result['started'])}, removed {len(result['removed'])})"
    )
    print_result(result, text, json)
