"""The core's own logic, through the Python API, on a fake backend (tests/unit/fake_backend.py):
admission, the create → ready → teardown states, rollback when a start fails, and what gc
collects or leaves. Real config files, approvals, runtime pins and git clones; no namespace or
container, so each test takes a fraction of a second.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sandboxer import Broker
from sandboxer.errors import BackendError, PolicyError
from tests.conftest import make_repository, make_runtime
from tests.samples import profile_yaml
from tests.unit.fake_backend import FakeBackend


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeBackend:
    backend = FakeBackend()
    monkeypatch.setattr("sandboxer.backends.backend_for", lambda name: backend)
    return backend


@pytest.fixture
def broker(tmp_path: Path, fake: FakeBackend) -> Broker:
    """A config dir with an approved extension and profile, and a repository to clone."""
    runtime = make_runtime(tmp_path / "runtime")
    repo = make_repository(tmp_path / "repo", {"README.md": b"workspace\n"})
    config = tmp_path / "config"
    (config / "extensions").mkdir(parents=True)
    (config / "profiles").mkdir()
    config.chmod(0o700)
    made = Broker(config_dir=str(config), state_dir=str(tmp_path / "state"))
    digest = made.owner.runtime_digest(str(runtime)).sha256
    (config / "extensions" / "ext.bwrap.yaml").write_text(
        f"extension: ext.bwrap\nconfig:\n  runtime:\n    path: {runtime}\n    sha256: {digest}\n"
    )
    (config / "profiles" / "p.yaml").write_text(profile_yaml("p", str(repo)))
    made.owner.approve("ext.bwrap")
    made.owner.approve("p")
    return made


def _left(broker: Broker) -> list[str]:
    sandboxes = Path(broker.state_dir) / "sandboxes"
    return sorted(p.name for p in sandboxes.iterdir() if not p.name.startswith(".")) if sandboxes.exists() else []


def test_create_teardown_walks_the_states_and_leaves_nothing(broker: Broker, fake: FakeBackend) -> None:
    sandbox = broker.create("p")
    assert sandbox.created is not None
    assert (sandbox.created.profile, sandbox.created.backend, sandbox.created.limits) == ("p", "bwrap", "fake")
    assert [(info.id, info.status) for info in broker.list()] == [(sandbox.id, "running")]
    clone = Path(broker.state_dir) / "sandboxes" / sandbox.id / "workspace"
    assert (clone / "README.md").read_text() == "workspace\n"
    assert [verb for verb, _ in fake.calls] == ["preflight", "admit", "start"]
    receipt = sandbox.teardown()
    assert receipt.residue == ()
    assert "fake processes" in receipt.removed
    assert any(item.startswith("sandbox dir ") for item in receipt.removed)
    assert [verb for verb, _ in fake.calls][-2:] == ["stop", "release"]
    assert _left(broker) == []
    assert broker.list() == []


def test_a_failed_start_is_rolled_back(broker: Broker, fake: FakeBackend) -> None:
    fake.fail_start = "the fake engine refused"
    with pytest.raises(BackendError, match="the fake engine refused") as raised:
        broker.create("p")
    assert raised.value.status == 5
    started = [sandbox_id for verb, sandbox_id in fake.calls if verb == "start"]
    assert len(started) == 1
    assert ("stop", started[0]) in fake.calls
    assert ("release", started[0]) in fake.calls
    assert _left(broker) == []


def test_admission_refuses_before_anything_is_made(broker: Broker, fake: FakeBackend) -> None:
    broker.owner.revoke("p")
    with pytest.raises(PolicyError, match="p is not approved"):
        broker.create("p")
    assert fake.calls == []
    assert _left(broker) == []
    profile = Path(broker.config_dir) / "profiles" / "p.yaml"
    broker.owner.approve("p")
    profile.write_text(profile.read_text() + "# one byte more\n")
    with pytest.raises(PolicyError, match="changed since it was approved"):
        broker.create("p")
    assert [verb for verb, _ in fake.calls] == []


def test_gc_collects_the_dead_and_leaves_the_running_and_the_unknown(broker: Broker, fake: FakeBackend) -> None:
    alive, dead, silent = (broker.create("p") for _ in range(3))
    fake.running.discard(dead.id)  # its processes died
    fake.unknown.add(silent.id)  # its engine does not answer
    assert {info.id: info.status for info in broker.list()} == {
        alive.id: "running",
        dead.id: "dead",
        silent.id: "unknown",
    }
    report = broker.gc()
    assert [(receipt.id, receipt.residue) for receipt in report.collected] == [(dead.id, ())]
    assert report.healthy == (alive.id,)
    assert report.busy == (silent.id,)
    assert _left(broker) == sorted([alive.id, silent.id])
    assert broker.gc().collected == ()  # nothing more to do


def test_a_broken_record_is_collected_as_residue_not_a_crash(broker: Broker, fake: FakeBackend) -> None:
    sandbox = broker.create("p")
    fake.running.discard(sandbox.id)
    other = broker.create("p")
    (Path(broker.state_dir) / "sandboxes" / sandbox.id / "record.json").write_text("{not json")
    report = broker.gc()
    ids = {receipt.id for receipt in report.collected}
    assert sandbox.id in ids
    assert report.healthy == (other.id,)
