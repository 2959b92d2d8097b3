"""How the Docker backend learns the daemon's user-namespace remapping, and what it refuses
(no Docker needed: the Engine's answer is stood in for)."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import pytest

from sandboxer.backends.docker import container as docker
from sandboxer.errors import BackendError
from tests.unit.test_plan_and_argv import make_plan

INFO = {"SecurityOptions": ["name=seccomp,profile=default", "name=userns"], "DockerRootDir": "/d/100000.100000"}


def test_the_map_is_dockremaps_ranges_one_after_another() -> None:
    text = "someone:200000:65536\ndockremap:100000:65536\n999:300000:10\ndockremap:500000:1000\n"
    mapped = docker.id_map(text, names=("dockremap", "999"))
    assert mapped == ((0, 100000, 65536), (65536, 300000, 10), (65546, 500000, 1000))
    remap = docker.Remap(uids=mapped, gids=mapped)
    assert remap.root == (100000, 100000)
    assert remap.host_ids(1000, 1000) == (101000, 101000)
    assert remap.host_ids(65540, 65536) == (300004, 300000)
    with pytest.raises(BackendError, match="no host uid for container uid 70000"):
        remap.host_ids(70000, 0)


@pytest.fixture
def engine_says(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Stand in for the Engine's /info and forget what an earlier call learnt."""
    monkeypatch.setattr(docker, "_LEARNT", docker.Learnt())

    def say(info: dict[str, Any]) -> None:
        monkeypatch.setattr(docker, "engine_call", lambda method, path, body=None: (200, info))

    return say


def test_a_daemon_without_remapping_is_refused_with_a_hint(engine_says: Any) -> None:
    engine_says({"SecurityOptions": ["name=seccomp,profile=default"], "DockerRootDir": "/var/lib/docker"})
    with pytest.raises(BackendError) as refused:
        docker.remap()
    assert refused.value.exit_status == 5
    assert refused.value.message.startswith("the Docker daemon does not remap user namespaces: ")
    assert "docs/docker.md" in str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_daemon_remapping_to_other_ranges_is_refused(engine_says: Any) -> None:
    if not os.path.exists("/etc/subuid"):
        pytest.skip("no /etc/subuid here")
    engine_says({**INFO, "DockerRootDir": "/var/lib/docker/123.123"})
    with pytest.raises(BackendError, match=r"not to dockremap's subordinate ranges|no subordinate ranges"):
        docker.remap()


def test_accounts_and_low_ids_never_run_a_sandbox() -> None:
    assert docker.account_problems(1000, 1000)  # a login account's range, remapped or not
    assert docker.account_problems(0, 0)
    assert docker.account_problems(65535, 70000)
    free = next(uid for uid in range(1_600_000_000, 1_600_001_000) if uid not in docker._known_ids("/etc/passwd"))
    assert docker.account_problems(free, free) == [] or free in docker._known_ids("/etc/group")


def test_a_pid_1_of_the_hosts_own_root_fails_the_host_check() -> None:

    plan = replace(make_plan(), backend="docker", host_uid=101000, host_gid=101000)
    problems = docker.host_problems({"State": {"Pid": os.getpid()}}, plan)
    view = docker.host_view(os.getpid())
    assert view is not None
    assert view.uid == os.getuid()
    assert any("planned 101000:101000" in problem for problem in problems)
    assert any("account's or below 65536" in problem for problem in problems)
    assert docker.host_problems({"State": {"Pid": 0}}, plan) == ["the container's pid 1 cannot be read on the host"]
