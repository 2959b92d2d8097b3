"""The final comparison covers lease mounts: a missing, writable, doubled or unsigned one is a
difference (bwrap: the sandbox's mountinfo; Docker: the Engine's Mounts), and the plan renders
them as the manifest says (fds for bwrap, a named volume for a spool on Docker)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from sandboxer.backends.bwrap.argv import needs_fd, render_lines
from sandboxer.backends.docker.render import binds, create_body, verify, volumes
from sandboxer.core.plan import Grants, Mount, MountKind, Plan, build_plan
from sandboxer.host.lease_mounts import staged_mismatches
from sandboxer.host.observe import MountSeen, differences, parse_mountinfo
from tests.unit.test_plan_and_argv import (
    SANDBOX_ID,
    WORKSPACE_SOURCE,
    fixed_fds,
    make_extension,
    make_profile,
    matching_mounts,
    matching_probe,
)

SHARED = "/run/branchbox/leases/shared/exchange"
SPOOL = "/run/branchbox/leases/tool-requests/delivery"
PROJECT = "/run/branchbox/leases/project-env"
RUN_DIR = "/run/branchbox/managed/run-1"


def lease_grants(backend: str) -> Grants:
    spool_source = "sandboxer-spool-x" if backend == "docker" else "/state/sandboxes/x/spools/sandboxer-spool-x"
    return Grants(
        uid=2345,
        gid=2346,
        mounts=(
            Mount(
                kind=MountKind.RO_BIND,
                target=SHARED,
                source=f"{RUN_DIR}/shared/exchange",
                lease="shared",
                beneath=RUN_DIR,
            ),
            Mount(kind=MountKind.FILE, target=PROJECT, content=b"A=1\n", mode=0o444, lease="project"),
            Mount(
                kind=MountKind.SPOOL,
                target=SPOOL,
                source=spool_source,
                lease="requests",
                beneath=None if backend == "docker" else "/state/sandboxes/x/spools",
            ),
        ),
        env=(("A", "1"), ("LANG", "C")),
    )


def lease_plan(backend: str = "bwrap") -> Plan:
    return build_plan(
        sandbox_id=SANDBOX_ID,
        profile=make_profile(),
        extension=make_extension(),
        workspace_source=WORKSPACE_SOURCE,
        grants=lease_grants(backend),
    )


def test_grants_set_the_user_and_the_environment_without_doubling_a_name() -> None:
    plan = lease_plan()
    assert (plan.uid, plan.gid) == (2345, 2346)
    names = [name for name, _ in plan.env]
    assert len(names) == len(set(names))
    assert dict(plan.env)["A"] == "1"
    assert dict(plan.env)["LANG"] == "C"  # a project variable takes the later value in place


def test_lease_sources_and_spools_reach_bwrap_by_descriptor() -> None:
    plan = lease_plan()
    leases = [m for m in plan.mounts if m.lease is not None]
    assert len(leases) == 3
    assert all(needs_fd(m) for m in leases)
    fds = fixed_fds()
    numbers = dict(fds.by_target)
    numbers.update({SHARED: 30, PROJECT: 31, SPOOL: 32})
    lines = render_lines(plan, type(fds)(by_target=numbers, info=fds.info))
    assert ["--ro-bind-fd", "30", SHARED] in lines
    assert ["--perms", "0444", "--ro-bind-data", "31", PROJECT] in lines
    assert ["--bind-fd", "32", SPOOL] in lines


def test_a_matching_lease_sandbox_has_no_differences() -> None:
    plan = lease_plan()
    assert differences(plan, matching_mounts(plan), ["lo"], matching_probe(plan)) == []


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("missing", f"mount {SHARED}: planned but not mounted"),
        ("writable", f"mount {SHARED}: planned read-only but writable"),
        ("doubled", f"mount {SHARED}: lease shared mounted 2 times"),
        ("unsigned", "mount /run/branchbox/leases/shared/other: not in the plan"),
        ("spool missing", f"mount {SPOOL}: planned but not mounted"),
    ],
)
def test_each_lease_mount_deviation_is_a_difference(case: str, needle: str) -> None:
    plan = lease_plan()
    seen = matching_mounts(plan)
    if case == "missing":
        seen = [m for m in seen if m.target != SHARED]
    elif case == "writable":
        seen = [MountSeen(target=m.target, read_only=False, fstype=m.fstype) if m.target == SHARED else m for m in seen]
    elif case == "doubled":
        seen.append(MountSeen(target=SHARED, read_only=True, fstype="ext4"))
    elif case == "unsigned":
        seen.append(MountSeen(target="/run/branchbox/leases/shared/other", read_only=True, fstype="ext4"))
    elif case == "spool missing":
        seen = [m for m in seen if m.target != SPOOL]
    problems = differences(plan, seen, ["lo"], matching_probe(plan))
    assert needle in problems, problems


def engine_mounts(plan: Plan, etc_dir: str) -> list[dict[str, object]]:
    """The Engine's Mounts of a container that follows the plan."""
    mounts: list[dict[str, object]] = [
        {"Type": "bind", "Source": b.source, "Destination": b.target, "RW": not b.read_only, "Propagation": "rprivate"}
        for b in binds(plan, etc_dir=etc_dir)
    ]
    mounts += [
        {
            "Type": "volume",
            "Name": name,
            "Source": f"/var/lib/docker/volumes/{name}/_data",
            "Destination": target,
            "RW": True,
        }
        for target, name in volumes(plan)
    ]
    return mounts


def mount_problems(plan: Plan, mounts: list[dict[str, object]]) -> list[str]:
    body = create_body(plan, image="sha256:" + "a" * 64, etc_dir="/etc-dir", state_dir="/state")
    attrs = {"Mounts": mounts, "HostConfig": {"Tmpfs": body["HostConfig"]["Tmpfs"]}, "Config": {}}
    return [p for p in verify(attrs, plan, etc_dir="/etc-dir") if p.startswith("mount") or "volume" in p]


def test_docker_renders_a_spool_as_its_named_volume_and_lease_binds_read_only() -> None:
    plan = lease_plan("docker")
    body = create_body(plan, image="sha256:" + "a" * 64, etc_dir="/etc-dir", state_dir="/state")
    mounts = body["HostConfig"]["Mounts"]
    assert {
        "Type": "volume",
        "Source": "sandboxer-spool-x",
        "Target": SPOOL,
        "ReadOnly": False,
        "VolumeOptions": {"NoCopy": True},
    } in mounts
    assert {"Type": "bind", "Source": f"{RUN_DIR}/shared/exchange", "Target": SHARED, "ReadOnly": True} in mounts
    assert mount_problems(plan, engine_mounts(plan, "/etc-dir")) == []


@pytest.mark.parametrize(
    "case", ["volume read-only", "volume renamed", "volume doubled", "extra volume", "bind writable"]
)
def test_docker_lease_mount_deviations_are_differences(case: str) -> None:
    plan = lease_plan("docker")
    mounts = engine_mounts(plan, "/etc-dir")
    spool = next(m for m in mounts if m["Type"] == "volume")
    if case == "volume read-only":
        spool["RW"] = False
    elif case == "volume renamed":
        spool["Name"] = "sandboxer-spool-other"
    elif case == "volume doubled":
        mounts.append(dict(spool))
    elif case == "extra volume":
        mounts.append({"Type": "volume", "Name": "v", "Destination": "/run/branchbox/leases/x", "RW": True})
    elif case == "bind writable":
        shared = next(m for m in mounts if m["Destination"] == SHARED)
        shared["RW"] = True
    assert mount_problems(plan, mounts), case


def test_a_staged_lease_must_be_the_staged_mount_inside() -> None:

    # /proc stands in for a staged point: a mount the broker's namespace really has.
    host = {m.target: m for m in parse_mountinfo(Path("/proc/self/mountinfo").read_text())}["/proc"]
    staged = SimpleNamespace(
        mounts=[
            Mount(kind=MountKind.RO_BIND, target="/run/x", source="/proc", lease="shared", beneath="/s/ab/leases"),
            Mount(kind=MountKind.RO_BIND, target="/opt/sandboxer/runtime", source="/srv/rt"),  # not a lease
        ]
    )
    same = MountSeen(target="/run/x", read_only=True, fstype=host.fstype, device=host.device, root=host.root)
    assert staged_mismatches(staged, [same]) == []  # type: ignore[arg-type]
    empty_point = MountSeen(target="/run/x", read_only=True, fstype="ext4", device="8:1", root="/s/ab/leases/0")
    problem = ["lease shared: /run/x is not its staged source inside the sandbox"]
    assert staged_mismatches(staged, [empty_point]) == problem  # type: ignore[arg-type]
    assert staged_mismatches(staged, []) == problem  # type: ignore[arg-type]
