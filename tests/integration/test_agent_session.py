"""A coding agent's working day, end to end, on both backends and through a root service: a
runtime built with pytest; the agent's commands (awk, which, cc, /tmp, its own tests, a commit
with the profile's identity, an interactive shell through a terminal); its work refused to
teardown until it is exported, then exported as a bundle that a fresh clone fetches; and an
expiring sandbox's work kept by the service's reaper."""

from __future__ import annotations

import fcntl
import json
import os
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxer import Broker
from tests.integration.conftest import REPO, SandboxBroker, backend_profile_text
from tests.integration.services import Service
from tests.samples import tiny_wheel

GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost", "-c", "init.defaultBranch=main"]
PROFILE = "agent"
IDENTITY = "Agent Smith <agent@example.test>"


@pytest.fixture(scope="session")
def pytest_runtime() -> Iterator[Path]:
    """A runtime built the owner's way (scripts/build-runtime.py --package pytest): a
    world-searchable place, as the sandbox uid of a root broker must reach it."""
    root = Path(tempfile.mkdtemp(prefix="sbx-agent-runtime-", dir="/tmp"))
    root.chmod(0o755)
    output = root / "runtime"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(root), "LANG": "C.UTF-8", "PYTHONPATH": str(REPO)}
    built = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "build-runtime.py"), "--output", str(output), "--package", "pytest"],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    info = json.loads((output / "build-info.json").read_text())
    assert info["packages"] == ["pytest"]
    (pytest_info,) = [d for d in info["distributions"] if d["name"] == "pytest"]
    assert len(pytest_info["sha256"]) == 64  # the wheel pip downloaded, by its digest
    yield output
    shutil.rmtree(root, ignore_errors=True)


def _agent_profile(broker: SandboxBroker, runtime: Path) -> None:
    """The broker's extension pinned to the pytest runtime, and a profile with an identity and
    an offline hint; both approved."""
    name = f"ext.{broker.backend}"
    path = broker.config / "extensions" / f"{name}.yaml"
    digest = Broker(config_dir=str(broker.config), state_dir=str(broker.state)).owner.runtime_digest(str(runtime))
    text = path.read_text()
    text = text.replace(f"path: {broker.runtime}", f"path: {runtime}")
    lines = [
        line if "sha256:" not in line or "image" in line else f"    sha256: {digest.sha256}"
        for line in text.splitlines()
    ]
    path.write_text("\n".join(lines) + "\n")
    extra = 'exec:\n  env:\n    PIP_NO_INDEX: "1"\n'
    profile = backend_profile_text(broker, PROFILE, broker.repo, extra).replace(
        "  ref: main\n", "  ref: main\n  git:\n    user:\n      name: Agent Smith\n      email: agent@example.test\n"
    )
    broker.write_profile(PROFILE, profile)
    broker.approve(name, PROFILE)


class Cli:
    """The `sandboxer` command as the agent's orchestrator runs it: a client of the service."""

    def __init__(self, broker: SandboxBroker, socket_path: Path) -> None:
        self.broker = broker
        self.env = {"PATH": "/usr/bin:/bin", "HOME": str(broker.root / "home"), "LANG": "C.UTF-8"}
        self.env |= {"SANDBOXER_SOCKET": str(socket_path), "TERM": "xterm-256color"}

    def argv(self, *args: str) -> list[str]:
        return self.broker.argv(*args)

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(*args), capture_output=True, text=True, env=self.env, timeout=300, check=False)

    def sh(self, sandbox_id: str, script: str) -> subprocess.CompletedProcess[str]:
        return self.run("exec", sandbox_id, "--", "sh", "-c", script)


def _interactive(cli: Cli, sandbox_id: str, lines: list[str]) -> bytes:
    """`exec -t ID -- bash -i` on a pseudo-terminal of the test's, as a person would: each line
    typed once the shell's prompt is back; what the terminal showed."""
    master, end = os.openpty()
    fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    process = subprocess.Popen(
        cli.argv("exec", "-t", sandbox_id, "--", "bash", "--norc", "--noprofile", "-i"),
        stdin=end,
        stdout=end,
        stderr=end,
        env=cli.env,
        start_new_session=True,
        preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),  # noqa: PLW1509 - a login's terminal
    )
    seen = b""
    try:
        for number, line in enumerate([*lines, "exit"]):
            deadline = time.monotonic() + 30
            while seen.count(b"$ ") <= number:
                assert time.monotonic() < deadline, seen[-1000:]
                if select.select([master], [], [], 0.1)[0]:
                    seen += os.read(master, 65536)
            os.write(master, line.encode() + b"\n")
        assert process.wait(timeout=30) == 0
        while select.select([master], [], [], 0.2)[0]:
            try:
                seen += os.read(master, 65536)
            except OSError:
                break
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(master)
        os.close(end)
    return seen


def test_an_agents_working_day(sbx_root: SandboxBroker, pytest_runtime: Path, tmp_path: Path) -> None:
    broker = sbx_root
    _agent_profile(broker, pytest_runtime)
    socket_path = broker.root / "run" / "broker.sock"
    service = Service(broker, socket_path, "--keep-exports", "120").start()
    try:
        cli = Cli(broker, socket_path)
        made = cli.run("create", "--profile", PROFILE)
        assert made.returncode == 0, made.stderr
        sandbox_id = made.stdout.strip()
        broker.created.append(sandbox_id)

        # The tools an agent reaches for, a writable /tmp, the offline hint.
        tools = cli.sh(sandbox_id, "awk 'BEGIN { print 6 * 7 }'; which git; cc --version | head -1; echo $PIP_NO_INDEX")
        assert tools.returncode == 0, tools.stderr
        answer, git, compiler, hint = tools.stdout.splitlines()
        assert (answer, git, hint) == ("42", "/usr/bin/git", "1")
        assert compiler.startswith(("cc ", "gcc "))
        assert cli.sh(sandbox_id, "echo scratch > /tmp/notes && cat /tmp/notes").stdout == "scratch\n"

        # Its own tests, with the runtime's pytest; then a commit with the profile's identity.
        test = "def test_sum():\n    assert sum([1, 2]) == 3\n"
        wrote = cli.run("exec", sandbox_id, "--", "sh", "-c", f"printf '%s' '{test}' > test_sum.py")
        assert wrote.returncode == 0, wrote.stderr
        tested = cli.sh(sandbox_id, "python3 -m pytest -q -p no:cacheprovider test_sum.py")
        assert tested.returncode == 0, tested.stdout + tested.stderr
        assert "1 passed" in tested.stdout

        # Packages on top of the read-only runtime: a venv of its own sees the runtime's pytest
        # and a wheel the agent brought in.
        wheel = tiny_wheel(tmp_path)
        assert cli.run("cp", str(wheel), f"{sandbox_id}:/tmp/{wheel.name}").returncode == 0
        layered = cli.sh(
            sandbox_id,
            f"runtime-venv /tmp/venv >/dev/null && /tmp/venv/bin/pip install -q --no-index /tmp/{wheel.name}"
            " && /tmp/venv/bin/python -c 'import pytest, tinywheel; print(tinywheel.VALUE, pytest.__file__)'",
        )
        assert layered.returncode == 0, layered.stdout + layered.stderr
        value, pytest_file = layered.stdout.split()
        assert value == "42"
        assert pytest_file.startswith("/opt/sandboxer/runtime/")
        assert cli.sh(sandbox_id, "pip install --user tinywheel").returncode != 0  # the runtime stays as pinned
        committed = cli.sh(
            sandbox_id, "git add test_sum.py && git commit -qm 'Add a test' && git log -1 --format='%an <%ae>'"
        )
        assert (committed.returncode, committed.stdout) == (0, f"{IDENTITY}\n"), committed.stderr

        # A person looks in through a terminal of the exec's own.
        shown = _interactive(cli, sandbox_id, ["git log --format=%s -1 | tr a-z A-Z", "echo $((6*7))-answer"])
        assert b"ADD A TEST" in shown
        assert b"42-answer" in shown

        # Its work does not go with a teardown until it is exported.
        refused = cli.run("teardown", sandbox_id)
        assert refused.returncode == 2
        assert "1 new commit on main (made from main)" in refused.stderr
        bundle = tmp_path / "work.bundle"
        exported = cli.run("export", sandbox_id, "--bundle", str(bundle), "--json")
        assert exported.returncode == 0, exported.stderr
        summary = json.loads(exported.stdout)
        assert (summary["ahead"], summary["dirty"], summary["branch"]) == (1, False, "main")
        clone = tmp_path / "clone"
        subprocess.run([*GIT, "clone", "-q", str(broker.repo), str(clone)], check=True)
        subprocess.run([*GIT, "-C", str(clone), "fetch", "-q", str(bundle), "HEAD:agent-work"], check=True)
        fetched = subprocess.run(
            ["git", "-C", str(clone), "log", "-1", "--format=%an <%ae>|%s", "agent-work"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert fetched.stdout == f"{IDENTITY}|Add a test\n"
        assert (clone / "README.md").exists()
        assert cli.run("teardown", sandbox_id).returncode == 0

        # A sandbox that runs out of time: the reaper keeps its work before the teardown.
        expiring = cli.run("create", "--profile", PROFILE, "--ttl", "3").stdout.strip()
        broker.created.append(expiring)
        assert cli.sh(expiring, "echo late > late.txt && git add late.txt && git commit -qm Late").returncode == 0
        kept = broker.state / "exports" / expiring
        deadline = time.monotonic() + 60
        while not (kept / "summary.json").exists() or broker.sandbox_dir(expiring).exists():
            assert time.monotonic() < deadline, "the reaper kept nothing"
            time.sleep(0.2)
        assert json.loads((kept / "summary.json").read_text())["ahead"] == 1
        subprocess.run([*GIT, "-C", str(clone), "fetch", "-q", str(kept / "work.bundle"), "HEAD:late"], check=True)
    finally:
        service.stop()
