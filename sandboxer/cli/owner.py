"""The owner's commands: ext (check, approve, revoke, list), runtime digest, manifest check and
bootstrap check; doctor. (`serve` is the root's: the service runs this whole table.)"""

from __future__ import annotations

import os
from typing import Annotated

import typer

from sandboxer.api.results import OwnerCheck, frozen, thawed
from sandboxer.cli.options import JsonOption, broker_of, caller_path, client_path, dirs_of, services
from sandboxer.commands import owner
from sandboxer.commands.doctor import doctor as check_host
from sandboxer.core import bootstrap, manifest
from sandboxer.core.configdir import load_owner_file, read_owner_file
from sandboxer.output import flatten
from sandboxer.output import print_result as _print

app = typer.Typer()
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


def _names_a_file(target: str) -> bool:
    """Whether `ext check`'s argument is a path (a `/` in it, or a name ending .yaml or .yml)
    rather than a NAME as `ext approve` takes it."""
    return "/" in target or target.endswith((".yaml", ".yml"))


@ext_app.command("check")
def ext_check(
    ctx: typer.Context,
    target: Annotated[
        str,
        typer.Argument(
            metavar="NAME|FILE",
            help="ext.bwrap, ext.docker, grants or a profile name (its file in the config dir, as ext approve"
            " reads it), or the path of a YAML file (one with a / or ending .yaml: ./dev.yaml).",
        ),
    ],
    json: JsonOption = False,
) -> None:
    """Validate an extension config, profile or grants file and print what it means: by NAME, the
    file `ext approve NAME` would approve; by path, any file."""

    if _names_a_file(target):
        result = owner.check(caller_path(target, "ext check"))
    else:  # the file `ext approve` reads, with the name its path gives it (one error for a bad NAME)
        raw = read_owner_file(dirs_of(ctx, state=False).config, target)
        item = load_owner_file(raw)
        described = owner.describe(item)
        kind = described.pop("kind")
        result = OwnerCheck(file=raw.path, sha256=item.file_sha256, kind=kind, meaning=frozen(described))
    lines = [f"{result.file}: valid {result.kind} (sha256 {result.sha256})"]
    lines += [f"  {key}: {value}" for key, value in flatten(thawed(result.meaning))]
    _print(result.to_json(), "\n".join(lines), json)


@manifest_app.command("check")
def manifest_check(
    ctx: typer.Context,
    file: Annotated[str, typer.Argument(help="A lease manifest (the assignment file in its run directory).")],
    json: JsonOption = False,
) -> None:
    """Validate a lease manifest and its sources; print what it grants (never a value)."""

    dirs = dirs_of(ctx, state=False)  # only to refuse sources inside it
    checked = manifest.load(os.path.abspath(caller_path(file, "manifest check")), forbidden=(dirs.config, dirs.state))
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

    opened = caller_path(file, "bootstrap check")
    document, _ = bootstrap.load(opened)
    result = {"valid": True, "file": os.path.abspath(opened), **document.meaning()}
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
    result = broker_of(ctx).owner.approve(name)
    _print(result.to_json(), f"approved {name} (sha256 {result.sha256})", json)


@ext_app.command("revoke")
def ext_revoke(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="ext.bwrap, ext.docker or a profile name.")],
    json: JsonOption = False,
) -> None:
    """Withdraw an approval."""
    result = broker_of(ctx).owner.revoke(name)
    _print(result.to_json(), f"revoked {name}" if result.revoked else f"{name} was not approved", json)


@ext_app.command("list")
def ext_list(ctx: typer.Context, json: JsonOption = False) -> None:
    """List every extension config and profile with its approval status."""
    result = broker_of(ctx).owner.listing()
    rows = [("NAME", "KIND", "STATUS", "VALID")]
    rows += [(e.name, e.kind, e.status, "yes" if e.valid else "no") for e in result.entries]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    human = "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)
    reasons = [f"{e.name}: {e.problem}" for e in result.entries if not e.valid and e.problem]
    if reasons:  # why each is not valid, not only "no"
        human += "\n\n" + "\n".join(reasons)
    if not result.entries:
        human = f"no extension configs or profiles in {result.config_dir}"
    _print(result.to_json(), human, json)


@runtime_app.command("pin")
def runtime_pin(
    ctx: typer.Context,
    path: Annotated[str, typer.Argument(help="The runtime directory (canonical absolute path).")],
    extension: Annotated[str, typer.Option("--extension", metavar="NAME", help="The extension config to pin it in.")],
    json: JsonOption = False,
) -> None:
    """Write a runtime directory and its digest into an extension config, for the owner to review
    and approve."""
    result = broker_of(ctx).owner.runtime_pin(client_path(path), extension)
    human = (
        f"{result.file}: config.runtime is now {result.path} at {result.sha256}\n"
        f"review it, then: sandboxer ext approve {result.extension}"
    )
    if result.status == "approved":
        human = f"{result.file}: already pins {result.path} at {result.sha256} (approved)"
    _print(result.to_json(), human, json)


@runtime_app.command("digest")
def runtime_digest(
    ctx: typer.Context,
    path: Annotated[str, typer.Argument(help="The runtime directory (canonical absolute path).")],
    full: Annotated[bool, typer.Option("--full", help="Re-read every file; ignore the stat cache.")] = False,
    json: JsonOption = False,
) -> None:
    """Print the tree digest v1 of a runtime directory."""
    result = broker_of(ctx).owner.runtime_digest(client_path(path), full=full)
    _print(result.to_json(), result.sha256, json)


@app.command("doctor")
def doctor(ctx: typer.Context, json: JsonOption = False) -> None:
    """Check this host for sandboxes — bwrap, user namespaces, Landlock, cgroups, git, the config
    and state dirs, disk space, Docker — one line each, with what to do. Exit 5 when any fails."""

    # It reports a state dir it would refuse.
    result = check_host(dirs_of(ctx, state=False), backends=services().backends)
    lines = result.pop("lines")
    _print(result, "\n".join(lines), json)
    if not result["ok"]:
        raise typer.Exit(5)
