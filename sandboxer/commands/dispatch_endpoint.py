"""The trusted endpoint's side of `dispatch-tool` (sandboxer.commands.dispatch): the one-line JSON frame
sent to the lease's endpoint socket, and the correlated response read back, within fixed time
and size limits; and the strict JSON every request and response must be."""

from __future__ import annotations

import json
import os
import socket
import stat
from typing import Any

from sandboxer.core import strictjson
from sandboxer.core.reading import open_beneath
from sandboxer.core.strictjson import JsonObject
from sandboxer.errors import PolicyError

RESPONSE = ("version", "run_id", "lease_id", "consumer", "request_id", "payload")
MAX_RESPONSE_BYTES = 1024 * 1024
CONNECT_SECONDS = 5.0
WRITE_SECONDS = 5.0
READ_SECONDS = 30.0


class Refused(PolicyError):
    """A terminal refusal of one request (exit 3)."""

    kind = "refused"


def strict_json(data: bytes, what: str) -> JsonObject:
    try:
        document = strictjson.document(data)
    except strictjson.Malformed:
        raise Refused(f"{what}: not one valid JSON object") from None
    if not isinstance(document, JsonObject) or document.duplicates:
        raise Refused(f"{what}: must be one JSON object without duplicate keys")
    return document


def canonical(document: dict[str, Any]) -> bytes:
    """The bytes a fingerprint is taken of: sorted keys, no spaces, UTF-8."""
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def relay(request: dict[str, Any], *, run_dir: str, endpoint: str, owner: int) -> dict[str, Any]:
    """One newline-terminated frame, write-side EOF, then the whole response; ConnectionError
    for transport failures, Refused for a response that is not the correlated one."""
    frame = canonical(request) + b"\n"
    endpoint_fd = _open_endpoint(run_dir, endpoint, owner)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(CONNECT_SECONDS)
            sock.connect(f"/proc/self/fd/{endpoint_fd}")  # the very socket checked, not a path anew
            sock.settimeout(WRITE_SECONDS)
            sock.sendall(frame)
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(READ_SECONDS)
            chunks, size = [], 0
            while data := sock.recv(65536):
                size += len(data)
                if size > MAX_RESPONSE_BYTES:
                    raise Refused(f"the endpoint's response is larger than {MAX_RESPONSE_BYTES} bytes")
                chunks.append(data)
    except TimeoutError:
        raise ConnectionError("timed out") from None
    except OSError as exc:
        raise ConnectionError(exc.strerror or type(exc).__name__) from None
    finally:
        os.close(endpoint_fd)
    raw = b"".join(chunks)
    if not raw:
        raise ConnectionError("the endpoint closed without answering")
    response = strict_json(raw.rstrip(b"\n"), "the endpoint's response")
    if sorted(response) != sorted(RESPONSE):
        raise Refused(f"the endpoint's response must have exactly the fields {', '.join(RESPONSE)}")
    for key in ("version", "run_id", "lease_id", "consumer", "request_id"):
        if response[key] != request[key]:
            raise Refused(f"the endpoint's response does not correlate ({key} differs)")
    return dict(response)


def _open_endpoint(run_dir: str, endpoint: str, owner: int) -> int:
    """The endpoint socket, opened below the run directory without following any symlink on the
    whole path, and still a socket of the assignment's owner."""
    try:
        fd = open_beneath(run_dir, endpoint, strict_root=True)
    except OSError as exc:
        raise ConnectionError(f"the endpoint cannot be opened ({exc.strerror})") from None
    info = os.fstat(fd)
    if not stat.S_ISSOCK(info.st_mode) or info.st_uid != owner:
        os.close(fd)
        raise Refused("the endpoint is no longer the owner's socket")
    return fd
