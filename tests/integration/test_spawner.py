"""The service's spawner (sandboxer/backends/bwrap/spawner.py): a small process that forks each
exec's relay. Its execs behave as the service's own did — whatever the size of the command line,
reaped at once, and nothing of an exec outlives the spawner being killed under it."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxer import Client
from sandboxer.clients.service import ClientSandbox
from sandboxer.errors import UsageError
from tests.conftest import settled
from tests.integration.conftest import SandboxBroker
from tests.integration.services import Service


def _children(pid: int) -> list[tuple[int, str, bytes]]:
    """(pid, state, command line) of each child of `pid`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == pid:
            found.append((int(entry), fields[0], cmdline))
    return found


@pytest.fixture
def served(sb_root: SandboxBroker) -> Iterator[tuple[Service, ClientSandbox, int]]:
    """A root service, a sandbox through it, and the pid of the service's spawner."""
    service = Service(sb_root, sb_root.state / "broker.sock").start()
    try:
        assert service.process is not None
        sandbox = Client(str(service.socket)).create(sb_root.profile)
        sb_root.created.append(sandbox.id)
        spawners = [pid for pid, _, cmd in _children(service.process.pid) if b"bwrap.spawner" in cmd]
        assert len(spawners) == 1, _children(service.process.pid)
        yield service, sandbox, spawners[0]
    finally:
        service.stop()


def test_a_large_command_line_and_its_relays_reaped(served: tuple[Service, ClientSandbox, int]) -> None:
    """A 300 KB argument (more than one socket message holds) runs; the spawner keeps no ended
    relay as a zombie (it would count against the sandbox's pids limit)."""
    _, sandbox, spawner = served
    parts = ["é" * 50_000] * 3  # 300 KB, each argument below the kernel's 128 KiB for one
    result = sandbox.exec(["sh", "-c", 'printf %s "$@" | wc -c', "sh", *parts])
    assert (result.status, result.stdout.strip()) == (0, b"300000"), result.stderr
    for _ in range(5):
        assert sandbox.exec(["true"]).status == 0
    assert settled(lambda: [state for _, state, _ in _children(spawner)], []) == []


def test_a_nul_in_the_command_line_is_refused(served: tuple[Service, ClientSandbox, int]) -> None:
    _, sandbox, _ = served
    with pytest.raises(UsageError, match="argv: must not hold a NUL character"):
        sandbox.exec(["echo", "a\0b"])


def test_an_exec_whose_spawner_is_killed_ends_with_all_it_started(
    served: tuple[Service, ClientSandbox, int],
) -> None:
    """The spawner killed while an exec runs: its relay dies with it, and the service kills what
    the exec started (it never runs on unsupervised); the next exec gets a new spawner."""
    _, sandbox, spawner = served
    marker = f"{9000 + os.getpid() % 1000}.25"
    outcome: list[int] = []
    running = threading.Thread(target=lambda: outcome.append(sandbox.exec(["sleep", marker]).status))
    running.start()
    deadline = time.monotonic() + 20
    while not any(marker.encode() in cmd for _, _, cmd in _all()):
        assert time.monotonic() < deadline, "the exec never started"
        time.sleep(0.05)
    os.kill(spawner, signal.SIGKILL)
    running.join(timeout=30)
    assert outcome == [137]
    deadline = time.monotonic() + 10
    while any(marker.encode() in cmd for _, _, cmd in _all()):
        assert time.monotonic() < deadline, "the exec's command outlived its relay"
        time.sleep(0.05)
    assert sandbox.exec(["true"]).status == 0


def _all() -> list[tuple[int, str, bytes]]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                found.append((int(entry), "", Path(f"/proc/{entry}/cmdline").read_bytes()))
            except OSError:
                continue
    return found


def test_a_root_spawner_forks_each_command_straight_into_its_sandbox(
    served: tuple[Service, ClientSandbox, int],
) -> None:
    """No relay: the command is the spawner's child, in the sandbox's pid namespace and nobody's
    else; the spawner's own children are born into its pid namespace again at once; every way a
    command ends reaches the caller; the spawner keeps no status pipe of an ended exec."""
    service, sandbox, spawner = served
    own = os.readlink(f"/proc/{spawner}/ns/pid")
    descriptors = sorted(os.listdir(f"/proc/{spawner}/fd"))
    marker = f"1.{os.getpid() % 1000:03d}7"  # a second and a bit, and no other process's argument
    started = threading.Thread(target=lambda: sandbox.exec(["sleep", marker]))
    started.start()
    deadline = time.monotonic() + 20
    while not (ours := [pid for pid, _, cmd in _children(spawner) if marker.encode() in cmd]):
        assert time.monotonic() < deadline, "the command never became the spawner's child"
        time.sleep(0.02)
    record = json.loads((service.broker.sandbox_dir(sandbox.id) / "record.json").read_text())
    holder = int(record["holder_pid"])
    assert os.readlink(f"/proc/{ours[0]}/ns/pid") == os.readlink(f"/proc/{holder}/ns/pid") != own
    assert os.readlink(f"/proc/{spawner}/ns/pid_for_children") == own
    started.join(timeout=30)
    outcomes = [
        (["true"], 0),
        (["sh", "-c", "exit 7"], 7),
        (["sh", "-c", "kill -9 $$"], 137),
        (["no-such-program"], 127),
    ]
    for argv, status in outcomes:
        assert sandbox.exec(argv).status == status, argv
    assert settled(lambda: _children(spawner), []) == []
    assert sorted(os.listdir(f"/proc/{spawner}/fd")) == descriptors
    assert os.readlink(f"/proc/{spawner}/ns/pid_for_children") == own
