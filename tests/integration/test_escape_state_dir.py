"""Probes of the state dir and its records (issue 31, hole 1): a state dir another account
planted, and records forged to turn gc into a weapon.

- Another account makes a state dir (SANDBOXER_STATE points there) holding a forged record that
  names the victim's file and, as its sandbox's init, a process of the victim's in the host's own
  pid namespace. The victim's `sandboxer gc`, `sandboxer list` (the client, which then runs
  in-process) and `SANDBOXER_NO_SERVICE=1 sandboxer gc` refuse in one line naming the directory
  and the rule (status 3); the victim's file and process survive.
- Root's own state dir holding forged records — a materialization that climbs out of its run
  directory, a spool and a cgroup outside the sandbox's directory, the pids of unrelated
  processes (one as bwrap, one as the init of a pid namespace of its own with a sleeper in it),
  an unlabelled container: gc removes nothing outside, signals nothing unrelated, removes no
  container it did not make, and says what it left alone (residue, status 6); a real sandbox
  beside them stays healthy and still tears down.

Real accounts (useradd), real bwrap, real Docker; the forged records are what an attacker would
write (record format 1, as sandboxer.core.record writes it).
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest

from sandboxer.core.record_reading import read_record
from sandboxer.host import procs
from tests.conftest import REPO
from tests.integration.conftest import SandboxBroker, docker_skip_reason

_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
ATTACKER, VICTIM = f"sbxplant{_WORKER}"[:32], f"sbxvictim{_WORKER}"[:32]
FORGED_ID = "0123456789abcdef01234567"
SECOND_ID = "89abcdef0123456789abcdef"
DOCKER_ID = "fedcba9876543210fedcba98"


@pytest.fixture(scope="module")
def accounts() -> Iterator[tuple[pwd.struct_passwd, pwd.struct_passwd]]:
    """Two real accounts, the attacker and the victim (removed afterwards)."""
    if os.geteuid() != 0:
        pytest.skip("creating test accounts needs root (CI runs as root)")
    for name in (ATTACKER, VICTIM):
        subprocess.run(["userdel", name], capture_output=True, check=False)
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
    try:
        yield pwd.getpwnam(ATTACKER), pwd.getpwnam(VICTIM)
    finally:
        for name in (ATTACKER, VICTIM):
            subprocess.run(["userdel", name], check=False)


def _as(account: pwd.struct_passwd) -> list[str]:
    return ["setpriv", "--reuid", str(account.pw_uid), "--regid", str(account.pw_gid), "--clear-groups", "--"]


def _record(sandbox_id: str, **parts: Any) -> dict[str, Any]:
    """A record of format 1 in the shape sandboxer writes it: identity, then the forged parts."""
    return {
        "format": 1,
        "id": sandbox_id,
        "profile": "bwrap-local",
        "backend": "bwrap",
        "state": "failed",  # gc destroys a sandbox that is not running without asking
        "created_at": "2026-01-01T00:00:00Z",
        "owner_pid": None,
        "owner_start": None,
        "warm_profile": False,
        **parts,
    }


def _processes(*, bwrap: int | None = None, init: int | None = None, namespace: int | None = None) -> dict[str, Any]:
    return {
        "bwrap_pid": bwrap,
        "bwrap_start": None if bwrap is None else procs.start_time(bwrap),
        "init_pid": init,
        "init_start": None if init is None else procs.start_time(init),
        "holder_pid": init,
        "holder_start": None if init is None else procs.start_time(init),
        "pid_namespace": namespace,
    }


def _manifest(run_dir: Path, *, owner: int, materializations: list[str], spools: list[str]) -> dict[str, Any]:
    seen = run_dir.stat()
    return {
        "file": str(run_dir / "assignment.json"),
        "sha256": "0" * 64,
        "owner_uid": owner,
        "run_dir": str(run_dir),
        "run_dir_identity": [seen.st_dev, seen.st_ino],
        "version": "2",
        "run_id": run_dir.name,
        "task_branch": "task",
        "revision": "0" * 40,
        "expiries": [],
        "leases": [],
        "mounts": [],
        "spools": [{"lease_id": f"lease{i}", "target": f"/run/spool{i}", "source": s} for i, s in enumerate(spools)],
        "materializations": materializations,
    }


def _limits(groups: list[str]) -> dict[str, Any]:
    return {"mechanism": "cgroup-v2", "groups": groups, "procs_files": [], "rlimits": [], "memory_mib": 64, "pids": 64}


def _plant(sandboxes: Path, record: dict[str, Any], *, mode: int = 0o700) -> None:
    directory = sandboxes / record["id"]
    directory.mkdir(mode=mode)
    directory.chmod(mode)
    (directory / "record.json").write_text(json.dumps(record))
    (directory / "lock").write_bytes(b"")
    for path in (directory / "record.json", directory / "lock"):
        path.chmod(0o666 if mode == 0o777 else 0o600)


def _alive(process: subprocess.Popen[bytes]) -> bool:
    return process.poll() is None


# ------------------------------------------------------------------ a state dir another account made


@pytest.fixture
def planted(
    accounts: tuple[pwd.struct_passwd, pwd.struct_passwd],
) -> Iterator[tuple[Path, Path, subprocess.Popen[bytes]]]:
    """The attacker's state dir (world-writable, as it must be for the victim to use it), with a
    forged record naming the victim's file (a materialization of a run directory of the
    victim's) and the victim's process (as the sandbox's init, its pid namespace the host's);
    the victim's file, and its process."""
    attacker, victim = accounts
    root = Path(tempfile.mkdtemp(prefix="sbx-plant-", dir="/tmp"))
    root.chmod(0o755)
    home = root / "victim"
    run_dir = home / "run-1"
    run_dir.mkdir(parents=True)
    for path, mode in ((home, 0o755), (run_dir, 0o700)):
        os.chown(path, victim.pw_uid, victim.pw_gid)
        path.chmod(mode)
    precious = run_dir / "precious"
    precious.write_bytes(b"the victim's work\n")
    os.chown(precious, victim.pw_uid, victim.pw_gid)
    sleeper = subprocess.Popen([*_as(victim), "sleep", "300"])
    try:
        settled = time.monotonic() + 10
        while (
            procs.start_time(sleeper.pid) is None or b"sleep" not in Path(f"/proc/{sleeper.pid}/cmdline").read_bytes()
        ):
            assert time.monotonic() < settled
            time.sleep(0.01)
        state = root / "planted"
        sandboxes = state / "sandboxes"
        sandboxes.mkdir(parents=True)
        record = _record(
            FORGED_ID,
            consumed=True,
            manifest=_manifest(run_dir, owner=victim.pw_uid, materializations=[str(precious)], spools=[]),
            **_processes(init=sleeper.pid, namespace=procs.namespace_inode(os.getpid(), "pid")),
        )
        _plant(sandboxes, record, mode=0o777)
        (sandboxes / ".lock").write_bytes(b"")
        for path in (state, sandboxes, sandboxes / ".lock"):
            os.chown(path, attacker.pw_uid, attacker.pw_gid)
            path.chmod(0o666 if path.is_file() else 0o777)
        for path in (sandboxes / FORGED_ID, sandboxes / FORGED_ID / "record.json", sandboxes / FORGED_ID / "lock"):
            os.chown(path, attacker.pw_uid, attacker.pw_gid)
        yield state, precious, sleeper
    finally:
        sleeper.kill()
        sleeper.wait()
        subprocess.run(["rm", "-rf", str(root)], check=False)


@pytest.mark.parametrize(
    ("argv", "in_process"),
    [(["gc"], False), (["list"], False), (["gc"], True), (["list", "--json"], True)],
    ids=["gc-client", "list-client", "gc-no-service", "list-no-service"],
)
def test_a_planted_state_dir_is_refused_and_its_record_harms_nothing(
    accounts: tuple[pwd.struct_passwd, pwd.struct_passwd],
    planted: tuple[Path, Path, subprocess.Popen[bytes]],
    argv: list[str],
    in_process: bool,
) -> None:
    attacker, victim = accounts
    state, precious, sleeper = planted
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(precious.parent.parent),
        "LANG": "C.UTF-8",
        "PYTHONPATH": str(REPO),
        "SANDBOXER_STATE": str(state),
        "SANDBOXER_CONFIG": str(precious.parent.parent / "config"),
    }
    if in_process:
        env["SANDBOXER_NO_SERVICE"] = "1"
    done = subprocess.run(
        [*_as(victim), sys.executable, "-m", "sandboxer", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
        cwd="/",
    )
    assert done.returncode == 3, done.stderr
    if "--json" in argv:
        assert json.loads(done.stdout)["error"]["kind"] == "policy"
    else:
        assert done.stdout == ""
    assert done.stderr.splitlines() == [
        f"sandboxer: state dir {state}: owned by uid {attacker.pw_uid}, must be this account's (uid {victim.pw_uid}) "
        "(hint: a state dir must be this account's own directory, mode 0700 (root's may be 0711), below "
        "directories owned by root or this account that nobody else may write to (unless sticky, as /tmp); "
        "docs/security.md)"
    ]
    assert precious.read_bytes() == b"the victim's work\n"
    assert _alive(sleeper)
    assert (state / "sandboxes" / FORGED_ID / "record.json").exists()  # nothing of it was touched
    assert not (state / "service.log").exists()  # and no private service was started there


def test_the_embedded_broker_refuses_a_planted_state_dir(
    accounts: tuple[pwd.struct_passwd, pwd.struct_passwd],
    planted: tuple[Path, Path, subprocess.Popen[bytes]],
) -> None:
    attacker, victim = accounts
    state, precious, sleeper = planted
    code = (
        "import sys\nfrom sandboxer import Broker\nfrom sandboxer.errors import PolicyError\n"
        "try:\n    Broker(state_dir=sys.argv[1], config_dir='/nonexistent').gc()\n"
        "except PolicyError as exc:\n    print(exc.status, exc.message)\n"
    )
    env = {"PATH": "/usr/bin:/bin", "HOME": "/", "LANG": "C.UTF-8", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [*_as(victim), sys.executable, "-c", code, str(state)], capture_output=True, text=True, env=env, check=False
    )
    assert done.stdout == (
        f"3 state dir {state}: owned by uid {attacker.pw_uid}, must be this account's (uid {victim.pw_uid})\n"
    ), done.stderr
    assert precious.exists()
    assert _alive(sleeper)


# ------------------------------------------------------------------------ root's own state dir


def test_roots_gc_follows_no_forged_record_out_of_its_sandbox(sb_root: SandboxBroker) -> None:
    """Forged records in root's own state dir (root wrote them: a bug, a restored backup, a
    compromise of the broker's account): gc confines every path to the sandbox's own directory
    and the broker's own cgroups, and signals only processes it can tell are the sandbox's."""
    healthy = sb_root.create()
    outside = Path(tempfile.mkdtemp(prefix="sbx-outside-", dir="/tmp"))
    run_dir = outside / "run-7"
    run_dir.mkdir(mode=0o700)
    run_dir.chmod(0o700)
    victim_file = outside / "victim-file"
    victim_file.write_bytes(b"not the run's\n")
    victim_spool = outside / "victim-spool"
    victim_spool.mkdir()
    (victim_spool / "kept").write_bytes(b"kept\n")
    victim_group = outside / "victim-empty-dir"  # a cgroup's rmdir would take an empty directory
    victim_group.mkdir()
    unrelated = subprocess.Popen(["sleep", "300"])
    # A pid namespace of its own, as a bwrap's: its pid 1 (unshare's fork) and a sleeper in it.
    namespaced = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "sleep", "300"])
    try:
        settled = time.monotonic() + 10
        while not procs.children(namespaced.pid) or procs.start_time(unrelated.pid) is None:
            assert time.monotonic() < settled
            time.sleep(0.01)
        inner = procs.children(namespaced.pid)[0]
        inner_namespace = procs.namespace_inode(inner, "pid")
        assert inner_namespace is not None
        assert inner_namespace != procs.namespace_inode(os.getpid(), "pid")
        sandboxes = sb_root.state / "sandboxes"
        forged = _record(
            FORGED_ID,
            consumed=True,
            manifest=_manifest(
                run_dir,
                owner=0,
                materializations=[f"{run_dir}/../victim-file"],
                spools=[str(victim_spool)],
            ),
            limits=_limits([str(victim_group)]),
            **_processes(bwrap=unrelated.pid, init=inner, namespace=inner_namespace),
        )
        _plant(sandboxes, forged)
        os.chmod(sandboxes / FORGED_ID, 0o711)  # noqa: S103 - as root's sandbox directories are
        collected = sb_root.run("gc", "--json")
        assert collected.status == 6, collected.stderr  # what it left alone is said, as residue
        document = json.loads(collected.stdout)
        assert document["healthy"] == [healthy]
        (receipt,) = [r for r in document["collected"] if r["id"] == FORGED_ID]
        assert f"spool {victim_spool}: not where this sandbox's spool is, left alone" in receipt["residue"]
        assert (
            f"materialization {run_dir}/../victim-file: not below the run directory, left alone" in receipt["residue"]
        )
        assert any(line.startswith(f"cgroup {victim_group}: not this sandbox's") for line in receipt["residue"])
        assert victim_file.read_bytes() == b"not the run's\n"
        assert (victim_spool / "kept").read_bytes() == b"kept\n"
        assert victim_group.is_dir()
        assert _alive(unrelated)
        assert _alive(namespaced)
        assert procs.start_time(inner) is not None
        assert not (sandboxes / FORGED_ID).exists()  # its own directory went
        # The real sandbox beside them: still healthy, its namespace believed (its init is pid 1
        # there and carries its bwrap's marker), and its teardown finds all of it.
        assert sb_root.exec(healthy, "true").status == 0
        real = read_record(json.loads((sandboxes / healthy / "record.json").read_text()))
        assert real.processes is not None
        assert real.processes.pid_namespace is not None
        assert procs.sandbox_namespace(healthy, real.processes) == real.processes.pid_namespace
        assert procs.sandbox_namespace(FORGED_ID, real.processes) is None  # another id's marker
        torn = sb_root.run("teardown", "--discard", "--json", healthy)
        assert torn.status == 0, torn.stderr
        assert json.loads(torn.stdout)["residue"] == []
    finally:
        for process in (unrelated, namespaced):
            process.kill()
            process.wait()
        subprocess.run(["rm", "-rf", str(outside)], check=False)


def test_roots_gc_removes_no_container_a_record_names_but_it_did_not_make(sb_root: SandboxBroker) -> None:
    reason = docker_skip_reason()
    if reason is not None:
        pytest.skip(reason)

    client = docker.from_env()
    images = [tag for image in client.images.list() for tag in image.tags if tag.startswith("sandboxer-base")]
    if not images:
        pytest.skip("no local sandboxer-base image (the Docker tests build it)")
    bystander = client.containers.create(images[0], ["true"], name=f"sbx-bystander-{_WORKER or 'main'}-{os.getpid()}")
    try:
        sandboxes = sb_root.state / "sandboxes"
        sandboxes.mkdir(exist_ok=True)
        _plant(sandboxes, _record(DOCKER_ID, backend="docker", container_id=bystander.id))
        collected = sb_root.run("gc", "--json")
        assert collected.status == 6, collected.stderr
        (receipt,) = [r for r in json.loads(collected.stdout)["collected"] if r["id"] == DOCKER_ID]
        assert receipt["residue"] == [
            f"container {bystander.id[:12]}: not this sandbox's container (its labels say otherwise), left alone"
        ]
        bystander.reload()  # still there
    finally:
        bystander.remove(force=True)
