"""Warm containers (ext.docker `config.warm`): started ahead, invisible to callers, taken by a
create only while they still match its plan — through the real CLI and a real Docker daemon."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.integration.conftest import DOCKER_PROFILE, SandboxBroker, _cleanup, add_docker, make_broker
from tests.integration.warm_pool import records, set_warm, wait_for_fills, wait_warm, warm_ids
from tests.samples import CONTRACT_ENV_NAMES

EXT = "ext.docker"


def _set_warm(broker: SandboxBroker, count: int) -> None:
    set_warm(broker, EXT, count)


def _containers(broker: SandboxBroker) -> list[str]:
    """Sandbox ids of the containers labelled with this broker's state dir."""
    listed = subprocess.run(
        [
            "docker",
            "ps",
            "-a",
            "--filter",
            f"label=io.sandboxer.state-dir={broker.state}",
            "--format",
            '{{.Label "io.sandboxer.sandbox"}}',
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return sorted(listed.stdout.split())


def _remapped_root() -> tuple[int, int]:
    """The host ids of a container's root: the remapping daemon keeps its storage in <uid>.<gid>."""
    root = subprocess.run(
        ["docker", "info", "--format", "{{.DockerRootDir}}"], capture_output=True, text=True, check=True
    ).stdout.strip()
    uid, gid = os.path.basename(root).split(".")
    return int(uid), int(gid)


@pytest.fixture
def warm(runtime_dir: Path, base_image: str) -> Iterator[SandboxBroker]:
    """A Docker broker whose extension keeps one warm container per profile, filled."""
    broker = make_broker(runtime_dir, as_user=False)
    add_docker(broker, base_image)
    _set_warm(broker, 1)
    try:
        filled = broker.run("warm", DOCKER_PROFILE, "--json")
        assert filled.status == 0, filled.stderr
        yield broker
    finally:
        _set_warm(broker, 0)
        wait_for_fills(broker)
        broker.run("warm", DOCKER_PROFILE)  # with no warm count: removes the profile's warm containers
        _cleanup(broker)
        wait_for_fills(broker)  # teardowns of taken sandboxes start fills; none may outlive the test


def test_warm_fills_the_pool_and_callers_never_see_a_warm_container(warm: SandboxBroker) -> None:
    (warm_id,) = warm_ids(warm)
    again = warm.run("warm", DOCKER_PROFILE, "--json")
    assert again.status == 0, again.stderr
    assert again.json() == {"profile": DOCKER_PROFILE, "warm": 1, "started": [], "removed": [], "busy": False}
    assert _containers(warm) == [warm_id]
    record = records(warm)[warm_id]
    assert record["state"] == "warm"
    workspace = warm.sandbox_dir(warm_id) / "workspace"
    seen = workspace.stat()
    # Cloned ahead from the profile's ref, as a create clones it: the sandbox user's (1000
    # inside, remapped by the daemon), 0700.
    root_uid, root_gid = _remapped_root()
    assert (seen.st_uid, seen.st_gid, seen.st_mode & 0o777) == (root_uid + 1000, root_gid + 1000, 0o700)
    assert sorted(os.listdir(workspace)) == [".git", "README.md"]
    assert warm.run("list", "--json").json() == {"sandboxes": []}
    for command, status in (("inspect", 4), ("teardown", 4)):
        refused = warm.run(command, warm_id, "--json")
        assert refused.status == status, refused.stderr
        assert refused.json()["error"]["message"] == f"no such sandbox: {warm_id}"
    ran = warm.exec(warm_id, "true")
    assert ran.status == 125
    assert ran.stderr == f"sandboxer: exec: no such sandbox: {warm_id}\n"
    assert _containers(warm) == [warm_id]  # none of those touched it


def test_a_create_takes_the_warm_container_and_its_teardown_replaces_it(warm: SandboxBroker) -> None:
    (warm_id,) = warm_ids(warm)
    taken = warm.create()
    assert taken == warm_id
    assert warm_ids(warm) == []  # the pool is refilled at teardown, not while the caller works
    record = records(warm)[taken]
    assert record["state"] == "ready"
    assert "warm" in record
    assert record["warm_profile"] is True
    cold = make_broker_like(warm)
    try:
        cold_id = cold.create()
        warm_view = warm.run("inspect", taken, "--json").json()
        cold_view = cold.run("inspect", cold_id, "--json").json()
    finally:
        _cleanup(cold)
    assert warm_view["matches_plan"] is True
    assert warm_view["differences"] == []
    for key in ("user", "env_names", "capabilities", "network"):
        assert warm_view[key] == cold_view[key], key
    assert sorted((m["target"], m["read_only"]) for m in warm_view["mounts"]) == sorted(
        (m["target"], m["read_only"]) for m in cold_view["mounts"]
    )
    assert sorted(warm_view["env_names"]) == sorted(CONTRACT_ENV_NAMES)
    inside = warm.sh(taken, "id -u; stat -c '%u %a' /workspace; git -C /workspace status --porcelain; ls /workspace")
    assert inside.status == 0, inside.stderr
    assert inside.stdout.splitlines()[:2] == ["1000", "1000 700"]
    assert "README.md" in inside.stdout.splitlines()[2:]
    clone = warm.sandbox_dir(taken) / "workspace"
    owner = (clone.stat().st_uid, clone.stat().st_gid)
    assert owner == (_remapped_root()[0] + 1000, _remapped_root()[1] + 1000)  # no account's, as a cold create's
    assert owner == (record["host_uid"], record["host_gid"])
    torn = warm.run("teardown", taken, "--json")
    assert torn.status == 0, torn.stderr
    (replacement,) = wait_warm(warm, 1)
    assert replacement != taken
    assert _containers(warm) == [replacement]


def make_broker_like(broker: SandboxBroker) -> SandboxBroker:
    """A second Docker broker on the same runtime and image, with no warm containers."""
    image = json.loads((broker.config / "extensions" / "ext.docker.yaml").read_text().split("image: ")[1].split()[0])
    other = make_broker(broker.runtime, as_user=False)
    add_docker(other, image)
    return other


@pytest.mark.parametrize("how", ["finished", "running"])
def test_a_warm_container_someone_executed_in_is_never_handed_out(warm: SandboxBroker, how: str) -> None:
    (warm_id,) = warm_ids(warm)
    container = records(warm)[warm_id]["container_id"]
    if how == "finished":
        subprocess.run(["docker", "exec", container, "true"], check=True)  # seen in the Engine's events
    else:
        subprocess.run(["docker", "exec", "-d", container, "/usr/bin/sleep", "30"], check=True)  # in ExecIDs
    taken = warm.create()
    assert taken != warm_id  # a cold create instead
    assert warm_id not in records(warm)
    assert warm_id not in _containers(warm)
    assert warm.run("inspect", taken, "--json").json()["matches_plan"] is True


def test_a_restarted_warm_container_is_never_handed_out(warm: SandboxBroker) -> None:
    (warm_id,) = warm_ids(warm)
    container = records(warm)[warm_id]["container_id"]
    subprocess.run(["docker", "restart", "--time", "0", container], check=True, capture_output=True)
    taken = warm.create()
    assert taken != warm_id
    assert warm_id not in _containers(warm)


def test_a_warm_container_removed_behind_the_brokers_back_is_passed_over(warm: SandboxBroker) -> None:
    (warm_id,) = warm_ids(warm)
    subprocess.run(["docker", "rm", "-f", records(warm)[warm_id]["container_id"]], check=True, capture_output=True)
    taken = warm.create()
    assert taken != warm_id
    assert warm_id not in records(warm)  # its directory went with it
    assert _containers(warm) == [taken]


def test_a_changed_profile_makes_warm_containers_stale(warm: SandboxBroker) -> None:
    (warm_id,) = warm_ids(warm)
    path = warm.config / "profiles" / f"{DOCKER_PROFILE}.yaml"
    path.write_text(path.read_text() + "limits:\n  pids: 99\n")
    assert warm.run("ext", "approve", DOCKER_PROFILE).status == 0
    taken = warm.create()
    assert taken != warm_id
    assert warm_id not in _containers(warm)
    container = records(warm)[taken]["container_id"]
    limit = subprocess.run(
        ["docker", "inspect", "--format", "{{.HostConfig.PidsLimit}}", container],
        capture_output=True,
        text=True,
        check=True,
    )
    assert limit.stdout.strip() == "99"


def test_gc_removes_warm_containers_of_a_revoked_profile(warm: SandboxBroker) -> None:
    (warm_id,) = warm_ids(warm)
    assert warm.run("ext", "revoke", DOCKER_PROFILE).status == 0
    report = warm.run("gc", "--json")
    assert report.status == 0, report.stderr
    assert [item["id"] for item in report.json()["collected"]] == [warm_id]
    assert report.json()["warm"] == []
    assert _containers(warm) == []
    refused = warm.run("warm", DOCKER_PROFILE)
    assert refused.status == 3
    assert refused.stderr.startswith(f"sandboxer: {DOCKER_PROFILE} is not approved")


def test_concurrent_creates_share_one_warm_container(warm: SandboxBroker) -> None:
    (warm_id,) = warm_ids(warm)
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(lambda _: warm.run("create", "--profile", DOCKER_PROFILE), range(3)))
    assert [r.stderr for r in results if r.status != 0] == []
    ids = [r.stdout.strip() for r in results]
    warm.created.extend(ids)
    assert len(set(ids)) == 3
    assert ids.count(warm_id) == 1
    for sandbox_id in ids:
        assert warm.exec(sandbox_id, "true").status == 0


def test_warm_refuses_a_name_that_is_not_a_profile(warm: SandboxBroker) -> None:
    before = sorted(os.listdir(warm.state / "sandboxes"))
    for bad in ("../x", "-x", "A", "ext/x"):
        refused = warm.run("warm", bad)
        assert refused.status == 2, (bad, refused.stderr)
        assert refused.stderr.startswith("sandboxer: ")
    assert sorted(os.listdir(warm.state / "sandboxes")) == before
