"""The Docker backend through the real CLI and the Engine API (needs a running Docker daemon)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest

from sandboxer.backends.docker.render import verify
from sandboxer.core.record_reading import read_record
from tests.conftest import settled
from tests.integration.conftest import SandboxBroker, _cleanup, make_broker, profile_text
from tests.samples import CONTRACT_ENV_NAMES

REPO = Path(__file__).resolve().parents[2]
PROFILE = "docker-local"


def _engine() -> Any:
    try:
        client = docker.from_env(timeout=30)
        client.ping()
    except Exception as exc:  # any reason the daemon cannot be reached
        pytest.skip(f"no Docker daemon answers ({type(exc).__name__}); scripts/start-dockerd says why")
    if os.geteuid() != 0:
        pytest.skip("the Docker backend needs a root broker")
    return client


@pytest.fixture(scope="session")
def base_image() -> str:
    """The local base image, built from the host's files (never pulled)."""
    _engine()
    script = [sys.executable, str(REPO / "scripts" / "build-base-image")]
    built = subprocess.run(script, capture_output=True, text=True, check=False)
    assert built.returncode == 0, built.stderr
    return built.stdout.strip()


@pytest.fixture
def db(runtime_dir: Path, base_image: str) -> Iterator[SandboxBroker]:
    """A broker with an approved ext.docker config and a Docker profile."""
    broker = make_broker(runtime_dir, as_user=False)
    digest = broker.run("runtime", "digest", str(runtime_dir)).stdout.strip()
    (broker.config / "extensions" / "ext.docker.yaml").write_text(
        f'extension: ext.docker\nconfig:\n  image: "{base_image}"\n  runtime:\n'
        f"    path: {runtime_dir}\n    sha256: {digest}\n"
    )
    broker.write_profile(PROFILE, profile_text(PROFILE, broker.repo).replace("ext.bwrap", "ext.docker"))
    for name in ("ext.docker", PROFILE):
        assert broker.run("ext", "approve", name).status == 0
    try:
        yield broker
    finally:
        _cleanup(broker)


def test_docker_sandbox_is_the_same_plan_inside(db: SandboxBroker) -> None:
    created = db.run("create", "--profile", PROFILE, "--json")
    assert created.status == 0, created.stderr
    sandbox_id = created.json()["id"]
    db.created.append(sandbox_id)
    assert created.json()["backend"] == "docker"
    inside = db.sh(
        sandbox_id,
        "id -u; id -g; pwd; python3 -c 'import sys; print(sys.prefix)'; "
        "for d in $HOME $XDG_CONFIG_HOME $XDG_CACHE_HOME $XDG_STATE_HOME $TMPDIR; do stat -c '%a %u %n' $d; done; "
        "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '; env | cut -d= -f1 | sort | tr '\\n' ' '",
    )
    assert inside.status == 0, inside.stderr
    lines = inside.stdout.splitlines()
    assert lines[:4] == ["1000", "1000", "/workspace", "/opt/sandboxer/runtime"]
    assert [line.split()[:2] for line in lines[4:9]] == [["700", "1000"]] * 5
    assert [line.split()[2] for line in lines[4:9]] == [
        "/run/sandboxer/state/home",
        "/run/sandboxer/state/config",
        "/run/sandboxer/state/cache",
        "/run/sandboxer/state/data",
        "/run/sandboxer/state/tmp",
    ]
    assert lines[9] == "lo"
    # `env` run by sh also sees the PWD the shell exports
    assert lines[10].split() == sorted([*CONTRACT_ENV_NAMES, "PWD"])
    write = db.exec(sandbox_id, "touch", "/opt/sandboxer/runtime/x")
    assert write.status != 0
    assert "Read-only file system" in write.stderr
    assert db.sh(sandbox_id, "echo kept > $HOME/n").status == 0
    assert db.sh(sandbox_id, "cat $HOME/n").stdout == "kept\n"
    assert db.exec(sandbox_id, "git", "-C", "/workspace", "status", "--porcelain").stdout == ""


def test_docker_exec_statuses_streams_and_timeout(db: SandboxBroker) -> None:
    sandbox_id = db.create(PROFILE)
    assert db.sh(sandbox_id, "exit 7").status == 7
    assert db.sh(sandbox_id, "kill -9 $$").status == 137
    assert db.exec(sandbox_id, "no-such-program").status == 127
    assert db.exec(sandbox_id, "/etc/passwd").status == 126
    blob = os.urandom(1 << 20)
    echoed = subprocess.run(
        db.argv("exec", sandbox_id, "--", "cat"), input=blob, capture_output=True, env=db.env(), check=False
    )
    assert echoed.returncode == 0
    assert echoed.stdout == blob
    started = time.monotonic()
    timed = db.exec(sandbox_id, "sh", "-c", "sleep 57.31", options=("--timeout", "1"))
    assert timed.status == 124
    assert time.monotonic() - started < 10

    def left() -> str:
        return subprocess.run(
            ["pgrep", "-f", "sleep 57.31"], capture_output=True, text=True, check=False
        ).stdout.strip()

    assert settled(left, "") == ""


def test_engine_inspect_shows_the_policy(db: SandboxBroker) -> None:
    sandbox_id = db.create(PROFILE)
    record = json.loads((db.sandbox_dir(sandbox_id) / "record.json").read_text())
    attrs = _engine().api.inspect_container(record["container_id"])
    host = attrs["HostConfig"]
    assert host["ReadonlyRootfs"] is True
    assert host["NetworkMode"] == "none"
    assert host["CapDrop"] == ["ALL"]
    assert not host["CapAdd"]
    assert "no-new-privileges:true" in host["SecurityOpt"]
    assert not any("unconfined" in opt for opt in host["SecurityOpt"])
    assert host["Privileged"] is False
    assert attrs["Config"]["User"] == "1000:1000"
    assert not any("docker.sock" in str(m.get("Source")) for m in attrs["Mounts"])
    evidence = db.run("inspect", sandbox_id, "--json").json()
    assert evidence["matches_plan"] is True
    assert evidence["network"]["interfaces"] == ["lo"]
    assert evidence["user"]["uid"] == 1000
    assert evidence["capabilities"]["effective"] == "0" * 16
    assert evidence["runtime"]["read_only"] is True
    remapped = any("userns" in option for option in _engine().info().get("SecurityOptions", []))
    host_uid = evidence["docker"]["host_uid"]
    if remapped:  # the daemon maps the container's 1000 to a subordinate uid of its own
        assert host_uid not in (None, 0, 1000)
    else:
        assert host_uid == 1000  # the sandbox uid itself on the host (docs/docker.md says so)


def test_a_container_altered_outside_the_broker_fails_verification(db: SandboxBroker, tmp_path: Path) -> None:

    sandbox_id = db.create(PROFILE)
    record = json.loads((db.sandbox_dir(sandbox_id) / "record.json").read_text())
    attrs = _engine().api.inspect_container(record["container_id"])
    plan = read_record(record).plan_for(str(db.sandbox_dir(sandbox_id) / "workspace"))
    etc_dir = str(db.sandbox_dir(sandbox_id) / "etc")
    assert verify(attrs, plan, etc_dir=etc_dir) == []
    extra = {"Type": "bind", "Source": str(tmp_path), "Destination": "/mnt/extra", "RW": True}
    altered = {**attrs, "Mounts": [*attrs["Mounts"], extra]}
    assert any("/mnt/extra" in problem for problem in verify(altered, plan, etc_dir=etc_dir))
    loosened = {**attrs, "HostConfig": {**attrs["HostConfig"], "ReadonlyRootfs": False, "CapAdd": ["NET_ADMIN"]}}
    problems = verify(loosened, plan, etc_dir=etc_dir)
    assert "root filesystem is writable" in problems
    assert "capabilities are not all dropped" in problems


def test_missing_image_is_an_error_naming_it(db: SandboxBroker, runtime_dir: Path, tmp_path: Path) -> None:
    """An image gone after its config was approved (approval refuses one that is not there)."""
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "marker").write_text(f"{tmp_path}\n")  # an image of its own, to remove
    packed = subprocess.run(["tar", "-C", str(tmp_path / "tree"), "-c", "."], capture_output=True, check=True)
    imported = subprocess.run(["docker", "import", "-"], input=packed.stdout, capture_output=True, check=True)
    absent = imported.stdout.decode().strip()
    text = (db.config / "extensions" / "ext.docker.yaml").read_text()
    image_line = next(line for line in text.splitlines() if "image:" in line)
    (db.config / "extensions" / "ext.docker.yaml").write_text(text.replace(image_line, f'  image: "{absent}"'))
    assert db.run("ext", "approve", "ext.docker").status == 0
    subprocess.run(["docker", "rmi", "-f", absent], capture_output=True, check=True)
    result = db.run("create", "--profile", PROFILE)
    assert result.status == 5
    assert absent in result.stderr
    assert "never pulled" in result.stderr
    assert os.listdir(db.state / "sandboxes") == [".lock"] or not [
        n for n in os.listdir(db.state / "sandboxes") if not n.startswith(".")
    ]


def test_create_killed_midway_is_cleaned_by_gc_and_teardown_removes_the_container(db: SandboxBroker) -> None:
    engine = _engine()
    label = f"io.sandboxer.state-dir={db.state}"
    started = time.monotonic()
    healthy = db.create(PROFILE)
    duration = time.monotonic() - started
    # Kill creates at points inside the time one takes; a create that still finished is healthy.
    for fraction in (0.2, 0.45, 0.7, 0.9):
        proc = subprocess.Popen(db.argv("create", "--profile", PROFILE), env=db.env(), stdout=subprocess.DEVNULL)
        time.sleep(duration * fraction)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    collected = db.run("gc", "--json")
    assert collected.status == 0, collected.stderr
    report = collected.json()
    assert healthy in report["healthy"]
    assert report["collected"], "no create was killed midway: the delays missed every create"
    assert all(not item["residue"] for item in report["collected"]), report
    containers = engine.api.containers(all=True, filters={"label": label})
    assert sorted(c["Labels"]["io.sandboxer.sandbox"] for c in containers) == sorted(report["healthy"]), report
    left = sorted(n for n in os.listdir(db.state / "sandboxes") if not n.startswith("."))
    assert left == sorted(report["healthy"])
    for other in report["healthy"]:
        if other != healthy:
            assert db.run("teardown", other).status == 0
    assert db.exec(healthy, "true").status == 0
    receipt = db.run("teardown", healthy, "--json")
    assert receipt.status == 0, receipt.stderr
    assert any(item.startswith("container ") for item in receipt.json()["removed"])
    assert engine.api.containers(all=True, filters={"label": label}) == []
