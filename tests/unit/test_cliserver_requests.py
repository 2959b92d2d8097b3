"""The CLI protocol's request as the service reads it (sandboxer/service/cliserver.py): over a
real socket pair, with real descriptors; every malformed request is refused whole and every
descriptor it passed is closed."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxer.core.reading import CallerFile, UnfitFile, read_caller_file
from sandboxer.errors import UsageError
from sandboxer.service.cliserver import _files, _receive

GOOD = {"argv": ["list"], "cwd": "/", "env": {}}


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    client, service = socket.socketpair()
    try:
        yield client, service
    finally:
        client.close()
        service.close()


def _open_fds() -> set[int]:
    return {int(name) for name in os.listdir("/proc/self/fd")}


def _send(client: socket.socket, request: object, extra: int = 0, *, magic: bytes = b"\0") -> list[int]:
    """Send `request` with stdio (three pipe ends) and `extra` more descriptors; return what was sent."""
    read_end, write_end = os.pipe()
    sent = [read_end, write_end, write_end] + [os.open("/dev/null", os.O_RDONLY) for _ in range(extra)]
    socket.send_fds(client, [magic + json.dumps(request).encode() + b"\n"], sent)
    for fd in set(sent):
        os.close(fd)
    return sent


def test_a_request_with_a_file_the_client_opened(pair: tuple[socket.socket, socket.socket]) -> None:
    client, service = pair
    files = [
        {"name": "b.json", "path": "/home/a/b.json", "errno": 0},
        {"name": "gone", "path": "/home/a/gone", "errno": 2},
    ]
    _send(client, {**GOOD, "files": files}, extra=1)
    request, fds = _receive(service, time.monotonic() + 5)
    try:
        assert len(fds) == 4
        opened = _files(request, fds)
        assert opened["b.json"].path == "/home/a/b.json"
        assert opened["b.json"].fd == fds[3]
        assert (opened["gone"].fd, opened["gone"].errno) == (None, 2)
    finally:
        for fd in fds:
            os.close(fd)


def test_a_request_without_files_has_none(pair: tuple[socket.socket, socket.socket]) -> None:
    client, service = pair
    _send(client, GOOD)
    request, fds = _receive(service, time.monotonic() + 5)
    for fd in fds:
        os.close(fd)
    assert request["files"] == []
    assert len(fds) == 3


BAD: list[tuple[object, int, str]] = [
    ({**GOOD, "files": [{"name": "x", "path": "/x", "errno": 0}]}, 0, "one descriptor is passed for each file"),
    ({**GOOD, "files": []}, 1, "one descriptor is passed for each file"),
    ({**GOOD, "files": [{"name": "x", "path": "relative", "errno": 0}]}, 1, "files: must be a list"),
    ({**GOOD, "files": [{"name": "x", "path": "/x", "errno": -1}]}, 0, "files: must be a list"),
    ({**GOOD, "files": [{"name": "x", "path": "/x", "errno": True}]}, 0, "files: must be a list"),
    ({**GOOD, "files": [{"name": "x", "path": "/x", "errno": 2**40}]}, 0, "files: must be a list"),
    ({**GOOD, "files": [{"name": "x", "path": "/x", "errno": 0, "mode": 1}]}, 1, "files: must be a list"),
    ({**GOOD, "files": {"x": 0}}, 1, "files: must be a list"),
    ({**GOOD, "more": 1}, 0, "a CLI request is an object of"),
    ({**GOOD, "files": []}, 5, "more descriptors than stdio"),
]


@pytest.mark.parametrize(("request_", "extra", "reason"), BAD)
def test_a_malformed_request_is_refused_and_its_descriptors_closed(
    pair: tuple[socket.socket, socket.socket], request_: object, extra: int, reason: str
) -> None:
    client, service = pair
    before = _open_fds()
    _send(client, request_, extra)
    with pytest.raises(UsageError) as refused:
        _receive(service, time.monotonic() + 5)
    assert reason in str(refused.value)
    assert _open_fds() == before


def test_a_request_without_the_nul_is_refused(pair: tuple[socket.socket, socket.socket]) -> None:
    client, service = pair
    before = _open_fds()
    _send(client, GOOD, magic=b"G")
    with pytest.raises(UsageError, match="starts with NUL"):
        _receive(service, time.monotonic() + 5)
    assert _open_fds() == before


def test_a_passed_descriptor_is_read_only_as_a_file_it_may_read(tmp_path: Path) -> None:
    """What the service reads of a client's descriptor: a regular, owner-only file open for
    reading; anything else is the one-line reason, never a crash."""

    path = tmp_path / "b.json"
    path.write_bytes(b"{}")
    path.chmod(0o600)
    for flags, reason in ((os.O_WRONLY, "cannot be read (Bad file descriptor)"), (os.O_PATH, "cannot be read")):
        fd = os.open(path, flags)
        try:
            with pytest.raises(UnfitFile) as refused:
                read_caller_file(CallerFile(str(path), fd=fd), 100)
            assert refused.value.reason.startswith(reason)
        finally:
            os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert read_caller_file(CallerFile(str(path), fd=fd), 100) == b"{}"
    finally:
        os.close(fd)
    with pytest.raises(UnfitFile, match="cannot be read"):
        read_caller_file(CallerFile(str(path), errno=2**40), 100)
