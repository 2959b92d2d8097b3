"""`sandboxer ext check NAME`: the NAMEs `ext approve` takes, with its errors; FILE still works.

Through the real CLI, in-process and through the client (which runs the file checks in its own
process), on real files in a real config dir.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import Broker, Result, make_runtime
from tests.samples import profile_yaml

GRANTS = "grants:\n  - users: [nobody]\n    profiles: [dev]\n    max_sandboxes: 2\n    max_ttl_seconds: 3600\n"


def _client_env() -> dict[str, str]:
    """The command as a user runs it: no SANDBOXER_NO_SERVICE (ext check stays in-process)."""
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")
    return {key: os.environ[key] for key in keep if key in os.environ}


def _write_all(broker: Broker, tmp_path: Path) -> None:
    runtime = make_runtime(tmp_path / "runtime")
    broker.write(
        "extensions/ext.bwrap.yaml",
        f"extension: ext.bwrap\nconfig:\n  runtime:\n    path: {runtime}\n    sha256: {'ab' * 32}\n",
    )
    broker.write("profiles/dev.yaml", profile_yaml("dev"))
    broker.write("grants.yaml", GRANTS)


@pytest.mark.parametrize(
    ("name", "relpath", "kind"),
    [("dev", "profiles/dev.yaml", "profile"), ("ext.bwrap", "extensions/ext.bwrap.yaml", "extension"),
     ("grants", "grants.yaml", "grants")],
)  # fmt: skip
def test_check_by_name_is_the_check_of_the_file_approve_reads(
    broker: Broker, tmp_path: Path, name: str, relpath: str, kind: str
) -> None:
    _write_all(broker, tmp_path)
    path = broker.config / relpath
    by_name = broker.run("ext", "check", name, "--json")
    assert by_name.status == 0, by_name.stderr
    by_path = broker.run("ext", "check", str(path), "--json")
    assert by_path.status == 0, by_path.stderr
    assert by_name.json() == by_path.json()
    assert (by_name.json()["file"], by_name.json()["kind"]) == (str(path), kind)
    human = broker.run("ext", "check", name, env=_client_env())
    assert human.status == 0, human.stderr
    assert human.stdout.splitlines()[0] == f"{path}: valid {kind} (sha256 {by_path.json()['sha256']})"
    assert not broker.state.exists()  # a file check needs nothing of the state dir


@pytest.mark.parametrize("name", ["nosuch", "ext.docker", "grants", "Bad Name", "ext.foo", "-"])
def test_an_unknown_name_is_the_same_one_line_error_as_approve(broker: Broker, name: str) -> None:
    checked = broker.run("ext", "check", "--", name, env=_client_env())
    approved = broker.run("ext", "approve", "--", name)
    assert (checked.status, approved.status) == (2, 2), (checked.stderr, approved.stderr)
    assert checked.stderr == approved.stderr
    assert checked.stderr.startswith("sandboxer: ")
    assert checked.stderr.count("\n") == 1
    assert checked.stdout == ""
    as_json = broker.run("ext", "check", "--json", "--", name)
    assert as_json.status == 2
    assert as_json.json()["error"]["kind"] == "usage"


def test_a_named_file_must_declare_its_name_as_for_approve(broker: Broker) -> None:
    broker.write("profiles/dev.yaml", profile_yaml("other"))
    broker.write("grants.yaml", profile_yaml("dev"))  # a profile where the grants belong
    for name in ("dev", "grants"):
        checked = broker.run("ext", "check", name)
        approved = broker.run("ext", "approve", name)
        assert (checked.status, approved.status) == (2, 2), (checked.stderr, approved.stderr)
        assert checked.stderr == approved.stderr
        assert "must equal the file's name" in checked.stderr


def _in(cwd: Path, broker: Broker, *args: str) -> Result:
    argv = [sys.executable, "-m", "sandboxer", "--config-dir", str(broker.config), "--state-dir", str(broker.state)]
    proc = subprocess.run([*argv, *args], cwd=cwd, env=_client_env(), capture_output=True, text=True, check=False)
    return Result(proc.returncode, proc.stdout, proc.stderr)


def test_a_path_is_still_a_file_relative_or_absolute(broker: Broker, tmp_path: Path) -> None:
    elsewhere = tmp_path / "drafts"
    elsewhere.mkdir()
    (elsewhere / "dev.yaml").write_text(profile_yaml("dev"))
    (elsewhere / "dev").write_text(profile_yaml("dev"))
    for given in ("dev.yaml", "./dev", str(elsewhere / "dev")):
        result = _in(elsewhere, broker, "ext", "check", given)
        assert result.status == 0, (given, result.stderr)
        assert result.stdout.startswith(f"{given}: valid profile (sha256 ")
    # A bare NAME is the config dir's file, never one in the working directory.
    named = _in(elsewhere, broker, "ext", "check", "dev")
    assert named.status == 2
    assert named.stderr == f"sandboxer: {broker.config / 'profiles' / 'dev.yaml'}: no such file\n"
    missing = _in(elsewhere, broker, "ext", "check", "gone.yaml")
    assert (missing.status, missing.stderr) == (2, "sandboxer: gone.yaml: no such file\n")
