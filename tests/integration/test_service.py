"""`sandboxer serve` and `sandboxer.Client`: the broker as a service on its Unix socket.

Real services (the CLI's `serve`, as the broker's user), real sandboxes on every backend, real
accounts: the caller is whoever the kernel says is at the other end of the socket.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import pwd
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from sandboxer import Broker, Client, ClientSandbox
from sandboxer.errors import ExecError, NotFoundError, SandboxerError, UsageError
from sandboxer.service.http import BODY_SECONDS, HEAD_SECONDS
from sandboxer.service.routes import document_bytes
from tests.integration.conftest import UNPRIVILEGED_UID, SandboxBroker, backend_profile_text
from tests.integration.services import Service, answers, as_service_account
from tests.integration.test_python_api import ORCHESTRATOR, assert_orchestrated

# Test accounts, one set per pytest-xdist worker (`make check` runs two: the modules that use
# them may run at once).
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
OTHER_ACCOUNT = f"sbxsvcother{_WORKER}"
CALLER_A, CALLER_B, CALLER_GROUP = f"sbxsvca{_WORKER}", f"sbxsvcb{_WORKER}", f"sbxsvcgrp{_WORKER}"


def _socket_dir(broker: SandboxBroker) -> Path:
    directory = broker.root / "svc"
    directory.mkdir(exist_ok=True)
    directory.chmod(0o755)  # any account may reach the socket: the service tells callers apart
    if broker.as_user:
        os.chown(directory, UNPRIVILEGED_UID, UNPRIVILEGED_UID)  # the service's own account makes it
    return directory


@pytest.fixture
def service(sbx: SandboxBroker) -> Iterator[Service]:
    started = Service(sbx, _socket_dir(sbx) / "broker.sock").start()
    try:
        yield started
    finally:
        started.stop()


def test_the_client_drives_a_whole_sandbox_life(service: Service) -> None:

    with as_service_account(service.broker):
        client = Client(str(service.socket))
        assert client.version().api == "v1"
        assert client.service.request("GET", "/v1/openapi.json") == json.loads(document_bytes())
        with client.create(service.broker.profile) as sandbox:
            result = sandbox.exec(["sh", "-c", "cat; echo warning >&2; exit 3"], stdin=b"hello\n")
            assert (result.status, result.stdout, result.stderr) == (3, b"hello\n", b"warning\n")
            stream = sandbox.exec_stream(["sh", "-c", "for i in 1 2 3; do echo $i; done; echo done >&2"])
            chunks = list(stream)
            assert b"".join(c for s, c in chunks if s == "stdout") == b"1\n2\n3\n"
            assert ("stderr", b"done\n") in chunks
            assert stream.status == 0
            assert sandbox.exec(["pwd"], cwd="/workspace").stdout == b"/workspace\n"
            assert sandbox.exec(["no-such-program"]).status == 127
            assert sandbox.exec(["sleep", "30"], timeout=0.5).status == 124
            evidence = sandbox.inspect()
            assert evidence.matches_plan is True, evidence.differences
            assert [(i.id, i.status) for i in client.list()] == [(sandbox.id, "running")]
        assert sandbox.teardown().residue == ()
        assert client.list() == []
        with pytest.raises(ExecError) as gone:
            sandbox.exec(["true"])
        assert gone.value.status == 125
        with pytest.raises(NotFoundError):
            sandbox.inspect()
        assert not (service.broker.state / "sandboxes" / sandbox.id).exists()


def test_the_orchestrator_drives_a_whole_sandbox_life_through_the_service(service: Service) -> None:
    """The documented orchestrator, switched to the client by its --socket: the same summary."""

    broker = service.broker
    argv = broker.python(str(ORCHESTRATOR), "--profile", broker.profile, "--socket", str(service.socket))
    done = subprocess.run(argv, capture_output=True, text=True, env=broker.env(), timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert_orchestrated(json.loads(done.stdout), broker)


def test_the_client_and_the_embedded_broker_answer_alike(sb_root: SandboxBroker) -> None:
    """One sandbox, the same execs through the service and in-process."""
    started = Service(sb_root, _socket_dir(sb_root) / "broker.sock").start()
    try:
        client = Client(str(started.socket))
        broker = Broker(config_dir=str(sb_root.config), state_dir=str(sb_root.state))
        with client.create(sb_root.profile) as through_service:
            embedded = broker.sandbox(through_service.id)
            for argv, options in (
                (["sh", "-c", "echo out; echo err >&2; exit 7"], {}),
                (["cat"], {"stdin": b"x" * 300_000}),
                (["pwd"], {"cwd": "/workspace"}),
                (["/nonexistent"], {}),
            ):
                assert through_service.exec(argv, **options) == embedded.exec(argv, **options)
            assert through_service.inspect().matches_plan == embedded.inspect().matches_plan is True
    finally:
        started.stop()


def test_a_second_service_for_the_same_state_dir_refuses(sb_root: SandboxBroker) -> None:
    first = Service(sb_root, _socket_dir(sb_root) / "one.sock").start()
    try:
        second = sb_root.run("serve", "--socket", str(_socket_dir(sb_root) / "two.sock"), timeout=30)
        assert second.status == 3, second
        assert "a service already answers for the state dir" in second.stderr
        assert Client(str(first.socket)).list() == []
    finally:
        first.stop()


def test_a_dead_services_socket_is_replaced_and_nothing_else_at_the_path(sb_root: SandboxBroker) -> None:
    path = _socket_dir(sb_root) / "broker.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()  # its file stays behind, as a killed service's does
    started = Service(sb_root, path).start()
    assert Client(str(path)).list() == []
    started.stop()
    assert not path.exists()

    path.write_text("not a socket")
    refused = sb_root.run("serve", "--socket", str(path), timeout=30)
    assert refused.status == 2, refused
    assert "exists and is not a socket" in refused.stderr
    assert path.read_text() == "not a socket"


def test_a_live_service_is_never_replaced(sb_root: SandboxBroker) -> None:
    path = _socket_dir(sb_root) / "broker.sock"
    other = make_other_state(sb_root)
    first = Service(sb_root, path).start()
    try:
        dirs = ["--config-dir", str(sb_root.config), "--state-dir", str(other)]
        refused = subprocess.run(
            [sys.executable, "-m", "sandboxer", *dirs, "serve", "--socket", str(path)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert refused.returncode == 3, refused.stderr
        assert "a service already listens on" in refused.stderr
        assert Client(str(path)).list() == []
    finally:
        first.stop()


def make_other_state(broker: SandboxBroker) -> Path:
    other = broker.root / "other-state"
    other.mkdir(mode=0o700)
    return other


def test_an_idle_service_exits_but_never_while_an_exec_runs(sb_root: SandboxBroker) -> None:
    """`serve --idle-exit 2` (a private service's, with 600): an exec twice as long keeps it; two
    seconds after the last request it exits 0 and takes its socket with it; the sandbox stays."""
    started = Service(sb_root, _socket_dir(sb_root) / "broker.sock", "--idle-exit", "2").start()
    assert started.process is not None
    try:
        client = Client(str(started.socket))
        sandbox = client.create(sb_root.profile)
        assert sandbox.exec(["sleep", "4"]).status == 0
        assert started.process.poll() is None  # busy all along: not idle
        assert started.process.wait(timeout=30) == 0
        assert "idle, exiting" in started.log.read_text()
        assert not started.socket.exists()
        assert sb_root.exec(sandbox.id, "echo", "kept").stdout == "kept\n"
        assert sb_root.run("teardown", sandbox.id).status == 0
    finally:
        started.stop()


def test_sigterm_leaves_sandboxes_running_for_the_next_service(sbx: SandboxBroker) -> None:
    path = _socket_dir(sbx) / "broker.sock"
    first = Service(sbx, path).start()
    with as_service_account(sbx):
        sandbox = Client(str(path)).create(sbx.profile)
    assert first.stop(signal.SIGTERM) == 0
    assert "live sandboxes keep running" in first.log.read_text()
    assert not path.exists()
    assert sbx.exec(sandbox.id, "true").status == 0  # still running, without any service
    second = Service(sbx, path).start()
    try:
        with as_service_account(sbx):
            client = Client(str(path))
            assert [(i.id, i.status) for i in client.list()] == [(sandbox.id, "running")]
            assert client.sandbox(sandbox.id).exec(["echo", "adopted"]).stdout == b"adopted\n"
            assert client.sandbox(sandbox.id).teardown().residue == ()
    finally:
        second.stop()


@pytest.fixture(scope="module")
def other_account() -> Iterator[pwd.struct_passwd]:
    """A real account that owns nothing of the broker (removed afterwards)."""
    if os.geteuid() != 0:
        pytest.skip("creating a test account needs root (CI runs as root)")
    subprocess.run(["userdel", OTHER_ACCOUNT], capture_output=True, check=False)
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER_ACCOUNT], check=True
    )
    try:
        yield pwd.getpwnam(OTHER_ACCOUNT)
    finally:
        subprocess.run(["userdel", OTHER_ACCOUNT], check=False)


def _as_account(account: pwd.struct_passwd, code: str, *, groups: bool = False) -> subprocess.CompletedProcess[str]:
    """`code` run by the account: its own uid and gid, and its supplementary groups with `groups`."""
    ids = [str(account.pw_uid), str(account.pw_gid)]
    group_option = "--init-groups" if groups else "--clear-groups"
    argv = ["setpriv", "--reuid", ids[0], "--regid", ids[1], group_option, "--", sys.executable, "-c", code]
    env = {"PATH": "/usr/bin:/bin", "HOME": "/", "LANG": "C.UTF-8", "PYTHONPATH": str(Path(__file__).parents[2])}
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, check=False)


def test_an_account_that_is_not_an_owner_is_refused_by_its_credentials(
    sb_root: SandboxBroker, other_account: pwd.struct_passwd
) -> None:
    started = Service(sb_root, _socket_dir(sb_root) / "broker.sock").start()
    try:
        sandbox = Client(str(started.socket)).create(sb_root.profile)
        code = (
            "import json, sys\n"
            "from sandboxer import Client\n"
            "from sandboxer.errors import SandboxerError\n"
            f"client = Client({str(started.socket)!r})\n"
            "seen = {}\n"
            "for name, call in (('list', client.list), ('create', lambda: client.create('any')),\n"
            f"                   ('exec', lambda: client.sandbox({sandbox.id!r}).exec(['true'])),\n"
            f"                   ('teardown', lambda: client.sandbox({sandbox.id!r}).teardown())):\n"
            "    try:\n"
            "        call(); seen[name] = 'allowed'\n"
            "    except SandboxerError as exc:\n"
            "        seen[name] = [type(exc).__name__, exc.status, exc.message]\n"
            "print(json.dumps(seen))\n"
        )
        done = _as_account(other_account, code)
        assert done.returncode == 0, done.stderr
        seen = json.loads(done.stdout)
        refusal = ["PolicyError", 3, f"uid {other_account.pw_uid} is not granted this broker"]
        assert seen == {"list": refusal, "create": refusal, "exec": refusal, "teardown": refusal}
        assert sb_root.exec(sandbox.id, "true").status == 0  # untouched
        assert Client(str(started.socket)).sandbox(sandbox.id).teardown().residue == ()
    finally:
        started.stop()


def _raw(path: Path, request: bytes) -> tuple[int, dict[str, object]]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(path))
        with contextlib.suppress(BrokenPipeError):  # it stopped reading an oversized body: the answer is there
            sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)


def test_bad_requests_get_one_clear_error_and_nothing_is_made(sb_root: SandboxBroker) -> None:
    started = Service(sb_root, _socket_dir(sb_root) / "broker.sock").start()
    try:
        client = Client(str(started.socket))
        with pytest.raises(UsageError) as unknown:
            client.service.request("POST", "/v1/sandboxes", {"profile": sb_root.profile, "privileged": True})
        assert unknown.value.message.startswith("privileged: unknown field")
        for ttl in (True, "60"):  # as the embedded API refuses them
            with pytest.raises(UsageError) as bad_ttl:
                client.service.request("POST", "/v1/sandboxes", {"profile": sb_root.profile, "ttl": ttl})
            assert bad_ttl.value.message == "ttl: must be a number of seconds"
        with pytest.raises(SandboxerError) as unknown_profile:
            client.create("no-such-profile")
        assert unknown_profile.value.status == sb_root.run("create", "--profile", "no-such-profile").status
        status, document = _raw(
            started.socket,
            b"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nConnection: close\r\n\r\n{nope",
        )
        assert status == 400
        assert document["error"] == {
            "kind": "UsageError",
            "message": "the request body is not JSON",
            "hint": None,
            "status": 2,
        }
        huge = 17 * 1024 * 1024
        head = f"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\nContent-Length: {huge}\r\nConnection: close\r\n\r\n"
        status, document = _raw(started.socket, head.encode() + b" " * huge)
        assert status == 400
        assert "larger than" in str(document["error"])
        assert client.list() == []
        assert sorted(os.listdir(sb_root.state / "sandboxes")) in ([], [".lock"])
    finally:
        started.stop()


def _trickle(path: Path, head: bytes, give_up: float) -> tuple[float, bytes]:
    """Send `head`, then one byte every half second, never finishing: (seconds until the service
    closed the connection, what it answered before)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(path))
        started = time.monotonic()
        sock.sendall(head)
        sock.settimeout(0.5)
        answer = b""
        while time.monotonic() - started < give_up:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                try:
                    sock.sendall(b"x")
                except (BrokenPipeError, ConnectionResetError):
                    break
                continue
            except ConnectionResetError:
                break
            if not chunk:
                break
            answer += chunk
        return time.monotonic() - started, answer


def _open_descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@contextlib.contextmanager
def _served_sandbox(broker: SandboxBroker) -> Iterator[tuple[Service, ClientSandbox, int]]:
    """A service of the test's own and a sandbox through it (torn down after): and how many
    descriptors the service holds once both have been used."""
    started = Service(broker, _socket_dir(broker) / "broker.sock").start()
    try:
        assert started.process is not None
        with Client(str(started.socket)).create(broker.profile) as sandbox:
            assert sandbox.exec(["true"]).status == 0
            yield started, sandbox, _open_descriptors(started.process.pid)
    finally:
        started.stop()


def _descriptors_settle(pid: int, before: int) -> int:
    """The service's open descriptors, once back to `before` (or after 10 s)."""
    deadline = time.monotonic() + 10
    while (count := _open_descriptors(pid)) > before and time.monotonic() < deadline:
        time.sleep(0.1)
    return count


def test_slow_clients_are_dropped_and_hold_nothing(sb_root: SandboxBroker) -> None:
    """A request head, a JSON body and an exec's options line each have 10 s to arrive (slow-loris);
    the service answers others meanwhile, and afterwards holds no more descriptors than before."""

    with _served_sandbox(sb_root) as (started, sandbox, before):
        assert started.process is not None
        give_up = 3 * max(HEAD_SECONDS, BODY_SECONDS)
        heads = {
            "head": b"GET /v1/sandboxes HTTP/1.1\r\nHost: x\r\nX-Slow: ",
            "body": b"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\nContent-Length: 4096\r\n\r\n{",
            "exec": f"POST /v1/sandboxes/{sandbox.id}/exec HTTP/1.1\r\nHost: x\r\n"
            "Content-Length: 4096\r\n\r\n{".encode(),
        }
        with ThreadPoolExecutor(max_workers=len(heads)) as pool:
            slow = {name: pool.submit(_trickle, started.socket, head, give_up) for name, head in heads.items()}
            time.sleep(1)
            assert [item.id for item in Client(str(started.socket)).list()] == [sandbox.id]  # answered meanwhile
            assert sandbox.exec(["echo", "served"]).stdout == b"served\n"
            ended = {name: future.result() for name, future in slow.items()}
        seconds, answer = ended["head"]
        assert seconds < give_up, "a slow request head was never dropped"
        assert answer == b""  # no request, no answer: the connection is closed
        for name, what in (("body", "the request body"), ("exec", "exec: the options line")):
            seconds, answer = ended[name]
            assert seconds < give_up, f"a slow {name} was never answered"
            status_line, _, rest = answer.partition(b"\r\n")
            assert status_line.startswith(b"HTTP/1.1 400"), answer
            document = json.loads(rest.partition(b"\r\n\r\n")[2])
            assert document["error"]["message"] == f"{what} took longer than {BODY_SECONDS:g} s to arrive"
        assert _descriptors_settle(started.process.pid, before) <= before
        assert sandbox.exec(["true"]).status == 0


@pytest.fixture(scope="module")
def callers() -> Iterator[tuple[pwd.struct_passwd, pwd.struct_passwd]]:
    """Two real accounts, A and B (B in a group of its own making), removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("creating test accounts needs root (CI runs as root)")
    for name in (CALLER_A, CALLER_B):
        subprocess.run(["userdel", name], capture_output=True, check=False)
    subprocess.run(["groupdel", CALLER_GROUP], capture_output=True, check=False)
    subprocess.run(["groupadd", "--system", CALLER_GROUP], check=True)
    for name, extra in ((CALLER_A, []), (CALLER_B, ["--groups", CALLER_GROUP])):
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", *extra, name], check=True
        )
    try:
        yield pwd.getpwnam(CALLER_A), pwd.getpwnam(CALLER_B)
    finally:
        for name in (CALLER_A, CALLER_B):
            subprocess.run(["userdel", name], check=False)
        subprocess.run(["groupdel", CALLER_GROUP], check=False)


DRIVER = """
import json, sys
from sandboxer import Client
from sandboxer.errors import SandboxerError
client = Client(sys.argv[1])
results = []
for op, *args in json.loads(sys.argv[2]):
    try:
        if op == "list":
            results.append([item.id for item in client.list()])
        elif op == "create":
            results.append(client.create(args[0], ttl=args[1] if len(args) > 1 else None).id)
        elif op == "exec":
            r = client.sandbox(args[0]).exec(args[1])
            results.append([r.status, r.stdout.decode(), r.stderr.decode()])
        elif op == "inspect":
            results.append(client.sandbox(args[0]).inspect().matches_plan)
        elif op == "teardown":
            results.append(list(client.sandbox(args[0]).teardown().residue))
        elif op == "gc":
            results.append(client.gc().healthy)
    except SandboxerError as exc:
        results.append([type(exc).__name__, exc.status, exc.message])
print(json.dumps(results))
"""


def _drive(account: pwd.struct_passwd, service: Service, *ops: list[object], groups: bool = False) -> list[object]:
    done = _as_account(
        account,
        DRIVER.replace("sys.argv[1]", repr(str(service.socket))).replace("sys.argv[2]", repr(json.dumps(ops))),
        groups=groups,
    )
    assert done.returncode == 0, done.stderr
    results: list[object] = json.loads(done.stdout)
    return results


def _answers_on(
    account: pwd.struct_passwd, service: Service, theirs: str, unknown: str, *, groups: bool = False
) -> dict[str, list[object]]:
    """What `account` is answered for inspect, exec and teardown of another's sandbox `theirs` and
    of the `unknown` id, each id written as ID."""
    ops = [["inspect", "ID"], ["exec", "ID", ["true"]], ["teardown", "ID"]]
    return {
        name: json.loads(
            json.dumps(_drive(account, service, *[[*op[:1], sandbox, *op[2:]] for op in ops], groups=groups)).replace(
                sandbox, "ID"
            )
        )
        for name, sandbox in (("theirs", theirs), ("unknown", unknown))
    }


def test_grants_admit_a_caller_to_its_profiles_and_to_its_own_sandboxes_only(
    sb_root: SandboxBroker, callers: tuple[pwd.struct_passwd, pwd.struct_passwd]
) -> None:
    a, b = callers
    grants = sb_root.config / "grants.yaml"
    entry_a = f"  - users: [{a.pw_name}]\n    profiles: [{sb_root.profile}]\n"
    entry_a += "    max_sandboxes: 1\n    max_ttl_seconds: 3600\n"
    grants.write_text("grants:\n" + entry_a)
    started = Service(sb_root, _socket_dir(sb_root) / "broker.sock").start()
    owner = Client(str(started.socket))
    try:
        refused_a = ["PolicyError", 3, f"uid {a.pw_uid} is not granted this broker"]
        assert _drive(a, started, ["list"]) == [refused_a]  # written, not yet approved
        assert sb_root.run("ext", "approve", "grants").status == 0

        created = _drive(a, started, ["create", sb_root.profile], ["list"])
        mine = str(created[0])
        assert created[1] == [mine]
        assert _drive(a, started, ["exec", mine, ["sh", "-c", "echo hi; id -u"]])[0][:2] == [0, "hi\n1000\n"]
        assert _drive(a, started, ["create", sb_root.profile], ["create", "other-profile"], ["gc"]) == [
            ["PolicyError", 3, f"uid {a.pw_uid} has its 1 live sandboxes (max_sandboxes)"],
            ["PolicyError", 3, f"profile 'other-profile' is not granted to uid {a.pw_uid}"],
            ["PolicyError", 3, "gc is for the broker's owners"],
        ]

        # The owner's sandbox, and one that does not exist, answer A alike: nothing leaks.
        theirs = owner.create(sb_root.profile).id
        unknown = "0123456789abcdef01234567"
        seen = _answers_on(a, started, theirs, unknown)
        assert seen["theirs"] == seen["unknown"]
        assert seen["theirs"][0] == ["NotFoundError", 4, "no such sandbox: ID"]
        assert seen["theirs"][1] == ["ExecError", 125, "exec: no such sandbox: ID"]
        assert sb_root.exec(theirs, "true").status == 0  # untouched
        assert _drive(a, started, ["list"]) == [[mine]]
        assert sorted(item.id for item in owner.list()) == sorted([mine, theirs])  # owners see everything

        not_granted = ["PolicyError", 3, f"uid {b.pw_uid} is not granted this broker"]
        assert _drive(b, started, ["list"], ["create", sb_root.profile]) == [not_granted] * 2
        assert _answers_on(b, started, mine, unknown) == {"theirs": [not_granted] * 3, "unknown": [not_granted] * 3}

        # One byte more and nobody is granted until an owner approves the new bytes; then B is,
        # through a group the kernel reports for its connection.
        entry_group = f"  - groups: [{CALLER_GROUP}]\n    profiles: [{sb_root.profile}]\n"
        entry_group += "    max_sandboxes: 2\n    max_ttl_seconds: 3600\n"
        grants.write_text("grants:\n" + entry_a + entry_group)
        assert _drive(a, started, ["list"]) == [refused_a]
        assert _drive(b, started, ["list"], groups=True)[0][:2] == ["PolicyError", 3]
        assert sb_root.run("ext", "approve", "grants").status == 0
        assert _drive(a, started, ["list"]) == [[mine]]
        assert _drive(b, started, ["list"], groups=True) == [[]]
        assert _drive(b, started, ["list"], groups=False)[0][:2] == ["PolicyError", 3]  # not without the group
        # B, a granted caller now, on A's sandbox: exactly as on one that does not exist.
        assert _answers_on(b, started, mine, unknown, groups=True) == seen
        assert _drive(a, started, ["exec", mine, ["true"]]) == [[0, "", ""]]  # untouched

        assert _drive(a, started, ["teardown", mine]) == [[]]
        assert owner.sandbox(theirs).teardown().residue == ()
        assert owner.list() == []
    finally:
        started.stop()


def test_the_audit_log_names_who_did_what_and_never_what_they_sent(
    sb_root: SandboxBroker, other_account: pwd.struct_passwd
) -> None:
    canary = "CANARY-" + os.urandom(6).hex()
    started = Service(sb_root, _socket_dir(sb_root) / "broker.sock").start()
    try:
        client = Client(str(started.socket))
        sandbox = client.create(sb_root.profile)
        assert sandbox.exec(["sh", "-c", f"echo {canary}; exit 4"], stdin=canary.encode()).status == 4
        with pytest.raises(NotFoundError):
            client.sandbox("0" * 24).inspect()
        listing = f"Client({str(started.socket)!r}).list()"
        _as_account(other_account, f"from sandboxer import Client\ntry:\n    {listing}\nexcept Exception:\n    pass\n")
        sandbox.teardown()
    finally:
        started.stop()
    log = sb_root.state / "audit.log"
    assert log.stat().st_mode & 0o777 == 0o600
    text = log.read_text()
    assert canary not in text
    lines = [json.loads(line) for line in text.splitlines()]
    assert all(set(line) == {"time", "uid", "pid", "verb", "sandbox", "outcome", "status"} for line in lines)
    seen = [(line["uid"], line["verb"], line["sandbox"], line["outcome"], line["status"]) for line in lines]
    assert seen == [
        (0, "create", sandbox.id, "ok", 0),
        (0, "exec", sandbox.id, "ok", 4),
        (0, "inspect", "0" * 24, "NotFoundError", 4),
        (other_account.pw_uid, "refused", None, "PolicyError", 3),
        (0, "teardown", sandbox.id, "ok", 0),
    ]
    assert all(line["pid"] > 0 for line in lines)


def test_a_sandbox_ends_with_its_ttl_and_a_callers_ttl_with_its_grant(
    sb_root: SandboxBroker, callers: tuple[pwd.struct_passwd, pwd.struct_passwd]
) -> None:
    a, _ = callers
    grants = f"grants:\n  - users: [{a.pw_name}]\n    profiles: [{sb_root.profile}]\n"
    (sb_root.config / "grants.yaml").write_text(grants + "    max_sandboxes: 3\n    max_ttl_seconds: 3600\n")
    assert sb_root.run("ext", "approve", "grants").status == 0
    started = Service(sb_root, _socket_dir(sb_root) / "broker.sock").start()
    try:
        client = Client(str(started.socket))
        lasting = client.create(sb_root.profile)
        short = client.create(sb_root.profile, ttl=6)  # long enough to be listed on a loaded machine
        listed = {item.id: item.expires_at for item in client.list()}
        assert listed[lasting.id] is None
        assert listed[short.id] is not None
        table = sb_root.run("list").stdout.splitlines()
        assert table[0].split() == ["ID", "PROFILE", "BACKEND", "STATUS", "CALLER", "AGE", "LEFT", "WORK"]
        left = {line.split()[0]: line.split()[6] for line in table[1:]}
        assert left[lasting.id] == "-"
        assert re.fullmatch(r"[0-6]s", left[short.id]), left
        deadline = time.monotonic() + 20
        while short.id in {item.id for item in client.list()}:
            assert time.monotonic() < deadline, "the expired sandbox was not torn down"
            time.sleep(0.2)
        assert not (sb_root.state / "sandboxes" / short.id).exists()
        assert [item.id for item in client.list()] == [lasting.id]
        expiries = [
            line
            for line in map(json.loads, (sb_root.state / "audit.log").read_text().splitlines())
            if line["verb"] == "expire"
        ]
        assert [(line["sandbox"], line["outcome"], line["status"]) for line in expiries] == [(short.id, "ok", 0)]

        too_long, granted = _drive(a, started, ["create", sb_root.profile, 7200], ["create", sb_root.profile])
        assert too_long == ["PolicyError", 3, "ttl: 7200 seconds is past the granted ceiling of 3600 (max_ttl_seconds)"]
        entries = {item.id: item.expires_at for item in client.list()}
        assert entries[str(granted)] is not None  # a caller's sandbox always ends
        client.sandbox(str(granted)).teardown()
        lasting.teardown()
    finally:
        started.stop()


def test_the_reaper_exports_work_before_it_tears_down(sbx_root: SandboxBroker) -> None:
    """A sandbox that expires with a new commit and a change not committed: the service keeps a
    bundle of the commit and a tar of the tree in <state>/exports/<id>/ (its audit line says
    where) before the teardown, then removes them once `--keep-exports` has run out."""
    started = Service(sbx_root, _socket_dir(sbx_root) / "broker.sock", "--keep-exports", "4").start()
    try:
        client = Client(str(started.socket))
        sandbox = client.create(sbx_root.profile, ttl=6)  # time for the exec below on a loaded machine
        script = "echo kept > kept.txt && git add kept.txt && git commit -qm Keep && echo more >> kept.txt"
        assert sandbox.exec(["sh", "-c", script]).status == 0
        kept = sbx_root.state / "exports" / sandbox.id
        deadline = time.monotonic() + 30
        while sandbox.id in {item.id for item in client.list()}:
            assert time.monotonic() < deadline, "the expired sandbox was not torn down"
            time.sleep(0.2)
        assert sorted(os.listdir(kept)) == ["summary.json", "tree.tar", "work.bundle"]
        summary = json.loads((kept / "summary.json").read_text())
        assert (summary["id"], summary["ahead"], summary["dirty"]) == (sandbox.id, 1, True)
        assert summary["files"] == ["work.bundle", "tree.tar"]
        clone = sbx_root.root / "clone"
        subprocess.run(["git", "clone", "-q", str(sbx_root.repo), str(clone)], check=True)
        subprocess.run(["git", "-C", str(clone), "fetch", "-q", str(kept / "work.bundle"), "HEAD:kept"], check=True)
        expiries = [
            line
            for line in map(json.loads, (sbx_root.state / "audit.log").read_text().splitlines())
            if line["verb"] == "expire"
        ]
        assert [(line["sandbox"], line["outcome"], line["kept"]) for line in expiries] == [
            (sandbox.id, "ok", str(kept))
        ]
        deadline = time.monotonic() + 30
        while kept.exists():
            assert time.monotonic() < deadline, "the kept export outlived --keep-exports"
            time.sleep(0.2)
    finally:
        started.stop()


def test_a_sandbox_unused_for_its_profiles_idle_timeout_is_torn_down(sbx_root: SandboxBroker) -> None:
    """lifetime.idle_seconds: a running exec keeps it, however long; after its last exec ends, the
    timeout runs out and the service tears it down (audit verb `idle`); another profile's stays."""
    idle_profile = "idle-two"
    text = backend_profile_text(sbx_root, idle_profile, sbx_root.repo, "lifetime:\n  idle_seconds: 2\n")
    sbx_root.write_profile(idle_profile, text)
    assert sbx_root.run("ext", "approve", idle_profile).status == 0
    started = Service(sbx_root, _socket_dir(sbx_root) / "broker.sock").start()
    try:
        client = Client(str(started.socket))
        lasting = client.create(sbx_root.profile)
        idle = client.create(idle_profile)
        assert idle.exec(["sleep", "4"]).status == 0  # twice the timeout, in use all along
        ended = time.monotonic()
        assert idle.exec(["true"]).status == 0  # still there right after
        deadline = time.monotonic() + 20
        while idle.id in {item.id for item in client.list()}:
            assert time.monotonic() < deadline, "the idle sandbox was not torn down"
            time.sleep(0.2)
        assert time.monotonic() - ended >= 2
        assert not (sbx_root.state / "sandboxes" / idle.id).exists()
        assert [item.id for item in client.list()] == [lasting.id]
        lines = [json.loads(line) for line in (sbx_root.state / "audit.log").read_text().splitlines()]
        assert [(line["sandbox"], line["status"]) for line in lines if line["verb"] == "idle"] == [(idle.id, 0)]
        lasting.teardown()
    finally:
        started.stop()


def test_many_waiting_execs_do_not_starve_another(sb_root: SandboxBroker) -> None:
    """Twelve execs wait for a file only a thirteenth creates: it must get to run."""

    started = Service(sb_root, _socket_dir(sb_root) / "broker.sock").start()
    try:
        client = Client(str(started.socket))
        with client.create(sb_root.profile) as sandbox:
            loop = "n=0; while [ ! -e /workspace/go ] && [ $n -lt 600 ]; do sleep 0.05; n=$((n+1)); done"
            wait = ["sh", "-c", loop + "; ls /workspace/go"]
            with ThreadPoolExecutor(max_workers=12) as pool:
                waiting = [pool.submit(sandbox.exec, wait) for _ in range(12)]
                time.sleep(0.5)
                assert sandbox.exec(["touch", "/workspace/go"]).status == 0
                results = [future.result(timeout=60) for future in waiting]
            assert [(r.status, r.stdout) for r in results] == [(0, b"/workspace/go\n")] * 12
    finally:
        started.stop()


def _count_processes(sandbox: ClientSandbox, name: str) -> int:
    """How many processes in the sandbox are called `name` (read by the shell itself: no process
    of the count's own is counted)."""
    count = 'n=0; for p in /proc/[0-9]*; do read c < $p/comm 2>/dev/null && [ "$c" = "$1" ] && n=$((n+1)); done'
    result = sandbox.exec(["sh", "-c", count + "; echo $n", "sh", name])
    assert result.status == 0, result
    return int(result.stdout)


def test_two_hundred_open_execs_do_not_starve_another(sb_root: SandboxBroker) -> None:
    """200 connections, each an exec of `cat` whose stdin stays open (each holds a worker and a
    process): one more exec still runs; when their clients hang up, all 200 end and the service
    holds no more descriptors than before."""
    with _served_sandbox(sb_root) as (started, sandbox, before):
        assert started.process is not None
        options = json.dumps({"argv": ["cat"]}).encode() + b"\n"
        request = (
            f"POST /v1/sandboxes/{sandbox.id}/exec HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        ).encode() + b"%x\r\n%b\r\n" % (len(options), options)  # the options, and a stdin never ended
        held: list[socket.socket] = []
        try:
            for _ in range(200):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                held.append(sock)
                sock.connect(str(started.socket))
                sock.sendall(request)
            for sock in held:  # each exec's answer has begun: its command is starting
                sock.settimeout(60)
                head = b""
                while b"\r\n" not in head and (chunk := sock.recv(64)):
                    head += chunk
                assert head.startswith(b"HTTP/1.1 200"), head
            deadline = time.monotonic() + 60
            while (running := _count_processes(sandbox, "cat")) < 200 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert running == 200
            result = sandbox.exec(["echo", "through"])
            assert (result.status, result.stdout) == (0, b"through\n")
        finally:
            for sock in held:
                sock.close()
        deadline = time.monotonic() + 60
        while _count_processes(sandbox, "cat") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _count_processes(sandbox, "cat") == 0
        assert _descriptors_settle(started.process.pid, before) <= before


def test_a_service_killed_mid_create_leaves_nothing_gc_cannot_finish(sb_root: SandboxBroker) -> None:

    path = _socket_dir(sb_root) / "broker.sock"
    first = Service(sb_root, path).start()
    live = Client(str(path)).create(sb_root.profile)  # running before the kill: the next service adopts it
    outcome: list[object] = []
    creating = threading.Thread(target=lambda: outcome.append(_create_or_error(Client(str(path)), sb_root.profile)))
    creating.start()
    deadline = time.monotonic() + 20
    while len(list((sb_root.state / "sandboxes").glob("*/record.json"))) < 2:  # the create is under way
        assert time.monotonic() < deadline, "no create started"
        time.sleep(0.005)
    first.stop(signal.SIGKILL)
    creating.join(timeout=60)
    assert path.exists()  # a killed service leaves its socket file behind
    collected = sb_root.run("gc", "--json")
    assert collected.status == 0, collected
    assert json.loads(collected.stdout)["collected"] or (outcome and not isinstance(outcome[0], Exception))
    assert live.id not in [item["id"] for item in json.loads(collected.stdout)["collected"]]
    second = Service(sb_root, path).start()  # the dead socket is replaced
    try:
        client = Client(str(path))
        assert live.id in [item.id for item in client.list()]
        adopted = client.sandbox(live.id)
        assert adopted.exec(["echo", "adopted"]).stdout == b"adopted\n"
        assert adopted.teardown().residue == ()
        for item in client.list():
            client.sandbox(item.id).teardown()
        assert client.list() == []
        assert sorted(p.name for p in (sb_root.state / "sandboxes").iterdir()) == [".lock"]
    finally:
        second.stop()


def _create_or_error(client: Client, profile: str) -> object:
    try:
        return client.create(profile).id
    except SandboxerError as exc:
        return exc


def _running_marker(broker: SandboxBroker, sandbox_id: str, marker: str) -> bool:
    """Whether any process in the sandbox has `marker` on its command line."""
    scan = "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done"
    listed = broker.exec(sandbox_id, "sh", "-c", scan)
    assert listed.status == 0, listed
    return marker in listed.stdout.replace(scan, "")


def test_an_exec_whose_client_goes_away_is_killed_with_all_it_started(sbx_root: SandboxBroker) -> None:
    started = Service(sbx_root, _socket_dir(sbx_root) / "broker.sock").start()
    try:
        client = Client(str(started.socket))
        with client.create(sbx_root.profile) as sandbox:
            marker = f"{7000 + os.getpid() % 1000}.5"
            options = {"argv": ["sh", "-c", f"echo started; sleep {marker} & sleep {marker}; echo never"]}
            body = json.dumps(options).encode() + b"\n"
            request = f"POST /v1/sandboxes/{sandbox.id}/exec HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.connect(str(started.socket))
                sock.sendall(request.encode() + body)
                seen = b""
                while b"started" not in seen:
                    seen += sock.recv(4096)
                deadline = time.monotonic() + 20
                while not _running_marker(sbx_root, sandbox.id, f"sleep {marker}"):  # its sleeps start
                    assert time.monotonic() < deadline, "the exec's processes never showed"
                    time.sleep(0.1)
            deadline = time.monotonic() + 20
            while _running_marker(sbx_root, sandbox.id, f"sleep {marker}"):
                assert time.monotonic() < deadline, "the exec outlived its client"
                time.sleep(0.2)
            assert sandbox.exec(["echo", "still serving"]).stdout == b"still serving\n"
        deadline = time.monotonic() + 20  # the exec's line is written once the service has reaped it

        def exec_statuses() -> list[int]:
            lines = [json.loads(line) for line in (sbx_root.state / "audit.log").read_text().splitlines()]
            return [line["status"] for line in lines if line["verb"] == "exec"]

        while 137 not in exec_statuses():
            assert time.monotonic() < deadline, exec_statuses()
            time.sleep(0.1)
        assert sorted(exec_statuses()) == [0, 137]
    finally:
        started.stop()


@contextlib.contextmanager
def _through(front: str, broker: SandboxBroker) -> Iterator[Broker | Client]:
    """The embedded Broker ("embedded"), or a Client of a service started for the block ("client")."""
    if front == "embedded":
        yield Broker(config_dir=str(broker.config), state_dir=str(broker.state))
        return
    started = Service(broker, _socket_dir(broker) / "broker.sock").start()
    try:
        yield Client(str(started.socket))
    finally:
        started.stop()


@pytest.mark.parametrize("front", ["embedded", "client"])
def test_put_and_get_copy_files_and_directories_as_the_sandbox_user(
    sbx_root: SandboxBroker, front: str, tmp_path: Path
) -> None:
    with _through(front, sbx_root) as broker:
        tree = tmp_path / "tree"
        (tree / "sub").mkdir(parents=True)
        (tree / "a.txt").write_text("alpha\n")
        (tree / "sub" / "b.bin").write_bytes(bytes(range(256)) * 1000)
        (tree / "sub" / "run.sh").write_text("#!/bin/sh\necho ran\n")
        (tree / "sub" / "run.sh").chmod(0o755)
        with broker.create(sbx_root.profile) as sandbox:
            sandbox.put(str(tree), "/workspace/in/tree")
            sandbox.put(str(tree / "a.txt"), "/workspace/single.txt")
            script = "cat /workspace/in/tree/a.txt /workspace/single.txt; /workspace/in/tree/sub/run.sh"
            seen = sandbox.exec(["sh", "-c", script + "; stat -c %u /workspace/single.txt"])
            assert seen.stdout == b"alpha\nalpha\nran\n1000\n", seen.stderr
            made = sandbox.exec(["sh", "-c", "mkdir -p /workspace/out/deep && echo made > /workspace/out/deep/x"])
            assert made.status == 0
            sandbox.get("/workspace/in/tree", str(tmp_path / "back"))
            sandbox.get("/workspace/out", str(tmp_path / "out"))
            sandbox.get("/workspace/single.txt", str(tmp_path / "single.txt"))
            assert (tmp_path / "back" / "sub" / "b.bin").read_bytes() == (tree / "sub" / "b.bin").read_bytes()
            assert (tmp_path / "back" / "sub" / "run.sh").stat().st_mode & 0o777 == 0o755
            assert (tmp_path / "out" / "deep" / "x").read_text() == "made\n"
            assert (tmp_path / "single.txt").read_text() == "alpha\n"

            # What the sandbox hands back is only ever regular files and directories.
            assert sandbox.exec(["ln", "-s", "/etc/shadow", "/workspace/out/link"]).status == 0
            with pytest.raises(UsageError) as refused:
                sandbox.get("/workspace/out", str(tmp_path / "again"))
            assert "is not a regular file or directory" in refused.value.message
            assert not (tmp_path / "again").exists()
            with pytest.raises(UsageError):
                sandbox.get("/workspace/single.txt", str(tmp_path / "single.txt"))  # never overwrites
            with pytest.raises(UsageError):
                sandbox.put(str(tree), "relative/path")

            # Streams both ways: past the service's 16 MiB body limit, never held whole.
            big = tmp_path / "big.bin"
            big.write_bytes(os.urandom(1 << 20) * 40)
            sandbox.put(str(big), "/workspace/big.bin")
            sandbox.get("/workspace/big.bin", str(tmp_path / "big-back.bin"))
            assert (tmp_path / "big-back.bin").read_bytes() == big.read_bytes()
            with pytest.raises(UsageError) as missing:
                sandbox.get("/workspace/no-such", str(tmp_path / "none"))
            assert missing.value.message.startswith("get: /workspace/no-such: tar in the sandbox failed (tar:")
            assert not (tmp_path / "none").exists()


@pytest.mark.parametrize("front", ["embedded", "client"])
def test_leaving_an_exec_stream_early_kills_the_exec(sbx_root: SandboxBroker, front: str) -> None:
    """Embedded and through the service alike: a program that stops listening stops the command."""
    with _through(front, sbx_root) as broker, broker.create(sbx_root.profile) as sandbox:
        marker = f"{8000 + os.getpid() % 1000}.5"
        stream = sandbox.exec_stream(["sh", "-c", f"sleep {marker} & yes flood"])
        for kind, chunk in stream:
            assert (kind, chunk[:6]) == ("stdout", b"flood\n")
            break
        deadline = time.monotonic() + 10
        while _running_marker(sbx_root, sandbox.id, f"sleep {marker}"):
            assert time.monotonic() < deadline, "the exec outlived the iteration that left it"
            time.sleep(0.2)


@pytest.mark.parametrize("front", ["embedded", "client"])
def test_a_programs_signal_reaches_the_exec_as_a_cli_clients_does(sbx_root: SandboxBroker, front: str) -> None:
    """`stream.signal(SIGINT)` while the exec runs: bwrap passes it to the command, which traps it;
    Docker's Engine cannot, so the exec is killed (130) — as for a CLI client's Ctrl-C. Before the
    iteration and after it there is nothing to signal; SIGKILL is no signal a caller sends."""
    script = 'trap "echo caught; exit 3" INT; echo ready; while :; do sleep 0.1; done'
    with _through(front, sbx_root) as broker, broker.create(sbx_root.profile) as sandbox:
        stream = sandbox.exec_stream(["sh", "-c", script], timeout=60)
        assert stream.signal(signal.SIGINT) is False  # not started
        with pytest.raises(UsageError) as refused:
            stream.signal(signal.SIGKILL)
        assert refused.value.message == (
            f"signal: {int(signal.SIGKILL)} is not one an exec's command may be sent (SIGINT, SIGTERM or SIGHUP)"
        )
        out = b""
        for kind, chunk in stream:
            out += chunk if kind == "stdout" else b""
            if out == b"ready\n":
                assert stream.signal(signal.SIGINT) is True
        assert (stream.status, out) == ((3, b"ready\ncaught\n") if sbx_root.backend == "bwrap" else (130, b"ready\n"))
        assert stream.signal(signal.SIGINT) is False  # ended
        assert sandbox.exec(["true"]).status == 0


def _granted_one_sandbox(broker: SandboxBroker, account: pwd.struct_passwd) -> Service:
    """Grants (approved) `account` one sandbox of the broker's profile; a service started for it."""
    (broker.config / "grants.yaml").write_text(
        f"grants:\n  - users: [{account.pw_name}]\n    profiles: [{broker.profile}]\n"
        "    max_sandboxes: 1\n    max_ttl_seconds: 3600\n"
    )
    assert broker.run("ext", "approve", "grants").status == 0
    return Service(broker, _socket_dir(broker) / "broker.sock").start()


def test_only_an_execs_own_caller_may_signal_it(
    sb_root: SandboxBroker, callers: tuple[pwd.struct_passwd, pwd.struct_passwd]
) -> None:
    """Another account that knows the exec's name and its sandbox is answered as for no exec; a
    name that is not a running exec's, and a signal that is not one of the three, are refused."""
    a, _ = callers
    started = _granted_one_sandbox(sb_root, a)
    try:
        owner = Client(str(started.socket))
        with owner.create(sb_root.profile) as sandbox:
            stream = sandbox.exec_stream(["sh", "-c", "echo ready; sleep 30"], timeout=60)
            chunks = iter(stream)
            assert next(chunks) == ("stdout", b"ready\n")
            exec_id = stream._exec_id
            assert exec_id is not None
            assert len(exec_id) == 32
            path = f"/v1/sandboxes/{sandbox.id}/exec/{exec_id}/signal"
            code = (
                "import json\nfrom sandboxer import Client\nfrom sandboxer.errors import SandboxerError\n"
                f"client = Client({str(started.socket)!r})\n"
                f"try:\n    client.service.request('POST', {path!r}, {{'signal': 'SIGTERM'}})\n"
                "except SandboxerError as exc:\n    print(json.dumps([type(exc).__name__, exc.status, exc.message]))\n"
            )
            done = _as_account(a, code)
            assert json.loads(done.stdout) == ["NotFoundError", 4, f"no such exec: {exec_id}"], done.stderr
            unknown_path = f"/v1/sandboxes/{sandbox.id}/exec/{'0' * 32}/signal"
            with pytest.raises(NotFoundError) as unknown:
                owner.service.request("POST", unknown_path, {"signal": "SIGTERM"})
            assert unknown.value.message == f"no such exec: {'0' * 32}"
            with pytest.raises(UsageError) as bad:
                owner.service.request("POST", path, {"signal": "SIGKILL"})
            assert bad.value.message == "signal: must be one of SIGINT, SIGTERM, SIGHUP"
            assert stream.signal(signal.SIGTERM) is True  # its own caller's: the command ends
            assert list(chunks) == []
            assert stream.status == 128 + signal.SIGTERM
    finally:
        started.stop()


AT_ITS_LIMIT = """
import json, signal, socket, sys
from sandboxer import Client
from sandboxer.errors import SandboxerError
path, profile = sys.argv[1], sys.argv[2]
client = Client(path)
sandbox = client.create(profile)
stream = sandbox.exec_stream(["sh", "-c", "echo ready; sleep 30"], timeout=60)
chunks = iter(stream)
next(chunks)  # the exec runs: one request of this account's 32 under way
held = []
for _ in range(31):  # CLI requests that never go on: the other 31
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    socket.send_fds(conn, [b"\\0{"], [0, 1, 2])
    held.append(conn)
try:
    client.list()
    busy = None
except SandboxerError as exc:
    busy = [type(exc).__name__, exc.message]
sent = stream.signal(signal.SIGTERM)
list(chunks)
for conn in held:
    conn.close()
import time
deadline = time.monotonic() + 30
while True:  # the service gives back a slot when it sees that connection's end: not at once
    try:
        client.list()
        break
    except SandboxerError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
sandbox.teardown()
print(json.dumps([busy, sent, stream.status]))
"""


def test_a_caller_at_its_limit_can_still_signal_its_exec(
    sb_root: SandboxBroker, callers: tuple[pwd.struct_passwd, pwd.struct_passwd]
) -> None:
    """A granted caller with its 32 requests under way (one of them the exec) is refused a 33rd
    (429), yet its exec's signal goes through: a signal is short and is for the very requests
    that hold the slots."""
    a, _ = callers
    started = _granted_one_sandbox(sb_root, a)
    try:
        code = f"import sys\nsys.argv[1:] = [{str(started.socket)!r}, {sb_root.profile!r}]\n" + AT_ITS_LIMIT
        done = _as_account(a, code)
        assert done.returncode == 0, done.stderr
        busy, sent, status = json.loads(done.stdout)
        assert busy == ["PolicyError", f"uid {a.pw_uid} has 32 requests under way (the service's limit per caller)"]
        assert (sent, status) == (True, 128 + signal.SIGTERM)
    finally:
        started.stop()


def test_the_systemd_units_verify(tmp_path: Path) -> None:
    """contrib/'s units as systemd reads them (systemd-analyze verify), with ExecStart pointing at
    this checkout's console script."""
    contrib = Path(__file__).parents[2] / "contrib"
    script = Path(sys.executable).with_name("sandboxer")
    service_text = (contrib / "sandboxer.service").read_text()
    assert "KillMode=process" in service_text  # sandboxes outlive a restart
    for forbidden in ("ProtectSystem", "PrivateTmp", "ProtectHome", "PrivateDevices", "ProtectClock"):
        assert f"\n{forbidden}=" not in service_text  # no mount namespace or device policy of its own
    (tmp_path / "sandboxer.service").write_text(service_text.replace("/usr/local/bin/sandboxer", str(script)))
    (tmp_path / "sandboxer.socket").write_text((contrib / "sandboxer.socket").read_text())
    units = [str(tmp_path / "sandboxer.socket"), str(tmp_path / "sandboxer.service")]
    checked = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *units], capture_output=True, text=True, check=False
    )
    assert checked.returncode == 0, checked.stderr
    assert checked.stderr == ""


def test_the_units_bounding_set_leaves_the_broker_all_it_needs(sb_root: SandboxBroker) -> None:
    """The root service without the capabilities the unit takes out of its bounding set (setpriv
    drops them as systemd would): a sandbox's whole life still works, and the service holds none."""
    unit = (Path(__file__).parents[2] / "contrib" / "sandboxer.service").read_text()
    line = next(line for line in unit.splitlines() if line.startswith("CapabilityBoundingSet=~"))
    dropped = line.split("~", 1)[1].split()
    assert "CAP_SYS_MODULE" in dropped
    path = _socket_dir(sb_root) / "bounded.sock"
    log = sb_root.root / "bounded.log"
    bounding = ",".join("-" + name.removeprefix("CAP_").lower() for name in dropped)
    with log.open("wb") as out:
        process = subprocess.Popen(
            ["setpriv", "--bounding-set", bounding, "--", *sb_root.argv("serve", "--socket", str(path))],
            stdout=out,
            stderr=out,
            env=sb_root.env(),
        )
    try:
        deadline = time.monotonic() + 20
        while not answers(path):
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the service never answered"
            time.sleep(0.05)
        with open(f"/proc/{process.pid}/status") as status:
            bounding_set = int(next(row for row in status if row.startswith("CapBnd:")).split()[1], 16)
        numbers = {"CAP_SYS_MODULE": 16, "CAP_SYS_RAWIO": 17, "CAP_SYS_BOOT": 22, "CAP_SYS_TIME": 25}
        assert not any(bounding_set >> numbers[name] & 1 for name in dropped if name in numbers)
        client = Client(str(path))
        with client.create(sb_root.profile) as sandbox:
            assert sandbox.exec(["echo", "bounded"]).stdout == b"bounded\n"
            assert sandbox.inspect().matches_plan is True
        assert sandbox.teardown().residue == ()
        assert client.list() == []
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)


def test_socket_activation_serves_the_socket_it_is_given(sb_root: SandboxBroker) -> None:
    """As systemd starts it from sandboxer.socket (systemd-socket-activate passes the socket)."""
    path = _socket_dir(sb_root) / "activated.sock"
    log = sb_root.root / "activated.log"
    with log.open("wb") as output:
        activator = subprocess.Popen(
            ["systemd-socket-activate", "--listen", str(path), *sb_root.argv("serve")],
            stdout=output,
            stderr=output,
            env=sb_root.env(),
        )
    try:
        deadline = time.monotonic() + 20
        while not path.exists():
            assert activator.poll() is None, log.read_text()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        client = Client(str(path))
        with client.create(sb_root.profile) as sandbox:
            assert sandbox.exec(["echo", "activated"]).stdout == b"activated\n"
    finally:
        activator.terminate()
        activator.wait(timeout=30)
    assert not list(sb_root.state.glob("*.sock"))  # it made no socket of its own


def test_an_execs_input_and_output_stream_past_the_body_limit(sbx_root: SandboxBroker) -> None:
    """exec's stdin is streamed into the command and its output out of it: 40 MiB in and out,
    where a request body is otherwise limited to 16 MiB."""
    started = Service(sbx_root, _socket_dir(sbx_root) / "broker.sock").start()
    try:
        client = Client(str(started.socket))
        with client.create(sbx_root.profile) as sandbox:
            data = os.urandom(1024) * (40 * 1024)
            result = sandbox.exec(["sh", "-c", "sha256sum; head -c 41943040 /dev/zero"], stdin=data)
            assert result.status == 0, result.stderr
            assert result.stdout[:64].decode() == hashlib.sha256(data).hexdigest()
            assert len(result.stdout) == 64 + len("  -\n") + 40 * 1024 * 1024
            # A command that reads none of a large input still ends, and the service goes on.
            ignored = sandbox.exec(["true"], stdin=b"x" * (20 * 1024 * 1024))
            assert ignored.status == 0
            assert sandbox.exec(["echo", "on"]).stdout == b"on\n"
    finally:
        started.stop()


def test_sigterm_ends_an_exec_whose_client_stopped_reading(sb_root: SandboxBroker) -> None:
    """A client that sends a large stdin and never reads (the command's output fills the service's
    queue, the command waits): SIGTERM still stops the service, and the exec with it."""
    started = Service(sb_root, _socket_dir(sb_root) / "broker.sock").start()
    sandbox = Client(str(started.socket)).create(sb_root.profile)
    marker = f"{6000 + os.getpid() % 1000}.5"
    body = json.dumps({"argv": ["sh", "-c", f"sleep {marker} & cat"]}).encode() + b"\n" + b"z" * (32 * 1024 * 1024)
    head = f"POST /v1/sandboxes/{sandbox.id}/exec HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(started.socket))
        sock.settimeout(60)
        sock.sendall(head.encode())
        sent = 0
        sock.setblocking(False)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # send until nothing more is taken: everyone waits
            try:
                sent += sock.send(body[sent : sent + 65536])
            except BlockingIOError:
                time.sleep(0.5)
                try:
                    sent += sock.send(body[sent : sent + 65536])
                except BlockingIOError:
                    break
        assert 0 < sent < len(body), "the whole body went in: nothing was held up"
        assert _running_marker(sb_root, sandbox.id, f"sleep {marker}")
        assert started.stop(signal.SIGTERM) == 0  # within the stop's own 30 s
    deadline = time.monotonic() + 20
    while _running_marker(sb_root, sandbox.id, f"sleep {marker}"):
        assert time.monotonic() < deadline, "the exec outlived the service"
        time.sleep(0.2)
    assert sb_root.run("teardown", sandbox.id).status == 0


CONCURRENT_CREATES = """
import json, sys
from concurrent.futures import ThreadPoolExecutor
from sandboxer import Client
from sandboxer.errors import SandboxerError
client = Client(sys.argv[1])
def one(_):
    try:
        return client.create(sys.argv[2]).id
    except SandboxerError as exc:
        return [exc.status, exc.message]
with ThreadPoolExecutor(3) as pool:
    print(json.dumps(list(pool.map(one, range(3)))))
"""


def test_concurrent_creates_of_a_caller_stay_within_its_limit(
    sb_root: SandboxBroker, callers: tuple[pwd.struct_passwd, pwd.struct_passwd]
) -> None:
    """Three creates at once under max_sandboxes: 2 — two sandboxes and one refusal (the creates
    under way count against the limit; they no longer run one after another)."""
    a, _ = callers
    grants = f"grants:\n  - users: [{a.pw_name}]\n    profiles: [{sb_root.profile}]\n"
    (sb_root.config / "grants.yaml").write_text(grants + "    max_sandboxes: 2\n    max_ttl_seconds: 3600\n")
    sb_root.approve("grants")
    started = Service(sb_root, _socket_dir(sb_root) / "broker.sock").start()
    try:
        code = CONCURRENT_CREATES.replace("sys.argv[1]", repr(str(started.socket)))
        done = _as_account(a, code.replace("sys.argv[2]", repr(sb_root.profile)))
        assert done.returncode == 0, done.stderr
        results = json.loads(done.stdout)
        made = [r for r in results if isinstance(r, str)]
        refused = [r for r in results if not isinstance(r, str)]
        assert len(made) == 2, results
        assert refused == [[3, f"uid {a.pw_uid} has its 2 live sandboxes (max_sandboxes)"]]
        owner = Client(str(started.socket))
        assert sorted(item.id for item in owner.list()) == sorted(made)
        for sandbox_id in made:
            owner.sandbox(sandbox_id).teardown()
    finally:
        started.stop()


def test_a_client_that_stops_reading_cannot_keep_its_exec_past_its_timeout(sbx_root: SandboxBroker) -> None:
    """The command floods its output and the client reads none of it, staying connected: the
    command still ends at its --timeout (the service's queue and the pipes are full, its exec
    loop blocked handing output on); the client that reads later gets status 124."""
    started = Service(sbx_root, _socket_dir(sbx_root) / "broker.sock").start()
    try:
        sandbox = Client(str(started.socket)).create(sbx_root.profile)
        marker = f"{7000 + os.getpid() % 1000}.5"
        options = {"argv": ["sh", "-c", f"sleep {marker} & yes flood"], "timeout": 2}
        body = json.dumps(options).encode() + b"\n"
        head = f"POST /v1/sandboxes/{sandbox.id}/exec HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(str(started.socket))
            sock.sendall(head.encode() + body)
            assert _running_marker(sbx_root, sandbox.id, f"sleep {marker}")
            deadline = time.monotonic() + 20
            while _running_marker(sbx_root, sandbox.id, f"sleep {marker}"):
                assert time.monotonic() < deadline, "the exec outlived its timeout while its client held on"
                time.sleep(0.2)
            answer = b""
            sock.settimeout(30)
            while chunk := sock.recv(1 << 20):  # now read it all: the end frame says why it ended
                answer += chunk
                if answer.endswith(b"0\r\n\r\n"):
                    break
        assert b'{"status": 124}' in answer
        sandbox.teardown()
    finally:
        started.stop()


class _FailingInput(io.RawIOBase):
    """A caller's stdin that gives some bytes, then fails."""

    def __init__(self) -> None:
        self.calls = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        self.calls += 1
        if self.calls > 1:
            raise OSError(errno.EIO, "the caller's input failed")
        buffer[:6] = b"first\n"
        return 6


@pytest.mark.parametrize("front", ["embedded", "client"])
def test_a_file_as_stdin_streams_and_its_failures_reach_the_caller(sb_root: SandboxBroker, front: str) -> None:
    with _through(front, sb_root) as broker, broker.create(sb_root.profile) as sandbox:
        read_end, write_end = os.pipe()
        with os.fdopen(read_end, "rb") as source:
            os.write(write_end, b"one\ntwo\n")
            os.close(write_end)
            assert sandbox.exec(["cat"], stdin=source).stdout == b"one\ntwo\n"

        with pytest.raises(OSError, match="the caller's input failed"):
            sandbox.exec(["cat"], stdin=_FailingInput())  # type: ignore[arg-type]

        # Leaving the stream early does not wait for input that never comes.
        quiet_r, quiet_w = os.pipe()
        with os.fdopen(quiet_r, "rb") as never:
            began = time.monotonic()
            for kind, chunk in sandbox.exec_stream(["sh", "-c", "echo go; cat"], stdin=never):
                assert (kind, chunk) == ("stdout", b"go\n")
                break
            assert time.monotonic() - began < 10
        os.close(quiet_w)


def test_a_create_whose_http_client_went_away_leaves_no_sandbox(sb_root: SandboxBroker) -> None:
    """The client never learns the id of a create it left: the service tears it down (audited
    with status 130), as it does for a CLI client's Ctrl-C."""
    started = Service(sb_root, _socket_dir(sb_root) / "broker.sock").start()
    try:
        body = json.dumps({"profile": sb_root.profile}).encode()
        head = f"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        registry = sb_root.state / "sandboxes"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(str(started.socket))
            sock.sendall(head + body)
            deadline = time.monotonic() + 30
            while not [name for name in os.listdir(registry) if not name.startswith(".")]:
                assert time.monotonic() < deadline, "no create began"
                time.sleep(0.005)
        deadline = time.monotonic() + 30
        while ("create", 130) not in [
            (line["verb"], line["status"]) for line in map(json.loads, _audit_lines(sb_root))
        ]:
            assert time.monotonic() < deadline, "the create was not audited as abandoned"
            time.sleep(0.1)
        assert Client(str(started.socket)).list() == []
    finally:
        started.stop()


def _audit_lines(broker: SandboxBroker) -> list[str]:
    log = broker.state / "audit.log"
    return log.read_text().splitlines() if log.exists() else []


@pytest.mark.parametrize("front", ["embedded", "client"])
def test_exec_env_through_the_api(sb_root: SandboxBroker, front: str) -> None:
    """exec(env=) as exec --env: the profile's exec.caller_env names only (ExecError, 125, else)."""
    sb_root.write_profile(
        "with-env", backend_profile_text(sb_root, "with-env", sb_root.repo, "exec:\n  caller_env: [TASK_ID]\n")
    )
    assert sb_root.run("ext", "approve", "with-env").status == 0
    with _through(front, sb_root) as broker, broker.create("with-env") as sandbox:
        ran = sandbox.exec(["sh", "-c", 'echo "$TASK_ID"'], env={"TASK_ID": "t-7"})
        assert (ran.status, ran.stdout) == (0, b"t-7\n")
        with pytest.raises(ExecError) as refused:
            sandbox.exec(["true"], env={"PATH": "/tmp"})
        assert refused.value.status == 125
        assert "exec.caller_env" in refused.value.message
