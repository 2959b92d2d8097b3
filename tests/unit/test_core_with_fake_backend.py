"""The core's own logic, through the Python API, on a fake backend (tests/unit/fake_backend.py):
admission, the create → ready → teardown states, rollback when a start fails, what gc collects
or leaves, and what of a lease manifest is the backend's to decide (service images, where a
spool lives, making, finding and removing it, an engine's orphans). Real config files,
approvals, runtime pins, manifests and git clones; no namespace, container or tmpfs, so each
test takes a fraction of a second.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from sandboxer import Broker
from sandboxer.api import results
from sandboxer.api.results import Receipt
from sandboxer.backends import Backends
from sandboxer.backends.bwrap.backend import BwrapBackend
from sandboxer.backends.docker.backend import DockerBackend
from sandboxer.commands import owner, teardown, warm
from sandboxer.commands.dispatch import dispatch
from sandboxer.commands.services import Services
from sandboxer.commands.teardown import receipt_of, residue_error
from sandboxer.core import leases
from sandboxer.core import manifest as mf
from sandboxer.core.plan import MountKind
from sandboxer.core.removal import Removal
from sandboxer.errors import BackendError, PolicyError, UnexportedWorkError, UsageError
from sandboxer.host.registry import Registry
from sandboxer.service.audit import AuditLog
from sandboxer.service.lifetimes import RETRY_EXPORT, Reaper
from tests.conftest import make_repository, make_runtime
from tests.manifest_samples import IMAGE_APP, REQUEST, RUN_ID, Run, build_run, fake_document, render
from tests.samples import profile_yaml
from tests.unit.fake_backend import FakeBackend, FakePublish


@pytest.fixture
def fake() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def broker(tmp_path: Path, fake: FakeBackend) -> Broker:
    """A config dir with an approved extension and profile, and a repository to clone."""
    runtime = make_runtime(tmp_path / "runtime")
    repo = make_repository(tmp_path / "repo", {"README.md": b"workspace\n"})
    config = tmp_path / "config"
    (config / "extensions").mkdir(parents=True)
    (config / "profiles").mkdir()
    config.chmod(0o700)
    engines = Backends({"bwrap": fake, "docker": fake})  # given to the core, not patched in
    made = Broker(config_dir=str(config), state_dir=str(tmp_path / "state"), backends=engines)
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
    assert [verb for verb, _ in fake.calls] == ["preflight", "admit", "start", "run"]  # list asks its git
    receipt = sandbox.teardown(discard=True)  # the fake runs no command: no git to ask about work
    assert receipt.residue == ()
    assert "fake processes" in receipt.removed
    assert any(item.startswith("sandbox dir ") for item in receipt.removed)
    assert [verb for verb, _ in fake.calls][-2:] == ["stop", "release"]
    assert _left(broker) == []
    assert broker.list() == []


def test_teardown_keeps_a_sandbox_whose_work_cannot_be_checked(broker: Broker, fake: FakeBackend) -> None:
    """A running sandbox whose git cannot answer (the fake runs no command) is refused as work
    that would be lost (2), and stays; once its processes are gone nothing can be exported from
    it, so teardown goes ahead without --discard."""
    sandbox = broker.create("p")
    with pytest.raises(UnexportedWorkError, match="its work cannot be checked") as refused:
        sandbox.teardown()
    assert refused.value.status == 2
    assert _left(broker) == [sandbox.id]
    assert "stop" not in [verb for verb, _ in fake.calls]
    fake.running.discard(sandbox.id)
    assert sandbox.teardown().residue == ()
    assert _left(broker) == []


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


# ------------------------------------------------------------------ leases: what the backend decides

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="a request spool needs a root broker")


@pytest.fixture
def run(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, broker: Broker) -> Run:
    """The sample run (v2) fitted to the broker's profile: its repository at its head, no images
    or published ports. (Below a short base: a socket's path is bounded.)"""
    run = build_run(tmp_path_factory.mktemp("run"))
    repo = tmp_path / "repo"
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    run.doc["repository"] = {"path": str(repo), "revision": head.stdout.strip()}
    run.doc["published_ports"] = []
    for key in ("service_images", "port_proxy_image", "workspace_folder", "omitted_services"):
        run.doc.pop(key, None)
    run.save()
    return run


@pytest.fixture
def spools(tmp_path: Path, fake: FakeBackend, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The fake's spools go below tmp_path/engine; the broker's tmpfs on each is only listed."""
    mounted: list[str] = []
    monkeypatch.setattr("sandboxer.host.lease_mounts.mount_spool_tmpfs", mounted.append)
    fake.spool_base = tmp_path / "engine"
    fake.spool_base.mkdir()
    return mounted


def test_grants_take_each_spools_place_from_the_function_given() -> None:
    manifest = mf.parse(render(fake_document("2")), file="/runs/assignment.json")
    lease_id = fake_document("2")["leases"][REQUEST]["lease_id"]
    granted = leases.grants(manifest, spool_place=lambda name: (f"placed:{name}", "/below"), project_env=None)
    spools = [(m.source, m.beneath, m.lease) for m in granted.mounts if m.kind is MountKind.SPOOL]
    assert spools == [(f"placed:{leases.spool_name(RUN_ID, lease_id)}", "/below", lease_id)]


def test_the_engines_place_spools_as_they_always_have() -> None:

    bwrap, docker = BwrapBackend(), DockerBackend()
    assert bwrap.spool_place("s", sandbox_dir="/st/x") == ("/st/x/spools/s", "/st/x/spools")
    assert bwrap.spool_directory("s", sandbox_dir="/st/x") == "/st/x/spools/s"
    assert docker.spool_place("s", sandbox_dir="/st/x") == ("s", None)
    assert (bwrap.admits_service_images(), docker.admits_service_images()) == (False, True)


@pytest.mark.parametrize("admitted", [False, True])
def test_service_images_are_admitted_as_the_backend_says(
    run: Run, broker: Broker, fake: FakeBackend, spools: list[str], admitted: bool
) -> None:
    run.doc["service_images"] = {"app": IMAGE_APP}
    run.save()
    fake.images = admitted
    if not admitted:
        with pytest.raises(PolicyError, match="service_images: images need the Docker backend"):
            broker.create("p", manifest=str(run.assignment))
        assert [verb for verb, _ in fake.calls] == ["preflight", "admit"]
        assert _left(broker) == []
        return
    if os.geteuid() != 0:
        pytest.skip("a request spool needs a root broker")
    receipt = broker.create("p", manifest=str(run.assignment)).teardown(discard=True)
    assert receipt.residue == ()
    assert len(spools) == 1


@needs_root
def test_spools_are_placed_made_found_and_removed_by_the_backend(
    run: Run, broker: Broker, fake: FakeBackend, spools: list[str]
) -> None:
    lease_id = run.doc["leases"][REQUEST]["lease_id"]
    name = leases.spool_name(RUN_ID, lease_id)
    sandbox = broker.create("p", manifest=str(run.assignment))
    # Placed by the backend, made by it, then the broker's tmpfs and layout on what it made.
    assert ("spool_place", name) in fake.calls
    assert ("make_spool_root", f"fake:{name}") in fake.calls
    root = fake.spool_base / name
    assert spools == [str(root)]
    assert json.loads((root / ".binding.json").read_text())["lease_id"] == lease_id
    assert (root / ".capability").read_bytes() == run.source(REQUEST).read_bytes()
    record = json.loads((Path(broker.state_dir) / "sandboxes" / sandbox.id / "record.json").read_text())
    assert [spool["source"] for spool in record["manifest"]["spools"]] == [f"fake:{name}"]
    # dispatch-tool picks a request up in the directory the backend names.
    (root / "requests" / "r1.json").write_bytes(b"{}")  # root's, not the consumer's: refused once found
    with pytest.raises(PolicyError, match="request r1: the request file is refused: it does not belong"):
        dispatch(
            broker.state_dir, sandbox.id, lease_id=lease_id, request_id="r1", wait_seconds=0, backends=broker.backends
        )
    assert ("spool_directory", name) in fake.calls
    assert not (root / "requests" / "r1.json").exists()
    # teardown removes it through the backend.
    receipt = sandbox.teardown(discard=True)  # the fake runs no command: no git to ask about work
    assert ("remove_spool", f"fake:{name}") in fake.calls
    assert f"fake spool fake:{name}" in receipt.removed
    assert receipt.residue == ()


def test_gc_collects_the_orphans_each_backend_reports(broker: Broker, fake: FakeBackend) -> None:
    orphan = "0123456789abcdef01234567"
    fake.orphans = {orphan: Removal(removed=("fake container",))}
    report = broker.gc()
    assert [(receipt.id, receipt.removed, receipt.residue) for receipt in report.collected] == [
        (orphan, ("fake container",), ())
    ]
    assert [verb for verb, _ in fake.calls].count("collect_orphans") == len(broker.backends.names)


@pytest.mark.parametrize("ttl", [True, "60", [60]])
def test_a_ttl_that_is_not_a_number_is_refused_and_nothing_is_made(broker: Broker, ttl: object) -> None:
    """The embedded API refuses what the service refuses for a TTL (a bool is no number of
    seconds, though Python counts it an int), with the same line and status, before anything."""
    with pytest.raises(UsageError) as refused:
        broker.create("p", ttl=ttl)  # type: ignore[arg-type]
    assert (refused.value.status, refused.value.message) == (2, "ttl: must be a number of seconds")
    assert _left(broker) == []


def test_the_reaper_cannot_be_held_by_work_that_will_not_export(broker: Broker, fake: FakeBackend) -> None:
    """An expired sandbox whose work cannot be exported (the fake's exec runs no git) is audited so and
    kept for one more try; the next try past RETRY_EXPORT tears it down without its work: no
    sandbox outlives its lifetime by making its work unexportable, and none stops the reaper."""

    sandbox = broker.create("p", ttl=60)
    registry = Registry(broker.state_dir)
    record = registry.read_or_none(sandbox.id)
    assert record is not None
    registry.write(replace(record, expires_at=1.0))  # long past
    reaper = Reaper(broker.dirs, broker.services, AuditLog(broker.state_dir))
    assert reaper.reap() == [sandbox.id]
    assert _left(broker) == [sandbox.id]
    assert reaper.reap() == []  # not again before RETRY_EXPORT
    reaper.failed[sandbox.id] -= RETRY_EXPORT + 1
    assert reaper.reap() == [sandbox.id]
    assert _left(broker) == []
    lines = [json.loads(line) for line in (Path(broker.state_dir) / "audit.log").read_text().splitlines()]
    assert [(line["verb"], line["outcome"], line["status"]) for line in lines] == [
        ("expire", "export failed (BackendError); tried again later", 5),
        ("expire", "ok", 0),
    ]


# ------------------------------------------------------------------ the commands' results, typed


def test_the_commands_return_their_result_types_and_each_round_trips(broker: Broker, fake: FakeBackend) -> None:
    """teardown, list, gc, warm and the owner's commands return the frozen result types (no
    document the core parses back), and each is its own document's parse."""
    sandbox = broker.create("p")
    config = Path(broker.config_dir)
    runtime = str(Path(broker.config_dir).parent / "runtime")
    made: list[results.JsonResult] = [
        teardown.list_sandboxes(broker.dirs, backends=broker.backends),
        warm.fill(broker.dirs, "p", backends=broker.backends),
        owner.check(str(config / "profiles" / "p.yaml")),
        owner.check(str(config / "extensions" / "ext.bwrap.yaml")),
        owner.list_entries(broker.dirs),
        owner.runtime_digest(broker.dirs, runtime, full=False),
        owner.runtime_pin(broker.dirs, runtime, "ext.bwrap"),
        teardown.teardown(broker.dirs, sandbox.id, services=broker.services),
        teardown.gc(broker.dirs, backends=broker.backends),
    ]
    expected = [
        results.SandboxList,
        results.WarmFill,
        results.OwnerCheck,
        results.OwnerCheck,
        results.OwnerListing,
        results.RuntimeDigest,
        results.RuntimePin,
        results.Receipt,
        results.GcReport,
    ]
    assert [type(result) for result in made] == expected
    for result in made:
        assert type(result).from_json(json.loads(json.dumps(result.to_json()))) == result


def test_ext_check_keeps_its_document_shape(broker: Broker) -> None:
    """`ext check --json` is the file, its digest, valid and its meaning's keys, kind first."""
    checked = owner.check(str(Path(broker.config_dir) / "profiles" / "p.yaml"))
    document = checked.to_json()
    assert list(document)[:5] == ["file", "sha256", "valid", "kind", "profile"]
    assert (document["kind"], document["valid"], document["profile"]) == ("profile", True, "p")
    assert checked.meaning["workspace"]["refs"] == tuple(document["workspace"]["refs"])  # read-only


def test_residue_is_one_error_carrying_its_receipt() -> None:
    """Every front end reports residue with residue_error: status 6, one wording, the receipt."""
    receipt = receipt_of("a" * 24, Removal.of(removed=["sandbox dir"], residue=["mount /x", "cgroup y"]))
    assert receipt == Receipt(id="a" * 24, removed=("sandbox dir",), residue=("mount /x", "cgroup y"))
    error = residue_error(receipt)
    assert (error.exit_status, error.receipt) == (6, receipt)
    assert str(error) == f"teardown of {'a' * 24} left residue: mount /x; cgroup y"


# ------------------------------------------------------------------ published ports: the core's part


def _publishing(broker: Broker, tmp_path: Path) -> None:
    text = profile_yaml("p", str(tmp_path / "repo")).replace(
        "  default: deny\n", "  default: deny\n  publish: loopback\n"
    )
    (Path(broker.config_dir) / "profiles" / "p.yaml").write_text(text)
    broker.owner.approve("p")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_published_ports_are_reserved_first_and_handed_over_once_the_sandbox_runs(
    run: Run, broker: Broker, fake: FakeBackend, tmp_path: Path, spools: list[str]
) -> None:
    _publishing(broker, tmp_path)
    port = _free_port()
    run.doc["published_ports"] = [{"host": port, "runtime": 8000}]
    run.save()
    publish = FakePublish()
    broker.services = Services.of(broker.services.backends, publish=publish)
    if os.geteuid() != 0:
        pytest.skip("the sample run's request spool needs a root broker")
    sandbox = broker.create("p", manifest=str(run.assignment))
    assert [verb for verb, _ in publish.calls] == ["require", "reserve", "open"]
    assert ("inside_sockets", sandbox.id) in fake.calls
    assert fake.calls.index(("inside_sockets", sandbox.id)) > [verb for verb, _ in fake.calls].index("start")
    sandbox.teardown(discard=True)
    assert publish.calls[-1] == ("close", sandbox.id)


def test_a_taken_port_refuses_before_anything_is_made(
    run: Run, broker: Broker, fake: FakeBackend, tmp_path: Path
) -> None:
    _publishing(broker, tmp_path)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        run.doc["published_ports"] = [{"host": port, "runtime": 8000}]
        run.save()
        broker.services = Services.of(broker.services.backends, publish=FakePublish())
        with pytest.raises(PolicyError, match=rf"published_ports\[0\]\.host: 127\.0\.0\.1:{port} is taken"):
            broker.create("p", manifest=str(run.assignment))
    assert "start" not in [verb for verb, _ in fake.calls]
    assert _left(broker) == []


def test_in_process_a_create_that_publishes_is_refused_with_a_hint(
    run: Run, broker: Broker, fake: FakeBackend, tmp_path: Path
) -> None:
    _publishing(broker, tmp_path)
    run.doc["published_ports"] = [{"host": _free_port(), "runtime": 8000}]
    run.save()
    with pytest.raises(PolicyError, match="publishes ports, which only the service forwards") as refused:
        broker.create("p", manifest=str(run.assignment))
    assert "sandboxer serve" in str(refused.value.hint)
    assert "start" not in [verb for verb, _ in fake.calls]
    assert _left(broker) == []


def test_extend_moves_the_end_but_never_brings_back_an_ended_lifetime(broker: Broker) -> None:
    """extend moves a lifetime's end later and never earlier; one that has ended already (the
    reaper is taking the sandbox) is refused (2), and the record is left as it was."""
    sandbox = broker.create("p", ttl=60)
    registry = Registry(broker.state_dir)
    first = registry.read(sandbox.id).expires_at
    assert first is not None
    moved = sandbox.extend(600)
    assert 590 <= moved.seconds_left <= 600
    assert moved.max_expires_at is None  # an owner's sandbox of a profile without a maximum
    assert sandbox.extend(10).expires_at == moved.expires_at  # never earlier
    ended = replace(registry.read(sandbox.id), expires_at=first - 3600)
    registry.write(ended)
    with pytest.raises(UsageError, match="lifetime has ended"):
        sandbox.extend(600)
    assert registry.read(sandbox.id).expires_at == ended.expires_at
    for seconds in (0, 1.5, True, 31_536_001):
        with pytest.raises(UsageError, match="whole number from 1 to 31536000"):
            sandbox.extend(seconds)  # type: ignore[arg-type]
    sandbox.teardown(discard=True)
