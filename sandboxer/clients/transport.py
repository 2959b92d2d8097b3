"""The client's side of HTTP on the service's Unix socket: requests and their error answers, and
an exec's stream — its body (options, then stdin) sent while its output frames are read
(docs/service.md has the framing). `sandboxer.clients.service` builds the verbs on it."""

from __future__ import annotations

import contextlib
import http.client
import json
import signal
import socket as socketlib
import threading
from collections.abc import Iterator
from typing import Any

from sandboxer import errors
from sandboxer.api.results import Receipt, Stream
from sandboxer.api.verbs import InputChunks, Stdin, checked_signal
from sandboxer.dirs import ROOT_SOCKET, Untrusted, check_peer
from sandboxer.service import frames

UNTRUSTED_HINT = "nothing was sent to it: a client talks only to a service of root or of its own account"
INLINE_BODY = 64 * 1024  # an exec body this small is sent without a thread (a Unix socket buffers more)


class ServiceHttp:
    """The service at the Unix socket `socket`; `timeout` bounds each request but a stream's."""

    def __init__(self, socket: str, timeout: float) -> None:
        self.socket = socket
        self.timeout = timeout

    def connection(self, timeout: float | None) -> http.client.HTTPConnection:
        """A new HTTP connection to the service (connected on its first request)."""
        return _UnixConnection(self.socket, timeout)

    def request(self, method: str, path: str, body: Any = None, *, timeout: float | None = None) -> Any:
        """One JSON request and its JSON answer; an error answer raised as its error class."""
        seconds = timeout or self.timeout
        connection = self.connection(seconds)
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
                    hint=not_answering_hint(self.socket),
                ) from None
        finally:
            connection.close()
        try:
            document = json.loads(data) if data else None
        except ValueError:
            raise errors.BackendError(f"the service answered HTTP {response.status} with no JSON") from None
        if response.status >= 400:
            raise_for(document, response.status)
        return document


def not_answering_hint(path: str) -> str:
    """What to do when no service answers on `path`: the system service is its owner's to start."""
    if path == ROOT_SOCKET:
        return "ask the owner of this host whether the sandboxer service runs: only its owner starts it"
    return "the sandboxer command starts a service for your own state dir when none answers"


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float | None) -> None:
        super().__init__("sandboxer", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        """Connect, and refuse a socket another account answers on before a byte is sent
        (sandboxer.dirs.check_peer, the CLI client's check): a request, a bootstrap credential
        or an exec's stdin goes only to a service of root or of this process's own account."""
        sock = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM | socketlib.SOCK_CLOEXEC)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self.path)
            check_peer(sock, self.path)
        except Untrusted as exc:
            sock.close()
            raise errors.UntrustedServiceError(f"{exc}; refused", hint=UNTRUSTED_HINT) from None
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def raise_for(document: Any, http_status: int) -> None:
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
    unexported = document.get("unexported")
    if isinstance(error, errors.UnexportedWorkError) and isinstance(unexported, list):
        error.unexported = tuple(str(item) for item in unexported)
    raise error


class ClientExecStream:
    """An exec's frames as ("stdout" | "stderr", bytes) pairs; `.status` at the end. `signal`
    sends its command a signal while it runs (from another thread, or between two chunks)."""

    def __init__(self, service: ServiceHttp, sandbox_id: str, options: bytes, stdin: Stdin) -> None:
        self._service = service
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
        if not self._started or not self._named.wait(self._service.timeout):
            return False
        exec_id = self._exec_id
        if exec_id is None:
            return False
        body = {"signal": signal.Signals(signum).name}
        try:
            self._service.request("POST", f"{self._path}/{exec_id}/signal", body)
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
        connection = self._service.connection(None)  # an exec takes as long as it takes
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
                raise_for(json.loads(data) if data else None, response.status)
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
            raise_for(document, 500)
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
