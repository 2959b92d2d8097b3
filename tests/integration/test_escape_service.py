"""Probes of a root service by the local accounts around it (issue 31): what one account sends
cannot wipe the audit log, a malformed request is a JSON refusal with its audit line (never an
unhandled 500), a grant withdrawn while a create runs stops it, and a client that leaves early
is an audit line, not a traceback in the service's log.

Real services (`sandboxer serve` as root), real accounts (useradd), raw requests on the real
Unix socket.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sandboxer import Client
from sandboxer.service.audit import REFUSAL_BURST, REFUSALS_PER_SECOND
from tests.integration.conftest import SandboxBroker
from tests.integration.services import Service

_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
FLOODER, GRANTEE = f"sbxflood{_WORKER}", f"sbxgrantee{_WORKER}"


def _socket_dir(broker: SandboxBroker) -> Path:
    directory = broker.root / "svc"
    directory.mkdir(exist_ok=True)
    directory.chmod(0o755)  # any account may reach the socket: the service tells callers apart
    return directory


@pytest.fixture(scope="module")
def accounts() -> Iterator[tuple[pwd.struct_passwd, pwd.struct_passwd]]:
    """Two real accounts: one that floods, one that an owner grants (removed afterwards)."""
    if os.geteuid() != 0:
        pytest.skip("creating test accounts needs root (CI runs as root)")
    for name in (FLOODER, GRANTEE):
        subprocess.run(["userdel", name], capture_output=True, check=False)
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
    try:
        yield pwd.getpwnam(FLOODER), pwd.getpwnam(GRANTEE)
    finally:
        for name in (FLOODER, GRANTEE):
            subprocess.run(["userdel", name], check=False)


@pytest.fixture
def served(sb_root: SandboxBroker) -> Iterator[Service]:
    started = Service(sb_root, _socket_dir(sb_root) / "broker.sock").start()
    try:
        yield started
    finally:
        started.stop()


def _as_account(account: pwd.struct_passwd, code: str, *args: str, timeout: float = 300) -> str:
    """`code` run by the account (its uid and gid, no other groups): its stdout."""
    ids = [str(account.pw_uid), str(account.pw_gid)]
    argv = ["setpriv", "--reuid", ids[0], "--regid", ids[1], "--clear-groups", "--", sys.executable, "-c", code, *args]
    env = {"PATH": "/usr/bin:/bin", "HOME": "/", "LANG": "C.UTF-8", "PYTHONPATH": str(Path(__file__).parents[2])}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def audit_lines(broker: SandboxBroker) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (broker.state / "audit.log").read_text().splitlines()]


# One keep-alive connection, request after request, as fast as the service answers: how many
# were answered, by status.
FLOOD = r"""
import collections, socket, sys
path, count = sys.argv[1], int(sys.argv[2])
answered = collections.Counter()
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect(path)
stream = sock.makefile("rb")
for _ in range(count):
    sock.sendall(b"GET /v1/sandboxes HTTP/1.1\r\nHost: x\r\n\r\n")
    status = int(stream.readline().split()[1])
    length = 0
    while (line := stream.readline()) != b"\r\n":
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    stream.read(length)
    answered[status] += 1
print(dict(answered))
"""


def test_one_accounts_flood_of_refusals_cannot_wipe_the_audit_log(
    sb_root: SandboxBroker, served: Service, accounts: tuple[pwd.struct_passwd, pwd.struct_passwd]
) -> None:
    """Thousands of refusals from one real account: its lines stay within its rate (the rest are
    counted in one line), the log stays small, and what another account did before is still
    there."""
    flooder, _ = accounts
    before = Client(str(served.socket)).create(sb_root.profile)
    requests = 3000
    started = time.monotonic()
    answered = _as_account(flooder, FLOOD, str(served.socket), str(requests))
    seconds = time.monotonic() - started
    assert answered.strip() == f"{{403: {requests}}}"
    written = [line for line in audit_lines(sb_root) if line["uid"] == flooder.pw_uid]
    assert len(written) <= REFUSAL_BURST + seconds * REFUSALS_PER_SECOND + 1, "the flood was logged line by line"
    assert (sb_root.state / "audit.log").stat().st_size < 64 * 1024
    served.stop()  # what was counted is written when the service stops
    lines = audit_lines(sb_root)
    assert (0, "create", before.id, "ok") in [(x["uid"], x["verb"], x["sandbox"], x["outcome"]) for x in lines]
    flood = [line for line in lines if line["uid"] == flooder.pw_uid]
    assert {(x["verb"], x["outcome"], x["status"]) for x in flood} == {("refused", "PolicyError", 3)}
    assert sum(line.get("suppressed", 1) for line in flood) == requests  # every one counted, once
    assert sb_root.run("teardown", before.id).status == 0
