"""The caller's commands: create, exec, teardown, export, exports (what the reaper kept), cp,
gc, dispatch-tool (and the owner's warm, which fills what create takes from).

Each command imports only its own module when it runs. `exec` keeps its own contract: the
command after `--` is taken verbatim, and every broker failure — bad usage included — is one
line on stderr and status 125 (sandboxer.commands.execute).
"""

from __future__ import annotations

import sys
import traceback
from typing import Annotated, Literal

import typer
from typer._click.core import Context
from typer._click.exceptions import BadOptionUsage, NoSuchOption
from typer._click.exceptions import UsageError as ClickUsageError
from typer.core import TyperCommand

from sandboxer.api.broker import MANIFEST_PATHS
from sandboxer.api.results import KeptExportFetched, KeptExports, Receipt
from sandboxer.cli.files import deliver, deliver_kept, sandbox_of, sandbox_path
from sandboxer.cli.options import (
    IdArgument,
    JsonOption,
    broker_of,
    caller,
    caller_file,
    caller_path,
    debug_of,
    dirs_of,
    interrupted,
    named,
)
from sandboxer.commands.execute import BROKER_FAILED, execute
from sandboxer.commands.kept import fetch_hint
from sandboxer.commands.teardown import residue_error
from sandboxer.core.exec_request import ExecRequest
from sandboxer.errors import EntryError, ExecUsage, ResidueError, UsageError
from sandboxer.execio.stdio import ClientStdio, Control, OwnStdio, Stdio
from sandboxer.invocation import current
from sandboxer.output import print_result, table

app = typer.Typer()
exports_app = typer.Typer(
    help="The work the service kept of your expired sandboxes: list (no command), get, rm.",
    invoke_without_command=True,
)
app.add_typer(exports_app, name="exports")


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
    broker = broker_of(ctx)
    manifest = None if manifest is None else caller_path(manifest, "--manifest", why=MANIFEST_PATHS)
    source = None if bootstrap is None else caller_file(bootstrap, "--bootstrap")
    sandbox = broker.create(
        profile, manifest=manifest, bootstrap=source, ttl=ttl, ref=ref, branch=branch, abandoned=interrupted
    )
    named(sandbox.id)
    print_result(sandbox.created.to_json() if sandbox.created else {"id": sandbox.id}, sandbox.id, json)


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

    invocation = current()
    stdio: Stdio = OwnStdio()  # this process's own stdio and signals
    if invocation.stdio is not None:
        control = None if invocation.control is None else Control(invocation.control, invocation.window)
        stdio = ClientStdio(invocation.stdio, control)
    try:
        request = ExecRequest.from_cli(
            sandbox_id,
            ctx.meta[_COMMAND],
            cwd=cwd,
            consumer=consumer,
            executable=executable,
            timeout=timeout,
            tty=tty,
            env=env or [],
        )
        broker = broker_of(ctx)
        broker.sandbox(named(sandbox_id), unknown=ExecUsage(f"exec: no such sandbox: {sandbox_id}"))
        status = execute(dirs_of(ctx), request, stdio, backends=broker.backends, caller_env=broker.environ)
    except Exception as exc:
        status = _exec_failure(exc, debug=debug_of(ctx))
    raise typer.Exit(status)


def _exec_failure(exc: Exception, *, debug: bool) -> int:
    """Report an exec's failure as its contract wants (one line on stderr); return its status."""

    if isinstance(exc, ExecUsage):
        sys.stderr.write(f"sandboxer: {exc}\n")
        return BROKER_FAILED
    if isinstance(exc, EntryError):
        sys.stderr.write(f"sandboxer: exec: {exc.message}\n")
        return exc.status
    if debug:
        traceback.print_exception(exc)
    sys.stderr.write(f"sandboxer: exec: internal error ({type(exc).__name__}); rerun with --debug\n")
    return BROKER_FAILED


def _receipt_text(receipt: Receipt) -> str:
    lines = [f"removed {item}" for item in receipt.removed]
    lines += [f"RESIDUE {item}" for item in receipt.residue]
    return "\n".join(lines) or f"{receipt.id}: nothing to remove"


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
    try:
        receipt = broker_of(ctx).sandbox(named(sandbox_id)).teardown(discard=discard)
    except ResidueError as exc:
        if isinstance(exc.receipt, Receipt):
            print_result(exc.receipt.to_json(), _receipt_text(exc.receipt), json)
        raise
    print_result(receipt.to_json(), _receipt_text(receipt), json)


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
    chosen = [(fmt, value) for fmt, value in (("bundle", bundle), ("patch", patch), ("tar", tar)) if value is not None]
    if len(chosen) != 1:
        raise UsageError("export: give exactly one of --bundle FILE, --patch DIR, --tar FILE")
    fmt, destination = chosen[0]
    if not destination:
        raise UsageError(f"export: --{fmt}: must name a file or directory")
    sandbox = broker_of(ctx).sandbox(named(sandbox_id))
    made = sandbox.prepare_export(fmt)
    try:
        deliver(made, f"--{fmt}", destination)
    except BaseException:
        sandbox.discard_export(made)
        raise
    sandbox.finish_export(made)
    summary = made.summary(destination)
    what = f"{summary.ahead} commit(s)" if fmt != "tar" else "the working tree"
    print_result(summary.to_json(), f"exported {what} of {sandbox_id} to {destination}", json)


@exports_app.callback()
def exports(ctx: typer.Context, json: JsonOption = False) -> None:
    """List the work the service kept of your expired sandboxes (docs/service.md, Lifetimes)."""
    if ctx.invoked_subcommand is not None:
        return

    kept = broker_of(ctx).exports()
    rows = [("ID", "FILES", "MIB", "KEPT UNTIL")]
    rows += [(e.id, ",".join(e.files), str(-(-int(e.bytes or 0) // (1024 * 1024))), str(e.kept_until)) for e in kept]
    text = table(rows)
    if kept:
        text += f"\nget one with: {fetch_hint('ID')}; remove it with: sandboxer exports rm ID"
    print_result(KeptExports(exports=tuple(kept)).to_json(), text if kept else "no kept exports", json)


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
    fmt: Literal["bundle", "tar"] = "tar" if tar else "bundle"
    source = broker_of(ctx).kept_export_file(named(export_id), fmt)
    if not destination:
        raise UsageError("exports get: FILE must name a file")
    deliver_kept(source, destination)
    result = KeptExportFetched(id=export_id, format=fmt, destination=destination)
    print_result(result.to_json(), f"wrote the kept {fmt} of {export_id} to {destination}", json)


@exports_app.command("rm")
def exports_rm(
    ctx: typer.Context,
    export_id: Annotated[str, typer.Argument(metavar="ID", help="A kept export's id (its sandbox's).")],
    json: JsonOption = False,
) -> None:
    """Remove a kept export: its room in your export budget is free at once."""
    result = broker_of(ctx).remove_export(named(export_id))
    print_result(result.to_json(), f"removed the kept export {export_id}", json)


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
    if caller() is not None:
        raise UsageError("cp runs in the caller's own process, never as a service's command")
    sandbox = sandbox_of(dirs_of(ctx), sandbox_id)
    if end == "destination":
        sandbox.put(source, path)
    else:
        sandbox.get(path, destination)


@app.command("gc")
def gc(ctx: typer.Context, json: JsonOption = False) -> None:
    """Finish sandboxes whose broker died mid-way."""
    report = broker_of(ctx).gc()
    lines = [f"collected {r.id}" + (" (RESIDUE)" if r.residue else "") for r in report.collected]
    lines += [f"removed the quarantine of an abandoned export ({name})" for name in report.exports]
    print_result(report.to_json(), "\n".join(lines) or "nothing to collect", json)
    for receipt in report.collected:
        if receipt.residue:
            raise residue_error(receipt)


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
    sandbox = broker_of(ctx).sandbox(named(sandbox_id))
    result = sandbox.dispatch_tool(lease, request_id, wait_seconds)
    print_result(result.to_json(), f"dispatched {result.request_id} ({result.response})", json)


@app.command("warm")
def warm(
    ctx: typer.Context,
    profile: Annotated[str, typer.Argument(metavar="PROFILE", help="A profile name.")],
    json: JsonOption = False,
) -> None:
    """Start the warm sandboxes a profile keeps (its extension's config.warm); remove stale ones."""
    result = broker_of(ctx).warm(profile)
    text = f"{result.profile}: " + (
        "another fill is running"
        if result.busy
        else f"{result.warm} warm (started {len(result.started)}, removed {len(result.removed)})"
    )
    print_result(result.to_json(), text, json)
