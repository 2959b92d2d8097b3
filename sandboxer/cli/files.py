"""What the caller's file commands need besides their options (sandboxer.cli.caller): where an
export is written — the descriptors a CLI client opened with the caller's rights, or a path —
and how `cp` reaches a sandbox from the caller's own process.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

import typer

from sandboxer.api.broker import Broker
from sandboxer.cli.options import caller, caller_path
from sandboxer.clients.service import Client
from sandboxer.commands.export_delivery import (
    copy_to_fd,
    copy_to_path,
    deliver_to_directory,
    deliver_to_file,
    deliver_to_path,
)
from sandboxer.dirs import ROOT_SOCKET, Untrusted, connect, find_service, no_service
from sandboxer.errors import UsageError
from sandboxer.host.registry import ID_PATTERN
from sandboxer.invocation import current

if TYPE_CHECKING:
    from sandboxer.api.sandbox import Sandbox
    from sandboxer.clients.service import ClientSandbox
    from sandboxer.commands.export import Export
    from sandboxer.dirs import Dirs


def deliver(made: Export, option: str, destination: str) -> None:
    """Write a verified export where the caller asked: to the descriptor its client opened with
    its own rights, or (in-process, or for the service's own account) at the path itself."""

    opened = current().files.get(destination)
    if opened is None:
        deliver_to_path(made, caller_path(destination, option))
        return
    if opened.fd is None:
        raise UsageError(f"export: {destination}: cannot be created ({os.strerror(opened.errno)})")
    peer = caller()
    uid = peer.uid if peer is not None else os.geteuid()  # whose file it must be
    if made.format != "patch":
        deliver_to_file(made, opened.fd, destination, uid=uid)
        return
    owner = (peer.uid, peer.gid) if peer is not None and os.geteuid() == 0 and peer.uid != 0 else None
    deliver_to_directory(made, opened.fd, destination, uid=uid, owner=owner)


def deliver_kept(source: str, destination: str) -> None:
    """Copy a kept export's file (the broker's) where the caller asked, as `deliver` writes an
    export: into the new file its client made with its own rights, or at the path itself."""

    opened = current().files.get(destination)
    if opened is None:
        copy_to_path(source, caller_path(destination, "exports get"))
        return
    if opened.fd is None:
        raise UsageError(f"exports get: {destination}: cannot be created ({os.strerror(opened.errno)})")
    peer = caller()
    copy_to_fd(source, opened.fd, destination, uid=peer.uid if peer is not None else os.geteuid())


def sandbox_path(value: str) -> tuple[str, str] | None:
    """(id, path) of `ID:/path`, else None (a local path)."""

    sandbox_id, colon, path = value.partition(":")
    if colon and ID_PATTERN.fullmatch(sandbox_id) and path.startswith("/"):
        return sandbox_id, path
    return None


def sandbox_of(dirs: Dirs, sandbox_id: str) -> Sandbox | ClientSandbox:
    """The sandbox through the service that answers for the state dir (as sandboxer.Client; only
    a service of root or of this account), else through the embedded broker. An account with no
    configuration of its own uses the system service's, as the sandboxer command does."""

    if os.environ.get("SANDBOXER_NO_SERVICE") != "1":
        path = find_service(dirs, os.environ)
        try:
            probe = connect(path)
        except Untrusted as exc:
            raise UsageError(f"cp: {exc}; refused") from None
        if probe is None and os.environ.get("SANDBOXER_SOCKET"):  # as the sandboxer command says it (125)
            sys.stderr.write(
                f"sandboxer: no service answers on {path} (SANDBOXER_SOCKET): ask its owner whether it runs, "
                "or unset SANDBOXER_SOCKET to use your default service\n"
            )
            raise typer.Exit(125)
        if probe is None and path == ROOT_SOCKET and os.geteuid() != 0:
            sys.stderr.write(f"sandboxer: {no_service(dirs.config)}\n")
            raise typer.Exit(125)
        if probe is not None:
            probe.close()

            return Client(path).sandbox(sandbox_id)  # put and get check that it is there

    return Broker(config_dir=dirs.config, state_dir=dirs.state).sandbox(sandbox_id)
