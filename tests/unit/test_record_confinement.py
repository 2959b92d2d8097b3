"""What teardown and gc accept of a record's paths (the rest, with real processes, accounts,
cgroups and containers: tests/integration/test_escape_state_dir.py)."""

from __future__ import annotations

import pytest

from sandboxer.commands.lease_removal import _below
from sandboxer.host.limits import CGROUP_ROOT, of_sandbox

SANDBOX = "0123456789abcdef01234567"


@pytest.mark.parametrize(
    "group",
    [
        f"{CGROUP_ROOT}/sandboxer/{SANDBOX}",
        f"{CGROUP_ROOT}/pids/sandboxer/{SANDBOX}",
        f"{CGROUP_ROOT}/system.slice/broker.service/sandboxer/{SANDBOX}",  # a delegated subtree
    ],
)
def test_a_cgroup_of_the_brokers_naming_is_the_sandboxs(group: str) -> None:
    assert of_sandbox(group, SANDBOX)


@pytest.mark.parametrize(
    "group",
    [
        "/home/victim/empty",
        f"/home/victim/sandboxer/{SANDBOX}",
        f"{CGROUP_ROOT}/sandboxer/89abcdef0123456789abcdef",  # another sandbox's
        f"{CGROUP_ROOT}/sandboxer/{SANDBOX}/..",
        f"{CGROUP_ROOT}/../../home/sandboxer/{SANDBOX}",
        f"{CGROUP_ROOT}//sandboxer/{SANDBOX}",
        f"{CGROUP_ROOT}/sandboxer/{SANDBOX}/",
        f"{CGROUP_ROOT}",
        f"{CGROUP_ROOT}/user.slice",
        f"sys/fs/cgroup/sandboxer/{SANDBOX}",
    ],
)
def test_any_other_path_is_not(group: str) -> None:
    assert not of_sandbox(group, SANDBOX)


@pytest.mark.parametrize(
    ("path", "below"),
    [
        ("/runs/run-1/materializations/key", True),
        ("/runs/run-1/shared", True),
        ("/runs/run-1", False),
        ("/runs/run-1/../victim", False),
        ("/runs/run-1/./x", False),
        ("/runs/run-1//x", False),
        ("/runs/run-10/x", False),
        ("/runs/run-1/x/", False),
        ("runs/run-1/x", False),
        ("/etc/passwd", False),
    ],
)
def test_a_materialization_lies_strictly_below_its_run_directory(path: str, below: bool) -> None:
    assert _below(path, "/runs/run-1") is below
    assert not _below("/runs/x/y", "/runs/../runs/x")  # nor below a run directory that climbs
