"""The plan, its bwrap rendering, the plan-vs-live comparison and sandbox ids: pure, no processes."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from sandboxer.backends.bwrap.argv import (
    HOLDER,
    HOLDER_TARGET,
    SHM_BYTES,
    BwrapFds,
    needs_fd,
    render,
    render_lines,
)
from sandboxer.core.config_types import ExtensionConfig, Limits, Profile, RuntimePin, Workspace
from sandboxer.core.plan import (
    RUNTIME_TARGET,
    STATE_ROOT,
    WORKSPACE_TARGET,
    MountKind,
    Plan,
    build_plan,
)
from sandboxer.errors import NotFoundError
from sandboxer.host.observe import MountSeen, ProbeSeen, differences, parse_mountinfo
from sandboxer.host.registry import check_id, new_id

GOLDEN = Path(__file__).parent / "golden" / "bwrap_argv.txt"
SANDBOX_ID = "0123456789abcdef01234567"
RUNTIME_PATH = "/srv/sandboxer/runtimes/demo"
RUNTIME_SHA = "ab" * 32
WORKSPACE_SOURCE = f"/run/sandboxer/sandboxes/{SANDBOX_ID}/workspace"
HOST_LINKS = (("/bin", "usr/bin"), ("/lib", "usr/lib"), ("/lib64", "usr/lib64"), ("/sbin", "usr/sbin"))
HOST_ETC = ("/etc/ssl/certs", "/etc/ld.so.cache")
# One fixed descriptor per target that bwrap receives by fd; info-fd is 9.
FIXED_FDS = {
    "/etc/passwd": 10,
    "/etc/group": 11,
    "/etc/hosts": 12,
    "/etc/hostname": 13,
    "/etc/nsswitch.conf": 14,
    "/etc/resolv.conf": 15,
    RUNTIME_TARGET: 16,
    WORKSPACE_TARGET: 17,
}
STATE_SUBDIRS = ("home", "config", "cache", "data", "tmp")


def make_profile(name: str = "golden", limits: Limits | None = None) -> Profile:
    return Profile(
        name=name,
        extension="ext.bwrap",
        workspace=Workspace(repository="/srv/repos/demo", ref="main"),
        network_default="deny",
        egress=(),
        secrets=(),
        limits=limits or Limits(),
        file_sha256="0" * 64,
    )


def make_extension() -> ExtensionConfig:
    return ExtensionConfig(
        extension="ext.bwrap",
        runtime=RuntimePin(path=RUNTIME_PATH, sha256=RUNTIME_SHA),
        image=None,
        file_sha256="1" * 64,
    )


def make_plan(*, workspace_in_memory: bool = False) -> Plan:
    return build_plan(
        sandbox_id=SANDBOX_ID,
        profile=make_profile(),
        extension=make_extension(),
        workspace_source=WORKSPACE_SOURCE,
        host_links=HOST_LINKS,
        host_etc=HOST_ETC,
        workspace_in_memory=workspace_in_memory,
    )


def fixed_fds() -> BwrapFds:
    return BwrapFds(by_target=FIXED_FDS, info=9, holder=7, seccomp=8)


# --- the plan -------------------------------------------------------------------------------------


def test_env_is_built_from_nothing_with_exactly_the_contract_names(monkeypatch: pytest.MonkeyPatch) -> None:
    # Whatever the broker's own environment holds must not reach the plan.
    monkeypatch.setenv("SANDBOXER_TEST_SECRET", "do-not-leak")
    monkeypatch.setenv("PATH", "/evil/bin:/usr/bin")
    monkeypatch.setenv("HOME", "/root")
    plan = make_plan()
    names = [name for name, _ in plan.env]
    assert len(names) == len(set(names)), "an environment name appears twice"
    state = "/run/sandboxer/state"
    assert dict(plan.env) == {
        "PATH": "/opt/sandboxer/runtime/bin:/usr/local/bin:/usr/bin:/bin",
        "HOME": f"{state}/home",
        "XDG_CONFIG_HOME": f"{state}/config",
        "XDG_CACHE_HOME": f"{state}/cache",
        "XDG_STATE_HOME": f"{state}/data",
        "TMPDIR": f"{state}/tmp",
        "PYTHONNOUSERSITE": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "LANG": "C.UTF-8",
        "USER": "sandbox",
        "LOGNAME": "sandbox",
        "SANDBOXER_SANDBOX_ID": SANDBOX_ID,
        "SANDBOXER_PROFILE": "golden",
        "SANDBOXER_NETWORK": "loopback",
    }
    path = dict(plan.env)["PATH"]
    assert path.split(":")[0] == "/opt/sandboxer/runtime/bin"
    assert all(entry.startswith("/") for entry in path.split(":")), "PATH has a relative entry"
    assert "do-not-leak" not in repr(plan)
    assert "/evil/bin" not in path


def test_runtime_is_read_only_and_workspace_writable() -> None:
    plan = make_plan()
    runtime = plan.mount_at(RUNTIME_TARGET)
    assert RUNTIME_TARGET == "/opt/sandboxer/runtime"
    assert runtime.kind is MountKind.RO_BIND
    assert runtime.source == RUNTIME_PATH
    assert runtime.read_only
    assert (plan.runtime_path, plan.runtime_sha256) == (RUNTIME_PATH, RUNTIME_SHA)
    workspace = plan.mount_at(WORKSPACE_TARGET)
    assert WORKSPACE_TARGET == "/workspace"
    assert workspace.kind is MountKind.BIND
    assert workspace.source == WORKSPACE_SOURCE
    assert not workspace.read_only
    # The only writable host bind is the workspace clone.
    host_binds = [m for m in plan.mounts if m.kind is MountKind.BIND]
    assert host_binds == [workspace]
    assert plan.mount_at("/usr").read_only
    for path in HOST_ETC:
        assert plan.mount_at(path).kind is MountKind.RO_BIND


def test_state_is_a_private_size_capped_tmpfs_with_five_private_dirs() -> None:
    plan = make_plan()
    state = plan.mount_at(STATE_ROOT)
    assert STATE_ROOT == "/run/sandboxer/state"
    assert state.kind is MountKind.TMPFS
    assert state.mode == 0o700
    assert state.size_bytes is not None
    assert 0 < state.size_bytes <= 4 * 1024**3
    dirs = [m for m in plan.mounts if m.kind is MountKind.DIR]
    assert [m.target for m in dirs] == [f"{STATE_ROOT}/{sub}" for sub in STATE_SUBDIRS]
    assert all(m.mode == 0o700 for m in dirs)
    # The dirs are made inside the tmpfs, so the tmpfs comes first; the state is outside the workspace.
    targets = [m.target for m in plan.mounts]
    assert all(targets.index(STATE_ROOT) < targets.index(m.target) for m in dirs)
    assert not STATE_ROOT.startswith(WORKSPACE_TARGET + "/")


def test_user_is_fixed_and_not_root() -> None:
    plan = make_plan()
    assert (plan.uid, plan.gid) == (1000, 1000)
    assert plan.user == "sandbox"
    assert plan.network == "loopback"
    assert plan.backend == "bwrap"
    passwd = plan.mount_at("/etc/passwd")
    assert passwd.kind is MountKind.FILE
    assert passwd.read_only
    assert b"sandbox:x:1000:1000:" in (passwd.content or b"")


def test_limits_come_from_the_profile() -> None:
    limits = Limits(memory_mib=512, pids=64)
    plan = build_plan(
        sandbox_id=SANDBOX_ID,
        profile=make_profile(limits=limits),
        extension=make_extension(),
        workspace_source=WORKSPACE_SOURCE,
    )
    assert plan.limits == limits


def test_plan_and_its_mounts_are_frozen() -> None:
    plan = make_plan()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.uid = 0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.env = ()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.mounts[0].source = "/"  # type: ignore[misc]
    assert isinstance(plan.mounts, tuple)
    assert isinstance(plan.env, tuple)


def test_exec_env_adds_only_the_consumer() -> None:
    plan = make_plan()
    assert plan.exec_env(consumer=None) == plan.env
    env = plan.exec_env(consumer="x")
    assert env == (*plan.env, ("SANDBOXER_CONSUMER", "x"))
    assert "SANDBOXER_CONSUMER" not in dict(plan.env), "the plan itself must not change"


# --- the bwrap argv -------------------------------------------------------------------------------


def _rendered() -> list[str]:
    return [" ".join(line) for line in render_lines(make_plan(), fixed_fds())]


def test_bwrap_argv_matches_golden_file() -> None:
    lines = _rendered()
    for line in render_lines(make_plan(), fixed_fds()):
        assert all(arg and " " not in arg for arg in line), f"an argument would not survive the golden format: {line}"
    if os.environ.get("SANDBOXER_UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text("\n".join(lines) + "\n")
    expected = GOLDEN.read_text().splitlines()
    assert lines == expected, "bwrap argv changed: review it, then rerun with SANDBOXER_UPDATE_GOLDEN=1"


def test_render_is_the_flattened_lines() -> None:
    plan, fds = make_plan(), fixed_fds()
    assert render(plan, fds) == [arg for line in render_lines(plan, fds) for arg in line]


def test_every_fd_target_gets_its_fixed_fd() -> None:
    plan = make_plan()
    assert {m.target for m in plan.mounts if needs_fd(m)} == set(FIXED_FDS)


def test_bwrap_argv_security_properties() -> None:
    lines = render_lines(make_plan(), fixed_fds())
    argv = render(make_plan(), fixed_fds())
    for flag in (
        "--unshare-user",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--disable-userns",
        "--new-session",
        "--clearenv",
    ):
        assert flag in argv, flag
    assert ["--cap-drop", "ALL"] in lines
    assert "--cap-add" not in argv
    assert "--share-net" not in argv
    assert not any(arg.startswith("--dev-bind") for arg in argv), "no host device is bound"
    bind_ops = {"--bind", "--ro-bind", "--bind-try", "--ro-bind-try", "--dev-bind", "--dev-bind-try"}
    for line in lines:
        if line[0] in bind_ops:
            assert "/" not in line[1:], f"the host root is bound: {line}"
    # Only the sandbox id is set in bwrap's own environment; everything else arrives per exec.
    setenv = [line for line in lines if line[0] == "--setenv"]
    assert setenv == [["--setenv", "SANDBOXER_SANDBOX_ID", SANDBOX_ID]]
    assert ["--ro-bind-fd", str(FIXED_FDS[RUNTIME_TARGET]), RUNTIME_TARGET] in lines
    assert ["--bind-fd", str(FIXED_FDS[WORKSPACE_TARGET]), WORKSPACE_TARGET] in lines
    assert not any(line[0] in bind_ops and line[-1] in (RUNTIME_TARGET, WORKSPACE_TARGET) for line in lines)
    assert ["--remount-ro", "/"] in lines
    mount_ops = bind_ops | {"--ro-bind-fd", "--bind-fd", "--tmpfs", "--dir", "--symlink", "--ro-bind-data", "--proc"}
    last_mount = max(i for i, line in enumerate(lines) if any(arg in mount_ops for arg in line))
    assert lines.index(["--remount-ro", "/"]) > last_mount, "the root is made read-only after every mount"
    assert argv[-3:] == ["--", HOLDER_TARGET, "infinity"]
    assert tuple(argv[-2:]) == HOLDER
    # The holder runs from an execute-only copy (non-dumpable); the policy reaches bwrap by fd.
    assert ["--perms", "0111", "--ro-bind-data", "7", HOLDER_TARGET] in lines
    assert ["--seccomp", "8"] in lines
    # /dev/shm is a sized tmpfs of its own, after bwrap's /dev.
    shm = lines.index(["--perms", "1777", "--size", str(SHM_BYTES), "--tmpfs", "/dev/shm"])
    assert shm == lines.index(["--dev", "/dev"]) + 1
    assert lines[shm + 1] == ["--remount-ro", "/dev"], "the rest of /dev is read-only"
    proc = lines.index(["--proc", "/proc"])
    assert lines[proc + 1 : proc + 3] == [
        ["--ro-bind", "/dev/null", "/proc/keys"],
        ["--ro-bind", "/dev/null", "/proc/key-users"],
    ]
    assert argv.count("--") == 1


# --- plan vs. live --------------------------------------------------------------------------------


def matching_mounts(plan: Plan) -> list[MountSeen]:
    """What a live sandbox that follows the plan shows in its mountinfo."""
    seen = [MountSeen(target="/", read_only=True, fstype="tmpfs")]
    for mount in plan.mounts:
        if mount.kind in (MountKind.DIR, MountKind.SYMLINK):
            continue
        fstype = {MountKind.PROC: "proc", MountKind.TMPFS: "tmpfs", MountKind.DEV: "tmpfs"}.get(mount.kind, "ext4")
        size = None if mount.size_bytes is None else mount.size_bytes // 1024
        seen.append(MountSeen(target=mount.target, read_only=mount.read_only, fstype=fstype, size_kib=size))
    seen += [
        MountSeen(target="/dev/pts", read_only=False, fstype="devpts"),
        MountSeen(target="/dev/shm", read_only=False, fstype="tmpfs"),
        MountSeen(target="/proc/sys", read_only=True, fstype="proc"),
    ]
    return seen


def matching_probe(plan: Plan) -> ProbeSeen:
    return ProbeSeen(
        uid=plan.uid,
        gid=plan.gid,
        groups=(),
        cap_eff=0,
        cap_prm=0,
        cap_bnd=0,
        no_new_privs=True,
        env_names=tuple(sorted(name for name, _ in plan.env)),
        cgroups=("4:memory:/sandboxer/" + SANDBOX_ID,),
        seccomp=2,
    )


def _replace_mount(mounts: list[MountSeen], target: str, **changes: object) -> list[MountSeen]:
    return [dataclasses.replace(m, **changes) if m.target == target else m for m in mounts]  # type: ignore[arg-type]


def test_a_matching_sandbox_has_no_differences() -> None:
    plan = make_plan()
    assert differences(plan, matching_mounts(plan), ["lo"], matching_probe(plan)) == []


def _mount_cases(plan: Plan) -> dict[str, tuple[list[MountSeen], str]]:
    base = matching_mounts(plan)
    return {
        "runtime writable": (_replace_mount(base, RUNTIME_TARGET, read_only=False), RUNTIME_TARGET),
        "usr writable": (_replace_mount(base, "/usr", read_only=False), "/usr"),
        "etc file writable": (_replace_mount(base, "/etc/passwd", read_only=False), "/etc/passwd"),
        "workspace missing": ([m for m in base if m.target != WORKSPACE_TARGET], WORKSPACE_TARGET),
        "state missing": ([m for m in base if m.target != STATE_ROOT], STATE_ROOT),
        "extra writable /mnt": ([*base, MountSeen(target="/mnt", read_only=False, fstype="ext4")], "/mnt"),
        "root writable": (_replace_mount(base, "/", read_only=False), "mount /"),
        "state tmpfs larger": (_replace_mount(base, STATE_ROOT, size_kib=512 * 1024), STATE_ROOT),
        "state tmpfs unsized": (_replace_mount(base, STATE_ROOT, size_kib=None), STATE_ROOT),
        "state not a tmpfs": (_replace_mount(base, STATE_ROOT, fstype="ext4"), STATE_ROOT),
    }


@pytest.mark.parametrize(
    "case",
    [
        "runtime writable",
        "usr writable",
        "etc file writable",
        "workspace missing",
        "state missing",
        "extra writable /mnt",
        "root writable",
        "state tmpfs larger",
        "state tmpfs unsized",
        "state not a tmpfs",
    ],
)
def test_each_mount_deviation_is_reported(case: str) -> None:
    plan = make_plan()
    mounts, needle = _mount_cases(plan)[case]
    problems = differences(plan, mounts, ["lo"], matching_probe(plan))
    assert problems, f"{case}: not reported"
    assert any(needle in problem for problem in problems), problems


def test_extra_read_only_host_mount_is_reported() -> None:
    """The contract: no host home in the sandbox, and a live sandbox that differs from its plan is refused.

    A read-only bind of the host's /home (or /root, or the config dir) is not in the plan and must be
    reported like an extra writable one.
    """
    plan = make_plan()
    mounts = [*matching_mounts(plan), MountSeen(target="/home", read_only=True, fstype="ext4")]
    problems = differences(plan, mounts, ["lo"], matching_probe(plan))
    assert any("/home" in problem for problem in problems), problems


@pytest.mark.parametrize(
    ("interfaces", "probe_changes", "needle"),
    [
        (["eth0", "lo"], {}, "network"),
        ([], {}, "network"),
        (["lo"], {"uid": 0}, "root"),
        (["lo"], {"uid": 0, "gid": 0}, "uid/gid"),
        (["lo"], {"gid": 0}, "uid/gid"),
        (["lo"], {"cap_eff": 0x20}, "capabilities"),
        (["lo"], {"cap_prm": 1}, "capabilities"),
        (["lo"], {"cap_bnd": 1 << 21}, "capabilities"),
        (["lo"], {"no_new_privs": False}, "no_new_privs"),
        (["lo"], {"seccomp": 0}, "seccomp"),
        (["lo"], {"seccomp": 1}, "seccomp"),
    ],
    ids=[
        "eth0",
        "no-interfaces",
        "uid0",
        "uid-gid-0",
        "gid0",
        "capeff",
        "capprm",
        "capbnd",
        "nnp-off",
        "no-seccomp",
        "strict-seccomp",
    ],
)
def test_each_probe_deviation_is_reported(interfaces: list[str], probe_changes: dict[str, object], needle: str) -> None:
    plan = make_plan()
    probe = dataclasses.replace(matching_probe(plan), **probe_changes)  # type: ignore[arg-type]
    problems = differences(plan, matching_mounts(plan), interfaces, probe)
    assert any(needle in problem for problem in problems), problems


@pytest.mark.parametrize(
    "env_names",
    [
        ("AWS_SECRET_ACCESS_KEY",),  # an extra name
        ("SANDBOXER_CONSUMER",),  # the consumer is per exec, never in the probe's env
    ],
)
def test_an_extra_env_name_is_reported(env_names: tuple[str, ...]) -> None:
    plan = make_plan()
    probe = matching_probe(plan)
    probe = dataclasses.replace(probe, env_names=tuple(sorted((*probe.env_names, *env_names))))
    problems = differences(plan, matching_mounts(plan), ["lo"], probe)
    assert any("environment" in problem for problem in problems), problems


def test_a_missing_env_name_is_reported() -> None:
    plan = make_plan()
    probe = matching_probe(plan)
    probe = dataclasses.replace(probe, env_names=tuple(n for n in probe.env_names if n != "HOME"))
    assert any("environment" in p for p in differences(plan, matching_mounts(plan), ["lo"], probe))


MOUNTINFO = (
    "1 0 0:50 / / ro,nosuid,nodev,relatime - tmpfs tmpfs rw,size=4k\n"
    "2 1 8:1 /srv/my\\040runtime /opt/sandboxer/runtime ro,nosuid,nodev,relatime master:1 - ext4 /dev/sda1 rw\n"
    "3 1 8:1 /tmp/ws /workspace rw,nosuid,nodev,relatime - ext4 /dev/sda1 rw,errors=remount-ro\n"
    "4 1 8:1 /x /with\\040space\\011tab\\134040 rw,relatime shared:2 master:3 - ext4 /dev/sda1 rw\n"
    "5 1 0:51 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw\n"
    "6 1 0:52 / /run/sandboxer rw,nosuid,nodev,relatime - tmpfs tmpfs rw,size=262144k,mode=700,uid=1000\n"
)


def test_parse_mountinfo_unescapes_and_reads_per_mount_options() -> None:
    mounts = parse_mountinfo(MOUNTINFO)
    assert [m.target for m in mounts] == [
        "/",
        "/opt/sandboxer/runtime",
        "/workspace",
        "/with space\ttab\\040",  # \134 is a literal backslash: "040" after it stays text
        "/proc",
        "/run/sandboxer",
    ]
    # Per-mount options decide: the superblock's options (here "rw", "errors=remount-ro") do not.
    assert [m.read_only for m in mounts] == [True, True, False, False, False, False]
    assert [m.fstype for m in mounts] == ["tmpfs", "ext4", "ext4", "ext4", "proc", "tmpfs"]
    assert [m.size_kib for m in mounts] == [4, None, None, None, None, 262144]
    assert [(m.device, m.root) for m in mounts] == [
        ("0:50", "/"),
        ("8:1", "/srv/my runtime"),
        ("8:1", "/tmp/ws"),
        ("8:1", "/x"),
        ("0:51", "/"),
        ("0:52", "/"),
    ]


def test_parse_mountinfo_skips_short_lines() -> None:
    assert parse_mountinfo("\ngarbage\n") == []


# --- sandbox ids ----------------------------------------------------------------------------------


def test_new_id_is_24_lowercase_hex_and_unique() -> None:
    ids = [new_id() for _ in range(1000)]
    assert len(set(ids)) == 1000
    for sandbox_id in ids:
        assert len(sandbox_id) == 24
        assert set(sandbox_id) <= set("0123456789abcdef")
        assert check_id(sandbox_id) == sandbox_id


@pytest.mark.parametrize(
    "bad",
    [
        "../x",
        "",
        "0123456789ABCDEF01234567",
        "0123456789abcdef0123456",
        "0123456789abcdef012345678",
        "0123456789abcdef01234567\n",
        "0123456789abcdef/1234567",
        "../../../../etc/passwd00",
        "-0123456789abcdef0123456",
        "0123456789abcdeg01234567",
    ],
    ids=["dotdot", "empty", "upper", "23", "25", "newline", "slash", "path24", "option", "nonhex"],
)
def test_check_id_refuses_anything_else(bad: str) -> None:
    with pytest.raises(NotFoundError) as caught:
        check_id(bad)
    assert caught.value.exit_status == 4


def test_an_in_memory_workspace_is_a_sized_tmpfs_and_binds_no_host_directory() -> None:
    """An unprivileged broker cannot mount on the host: its workspace is a tmpfs of
    limits.workspace_mib in the sandbox's own mount namespace, and the host clone is not bound."""
    plan = make_plan(workspace_in_memory=True)
    workspace = plan.mount_at(WORKSPACE_TARGET)
    assert plan.workspace_in_memory
    assert not make_plan().workspace_in_memory
    assert (workspace.kind, workspace.size_bytes, workspace.mode) == (MountKind.TMPFS, 4096 * 1024 * 1024, 0o700)
    lines = [line for line in render_lines(plan, fixed_fds()) if WORKSPACE_TARGET in line]
    assert lines == [["--perms", "0700", "--size", str(4096 * 1024 * 1024), "--tmpfs", WORKSPACE_TARGET]]
    assert WORKSPACE_SOURCE not in " ".join(render(plan, fixed_fds()))
