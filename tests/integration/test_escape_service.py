"""Probes of a root service by the local accounts around it (issue 31): what one account sends
cannot wipe the audit log, a malformed request is a JSON refusal with its audit line (never an
unhandled 500), a grant withdrawn while a create runs stops it, and a client that leaves early
is an audit line, not a traceback in the service's log.

Real services (`sandboxer serve` as root), real accounts (useradd), raw requests on the real
Unix socket.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import os
import pwd
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandboxer import Client
from sandboxer.service.audit import REFUSAL_BURST, REFUSALS_PER_SECOND
from tests.integration.conftest import SandboxBroker
from tests.integration.services import Service
from tests.integration.test_escape_support import loop_backing_files, mount_points

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


def _account_argv(account: pwd.struct_passwd, code: str, *args: str) -> tuple[list[str], dict[str, str]]:
    """What runs `code` as the account (its uid and gid, no other groups), and its environment."""
    ids = [str(account.pw_uid), str(account.pw_gid)]
    argv = ["setpriv", "--reuid", ids[0], "--regid", ids[1], "--clear-groups", "--", sys.executable, "-c", code, *args]
    env = {"PATH": "/usr/bin:/bin", "HOME": "/", "LANG": "C.UTF-8", "PYTHONPATH": str(Path(__file__).parents[2])}
    return argv, env


def _as_account(account: pwd.struct_passwd, code: str, *args: str, timeout: float = 300) -> str:
    """`code` run by the account: its stdout."""
    argv, env = _account_argv(account, code, *args)
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def audit_lines(broker: SandboxBroker) -> list[dict[str, Any]]:
    path = broker.state / "audit.log"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# One keep-alive connection, request after request, as fast as the service answers: how many
# were answered, by status; then CLI requests the service cannot read (a NUL, no descriptors),
# each on a connection of its own, until the service closes it.
FLOOD = r"""
import collections, socket, sys
path, count, cli_count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for _ in range(cli_count):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as cli:
        cli.connect(path)
        cli.sendall(b"\0{}\n")
        cli.recv(1)
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
    """Thousands of refusals from one real account, through HTTP and the CLI protocol: its lines
    stay within its rate (the rest are counted, every one, in a line per verb and outcome), the
    log stays small, and what another account did before is still there."""
    flooder, _ = accounts
    before = Client(str(served.socket)).create(sb_root.profile)
    requests, cli_requests = 3000, 300
    started = time.monotonic()
    answered = _as_account(flooder, FLOOD, str(served.socket), str(requests), str(cli_requests))
    seconds = time.monotonic() - started
    assert answered.strip() == f"{{403: {requests}}}"
    written = [line for line in audit_lines(sb_root) if line["uid"] == flooder.pw_uid]
    assert len(written) <= REFUSAL_BURST + seconds * REFUSALS_PER_SECOND + 1, "the flood was logged line by line"
    assert (sb_root.state / "audit.log").stat().st_size < 64 * 1024
    served.stop()  # what was counted is written when the service stops
    lines = audit_lines(sb_root)
    assert (0, "create", before.id, "ok") in [(x["uid"], x["verb"], x["sandbox"], x["outcome"]) for x in lines]
    flood = [line for line in lines if line["uid"] == flooder.pw_uid]
    counted = collections.Counter()
    for line in flood:
        counted[line["verb"], line["outcome"], line["status"]] += line.get("suppressed", 1)
    assert counted == {("refused", "PolicyError", 3): requests, ("cli", "UsageError", 2): cli_requests}
    assert sb_root.run("teardown", before.id).status == 0


# ------------------------------------------------------------------------ malformed requests


def raw(path: Path, data: bytes, *, end_after: bool = False) -> tuple[int, bytes, bytes]:
    """Send `data` on a new connection (and end the sending side with `end_after`): the answer's
    status, head and body (all of it, until the service closes)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(str(path))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # it stopped reading: its answer is there
            sock.sendall(data)
            if end_after:
                sock.shutdown(socket.SHUT_WR)
        answer = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1]) if head.startswith(b"HTTP/1.") else 0
    return status, head, body


def post(route: str, body: bytes, *, headers: str = "Content-Type: application/json\r\n") -> bytes:
    head = f"POST {route} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{headers}Content-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


def _envelope(body: bytes) -> dict[str, Any]:
    document = json.loads(body)
    assert set(document) == {"error"}, document
    error: dict[str, Any] = document["error"]
    assert set(error) == {"kind", "message", "hint", "status"}, error
    return error


def _audited(broker: SandboxBroker, before: int, *, timeout: float = 10) -> list[dict[str, Any]]:
    """The audit lines written since the log had `before` lines (waiting a little: a line is
    written once its answer is sent)."""
    deadline = time.monotonic() + timeout
    while True:
        new = audit_lines(broker)[before:]
        if new or time.monotonic() > deadline:
            return new
        time.sleep(0.05)


def _malformed(sandbox_id: str) -> dict[str, tuple[bytes, int, str, str]]:
    """Each malformed request: its bytes, the HTTP status, the error's kind and the audit verb."""
    exec_route = f"/v1/sandboxes/{sandbox_id}/exec"
    deep = b"[" * 200_000 + b"]" * 200_000
    return {
        "not an object": (post("/v1/sandboxes", b"[1, 2]"), 400, "UsageError", "create"),
        "a field of the wrong type": (post("/v1/sandboxes", b'{"profile": {"a": 1}}'), 400, "UsageError", "create"),
        "not UTF-8": (post("/v1/sandboxes", b'{"profile": "\xff\xfe"}'), 400, "UsageError", "create"),
        "a charset nobody has": (
            post("/v1/sandboxes", b'{"profile": "x"}', headers="Content-Type: application/json; charset=nope\r\n"),
            400,
            "UsageError",
            "create",
        ),
        "not JSON's Content-Type": (
            post("/v1/sandboxes", b"\x00\x01", headers="Content-Type: application/octet-stream\r\n"),
            400,
            "UsageError",
            "create",
        ),
        "nested too deep": (post("/v1/sandboxes", deep), 400, "UsageError", "create"),
        "too large": (post("/v1/owner/approve", b" " * (17 * 1024 * 1024)), 400, "UsageError", "ext-approve"),
        "an unknown route": (
            b"GET /v1/nothing-here HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            404,
            "NotFoundError",
            "unknown",
        ),
        "an unknown version": (
            b"GET /v2/sandboxes HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            404,
            "NotFoundError",
            "unknown",
        ),
        "a wrong method": (
            b"PUT /v1/sandboxes HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 0\r\n\r\n",
            405,
            "UsageError",
            "unknown",
        ),
        "exec: a timeout of text": (
            post(exec_route, b'{"argv": ["true"], "timeout": "soon"}\n'),
            400,
            "UsageError",
            "exec",
        ),
        "exec: a timeout of a list": (
            post(exec_route, b'{"argv": ["true"], "timeout": [1]}\n'),
            400,
            "UsageError",
            "exec",
        ),
        "exec: a cwd of an object": (
            post(exec_route, b'{"argv": ["true"], "cwd": {"a": 1}}\n'),
            400,
            "UsageError",
            "exec",
        ),
        "exec: options nested too deep": (post(exec_route, deep[:500_000] + b"\n"), 400, "UsageError", "exec"),
        "exec: options not UTF-8": (post(exec_route, b'{"argv": ["\xff"]}\n'), 400, "UsageError", "exec"),
        "signal: not JSON": (post(f"{exec_route}/{'0' * 32}/signal", b"{"), 400, "UsageError", "exec-signal"),
        "a bad request line": (b"NOT HTTP AT ALL\r\n\r\n", 400, "UsageError", "unknown"),
        "a bad header": (b"GET /v1/sandboxes HTTP/1.1\r\nHost x\r\n\r\n", 400, "UsageError", "unknown"),
        "a bad chunk": (
            b"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            400,
            "UsageError",
            "unknown",
        ),
    }


def test_every_malformed_request_is_a_json_refusal_with_one_audit_line(sb_root: SandboxBroker, served: Service) -> None:
    sandbox = Client(str(served.socket)).create(sb_root.profile)
    seen = {}
    for name, (data, status, kind, verb) in _malformed(sandbox.id).items():
        before = len(audit_lines(sb_root))
        answered, head, body = raw(served.socket, data)
        try:
            error = _envelope(body)
        except ValueError:
            error = {"kind": None, "status": None, "message": body[:80]}
        lines = _audited(sb_root, before)
        seen[name] = (
            answered,
            b"application/json" in head.lower(),
            error["kind"],
            [(x["verb"], x["outcome"]) for x in lines],
        )
        expected = (status, True, kind, [(verb, kind)])
        if seen[name] == expected:
            del seen[name]
        else:
            seen[name] = (seen[name], error["message"])
    assert seen == {}
    assert served.process is not None
    assert served.process.poll() is None
    log = served.log.read_text()
    assert "Traceback" not in log, log
    assert "Error handling request" not in log, log
    assert sandbox.exec(["true"]).status == 0
    assert [item.id for item in Client(str(served.socket)).list()] == [sandbox.id]  # nothing was made
    assert sandbox.teardown().residue == ()


def test_a_body_cut_short_is_refused_and_audited(sb_root: SandboxBroker, served: Service) -> None:
    """A Content-Length the body never reaches (the client ends its side): no answer can reach it,
    but the audit log has the refusal and the service's log no traceback."""
    before = len(audit_lines(sb_root))
    head = b"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
    raw(served.socket, head + b'{"profile": ', end_after=True)
    lines = _audited(sb_root, before)
    assert [(x["uid"], x["verb"], x["outcome"], x["status"]) for x in lines] == [(0, "create", "UsageError", 2)]
    assert "Traceback" not in served.log.read_text()
    assert Client(str(served.socket)).list() == []


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
FIELDS = ["profile", "ttl", "manifest", "bootstrap", "ref", "branch", "lease", "request_id", "wait_seconds", "name"]
BODIES = (
    st.binary(max_size=200)
    | JSON_VALUES.map(lambda value: json.dumps(value).encode())
    | st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=4).map(lambda value: json.dumps(value).encode())
)
# An exec's options line: a command that runs (so that every other option is read), with any of
# the other options of any JSON type.
EXEC_OPTIONS = st.fixed_dictionaries(
    {"argv": st.just(["true"])},
    optional={name: JSON_VALUES for name in ("cwd", "timeout", "consumer", "executable", "env")},
).map(lambda value: json.dumps(value).encode())


def test_fuzzed_bodies_are_answered_in_json_with_one_audit_line_each(sb_root: SandboxBroker, served: Service) -> None:
    """Bodies of any bytes and any JSON to the routes that read one, from the owner (whose
    requests reach the routes): never a 500, always the envelope, one audit line each."""
    sandbox = Client(str(served.socket)).create(sb_root.profile)
    routes = [
        "/v1/sandboxes",
        f"/v1/sandboxes/{sandbox.id}/exec",
        f"/v1/sandboxes/{sandbox.id}/dispatch",
        f"/v1/sandboxes/{sandbox.id}/export/confirm",
        f"/v1/sandboxes/{sandbox.id}/exec/{'0' * 32}/signal",
        "/v1/owner/revoke",
        "/v1/runtime/digest",
    ]

    @settings(max_examples=150, deadline=None, database=None)
    @given(route=st.sampled_from(routes), body=BODIES, options=EXEC_OPTIONS)
    def probe(route: str, body: bytes, options: bytes) -> None:
        if route.endswith("/exec"):
            body = options + b"\n"  # the options line, and no stdin
        before = len(audit_lines(sb_root))
        status, _, answer = raw(served.socket, post(route, body))
        assert status != 500, answer
        if status >= 400:
            _envelope(answer)
        else:
            assert route.endswith("/exec"), (route, body, status)  # what else a random body could do
        lines = _audited(sb_root, before)
        assert len(lines) == 1, lines

    probe()
    assert "Traceback" not in served.log.read_text()
    assert [item.id for item in Client(str(served.socket)).list()] == [sandbox.id]
    assert sandbox.teardown().residue == ()


# ------------------------------------------------------------------- a grant withdrawn midway

CREATE = r"""
import json, sys
from sandboxer import Client
from sandboxer.errors import SandboxerError
try:
    print(json.dumps({"made": Client(sys.argv[1]).create(sys.argv[2]).id}))
except SandboxerError as exc:
    print(json.dumps({"error": [type(exc).__name__, exc.status, exc.message]}))
"""
EXPORT = r"""
import json, sys
from sandboxer import Client
from sandboxer.errors import SandboxerError
try:
    print(json.dumps({"made": Client(sys.argv[1]).sandbox(sys.argv[2]).export("tar", sys.argv[3]).format}))
except SandboxerError as exc:
    print(json.dumps({"error": [type(exc).__name__, exc.status, exc.message]}))
"""


def _held_on(
    fifo: Path, argv: list[str], env: dict[str, str], withdraw: Callable[[], None]
) -> subprocess.CompletedProcess[str]:
    """Run `argv`; once what it asked for reads `fifo` (and waits for a writer), call `withdraw`,
    then let every read of the FIFO go on (empty) until it ends."""
    running = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        held = _writer_when_read(fifo, time.monotonic() + 60)
        withdraw()
        os.close(held)
        while running.poll() is None:
            with contextlib.suppress(OSError):
                os.close(_writer_when_read(fifo, time.monotonic() + 0.5))
        out, err = running.communicate(timeout=60)
    finally:
        if running.poll() is None:
            running.kill()
        fifo.unlink()
    return subprocess.CompletedProcess(argv, running.returncode, out, err)


def _answer(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """What CREATE or EXPORT printed."""
    assert done.returncode == 0, done.stderr
    answer: dict[str, Any] = json.loads(done.stdout)
    assert "error" in answer, answer
    return answer


def _grant(broker: SandboxBroker, *names: str) -> None:
    """grants.yaml naming `names` for the broker's profile, approved."""
    entries = "".join(
        f"  - users: [{name}]\n    profiles: [{broker.profile}]\n    max_sandboxes: 3\n    max_ttl_seconds: 3600\n"
        for name in names
    )
    (broker.config / "grants.yaml").write_text("grants:\n" + entries)
    assert broker.run("ext", "approve", "grants").status == 0


def _writer_when_read(fifo: Path, deadline: float) -> int:
    """The FIFO's write end, once a reader waits on it (its read then waits for this end)."""
    while True:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno != errno.ENXIO or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


@pytest.mark.parametrize("front", ["http", "cli"])
def test_a_grant_withdrawn_while_a_create_runs_stops_it_and_leaves_nothing(
    sb_root: SandboxBroker, served: Service, accounts: tuple[pwd.struct_passwd, pwd.struct_passwd], front: str
) -> None:
    """The clone of the workspace waits on a real slow file (the repository's
    objects/info/alternates made a FIFO: git reads it and waits for a writer); meanwhile the
    owner withdraws the caller's grant. The create — through the HTTP API, or the CLI client — is
    refused before its start, with the reason, and nothing of it is left."""
    flooder, grantee = accounts
    _grant(sb_root, grantee.pw_name)
    fifo = sb_root.repo / ".git" / "objects" / "info" / "alternates"
    fifo.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(fifo)
    argv, env = _account_argv(grantee, CREATE, str(served.socket), sb_root.profile)
    if front == "cli":
        argv = [*argv[: argv.index("-c")], "-m", "sandboxer", "create", "--profile", sb_root.profile]
        env["SANDBOXER_SOCKET"] = str(served.socket)
    before = len(audit_lines(sb_root))

    def withdraw() -> None:  # the clone is under way (and waits): the owner removes the grant
        assert [p.name for p in (sb_root.state / "sandboxes").iterdir() if not p.name.startswith(".")]
        _grant(sb_root, flooder.pw_name)  # the grantee's entry removed, the new bytes approved

    done = _held_on(fifo, argv, env, withdraw)
    refusal = f"uid {grantee.pw_uid} is no longer granted profile '{sb_root.profile}': grants.yaml changed"
    if front == "http":
        answer = _answer(done)
        assert answer["error"][:2] == ["PolicyError", 3], answer
        message = answer["error"][2]
        verb = "create"
    else:
        assert done.returncode == 3, done
        assert done.stdout == ""
        message = done.stderr.removeprefix("sandboxer: ")
        verb = "cli create"
    assert message.startswith(refusal), message
    assert "refused before the start" in message
    lines = _audited(sb_root, before)
    assert [(x["uid"], x["verb"], x["status"]) for x in lines] == [(grantee.pw_uid, verb, 3)]
    assert [p.name for p in (sb_root.state / "sandboxes").iterdir() if not p.name.startswith(".")] == []
    assert not [m for m in mount_points() if m.startswith(str(sb_root.root))]
    assert not [f for f in loop_backing_files() if f.startswith(str(sb_root.root))]
    assert Client(str(served.socket)).list() == []


def test_a_grant_withdrawn_while_an_export_runs_stops_it_before_its_quarantine(
    sb_root: SandboxBroker, served: Service, accounts: tuple[pwd.struct_passwd, pwd.struct_passwd]
) -> None:
    """The export's git inside the sandbox waits on a FIFO planted as the workspace's
    objects/info/alternates; meanwhile the owner withdraws the grant. The export is refused before
    its quarantine is made, with the reason, and no quarantine is left."""
    flooder, grantee = accounts
    _grant(sb_root, grantee.pw_name)
    made = json.loads(_as_account(grantee, CREATE, str(served.socket), sb_root.profile))
    sandbox_id = made["made"]
    owner = Client(str(served.socket)).sandbox(sandbox_id)
    before = len(audit_lines(sb_root))
    assert owner.exec(["sh", "-c", "echo work > new.txt"], cwd="/workspace").status == 0
    _audited(sb_root, before)  # its line is written once its answer has gone
    fifo = sb_root.sandbox_dir(sandbox_id) / "workspace" / ".git" / "objects" / "info" / "alternates"
    os.mkfifo(fifo, 0o644)
    destination = sb_root.root / f"export-{grantee.pw_name}"
    destination.mkdir()
    os.chown(destination, grantee.pw_uid, grantee.pw_gid)
    argv, env = _account_argv(grantee, EXPORT, str(served.socket), sandbox_id, str(destination / "work.tar"))
    before = len(audit_lines(sb_root))
    answer = _answer(_held_on(fifo, argv, env, lambda: _grant(sb_root, flooder.pw_name)))
    assert answer["error"][:2] == ["PolicyError", 3], answer
    assert answer["error"][2].startswith(f"uid {grantee.pw_uid} is no longer granted this broker")
    assert "refused before the export's quarantine" in answer["error"][2]
    lines = _audited(sb_root, before)
    assert [(x["uid"], x["verb"], x["outcome"]) for x in lines] == [(grantee.pw_uid, "export", "PolicyError")]
    exports = sb_root.state / "exports"
    assert not exports.exists() or list(exports.iterdir()) == []
    assert not (destination / "work.tar").exists()
    assert owner.teardown(discard=True).residue == ()


# ------------------------------------------------------------------- clients that leave early


def _leave(path: Path, request: bytes, *, read: int) -> bytes:
    """Send `request`, read `read` bytes of the answer (0: none), then go at once (a reset)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(str(path))
    sock.sendall(request)
    got = b""
    while len(got) < read:
        chunk = sock.recv(read - len(got))
        if not chunk:
            break
        got += chunk
    sock.close()
    return got


def _line_for(broker: SandboxBroker, before: int, verb: str, timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [line for line in audit_lines(broker)[before:] if line["verb"] == verb]
        if found:
            assert len(found) == 1, found
            return found[0]
        time.sleep(0.1)
    raise AssertionError(f"no audit line for {verb}: {audit_lines(broker)[before:]}")


def test_clients_that_leave_early_are_audit_lines_not_tracebacks(sb_root: SandboxBroker, served: Service) -> None:
    """A client that goes mid-exec-stream, mid-export-body, before any answer, (a CLI client)
    killed mid-exec, or that sends a CLI request the service cannot read: one audit line each,
    and the service's log keeps its one line per start and stop — no traceback, no aiohttp error."""
    assert served.process is not None
    sandbox = Client(str(served.socket)).create(sb_root.profile)
    big = "head -c 32000000 /dev/urandom > big && git add big && git commit -qm big"
    before = len(audit_lines(sb_root))
    assert sandbox.exec(["sh", "-c", big], cwd="/workspace").status == 0
    _line_for(sb_root, before, "exec")  # written once its answer has gone

    before = len(audit_lines(sb_root))
    options = json.dumps({"argv": ["sh", "-c", "while :; do echo flowing; done"]}).encode() + b"\n"
    head = f"POST /v1/sandboxes/{sandbox.id}/exec HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunk = f"{len(options):x}\r\n".encode() + options + b"\r\n"
    assert b"flowing" in _leave(served.socket, head.encode() + chunk, read=4096)
    left = _line_for(sb_root, before, "exec")
    assert left["status"] == 137, (left, served.log.read_text())  # the command was killed with its client

    before = len(audit_lines(sb_root))
    body = b'{"format": "bundle"}'
    head = f"POST /v1/sandboxes/{sandbox.id}/export HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    assert _leave(served.socket, head.encode() + body, read=65536).startswith(b"HTTP/1.1 200")
    left = _line_for(sb_root, before, "export")
    assert (left["sandbox"], left["outcome"], left["status"]) == (sandbox.id, "ClientGone", None)
    quarantines = [path.name for path in (sb_root.state / "exports").iterdir() if path.name != ".lock"]
    assert quarantines == []  # its quarantine went with it (.lock: the directory's own lock)

    before = len(audit_lines(sb_root))
    _leave(served.socket, b"GET /v1/openapi.json HTTP/1.1\r\nHost: x\r\n\r\n", read=0)
    _line_for(sb_root, before, "openapi")

    before = len(audit_lines(sb_root))
    env = {key: value for key, value in sb_root.env().items() if key != "SANDBOXER_NO_SERVICE"}
    cli = subprocess.Popen(
        sb_root.argv("exec", sandbox.id, "--", "sh", "-c", "echo started; sleep 60"),
        stdout=subprocess.PIPE,
        env={**env, "SANDBOXER_SOCKET": str(served.socket)},
    )
    assert cli.stdout is not None
    assert cli.stdout.readline() == b"started\n"
    cli.kill()
    cli.wait()
    cli.stdout.close()
    assert _line_for(sb_root, before, "cli exec")["status"] == 137

    before = len(audit_lines(sb_root))
    raw(served.socket, b"\0not a request\n", end_after=True)  # a CLI client's NUL, no descriptors
    refused = _line_for(sb_root, before, "cli")
    assert (refused["uid"], refused["outcome"], refused["status"]) == (0, "UsageError", 2)

    assert sandbox.exec(["true"]).status == 0  # the service is well
    assert served.stop() == 0
    log = served.log.read_text().splitlines()
    assert len(log) == 2, log  # serving ..., stopped ...
    assert log[0].startswith("sandboxer: serving ")
    assert log[1].startswith("sandboxer: stopped")
