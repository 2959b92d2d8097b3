"""`Client(timeout=...)` bounds each request: a service that accepts and never answers ends the
request with one line that names the socket and the timeout (a real socket, nothing behind it)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from sandboxer import Client
from sandboxer.errors import BackendError


def test_a_request_past_the_clients_timeout_fails_with_one_line(tmp_path: Path) -> None:
    path = tmp_path / "silent.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(path))
        server.listen()  # the kernel accepts the connection; nobody ever reads or answers
        client = Client(str(path), timeout=0.5)
        assert (client.socket, client.timeout) == (str(path), 0.5)
        with pytest.raises(BackendError) as failed:
            client.list()
        assert failed.value.message == f"the broker service at {path} did not answer within 0.5 s"
        assert failed.value.status == 5


def test_no_service_at_the_socket_is_said_with_a_hint(tmp_path: Path) -> None:
    path = tmp_path / "nothing.sock"
    with pytest.raises(BackendError) as failed:
        Client(str(path), timeout=5).list()
    assert failed.value.message.startswith(f"the broker service at {path} does not answer (")
    assert failed.value.hint == "the sandboxer command starts a service for your own state dir when none answers"
