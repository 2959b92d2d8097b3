"""What the review of the lease code asked for, proved on the real CLI: teardown never removes
through a run directory someone swapped; staged lease sources are passable only by their sandbox;
Docker binds the staged mounts, never a path in the run directory; a request spooled as a
directory is refused like any bad request; one run is one sandbox."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import (
    UNPRIVILEGED_UID,
    Endpoints,
    SandboxBroker,
    _cleanup,
    make_broker,
)
from tests.integration.test_dispatch_tool import SPOOL, assert_terminal, dispatch, setup
from tests.integration.test_manifest_sandboxes import SHARED_NOTE, create, docker, make_run, prepare, record_of
from tests.manifest_samples import PROVIDER_ENV, REQUEST, SHARED, Run, build_run, write_file


def test_teardown_leaves_the_run_alone_when_its_directory_was_swapped(sbx_root: SandboxBroker, base: Path) -> None:
    broker = sbx_root
    run = make_run(base, broker)
    sandbox_id = create(broker, run)
    token = run.source(PROVIDER_ENV)
    # The run's parent is moved away and replaced by a symlink to a look-alike the broker must
    # never delete from.
    moved = base / "managed-moved"
    os.rename(base / "managed", moved)
    decoy = base / "decoy"
    (decoy / run.run_dir.name / "materializations").mkdir(parents=True)
    decoy_token = decoy / run.run_dir.name / "materializations" / token.name
    decoy_token.write_bytes(b"must survive")
    (base / "managed").symlink_to(decoy)
    receipt = broker.run("teardown", sandbox_id, "--json")
    assert receipt.status == 6, receipt.stderr
    residue = receipt.json()["residue"]
    assert any(item.startswith(f"materialization {token}") for item in residue), residue
    assert decoy_token.read_bytes() == b"must survive"
    assert (moved / run.run_dir.name / "materializations" / token.name).exists()
    assert not broker.sandbox_dir(sandbox_id).exists()


def _leased(broker: SandboxBroker, base: Path) -> tuple[Run, str, dict[str, Any], Path]:
    """A sandbox of a complete run: the run, the sandbox's id, its record, its staging dir."""
    run = make_run(base, broker)
    sandbox_id = create(broker, run)
    return run, sandbox_id, record_of(broker, sandbox_id), broker.sandbox_dir(sandbox_id) / "leases"


def _mount_points() -> list[str]:
    return [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]


def test_staged_lease_sources_are_passable_only_by_their_sandbox(sb_root: SandboxBroker, base: Path) -> None:
    broker = sb_root
    run, sandbox_id, record, staging = _leased(broker, base)
    info = os.stat(staging)
    assert stat.S_IMODE(info.st_mode) == 0o710
    assert (info.st_uid, info.st_gid) == (0, record["host_gid"])
    spools = os.stat(broker.sandbox_dir(sandbox_id) / "spools")
    assert stat.S_IMODE(spools.st_mode) == 0o710
    assert (spools.st_uid, spools.st_gid) == (0, record["host_gid"])
    assert str(staging) in _mount_points()  # a private mount of its own
    seen = broker.exec(sandbox_id, "cat", f"{run.doc['leases'][SHARED]['materializations'][0]['target_path']}/note.txt")
    assert seen.status == 0, seen.stderr
    assert broker.run("teardown", sandbox_id).status == 0
    assert not [point for point in _mount_points() if point.startswith(str(staging))]


def test_docker_binds_the_staged_lease_mounts_never_a_path_in_the_run(docker_root: SandboxBroker, base: Path) -> None:
    broker = docker_root
    run, sandbox_id, record, staging = _leased(broker, base)
    target = run.doc["leases"][SHARED]["materializations"][0]["target_path"]
    attrs = json.loads(docker("inspect", record["container_id"]))[0]
    (bound,) = [m for m in attrs["Mounts"] if m["Destination"] == target]
    assert Path(bound["Source"]).parent == staging  # the broker's own mount of the checked source
    assert bound["RW"] is False
    assert bound["Source"] in _mount_points()
    assert not any(str(run.run_dir) in str(m["Source"]) for m in attrs["Mounts"])
    # Swapping the source in the run directory afterwards changes nothing the sandbox sees.
    source = run.source(SHARED)
    os.rename(source, source.with_name("moved-away"))
    decoy = base / "decoy"
    decoy.mkdir()
    (decoy / "note.txt").write_text("decoy\n")
    source.symlink_to(decoy)
    seen = broker.exec(sandbox_id, "cat", f"{target}/note.txt")
    assert seen.status == 0, seen.stderr
    assert seen.stdout.encode() == SHARED_NOTE
    evidence = broker.run("inspect", sandbox_id, "--json")
    assert evidence.status == 0, evidence.stderr
    assert evidence.json()["matches_plan"] is True, evidence.json()["differences"]
    torn = broker.run("teardown", sandbox_id, "--json")
    assert torn.status == 0, torn.stderr
    assert (decoy / "note.txt").read_text() == "decoy\n"  # the symlink went, never what it points at
    assert not [point for point in _mount_points() if point.startswith(str(staging))]


def test_a_bwrap_spool_is_a_bounded_tmpfs_of_its_own(sb_root: SandboxBroker, base: Path) -> None:
    broker = sb_root
    run = make_run(base, broker)
    sandbox_id = create(broker, run)
    (spool,) = record_of(broker, sandbox_id)["manifest"]["spools"]
    host_view = [
        line for line in Path("/proc/self/mountinfo").read_text().splitlines() if line.split()[4] == spool["source"]
    ]
    assert len(host_view) == 1, host_view
    assert " - tmpfs " in host_view[0]
    assert all(flag in host_view[0].split()[5].split(",") for flag in ("nosuid", "nodev", "noexec"))
    # The consumer cannot write more than the spool's 64 MiB, however it tries.
    filled = broker.sh(sandbox_id, f"head -c 80M /dev/zero > {SPOOL}/requests/big; echo $?; df -k {SPOOL} | tail -1")
    lines = filled.stdout.splitlines()
    assert lines[0] != "0", filled.stdout
    assert "No space left on device" in filled.stderr
    assert int(lines[1].split()[1]) == 64 * 1024  # the tmpfs's size, in KiB
    assert (Path(spool["source"]) / "requests" / "big").stat().st_size <= 64 * 1024 * 1024
    torn = broker.run("teardown", sandbox_id, "--json")
    assert torn.status == 0, torn.stderr
    assert f"spool {spool['source']}" in torn.json()["removed"]
    assert not [point for point in _mount_points() if point.startswith(str(broker.sandbox_dir(sandbox_id)))]


def test_a_directory_spooled_as_a_request_is_refused(sbx_root: SandboxBroker, base: Path, endpoints: Endpoints) -> None:
    broker = sbx_root
    _, sandbox_id = setup(broker, base, endpoints)
    made = broker.sh(sandbox_id, f"cd {SPOOL}/requests && mkdir d.json && touch d.json/x")
    assert made.status == 0, made.stderr
    result = dispatch(broker, sandbox_id, "d")
    assert_terminal(result)
    assert "internal error" not in result.stderr


def test_one_run_is_one_sandbox(sbx_root: SandboxBroker, base: Path) -> None:
    broker = sbx_root
    run = make_run(base, broker)
    create(broker, run)
    again = broker.run("create", "--profile", broker.profile, "--manifest", str(run.assignment))
    assert again.status == 3, again.stderr
    assert "already has sandbox" in again.stderr


def test_an_unprivileged_broker_grants_leases_but_no_request_spool(runtime_dir: Path) -> None:
    """An ordinary user's broker binds the leases of a run it owns; a tool-request lease it
    refuses (3), since only root can make spool files that are not the consumer's."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root to run the broker as another user (setpriv)")
    broker = make_broker(runtime_dir, as_user=True)
    base = Path(tempfile.mkdtemp(prefix="lh-user-", dir="/tmp"))  # reachable by that user
    try:
        base.chmod(0o755)
        run = build_run(base, "2")
        prepare(run, broker)
        write_file(run.source(SHARED) / "note.txt", SHARED_NOTE, 0o644)
        run.save()
        subprocess.run(["chown", "-R", f"{UNPRIVILEGED_UID}:{UNPRIVILEGED_UID}", str(base / "managed")], check=True)
        refused = broker.run("create", "--profile", broker.profile, "--manifest", str(run.assignment))
        assert refused.status == 3, refused.stderr
        assert "root broker" in refused.stderr
        del run.doc["leases"][REQUEST]
        run.save()
        sandbox_id = create(broker, run)
        shared = run.doc["leases"][SHARED]["materializations"][0]["target_path"]
        seen = broker.exec(sandbox_id, "/bin/sh", "-c", f"cat {shared}/note.txt; touch {shared}/x")
        assert seen.stdout.encode() == SHARED_NOTE
        assert seen.status != 0  # read-only
        receipt = broker.run("teardown", sandbox_id, "--json")
        assert receipt.status == 0, receipt.stderr
        assert receipt.json()["residue"] == []
        assert not run.source(SHARED).exists()
    finally:
        _cleanup(broker)
        shutil.rmtree(base, ignore_errors=True)
