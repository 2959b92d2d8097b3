"""The owner commands through the real CLI: check, approve, revoke, list, and the ledger's guards."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Broker, make_repository, make_runtime
from tests.samples import profile_yaml

# A real repository with main: ext approve checks that a profile's repository has its ref.
REPOSITORY = "/tmp/sandboxer-owner-cli-repository"


@pytest.fixture(autouse=True, scope="module")
def _repository() -> Iterator[None]:
    shutil.rmtree(REPOSITORY, ignore_errors=True)
    make_repository(Path(REPOSITORY), {"README.md": b"owner tests\n"})
    subprocess.run(["git", "-C", REPOSITORY, "branch", "mair"], check=True)  # a ref one byte from main
    yield
    shutil.rmtree(REPOSITORY, ignore_errors=True)


def ext_config(runtime: Path, digest: str) -> str:
    return f"extension: ext.bwrap\nconfig:\n  runtime:\n    path: {runtime}\n    sha256: {digest}\n"


def statuses(broker: Broker) -> dict[str, str]:
    result = broker.run("ext", "list", "--json")
    assert result.status == 0, result.stderr
    return {entry["name"]: entry["status"] for entry in result.json()["entries"]}


def test_check_prints_normalized_meaning(broker: Broker) -> None:
    path = broker.write("profiles/dev.yaml", profile_yaml("dev", REPOSITORY))
    result = broker.run("ext", "check", str(path), "--json")
    assert result.status == 0, result.stderr
    document = result.json()
    assert document["kind"] == "profile"
    assert document["network"] == {
        "default": "deny",
        "egress": [],
        "routes": [],
        "limits": {"connections": 64, "mib": 1024, "seconds": 600},
        "publish": "none",
    }
    assert document["limits"] == {
        "memory_mib": 2048,
        "pids": 512,
        "workspace_mib": 4096,
        "state_mib": 256,
        "tmp_mib": 256,
        "cpus": None,
        "best_effort": False,
    }
    assert document["security"] == {"allow_ptrace": False}
    assert document["workspace"]["git"] == {"user": {"name": "Sandbox", "email": "sandbox@localhost"}}
    assert document["exec"] == {"caller_env": [], "env": {}}


def test_check_prints_egress_rules_as_the_proxy_reads_them(broker: Broker) -> None:
    egress = "  egress:\n    - {host: PyPI.org, ports: [443]}\n  limits: {seconds: 30}\n"
    path = broker.write("profiles/dev.yaml", profile_yaml("dev", REPOSITORY).replace("  egress: []\n", egress))
    result = broker.run("ext", "check", str(path), "--json")
    assert result.status == 0, result.stderr
    network = result.json()["network"]
    assert network["egress"] == [{"host": "pypi.org", "ports": [443], "addresses": []}]
    assert network["limits"] == {"connections": 64, "mib": 1024, "seconds": 30}


def test_check_reports_bad_file_in_one_line_with_status_2(broker: Broker) -> None:
    path = broker.write("profiles/dev.yaml", profile_yaml("dev", REPOSITORY) + "colour: red\n")
    result = broker.run("ext", "check", str(path))
    assert result.status == 2
    assert result.stderr == f"sandboxer: {path}:11:1: colour: unknown key\n"
    assert result.stdout == ""


def test_check_json_error_object(broker: Broker) -> None:
    path = broker.write("profiles/dev.yaml", profile_yaml("dev", REPOSITORY).replace("ref: main", "ref: 7"))
    result = broker.run("ext", "check", str(path), "--json")
    assert result.status == 2
    assert result.json() == {"error": {"kind": "config", "message": f"{path}:5:8: workspace.ref: must be a string"}}


def test_check_forbidden_setting_exits_3_without_the_secret(broker: Broker) -> None:
    canary = "sk-canary-4f1d2e9a77"
    path = broker.write(
        "profiles/dev.yaml", profile_yaml("dev", REPOSITORY).replace("secrets: []", f"secrets: [{canary}]")
    )
    result = broker.run("ext", "check", str(path))
    assert result.status == 3
    assert "setup.secrets: must be empty for ext.bwrap" in result.stderr
    assert canary not in result.stderr + result.stdout


def test_approval_lifecycle(broker: Broker) -> None:
    path = broker.write("profiles/dev.yaml", profile_yaml("dev", REPOSITORY))
    assert statuses(broker) == {"dev": "unapproved"}

    approved = broker.run("ext", "approve", "dev", "--json")
    assert approved.status == 0, approved.stderr
    assert approved.json()["sha256"] == __import__("hashlib").sha256(path.read_bytes()).hexdigest()
    assert statuses(broker) == {"dev": "approved"}

    path.write_bytes(path.read_bytes().replace(b"ref: main", b"ref: mair"))  # one byte
    assert statuses(broker) == {"dev": "changed-since-approval"}

    assert broker.run("ext", "approve", "dev").status == 0
    assert statuses(broker) == {"dev": "approved"}

    revoked = broker.run("ext", "revoke", "dev", "--json")
    assert revoked.status == 0
    assert revoked.json()["revoked"] is True
    assert statuses(broker) == {"dev": "unapproved"}
    again = broker.run("ext", "revoke", "dev", "--json")
    assert again.json()["revoked"] is False


def test_ledger_is_owner_only(broker: Broker) -> None:
    broker.write("profiles/dev.yaml", profile_yaml("dev", REPOSITORY))
    assert broker.run("ext", "approve", "dev").status == 0
    ledger = broker.config / "approvals.json"
    assert ledger.stat().st_mode & 0o777 == 0o600


def test_deleted_file_with_lingering_approval_is_listed(broker: Broker) -> None:
    path = broker.write("profiles/dev.yaml", profile_yaml("dev", REPOSITORY))
    assert broker.run("ext", "approve", "dev").status == 0
    path.unlink()
    entries = broker.run("ext", "list", "--json").json()["entries"]
    assert entries == [
        {
            "name": "dev",
            "kind": "profile",
            "file": None,
            "valid": False,
            "problem": "file is missing",
            "present": False,
            "sha256": None,
            "approved_sha256": entries[0]["approved_sha256"],
            "status": "changed-since-approval",
        }
    ]


def test_list_says_why_a_file_is_not_valid(broker: Broker) -> None:
    broker.write("profiles/dev.yaml", profile_yaml("dev", REPOSITORY) + "limits:\n  memory_mb: 512\n")
    listed = broker.run("ext", "list")
    assert listed.status == 0, listed.stderr
    table, reasons = listed.stdout.split("\n\n")
    assert table.splitlines()[1].split() == ["dev", "profile", "unapproved", "no"]
    assert reasons.strip().startswith("dev: ")
    assert reasons.strip().endswith("limits.memory_mb: unknown key (did you mean memory_mib?)")


def test_invalid_file_cannot_be_approved_and_ledger_is_untouched(broker: Broker) -> None:
    broker.write("profiles/dev.yaml", profile_yaml("dev", REPOSITORY) + "extra: 1\n")
    result = broker.run("ext", "approve", "dev")
    assert result.status == 2
    assert "extra: unknown key" in result.stderr
    assert not (broker.config / "approvals.json").exists()


def test_forbidden_profile_cannot_be_approved(broker: Broker) -> None:
    broker.write("profiles/dev.yaml", profile_yaml("dev", REPOSITORY).replace("default: deny", "default: allow"))
    assert broker.run("ext", "approve", "dev").status == 3
    assert not (broker.config / "approvals.json").exists()


def test_file_declaring_another_name_cannot_be_approved(broker: Broker) -> None:
    broker.write("profiles/dev.yaml", profile_yaml("prod"))
    result = broker.run("ext", "approve", "dev")
    assert result.status == 2
    assert "profile: must equal the file's name (dev)" in result.stderr


@pytest.mark.parametrize("name", ["../etc/passwd", "ext.other", "Dev", "a/b"])
def test_bad_names_are_usage_errors(broker: Broker, name: str) -> None:
    result = broker.run("ext", "approve", name)
    assert result.status == 2
    assert result.stderr.startswith("sandboxer: ")
    assert result.stderr.count("\n") == 1


def test_missing_file_is_a_usage_error(broker: Broker) -> None:
    result = broker.run("ext", "approve", "nothere")
    assert result.status == 2
    assert "no such file" in result.stderr


def test_ledger_not_owner_only_is_refused_not_reset(broker: Broker) -> None:
    broker.write("profiles/dev.yaml", profile_yaml("dev", REPOSITORY))
    assert broker.run("ext", "approve", "dev").status == 0
    ledger = broker.config / "approvals.json"
    ledger.chmod(0o644)
    before = ledger.read_bytes()
    for args in (("ext", "list"), ("ext", "approve", "dev"), ("ext", "revoke", "dev")):
        result = broker.run(*args)
        assert result.status == 3, args
        assert result.stderr == f"sandboxer: {ledger}: must be owner-only (mode 0600); refusing to trust it\n"
    assert ledger.read_bytes() == before


@pytest.mark.parametrize(
    "content",
    [b"{not json", b"[]", b'{"format": 1}', b'{"format": 2, "approvals": {}}', b'{"format": 1, "approvals": {"x": 1}}'],
)
def test_malformed_ledger_is_refused_not_reset(broker: Broker, content: bytes) -> None:
    broker.write("profiles/dev.yaml", profile_yaml("dev", REPOSITORY))
    ledger = broker.config / "approvals.json"
    ledger.write_bytes(content)
    ledger.chmod(0o600)
    result = broker.run("ext", "approve", "dev")
    assert result.status == 3
    assert str(ledger) in result.stderr
    assert "refusing to trust it" in result.stderr
    assert ledger.read_bytes() == content


def test_ledger_symlink_is_refused(broker: Broker, tmp_path: Path) -> None:
    elsewhere = tmp_path / "forged.json"
    elsewhere.write_text('{"format": 1, "approvals": {}}')
    elsewhere.chmod(0o600)
    (broker.config / "approvals.json").symlink_to(elsewhere)
    result = broker.run("ext", "list")
    assert result.status == 3
    assert "approvals.json" in result.stderr


def test_group_writable_config_dir_is_refused_for_changes(broker: Broker) -> None:
    broker.write("profiles/dev.yaml", profile_yaml("dev", REPOSITORY))
    broker.config.chmod(0o770)
    result = broker.run("ext", "approve", "dev")
    assert result.status == 3
    assert "not group/world-writable" in result.stderr
    assert not (broker.config / "approvals.json").exists()


def test_concurrent_approvals_lose_no_entry(broker: Broker) -> None:
    names = [f"p{i}" for i in range(12)]
    for name in names:
        broker.write(f"profiles/{name}.yaml", profile_yaml(name, REPOSITORY))
    base = [sys.executable, "-m", "sandboxer", "--config-dir", str(broker.config), "--state-dir", str(broker.state)]
    env = {"PATH": os.environ["PATH"], "SANDBOXER_NO_SERVICE": "1"}  # processes of their own, racing on the ledger
    procs = [subprocess.Popen([*base, "ext", "approve", name], env=env) for name in names]
    assert [proc.wait(timeout=120) for proc in procs] == [0] * len(names)
    ledger = json.loads((broker.config / "approvals.json").read_text())
    assert sorted(ledger["approvals"]) == sorted(names)
    assert statuses(broker) == dict.fromkeys(names, "approved")


def test_extension_approval_verifies_the_runtime_pin(broker: Broker, tmp_path: Path) -> None:
    runtime = make_runtime(tmp_path / "runtime")
    digest = broker.run("runtime", "digest", str(runtime)).stdout.strip()
    broker.write("extensions/ext.bwrap.yaml", ext_config(runtime, digest))
    approved = broker.run("ext", "approve", "ext.bwrap")
    assert approved.status == 0, approved.stderr
    assert statuses(broker) == {"ext.bwrap": "approved"}

    (runtime / "added.py").write_text("")
    assert broker.run("ext", "revoke", "ext.bwrap").status == 0
    refused = broker.run("ext", "approve", "ext.bwrap")
    assert refused.status == 3
    assert "does not match the pinned config.runtime.sha256" in refused.stderr
    assert statuses(broker) == {"ext.bwrap": "unapproved"}


def test_runtime_inside_config_dir_is_refused(broker: Broker) -> None:
    runtime = make_runtime(broker.config / "runtime")
    digest = broker.run("runtime", "digest", str(runtime)).stdout.strip()
    broker.write("extensions/ext.bwrap.yaml", ext_config(runtime, digest))
    result = broker.run("ext", "approve", "ext.bwrap")
    assert result.status == 3
    assert f"runtime {runtime}: overlaps the config dir" in result.stderr


def test_unknown_option_is_a_usage_error(broker: Broker) -> None:
    result = broker.run("ext", "list", "--bogus")
    assert result.status == 2
    assert result.stderr == "sandboxer: no such option: --bogus\n"


def test_runtime_pin_writes_the_digest_for_the_owner_to_review_and_approve(broker: Broker, tmp_path: Path) -> None:
    old = make_runtime(tmp_path / "old")
    new = make_runtime(tmp_path / "new")
    (new / "lib.py").write_text("changed = True\n")
    old_digest = broker.run("runtime", "digest", str(old)).stdout.strip()
    broker.write(
        "extensions/ext.bwrap.yaml",
        "# the team's runtime, rebuilt weekly\n" + ext_config(old, old_digest) + "# end\n",
    )
    assert broker.run("ext", "approve", "ext.bwrap").status == 0

    pinned = broker.run("runtime", "pin", str(new), "--extension", "ext.bwrap", "--json")
    assert pinned.status == 0, pinned.stderr
    new_digest = broker.run("runtime", "digest", str(new)).stdout.strip()
    assert pinned.json() == {
        "extension": "ext.bwrap",
        "file": str(broker.config / "extensions" / "ext.bwrap.yaml"),
        "path": str(new),
        "sha256": new_digest,
        "status": "changed-since-approval",  # nothing is approved on the owner's behalf
    }
    text = (broker.config / "extensions" / "ext.bwrap.yaml").read_text()
    assert text.startswith("# the team's runtime, rebuilt weekly\n")
    assert text.endswith("# end\n")
    assert f"path: {new}\n" in text
    assert new_digest in text
    assert old_digest not in text
    assert broker.run("ext", "approve", "ext.bwrap").status == 0
    again = broker.run("runtime", "pin", str(new), "--extension", "ext.bwrap")
    assert (again.status, again.stdout.endswith("(approved)\n")) == (0, True)
    assert statuses(broker) == {"ext.bwrap": "approved"}  # the same pin leaves the file alone

    bad = broker.run("runtime", "pin", str(new), "--extension", "ext.nope")
    assert (bad.status, bad.stderr) == (2, "sandboxer: --extension: must be one of ext.bwrap, ext.docker\n")
    missing = broker.run("runtime", "pin", str(tmp_path / "absent"), "--extension", "ext.bwrap")
    assert missing.status in (2, 3)
    assert len(missing.stderr.splitlines()) == 1
    assert statuses(broker) == {"ext.bwrap": "approved"}
