"""The one Docker Engine client of the broker: its HTTP API spoken over /var/run/docker.sock.

Every Engine call the broker makes goes through this module — create and teardown, gc's view of
the containers a broker made, the spool volumes, and every exec (sandboxer.backends.docker.execs).
It is HTTP/1.1 by hand rather than the Docker SDK (docs/docker.md says why). The
requests are few and fixed: one per call with `Connection: close`, plus the upgraded (hijacked)
connection an exec or an attach streams over. The endpoint is fixed too: never DOCKER_HOST from
the environment. The tests observe the Engine through the SDK, independently of this module.
"""

from __future__ import annotations

import json
import socket
import struct
import time

from sandboxer.host.ready import wait_ready

Socket = socket.socket

SOCKET = "/var/run/docker.sock"
API = "/v1.41"


class EngineError(Exception):
    """The Engine refused or failed."""


def _connect() -> Socket:
    """A stream socket to the Engine."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(SOCKET)
    except BaseException:
        sock.close()
        raise
    return sock


def _request(method: str, path: str, body: dict[str, object] | None = None) -> tuple[int, bytes]:
    payload = json.dumps(body).encode() if body is not None else b""
    sock = _connect()
    try:
        sock.settimeout(60)  # a daemon that never answers must not hang the broker
        head = f"{method} {API}{path} HTTP/1.1\r\nHost: docker\r\nConnection: close\r\n"
        head += f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        sock.sendall(head.encode() + payload)
        chunks = []
        while data := sock.recv(65536):
            chunks.append(data)
    finally:
        sock.close()
    raw = b"".join(chunks)
    header, _, content = raw.partition(b"\r\n\r\n")
    try:
        status = int(header.split(b" ", 2)[1])
    except (IndexError, ValueError):
        raise EngineError("the Engine sent a malformed response") from None
    if b"transfer-encoding: chunked" in header.lower():
        try:
            content = _dechunk(content)
        except ValueError:
            raise EngineError("the Engine sent a damaged response") from None
    return status, content


def _dechunk(data: bytes) -> bytes:
    out: list[bytes] = []
    i = 0
    while True:
        end = data.index(b"\r\n", i)
        size = int(data[i:end].split(b";")[0], 16)
        if size == 0:
            return b"".join(out)
        out.append(data[end + 2 : end + 2 + size])
        i = end + 2 + size + 2


def inspect_exec(exec_id: str) -> dict[str, object]:
    """The Engine's view of an exec (Running, ExitCode, Pid)."""
    status, content = _request("GET", f"/exec/{exec_id}/json")
    if status != 200:
        raise EngineError(f"exec inspect: HTTP {status}")
    result: dict[str, object] = json.loads(content)
    return result


def hijack(path: str, body: bytes) -> tuple[Socket, bytes]:
    """POST `path` asking for the raw stream (HTTP upgrade); returns the socket and what already
    arrived after the response head."""
    what = path.partition("?")[0]
    sock = _connect()
    try:
        head = f"POST {API}{path} HTTP/1.1\r\nHost: docker\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n"
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        sock.sendall(head.encode() + body)
        buffer = b""
        while b"\r\n\r\n" not in buffer:
            data = sock.recv(4096)
            if not data:
                raise EngineError(f"{what}: the Engine closed the connection")
            buffer += data
        header, _, buffer = buffer.partition(b"\r\n\r\n")
        status = header.split(b" ", 2)[1] if header.count(b" ") >= 1 else b"?"
        if status not in (b"101", b"200"):
            raise EngineError(f"{what}: HTTP {status.decode(errors='replace')}")
    except BaseException:
        sock.close()
        raise
    return sock, buffer


def frames(buffer: bytes) -> tuple[list[tuple[int, bytes]], bytes]:
    """Split the multiplexed stream (8-byte headers: stream, 3 zero bytes, size) into whole
    frames and the incomplete rest."""
    frames = []
    while len(buffer) >= 8:
        stream, size = buffer[0], struct.unpack(">I", buffer[4:8])[0]
        if len(buffer) < 8 + size:
            break
        frames.append((stream, buffer[8 : 8 + size]))
        buffer = buffer[8 + size :]
    return frames, buffer


def attach(container: str) -> tuple[Socket, bytes]:
    """Attach to a created container's stdout before it starts (nothing it writes is missed)."""
    return hijack(f"/containers/{container}/attach?stream=1&stdout=1&stderr=1", b"")


def read_until(attached: tuple[Socket, bytes], mark: bytes, *, timeout: float, limit: int = 1 << 20) -> bytes:
    """What the container writes to stdout before the line `mark`; closes the attachment."""
    sock, buffer = attached
    deadline = time.monotonic() + timeout
    out = bytearray()
    try:
        while True:
            ready_frames, buffer = frames(buffer)
            out += b"".join(payload for stream, payload in ready_frames if stream == 1)
            end = out.find(b"\n" + mark + b"\n")
            if end >= 0:
                return bytes(out[: end + 1])
            remaining = deadline - time.monotonic()
            if remaining <= 0 or len(out) > limit:
                raise EngineError("the container's probe did not finish")
            ready, _ = wait_ready([sock.fileno()], timeout=remaining)
            data = sock.recv(65536) if ready else b""
            if ready and not data:
                raise EngineError("the container's output ended before its probe finished")
            buffer += data
    finally:
        sock.close()


def remove_container(container: str) -> str | None:
    """Remove a container and its anonymous volumes: None when removed now, "gone" when it
    already was, else what went wrong.

    Teardown uses this rather than the SDK, whose import costs more than the removal.
    """
    try:
        status, _ = _request("DELETE", f"/containers/{container}?force=true&v=true")
    except OSError as exc:
        return f"the Engine cannot be reached ({exc.strerror})"
    if status == 404:
        return "gone"
    return None if status == 204 else f"the Engine answered HTTP {status}"


def remove_labelled(container: str, labels: dict[str, str]) -> str | None:
    """Remove a container (as remove_container) only when it carries every one of `labels`: a
    container id read from a record is not trusted to be the sandbox's (teardown and gc of a
    forged record never remove another broker's container, or one nobody's broker made). A
    container that does not carry them is left alone: "not this sandbox's container"."""
    if not all(c in "0123456789abcdef" for c in container) or not 12 <= len(container) <= 64:
        return "not a container id, left alone"
    try:
        status, content = _request("GET", f"/containers/{container}/json")
    except OSError as exc:
        return f"the Engine cannot be reached ({exc.strerror})"
    if status == 404:
        return "gone"
    if status != 200:
        return f"the Engine answered HTTP {status}"
    config = json.loads(content).get("Config") or {}
    found = config.get("Labels") or {}
    if not isinstance(found, dict) or any(found.get(key) != value for key, value in labels.items()):
        return "not this sandbox's container (its labels say otherwise), left alone"
    return remove_container(container)


def request(method: str, path: str, body: dict[str, object] | None = None) -> tuple[int, bytes]:
    """One Engine API call (status, body); raises OSError when the Engine does not answer."""
    return _request(method, path, body)


def ping() -> bool:
    """Whether the Engine answers."""
    try:
        status, _ = _request("GET", "/_ping")
    except (OSError, EngineError):
        return False
    return status == 200


def containers(label: str) -> list[dict[str, object]]:
    """Every container, running or not, carrying `label` (`key=value`), as the Engine lists them."""
    filters = quote(json.dumps({"label": [label]}))
    status, content = _request("GET", f"/containers/json?all=1&filters={filters}")
    if status != 200:
        raise EngineError(f"container list: HTTP {status}")
    found: list[dict[str, object]] = json.loads(content)
    return found


def quote(text: str) -> str:
    """`text` percent-encoded for a query string (urllib.parse costs milliseconds to import)."""
    safe = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
    return "".join(c if c in safe else "".join(f"%{b:02X}" for b in c.encode()) for c in text)
