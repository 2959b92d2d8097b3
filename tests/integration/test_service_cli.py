"""The `sandboxer` command as a client of the service: the command line, its working directory,
environment and stdio go to the service, which runs the command table for the caller the kernel
names and answers the exit status.

Real services, real sandboxes, real accounts; the CLI is run exactly as a user runs it.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxer.clients.cli import IDLE_EXIT
from tests.integration.conftest import UNPRIVILEGED_UID, SandboxBroker, _bwrap_broker, _cleanup, services_of
from tests.integration.services import Service
from tests.integration.test_cli_table import _command_paths, _root
from tests.integration.test_service import _running_marker, callers  # noqa: F401 - a fixture

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def served(sbx_root: SandboxBroker) -> Iterator[SandboxBroker]:
    """A root broker whose CLI goes through the service of its state dir."""
    started = Service(sbx_root, sbx_root.state / "broker.sock").start()
    sbx_root.through_service = True
    try:
        yield sbx_root
    finally:
        sbx_root.through_service = False
        started.stop()


def test_every_commands_help_is_the_same_through_the_service(sb_root: SandboxBroker) -> None:
    """`sandboxer --help` and each command's and subcommand's `--help` (exec's too): with a
    service answering exactly as in-process, and answered in the client's own process (help
    needs nothing of the broker: no service is asked, none is started for it)."""

    started = Service(sb_root, sb_root.state / "broker.sock").start()
    try:
        for path in [(), *_command_paths(_root())]:
            sb_root.through_service = True
            through = sb_root.run(*path, "--help")
            sb_root.through_service = False
            direct = sb_root.run(*path, "--help")
            assert (through.status, through.stdout, through.stderr) == (direct.status, direct.stdout, direct.stderr)
            assert through.status == 0, (path, through.stderr)
            assert through.stdout.startswith(" ".join(("Usage: sandboxer", *path))), (path, through.stdout)
    finally:
        sb_root.through_service = False
        started.stop()
    assert audited(sb_root) == []  # the service was asked nothing


def audited(broker: SandboxBroker) -> list[tuple[str, int]]:
    """(verb, status) of every line of the audit log."""
    log = broker.state / "audit.log"
    if not log.exists():
        return []
    return [(line["verb"], line["status"]) for line in map(json.loads, log.read_text().splitlines())]


def _ageless(text: str) -> str:
    """A list's JSON without the ages, which differ by the seconds between two runs."""
    return re.sub(r'"age_seconds": \d+', '"age_seconds": N', text)


def test_every_command_answers_through_the_service_as_in_process(served: SandboxBroker) -> None:
    """The same output, errors and statuses; the audit log shows the service ran them."""
    sandbox_id = served.create()
    cases: list[tuple[tuple[str, ...], bytes | None]] = [
        (("exec", sandbox_id, "--", "sh", "-c", "cat; echo out; echo err >&2; exit 7"), b"in\n"),
        (("exec", sandbox_id, "--cwd", "/workspace", "--", "pwd"), None),
        (("exec", sandbox_id, "--", "no-such-program"), None),
        (("exec", sandbox_id, "--timeout", "0.5", "--", "sleep", "30"), None),
        (("exec", "0" * 24, "--", "true"), None),
        (("exec", sandbox_id, "true"), None),
        (("inspect", "0" * 24), None),
        (("list", "--json"), None),
        (("create", "--profile", "no-such-profile"), None),
        (("create",), None),
        (("--version",), None),
        (("exec", "--help"), None),
    ]
    for args, stdin in cases:
        through = served.run(*args, stdin=stdin)
        served.through_service = False
        try:
            direct = served.run(*args, stdin=stdin)
        finally:
            served.through_service = True
        assert (through.status, _ageless(through.stdout), through.stderr) == (
            direct.status,
            _ageless(direct.stdout),
            direct.stderr,
        ), args
    first = served.run("exec", sandbox_id, "--", "sh", "-c", "cat; echo out; echo err >&2; exit 7", stdin=b"in\n")
    assert (first.status, first.stdout, first.stderr) == (7, "in\nout\n", "err\n")
    verbs = audited(served)
    assert ("cli exec", 7) in verbs
    assert ("cli exec", 124) in verbs
    assert ("cli inspect", 4) in verbs
    assert ("cli create", 0) in verbs
    assert served.run("teardown", sandbox_id).status == 0
    served.created.remove(sandbox_id)
    assert ("cli teardown", 0) in audited(served)


def test_no_service_runs_in_process_even_when_one_answers(served: SandboxBroker) -> None:
    before = audited(served)
    served.through_service = False
    assert served.run("list").status == 0
    assert audited(served) == before
    served.through_service = True
    assert served.run("list").status == 0
    assert audited(served) == [*before, ("cli list", 0)]


def test_a_command_gets_the_clients_own_descriptors(served: SandboxBroker) -> None:
    """The command's stdin and stdout are the client's pipes (a file behind a pipe, as in-process)."""
    sandbox_id = served.create()
    out = served.root / "out.txt"
    with out.open("wb") as target:
        done = subprocess.run(
            served.argv("exec", sandbox_id, "--", "sh", "-c", "wc -c; readlink /proc/self/fd/1"),
            input=b"x" * 100_000,
            stdout=target,
            stderr=subprocess.PIPE,
            env=served.env(),
            timeout=60,
            check=False,
        )
    assert done.returncode == 0, done.stderr
    count, link = out.read_text().split("\n")[:2]
    assert count.strip() == "100000"
    assert link.startswith("pipe:")  # never the caller's file itself


def _interrupted(broker: SandboxBroker, sandbox_id: str) -> tuple[int, bytes]:
    """SIGINT to the CLI while its exec runs a command that traps it: the status and output."""
    script = 'trap "echo caught; exit 3" INT; echo ready; while :; do sleep 0.1; done'
    process = subprocess.Popen(
        broker.argv("exec", sandbox_id, "--", "sh", "-c", script),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=broker.env(),
    )
    assert process.stdout is not None
    assert process.stdout.readline() == b"ready\n"
    process.send_signal(signal.SIGINT)
    out, _ = process.communicate(timeout=30)
    return process.returncode, out


def test_a_signal_to_the_client_reaches_the_exec_as_in_process(served: SandboxBroker) -> None:
    """bwrap passes the signal to the command; Docker's Engine cannot, so the exec is killed
    (130) — the same through the service as in-process."""
    sandbox_id = served.create()
    through = _interrupted(served, sandbox_id)
    served.through_service = False
    try:
        direct = _interrupted(served, sandbox_id)
    finally:
        served.through_service = True
    assert through == direct
    assert through == ((3, b"caught\n") if served.backend == "bwrap" else (130, b""))


def test_ctrl_c_during_a_create_through_the_service_leaves_no_sandbox(served: SandboxBroker) -> None:
    """As in-process: "interrupted", status 130, and nothing made is left (the service finishes
    the create it started, then tears it down)."""
    registry = served.state / "sandboxes"
    before = set(os.listdir(registry)) if registry.is_dir() else set()
    process = subprocess.Popen(
        served.argv("create", "--profile", served.profile),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=served.env(),
    )
    deadline = time.monotonic() + 30
    while not (set(os.listdir(registry)) - before if registry.is_dir() else set()):  # the create is under way
        assert time.monotonic() < deadline, "no create began"
        assert process.poll() is None, "the create ended before it began"
        time.sleep(0.005)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    assert (process.returncode, out, err) == (130, b"", b"sandboxer: interrupted\n")
    assert json.loads(served.run("list", "--json").stdout) == {"sandboxes": []}
    assert ("cli create", 130) in audited(served)


def test_an_exec_whose_client_is_killed_is_killed_with_all_it_started(served: SandboxBroker) -> None:
    sandbox_id = served.create()
    marker = f"{8000 + os.getpid() % 1000}.5"
    process = subprocess.Popen(
        served.argv("exec", sandbox_id, "--", "sh", "-c", f"sleep {marker} & sleep {marker}"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=served.env(),
    )
    deadline = time.monotonic() + 20
    while not _running_marker(served, sandbox_id, f"sleep {marker}"):
        assert time.monotonic() < deadline, "the exec's processes never showed"
        time.sleep(0.1)
    process.kill()
    process.wait()
    deadline = time.monotonic() + 20
    while _running_marker(served, sandbox_id, f"sleep {marker}"):
        assert time.monotonic() < deadline, "the exec outlived its client"
        time.sleep(0.2)
    assert served.exec(sandbox_id, "echo", "still serving").stdout == "still serving\n"
    deadline = time.monotonic() + 20  # the service writes the exec's line once it has reaped it
    while ("cli exec", 137) not in audited(served):
        assert time.monotonic() < deadline, audited(served)
        time.sleep(0.1)


def test_a_client_naming_other_directories_is_refused(served: SandboxBroker) -> None:
    other = served.root / "other-config"
    other.mkdir(mode=0o700)
    env = {**served.env(), "SANDBOXER_CONFIG": str(other), "SANDBOXER_SOCKET": str(served.state / "broker.sock")}
    done = subprocess.run(
        [sys.executable, "-m", "sandboxer", "list"], capture_output=True, text=True, env=env, timeout=60, check=False
    )
    assert done.returncode == 2
    assert done.stderr.startswith(f"sandboxer: this service answers for the config dir {served.config}, not {other}")


def test_a_socket_nobody_answers_on_is_an_error_not_a_fallback(sb_root: SandboxBroker) -> None:
    env = {**sb_root.env(), "SANDBOXER_SOCKET": str(sb_root.root / "nobody.sock")}
    env.pop("SANDBOXER_NO_SERVICE")
    done = subprocess.run(sb_root.argv("list"), capture_output=True, text=True, env=env, timeout=60, check=False)
    assert done.returncode == 125
    assert done.stderr.startswith(f"sandboxer: no service answers on {sb_root.root / 'nobody.sock'}")


def _cli_as(account: pwd.struct_passwd, socket_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI run by `account`, for the service at `socket_path`."""
    ids = [str(account.pw_uid), str(account.pw_gid)]
    argv = ["setpriv", "--reuid", ids[0], "--regid", ids[1], "--clear-groups", "--"]
    argv += [sys.executable, "-m", "sandboxer", *args]
    env = {"PATH": "/usr/bin:/bin", "HOME": "/", "LANG": "C.UTF-8", "PYTHONPATH": str(REPO)}
    env["SANDBOXER_SOCKET"] = str(socket_path)
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, check=False, cwd="/")


def test_callers_through_the_cli_get_their_grants_and_nothing_more(
    sb_root: SandboxBroker,
    callers: tuple[pwd.struct_passwd, pwd.struct_passwd],  # noqa: F811 - the fixture
) -> None:
    a, b = callers
    grants = sb_root.config / "grants.yaml"
    grants.write_text(
        f"grants:\n  - users: [{a.pw_name}]\n    profiles: [{sb_root.profile}]\n"
        "    max_sandboxes: 2\n    max_ttl_seconds: 3600\n"
    )
    assert sb_root.run("ext", "approve", "grants").status == 0
    socket_path = sb_root.state / "broker.sock"
    started = Service(sb_root, socket_path).start()
    try:
        created = _cli_as(a, socket_path, "create", "--profile", sb_root.profile)
        assert created.returncode == 0, created.stderr
        mine = created.stdout.strip()
        ran = _cli_as(a, socket_path, "exec", mine, "--", "sh", "-c", "echo hi; id -u")
        assert (ran.returncode, ran.stdout) == (0, "hi\n1000\n")
        assert _cli_as(a, socket_path, "list").stdout.split("\n")[1].split()[0] == mine
        owner_verbs: list[tuple[list[str], str]] = [(["gc"], "gc"), (["ext", "approve", "grants"], "ext approve")]
        for verb_args, what in owner_verbs:
            refused = _cli_as(a, socket_path, *verb_args)
            assert (refused.returncode, refused.stderr) == (3, f"sandboxer: {what} is for the broker's owners\n")
        digest = _cli_as(a, socket_path, "runtime", "digest", str(sb_root.runtime))
        assert digest.returncode == 3

        theirs = sb_root.create()  # the owner's, in-process
        unknown = "0123456789abcdef01234567"
        probes: list[tuple[str, ...]] = [("exec", "ID", "--", "true"), ("inspect", "ID"), ("teardown", "ID")]
        for args in probes:
            answers = [
                _cli_as(a, socket_path, *[sandbox if arg == "ID" else arg for arg in args])
                for sandbox in (theirs, unknown)
            ]
            seen = [
                (x.returncode, x.stdout, x.stderr.replace(s, "ID"))
                for x, s in zip(answers, (theirs, unknown), strict=True)
            ]
            assert seen[0] == seen[1], args
            assert seen[0][0] in (4, 125)
        assert sb_root.exec(theirs, "true").status == 0  # untouched

        refused_b = _cli_as(b, socket_path, "create", "--profile", sb_root.profile)
        assert (refused_b.returncode, refused_b.stderr.split(" (hint")[0]) == (
            3,
            f"sandboxer: uid {b.pw_uid} is not granted this broker",
        )
        assert _cli_as(a, socket_path, "teardown", mine).returncode == 0
    finally:
        started.stop()


@pytest.fixture
def sb_user(runtime_dir: Path) -> Iterator[SandboxBroker]:
    """A bwrap broker run as an unprivileged user."""
    broker = _bwrap_broker(runtime_dir, as_user=True)
    try:
        yield broker
    finally:
        _cleanup(broker)


def test_an_unprivileged_users_client_starts_its_private_service(sb_user: SandboxBroker) -> None:
    sb_user.through_service = True
    socket_path = sb_user.state / "broker.sock"
    assert not socket_path.exists()
    first = sb_user.run("list")
    assert (first.status, first.stdout) == (0, "no sandboxes\n"), first.stderr
    assert socket_path.exists()
    services = services_of(sb_user.state)
    assert len(services) == 1
    assert os.stat(f"/proc/{services[0]}").st_uid == UNPRIVILEGED_UID
    with open(f"/proc/{services[0]}/cmdline", "rb") as cmdline:
        argv = cmdline.read().split(b"\0")
    assert argv[argv.index(b"--idle-exit") + 1] == str(IDLE_EXIT).encode()  # it goes when unused
    sandbox_id = sb_user.create()
    assert sb_user.exec(sandbox_id, "echo", "private").stdout == "private\n"
    assert services_of(sb_user.state) == services  # the same one answered
    assert ("cli exec", 0) in audited(sb_user)


UNTRUSTED_SERVER = """
import os, socket, sys
path = sys.argv[1]
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(path)
os.chmod(path, 0o777)
server.listen(1)
print("ready", flush=True)
conn, _ = server.accept()
conn.settimeout(5)
try:
    data = conn.recv(65536)
except OSError:
    data = b""
print(len(data), flush=True)
"""


def test_the_client_sends_nothing_to_a_service_of_another_account(sb_root: SandboxBroker) -> None:
    """A socket answered by a process of neither root nor the caller's account gets no byte of
    the caller's environment or descriptors: the client refuses it (125)."""
    directory = sb_root.root / "other"
    directory.mkdir()
    os.chown(directory, UNPRIVILEGED_UID, UNPRIVILEGED_UID)
    path = directory / "other.sock"
    uid = str(UNPRIVILEGED_UID)
    as_other = ["setpriv", "--reuid", uid, "--regid", uid, "--clear-groups", "--", sys.executable]
    server = subprocess.Popen([*as_other, "-c", UNTRUSTED_SERVER, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        assert server.stdout.readline() == "ready\n"
        env = {**sb_root.env(), "SANDBOXER_SOCKET": str(path), "SECRET_TOKEN": "do-not-send"}
        env.pop("SANDBOXER_NO_SERVICE")
        done = subprocess.run(sb_root.argv("list"), capture_output=True, text=True, env=env, timeout=60, check=False)
        assert done.returncode == 125
        assert done.stderr == (
            f"sandboxer: the service on {path} runs as uid {UNPRIVILEGED_UID}, neither root nor this account; refused\n"
        )
        assert server.stdout.readline() == "0\n"  # it got the connection, and not one byte
    finally:
        server.kill()
        server.communicate()


def test_a_caller_whose_stderr_refuses_writes_is_still_audited(sb_root: SandboxBroker) -> None:
    """An account no grant admits, with its stderr on /dev/full: refused (3), audited, and the
    service's next answer is whole."""
    started = Service(sb_root, sb_root.state / "broker.sock").start()
    try:
        uid = str(UNPRIVILEGED_UID)
        argv = ["setpriv", "--reuid", uid, "--regid", uid, "--clear-groups", "--", "sh", "-c"]
        argv.append(f"{' '.join(sb_root.argv('list'))} 2>/dev/full")
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/", "PYTHONPATH": str(REPO)}
        env["SANDBOXER_SOCKET"] = str(sb_root.state / "broker.sock")
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, check=False)
        assert done.returncode == 3, done
        assert ("refused", 3) in audited(sb_root)
        sb_root.through_service = True
        listed = sb_root.run("list", "--json")
        assert (listed.status, json.loads(listed.stdout)) == (0, {"sandboxes": []})
    finally:
        sb_root.through_service = False
        started.stop()


RAW_CLI_CLIENT = """
import json, os, socket, sys
path, out = sys.argv[1], sys.argv[2]
conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
conn.connect(path)
target = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
header = json.dumps({"argv": ["list"], "cwd": "/", "env": {}}).encode()
socket.send_fds(conn, [b"\\0" + header + b"\\n"], [0, target, target])
print(conn.recv(4096).decode().strip())
"""


def test_another_accounts_client_may_pass_pipes_only(
    sb_root: SandboxBroker,
    callers: tuple[pwd.struct_passwd, pwd.struct_passwd],  # noqa: F811 - the fixture
) -> None:
    """A root service writes a client's output with its own rights: for another account it takes
    pipes only (the sandboxer command puts files and terminals behind pipes itself)."""
    a, _ = callers
    grants = f"grants:\n  - users: [{a.pw_name}]\n    profiles: [{sb_root.profile}]\n"
    (sb_root.config / "grants.yaml").write_text(grants + "    max_sandboxes: 1\n    max_ttl_seconds: 3600\n")
    sb_root.approve("grants")
    socket_path = sb_root.state / "broker.sock"
    started = Service(sb_root, socket_path).start()
    try:
        out = sb_root.root / "a-out"
        out.mkdir()
        os.chown(out, a.pw_uid, a.pw_gid)
        ids = [str(a.pw_uid), str(a.pw_gid)]
        argv = ["setpriv", "--reuid", ids[0], "--regid", ids[1], "--clear-groups", "--", sys.executable, "-c"]
        argv += [RAW_CLI_CLIENT, str(socket_path), str(out / "file")]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False, stdin=subprocess.DEVNULL)
        assert json.loads(done.stdout) == {"status": 3}, done
        assert (out / "file").read_bytes() == b""  # nothing was written into the file
        assert ("refused", 3) in audited(sb_root)
        through_cli = _cli_as(a, socket_path, "list", "--json")  # the command's own pipes: served
        assert (through_cli.returncode, json.loads(through_cli.stdout)) == (0, {"sandboxes": []}), through_cli
    finally:
        started.stop()


def test_cli_audit_lines_name_the_sandbox_and_hold_no_argument_or_environment_value(served: SandboxBroker) -> None:
    canary = "CANARY" + os.urandom(6).hex()
    sandbox_id = served.create()
    env = {**served.env(), "SOME_TOKEN": canary}
    for args in (
        ("exec", sandbox_id, "--", "echo", canary),
        ("exec", canary, "--", "true"),
        ("inspect", canary),
        ("create", "--profile", canary),
    ):
        subprocess.run(served.argv(*args), capture_output=True, env=env, timeout=120, check=False)
    text = (served.state / "audit.log").read_text()
    assert canary not in text
    lines = [json.loads(line) for line in text.splitlines()]
    assert (sandbox_id, 0) in [(line["sandbox"], line["status"]) for line in lines if line["verb"] == "cli exec"]
    assert (sandbox_id, 0) in [(line["sandbox"], line["status"]) for line in lines if line["verb"] == "cli create"]


HOLDING_CLIENTS = """
import socket, sys, time
path, count = sys.argv[1], int(sys.argv[2])
held = []
for _ in range(count):
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    socket.send_fds(conn, [b"\\0{"], [0, 1, 2])  # a CLI request that never goes on
    held.append(conn)
time.sleep(1.5)
closed = 0
for conn in held:
    conn.setblocking(False)
    try:
        closed += conn.recv(1) == b""
    except ConnectionResetError:
        closed += 1
    except BlockingIOError:
        pass
print(closed)
"""


def test_one_account_cannot_take_every_worker(served: SandboxBroker) -> None:
    """40 stalled CLI requests of one (ungranted) account: 32 are held (each for at most the 10 s a
    request may take), the rest closed at once; the owner is served meanwhile."""
    uid = str(UNPRIVILEGED_UID)
    argv = ["setpriv", "--reuid", uid, "--regid", uid, "--clear-groups", "--", sys.executable, "-c", HOLDING_CLIENTS]
    holder = subprocess.Popen([*argv, str(served.state / "broker.sock"), "40"], stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(0.5)
        listed = served.run("list", "--json")  # the owner is served while they wait
        assert listed.status == 0, listed
        out, _ = holder.communicate(timeout=60)
        assert out.strip() == "8"
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.communicate()


SHARED_LIMIT = """
import http.client, json, socket, sys, time
path = sys.argv[1]

def version():
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    conn.sendall(b"GET /v1/version HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
    response = http.client.HTTPResponse(conn)
    response.begin()
    status = [response.status, json.loads(response.read())]
    conn.close()
    return status

held = []
for _ in range(32):
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    socket.send_fds(conn, [b"\\0{"], [0, 1, 2])  # a CLI request that never goes on
    held.append(conn)
busy = version()
for conn in held:
    conn.close()
for _ in range(100):  # the service sees them end
    later = version()
    if later[0] != 429:
        break
    time.sleep(0.05)
print(json.dumps([busy, later]))
"""


def test_one_accounts_share_counts_its_cli_commands_and_http_requests_together(served: SandboxBroker) -> None:
    """32 stalled CLI requests of one account: its HTTP request is refused at once (429, with an
    audit line); once they end, it is answered again (here: refused as not granted, 403)."""
    uid = str(UNPRIVILEGED_UID)
    argv = ["setpriv", "--reuid", uid, "--regid", uid, "--clear-groups", "--", sys.executable, "-c", SHARED_LIMIT]
    done = subprocess.run(
        [*argv, str(served.state / "broker.sock")], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    busy, later = json.loads(done.stdout)
    assert busy[0] == 429
    assert busy[1]["error"]["message"] == f"uid {uid} has 32 requests under way (the service's limit per caller)"
    assert later[0] == 403
    assert ("version", 3) in audited(served)  # the refusal of a request past the share is audited too
