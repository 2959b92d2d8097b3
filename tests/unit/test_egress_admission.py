"""The owner's egress keys where both files are known (docs/egress.md, "The owner's keys"): a
profile's network.routes checked against its extension's config.routes at approval and at create,
each route's secret file checked (never read) at the extension's approval, `ext check` showing
the keys, and what a sandbox with egress carries into every exec. On the fake backend
(tests/unit/fake_backend.py), with real config files, approvals and clones."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

import pytest

from sandboxer import Broker
from sandboxer.backends import Backends
from sandboxer.commands import owner
from sandboxer.commands.services import Services
from sandboxer.core.egress.inside import EGRESS_PROXY_URL
from sandboxer.errors import ExecError, PolicyError, SandboxerError
from tests.conftest import make_repository, make_runtime
from tests.samples import profile_yaml
from tests.unit.fake_backend import FakeBackend, FakeEgress

EGRESS = "  egress:\n    - {host: api.model.test, ports: [443]}\n"
CANARY = "canary-" + secrets.token_hex(16)


class Owner:
    """A config dir with a runtime, a repository, and files the tests write and approve."""

    def __init__(self, tmp_path: Path, fake: FakeBackend) -> None:
        self.runtime = make_runtime(tmp_path / "runtime")
        self.repo = make_repository(tmp_path / "repo", {"README.md": b"workspace\n"})
        self.config = tmp_path / "config"
        (self.config / "extensions").mkdir(parents=True)
        (self.config / "profiles").mkdir()
        self.config.chmod(0o700)
        self.secret = tmp_path / "secret"
        self.secret.write_text(CANARY + "\n")
        self.secret.chmod(0o600)
        engines = Backends({"bwrap": fake, "docker": fake})
        self.broker = Broker(config_dir=str(self.config), state_dir=str(tmp_path / "state"), backends=engines)
        self.egress = FakeEgress()  # what a service would be: the core hands it each listener
        self.broker.services = Services.of(engines, egress=self.egress)
        self.digest = self.broker.owner.runtime_digest(str(self.runtime)).sha256

    def extension(self, routes: str = "") -> None:
        text = f"extension: ext.bwrap\nconfig:\n  runtime:\n    path: {self.runtime}\n    sha256: {self.digest}\n"
        (self.config / "extensions" / "ext.bwrap.yaml").write_text(text + routes)

    def profile(self, network: str, extra: str = "") -> None:
        text = profile_yaml("p", str(self.repo), extra).replace("  egress: []\n", network)
        (self.config / "profiles" / "p.yaml").write_text(text)

    def route(self, name: str = "model", host: str = "api.model.test", secret: Path | None = None) -> str:
        return (
            f"  routes:\n    {name}:\n      host: {host}\n      header: Authorization\n"
            f"      format: 'Bearer {{secret}}'\n      secret_file: {secret or self.secret}\n"
        )


@pytest.fixture
def fake() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def made(tmp_path: Path, fake: FakeBackend) -> Owner:
    return Owner(tmp_path, fake)


def test_an_extension_with_an_owner_only_secret_file_is_approved(made: Owner) -> None:
    made.extension(made.route())
    assert made.broker.owner.approve("ext.bwrap").status == "approved"


def _refusal(made: Owner, secret: Path) -> str:
    made.extension(made.route(secret=secret))
    with pytest.raises(PolicyError) as refused:
        made.broker.owner.approve("ext.bwrap")
    assert refused.value.exit_status == 3
    assert CANARY not in str(refused.value)  # the secret file is checked, never read
    return refused.value.message


def test_each_secret_file_rule_names_the_file_the_field_and_the_rule(made: Owner, tmp_path: Path) -> None:
    field = f"{made.config}/extensions/ext.bwrap.yaml: config.routes.model.secret_file"
    assert _refusal(made, tmp_path / "absent") == f"{field}: no such file"
    link = tmp_path / "link"
    link.symlink_to(made.secret)
    assert _refusal(made, link) == f"{field}: must be a regular file, not a symbolic link"
    directory = tmp_path / "dir"
    directory.mkdir(mode=0o700)
    assert _refusal(made, directory) == f"{field}: must be a regular file"
    made.secret.chmod(0o640)
    assert _refusal(made, made.secret) == f"{field}: must be readable by its owner only (no group or other permissions)"
    made.secret.chmod(0o604)
    assert _refusal(made, made.secret).endswith("must be readable by its owner only (no group or other permissions)")
    made.secret.chmod(0o600)
    if os.geteuid() == 0:  # only root can give a file away
        os.chown(made.secret, 4242, 4242)
        owner_uid = made.config.stat().st_uid
        assert _refusal(made, made.secret) == (
            f"{field}: must be owned by root or by the config dir's owner (uid {owner_uid})"
        )


def test_a_profile_naming_a_route_its_extension_lacks_is_refused_at_approval(made: Owner) -> None:
    made.extension(made.route(name="other"))
    made.broker.owner.approve("ext.bwrap")
    made.profile(EGRESS + "  routes: [model]\n")
    with pytest.raises(PolicyError) as refused:
        made.broker.owner.approve("p")
    assert refused.value.message == (
        "profile p: network.routes: model is not a route of ext.bwrap (config.routes has: other)"
    )
    assert owner.status_of(made.broker.dirs, "p") == "unapproved"


def test_a_profile_whose_route_host_is_not_in_egress_is_refused_at_approval(made: Owner) -> None:
    made.extension(made.route())
    made.broker.owner.approve("ext.bwrap")
    made.profile("  egress:\n    - {host: pypi.org, ports: [443]}\n  routes: [model]\n")
    with pytest.raises(PolicyError, match=r"the host of route model is not listed in network\.egress"):
        made.broker.owner.approve("p")


def test_a_route_removed_from_the_extension_after_approval_stops_create(made: Owner, fake: FakeBackend) -> None:
    made.extension(made.route())
    made.broker.owner.approve("ext.bwrap")
    made.profile(EGRESS + "  routes: [model]\n")
    made.broker.owner.approve("p")
    made.extension(made.route(name="renamed"))  # the owner renames it, and approves the file again
    made.broker.owner.approve("ext.bwrap")
    with pytest.raises(PolicyError) as refused:
        made.broker.create("p")
    assert refused.value.message == (
        "profile p: network.routes: model is not a route of ext.bwrap (config.routes has: renamed)"
    )
    assert (made.broker.list(), fake.calls) == ([], [])  # refused before anything was made


def test_ext_check_shows_the_egress_keys(made: Owner) -> None:
    made.extension(made.route())
    made.profile(EGRESS + "  routes: [model]\n  limits: {connections: 2}\n")
    profile = owner.check(str(made.config / "profiles" / "p.yaml")).to_json()
    assert profile["network"] == {
        "default": "deny",
        "egress": [{"host": "api.model.test", "ports": [443], "addresses": []}],
        "routes": ["model"],
        "limits": {"connections": 2, "mib": 1024, "seconds": 600},
        "publish": "none",
    }
    extension = owner.check(str(made.config / "extensions" / "ext.bwrap.yaml")).to_json()
    assert extension["config"]["routes"] == {
        "model": {
            "host": "api.model.test",
            "header": "Authorization",
            "format": "Bearer {secret}",
            "secret_file": str(made.secret),
            "expires_at": None,
        }
    }
    assert CANARY not in json.dumps(extension)


def test_a_sandbox_with_egress_carries_the_proxy_into_every_exec(made: Owner, fake: FakeBackend) -> None:
    made.extension()
    made.broker.owner.approve("ext.bwrap")
    made.profile(EGRESS, "exec:\n  caller_env: [TASK_ID]\n")
    made.broker.owner.approve("p")
    sandbox = made.broker.create("p")
    sandbox.exec(["true"])
    _, env = fake.execs[-1]
    assert (env["HTTPS_PROXY"], env["https_proxy"], env["SANDBOXER_NETWORK"]) == (EGRESS_PROXY_URL,) * 2 + ("proxy",)
    with pytest.raises(ExecError) as refused:
        sandbox.exec(["true"], env={"HTTPS_PROXY": "http://elsewhere:1"})
    assert refused.value.message == (
        "exec: --env HTTPS_PROXY: not a name this sandbox's profile lets a caller set (exec.caller_env)"
    )


def test_the_listener_is_made_and_served_before_the_sandbox_is_ready_and_closed_with_it(
    made: Owner, fake: FakeBackend
) -> None:
    made.extension()
    made.broker.owner.approve("ext.bwrap")
    made.profile(EGRESS)
    made.broker.owner.approve("p")
    sandbox = made.broker.create("p")
    assert ("listen_inside", sandbox.id) in fake.calls
    assert made.egress.calls == [("require", "p"), ("open", sandbox.id)]
    assert made.egress.status(sandbox.id) == "up"
    sandbox.teardown(discard=True)
    assert made.egress.calls[-1] == ("close", sandbox.id)


def test_without_a_service_a_profile_with_egress_is_refused_before_anything_is_made(
    made: Owner, fake: FakeBackend
) -> None:
    """In-process (an embedded Broker, SANDBOXER_NO_SERVICE=1) nobody would serve the proxy once
    the command ends: the create is refused (3) with the way to do it, and nothing is made."""
    made.extension()
    made.broker.owner.approve("ext.bwrap")
    made.profile(EGRESS)
    made.broker.owner.approve("p")
    made.broker.services = Services.of(made.broker.backends)  # no egress: what in-process has
    with pytest.raises(PolicyError) as refused:
        made.broker.create("p")
    assert refused.value.status == 3
    assert "only the service runs" in refused.value.message
    assert "sandboxer serve" in (refused.value.hint or "")
    assert not [call for call in fake.calls if call[0] == "start"]
    assert not list((Path(made.broker.state_dir) / "sandboxes").glob("[0-9a-f]*"))


def test_a_record_that_would_let_a_caller_set_a_proxy_name_still_refuses_it(made: Owner) -> None:
    """Should a record ever list a plan name among caller_env (an older broker's, an edit),
    exec --env still refuses it: the sandbox's own environment is not the caller's to change."""
    made.extension()
    made.broker.owner.approve("ext.bwrap")
    made.profile(EGRESS)
    made.broker.owner.approve("p")
    sandbox = made.broker.create("p")
    path = Path(made.broker.state_dir) / "sandboxes" / sandbox.id / "record.json"
    record = json.loads(path.read_text())
    record["caller_env"] = ["HTTPS_PROXY"]
    path.write_text(json.dumps(record))
    with pytest.raises(ExecError) as refused:
        sandbox.exec(["true"], env={"HTTPS_PROXY": "http://elsewhere:1"})
    assert refused.value.message == "exec: --env HTTPS_PROXY: set by the sandbox itself, not by a caller"


def test_no_error_of_approval_or_create_carries_the_secret(made: Owner, tmp_path: Path) -> None:
    """The canary is the secret file's content: approval opens the file to check it, never reads
    it, and nothing else touches it before the proxy's request."""
    faults: list[str] = []
    for secret in (made.secret, tmp_path / "absent"):
        made.extension(made.route(secret=secret))
        made.secret.chmod(0o644)
        try:
            made.broker.owner.approve("ext.bwrap")
        except SandboxerError as exc:
            faults.append(str(exc))
    made.secret.chmod(0o600)
    made.extension(made.route())
    made.broker.owner.approve("ext.bwrap")
    made.profile("  egress: []\n  routes: [model]\n")
    try:
        made.broker.owner.approve("p")
    except SandboxerError as exc:
        faults.append(str(exc))
    assert len(faults) == 3
    assert not any(CANARY in fault for fault in faults)
