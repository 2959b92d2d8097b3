"""The embedded Python API (`sandboxer.Broker`) against real sandboxes.

The orchestrator of docs/api.md runs as a program on every backend and broker (as the broker's
user, as the CLI does); the finer behaviour runs in-process against a root broker of each
backend and is compared with what the CLI reports for the same sandbox.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxer import Broker, Evidence, ExecResult, Sandbox
from sandboxer.api.results import thawed
from sandboxer.errors import ExecError, NotFoundError, PolicyError, UsageError
from tests.conftest import REPO
from tests.integration.conftest import SandboxBroker

ORCHESTRATOR = REPO / "examples" / "orchestrator.py"


def test_the_documented_orchestrator_is_the_example_file() -> None:
    """docs/api.md shows the very script the next test runs."""
    docs = (REPO / "docs" / "api.md").read_text()
    assert ORCHESTRATOR.read_text() in docs


def test_the_orchestrator_drives_a_whole_sandbox_life(sbx: SandboxBroker) -> None:
    argv = sbx.python(str(ORCHESTRATOR), "--profile", sbx.profile)
    argv += ["--config-dir", str(sbx.config), "--state-dir", str(sbx.state)]
    done = subprocess.run(argv, capture_output=True, text=True, env=sbx.env(), timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert_orchestrated(json.loads(done.stdout), sbx)


def assert_orchestrated(summary: dict[str, object], sbx: SandboxBroker) -> None:
    """What the orchestrator reports of a whole sandbox life, in-process or through a service."""
    assert summary["task"] == {"status": 0, "stdout": "counted 3 words\n", "stderr": "a warning\n"}
    streamed = summary["streamed"]
    assert isinstance(streamed, list)
    assert ["stdout", "3\n"] in streamed
    assert ["stderr", "done\n"] in streamed
    assert summary["streamed_status"] == 0
    assert summary["missing"] == 127
    assert summary["matches_plan"] is True
    assert summary["workspace_mib"] == 4096
    assert summary["listed"] == ["running"]
    assert summary["residue"] == []
    assert summary["listed_after"] == []
    assert summary["after_teardown"] == 125
    assert not (sbx.state / "sandboxes" / str(summary["id"])).exists()


@pytest.fixture(params=["bwrap", "docker"])
def api(request: pytest.FixtureRequest, runtime_dir: Path) -> tuple[Broker, SandboxBroker]:
    """A root broker of each backend, and the Broker object for its directories."""
    if os.geteuid() != 0:
        pytest.skip("the in-process API tests drive a root broker (CI runs as root)")
    broker = request.getfixturevalue("sb_root" if request.param == "bwrap" else "docker_root")
    return Broker(config_dir=str(broker.config), state_dir=str(broker.state)), broker


@pytest.fixture
def box(api: tuple[Broker, SandboxBroker]) -> Iterator[Sandbox]:
    broker, _ = api
    sandbox = broker.create(api[1].profile)
    try:
        yield sandbox
    finally:
        sandbox.teardown()


def test_exec_gives_status_and_both_streams_apart(box: Sandbox) -> None:
    result = box.exec(["sh", "-c", "cat; echo out; echo err >&2; exit 3"], stdin=b"in\n")
    assert result == ExecResult(status=3, stdout=b"in\nout\n", stderr=b"err\n")


def test_exec_takes_large_input_and_output_whole(box: Sandbox) -> None:
    data = os.urandom(3 * 1024 * 1024)
    result = box.exec(["sh", "-c", "cat; cat /workspace/README.md >&2"], stdin=data)
    assert (result.status, len(result.stdout), result.stdout == data) == (0, len(data), True)
    assert result.stderr == b"workspace\n"


def test_exec_options_match_the_cli(box: Sandbox) -> None:
    assert box.exec(["pwd"], cwd="/opt/sandboxer/runtime").stdout == b"/opt/sandboxer/runtime\n"
    assert box.exec(["sh", "-c", "echo $SANDBOXER_CONSUMER"], consumer="agent-1").stdout == b"agent-1\n"
    started = time.monotonic()
    assert box.exec(["sleep", "30"], timeout=1).status == 124
    assert time.monotonic() - started < 20
    missing = box.exec(["no-such-program"])
    assert missing.status == 127
    assert b"no-such-program: not found" in missing.stderr
    with pytest.raises(ExecError, match="--cwd") as raised:
        box.exec(["true"], cwd="relative")
    assert raised.value.status == 125


def test_exec_stream_yields_chunks_as_they_are_written(box: Sandbox) -> None:
    stream = box.exec_stream(["sh", "-c", "echo first; sleep 1; echo second >&2; exit 4"])
    seen: list[tuple[str, bytes, float]] = [(name, chunk, time.monotonic()) for name, chunk in stream]
    assert [(name, chunk) for name, chunk, _ in seen] == [("stdout", b"first\n"), ("stderr", b"second\n")]
    assert seen[1][2] - seen[0][2] > 0.5, "the first chunk arrived before the command ended"
    assert stream.status == 4


def test_inspect_is_the_clis_evidence(api: tuple[Broker, SandboxBroker], box: Sandbox) -> None:
    evidence = box.inspect()
    assert isinstance(evidence, Evidence)
    cli = api[1].run("inspect", box.id, "--json")
    assert cli.status == 0, cli.stderr
    document = cli.json()
    assert evidence.matches_plan is document["matches_plan"] is True
    assert evidence.differences == ()
    assert evidence.id == box.id
    assert evidence.backend == document["backend"]
    assert thawed(evidence.user) == document["user"]
    assert thawed(evidence.seccomp) == document["seccomp"]
    assert [m.target for m in evidence.mounts] == [m["target"] for m in document["mounts"]]
    assert evidence.env_names == tuple(document["env_names"])
    observed, reported = evidence.to_json(), dict(document)
    for both in (observed, reported):
        both["runtime"]["digest_ms"] = None  # the time it took differs between two runs
        both["usage"] = sorted(both["usage"])  # what it uses now changes between two looks
    assert observed == reported


def test_with_tears_down_and_teardown_is_idempotent(api: tuple[Broker, SandboxBroker]) -> None:
    broker, cli = api
    with broker.create(cli.profile) as sandbox:
        assert [info.status for info in broker.list() if info.id == sandbox.id] == ["running"]
    assert not cli.sandbox_dir(sandbox.id).exists()
    receipt = sandbox.teardown()
    assert receipt.id == sandbox.id
    assert receipt.residue == ()
    assert receipt.removed
    assert sandbox.teardown() is receipt
    with pytest.raises(NotFoundError) as raised:
        broker.sandbox(sandbox.id)
    assert raised.value.status == 4


def test_a_sandbox_is_found_again_by_id(api: tuple[Broker, SandboxBroker], box: Sandbox) -> None:
    again = api[0].sandbox(box.id)
    assert again.exec(["echo", "again"]).stdout == b"again\n"


def test_errors_are_the_clis(api: tuple[Broker, SandboxBroker]) -> None:
    broker, cli = api
    with pytest.raises(UsageError) as raised:
        broker.create("no-such-profile")
    assert raised.value.status == 2
    cli_says = cli.run("create", "--profile", "no-such-profile")
    assert cli_says.status == 2
    assert raised.value.message in cli_says.stderr


def test_gc_and_owner_verbs_are_typed(api: tuple[Broker, SandboxBroker]) -> None:
    broker, cli = api
    report = broker.gc()
    assert report.collected == ()
    entries = {entry.name: entry for entry in broker.owner.list()}
    assert entries[cli.profile].status == "approved"
    assert entries[cli.profile].valid is True
    revoked = broker.owner.revoke(cli.profile)
    assert (revoked.status, revoked.revoked) == ("unapproved", True)
    with pytest.raises(PolicyError):
        broker.create(cli.profile)
    approved = broker.owner.approve(cli.profile)
    assert approved.status == "approved"
    assert approved.sha256 == entries[cli.profile].sha256
    digest = broker.owner.runtime_digest(str(cli.runtime))
    assert digest.sha256 == cli.run("runtime", "digest", str(cli.runtime)).stdout.strip()
    assert digest.files > 0


def test_import_sandboxer_stays_light() -> None:
    """The CLI imports the package on every command: the API must not load with it."""
    code = "import sys, sandboxer; print(sorted(m for m in sys.modules if m.startswith('sandboxer')))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert done.stdout.strip() == "['sandboxer']"
