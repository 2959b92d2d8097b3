"""Everything of a bwrap sandbox inside its limits and out of its code's reach: bwrap, its init
and the holder in the sandbox's cgroups, the holder non-dumpable and filtered, no host file
open, bounded /dev/shm and workspace, provider launches unreadable by other execs, and the
evidence `inspect` gives of all of it."""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import time
from pathlib import Path

import pytest

from sandboxer.backends.bwrap import live as bwrap_live
from sandboxer.backends.bwrap.live import Live, confinement_problems
from sandboxer.core import seccomp
from sandboxer.host.limits import LimitSetup
from tests.conftest import make_repository
from tests.integration.conftest import SandboxBroker, profile_text, services_of
from tests.integration.test_manifest_sandboxes import INHERITED, create, make_run, run_env

# Runs inside the sandbox: what the kernel answers when an exec reaches for another process.
REACH = r"""
import ctypes, errno, os, sys
libc = ctypes.CDLL(None, use_errno=True)
out = []
for pid in sys.argv[1:]:
    for name in ("environ", "mem", "fd"):
        try:
            if name == "fd":
                os.readlink(f"/proc/{pid}/fd/0")
            else:
                open(f"/proc/{pid}/{name}", "rb").read(1)
            out.append(f"{pid}/{name}:open")
        except OSError as exc:
            out.append(f"{pid}/{name}:{errno.errorcode[exc.errno]}")
    r = libc.ptrace(16, int(pid), 0, 0)  # PTRACE_ATTACH
    out.append(f"{pid}/ptrace:{'ok' if r == 0 else errno.errorcode[ctypes.get_errno()]}")
print(" ".join(out))
"""


def _inspect(broker: SandboxBroker, sandbox_id: str) -> dict[str, object]:
    result = broker.run("inspect", sandbox_id, "--json")
    assert result.status == 0, result.stderr
    evidence: dict[str, object] = json.loads(result.stdout)
    return evidence


def _record(broker: SandboxBroker, sandbox_id: str) -> dict[str, object]:
    data: dict[str, object] = json.loads((broker.sandbox_dir(sandbox_id) / "record.json").read_text())
    return data


def test_inspect_reports_the_syscall_policy_and_the_confined_processes(sb: SandboxBroker) -> None:
    sandbox_id = sb.create()
    evidence = _inspect(sb, sandbox_id)
    assert evidence["matches_plan"] is True, evidence["differences"]
    assert evidence["seccomp"] == {"mode": 2, "sha256": seccomp.digest(allow_ptrace=False), "allow_ptrace": False}
    record = _record(sb, sandbox_id)
    for key in ("bwrap_pid", "init_pid", "holder_pid"):
        pid = record[key]
        assert isinstance(pid, int)
        cgroups = Path(f"/proc/{pid}/cgroup").read_text()
        if record["limits"]["mechanism"] == "cgroup-v1":  # type: ignore[index]
            assert f":memory:/sandboxer/{sandbox_id}\n" in cgroups, (key, cgroups)
            assert f":pids:/sandboxer/{sandbox_id}\n" in cgroups, (key, cgroups)
    holder = Path(f"/proc/{record['holder_pid']}/status")
    assert "Seccomp:\t2" in holder.read_text()
    uid = int(next(line for line in holder.read_text().splitlines() if line.startswith("Uid:")).split()[1])
    assert holder.stat().st_uid != uid, "the holder is dumpable"
    assert not (sb.sandbox_dir(sandbox_id) / "bwrap.log").exists(), "bwrap writes into a host file"


def test_an_exec_cannot_reach_init_the_holder_or_another_exec(sb: SandboxBroker) -> None:
    sandbox_id = sb.create()
    background = sb.sh(sandbox_id, "sleep 300 >/dev/null 2>&1 & echo $!")
    assert background.status == 0, background.stderr
    other = background.stdout.strip()
    reached = sb.exec(sandbox_id, "python3", "-c", REACH, "1", "2", other)
    assert reached.status == 0, reached.stderr
    outcomes = dict(item.split(":") for item in reached.stdout.split())
    for pid in ("1", "2", other):
        assert outcomes[f"{pid}/ptrace"] == "EPERM", outcomes
        for name in ("environ", "mem", "fd"):
            assert outcomes[f"{pid}/{name}"] == "EACCES", (pid, name, outcomes)


def test_the_workspace_is_its_own_sized_filesystem(sb: SandboxBroker) -> None:
    sb.write_profile("small", profile_text("small", sb.repo, "limits:\n  workspace_mib: 16\n"))
    assert sb.run("ext", "approve", "small").status == 0
    sandbox_id = sb.create("small")
    evidence = _inspect(sb, sandbox_id)
    limits = evidence["limits"]
    assert isinstance(limits, dict)
    assert limits["workspace_mib"] == 16
    assert limits["workspace_enforced"] is True
    filled = sb.sh(sandbox_id, "dd if=/dev/zero of=/workspace/fill bs=1M count=64 2>&1; echo status=$?")
    assert "No space left on device" in filled.stdout, filled.stdout
    assert "status=1" in filled.stdout
    git = sb.sh(sandbox_id, "rm /workspace/fill && git -C /workspace status --porcelain && echo clean")
    assert git.stdout.strip() == "clean", git.stdout + git.stderr
    if sb.as_user:
        # An unprivileged broker cannot mount on the host: the workspace is a 16 MiB tmpfs of the
        # sandbox's own, and the host keeps no copy of the clone.
        mounted = sb.sh(sandbox_id, "grep ' /workspace ' /proc/self/mountinfo")
        assert " - tmpfs " in mounted.stdout, mounted.stdout
        assert "size=16384k" in mounted.stdout, mounted.stdout
        assert not (sb.sandbox_dir(sandbox_id) / "workspace").exists()
        assert sb.run("teardown", sandbox_id).status == 0
        return
    image = sb.sandbox_dir(sandbox_id) / "workspace.img"
    assert image.stat().st_blocks * 512 <= 16 * 1024 * 1024, "the host holds more than the limit"
    receipt = sb.run("teardown", sandbox_id)
    assert receipt.status == 0, receipt.stderr
    assert "workspace filesystem" in receipt.stdout
    assert not os.path.ismount(sb.sandbox_dir(sandbox_id) / "workspace")


def test_a_clone_larger_than_the_workspace_is_refused_and_leaves_nothing(sb: SandboxBroker) -> None:
    """24 MiB of clone cannot become a 16 MiB workspace: create fails (5) naming the limit, and
    leaves no sandbox, directory or process behind. As root the checkout meets the limit (git
    checkout exits 0 with files cut short: the work tree is checked); unprivileged, the copy into
    the tmpfs does."""
    # Incompressible, so the packed history is as large as the checkout.
    blobs = {f"blob{n}": os.urandom(4 * 1024 * 1024) for n in range(3)}
    big = make_repository(sb.root / "big", blobs, "big")
    sb.write_profile("cramped", profile_text("cramped", big, "limits:\n  workspace_mib: 16\n"))
    assert sb.run("ext", "approve", "cramped").status == 0
    refused = sb.run("create", "--profile", "cramped")
    assert refused.status == 5, refused
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "limits.workspace_mib" in refused.stderr, refused.stderr
    if sb.as_user:
        assert "limits.workspace_mib: the clone does not fit in 16 MiB" in refused.stderr
    left = [p.name for p in (sb.state / "sandboxes").iterdir() if not p.name.startswith(".")]
    assert left == []
    found = subprocess.run(["pgrep", "-f", str(sb.state)], capture_output=True, text=True, check=False).stdout.split()
    assert [int(pid) for pid in found] == services_of(sb.state)  # nothing but a private service


def test_dev_shm_is_a_sized_tmpfs(sb: SandboxBroker) -> None:
    sandbox_id = sb.create()
    filled = sb.sh(sandbox_id, "dd if=/dev/zero of=/dev/shm/fill bs=1M count=96 2>&1; echo status=$?")
    assert "No space left on device" in filled.stdout, filled.stdout
    assert "status=1" in filled.stdout
    sized = sb.sh(sandbox_id, "df -k /dev/shm | tail -1")
    assert sized.stdout.split()[1] == str(64 * 1024), sized.stdout


def test_a_provider_launch_is_out_of_reach_of_other_execs(sb_root: SandboxBroker, base: Path) -> None:
    """The attack: a plain exec reads a provider launch's environment or memory (ptrace, /proc)."""
    broker = sb_root
    run = make_run(base, broker)
    sandbox_id = create(broker, run)
    token = INHERITED["MODEL_ACCESS_TOKEN"]
    argv = broker.argv(
        "exec", sandbox_id, "--consumer", "coding-agent", "--executable", "env", "--", "env", "sleep", "300"
    )
    launch = subprocess.Popen(argv, env={**broker.env(), **INHERITED}, stdout=subprocess.DEVNULL)
    try:
        found = ""
        for _ in range(100):  # until the launch runs inside
            found = run_env(broker, "exec", sandbox_id, "--", "sh", "-c", "pgrep -x sleep").stdout.strip()
            if found:
                break
            time.sleep(0.05)
        assert found, "the provider launch did not start"
        pid = found.splitlines()[0]
        reached = run_env(broker, "exec", sandbox_id, "--", "python3", "-c", REACH, pid)
        assert reached.status == 0, reached.stderr
        outcomes = dict(item.split(":") for item in reached.stdout.split())
        assert outcomes == {
            f"{pid}/environ": "EACCES",
            f"{pid}/mem": "EACCES",
            f"{pid}/fd": "EACCES",
            f"{pid}/ptrace": "EPERM",
        }
        scan = run_env(broker, "exec", sandbox_id, "--", "sh", "-c", "cat /proc/[0-9]*/environ 2>/dev/null; true")
        assert token not in scan.stdout
    finally:
        launch.send_signal(signal.SIGTERM)
        launch.wait(timeout=30)


REOPEN = """
import os
try:  # a pipe of the broker's: root's (refused) or the user's own (empty)
    data = os.read(os.open("/proc/self/fd/1", os.O_RDONLY | os.O_NONBLOCK), 4096)
except (BlockingIOError, PermissionError):
    data = b""
print("read", len(data))
"""


def test_the_callers_stdout_file_cannot_be_reopened_for_reading(sb: SandboxBroker, tmp_path: Path) -> None:
    sandbox_id = sb.create()
    out = tmp_path / "caller.log"
    out.write_text("an earlier line the caller wrote\n")
    out.chmod(0o644)
    with open(out, "a") as stream:
        done = subprocess.run(
            sb.argv("exec", sandbox_id, "--", "python3", "-c", REOPEN), stdout=stream, env=sb.env(), check=False
        )
    assert done.returncode == 0
    assert out.read_text() == "an earlier line the caller wrote\nread 0\n"
    with open(out, "w") as stream:  # and a long output arrives whole through the relay
        done = subprocess.run(
            sb.argv("exec", sandbox_id, "--", "seq", "1", "200000"), stdout=stream, env=sb.env(), check=False
        )
    assert done.returncode == 0
    assert out.read_text() == "".join(f"{n}\n" for n in range(1, 200001))


def test_create_refuses_sandbox_processes_that_escape_their_confinement(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `create` and `inspect` check of bwrap, its init and the holder, against processes that
    escape every rule: outside the sandbox's cgroups, dumpable, unfiltered, a host file open."""
    monkeypatch.setattr(bwrap_live, "_PROBE_SETTLE_SECONDS", 0.2)  # init's host file is looked at again

    log = tmp_path / "bwrap.log"
    with open(log, "wb") as stream:
        escaped = [
            subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL, stdout=stream, stderr=subprocess.DEVNULL)
            for _ in range(3)
        ]
    try:
        # sleep opens and closes its loader's and locale files as it starts: checked during that,
        # it has a host file at descriptor 3. Wait until each is asleep (clock_nanosleep, 230).
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(
            Path(f"/proc/{process.pid}/syscall").read_text().split()[0] != "230" for process in escaped
        ):
            time.sleep(0.01)
        live = Live(bwrap_pid=escaped[0].pid, init_pid=escaped[1].pid, holder_pid=escaped[2].pid, pid_namespace=0)
        groups = ("/sys/fs/cgroup/memory/sandboxer/0123456789abcdef01234567",)
        problems = confinement_problems(live, LimitSetup(mechanism="cgroup-v1", groups=groups))
    finally:
        for process in escaped:
            process.kill()
            process.wait()
    for name in ("bwrap", "init", "holder"):
        assert f"{name}: outside the sandbox's cgroups (memory:/sandboxer/0123456789abcdef01234567 missing)" in problems
        assert f"{name}: descriptor 1 is open on a host file" in problems
    assert "holder: dumpable (the sandbox user could ptrace it)" in problems
    assert "holder: runs without the syscall policy" in problems
    assert len(problems) == 8, problems


def test_a_terminal_handed_to_an_exec_is_not_readable_after_it_returns(sb: SandboxBroker) -> None:
    """A background process of an exec whose stdin was the caller's terminal read whatever was
    typed there afterwards: the command now gets a pipe, closed when the exec ends."""
    sandbox_id = sb.create()
    controller, terminal = pty.openpty()
    try:
        left_behind = "(sleep 1; cat > $HOME/typed) >/dev/null 2>&1 & test -p /dev/stdin && echo pipe"
        done = subprocess.run(
            sb.argv("exec", sandbox_id, "--", "sh", "-c", left_behind),
            stdin=terminal,
            capture_output=True,
            env=sb.env(),
            check=False,
            timeout=60,
        )
        assert (done.returncode, done.stdout) == (0, b"pipe\n"), done.stderr
        os.write(controller, b"typed after the exec returned\n")
        time.sleep(2)
    finally:
        os.close(controller)
        os.close(terminal)
    typed = sb.sh(sandbox_id, 'cat "$HOME/typed"')
    assert typed.status == 0, typed.stderr
    assert typed.stdout == ""


def test_stdin_that_is_a_file_arrives_through_a_pipe(sb: SandboxBroker, tmp_path: Path) -> None:
    sandbox_id = sb.create()
    script = tmp_path / "input"
    script.write_bytes(b"".join(f"line {n}\n".encode() for n in range(50000)))
    script.chmod(0o666)
    with open(script, "rb") as stream:
        read = subprocess.run(
            sb.argv("exec", sandbox_id, "--", "sh", "-c", "test -p /dev/stdin && wc -l"),
            stdin=stream,
            capture_output=True,
            env=sb.env(),
            check=False,
        )
    assert (read.returncode, read.stdout.strip()) == (0, b"50000"), read.stderr
