"""The Python client of the broker service: the embedded API's verbs and result types, over the
service's Unix socket (docs/service.md, docs/api.md).

    from sandboxer import Client

    client = Client()                      # the service for the default state dir
    with client.create("bwrap-local") as sb:
        result = sb.exec(["python3", "-c", "print(1)"], timeout=30)

The service knows the caller from the kernel (the socket's peer credentials): nothing the client
sends says who it is. Errors are the classes of `sandboxer.errors`, rebuilt from the service's
answer, with the same `.status`. HTTP is the standard library's (`http.client`) on a Unix socket
(sandboxer.clients.transport).
"""

from __future__ import annotations

import base64
import builtins
import contextlib
import http.client
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from sandboxer import errors
from sandboxer.api.results import (
    Approval,
    CallerView,
    Created,
    Dispatched,
    Evidence,
    Exported,
    GcReport,
    KeptExport,
    KeptExportRemoved,
    KeptExports,
    NetworkLog,
    OwnerCheck,
    OwnerEntry,
    OwnerListing,
    Receipt,
    RuntimeDigest,
    SandboxInfo,
    SandboxList,
    Version,
)
from sandboxer.api.usage_results import Lifetime, Usage, WorkSummary
from sandboxer.api.verbs import Input, SandboxBase, check_dispatch, checked_create, checked_exec, checked_export
from sandboxer.clients.transport import ClientExecStream, ServiceHttp, raise_for
from sandboxer.commands.export_delivery import receive
from sandboxer.commands.owner import check
from sandboxer.core import bootstrap
from sandboxer.dirs import find_service, resolve_dirs

__all__ = ["Client", "ClientExecStream", "ClientOwner", "ClientSandbox"]

DISPATCH_MARGIN = 60.0  # seconds a dispatch may take past its wait: the relay to its endpoint (40 at most)


def default_socket() -> str:
    """SANDBOXER_SOCKET, else the socket of the caller's state dir's service (root's:
    /run/sandboxer/broker.sock). An account other than root with no configuration of its own
    is a caller of the system service: its socket when root's service answers there or no
    private one does (sandboxer.dirs.find_service; docs/service.md, "Finding the service")."""

    euid, home = os.geteuid(), os.path.expanduser("~")
    dirs = resolve_dirs(config_dir=None, state_dir=None, environ=os.environ, euid=euid, home=home)
    return find_service(dirs, os.environ)


class Client:
    """The broker service at `socket` (default: SANDBOXER_SOCKET, root's /run/sandboxer/broker.sock,
    else the caller's state dir's broker.sock; an account with no configuration of its own finds
    the system service: default_socket). Every connection is checked before a byte is sent: a
    socket answered by a process of neither root nor this account raises UntrustedServiceError
    (a PolicyError, 3).
    `timeout` bounds each request but an exec's."""

    def __init__(self, socket: str | None = None, *, timeout: float = 300.0) -> None:
        self.service = ServiceHttp(socket or default_socket(), timeout)
        self.owner = ClientOwner(self)

    @property
    def socket(self) -> str:
        """The path of the service's socket."""
        return self.service.socket

    @property
    def timeout(self) -> float:
        """The seconds each request may take (an exec's stream and an export: as long as they take)."""
        return self.service.timeout

    def version(self) -> Version:
        """The service's version and API version."""
        return Version.from_json(self.service.request("GET", "/v1/version"))

    def whoami(self) -> CallerView:
        """What this account may do here: owner, or its granted profiles with their limits and
        approval now, and its live sandboxes (an account no grant names: PolicyError, 3)."""
        return CallerView.from_json(self.service.request("GET", "/v1/me"))

    def create(
        self,
        profile: str,
        *,
        manifest: str | None = None,
        bootstrap: str | None = None,
        ttl: float | None = None,
        ref: str | None = None,
        branch: str | None = None,
    ) -> ClientSandbox:
        """A new sandbox from the approved `profile`; the service tears it down after `ttl` seconds.
        `bootstrap`: a runtime bootstrap file, read here with this process's rights (owner-only,
        not a symlink) and sent; `manifest`: a lease manifest, which the service opens itself —
        so only a service of this process's own account takes one."""
        manifest, bootstrap = checked_create(profile, manifest=manifest, bootstrap=bootstrap, ref=ref, branch=branch)
        body: dict[str, Any] = {"profile": profile}
        if ttl is not None:
            body["ttl"] = ttl
        for name, value in (("ref", ref), ("branch", branch)):
            if value is not None:
                body[name] = value
        if manifest is not None:
            body["manifest"] = os.path.abspath(manifest)
        if bootstrap is not None:
            body["bootstrap"] = _sent_bootstrap(bootstrap)
        return ClientSandbox(self, Created.from_json(self.service.request("POST", "/v1/sandboxes", body)))

    def sandbox(self, sandbox_id: str) -> ClientSandbox:
        """The sandbox `sandbox_id` (not checked until it is used)."""
        return ClientSandbox(self, None, sandbox_id=sandbox_id)

    def list(self, *, work: bool = True) -> list[SandboxInfo]:
        """Every sandbox of the service's this caller may see, with its status, whose it is, its
        age and time left, and (`work`: a command in each running one asks its git) its work."""
        path = "/v1/sandboxes" if work else "/v1/sandboxes?work=0"
        return list(SandboxList.from_json(self.service.request("GET", path)).sandboxes)

    def gc(self) -> GcReport:
        return GcReport.from_json(self.service.request("POST", "/v1/gc"))

    def exports(self) -> builtins.list[KeptExport]:
        """The work the service kept of this caller's expired sandboxes (an owner's: every one)."""
        return list(KeptExports.from_json(self.service.request("GET", "/v1/exports")).exports)

    def get_export(self, export_id: str, destination: str, *, format: str = "bundle") -> None:
        """Write a kept export's commits (`format` "bundle") or changed tree ("tar") to the new
        local file `destination`, with this process's rights."""

        destination = checked_export("get_export", format, destination)
        connection = self.service.connection(None)  # as long as the file takes
        try:
            try:
                connection.request("GET", f"/v1/exports/{export_id}/{format}")
                response = connection.getresponse()
            except OSError as exc:
                raise errors.BackendError(f"the broker service does not answer ({exc})") from None
            if response.status >= 400:
                try:
                    document = json.loads(response.read())
                except ValueError:
                    document = None
                raise_for(document, response.status)
            try:
                receive(format, response, destination)
            except (http.client.HTTPException, OSError) as exc:
                raise errors.BackendError(f"exports get: the service's stream broke off ({exc!r})") from None
        finally:
            connection.close()

    def remove_export(self, export_id: str) -> KeptExportRemoved:
        """Remove a kept export (its room in the caller's export budget is free at once); the
        files it held."""
        return KeptExportRemoved.from_json(self.service.request("DELETE", f"/v1/exports/{export_id}"))


def _sent_bootstrap(path: str) -> dict[str, str]:
    """A bootstrap file as the service takes it from a client: read and checked here as the broker
    reads one (docs/bootstrap.md; the same errors), its path and base64 bytes."""

    _, data = bootstrap.load(path)
    return {"path": os.path.abspath(path), "content": base64.b64encode(data).decode()}


class ClientSandbox(SandboxBase):
    """One live sandbox through the service; as a context manager it is torn down at the end."""

    def __init__(self, client: Client, created: Created | None, *, sandbox_id: str | None = None) -> None:
        super().__init__(created, sandbox_id)
        self.client = client

    def exec_stream(
        self,
        argv: Sequence[str],
        *,
        stdin: Input = b"",
        cwd: str | None = None,
        timeout: float | None = None,
        consumer: str | None = None,
        executable: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ClientExecStream:
        """Run `argv` and yield its output as it arrives; `.status` once the iteration ended.
        Leaving the iteration early closes the connection, and the service kills the exec."""
        argv, stdin = checked_exec(
            argv, stdin, cwd=cwd, timeout=timeout, consumer=consumer, executable=executable, env=env
        )
        options: dict[str, Any] = {"argv": list(argv)}
        for name, value in (("cwd", cwd), ("timeout", timeout), ("consumer", consumer), ("executable", executable)):
            if value is not None:
                options[name] = value
        if env:
            options["env"] = dict(env)
        return ClientExecStream(self.client.service, self.id, json.dumps(options).encode() + b"\n", stdin)

    def inspect(self) -> Evidence:
        return Evidence.from_json(self.client.service.request("GET", f"/v1/sandboxes/{self.id}"))

    def usage(self) -> Usage:
        return Usage.from_json(self.client.service.request("GET", f"/v1/sandboxes/{self.id}/usage"))

    def work_state(self) -> WorkSummary:
        return WorkSummary.from_json(self.client.service.request("GET", f"/v1/sandboxes/{self.id}/work"))

    def extend(self, seconds: int) -> Lifetime:
        body = {"seconds": seconds}
        return Lifetime.from_json(self.client.service.request("POST", f"/v1/sandboxes/{self.id}/extend", body))

    def network_log(self, *, last: int | None = None) -> NetworkLog:
        query = "" if last is None else f"?last={int(last)}"
        return NetworkLog.from_json(self.client.service.request("GET", f"/v1/sandboxes/{self.id}/logs/network{query}"))

    def _require_known(self) -> None:
        """NotFoundError (4) unless the service lists the sandbox for this caller."""
        if self.id not in {info.id for info in self.client.list(work=False)}:
            raise errors.NotFoundError(f"no such sandbox: {self.id}")

    def dispatch_tool(self, lease: str, request_id: str, wait_seconds: int = 0) -> Dispatched:
        """Relay the request `request_id` of the tool-request lease `lease` to its endpoint, waiting
        up to `wait_seconds` for it; NotPendingError (75, retryable) when it is not there yet."""
        check_dispatch(lease, request_id, wait_seconds)
        body = {"lease": lease, "request_id": request_id, "wait_seconds": wait_seconds}
        path = f"/v1/sandboxes/{self.id}/dispatch"
        timeout = max(self.client.timeout, wait_seconds + DISPATCH_MARGIN)  # it waits, then relays
        return Dispatched.from_json(self.client.service.request("POST", path, body, timeout=timeout))

    def teardown(self, *, discard: bool = False) -> Receipt:
        """Remove the sandbox; later calls return the same receipt (ResidueError, 6, on residue;
        UnexportedWorkError, 2, for work no export took out unless `discard`)."""
        if self._receipt is None:
            path = f"/v1/sandboxes/{self.id}?discard={'true' if discard else 'false'}"
            self._receipt = Receipt.from_json(self.client.service.request("DELETE", path))
        return self._receipt

    def export(self, format: str, destination: str) -> Exported:
        """Take the sandbox's work out to the new local `destination` (sandboxer.api.verbs): the
        service verifies it and sends it; it is written here, with this process's rights."""

        destination = checked_export("export", format, destination)
        connection = self.client.service.connection(None)  # as long as git inside takes
        try:
            try:
                body = json.dumps({"format": format}).encode()
                headers = {"Content-Type": "application/json"}
                connection.request("POST", f"/v1/sandboxes/{self.id}/export", body=body, headers=headers)
                response = connection.getresponse()
            except OSError as exc:
                raise errors.BackendError(f"the broker service does not answer ({exc})") from None
            if response.status >= 400:
                try:
                    document = json.loads(response.read())
                except ValueError:
                    document = None
                raise_for(document, response.status)
            try:
                summary = json.loads(response.getheader("Sandboxer-Export") or "")
            except ValueError:
                raise errors.BackendError("the service's export came without its summary") from None
            try:
                receive(format, response, destination)
                response.read()  # to the body's end (a tar reader stops at its own): then it was sent whole
            except (http.client.HTTPException, OSError) as exc:  # the service went away mid-way
                raise errors.BackendError(f"export: the service's stream broke off ({exc!r})") from None
        finally:
            connection.close()
        token = summary.pop("token", None)
        if isinstance(token, str):  # all of it is written: teardown need not keep the work for it
            with contextlib.suppress(errors.SandboxerError):
                self.client.service.request("POST", f"/v1/sandboxes/{self.id}/export/confirm", {"token": token})
        return Exported.from_json({**summary, "destination": destination})


class ClientOwner:
    """The owner's verbs through the service (refused to a granted caller: PolicyError, 3)."""

    def __init__(self, client: Client) -> None:
        self.client = client

    def check(self, path: str) -> OwnerCheck:
        """Validate one owner file; its normalized meaning (ConfigError, 2, when invalid). Read in
        this process, with its own rights, as `sandboxer ext check` does: it needs nothing of the
        service's."""

        return check(path)

    def approve(self, name: str) -> Approval:
        """Approve the exact current bytes of an extension config, a profile or grants."""
        return Approval.from_json(self.client.service.request("POST", "/v1/owner/approve", {"name": name}))

    def revoke(self, name: str) -> Approval:
        """Withdraw an approval (not an error when there is none)."""
        return Approval.from_json(self.client.service.request("POST", "/v1/owner/revoke", {"name": name}))

    def list(self) -> list[OwnerEntry]:
        """Every owner file with its approval status, and every approval whose file is gone."""
        return list(OwnerListing.from_json(self.client.service.request("GET", "/v1/owner/entries")).entries)

    def runtime_digest(self, path: str, *, full: bool = False) -> RuntimeDigest:
        """The tree digest v1 of the runtime directory at the absolute `path`, read by the service
        (which does so only for a caller of its own account)."""
        body = {"path": path, "full": full}
        return RuntimeDigest.from_json(self.client.service.request("POST", "/v1/runtime/digest", body))
