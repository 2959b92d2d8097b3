"""`exec` on the Docker backend: the Engine API spoken directly over its Unix socket.

The Docker SDK (requests, urllib3) costs more to import than a `docker exec` takes, so the hot
path talks HTTP/1.1 to /var/run/docker.sock itself: create the exec, start it with an upgraded
(hijacked) connection, pump stdin in and demultiplex stdout/stderr frames out as they arrive,
then read the exit code. The command runs under `env -i`, so its environment is exactly the
plan's: nothing of the container's (Docker adds HOSTNAME) or of the caller's.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import struct
import threading
import time
from typing import Any

SOCKET = "/var/run/docker.sock"
API = "/v1.41"


class EngineError(Exception):
    """The Engine refused or failed."""


def _connect() -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(SOCKET)
    return sock


def _request(method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, bytes]:
    payload = json.dumps(body).encode() if body is not None else b""
    with _connect() as sock:
        sock.settimeout(60)  # a daemon that never answers must not hang the broker
        head = f"{method} {API}{path} HTTP/1.1\r\nHost: docker\r\nConnection: close\r\n"
        head += f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        sock.sendall(head.encode() + payload)
        chunks = []
        while data := sock.recv(65536):
            chunks.append(data)
    raw = b"".join(chunks)
    header, _, content = raw.partition(b"\r\n\r\n")
    status = int(header.split(b" ", 2)[1])
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


def create_exec(container: str, argv: list[str], *, env: dict[str, str], user: str, cwd: str) -> str:
    """Create an exec of `argv` under `env -i`; returns its id."""
    if "=" in argv[0]:
        raise EngineError("a program name with '=' cannot be run through env -i")
    # env -C: a cwd that does not exist is env's own failure (status 125, like the bwrap path),
    # not an OCI error text on stdout.
    command = ["/usr/bin/env", "-i", "-C", cwd, "--", *(f"{k}={v}" for k, v in env.items()), *argv]
    body = {
        "AttachStdin": True,
        "AttachStdout": True,
        "AttachStderr": True,
        "Tty": False,
        "Cmd": command,
        "User": user,
        "WorkingDir": "/",
        "Privileged": False,
    }
    status, content = _request("POST", f"/containers/{container}/exec", body)
    if status != 201:
        raise EngineError(f"exec create: HTTP {status}")
    return str(json.loads(content)["Id"])


def inspect_exec(exec_id: str) -> dict[str, Any]:
    """The Engine's view of an exec (Running, ExitCode, Pid)."""
    status, content = _request("GET", f"/exec/{exec_id}/json")
    if status != 200:
        raise EngineError(f"exec inspect: HTTP {status}")
    result: dict[str, Any] = json.loads(content)
    return result


def _pump_stdin(sock: socket.socket, stdin: int) -> None:
    try:
        while data := os.read(stdin, 65536):
            sock.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)


def run(exec_id: str, *, stdin: int, stdout: int, stderr: int, timeout: float | None) -> bool:
    """Start the exec and stream until it ends; False if `timeout` expired first."""
    sock = _connect()
    try:
        body = json.dumps({"Detach": False, "Tty": False}).encode()
        head = f"POST {API}/exec/{exec_id}/start HTTP/1.1\r\nHost: docker\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n"
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        sock.sendall(head.encode() + body)
        buffer = b""
        while b"\r\n\r\n" not in buffer:
            data = sock.recv(4096)
            if not data:
                raise EngineError("exec start: the Engine closed the connection")
            buffer += data
        header, _, buffer = buffer.partition(b"\r\n\r\n")
        if int(header.split(b" ", 2)[1]) not in (101, 200):
            raise EngineError(f"exec start: HTTP {header.split(b' ', 2)[1].decode()}")
        threading.Thread(target=_pump_stdin, args=(sock, stdin), daemon=True).start()
        deadline = None if timeout is None else time.monotonic() + timeout
        targets = {1: stdout, 2: stderr}
        while True:
            while len(buffer) >= 8:
                stream, size = buffer[0], struct.unpack(">I", buffer[4:8])[0]
                if len(buffer) < 8 + size:
                    break
                payload, buffer = buffer[8 : 8 + size], buffer[8 + size :]
                fd = targets.get(stream)
                view = memoryview(payload)
                while fd is not None and view:
                    view = view[os.write(fd, view) :]
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            ready, _, _ = select.select([sock], [], [], remaining)
            if not ready:
                continue
            data = sock.recv(65536)
            if not data:
                if buffer:
                    raise EngineError("the Engine closed the stream in the middle of a frame")
                return True
            buffer += data
    finally:
        sock.close()


def capture(container: str, argv: list[str], *, env: dict[str, str], user: str, cwd: str = "/") -> bytes:
    """Run a short command in the container and return its stdout (the create-time probe)."""
    exec_id = create_exec(container, argv, env=env, user=user, cwd=cwd)
    output = os.memfd_create("sandboxer-probe", os.MFD_CLOEXEC)
    devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        finished = run(exec_id, stdin=devnull, stdout=output, stderr=devnull, timeout=30)
        os.lseek(output, 0, os.SEEK_SET)
        data = os.read(output, 1 << 20)
    finally:
        os.close(output)
        os.close(devnull)
    if not finished or exit_code(exec_id) != 0:
        raise EngineError(f"probe {argv[0]} failed in the container")
    return data


def exit_code(exec_id: str, *, wait: float = 10.0) -> int:
    """The exit code of a finished exec (the Engine may need a moment to record it)."""
    deadline = time.monotonic() + wait
    while True:
        state = inspect_exec(exec_id)
        if not state.get("Running") or time.monotonic() > deadline:
            code = state.get("ExitCode")
            return int(code) if isinstance(code, int) else 125
        time.sleep(0.002)


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


def engine_get(path: str) -> tuple[int, bytes]:
    """GET an Engine API path (status, body); raises OSError when the Engine does not answer."""
    return _request("GET", path)
