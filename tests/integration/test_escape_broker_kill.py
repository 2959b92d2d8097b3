"""The broker is SIGKILLed at every step of create, exec, teardown and dispatch-tool; `sandboxer gc`
then finishes the job and nothing is left behind.

Each step is found by a mark the step leaves on the host, watched for while the CLI runs: the
sandbox directory, its record, the workspace image and its loop mount, a host-side `git`, the
sandbox's cgroups, its syscall policy file, a running bwrap, the holder, the verification probe,
the container, an exec's command or its own cgroup, a record marked tearing-down, the holder gone,
the cgroups or the mount removed, the dispatcher's claim and relay. The CLI is killed the moment
the mark appears (it may have gone a little further by then; the mark is reported either way).

After the kill: `gc` exits 0 and reports no residue; the sandbox — when it is healthy, as after a
killed exec or dispatch — still works and tears down cleanly; and then there is no sandbox
directory, no cgroup directory named for it, no process carrying its id, no mount or loop device
below the state dir, no container or spool volume of the broker, and no new git home in /tmp.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from sandboxer.backends.docker.render import STATE_LABEL
from tests.integration.conftest import Endpoints, SandboxBroker, _cleanup, log_lines
from tests.integration.test_dispatch_tool import LEASE, envelope, setup, spool
from tests.integration.test_escape_support import (
    host_processes,
    loop_backing_files,
    mount_points,
    start_broker,
)

CGROUP_CONTROLLERS = ("memory", "pids")
EXEC_SECONDS = "313.579"  # the command of a killed exec: a duration nothing else sleeps for


# ------------------------------------------------------------------------------------- the scene


@dataclass
class Scene:
    """What the watcher sees while the CLI runs: its process tree and the broker's state dir."""

    broker: SandboxBroker
    cli_pid: int
    known: set[str]
    sandbox_id: str | None = None
    docker_containers_before: set[str] = field(default_factory=set)
    initial_record: dict[str, Any] = field(default_factory=dict)  # the record before the run

    @property
    def registry(self) -> Path:
        return self.broker.state / "sandboxes"

    def current_id(self) -> str | None:
        """The sandbox this run works on: given, or the first new directory in the registry."""
        if self.sandbox_id is None:
            with contextlib.suppress(OSError):
                fresh = [n for n in os.listdir(self.registry) if not n.startswith(".") and n not in self.known]
                if fresh:
                    self.sandbox_id = fresh[0]
        return self.sandbox_id

    def directory(self) -> Path | None:
        sandbox_id = self.current_id()
        return None if sandbox_id is None else self.registry / sandbox_id

    def record(self) -> dict[str, Any]:
        directory = self.directory()
        if directory is None:
            return {}
        try:
            data: dict[str, Any] = json.loads((directory / "record.json").read_text())
        except (OSError, ValueError):
            return {}
        return data

    def descendants(self) -> list[tuple[int, str, bytes]]:
        """(pid, comm, cmdline) of every descendant of the CLI."""
        found: list[tuple[int, str, bytes]] = []
        frontier = [self.cli_pid]
        while frontier:
            pid = frontier.pop()
            for task in _tasks(pid):
                try:
                    children = Path(f"/proc/{pid}/task/{task}/children").read_text().split()
                except OSError:
                    continue
                for child in map(int, children):
                    frontier.append(child)
                    try:
                        comm = Path(f"/proc/{child}/comm").read_text().strip()
                        cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
                    except OSError:
                        continue
                    found.append((child, comm, cmdline))
        return found

    def has_descendant(self, comm: str, cmdline: bytes | None = None) -> bool:
        return any(c == comm and (cmdline is None or line == cmdline) for _, c, line in self.descendants())

    def exists(self, *parts: str) -> bool:
        directory = self.directory()
        return directory is not None and os.path.lexists(directory.joinpath(*parts))

    def mounted(self, *parts: str) -> bool:
        directory = self.directory()
        return directory is not None and str(directory.joinpath(*parts)) in mount_points()

    def cgroup(self) -> bool:
        sandbox_id = self.current_id()
        return sandbox_id is not None and os.path.isdir(f"/sys/fs/cgroup/memory/sandboxer/{sandbox_id}")

    def new_container(self) -> bool:
        """A container of this broker's was created (another broker's, of a test running at the
        same time, is not: its configuration names another state dir)."""
        return any(
            _labels(name).get(STATE_LABEL) == str(self.broker.state)
            for name in docker_containers() - self.docker_containers_before
        )


def _tasks(pid: int) -> list[str]:
    try:
        return os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []


@functools.cache
def docker_root() -> str:
    """The Engine's root directory (with user-namespace remapping, a subdirectory per mapping)."""
    done = subprocess.run(
        ["docker", "info", "--format", "{{.DockerRootDir}}"], capture_output=True, text=True, check=False, timeout=60
    )
    return done.stdout.strip()


def docker_containers() -> set[str]:
    """The Engine's container directories (a new one appears the moment a container is created)."""
    try:
        return set(os.listdir(os.path.join(docker_root(), "containers")))
    except OSError:
        return set()


def _labels(container: str) -> dict[str, str]:
    """A container's labels, from the configuration the Engine writes as it creates it ({} until
    then)."""
    try:
        config = json.loads(Path(docker_root(), "containers", container, "config.v2.json").read_text())
    except (OSError, ValueError):
        return {}
    labels = config.get("Config", {}).get("Labels") or {}
    return labels if isinstance(labels, dict) else {}


Mark = Callable[[Scene], bool]


@dataclass
class Killed:
    """How a run ended: killed at its mark (or not), and the sandbox it worked on."""

    hit: bool
    sandbox_id: str | None
    status: int
    stderr: str
    left: list[str]  # what the run had made when it was killed (files, mounts, cgroups, records)


def kill_at(
    broker: SandboxBroker,
    args: list[str],
    mark: Mark,
    *,
    sandbox_id: str | None = None,
    initial_record: dict[str, Any] | None = None,
    timeout: float = 90,
) -> Killed:
    """Run the CLI and SIGKILL it the moment `mark` holds."""
    registry = broker.state / "sandboxes"
    known = {n for n in os.listdir(registry) if not n.startswith(".")} if registry.is_dir() else set()
    before = docker_containers() if broker.backend == "docker" else set()
    # Output to a file, never a pipe: a killed exec's command keeps the pipe's write end open.
    with tempfile.TemporaryFile() as errors:
        proc = subprocess.Popen(
            broker.argv(*args), env=broker.env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errors
        )
        scene = Scene(
            broker=broker,
            cli_pid=proc.pid,
            known=known,
            sandbox_id=sandbox_id,
            docker_containers_before=before,
            initial_record=initial_record or {},
        )
        hit = False
        deadline = time.monotonic() + timeout
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                if mark(scene):
                    os.kill(proc.pid, signal.SIGKILL)
                    hit = True
                    break
                time.sleep(0.0005)
        finally:
            if proc.poll() is None and not hit:
                proc.kill()
            left = made(scene)
            proc.wait(timeout=60)
        errors.seek(0)
        stderr = errors.read().decode(errors="replace")
    return Killed(hit=hit, sandbox_id=scene.sandbox_id, status=proc.returncode, stderr=stderr, left=left)


def made(scene: Scene) -> list[str]:
    """What exists of the sandbox right now, for the test's report."""
    if scene.current_id() is None:
        return []
    record = scene.record()
    found = [f"record:{record.get('state')}"] if record else []
    found += [name for name in ("workspace.img", "seccomp.bpf", "holder", "ledger") if scene.exists(name)]
    found += ["mounted"] if scene.mounted("workspace") else []
    found += ["cgroup"] if scene.cgroup() else []
    found += [f"{key}" for key in ("bwrap_pid", "container_id") if key in record]
    return found


# ------------------------------------------------------------------------------- the aftermath


def git_homes() -> set[str]:
    return set(glob.glob("/tmp/sandboxer-git-home-*"))


def gc_clean(broker: SandboxBroker, sandbox_id: str) -> dict[str, Any]:
    """gc exits 0; whatever it says of this sandbox carries no residue.

    A process the killed broker had just forked (a relay into the sandbox, before it closes what
    it inherited) holds the sandbox's lock for the moment it takes to die of the broker's death;
    gc rightly calls the sandbox busy meanwhile, so it is asked again for a few seconds."""
    deadline = time.monotonic() + 5
    while True:
        done = broker.run("gc", "--json")
        assert done.status == 0, (done.stdout, done.stderr)
        receipt: dict[str, Any] = json.loads(done.stdout)
        if sandbox_id not in receipt["busy"]:
            break
        if time.monotonic() > deadline:
            holders = lock_holders(broker.sandbox_dir(sandbox_id) / "lock")
            raise AssertionError(f"gc still calls {sandbox_id} busy; its lock is held by {holders}")
        time.sleep(0.1)
    for entry in receipt["collected"]:
        assert entry["residue"] == [], entry
    return receipt


def in_process(broker: SandboxBroker) -> SandboxBroker:
    """The broker whose CLI process is the broker itself: the one these tests kill."""
    broker.through_service = False
    return broker


def lock_holders(path: Path) -> list[str]:
    """Every process with `path` open: pid, state, parent and command line (what a failure shows)."""
    try:
        wanted = os.stat(path)
    except OSError:
        return []
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    seen = os.stat(f"/proc/{pid}/fd/{fd}")
                    if (seen.st_dev, seen.st_ino) == (wanted.st_dev, wanted.st_ino):
                        status = dict(
                            line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                        )
                        command = Path(f"/proc/{pid}/cmdline").read_bytes()[:120]
                        found.append(f"{pid} {status.get('State')} ppid {status.get('PPid')} {command!r}")
        except OSError:
            continue
    return found


def assert_nothing_left(broker: SandboxBroker, sandbox_id: str, homes_before: set[str]) -> None:
    """No directory, cgroup, process, mount, loop device, container or git home of the sandbox."""
    directory = broker.sandbox_dir(sandbox_id)
    assert not os.path.lexists(directory), sorted(os.listdir(directory)) if directory.is_dir() else directory
    groups = [f"/sys/fs/cgroup/{c}/sandboxer/{sandbox_id}" for c in CGROUP_CONTROLLERS]
    groups.append(f"/sys/fs/cgroup/sandboxer/{sandbox_id}")
    assert [g for g in groups if os.path.lexists(g)] == []
    marker = sandbox_id.encode()
    deadline = time.monotonic() + 5  # a process gc killed may take a moment to be reaped
    carrying = host_processes(lambda cmdline, environ: marker in cmdline or marker in environ)
    while carrying and time.monotonic() < deadline:
        time.sleep(0.1)
        carrying = host_processes(lambda cmdline, environ: marker in cmdline or marker in environ)
    assert carrying == [], [(pid, Path(f"/proc/{pid}/cmdline").read_bytes()[:200]) for pid in carrying]
    state = str(broker.state)
    assert [m for m in mount_points() if m == state or m.startswith(state + "/")] == []
    assert [f for f in loop_backing_files() if f.startswith(state + "/")] == []
    assert git_homes() - homes_before == set()
    if broker.backend == "docker":
        label = f"label=io.sandboxer.state-dir={state}"
        for kind in (["ps", "-aq"], ["volume", "ls", "-q"]):
            listed = subprocess.run(
                ["docker", *kind, "--filter", label], capture_output=True, text=True, check=False, timeout=60
            )
            assert listed.stdout.split() == [], (kind, listed.stdout)


def teardown_clean(broker: SandboxBroker, sandbox_id: str) -> None:
    """Teardown (what the sandbox wrote is nobody's work: --discard) leaves no residue."""
    done = broker.run("teardown", sandbox_id, "--discard", "--json")
    assert done.status == 0, (done.stdout, done.stderr)
    assert json.loads(done.stdout)["residue"] == []


# ------------------------------------------------------------------------------------- create

CREATE_MARKS: dict[str, Mark] = {
    "directory-made": lambda s: s.current_id() is not None,
    "record-written": lambda s: s.exists("record.json"),
    "workspace-image": lambda s: s.exists("workspace.img"),
    "workspace-mounted": lambda s: s.mounted("workspace"),
    "host-git": lambda s: s.has_descendant("git"),
    "cgroups-made": lambda s: s.cgroup(),
    "policy-saved": lambda s: s.exists("seccomp.bpf"),
    "bwrap-running": lambda s: s.has_descendant("bwrap"),
    "holder-running": lambda s: s.has_descendant("holder"),
    # Verification starts once the running bwrap is recorded; its probe lives a few milliseconds.
    "verifying": lambda s: "bwrap_pid" in s.record() or s.has_descendant("sleep", b"sleep\x0030\x00"),
    "container-created": lambda s: s.new_container(),
    "container-recorded": lambda s: "container_id" in s.record(),
}

# The steps each variant goes through, in order (sandboxer/commands/create.py: _make).
CREATE_STEPS = {
    "bwrap-root": [
        "directory-made",
        "record-written",
        "workspace-image",
        "workspace-mounted",
        "host-git",
        "cgroups-made",
        "policy-saved",
        "bwrap-running",
        "holder-running",
        "verifying",
    ],
    "bwrap-user": [
        "directory-made",
        "record-written",
        "host-git",
        "policy-saved",
        "bwrap-running",
        "holder-running",
        "verifying",
    ],
    "docker": [
        "directory-made",
        "record-written",
        "workspace-image",
        "workspace-mounted",
        "host-git",
        "container-created",
        "container-recorded",
    ],
}

CREATE_CASES = [pytest.param(v, step, id=f"{v}-{step}") for v, steps in CREATE_STEPS.items() for step in steps]


@pytest.mark.parametrize(("which", "step"), CREATE_CASES)
def test_create_killed_then_gc_leaves_nothing(
    request: pytest.FixtureRequest, runtime_dir: Path, which: str, step: str
) -> None:
    broker = in_process(start_broker(request, runtime_dir, which))
    homes = git_homes()
    try:
        for _ in range(3):
            killed = kill_at(broker, ["create", "--profile", broker.profile], CREATE_MARKS[step])
            if "record:ready" not in killed.left:
                break
            # The kill landed after the create had finished (a loaded machine: the last steps
            # take milliseconds): the step was not exercised. That sandbox is whole; try again.
            print(f"create finished before the kill at {step}: again")
            assert killed.sandbox_id is not None
            teardown_clean(broker, killed.sandbox_id)
        assert "record:ready" not in killed.left, f"the kill never landed before the create finished: {step}"
        assert killed.hit, f"create ended (status {killed.status}) before step {step}: {killed.stderr}"
        print(f"create killed at {step}: {killed.left}")
        assert killed.status == -signal.SIGKILL
        assert killed.sandbox_id is not None
        receipt = gc_clean(broker, killed.sandbox_id)
        assert killed.sandbox_id in [entry["id"] for entry in receipt["collected"]], receipt
        assert_nothing_left(broker, killed.sandbox_id, homes)
        # The broker is still usable: the next create and its teardown work.
        again = broker.create()
        teardown_clean(broker, again)
    finally:
        _cleanup(broker)


# --------------------------------------------------------------------------------------- exec

EXEC_COMMAND = f"/usr/bin/sleep\x00{EXEC_SECONDS}\x00".encode()


def command_running(scene: Scene) -> bool:
    return bool(host_processes(lambda cmdline, _env: cmdline == EXEC_COMMAND))


def container_cgroups(container_id: str) -> list[str]:
    """The pids cgroup directories of a container (the Engine's, and any the broker made below)."""
    found = []
    for top in glob.glob(f"/sys/fs/cgroup/pids/**/*{container_id}*", recursive=True):
        found.append(top)
        found += [os.path.join(root, name) for root, names, _ in os.walk(top) for name in names]
    return found


def exec_group_made(scene: Scene) -> bool:
    """The exec has its own cgroup (made for --timeout) and its command runs."""
    if scene.broker.backend == "docker":
        container = str(scene.initial_record.get("container_id"))
        made = [g for g in container_cgroups(container) if "/sandboxer-exec-" in g]
    else:
        made = glob.glob(f"/sys/fs/cgroup/pids/sandboxer/{scene.current_id()}/exec-*")
    return bool(made) and command_running(scene)


EXEC_MARKS: dict[str, tuple[Mark, tuple[str, ...]]] = {
    "entering": (lambda s: bool(s.descendants()) or command_running(s), ()),
    "command-running": (command_running, ()),
    "timeout-group": (exec_group_made, ("--timeout", "120")),
}
EXEC_STEPS = {
    "bwrap-root": ["entering", "command-running", "timeout-group"],
    "bwrap-user": ["entering", "command-running"],
    "docker": ["entering", "command-running", "timeout-group"],
}
EXEC_CASES = [pytest.param(v, step, id=f"{v}-{step}") for v, steps in EXEC_STEPS.items() for step in steps]


@pytest.mark.parametrize(("which", "step"), EXEC_CASES)
def test_exec_killed_then_gc_and_teardown_leave_nothing(
    request: pytest.FixtureRequest, runtime_dir: Path, which: str, step: str
) -> None:
    broker = in_process(start_broker(request, runtime_dir, which))
    homes = git_homes()
    try:
        sandbox_id = broker.create()
        mark, options = EXEC_MARKS[step]
        record = json.loads((broker.sandbox_dir(sandbox_id) / "record.json").read_text())
        args = ["exec", sandbox_id, *options, "--", "/usr/bin/sleep", EXEC_SECONDS]
        killed = kill_at(broker, args, mark, sandbox_id=sandbox_id, initial_record=record)
        assert killed.hit, f"exec ended (status {killed.status}) before step {step}: {killed.stderr}"
        print(f"exec killed at {step}: {killed.left}")
        receipt = gc_clean(broker, sandbox_id)
        assert sandbox_id in receipt["healthy"], receipt  # a killed exec does not kill its sandbox
        after = broker.exec(sandbox_id, "/bin/sh", "-c", "echo usable")
        assert (after.status, after.stdout) == (0, "usable\n"), after
        teardown_clean(broker, sandbox_id)
        assert_nothing_left(broker, sandbox_id, homes)
        assert host_processes(lambda cmdline, _env: cmdline == EXEC_COMMAND) == []
        if broker.backend == "docker":  # the Engine could remove the container's cgroup: nothing below it
            assert container_cgroups(str(record["container_id"])) == []
    finally:
        _cleanup(broker)


# ----------------------------------------------------------------------------------- teardown


def holder_gone(scene: Scene) -> bool:
    """The holder (Docker: the container's pid 1, seen on the host) no longer runs."""
    record = scene.initial_record
    pid = record.get("docker_pid") or record.get("holder_pid")
    return isinstance(pid, int) and not os.path.exists(f"/proc/{pid}")


TEARDOWN_MARKS: dict[str, Mark] = {
    "marked-tearing-down": lambda s: s.record().get("state") == "tearing-down",
    "processes-stopped": holder_gone,
    "cgroups-removed": lambda s: s.exists("lock") and not s.cgroup(),
    "workspace-unmounted": lambda s: s.exists("workspace.img") and not s.mounted("workspace"),
}
TEARDOWN_STEPS = {
    "bwrap-root": [
        "marked-tearing-down",
        "processes-stopped",
        "cgroups-removed",
        "workspace-unmounted",
    ],
    # An unprivileged broker's workspace is a tmpfs that ends with the sandbox's namespaces.
    "bwrap-user": ["marked-tearing-down", "processes-stopped"],
    "docker": ["marked-tearing-down", "processes-stopped", "workspace-unmounted"],
}
TEARDOWN_CASES = [pytest.param(v, step, id=f"{v}-{step}") for v, steps in TEARDOWN_STEPS.items() for step in steps]

# Many files in the workspace, so that removing it (root: unmounting its filesystem) has work to do.
MANY_FILES = (
    "import os\nos.mkdir('/workspace/many')\nfor i in range(20001):\n    open(f'/workspace/many/f{i:05d}', 'w').close()"
)


@pytest.mark.parametrize(("which", "step"), TEARDOWN_CASES)
def test_teardown_killed_then_gc_leaves_nothing(
    request: pytest.FixtureRequest, runtime_dir: Path, which: str, step: str
) -> None:
    broker = in_process(start_broker(request, runtime_dir, which))
    homes = git_homes()
    try:
        sandbox_id = broker.create()
        planted = broker.exec(sandbox_id, "/usr/bin/python3", "-c", MANY_FILES)
        assert planted.status == 0, planted.stderr
        record = json.loads((broker.sandbox_dir(sandbox_id) / "record.json").read_text())
        if broker.backend == "docker":
            record["docker_pid"] = docker_pid(str(record["container_id"]))
        args = ["teardown", "--discard", sandbox_id]  # what it planted is nobody's work
        killed = kill_at(broker, args, TEARDOWN_MARKS[step], sandbox_id=sandbox_id, initial_record=record)
        assert killed.hit, f"teardown ended (status {killed.status}) before step {step}: {killed.stderr}"
        print(f"teardown killed at {step}: {killed.left}")
        gc_clean(broker, sandbox_id)
        assert_nothing_left(broker, sandbox_id, homes)
    finally:
        _cleanup(broker)


def docker_pid(container_id: str) -> int:
    done = subprocess.run(
        ["docker", "inspect", "--format", "{{.State.Pid}}", container_id],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return int(done.stdout.strip())


# ------------------------------------------------------------------------------ dispatch-tool

DISPATCH_STEPS = ["waiting-for-the-request", "request-claimed", "endpoint-has-the-request"]


@pytest.mark.parametrize("step", DISPATCH_STEPS)
def test_dispatch_killed_then_gc_and_teardown_leave_nothing(
    sbx_root: SandboxBroker, base: Path, endpoints: Endpoints, step: str
) -> None:
    broker = sbx_root
    homes = git_homes()
    _, sandbox_id = setup(broker, base, endpoints, mode="slow")
    request_id = f"killed-{step}"
    if step != "waiting-for-the-request":
        spool(broker, sandbox_id, request_id, envelope(request_id))
    ledger = broker.sandbox_dir(sandbox_id) / "ledger"
    marks: dict[str, Mark] = {
        "waiting-for-the-request": lambda _s: bool(list(ledger.rglob(f"{request_id}.lock"))),
        "request-claimed": lambda _s: bool(list(ledger.rglob(f"{request_id}.json"))),
        "endpoint-has-the-request": lambda _s: bool(log_lines(endpoints.log)),
    }
    args = ["dispatch-tool", sandbox_id, "--lease", LEASE, "--request-id", request_id, "--wait-seconds", "30"]
    killed = kill_at(broker, args, marks[step], sandbox_id=sandbox_id)
    assert killed.hit, f"dispatch-tool ended (status {killed.status}) before step {step}: {killed.stderr}"
    print(f"dispatch-tool killed at {step}: {killed.left}")
    receipt = gc_clean(broker, sandbox_id)
    assert sandbox_id in receipt["healthy"], receipt
    after = broker.exec(sandbox_id, "/bin/sh", "-c", "echo usable")
    assert (after.status, after.stdout) == (0, "usable\n"), after
    endpoints.stop()
    teardown_clean(broker, sandbox_id)
    assert_nothing_left(broker, sandbox_id, homes)
