"""What a bwrap sandbox isolates, checked from inside and from the host, for both broker users.

Every test drives the real CLI against real bubblewrap and real Git: the contract's "Inside every
sandbox" table (user, capabilities, read-only runtime, private state, loopback-only network,
invisible host paths, an environment built from nothing), the exec exit statuses, stdio
pass-through, timeouts, concurrency, sandbox-to-sandbox isolation and complete teardown.
"""

from __future__ import annotations

import contextlib
import glob
import grp
import json
import os
import pwd
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import docker
import psutil
import pytest

from tests.integration.conftest import SandboxBroker, backend_profile_text
from tests.samples import CONTRACT_ENV_NAMES

PYTHON = "/opt/sandboxer/runtime/bin/python3"
STATE = "/run/sandboxer/state"
STATE_ENV = {
    "HOME": f"{STATE}/home",
    "XDG_CONFIG_HOME": f"{STATE}/config",
    "XDG_CACHE_HOME": f"{STATE}/cache",
    "XDG_STATE_HOME": f"{STATE}/data",
    "TMPDIR": f"{STATE}/tmp",
}
GENERATED_ETC = {"passwd", "group", "hosts", "hostname", "nsswitch.conf", "resolv.conf"}
HOST_ETC = ("/etc/ssl/certs", "/etc/ca-certificates", "/etc/ld.so.cache", "/etc/localtime", "/etc/alternatives")
PORT = 47123  # every sandbox has its own network namespace: a fixed port never clashes

# A loopback server: answers every connection with a greeting; gives up after two idle minutes.
SERVER = """\
import socket, sys
port, greeting = int(sys.argv[1]), sys.argv[2].encode()
with socket.socket() as server:
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen(8)
    server.settimeout(120)
    while True:
        try:
            conn, _ = server.accept()
        except TimeoutError:
            break
        with conn:
            conn.sendall(greeting + b"\\n")
"""

# A client: connects to 127.0.0.1:PORT, retrying refusals until the deadline; prints what it read
# or "refused" (exit 3).
CLIENT = """\
import socket, sys, time
port, deadline = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
while True:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as conn:
            data = b""
            while chunk := conn.recv(4096):
                data += chunk
        print(data.decode().strip())
        break
    except ConnectionRefusedError:
        if time.monotonic() >= deadline:
            print("refused")
            sys.exit(3)
        time.sleep(0.05)
"""

START_SERVER = (
    f'cat > "$TMPDIR/server.py"; nohup {PYTHON} "$TMPDIR/server.py" "$1" "$2" </dev/null >/dev/null 2>&1 & echo started'
)


def run_raw(
    sb: SandboxBroker,
    *args: str,
    stdin: bytes | None = None,
    extra_env: dict[str, str] | None = None,
    timeout: float = 60,
) -> subprocess.CompletedProcess[bytes]:
    """Run the CLI keeping stdout and stderr as bytes (and optionally extra caller environment)."""
    return subprocess.run(
        sb.argv(*args),
        input=stdin,
        capture_output=True,
        env={**sb.env(), **(extra_env or {})},
        check=False,
        timeout=timeout,
    )


def start_server(sb: SandboxBroker, sandbox_id: str, greeting: str) -> None:
    """Start the loopback server in the background; the exec must return at once."""
    started = time.monotonic()
    proc = run_raw(
        sb,
        "exec",
        sandbox_id,
        "--",
        "/bin/sh",
        "-c",
        START_SERVER,
        "sh",
        str(PORT),
        greeting,
        stdin=SERVER.encode(),
        timeout=20,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == b"started\n"
    assert time.monotonic() - started < 15, "a detached background process held the exec open"  # it runs on


def connect(sb: SandboxBroker, sandbox_id: str, port: int, wait: float) -> tuple[int, str]:
    """Connect from inside the sandbox to 127.0.0.1:port; (status, greeting or 'refused')."""
    result = sb.exec(sandbox_id, PYTHON, "-c", CLIENT, str(port), str(wait))
    return result.status, result.stdout.strip()


def live_processes(predicate: Callable[[list[str]], bool]) -> list[psutil.Process]:
    """Non-zombie host processes whose cmdline satisfies `predicate` (a callable on the argv list)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = proc.info["cmdline"] or []
        if proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if predicate(cmdline):
            found.append(proc)
    return found


def env_inside(output: str) -> dict[str, str]:
    """Parse `env` output."""
    return dict(line.split("=", 1) for line in output.splitlines())


@contextlib.contextmanager
def host_loopback_server() -> Iterator[tuple[int, list[str]]]:
    """A TCP server on the host's 127.0.0.1 (port 0) in a thread; yields (port, accepted peers)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.05)
    accepted: list[str] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, peer = server.accept()
            except TimeoutError:
                continue
            with conn:
                accepted.append(f"{peer[0]}:{peer[1]}")
                conn.sendall(b"host-service\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1], accepted
    finally:
        stop.set()
        thread.join(timeout=5)
        server.close()


# 1 ─ user, capabilities, no_new_privs, new session without the caller's terminal


def test_exec_runs_as_uid_1000_without_capabilities_in_a_new_session_without_the_callers_terminal(
    sb: SandboxBroker,
) -> None:
    sandbox_id = sb.create()
    script = (
        "id -u; id -g; "
        "grep -E '^(CapEff|CapPrm|CapBnd|CapAmb|NoNewPrivs):' /proc/self/status; "
        'echo "pid $$"; echo "stat $(cat /proc/$$/stat)"; '
        "test -t 0 && echo stdin-is-a-tty; "
        "sh -c 'exec 3</dev/tty' 2>/dev/null; echo \"devtty $?\"; "
        f"{PYTHON} -c '"
        "import fcntl, termios, errno\n"
        "try:\n"
        '    fcntl.ioctl(0, termios.TIOCSTI, b"#")\n'
        '    print("tiocsti ok")\n'
        "except OSError as exc:\n"
        '    print("tiocsti", errno.errorcode[exc.errno])\n'
        "'"
    )
    # The caller has a controlling terminal (a pty we own); the sandboxed command must not.
    master, slave = os.openpty()
    try:
        control = subprocess.run(
            ["setsid", "--ctty", "/bin/sh", "-c", "exec 3</dev/tty && echo host-tty-ok"],
            stdin=slave,
            capture_output=True,
            check=False,
            timeout=30,
        )
        proc = subprocess.run(
            ["setsid", "--ctty", *sb.argv("exec", sandbox_id, "--", "/bin/sh", "-c", script)],
            stdin=slave,
            capture_output=True,
            env=sb.env(),
            check=False,
            timeout=60,
        )
    finally:
        os.close(slave)
        os.close(master)
    assert control.stdout == b"host-tty-ok\n", "control: the caller's pty is its controlling terminal"
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.decode().splitlines()
    assert lines[:2] == ["1000", "1000"]
    fields = dict(line.split(":", 1) for line in lines[2:7])
    assert {k: v.strip() for k, v in fields.items()} == {
        "CapEff": "0000000000000000",
        "CapPrm": "0000000000000000",
        "CapBnd": "0000000000000000",
        "CapAmb": "0000000000000000",
        "NoNewPrivs": "1",
    }
    pid = int(lines[7].removeprefix("pid "))
    stat = lines[8].removeprefix("stat ")
    after_comm = stat[stat.rindex(")") + 2 :].split()
    session = int(after_comm[3])  # state ppid pgrp session …
    assert session == pid, f"the shell (pid {pid}) is not a session leader (session {session})"
    # The caller's terminal reaches the command only through a pipe the broker copies.
    assert "stdin-is-a-tty" not in lines, "the caller's pty itself reached the command as fd 0"
    assert "devtty 0" not in lines
    assert any(line.startswith("devtty ") for line in lines)
    tiocsti = next(line for line in lines if line.startswith("tiocsti"))
    assert tiocsti in ("tiocsti EPERM", "tiocsti ENOTTY"), "TIOCSTI must not inject into the caller's terminal"


# 2 ─ read-only runtime and system


def test_runtime_root_and_usr_are_read_only(sbx: SandboxBroker) -> None:
    sandbox_id = sbx.create()
    runtime = sbx.sh(sandbox_id, "touch /opt/sandboxer/runtime/x")
    assert runtime.status != 0
    assert "Read-only file system" in runtime.stderr
    runtime_bin = sbx.sh(sandbox_id, "echo hi > /opt/sandboxer/runtime/bin/python3")
    assert runtime_bin.status != 0
    assert "Read-only file system" in runtime_bin.stderr
    for target in ("/x", "/usr/x", "/usr/bin/x"):
        result = sbx.sh(sandbox_id, f"touch {target}")
        assert result.status != 0, target
        assert "Read-only file system" in result.stderr, result.stderr
    assert not (Path(sbx.runtime) / "x").exists()
    after = sbx.sh(sandbox_id, "test -e /opt/sandboxer/runtime/x || test -e /x || test -e /usr/x")
    assert after.status == 1


# 3 ─ private state directories


def test_state_directories_are_the_contract_paths_mode_0700_owned_by_the_sandbox_user_outside_workspace(
    sb: SandboxBroker,
) -> None:
    sandbox_id = sb.create()
    names = list(STATE_ENV)
    script = "; ".join(f'echo "{n}=${n} $(stat -c "%a %u" "${n}") $(cd "${n}" && pwd -P)"' for n in names)
    result = sb.sh(sandbox_id, script)
    assert result.status == 0, result.stderr
    seen = {}
    for line in result.stdout.splitlines():
        name, rest = line.split("=", 1)
        path, mode, uid, real = rest.split()
        seen[name] = (path, mode, uid, real)
    assert seen == {name: (path, "700", "1000", path) for name, path in STATE_ENV.items()}
    for path, *_ in seen.values():
        assert path != "/workspace"
        assert not path.startswith("/workspace/")


# 4 ─ state persists between execs and stays out of the workspace


def test_home_file_persists_between_execs_and_stays_out_of_the_clone_and_git_status(sbx: SandboxBroker) -> None:
    sandbox_id = sbx.create()
    written = sbx.sh(sandbox_id, 'printf persisted-7c1 > "$HOME/note.txt"')
    assert written.status == 0, written.stderr
    read = sbx.sh(sandbox_id, 'cat "$HOME/note.txt"; echo; git -C /workspace status --porcelain; echo "git $?"')
    assert read.status == 0, read.stderr
    assert read.stdout == "persisted-7c1\ngit 0\n", read.stdout + read.stderr
    clone = sbx.workspace_dir(sandbox_id)
    assert (clone / "README.md").exists(), "the host clone is where we think it is"
    assert not list(clone.rglob("note.txt"))
    assert all(
        b"persisted-7c1" not in p.read_bytes() for p in clone.rglob("*") if p.is_file() and ".git" not in p.parts
    )


# 5 ─ a loopback server outlives its exec


def test_loopback_server_started_in_one_exec_answers_the_next(sbx: SandboxBroker) -> None:
    sandbox_id = sbx.create()
    start_server(sbx, sandbox_id, "hello-from-exec-1")
    status, reply = connect(sbx, sandbox_id, PORT, wait=3)
    assert (status, reply) == (0, "hello-from-exec-1")
    again = connect(sbx, sandbox_id, PORT, wait=3)
    assert again == (0, "hello-from-exec-1")


# 6 ─ loopback-only network, and inspect's evidence


def test_only_loopback_exists_and_inspect_reports_a_sandbox_matching_its_plan(sbx: SandboxBroker) -> None:
    sandbox_id = sbx.create()
    result = sbx.sh(
        sandbox_id,
        "cat /proc/net/dev; echo ---; cat /proc/net/route; echo ---; cat /proc/net/ipv6_route 2>/dev/null; true",
    )
    assert result.status == 0, result.stderr
    dev, route, ipv6 = result.stdout.split("---\n")
    interfaces = [line.split(":", 1)[0].strip() for line in dev.splitlines()[2:]]
    assert interfaces == ["lo"]
    route_lines = route.splitlines()
    assert len(route_lines) == 1
    assert route_lines[0].split()[:3] == ["Iface", "Destination", "Gateway"]
    for line in ipv6.splitlines():
        assert line.split()[-1] == "lo", line

    inspected = sbx.run("inspect", sandbox_id, "--json")
    assert inspected.status == 0, inspected.stderr
    evidence = inspected.json()
    assert evidence["id"] == sandbox_id
    assert evidence["status"] == "running"
    assert evidence["network"]["interfaces"] == ["lo"]
    assert all(route["dev"] == "lo" for route in evidence["network"]["routes"]), evidence["network"]["routes"]
    assert evidence["matches_plan"] is True
    assert evidence["differences"] == []
    assert evidence["user"]["uid"] == 1000
    assert evidence["user"]["gid"] == 1000
    assert evidence["capabilities"]["effective"] == "0000000000000000"
    assert evidence["capabilities"]["no_new_privs"] is True
    assert evidence["runtime"]["read_only"] is True
    assert evidence["runtime"]["target"] == "/opt/sandboxer/runtime"
    assert evidence["runtime"]["sha256"] == evidence["runtime"]["pinned_sha256"]
    mechanisms = {"cgroup-v1", "cgroup-v2"} if not sbx.as_user else {"cgroup-v1", "cgroup-v2", "rlimit"}
    if sbx.backend == "docker":
        mechanisms = {"docker"}  # the Engine's pids and memory limits
    assert evidence["limits"]["mechanism"] in mechanisms
    assert evidence["env_names"] == sorted(evidence["env_names"])
    assert evidence["env_names"] == CONTRACT_ENV_NAMES


# 7 ─ the host's loopback is another network


def test_host_loopback_service_is_unreachable_from_inside(sbx: SandboxBroker) -> None:
    sandbox_id = sbx.create()
    with host_loopback_server() as (port, accepted):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            assert conn.recv(100) == b"host-service\n", "control: the host service answers on the host"
        status, reply = connect(sbx, sandbox_id, port, wait=0)
        time.sleep(0.1)
        assert len(accepted) == 1, f"only the host's own control connection was accepted: {accepted}"
    assert (status, reply) == (3, "refused")


# 8 ─ host paths are invisible; /etc is generated


def test_host_paths_are_invisible_and_etc_holds_only_generated_files_and_host_binds(sbx: SandboxBroker) -> None:
    sandbox_id = sbx.create()
    hidden = [
        "/root",
        "/home",
        str(sbx.config),
        str(sbx.state),
        str(sbx.repo),
        str(sbx.runtime),
        str(sbx.root),
        "/etc/shadow",
        "/etc/sandboxer",
        "/var/run/docker.sock",
        "/run/docker.sock",
    ]
    for path in (sbx.config, sbx.state, sbx.repo, sbx.runtime, sbx.root, "/root", "/etc/shadow"):
        assert os.path.exists(path), f"control: {path} exists on the host"
    script = (
        'for p in "$@"; do if test -e "$p" || test -L "$p"; then echo "visible $p"; fi; done; '
        "echo ---; ls -A /etc; echo ---; cat /etc/passwd"
    )
    result = sbx.exec(sandbox_id, "/bin/sh", "-c", script, "sh", *hidden)
    assert result.status == 0, result.stderr
    visible, etc, passwd = result.stdout.split("---\n")
    assert visible == ""
    expected_etc = GENERATED_ETC | {path.split("/")[2] for path in HOST_ETC if os.path.exists(path)}
    if sbx.backend == "docker":
        expected_etc |= {"mtab"}  # Docker's own link to /proc/self/mounts
    assert set(etc.split()) == expected_etc
    assert passwd.splitlines() == [
        "root:x:0:0:root:/nonexistent:/usr/sbin/nologin",
        "sandbox:x:1000:1000:sandbox:/run/sandboxer/state/home:/bin/sh",
    ]


# 9 ─ the environment is built from nothing


def test_callers_environment_never_reaches_inside_and_env_is_exactly_the_contracts(sbx: SandboxBroker) -> None:
    sandbox_id = sbx.create()
    canary = {"SANDBOXER_CANARY": "canary-7f3e"}
    plain = run_raw(sbx, "exec", sandbox_id, "--", "env", extra_env=canary)
    assert plain.returncode == 0, plain.stderr
    text = plain.stdout.decode()
    assert "SANDBOXER_CANARY" not in text
    assert "canary-7f3e" not in text
    assert str(sbx.root) not in text, "the caller's HOME leaked"
    env = env_inside(text)
    assert sorted(env) == CONTRACT_ENV_NAMES
    assert {name: env[name] for name in STATE_ENV} == STATE_ENV
    assert env["PATH"].split(":")[0] == "/opt/sandboxer/runtime/bin"
    assert env["PYTHONNOUSERSITE"] == "1"
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"
    assert env["SANDBOXER_SANDBOX_ID"] == sandbox_id
    assert env["SANDBOXER_PROFILE"] == sbx.profile
    assert env["SANDBOXER_NETWORK"] == "loopback"

    consumer = run_raw(sbx, "exec", sandbox_id, "--consumer", "agent-1", "--", "env", extra_env=canary)
    assert consumer.returncode == 0, consumer.stderr
    with_consumer = env_inside(consumer.stdout.decode())
    assert sorted(with_consumer) == sorted([*CONTRACT_ENV_NAMES, "SANDBOXER_CONSUMER"])
    assert with_consumer["SANDBOXER_CONSUMER"] == "agent-1"
    assert "canary-7f3e" not in consumer.stdout.decode()


# 10 ─ exit statuses


def test_debian_alternatives_resolve_inside(sbx: SandboxBroker) -> None:
    """The host's /etc/alternatives, read-only: the programs behind its links run."""
    sandbox_id = sbx.create()
    script = 'awk "BEGIN { print 6 * 7 }"; which sh; for p in cc vi editor pager; do command -v "$p"; done'
    ran = sbx.sh(sandbox_id, script)
    assert ran.status == 0, ran.stderr
    assert ran.stdout.splitlines() == [
        "42",
        "/usr/bin/sh",
        "/usr/bin/cc",
        "/usr/bin/vi",
        "/usr/bin/editor",
        "/usr/bin/pager",
    ]
    compiler = sbx.exec(sandbox_id, "cc", "--version")
    assert compiler.status == 0, compiler.stderr
    assert sbx.sh(sandbox_id, "readlink /etc/alternatives/awk && ! touch /etc/alternatives/x 2>/dev/null").status == 0


def test_exec_exit_statuses_follow_the_contract(sbx: SandboxBroker) -> None:
    sandbox_id = sbx.create()
    assert sbx.sh(sandbox_id, "exit 7").status == 7
    assert sbx.sh(sandbox_id, "kill -9 $$").status == 137
    assert sbx.sh(sandbox_id, "kill -TERM $$").status == 143

    # The same line and status on both backends (on Docker a one-line shell looks the program up
    # before env -i runs it).
    missing = sbx.exec(sandbox_id, "no-such-program-5b2")
    assert missing.status == 127
    assert missing.stderr == "sandboxer: exec: no-such-program-5b2: not found\n"
    assert missing.stdout == ""
    assert sbx.exec(sandbox_id, "./true", options=("--cwd", "/usr/bin")).status == 0  # relative to --cwd

    # A program whose path is there but leads nowhere is said to be a dangling link (still 127).
    assert sbx.sh(sandbox_id, "ln -s /no/such/tool /workspace/tool").status == 0
    dangling = sbx.exec(sandbox_id, "/workspace/tool")
    assert (dangling.status, dangling.stderr) == (
        127,
        "sandboxer: exec: /workspace/tool: /workspace/tool is a dangling link (to /no/such/tool)\n",
    )

    for path in ("/etc/passwd", "/etc"):
        not_executable = sbx.exec(sandbox_id, path)
        assert not_executable.status == 126, not_executable.stderr
        assert not_executable.stderr == f"sandboxer: exec: {path}: not executable (Permission denied)\n"

    for bad_id in ("0123456789abcdef01234567", "not-a-sandbox-id", "0123456789ABCDEF01234567"):
        unknown = sbx.exec(bad_id, "true")
        assert unknown.status == 125, (bad_id, unknown.stderr)
        assert unknown.stderr.startswith("sandboxer: ")
        assert len(unknown.stderr.splitlines()) == 1

    # The broker's own failure (125) is its one line on both backends.
    no_cwd = sbx.exec(sandbox_id, "pwd", options=("--cwd", "/nonexistent"))
    assert no_cwd.status == 125, no_cwd.stderr
    assert no_cwd.stderr == (
        "sandboxer: exec: --cwd /nonexistent: not a directory inside the sandbox (No such file or directory)\n"
    )
    assert no_cwd.stdout == ""
    not_a_dir = sbx.exec(sandbox_id, "pwd", options=("--cwd", "/etc/passwd"))
    assert not_a_dir.status == 125, not_a_dir.stderr
    assert not_a_dir.stderr == (
        "sandboxer: exec: --cwd /etc/passwd: not a directory inside the sandbox (Not a directory)\n"
    )

    cwd = sbx.exec(sandbox_id, "pwd", options=("--cwd", "/run/sandboxer/state/tmp"))
    assert cwd.status == 0, cwd.stderr
    assert cwd.stdout == "/run/sandboxer/state/tmp\n"


# 11 ─ stdio is a clean byte pipe


def test_binary_stdin_round_trips_and_large_output_arrives_complete(sbx: SandboxBroker) -> None:
    sandbox_id = sbx.create()
    payload = os.urandom(1 << 20)
    echoed = run_raw(sbx, "exec", sandbox_id, "--", "cat", stdin=payload)
    assert echoed.returncode == 0, echoed.stderr
    assert len(echoed.stdout) == len(payload)
    assert echoed.stdout == payload
    big = run_raw(sbx, "exec", sandbox_id, "--", "head", "-c", "8388608", "/dev/zero")
    assert big.returncode == 0, big.stderr
    assert len(big.stdout) == 8388608
    assert big.stdout.count(0) == 8388608


# 12 ─ --timeout kills the whole tree


def test_timeout_exits_124_kills_the_whole_process_tree_and_leaves_the_sandbox_usable(sbx: SandboxBroker) -> None:
    sandbox_id = sbx.create()
    seconds = "59.913"  # a duration no other process on the host sleeps for

    def sleepers() -> list[psutil.Process]:
        return live_processes(lambda argv: argv == ["sleep", seconds])

    assert sleepers() == []
    started = time.monotonic()
    result = sbx.exec(sandbox_id, "/bin/sh", "-c", f"sleep {seconds} & sleep {seconds}", options=("--timeout", "1"))
    elapsed = time.monotonic() - started
    assert (result.status, result.stderr) == (124, "sandboxer: exec: timed out after 1 s\n")
    assert 0.9 <= elapsed < 15, elapsed  # the command would sleep for a minute
    own = sbx.exec(sandbox_id, "/bin/sh", "-c", "exit 124", options=("--timeout", "30"))
    assert (own.status, own.stderr) == (124, "")  # the command's own 124 is not a timeout
    survivors = sleepers()
    assert survivors == [], [(p.pid, p.info) for p in survivors]
    after = sbx.sh(sandbox_id, "echo still-usable")
    assert (after.status, after.stdout) == (0, "still-usable\n")


# 13 ─ sandboxes are isolated from each other

LIST_PROCS = 'for d in /proc/[0-9]*; do printf "%s " "${d#/proc/}"; tr "\\0" " " < "$d/cmdline"; echo; done'


def test_two_sandboxes_cannot_see_each_others_files_processes_or_loopback(sbx: SandboxBroker) -> None:
    first = sbx.create()
    second = sbx.create()
    setup = sbx.sh(
        first,
        'echo a > "$HOME/a-marker" && echo a > /workspace/a-marker && '
        "nohup sleep 30 </dev/null >/dev/null 2>&1 & echo ok",
    )
    assert (setup.status, setup.stdout) == (0, "ok\n"), setup.stderr
    start_server(sbx, first, "only-for-a")
    assert connect(sbx, first, PORT, wait=3) == (0, "only-for-a"), "control: A's server answers inside A"
    in_a = sbx.sh(first, LIST_PROCS)
    assert "sleep 30" in in_a.stdout, "control: A's /proc shows A's background sleep"

    files = sbx.sh(second, 'test -e "$HOME/a-marker"; echo "home $?"; test -e /workspace/a-marker; echo "ws $?"')
    assert files.stdout == "home 1\nws 1\n", files.stderr
    assert not (sbx.workspace_dir(second) / "a-marker").exists()
    assert (sbx.workspace_dir(first) / "a-marker").exists()

    in_b = sbx.sh(second, LIST_PROCS)
    assert in_b.status == 0, in_b.stderr
    assert "sleep 30" not in in_b.stdout
    assert "server.py" not in in_b.stdout
    commands = [line.split(" ", 1)[1].strip() for line in in_b.stdout.splitlines()]
    # the sandbox's init and holder, and this exec's shell and its helpers: nothing of A's.
    assert len(commands) <= 6, commands
    holder = "/run/sandboxer/holder infinity" if sbx.backend == "bwrap" else "sleep 3600"
    assert any(holder in c for c in commands)

    assert connect(sbx, second, PORT, wait=0) == (3, "refused")


# 14 ─ concurrent execs


def test_concurrent_execs_in_one_sandbox_all_succeed(sbx: SandboxBroker) -> None:
    sandbox_id = sbx.create()

    def one(i: int) -> tuple[int, str, str]:
        result = sbx.sh(sandbox_id, f'echo "writer-{i}" > "$HOME/c{i}" && cat "$HOME/c{i}"')
        return result.status, result.stdout, result.stderr

    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(one, range(6)))
    assert results == [(0, f"writer-{i}\n", "") for i in range(6)]
    listing = sbx.sh(sandbox_id, 'ls "$HOME"')
    assert listing.status == 0, listing.stderr
    assert listing.stdout.split() == [f"c{i}" for i in range(6)]


# 15 ─ workspace ownership on the host (root broker)


def test_files_the_sandbox_creates_belong_to_its_own_unprivileged_host_uid(sb_root: SandboxBroker) -> None:

    sandbox_id = sb_root.create()
    other = sb_root.create()
    result = sb_root.sh(sandbox_id, "echo made-inside > /workspace/newfile && mkdir /workspace/newdir")
    assert result.status == 0, result.stderr
    record = json.loads((sb_root.sandbox_dir(sandbox_id) / "record.json").read_text())
    host_uid, host_gid = record["host_uid"], record["host_gid"]
    assert host_uid not in (0, 1000)
    with pytest.raises(KeyError):
        pwd.getpwuid(host_uid)  # no account on the host has it
    with pytest.raises(KeyError):
        grp.getgrgid(host_gid)
    other_record = json.loads((sb_root.sandbox_dir(other) / "record.json").read_text())
    assert other_record["host_uid"] != host_uid  # sandboxes do not share a host uid
    clone = sb_root.sandbox_dir(sandbox_id) / "workspace"
    for path in (clone / "newfile", clone / "newdir", clone, clone / "README.md"):
        st = os.stat(path)
        assert (st.st_uid, st.st_gid) == (host_uid, host_gid), path
    assert (clone / "newfile").read_text() == "made-inside\n"
    assert sb_root.sh(sandbox_id, "id -u").stdout == "1000\n"  # inside it is still uid 1000


# 16 ─ teardown leaves nothing


def test_teardown_removes_processes_directory_mounts_and_cgroups_and_a_second_teardown_exits_4(
    sb: SandboxBroker,
) -> None:
    sandbox_id = sb.create()
    background = sb.sh(sandbox_id, "nohup sleep 44.917 </dev/null >/dev/null 2>&1 & echo ok")
    assert background.stdout == "ok\n", background.stderr
    record = json.loads((sb.sandbox_dir(sandbox_id) / "record.json").read_text())
    recorded = [record[f"{key}_pid"] for key in ("bwrap", "init", "holder")]

    def with_id() -> list[psutil.Process]:
        return live_processes(lambda argv: any(sandbox_id in arg for arg in argv))

    def cgroups() -> list[str]:
        return glob.glob(f"/sys/fs/cgroup/*/sandboxer/{sandbox_id}") + glob.glob(
            f"/sys/fs/cgroup/sandboxer/{sandbox_id}"
        )

    assert with_id(), "control: bwrap carries the sandbox id in its argv"
    if record["limits"]["mechanism"].startswith("cgroup"):
        assert cgroups(), "control: the sandbox's cgroups exist before teardown"

    receipt = sb.run("teardown", sandbox_id, "--json")
    assert receipt.status == 0, receipt.stderr
    assert receipt.json()["residue"] == []
    assert receipt.json()["id"] == sandbox_id

    assert with_id() == []
    for pid in recorded:
        with contextlib.suppress(psutil.NoSuchProcess):
            assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
    assert live_processes(lambda argv: argv == ["sleep", "44.917"]) == []
    assert not sb.sandbox_dir(sandbox_id).exists()
    mountinfo = Path("/proc/self/mountinfo").read_text()
    assert sandbox_id not in mountinfo
    assert cgroups() == []

    again = sb.run("teardown", sandbox_id, "--json")
    assert again.status == 4, (again.status, again.stdout, again.stderr)


def test_exec_env_sets_only_the_names_the_profile_lets_a_caller_set(sbx: SandboxBroker) -> None:
    """exec --env NAME=VALUE for exec.caller_env's names; everything else is refused (125, one
    line), and the sandbox's own environment is never the caller's to change."""
    text = backend_profile_text(sbx, "with-env", sbx.repo, "exec:\n  caller_env: [TASK_ID, HINT]\n")
    sbx.write_profile("with-env", text)
    assert sbx.run("ext", "approve", "with-env").status == 0
    sandbox_id = sbx.create("with-env")
    ran = sbx.exec(
        sandbox_id, "sh", "-c", 'echo "$TASK_ID/$HINT"', options=("--env", "TASK_ID=t-42", "--env", "HINT=a b=c")
    )
    assert (ran.status, ran.stdout) == (0, "t-42/a b=c\n"), ran.stderr
    if sbx.backend == "docker":  # a caller's values travel in the exec's environment, never its command line
        running = subprocess.Popen(
            sbx.argv("exec", sandbox_id, "--env", "TASK_ID=canary-5b1d", "--", "sleep", "30"), env=sbx.env()
        )
        record = json.loads((sbx.sandbox_dir(sandbox_id) / "record.json").read_text())
        engine = docker.from_env()
        try:
            shown: list[str] = []
            deadline = time.monotonic() + 20
            while not shown and time.monotonic() < deadline:
                time.sleep(0.2)
                execs = engine.api.inspect_container(record["container_id"])["ExecIDs"] or []
                shown = [" ".join(engine.api.exec_inspect(e)["ProcessConfig"]["arguments"]) for e in execs]
        finally:
            engine.close()
            running.kill()
            running.wait()
        assert shown
        assert not [line for line in shown if "canary-5b1d" in line], shown
    refusals = {
        "NOT_LISTED=1": (
            "sandboxer: exec: --env NOT_LISTED: not a name this sandbox's profile lets a caller set (exec.caller_env)\n"
        ),
        "novalue": "sandboxer: exec: --env must be NAME=VALUE\n",
    }
    for pair, line in refusals.items():
        refused = sbx.exec(sandbox_id, "true", options=("--env", pair))
        assert (refused.status, refused.stderr) == (125, line)
    plain = sbx.create()  # a profile without exec.caller_env: no name at all
    refused = sbx.exec(plain, "true", options=("--env", "TASK_ID=1"))
    assert refused.status == 125
    assert "exec.caller_env" in refused.stderr
