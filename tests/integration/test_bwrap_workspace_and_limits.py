"""The workspace clone is made safely on the host, and the profile's limits hold inside: on bwrap (as
root and, where the fixture allows, as a user) and on Docker alike."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import settled
from tests.integration.conftest import (
    SandboxBroker,
    _bwrap_broker,
    _ready,
    _serve,
    add_docker,
    backend_profile_text,
    make_broker,
)
from tests.integration.test_bwrap_isolation import live_processes


def test_clone_shares_no_inode_with_the_owners_repository(sbx_root: SandboxBroker) -> None:
    sb = sbx_root
    sandbox_id = sb.create()
    clone = sb.workspace_dir(sandbox_id)
    owner_inodes = {p.stat().st_ino for p in (sb.repo / ".git" / "objects").rglob("*") if p.is_file()}
    clone_objects = [p for p in (clone / ".git" / "objects").rglob("*") if p.is_file()]
    assert clone_objects, "the clone has objects"
    assert all(p.stat().st_nlink == 1 for p in clone_objects)
    assert not owner_inodes & {p.stat().st_ino for p in clone_objects}


def test_owner_hooks_templates_and_global_config_never_run_on_the_host(sbx_root: SandboxBroker, tmp_path: Path) -> None:
    sb = sbx_root
    marker = tmp_path / "hook-ran"
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    for name in ("post-checkout", "post-merge", "reference-transaction"):
        hook = hooks / name
        hook.write_text(f"#!/bin/sh\ntouch {marker}\n")
        hook.chmod(0o755)
    (sb.repo / ".git" / "hooks").mkdir(exist_ok=True)
    for hook in hooks.iterdir():
        (sb.repo / ".git" / "hooks" / hook.name).write_bytes(hook.read_bytes())
        (sb.repo / ".git" / "hooks" / hook.name).chmod(0o755)
    home = sb.root / "home"
    (home / ".gitconfig").write_text(f"[core]\n\thooksPath = {hooks}\n[init]\n\ttemplateDir = {tmp_path}\n")
    (tmp_path / "hooks").chmod(0o755)
    # The same hooks do run for a plain git clone with this HOME: the test can see them fire.
    probe = tmp_path / "probe-clone"
    subprocess.run(["git", "clone", "-q", str(sb.repo), str(probe)], env={**sb.env(), "HOME": str(home)}, check=True)
    assert marker.exists()
    marker.unlink()
    sandbox_id = sb.create()
    assert not marker.exists()
    assert not list((sb.workspace_dir(sandbox_id) / ".git" / "hooks").glob("*"))


def limited(sb: SandboxBroker, name: str, limits: str) -> str:
    sb.write_profile(name, backend_profile_text(sb, name, sb.repo, f"limits:\n{limits}"))
    approved = sb.run("ext", "approve", name)
    assert approved.status == 0, approved.stderr
    return sb.create(name)


def _mechanism(broker: SandboxBroker, sandbox_id: str) -> str:
    inspected = broker.run("inspect", sandbox_id, "--json")
    assert inspected.status == 0, inspected.stderr
    return str(inspected.json()["limits"]["mechanism"])


# 60 processes at once, counted as they start (the shell exits 2 on the first fork refused).
FLOOD = "n=0; for i in $(seq 60); do sleep 3 & n=$((n+1)); done 2>/dev/null; wait; echo $n"


def test_pids_limit_stops_a_fork_flood(sbx: SandboxBroker) -> None:
    """The sandbox's pids limit refuses a fork flood, and the broker says so — also for an exec
    with --timeout, which runs in a pids group of its own below the sandbox's (the kernel counts
    the refusals there, and the group is gone when the exec ends)."""
    sb = sbx
    sandbox_id = limited(sb, "few-pids", "  pids: 24\n")
    # Asked before the floods: right after one, the flood's sleeps still fill the limit for a
    # moment, and inspect's probe in the sandbox cannot start either.
    mechanism = _mechanism(sb, sandbox_id)
    for options in ((), ("--timeout", "60")):
        flood = sb.exec(sandbox_id, "/bin/sh", "-c", FLOOD, options=options)
        assert flood.status != 0, flood  # the shell could not fork all 60 (it exits 2 on a failed fork)
        assert flood.stdout.strip() != "60"
        if mechanism != "rlimit":  # a cgroup's pids.max refused, and the broker says so
            assert flood.stderr.endswith("sandboxer: exec: the pids limit (24) refused a new process\n"), flood
    # With room to spare the same kind of work succeeds.
    roomy = limited(sb, "more-pids", "  pids: 512\n")
    fine = sb.sh(roomy, "for i in $(seq 30); do sleep 0.2 & done; wait; echo done")
    assert fine.status == 0, fine.stderr
    assert fine.stdout.strip() == "done"


def test_pids_limit_counts_the_sandboxs_processes_not_its_accounts(sbx: SandboxBroker) -> None:
    """The broker's account runs more processes outside the sandbox than the sandbox's pids limit
    allows: the sandbox still starts and forks within its limit. (Under rlimits the kernel
    counts an account's processes host-wide against a limit in force when a user namespace is
    made: bwrap must make it without RLIMIT_NPROC, which the sandbox's processes take after.)"""
    sb = sbx
    seconds = "47.613"  # a duration no other process on the host sleeps for
    outside = [
        subprocess.Popen(sb.python("-c", f"import time; time.sleep({seconds})"), stdin=subprocess.DEVNULL)
        for _ in range(30)
    ]
    try:
        sandbox_id = limited(sb, "few-pids-busy-account", "  pids: 24\n")
        forked = sb.sh(sandbox_id, "for i in $(seq 10); do sleep 0.2 & done; wait; echo done")
        assert forked.status == 0, forked.stderr
        assert forked.stdout.strip() == "done"
        flood = sb.sh(sandbox_id, FLOOD)
        assert flood.status != 0, flood  # the limit still holds inside
        assert flood.stdout.strip() != "60"
        if _mechanism(sb, sandbox_id) == "rlimit":  # and bwrap, its init and the holder carry it
            record = json.loads((sb.sandbox_dir(sandbox_id) / "record.json").read_text())
            for key in ("bwrap_pid", "init_pid", "holder_pid"):
                limits = Path(f"/proc/{record[key]}/limits").read_text()
                line = next(line for line in limits.splitlines() if line.startswith("Max processes"))
                assert line.split()[2:4] == ["24", "24"], (key, line)
    finally:
        for process in outside:
            process.kill()
            process.wait()


# Forks until the pids limit refuses one, says how many it made, and keeps them all until the
# test makes /workspace/.release; its children end with it (their pipe's end of file).
FILLER = """
import os, time
r, w = os.pipe()
n = 0
while True:
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    n += 1
print(n, flush=True)
while not os.path.exists("/workspace/.release"):
    time.sleep(0.05)
"""


@pytest.fixture(params=["root", "root-service", "docker-service"])
def sb_cgroups(request: pytest.FixtureRequest, runtime_dir: Path) -> Iterator[SandboxBroker]:
    """A root broker, whose limits are cgroups: bwrap with its CLI in-process (each exec forks its
    relay) and a client of a root service (whose spawner forks each command straight into the
    sandbox), and Docker through a root service."""
    if request.param == "docker-service":
        broker = make_broker(runtime_dir, as_user=False)
        add_docker(broker, request.getfixturevalue("base_image"))
    else:
        broker = _bwrap_broker(runtime_dir, as_user=False)
    if request.param != "root":
        _serve(broker)
    with _ready(broker):
        yield broker


def _pids_group(sb: SandboxBroker, record: dict[str, Any]) -> Path:
    """The sandbox's pids cgroup: the one its record names (bwrap), or its container's (Docker's
    cgroupfs or systemd driver)."""
    if sb.backend == "bwrap":
        return next(Path(g) for g in record["limits"]["groups"] if (Path(g) / "pids.max").exists())
    container = record["container_id"]
    places = (f"docker/{container}", f"system.slice/docker-{container}.scope")
    found = [Path(root, place) for root in ("/sys/fs/cgroup/pids", "/sys/fs/cgroup") for place in places]
    return next(p for p in found if (p / "pids.max").exists())


def test_a_full_sandbox_admits_no_exec_past_its_pids_limit(sb_cgroups: SandboxBroker) -> None:
    """Once a sandbox's processes fill its pids limit, an exec cannot start there, and says why;
    nor can bwrap's inspect probe. The kernel refuses a fork at pids.max but lets a process be
    moved in past it, as an exec's entry is (bwrap's, and runc's for docker exec): without the
    broker's own check each exec would be one process past the limit."""
    sb = sb_cgroups
    sandbox_id = limited(sb, "full-pids", "  pids: 24\n")
    if _mechanism(sb, sandbox_id) == "rlimit":
        pytest.skip("this host has no pids cgroup for the root broker (the rlimit mechanism counts forks only)")
    record = json.loads((sb.sandbox_dir(sandbox_id) / "record.json").read_text())
    group = _pids_group(sb, record)
    filler = subprocess.Popen(
        sb.argv("exec", sandbox_id, "--", "python3", "-c", FILLER),
        env=sb.env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert filler.stdout is not None
        assert int(filler.stdout.readline()) > 0
        assert (group / "pids.current").read_text().strip() == "24"
        results = []

        def attempt(options: tuple[str, ...]) -> None:
            results.append(sb.exec(sandbox_id, "sleep", "20", options=options))

        attempts = [threading.Thread(target=attempt, args=(o,)) for o in ((), (), ("--timeout", "60"))]
        for thread in attempts:
            thread.start()
        for thread in attempts:
            thread.join()
        full = "the sandbox is at its pids limit (24): no new process can start in it until one of its processes ends"
        assert [r.status for r in results] == [125, 125, 125], results
        assert all(r.stderr == f"sandboxer: exec: {full}\n" for r in results), results
        # None of them stayed (a refused one is reaped a moment after it reported).
        assert settled(lambda: (group / "pids.current").read_text().strip(), "24") == "24"
        if sb.backend == "bwrap":  # its probe enters as an exec does (Docker's: docker exec of cat)
            inspected = sb.run("inspect", sandbox_id, "--json")
            assert inspected.status == 5, inspected
            assert inspected.stderr == f"sandboxer: probe: {full}\n", inspected
    finally:
        (sb.workspace_dir(sandbox_id) / ".release").touch()
        try:
            _, err = filler.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            filler.kill()
            _, err = filler.communicate()
    assert filler.returncode == 0, err
    fine = sb.exec(sandbox_id, "true")  # room again once its processes ended
    assert fine.status == 0, fine.stderr


def test_memory_limit_stops_a_large_allocation(sbx: SandboxBroker) -> None:
    sb = sbx
    grab = "import sys; b = bytearray(int(sys.argv[1]) * 2**20); b[::4096] = b'x' * len(b[::4096]); print('ok')"
    small = limited(sb, "small-memory", "  memory_mib: 128\n")
    refused = sb.exec(small, "python3", "-c", grab, "400")
    assert refused.status != 0
    assert "ok" not in refused.stdout
    if _mechanism(sb, small) != "rlimit":  # a cgroup's limit kills, and the broker says so
        assert refused.status == 137, refused
        assert refused.stderr.endswith("sandboxer: exec: killed by the memory limit (128 MiB)\n"), refused.stderr
    fits = sb.exec(small, "python3", "-c", grab, "16")
    assert fits.status == 0, fits.stderr
    assert fits.stdout.strip() == "ok"


def test_inspect_reports_the_limit_mechanism_in_force(sbx: SandboxBroker) -> None:
    sb = sbx
    sandbox_id = limited(sb, "inspected", "  memory_mib: 256\n  pids: 64\n")
    inspected = sb.run("inspect", sandbox_id, "--json")
    assert inspected.status == 0, inspected.stderr
    limits = inspected.json()["limits"]
    assert (limits["memory_mib"], limits["pids"]) == (256, 64)
    if sb.backend == "docker":
        assert limits["mechanism"] == "docker"  # the Engine's pids and memory limits
    elif os.geteuid() == 0 and not sb.as_user:
        assert limits["mechanism"] == "cgroup-v1" if Path("/sys/fs/cgroup/memory").is_dir() else "cgroup-v2"
        assert any(sandbox_id in line for line in limits["cgroups"])
    else:
        assert limits["mechanism"] in ("cgroup-v2", "rlimit")


def test_executable_option_runs_that_program_with_the_given_argv(sbx: SandboxBroker) -> None:
    sb = sbx
    sandbox_id = sb.create()
    result = sb.exec(sandbox_id, "custom-name", "-c", 'echo "$0"', options=("--executable", "/bin/sh"))
    assert result.status == 0, result.stderr
    assert result.stdout.strip() == "custom-name"


def test_timeout_also_kills_a_process_that_left_the_session(sbx_root: SandboxBroker) -> None:
    """A process that made its own session and was re-parented is still the exec's: with
    --timeout each exec runs in a cgroup of its own (bwrap: below the sandbox's; Docker: below
    the container's), and all of it is killed."""
    sb = sbx_root
    sandbox_id = sb.create()
    seconds = "58.771"  # a duration no other process on the host sleeps for
    script = f'setsid sh -c "sleep {seconds}" & sleep {seconds}'
    result = sb.exec(sandbox_id, "/bin/sh", "-c", script, options=("--timeout", "1"))
    assert result.status == 124, result.stderr
    survivors = live_processes(lambda argv: argv == ["sleep", seconds])
    assert survivors == [], [(p.pid, p.info) for p in survivors]
    after = sb.exec(sandbox_id, "/bin/sh", "-c", "echo usable")
    assert (after.status, after.stdout) == (0, "usable\n")


COMMIT = (
    "cd /workspace && echo work > agent.txt && git add agent.txt && git commit -q -m 'agent work' "
    "&& git log -1 --format='%an <%ae>' && git remote && git status --porcelain"
)


def test_git_commit_works_in_a_fresh_sandbox_with_the_profiles_identity(sbx: SandboxBroker) -> None:
    """A neutral identity by default, the profile's workspace.git.user when it names one; the
    clone has no remote (no host path to name)."""
    default = sbx.sh(sbx.create(), COMMIT)
    assert (default.status, default.stdout) == (0, "Sandbox <sandbox@localhost>\n"), default.stderr
    text = backend_profile_text(sbx, "agent", sbx.repo).replace(
        "  ref: main\n", "  ref: main\n  git:\n    user:\n      name: Agent Smith\n      email: agent@example.test\n"
    )
    sbx.write_profile("agent", text)
    assert sbx.run("ext", "approve", "agent").status == 0
    for _ in range(2):  # the second create reads the profile from the parse cache
        named = sbx.sh(sbx.create("agent"), COMMIT)
        assert (named.status, named.stdout) == (0, "Agent Smith <agent@example.test>\n"), named.stderr
