"""Warm namespaces (ext.bwrap `config.warm`): started and verified ahead, invisible to callers,
taken by a create only while they still match its plan — real bwrap, as root (each command in
the CLI's own process, fills in detached processes) and as an unprivileged user (through its
private service, which fills on a thread of its own)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.integration.conftest import MODES, PROFILE, SandboxBroker, _bwrap_broker, _cleanup, profile_text
from tests.integration.warm_pool import records, sandbox_dirs, set_warm, wait_for_fills, wait_warm, warm_ids
from tests.samples import CONTRACT_ENV_NAMES

EXT = "ext.bwrap"


@contextlib.contextmanager
def _warm_broker(runtime_dir: Path, *, as_user: bool) -> Iterator[SandboxBroker]:
    """A bwrap broker whose extension keeps one warm namespace per profile, filled."""
    broker = _bwrap_broker(runtime_dir, as_user=as_user)
    set_warm(broker, EXT, 1)
    try:
        filled = broker.run("warm", PROFILE, "--json")
        assert filled.status == 0, filled.stderr
        yield broker
    finally:
        wait_for_fills(broker)
        set_warm(broker, EXT, 0)
        broker.run("warm", PROFILE)  # with no warm count: removes the profile's warm sandboxes
        left_warm = warm_ids(broker)
        _cleanup(broker)
        wait_for_fills(broker)  # teardowns of taken sandboxes start fills; none may outlive the test
    assert left_warm == []


@pytest.fixture(params=MODES)
def warm(request: pytest.FixtureRequest, runtime_dir: Path) -> Iterator[SandboxBroker]:
    with _warm_broker(runtime_dir, as_user=request.param == "user") as broker:
        yield broker


@pytest.fixture
def warm_as_root(runtime_dir: Path) -> Iterator[SandboxBroker]:
    with _warm_broker(runtime_dir, as_user=False) as broker:
        yield broker


def _holder(broker: SandboxBroker, sandbox_id: str) -> int:
    return int(records(broker)[sandbox_id]["holder_pid"])


def test_warm_fills_the_pool_and_callers_never_see_a_warm_namespace(warm: SandboxBroker) -> None:
    (warm_id,) = warm_ids(warm)
    again = warm.run("warm", PROFILE, "--json")
    assert again.status == 0, again.stderr
    assert again.json() == {"profile": PROFILE, "warm": 1, "started": [], "removed": [], "busy": False}
    record = records(warm)[warm_id]
    assert record["state"] == "warm"
    # Cloned ahead from the profile's ref, as a create clones it.
    assert sorted(os.listdir(warm.workspace_dir(warm_id))) == [".git", "README.md"]
    assert record["work"]["ref"] == "main"
    assert warm.run("list", "--json").json() == {"sandboxes": []}
    for command in ("inspect", "teardown"):
        refused = warm.run(command, warm_id, "--json")
        assert refused.status == 4, refused.stderr
        assert refused.json()["error"]["message"] == f"no such sandbox: {warm_id}"
    ran = warm.exec(warm_id, "true")
    assert ran.status == 125
    assert ran.stderr == f"sandboxer: exec: no such sandbox: {warm_id}\n"
    assert warm_ids(warm) == [warm_id]  # none of those touched it


def test_a_create_takes_the_warm_namespace_as_a_cold_create_would_make_it(warm: SandboxBroker) -> None:
    (warm_id,) = warm_ids(warm)
    taken = warm.create()
    assert taken == warm_id
    assert warm_ids(warm) == []  # the pool is refilled at teardown, not while the caller works
    record = records(warm)[taken]
    assert record["state"] == "ready"
    assert record["warm_profile"] is True
    cold = warm.create()  # none left warm: started for this create
    assert cold != taken
    assert "warm" not in records(warm)[cold]
    warm_view = warm.run("inspect", taken, "--json").json()
    cold_view = warm.run("inspect", cold, "--json").json()
    assert warm_view["matches_plan"] is True
    assert warm_view["differences"] == []
    for key in ("user", "env_names", "capabilities", "network", "seccomp"):
        assert warm_view[key] == cold_view[key], key
    del warm_view["runtime"]["digest_ms"], cold_view["runtime"]["digest_ms"]  # timings
    del warm_view["limits"]["cgroups"], cold_view["limits"]["cgroups"]  # named by sandbox id
    assert warm_view["runtime"] == cold_view["runtime"]
    assert warm_view["limits"] == cold_view["limits"]
    assert sorted((m["target"], m["read_only"]) for m in warm_view["mounts"]) == sorted(
        (m["target"], m["read_only"]) for m in cold_view["mounts"]
    )
    assert sorted(warm_view["env_names"]) == sorted(CONTRACT_ENV_NAMES)
    script = "id -u; stat -c '%u %a' /workspace; git -C /workspace status --porcelain; ls /workspace"
    inside = warm.sh(taken, script)
    assert inside.status == 0, inside.stderr
    assert inside.stdout == warm.sh(cold, script).stdout
    assert inside.stdout.splitlines() == ["1000", "1000 700", "README.md"]
    assert records(warm)[taken]["work"] == records(warm)[cold]["work"]  # the same commit, from the same ref
    torn = warm.run("teardown", taken, "--json")
    assert torn.status == 0, torn.stderr
    assert torn.json()["residue"] == []
    (replacement,) = wait_warm(warm, 1)
    assert replacement not in (taken, cold)


def test_a_warm_namespace_someone_started_a_process_in_is_never_handed_out(warm_as_root: SandboxBroker) -> None:
    warm = warm_as_root  # only root can enter a namespace behind the broker's back
    (warm_id,) = warm_ids(warm)
    intruder = subprocess.Popen(
        ["nsenter", "--target", str(_holder(warm, warm_id)), "--pid", "--", "/usr/bin/sleep", "30"]
    )
    try:
        taken = warm.create()
        assert taken != warm_id  # a cold create instead
        assert warm_id not in records(warm)
        assert warm.run("inspect", taken, "--json").json()["matches_plan"] is True
        # It ended with the warm sandbox (nsenter passes on the signal its child died of).
        assert intruder.wait(timeout=10) in (-signal.SIGTERM, -signal.SIGKILL)
    finally:
        intruder.kill()
        intruder.wait()


def test_a_warm_namespace_whose_holder_died_is_passed_over(warm: SandboxBroker) -> None:
    (warm_id,) = warm_ids(warm)
    os.kill(_holder(warm, warm_id), signal.SIGKILL)
    taken = warm.create()
    assert taken != warm_id
    assert warm_id not in {d.name for d in sandbox_dirs(warm)}  # its directory went with it
    assert warm.exec(taken, "true").status == 0


def test_a_changed_profile_makes_warm_namespaces_stale(warm: SandboxBroker) -> None:
    (warm_id,) = warm_ids(warm)
    warm.write_profile(PROFILE, profile_text(PROFILE, warm.repo, "limits:\n  pids: 99\n"))
    warm.approve(PROFILE)
    taken = warm.create()
    assert taken != warm_id
    assert warm_id not in records(warm)
    assert warm.run("inspect", taken, "--json").json()["limits"]["pids"] == 99


def test_a_warm_namespace_cloned_before_the_repository_moved_is_never_handed_out(warm: SandboxBroker) -> None:
    (warm_id,) = warm_ids(warm)
    before = records(warm)[warm_id]["work"]["base"]
    (warm.repo / "NEW.md").write_text("new\n")
    git = ["git", "-C", str(warm.repo), "-c", "user.name=t", "-c", "user.email=t@localhost"]
    subprocess.run([*git, "add", "NEW.md"], check=True)
    subprocess.run([*git, "commit", "-qm", "moved"], check=True)
    taken = warm.create()
    assert taken != warm_id
    assert warm_id not in records(warm)
    assert records(warm)[taken]["work"]["base"] != before
    listed = warm.sh(taken, "ls /workspace")
    assert listed.stdout.split() == ["NEW.md", "README.md"]


def test_create_with_another_ref_never_takes_a_warm_namespace(warm: SandboxBroker) -> None:
    (warm_id,) = warm_ids(warm)
    made = warm.run("create", "--profile", PROFILE, "--ref", "main", "--branch", "task")
    assert made.status == 0, made.stderr
    warm.created.append(made.stdout.strip())
    assert made.stdout.strip() != warm_id
    assert warm_ids(warm) == [warm_id]  # still warm, for a create of the profile's own ref


def test_gc_removes_warm_namespaces_of_a_revoked_profile(warm: SandboxBroker) -> None:
    (warm_id,) = warm_ids(warm)
    revoked = warm.run("ext", "revoke", PROFILE)
    assert revoked.status == 0, revoked.stderr
    report = warm.run("gc", "--json")
    assert report.status == 0, report.stderr
    assert [item["id"] for item in report.json()["collected"]] == [warm_id]
    assert report.json()["warm"] == []
    assert not warm.sandbox_dir(warm_id).exists()


def test_concurrent_creates_share_one_warm_namespace(warm: SandboxBroker) -> None:
    (warm_id,) = warm_ids(warm)
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(lambda _: warm.run("create", "--profile", PROFILE), range(3)))
    assert [r.stderr for r in results if r.status != 0] == []
    ids = [r.stdout.strip() for r in results]
    warm.created.extend(ids)
    assert len(set(ids)) == 3
    assert ids.count(warm_id) == 1
    for sandbox_id in ids:
        assert warm.exec(sandbox_id, "true").status == 0
