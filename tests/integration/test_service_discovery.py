"""How clients find the service and whom they trust on a socket: the peer check of both clients
(the sandboxer command and sandboxer.Client), a granted account finding the system service on
/run/sandboxer/broker.sock, and root's command starting the service on demand.

Real accounts (useradd), real sockets, a real root service on the host-wide system socket path:
the module owns that path while it runs (a lock file beside it; it never replaces a service it
did not start) and leaves the host as it found it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxer import Client
from sandboxer.clients.cli import IDLE_EXIT
from sandboxer.dirs import ROOT_SOCKET
from sandboxer.errors import UntrustedServiceError
from tests.integration.conftest import (
    PROFILE,
    SandboxBroker,
    _bwrap_broker,
    _cleanup,
    _require_tools,
    profile_text,
    services_of,
)
from tests.integration.services import Service, answers
from tests.integration.test_bootstrap_cli_and_delivery import document, new_credential, rendered, write_bootstrap

REPO = Path(__file__).resolve().parents[2]
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
STRANGER, GRANTED = f"sbxdscother{_WORKER}", f"sbxdscgrant{_WORKER}"
SYSTEM_LOCK = Path(ROOT_SOCKET).parent.with_name("sandboxer.test-lock")  # /run, beside /run/sandboxer


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A temporary directory other accounts may pass through (pytest's tmp_path is root's alone)."""
    root = Path(tempfile.mkdtemp(prefix="sbx-dsc-", dir="/tmp"))
    root.chmod(0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def _account(name: str) -> Iterator[pwd.struct_passwd]:
    if os.geteuid() != 0:
        pytest.skip("creating a test account needs root (CI runs as root)")
    subprocess.run(["userdel", name], capture_output=True, check=False)
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], check=False)


@pytest.fixture(scope="module")
def stranger() -> Iterator[pwd.struct_passwd]:
    """A real account that is neither root nor the test's."""
    with _account(STRANGER) as account:
        yield account


@pytest.fixture(scope="module")
def granted() -> Iterator[pwd.struct_passwd]:
    """A real account the system service's grants.yaml names."""
    with _account(GRANTED) as account:
        yield account


def _as(account: pwd.struct_passwd, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    ids = [str(account.pw_uid), str(account.pw_gid)]
    wrap = ["setpriv", "--reuid", ids[0], "--regid", ids[1], "--clear-groups", "--"]
    return subprocess.run([*wrap, *argv], capture_output=True, text=True, env=env, timeout=120, check=False, cwd="/")


# A listener that accepts `count` connections and prints how many bytes each brought.
RECORDER = """
import socket, sys
path, count = sys.argv[1], int(sys.argv[2])
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(path)
import os; os.chmod(path, 0o777)
server.listen(8)
print("ready", flush=True)
for _ in range(count):
    conn, _ = server.accept()
    conn.settimeout(5)
    received = 0
    try:
        while data := conn.recv(65536):
            received += len(data)
    except OSError:
        pass
    conn.close()
    print(received, flush=True)
"""


def test_neither_client_sends_a_byte_to_a_socket_of_another_account(
    open_tmp: Path, stranger: pwd.struct_passwd
) -> None:
    """Each connection of sandboxer.Client — a request, a create with a bootstrap credential, an
    exec with stdin — and the sandboxer command's are refused before a byte when another account
    answers: its listener counts zero bytes for every one."""
    directory = open_tmp / "theirs"
    directory.mkdir()
    os.chown(directory, stranger.pw_uid, stranger.pw_gid)
    path = directory / "broker.sock"
    ids = [str(stranger.pw_uid), str(stranger.pw_gid)]
    wrap = ["setpriv", "--reuid", ids[0], "--regid", ids[1], "--clear-groups", "--"]
    listener = subprocess.Popen(
        [*wrap, sys.executable, "-c", RECORDER, str(path), "4"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert listener.stdout is not None
        assert listener.stdout.readline() == "ready\n"
        credential = new_credential()
        bootstrap = write_bootstrap(open_tmp / "bootstrap.json", rendered(document(credential)))
        client = Client(str(path), timeout=10)
        refusal = f"the service on {path} runs as uid {stranger.pw_uid}, neither root nor this account; refused"
        calls = (
            client.list,
            lambda: client.create(PROFILE, bootstrap=str(bootstrap)),
            lambda: client.sandbox("0123456789abcdef01234567").exec(["cat"], stdin=credential.encode()),
        )
        for call in calls:
            with pytest.raises(UntrustedServiceError) as refused:
                call()
            assert (refused.value.message, refused.value.status) == (refusal, 3)
            assert credential not in str(refused.value)
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "SANDBOXER_SOCKET": str(path), "SECRET": credential}
        done = subprocess.run(
            [sys.executable, "-m", "sandboxer", "create", "--profile", PROFILE, "--bootstrap", str(bootstrap)],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )
        assert (done.returncode, done.stderr) == (125, f"sandboxer: {refusal}\n")
        out, _ = listener.communicate(timeout=30)
        assert out.split() == ["0", "0", "0", "0"]  # four connections, not one byte on any
    finally:
        listener.kill()
        listener.communicate()


def test_roots_command_starts_the_service_of_its_state_dir(sb_root: SandboxBroker) -> None:
    """Root without a running service: its command starts one for the state dir on demand, as a
    user's starts its private one (it leaves after IDLE_EXIT seconds unused), and uses it."""
    sb_root.through_service = True  # no SANDBOXER_NO_SERVICE
    socket_path = sb_root.state / "broker.sock"
    shutil.rmtree(sb_root.state)  # a first command ever: the command makes the state dir (as root: 0711)
    assert services_of(sb_root.state) == []
    sandbox_id = sb_root.create()
    assert sb_root.exec(sandbox_id, "echo", "served").stdout == "served\n"
    started = services_of(sb_root.state)
    assert len(started) == 1
    assert os.stat(f"/proc/{started[0]}").st_uid == 0
    argv = Path(f"/proc/{started[0]}/cmdline").read_bytes().split(b"\0")
    assert argv[argv.index(b"--idle-exit") + 1] == str(IDLE_EXIT).encode()
    assert argv[argv.index(b"--socket") + 1] == str(socket_path).encode()
    assert os.getsid(started[0]) == started[0]  # a session of its own
    assert "serving" in (sb_root.state / "service.log").read_text()
    verbs = [json.loads(line)["verb"] for line in (sb_root.state / "audit.log").read_text().splitlines()]
    assert "cli create" in verbs
    assert "cli exec" in verbs
    # SANDBOXER_NO_SERVICE=1 stays the explicit switch: in-process, no audit line.
    sb_root.through_service = False
    assert sb_root.exec(sandbox_id, "true").status == 0
    assert [json.loads(line)["verb"] for line in (sb_root.state / "audit.log").read_text().splitlines()] == verbs


def test_help_and_the_version_start_no_service(tmp_path: Path) -> None:
    """Help and the version need nothing of the broker: a first command that only asks for them
    starts no service and leaves nothing in the state dir (a new user's first command)."""
    state, config = tmp_path / "state", tmp_path / "config"
    env = {"PATH": os.environ["PATH"], "LANG": "C.UTF-8", "SANDBOXER_STATE": str(state)}
    env["SANDBOXER_CONFIG"] = str(config)
    for argv in (["--version"], ["--help"], ["create", "--help"], ["exec", "--help"], ["list", "--help"]):
        done = subprocess.run(
            [sys.executable, "-m", "sandboxer", *argv], capture_output=True, text=True, env=env, timeout=60, check=False
        )
        assert (done.returncode, done.stderr) == (0, ""), argv
        assert done.stdout.strip(), argv
        assert services_of(state) == [], argv
        assert not state.exists() or not {"broker.sock", "service.log", "audit.log"} & set(os.listdir(state)), argv


class SystemService:
    """The module's root service on the system socket path, which it may stop and start again."""

    def __init__(self, broker: SandboxBroker) -> None:
        self.broker = broker
        self.service: Service | None = None

    def start(self) -> None:
        self.service = Service(self.broker, Path(ROOT_SOCKET)).start()

    def stop(self) -> None:
        if self.service is not None:
            self.service.stop()
            self.service = None


@pytest.fixture(scope="module")
def system_service(runtime_dir: Path) -> Iterator[SystemService]:
    """A root service answering on /run/sandboxer/broker.sock for a test broker's directories.
    The path is the host's: a lock file beside /run/sandboxer keeps two workers (or two runs)
    apart; a service this fixture did not start is never replaced (the tests skip); afterwards
    the socket is gone (serve removes it) and /run/sandboxer as it was."""
    _require_tools()
    if os.geteuid() != 0:
        pytest.skip("the system service runs as root (CI runs as root)")
    run_dir = Path(ROOT_SOCKET).parent
    lock = os.open(SYSTEM_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # waits for another worker's (or run's) module to end
        if answers(Path(ROOT_SOCKET)):
            pytest.skip(f"a service this test did not start answers on {ROOT_SOCKET}")
        made_run_dir = not run_dir.exists()
        broker = _bwrap_broker(runtime_dir, as_user=False)
        system = SystemService(broker)
        try:
            system.start()  # serve makes /run/sandboxer when missing
            yield system
        finally:
            system.stop()
            _cleanup(broker)
            if made_run_dir:
                with contextlib.suppress(OSError):
                    run_dir.rmdir()
    finally:
        os.close(lock)  # the lock file stays (a few bytes in /run): removing it would let two in


@pytest.fixture
def caller_home(open_tmp: Path, granted: pwd.struct_passwd) -> Path:
    """A home of the granted account's own, with no sandboxer configuration in it."""
    home = open_tmp / "home"
    home.mkdir()
    os.chown(home, granted.pw_uid, granted.pw_gid)
    return home


def _caller_env(home: Path) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8", "PYTHONPATH": str(REPO)}


def _grant(broker: SandboxBroker, account: pwd.struct_passwd, *profiles: str) -> None:
    grants = broker.config / "grants.yaml"
    grants.write_text(
        f"grants:\n  - users: [{account.pw_name}]\n    profiles: [{', '.join(profiles)}]\n"
        "    max_sandboxes: 2\n    max_ttl_seconds: 3600\n"
    )
    broker.approve("grants")


CLIENT_CODE = """
import json, sys
from sandboxer import Client
client = Client()
with client.create(sys.argv[1]) as sandbox:
    out = sandbox.exec(["echo", "through", "the", "system", "service"]).stdout.decode()
print(json.dumps({"socket": client.socket, "out": out}))
"""


def test_a_granted_account_finds_the_system_service(
    system_service: SystemService, granted: pwd.struct_passwd, caller_home: Path
) -> None:
    """No configuration of its own: the command and Client() use root's service on the system
    socket, and a refusal tells the caller to ask the owner, never to run an owner's command."""
    broker = system_service.broker
    unapproved = "not-approved"
    broker.write_profile(unapproved, profile_text(unapproved, broker.repo))  # granted, never approved
    _grant(broker, granted, PROFILE, unapproved)
    env = _caller_env(caller_home)
    cli = [sys.executable, "-m", "sandboxer"]

    created = _as(granted, [*cli, "create", "--profile", PROFILE], env)
    assert created.returncode == 0, created.stderr
    sandbox_id = created.stdout.strip()
    ran = _as(granted, [*cli, "exec", sandbox_id, "--", "id", "-u"], env)
    assert (ran.returncode, ran.stdout) == (0, "1000\n"), ran.stderr
    local = caller_home / "note.txt"
    local.write_text("from the caller\n")
    os.chown(local, granted.pw_uid, granted.pw_gid)
    copied = _as(granted, [*cli, "cp", str(local), f"{sandbox_id}:/workspace/note.txt"], env)  # its own process
    assert copied.returncode == 0, copied.stderr
    read = _as(granted, [*cli, "exec", sandbox_id, "--", "cat", "/workspace/note.txt"], env)
    assert read.stdout == "from the caller\n", read.stderr
    record = json.loads((broker.state / "sandboxes" / sandbox_id / "record.json").read_text())
    os.kill(record["holder_pid"], signal.SIGKILL)  # the sandbox dies under its caller
    deadline = time.monotonic() + 20
    while (inspected := _as(granted, [*cli, "inspect", sandbox_id], env)).returncode == 0:
        assert time.monotonic() < deadline, "the sandbox never stopped"
        time.sleep(0.1)
    assert inspected.returncode == 5
    assert inspected.stderr.endswith(f"(sandboxer teardown {sandbox_id} removes it)\n"), inspected.stderr
    assert "gc" not in inspected.stderr  # the owners' verb, not the caller's
    assert _as(granted, [*cli, "teardown", "--discard", sandbox_id], env).returncode == 0  # which it may do
    assert not (caller_home / ".local").exists()  # no private service, no state dir of its own

    through_client = _as(granted, [sys.executable, "-c", CLIENT_CODE, PROFILE], env)
    assert through_client.returncode == 0, through_client.stderr
    assert json.loads(through_client.stdout) == {"socket": ROOT_SOCKET, "out": "through the system service\n"}

    refused = _as(granted, [*cli, "create", "--profile", unapproved], env)
    assert refused.returncode == 3
    assert "ext approve" not in refused.stderr
    assert "NO_SERVICE" not in refused.stderr
    assert "ask the owner" in refused.stderr, refused.stderr

    # An account with a config dir of its own has a broker of its own: not the system service's.
    (caller_home / ".config" / "sandboxer").mkdir(parents=True)
    for directory in (caller_home / ".config", caller_home / ".config" / "sandboxer"):
        os.chown(directory, granted.pw_uid, granted.pw_gid)
    own = _as(granted, [sys.executable, "-c", "from sandboxer import Client; print(Client().socket)"], env)
    assert own.returncode == 0, own.stderr
    assert own.stdout.strip() != ROOT_SOCKET
    shutil.rmtree(caller_home / ".config")


def test_with_no_service_anywhere_a_caller_is_told_to_ask_the_owner(
    system_service: SystemService, granted: pwd.struct_passwd, caller_home: Path
) -> None:
    """The system service stopped and no broker of its own: the command starts no private
    broker (which has nothing to serve) but says whom to ask (125); Client() names the system
    socket with the same advice."""
    system_service.stop()
    try:
        env = _caller_env(caller_home)
        done = _as(granted, [sys.executable, "-m", "sandboxer", "create", "--profile", PROFILE], env)
        assert done.returncode == 125
        assert done.stderr.startswith(f"sandboxer: no service answers on {ROOT_SOCKET} (the system service)")
        assert "ask the owner" in done.stderr
        assert "serve" not in done.stderr
        assert "NO_SERVICE" not in done.stderr
        assert not (caller_home / ".local").exists()
        copied = _as(granted, [sys.executable, "-m", "sandboxer", "cp", "/etc/hostname", f"{'0' * 24}:/x"], env)
        assert (copied.returncode, copied.stderr) == (125, done.stderr)  # cp says the same
        code = (
            "from sandboxer import Client\nfrom sandboxer.errors import SandboxerError\n"
            "client = Client()\ntry:\n    client.list()\nexcept SandboxerError as exc:\n"
            "    print(client.socket); print(exc.hint)\n"
        )
        seen = _as(granted, [sys.executable, "-c", code], env)
        assert seen.returncode == 0, seen.stderr
        socket_line, hint = seen.stdout.splitlines()
        assert socket_line == ROOT_SOCKET
        assert "ask the owner" in hint
        assert "serve" not in hint
        assert services_of(caller_home) == []
    finally:
        system_service.start()
