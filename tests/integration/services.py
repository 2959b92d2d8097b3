"""A `sandboxer serve` process for a test broker's directories, started and stopped by the test."""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.integration.conftest import SandboxBroker

UNPRIVILEGED_UID = 65534
READY = b"sandboxer: serving "  # the line `serve` writes once it serves


class UnixConnection(http.client.HTTPConnection):
    """HTTP/1.1 to a service's Unix socket."""

    def __init__(self, path: Path) -> None:
        super().__init__("localhost", timeout=120)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(self._path))


class Service:
    """One `sandboxer serve` process for a broker's directories."""

    def __init__(self, broker: SandboxBroker, socket_path: Path, *options: str) -> None:
        self.broker = broker
        self.socket = socket_path
        self.options = options  # more `serve` options
        self.log = broker.root / f"serve-{time.monotonic_ns()}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> Service:
        # This service, on its own socket, is the one the test talks to: the broker's CLI runs
        # in-process beside it (an unprivileged one would start a private service otherwise),
        # and the service a fixture started for the broker's CLI gives way to it.
        self.broker.through_service = False
        if self.broker.service is not None:
            self.broker.service.stop()
            self.broker.service = None
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                self.broker.argv("serve", "--socket", str(self.socket), *self.options),
                stdout=log,
                stderr=log,
                env={**self.broker.env(), **self.broker.service_env},
            )
        # Ready is the service's own line, written once live sandboxes' egress and published
        # ports are served again; its socket accepts (into the backlog) before that.
        deadline = time.monotonic() + 20
        while not (answers(self.socket) and READY in self.log.read_bytes()):
            assert self.process.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, "the service never answered"
            time.sleep(0.05)
        return self

    def stop(self, signum: int = signal.SIGTERM) -> int:
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signum)
        return self.process.wait(timeout=30)


def answers(path: Path) -> bool:
    """Whether something accepts connections on the socket at `path`."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


@contextlib.contextmanager
def as_service_account(broker: SandboxBroker) -> Iterator[None]:
    """The block's sandboxer.Client calls made as the account the broker's service runs as: a
    client trusts only a service of root or of its own account, so root's test process talks to
    an unprivileged broker's service as that account (its effective ids; set back after)."""
    if not broker.as_user:
        yield
        return

    os.setegid(UNPRIVILEGED_UID)
    os.seteuid(UNPRIVILEGED_UID)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)
