"""Teardown and gc that a sandbox cannot break from inside, and host work that dies with its broker.

Each test replays one of an attacker's probes through the real CLI, on bwrap as root and as an
unprivileged user (fixture `sb`): a workspace of thousands of nested, unsearchable directories and
symlinks to the host; a create SIGKILLed while its host-side `git clone` runs; one sandbox gc
cannot destroy among others it can; a clone that names the owner's repository.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from sandboxer.host import hostgit
from tests.integration.conftest import UNPRIVILEGED_UID, SandboxBroker, profile_text
from tests.integration.test_bwrap_lifecycle import cgroups_of, processes_naming

# Runs inside the sandbox: a chain of 3,000 directories (by relative chdir, past PATH_MAX), a
# symlink to a host directory at its bottom and beside it, and directories without any bits.
PLANT = r"""
import os, sys
host = sys.argv[1]
os.chdir("/workspace")
os.symlink(host, "to-host")
os.mkdir("locked")
os.mkdir("locked/inner")
open("locked/inner/file", "w").close()
os.symlink(host, "locked/to-host")
os.chmod("locked/inner", 0)
os.chmod("locked", 0)
os.mkdir("read-only")
open("read-only/file", "w").close()
os.chmod("read-only", 0o500)
for _ in range(3000):
    os.mkdir("d")
    os.chdir("d")
os.symlink(host, "to-host")
os.symlink(host + "/file", "to-host-file")
os.mkdir("shut")
os.chmod("shut", 0)
os.chdir("/workspace")
os.chmod("d", 0o100)
print("planted")
"""


@pytest.fixture
def host_dir(sb: SandboxBroker) -> Path:
    """A host directory the broker could delete if it ever followed a link (the broker's own)."""
    host = sb.root / "host-canary"
    host.mkdir()
    (host / "file").write_text("keep\n")
    if sb.as_user:
        for path in (host, host / "file"):
            os.chown(path, UNPRIVILEGED_UID, UNPRIVILEGED_UID)
    return host


def _plant(sb: SandboxBroker, sandbox_id: str, host: Path) -> None:
    planted = sb.exec(sandbox_id, "python3", "-c", PLANT, str(host))
    assert planted.status == 0, planted.stderr
    assert planted.stdout == "planted\n"


def _record(sb: SandboxBroker, sandbox_id: str) -> dict[str, object]:
    record: dict[str, object] = json.loads((sb.sandbox_dir(sandbox_id) / "record.json").read_text())
    return record


def test_teardown_and_gc_remove_a_workspace_made_deep_unsearchable_and_linked_to_the_host(
    sb: SandboxBroker, host_dir: Path
) -> None:
    torn, collected = sb.create(), sb.create()
    for sandbox_id in (torn, collected):
        _plant(sb, sandbox_id, host_dir)

    receipt = sb.run("teardown", "--discard", torn, "--json")
    assert receipt.status == 0, receipt.stderr
    assert receipt.json()["residue"] == []
    assert not sb.sandbox_dir(torn).exists()

    # The other one dies on its own; gc must still be able to remove the same hostile tree.
    record = _record(sb, collected)
    init_pid = record["init_pid"]
    assert isinstance(init_pid, int)
    os.kill(init_pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while psutil.pid_exists(init_pid) and psutil.Process(init_pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the sandbox's init did not die"
        time.sleep(0.01)
    result = sb.run("gc", "--json")
    assert result.status == 0, result.stderr
    document = result.json()
    assert [(r["id"], r["residue"]) for r in document["collected"]] == [(collected, [])]
    assert not sb.sandbox_dir(collected).exists()

    assert (host_dir / "file").read_text() == "keep\n"
    assert sorted(p.name for p in host_dir.iterdir()) == ["file"]
    later = sb.run("gc", "--json")
    assert later.status == 0, later.stderr
    assert later.json()["collected"] == []


def test_gc_collects_every_sandbox_it_can_when_one_fails(sb: SandboxBroker) -> None:
    """The probe: one sandbox whose teardown raised ended every gc before it collected anything.
    Here one dead sandbox's record makes its destroy raise; the next one is still collected, the
    healthy one spared, and the failure is that sandbox's residue (exit 6)."""
    healthy = sb.create()
    broken, dead = "0" * 24, "f" * 24  # gc walks ids in order: the broken one comes first
    # A record of the right shape whose destroy raises (a cgroup path of the broker's naming for
    # the sandbox that no system call takes). One out of shape is refused as a whole and its
    # sandbox destroyed by its id: the dead one's.
    groups = [f"/sys/fs/cgroup/pids\0/sandboxer/{broken}"]
    limits = {"mechanism": "cgroup-v1", "groups": groups, "procs_files": [], "rlimits": [], "memory_mib": 1, "pids": 1}
    identity = {"format": 1, "profile": "p", "created_at": "2026-11-30T00:00:00Z", "backend": "bwrap"}
    for sandbox_id, record in (
        (broken, {**identity, "id": broken, "state": "creating", "limits": limits}),
        (dead, {"format": 1, "id": dead, "state": "creating", "backend": "bwrap", "limits": {"groups": 7}}),
    ):
        directory = sb.sandbox_dir(sandbox_id)
        (directory / "workspace").mkdir(parents=True)
        (directory / "lock").touch()
        (directory / "record.json").write_text(json.dumps(record))
        if sb.as_user:
            for path in (directory, directory / "workspace", directory / "lock", directory / "record.json"):
                os.chown(path, UNPRIVILEGED_UID, UNPRIVILEGED_UID)

    result = sb.run("gc", "--json")
    assert result.status == 6, result
    document = result.json()
    receipts = {r["id"]: r for r in document["collected"]}
    assert sorted(receipts) == [broken, dead]
    assert receipts[dead]["residue"] == []
    assert not sb.sandbox_dir(dead).exists()
    assert len(receipts[broken]["residue"]) == 1
    assert receipts[broken]["residue"][0].startswith("gc failed ("), receipts[broken]
    assert sb.sandbox_dir(broken).exists()
    assert document["healthy"] == [healthy]
    assert sb.exec(healthy, "true").status == 0


# --- a create killed while its host-side git clone runs --------------------------------------------


@pytest.fixture(scope="session")
def big_repository() -> Iterator[Path]:
    """A repository of 30,000 random blobs (about 60 MiB): its clone takes seconds, long enough
    to kill the create in the middle of it. Bare (nothing to check out here), readable by every uid."""
    root = Path(tempfile.mkdtemp(prefix="sbx-big-", dir="/tmp"))
    root.chmod(0o755)
    repo = root / "repo.git"
    subprocess.run(["git", "-c", "init.defaultBranch=main", "init", "-q", "--bare", str(repo)], check=True)
    importer = subprocess.Popen(["git", "-C", str(repo), "fast-import", "--quiet"], stdin=subprocess.PIPE)
    assert importer.stdin is not None
    count = 30_000
    for mark in range(1, count + 1):
        data = os.urandom(2048)
        importer.stdin.write(b"blob\nmark :%d\ndata %d\n%s\n" % (mark, len(data), data))
    importer.stdin.write(b"commit refs/heads/main\ncommitter t <t@localhost> 0 +0000\ndata 4\nbig\n")
    for mark in range(1, count + 1):
        importer.stdin.write(b"M 100644 :%d d%02d/f%d\n" % (mark, mark % 97, mark))
    importer.stdin.close()
    assert importer.wait() == 0
    try:
        yield repo
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _git_helpers_of(pid: int) -> dict[psutil.Process, str]:
    """The git processes below the broker `pid`, with their command lines."""
    try:
        below = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return {}
    found: dict[psutil.Process, str] = {}
    for proc in below:
        try:
            command = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if "git" in command:
            found[proc] = command
    return found


def _running(procs: list[psutil.Process]) -> list[str]:
    alive = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{proc.pid} {' '.join(proc.cmdline())}")
        except psutil.NoSuchProcess:
            continue
    return alive


def test_gc_after_a_create_killed_mid_clone_leaves_no_git_no_directory_and_nothing_in_tmp(
    sb: SandboxBroker, big_repository: Path
) -> None:
    sb.through_service = False  # the CLI process is the broker this test kills
    sb.write_profile("big", profile_text("big", big_repository))
    approved = sb.run("ext", "approve", "big")
    assert approved.status == 0, approved.stderr
    homes_before = set(glob.glob("/tmp/sandboxer-git-home-*"))
    registry = sb.state / "sandboxes"

    create = subprocess.Popen(
        sb.argv("create", "--profile", "big"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=sb.env()
    )
    helpers: dict[psutil.Process, str] = {}
    deadline = time.monotonic() + 60
    # Kill once git's index-pack writes the pack into the clone: the window an orphan would race gc.
    while create.poll() is None and time.monotonic() < deadline:
        helpers = _git_helpers_of(create.pid)
        if any("index-pack" in command for command in helpers.values()):
            break
        time.sleep(0.005)
    create.kill()
    create.communicate(timeout=30)
    assert create.returncode == -signal.SIGKILL, "the create finished before the kill; the test proves nothing"
    assert helpers, "no git ran when the create was killed"
    (sandbox_id,) = [name for name in os.listdir(registry) if not name.startswith(".")]
    assert (sb.sandbox_dir(sandbox_id) / "git-home").is_dir(), "git's HOME is the sandbox's, not /tmp"

    result = sb.run("gc", "--json")
    assert result.status == 0, result
    assert [(r["id"], r["residue"]) for r in result.json()["collected"]] == [(sandbox_id, [])]
    assert not sb.sandbox_dir(sandbox_id).exists()
    assert _running(list(helpers)) == []
    assert processes_naming([sandbox_id, str(big_repository)]) == []
    assert cgroups_of(sandbox_id) == []
    assert set(glob.glob("/tmp/sandboxer-git-home-*")) == homes_before


def test_the_clone_names_no_host_path(sb: SandboxBroker) -> None:
    """The probe: `git remote -v` in /workspace printed the owner's repository path."""
    sandbox_id = sb.create()
    remotes = sb.sh(sandbox_id, "cd /workspace && git remote -v && git status --porcelain && git log --oneline")
    assert remotes.status == 0, remotes.stderr
    (only_line,) = remotes.stdout.splitlines()  # no remote, a clean tree, the one commit
    assert only_line.endswith(" init"), remotes.stdout
    search = sb.exec(sandbox_id, "grep", "-rlF", str(sb.repo), "/workspace")
    assert search.status == 1, search  # grep: 1 = no line anywhere names the repository
    assert str(sb.repo) not in search.stdout
    assert not (sb.sandbox_dir(sandbox_id) / "git-home").exists()


def test_stop_git_kills_what_ran_with_that_git_home_and_nothing_else(tmp_path: Path) -> None:
    """What gc relies on when the broker died mid-clone: a helper git left behind (here a
    stand-in that detached into a session of its own) is found by its environment and killed;
    a process of another sandbox's clone is not touched."""
    ours, other = tmp_path / "a" / "git-home", tmp_path / "b" / "git-home"
    started = []
    for home in (ours, other):
        home.mkdir(parents=True)
        env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "GIT_CONFIG_GLOBAL": str(home / "gitconfig")}
        started.append(subprocess.Popen(["sleep", "300"], env=env, start_new_session=True, stdin=subprocess.DEVNULL))
    # Popen returns once exec has begun; the kernel lays out the new environment after that (an
    # empty /proc/PID/environ meanwhile). A helper gc looks for has long been running.
    deadline = time.monotonic() + 10
    while not all(b"GIT_CONFIG_GLOBAL=" in Path(f"/proc/{proc.pid}/environ").read_bytes() for proc in started):
        assert time.monotonic() < deadline, "the stand-ins never showed their environment"
        time.sleep(0.01)
    try:
        assert hostgit.stop_git(str(ours)) == []
        assert started[0].wait(timeout=10) == -signal.SIGKILL
        assert started[1].poll() is None
        assert hostgit.stop_git(str(tmp_path / "c" / "git-home")) == []  # no such directory: nothing to do
    finally:
        for proc in started:
            proc.kill()
            proc.wait()
