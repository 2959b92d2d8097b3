"""The Python client of the broker service: the embedded API's verbs and result types, over the
service's Unix socket (docs/service.md, docs/api.md).

    from sandboxer import Client

    client = Client()                      # the service for the default state dir
    with client.create("bwrap-local") as sb:
        result = sb.exec(["python3", "-c", "print(1)"], timeout=30)

The service knows the caller from the kernel (the socket's peer credentials): nothing the client
sends says who it is. Errors are the classes of `sandboxer.errors`, rebuilt from the service's
answer, with the same `.status`. HTTP is the standard library's (`http.client`) on a Unix socket.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket as socketlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from sandboxer import errors
from sandboxer.results import (
    Approval,
    Created,
    Dispatched,
    Evidence,
    Exported,
    GcReport,
    OwnerEntry,
    Receipt,
    RuntimeDigest,
    SandboxInfo,
    Stream,
    owner_entries,
)
from sandboxer.service import frames
from sandboxer.verbs import InputChunks, SandboxBase, Stdin, checked_signal

__all__ = ["Client", "ClientExecStream", "ClientOwner", "ClientSandbox"]

INLINE_BODY = 64 * 1024  # an exec body this small is sent without a thread (a Unix socket buffers more)
DISPATCH_MARGIN = 60.0  # seconds a dispatch may take past its wait: the relay to its endpoint (40 at most)


def default_socket() -> str:
    """SANDBOXER_SOCKET, else the socket of the caller's state dir's service (root's:
    /run/sandboxer/broker.sock)."""
    from sandboxer.dirs import resolve_dirs, service_socket

    dirs = resolve_dirs(
        config_dir=None, state_dir=None, environ=os.environ, euid=os.geteuid(), home=os.path.expanduser("~")
    )
    return service_socket(dirs, os.environ)


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float | None) -> None:
        super().__init__("sandboxer", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        sock = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self.path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def _raise_for(document: Any, http_status: int) -> None:
    """The service's error answer as the error class it names (by status when unknown)."""
    failure = document.get("error") if isinstance(document, dict) else None
    if not isinstance(failure, dict):
        raise errors.BackendError(f"the service answered HTTP {http_status} without an error document")
    kind = getattr(errors, str(failure.get("kind")), None)
    status = failure.get("status")
    by_status = {2: errors.UsageError, 3: errors.PolicyError, 4: errors.NotFoundError, 5: errors.BackendError}
    by_status |= {6: errors.ResidueError, 75: errors.NotPendingError, 125: errors.ExecError}
    if not (isinstance(kind, type) and issubclass(kind, errors.SandboxerError)) or kind in (
        errors.ConfigError,
        errors.DocumentError,
    ):
        kind = by_status.get(status if isinstance(status, int) else 5, errors.BackendError)
    error = kind(str(failure.get("message")), hint=failure.get("hint"))
    if isinstance(error, errors.ResidueError) and isinstance(document.get("receipt"), dict):
        error.receipt = Receipt.from_json(document["receipt"])
    raise error


class Client:
    """The broker service at `socket` (default: SANDBOXER_SOCKET, root's /run/sandboxer/broker.sock,
    else the caller's state dir's broker.sock). `timeout` bounds each request but an exec's."""

    def __init__(self, socket: str | None = None, *, timeout: float = 300.0) -> None:
        self.socket = socket or default_socket()
        self.timeout = timeout
        self.owner = ClientOwner(self)

    def _request(self, method: str, path: str, body: Any = None, *, timeout: float | None = None) -> Any:
        seconds = timeout or self.timeout
        connection = _UnixConnection(self.socket, seconds)
        try:
            payload = None if body is None else json.dumps(body).encode()
            headers = {"Content-Type": "application/json"} if payload is not None else {}
            try:
                connection.request(method, path, body=payload, headers=headers)
                response = connection.getresponse()
                data = response.read()
            except TimeoutError:
                raise errors.BackendError(
                    f"the broker service at {self.socket} did not answer within {seconds:g} s"
                ) from None
            except OSError as exc:
                raise errors.BackendError(
                    f"the broker service at {self.socket} does not answer ({exc.strerror or exc})",
                    hint="start it: sandboxer serve",
                ) from None
        finally:
            connection.close()
        try:
            document = json.loads(data) if data else None
        except ValueError:
            raise errors.BackendError(f"the service answered HTTP {response.status} with no JSON") from None
        if response.status >= 400:
            _raise_for(document, response.status)
        return document

    def version(self) -> dict[str, Any]:
        """The service's version and API version."""
        result: dict[str, Any] = self._request("GET", "/v1/version")
        return result

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
        return ClientSandbox(self, Created.from_json(self._request("POST", "/v1/sandboxes", body)))

    def sandbox(self, sandbox_id: str) -> ClientSandbox:
        """The sandbox `sandbox_id` (not checked until it is used)."""
        return ClientSandbox(self, None, sandbox_id=sandbox_id)

    def list(self) -> list[SandboxInfo]:
        return [SandboxInfo.from_json(entry) for entry in self._request("GET", "/v1/sandboxes")["sandboxes"]]

    def gc(self) -> GcReport:
        return GcReport.from_json(self._request("POST", "/v1/gc"))


def _sent_bootstrap(path: str) -> dict[str, str]:
    """A bootstrap file as the service takes it from a client: read and checked here as the broker
    reads one (docs/bootstrap.md; the same errors), its path and base64 bytes."""
    import base64

    from sandboxer.core import bootstrap

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
        stdin: Stdin = b"",
        cwd: str | None = None,
        timeout: float | None = None,
        consumer: str | None = None,
        executable: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ClientExecStream:
        """Run `argv` and yield its output as it arrives; `.status` once the iteration ended.
        Leaving the iteration early closes the connection, and the service kills the exec."""
        options: dict[str, Any] = {"argv": list(argv)}
        for name, value in (("cwd", cwd), ("timeout", timeout), ("consumer", consumer), ("executable", executable)):
            if value is not None:
                options[name] = value
        if env:
            options["env"] = dict(env)
        return ClientExecStream(self.client, self.id, json.dumps(options).encode() + b"\n", stdin)

    def inspect(self) -> Evidence:
        return Evidence.from_json(self.client._request("GET", f"/v1/sandboxes/{self.id}"))

    def _require_known(self) -> None:
        """NotFoundError (4) unless the service lists the sandbox for this caller."""
        if self.id not in {info.id for info in self.client.list()}:
            raise errors.NotFoundError(f"no such sandbox: {self.id}")

    def dispatch_tool(self, lease: str, request_id: str, wait_seconds: int = 0) -> Dispatched:
        """Relay the request `request_id` of the tool-request lease `lease` to its endpoint, waiting
        up to `wait_seconds` for it; NotPendingError (75, retryable) when it is not there yet."""
        body = {"lease": lease, "request_id": request_id, "wait_seconds": wait_seconds}
        path = f"/v1/sandboxes/{self.id}/dispatch"
        timeout = max(self.client.timeout, wait_seconds + DISPATCH_MARGIN)  # it waits, then relays
        return Dispatched.from_json(self.client._request("POST", path, body, timeout=timeout))

    def teardown(self, *, discard: bool = False) -> Receipt:
        """Remove the sandbox; later calls return the same receipt (ResidueError, 6, on residue;
        UnexportedWorkError, 2, for work no export took out unless `discard`)."""
        if self._receipt is None:
            path = f"/v1/sandboxes/{self.id}?discard={'true' if discard else 'false'}"
            self._receipt = Receipt.from_json(self.client._request("DELETE", path))
        return self._receipt

    def export(self, format: str, destination: str) -> Exported:
        """Take the sandbox's work out to the new local `destination` (sandboxer.verbs): the
        service verifies it and sends it; it is written here, with this process's rights."""
        from sandboxer.commands.export_delivery import receive

        connection = _UnixConnection(self.client.socket, None)  # as long as git inside takes
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
                _raise_for(document, response.status)
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
                self.client._request("POST", f"/v1/sandboxes/{self.id}/export/confirm", {"token": token})
        return Exported.from_json({**summary, "destination": destination})


class ClientOwner:
    """The owner's verbs through the service (refused to a granted caller: PolicyError, 3)."""

    def __init__(self, client: Client) -> None:
        self.client = client

    def check(self, path: str) -> dict[str, object]:
        """Validate one owner file; its normalized meaning (ConfigError, 2, when invalid). Read in
        this process, with its own rights, as `sandboxer ext check` does: it needs nothing of the
        service's."""
        from sandboxer.commands.owner import check

        return check(path)

    def approve(self, name: str) -> Approval:
        """Approve the exact current bytes of an extension config, a profile or grants."""
        return Approval.from_json(self.client._request("POST", "/v1/owner/approve", {"name": name}))

    def revoke(self, name: str) -> Approval:
        """Withdraw an approval (not an error when there is none)."""
        return Approval.from_json(self.client._request("POST", "/v1/owner/revoke", {"name": name}))

    def list(self) -> list[OwnerEntry]:
        """Every owner file with its approval status, and every approval whose file is gone."""
        return owner_entries(self.client._request("GET", "/v1/owner/entries"))

    def runtime_digest(self, path: str, *, full: bool = False) -> RuntimeDigest:
        """The tree digest v1 of the runtime directory at the absolute `path`, read by the service
        (which does so only for a caller of its own account)."""
        body = {"path": path, "full": full}
        return RuntimeDigest.from_json(self.client._request("POST", "/v1/runtime/digest", body))


class ClientExecStream:
    """An exec's frames as ("stdout" | "stderr", bytes) pairs; `.status` at the end. `signal`
    sends its command a signal while it runs (from another thread, or between two chunks)."""

    def __init__(self, client: Client, sandbox_id: str, options: bytes, stdin: Stdin) -> None:
        self._client = client
        self._path = f"/v1/sandboxes/{sandbox_id}/exec"
        self._options = options  # the body's first line
        self._stdin = stdin
        self.status: int | None = None
        self._started = False
        self._named = threading.Event()  # the answer has named the exec (_exec_id), or it ended
        self._exec_id: str | None = None

    def signal(self, signum: int) -> bool:
        """Send SIGINT, SIGTERM or SIGHUP to the command and its session (on Docker it ends the
        exec, status 128+N, as a CLI client's does); False when the exec is not running."""
        checked_signal(signum)
        if not self._started or not self._named.wait(self._client.timeout):
            return False
        exec_id = self._exec_id
        if exec_id is None:
            return False
        body = {"signal": signal.Signals(signum).name}
        try:
            self._client._request("POST", f"{self._path}/{exec_id}/signal", body)
        except errors.NotFoundError:
            return False  # it has just ended
        return True

    def __iter__(self) -> Iterator[tuple[Stream, bytes]]:
        self._named.clear()
        self._started = True
        try:
            yield from self._frames()
        finally:
            self._exec_id = None
            self._named.set()

    def _frames(self) -> Iterator[tuple[Stream, bytes]]:
        connection = _UnixConnection(self._client.socket, None)  # an exec takes as long as it takes
        response: http.client.HTTPResponse | None = None
        body = _Body(self._options, self._stdin)
        try:
            try:
                connection.putrequest("POST", self._path)
                connection.putheader(*body.header())
                connection.endheaders()
                # The body (the command's stdin) goes in while the output comes out: a command
                # that writes before it has read all its input would otherwise wait on us forever.
                body.start(connection.sock)
                response = connection.getresponse()
            except OSError as exc:
                raise errors.BackendError(f"the broker service does not answer ({exc})") from None
            if response.status >= 400:
                data = response.read()
                _raise_for(json.loads(data) if data else None, response.status)
            self._exec_id = response.getheader(frames.EXEC_HEADER)
            self._named.set()
            reader = frames.FrameReader()
            while chunk := response.read1(65536):
                for kind, payload in reader.feed(chunk):
                    if kind == frames.END:
                        self._finish(json.loads(payload))
                        body.raise_failure()  # the command ran on the input read before it
                        return
                    yield ("stdout" if kind == frames.STDOUT else "stderr"), payload
            raise errors.BackendError("the service ended the exec's stream before its status")
        finally:
            if response is not None:
                response.close()
            body.stop(connection.sock)
            connection.close()

    def _finish(self, document: dict[str, Any]) -> None:
        if "error" in document:
            _raise_for(document, 500)
        self.status = int(document["status"])


class _Body:
    """An exec's request body, sent on a thread of its own while the answer is read: its options
    line, then its stdin — bytes with a Content-Length, or a binary file's chunks as they come
    (chunked transfer encoding). A closed connection ends it; a file that cannot be read ends it
    early (the command reads its end) and its failure is raised after the exec. A body of at
    most INLINE_BODY bytes is sent at once instead: a Unix socket's buffer holds it whole."""

    def __init__(self, options: bytes, stdin: Stdin) -> None:
        self._options = options
        self._data = stdin if isinstance(stdin, bytes) else None
        self._chunks = None if isinstance(stdin, bytes) else InputChunks(stdin)
        self._thread: threading.Thread | None = None

    def header(self) -> tuple[str, str]:
        if self._data is not None:
            return "Content-Length", str(len(self._options) + len(self._data))
        return "Transfer-Encoding", "chunked"  # a stream of unknown length

    def start(self, sock: socketlib.socket) -> None:
        if self._data is not None and len(self._options) + len(self._data) <= INLINE_BODY:
            self._send(sock)  # the socket's buffer takes it all at once: no thread needed
            return
        self._thread = threading.Thread(target=self._send, args=(sock,), daemon=True)
        self._thread.start()

    def _send(self, sock: socketlib.socket) -> None:
        with contextlib.suppress(OSError):
            if self._chunks is None:
                sock.sendall(self._options + (self._data or b""))
                return
            sock.sendall(b"%x\r\n%b\r\n" % (len(self._options), self._options))
            for chunk in self._chunks:
                sock.sendall(b"%x\r\n%b\r\n" % (len(chunk), chunk))
            sock.sendall(b"0\r\n\r\n")  # the end, also of a file that failed (raised after the exec)

    def raise_failure(self) -> None:
        if self._chunks is not None and self._chunks.failure is not None:
            raise self._chunks.failure

    def stop(self, sock: socketlib.socket | None) -> None:
        """End the sending (a send blocked on the connection, a wait for the caller's input)."""
        if self._thread is not None:
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socketlib.SHUT_RDWR)
            if self._chunks is not None:
                self._chunks.stop()
            self._thread.join()
        if self._chunks is not None:
            self._chunks.close()
