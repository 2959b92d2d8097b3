"""Sandboxes made from a lease manifest (docs/manifest.md), on bwrap as root and on Docker:
lease binds, request spools, project variables, provider launches, expiry at exec, refusals
that leave nothing behind, and teardown of what the assignment handed over."""

from __future__ import annotations

import json
import os
import subprocess
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sandboxer.backends.docker.render import STATE_LABEL
from tests.conftest import Result, make_repository
from tests.integration.conftest import SandboxBroker
from tests.integration.scan import files_holding
from tests.manifest_samples import (
    CREDENTIAL,
    MODEL,
    PROJECT_ENV,
    PROVIDER_ENV,
    REQUEST,
    RUN_ID,
    SHARED,
    Run,
    build_run,
    write_file,
)

SHARED_TARGET = "/run/branchbox/leases/shared/exchange"
PROJECT_ENV_TARGET = "/run/branchbox/leases/project-env"
SOCKET_TARGET = "/run/branchbox/leases/tool-endpoints/delivery.sock"
NOTES_TARGET = "/run/branchbox/leases/tool-endpoints/notes"
SPOOL = "/run/branchbox/leases/tool-requests/delivery"
CREDENTIAL_TARGET = "/etc/provider/credential.json"
CONSUMER = "coding-agent"
INHERITED = {"MODEL_ACCESS_TOKEN": "inherited-token-5d8c1e7a9b", "MODEL_REGION": "region-north-3f2a"}
PROVIDER_ENV_NAMES = sorted(
    [
        "PATH",
        "HOME",
        "XDG_CONFIG_HOME",
        "XDG_CACHE_HOME",
        "XDG_STATE_HOME",
        "TMPDIR",
        "MODEL_ACCESS_TOKEN",
        "MODEL_REGION",
        "SOURCE_DELIVERY_TOKEN",
        "EXTRA_PROVIDER_SETTING",
    ]
)
SHARED_NOTE = b"shared note from the orchestrator\n"


# ------------------------------------------------------------------------------------ helpers


def git_head(repo: Path, rev: str = "HEAD") -> str:
    out = subprocess.run(["git", "-C", str(repo), "rev-parse", rev], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def prepare(run: Run, broker: SandboxBroker, *, revision: str | None = None) -> None:
    """Make the sample run fit this broker: its repository and revision, no images or published
    ports (loopback only; the extension's image), the model identity's executable `env`."""
    doc = run.doc
    doc["repository"] = {"path": str(broker.repo), "revision": revision or git_head(broker.repo)}
    doc["published_ports"] = []
    for key in ("service_images", "port_proxy_image", "workspace_folder", "omitted_services"):
        doc.pop(key, None)
    doc["leases"][MODEL]["executable"] = "env"


def make_run(base: Path, broker: SandboxBroker, version: str = "2", *, revision: str | None = None) -> Run:
    """A complete valid run for this broker, saved, with a note in the shared directory."""
    run = build_run(base, version)
    prepare(run, broker, revision=revision)
    write_file(run.source(SHARED) / "note.txt", SHARED_NOTE, 0o644)
    run.save()
    return run


def create(broker: SandboxBroker, run: Run) -> str:
    result = broker.run("create", "--profile", broker.profile, "--manifest", str(run.assignment))
    assert result.status == 0, result.stderr
    sandbox_id = result.stdout.strip()
    broker.created.append(sandbox_id)
    return sandbox_id


def run_env(broker: SandboxBroker, *args: str, extra_env: dict[str, str] | None = None) -> Result:
    """Run the CLI with extra variables in the caller's environment (for this one run only)."""
    proc = subprocess.run(
        broker.argv(*args), capture_output=True, env={**broker.env(), **(extra_env or {})}, check=False, timeout=120
    )
    return Result(proc.returncode, proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace"))


def provider_launch(
    broker: SandboxBroker,
    sandbox_id: str,
    *,
    consumer: str = CONSUMER,
    executable: str = "env",
    extra_env: dict[str, str] | None = None,
) -> Result:
    """`exec ID --consumer C --executable E -- env`, the caller's environment holding `extra_env`
    (by default both inherited names)."""
    env = INHERITED if extra_env is None else extra_env
    options = ("--consumer", consumer, "--executable", executable)
    return run_env(broker, "exec", sandbox_id, *options, "--", "env", extra_env=env)


def env_of(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def record_of(broker: SandboxBroker, sandbox_id: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((broker.sandbox_dir(sandbox_id) / "record.json").read_text())
    return data


def docker(*args: str) -> str:
    out = subprocess.run(["docker", *args], capture_output=True, text=True, check=False, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def spool_volumes(broker: SandboxBroker) -> set[str]:
    """The spool volumes the daemon has of this broker's state dir, and any of none (which no
    broker should make): another broker's, of a test running at the same time, are not these."""
    listed = docker("volume", "ls", "--format", f'{{{{.Name}}}}\t{{{{.Label "{STATE_LABEL}"}}}}')
    return {
        name
        for name, _, state in (line.partition("\t") for line in listed.splitlines())
        if name.startswith("sandboxer-spool-") and state in ("", str(broker.state))
    }


def sandboxes_on_disk(broker: SandboxBroker) -> list[str]:
    registry = broker.state / "sandboxes"
    return sorted(p.name for p in registry.iterdir() if not p.name.startswith(".")) if registry.is_dir() else []


def assert_nothing_left(broker: SandboxBroker, volumes_before: set[str] | None) -> None:
    """No sandbox directory; on Docker no container of this broker and no new spool volume."""
    assert sandboxes_on_disk(broker) == []
    if broker.backend == "docker":
        label = f"label=io.sandboxer.state-dir={broker.state}"
        assert docker("ps", "-aq", "--filter", label).split() == []
        assert docker("volume", "ls", "-q", "--filter", label).split() == []
        assert volumes_before is not None
        assert spool_volumes(broker) - volumes_before == set()


def volumes_now(broker: SandboxBroker) -> set[str] | None:
    return spool_volumes(broker) if broker.backend == "docker" else None


def assert_refused(result: Result, status: int, *words: str) -> None:
    assert result.status == status, (result.status, result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("sandboxer:"), result.stderr
    for word in words:
        assert word in result.stderr, result.stderr


def rfc3339(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def lease_mounts(broker: SandboxBroker, sandbox_id: str) -> dict[str, dict[str, Any]]:
    inspected = broker.run("inspect", sandbox_id, "--json")
    assert inspected.status == 0, inspected.stderr
    leases = inspected.json()["leases"]
    assert leases is not None
    assert leases["run_id"] == RUN_ID
    return {m["target"]: m for m in leases["mounts"]}


# ------------------------------------------------------------------------------------ tests


def test_shared_directory_is_a_read_only_bind(sbx_root: SandboxBroker, base: Path) -> None:
    broker = sbx_root
    run = make_run(base, broker)
    sandbox_id = create(broker, run)

    read = broker.exec(sandbox_id, "cat", f"{SHARED_TARGET}/note.txt")
    assert read.status == 0, read.stderr
    assert read.stdout.encode() == SHARED_NOTE

    for script in (f"touch {SHARED_TARGET}/new", f"echo x >> {SHARED_TARGET}/note.txt", f"mkdir {SHARED_TARGET}/d"):
        written = broker.sh(sandbox_id, script)
        assert written.status != 0, f"{script!r} succeeded inside"
    assert sorted(p.name for p in run.source(SHARED).iterdir()) == ["note.txt"]
    assert (run.source(SHARED) / "note.txt").read_bytes() == SHARED_NOTE

    mounts = lease_mounts(broker, sandbox_id)
    assert mounts[SHARED_TARGET]["lease_id"] == "shared_exchange"
    assert mounts[SHARED_TARGET]["present"] is True
    assert mounts[SHARED_TARGET]["read_only"] is True
    for target in (NOTES_TARGET, CREDENTIAL_TARGET):
        assert mounts[target]["present"] is True, mounts[target]
        assert mounts[target]["read_only"] is True, mounts[target]


SPOOL_SCRIPT = f"""
cd {SPOOL} || exit 90
stat -c '%a %u %n' .binding.json .capability requests responses .processing
echo "id $(id -u)"
if echo request > requests/r1.json; then echo "requests: wrote"; else echo "requests: refused"; fi
if echo response > responses/r1.json; then echo "responses: wrote"; else echo "responses: refused"; fi
if echo forged > .capability; then echo "capability-write: wrote"; else echo "capability-write: refused"; fi
if echo forged > requests/cap && mv -f requests/cap .capability; then echo "capability-replace: replaced";
else echo "capability-replace: refused"; fi
if rm -f .capability; then echo "capability-remove: removed"; else echo "capability-remove: refused"; fi
if ls .processing > /dev/null; then echo "processing: listed"; else echo "processing: refused"; fi
if test -e {SOCKET_TARGET} || test -L {SOCKET_TARGET}; then echo "socket: present"; else echo "socket: absent"; fi
if test -d {NOTES_TARGET}; then echo "notes: present"; else echo "notes: absent"; fi
echo "capability $(cat .capability)"
"""


def test_request_spool_layout_and_modes_as_the_consumer_sees_them(sbx_root: SandboxBroker, base: Path) -> None:
    broker = sbx_root
    run = make_run(base, broker)
    capability = run.source(REQUEST).read_bytes().decode()
    sandbox_id = create(broker, run)

    result = broker.sh(sandbox_id, SPOOL_SCRIPT)
    assert result.status == 0, (result.stdout, result.stderr)
    lines = result.stdout.splitlines()
    modes = {line.split()[2]: (line.split()[0], int(line.split()[1])) for line in lines[:5]}
    assert lines[5] == "id 1000"
    assert {name: mode for name, (mode, _) in modes.items()} == {
        ".binding.json": "444",
        ".capability": "444",
        "requests": "700",
        "responses": "755",
        ".processing": "700",
    }, lines[:5]
    assert modes["requests"][1] == 1000
    for name in (".binding.json", ".capability", "responses", ".processing"):
        assert modes[name][1] != 1000, f"{name} is the consumer's: {lines[:5]}"
    outcome = dict(line.split(": ", 1) for line in lines[6:] if ": " in line)
    assert outcome == {
        "requests": "wrote",
        "responses": "refused",
        "capability-write": "refused",
        "capability-replace": "refused",
        "capability-remove": "refused",
        "processing": "refused",
        "socket": "absent",
        "notes": "present",
    }, result.stdout
    assert lines[-1] == f"capability {capability}", "the capability changed inside"

    binding = broker.exec(sandbox_id, "cat", f"{SPOOL}/.binding.json")
    assert binding.status == 0, binding.stderr
    doc = binding.json()
    assert doc["lease_id"] == "delivery_requests"
    assert doc["consumer_uid"] == 1000
    assert doc["request_dir"] == f"{SPOOL}/requests"
    assert doc["response_dir"] == f"{SPOOL}/responses"
    assert capability not in binding.stdout

    mounts = lease_mounts(broker, sandbox_id)
    assert SOCKET_TARGET not in mounts, "the linked socket endpoint is mounted"
    assert mounts[SPOOL]["present"] is True
    assert mounts[SPOOL]["read_only"] is False


def test_provider_values_reach_only_the_provider_launch(sbx_root: SandboxBroker, base: Path) -> None:
    broker = sbx_root
    run = make_run(base, broker)
    token = run.source(PROVIDER_ENV, 0).read_bytes().decode()
    setting = run.source(PROVIDER_ENV, 1).read_bytes().decode()
    provider_markers = [s for s in run.secrets if s.startswith("provsecret-") or "provsecret-" in s]
    assert token in provider_markers
    assert len(provider_markers) == 2
    watched = [*provider_markers, *INHERITED.values()]
    sandbox_id = create(broker, run)

    launched = provider_launch(broker, sandbox_id)
    assert launched.status == 0, launched.stderr
    env = env_of(launched.stdout)
    assert sorted(env) == PROVIDER_ENV_NAMES, launched.stdout
    assert env["SOURCE_DELIVERY_TOKEN"] == token
    assert env["EXTRA_PROVIDER_SETTING"] == setting
    assert {name: env[name] for name in INHERITED} == INHERITED
    assert env["PATH"] == "/opt/sandboxer/runtime/bin:/usr/local/bin:/usr/bin:/bin"
    assert env["HOME"] == "/run/sandboxer/state/home"
    assert not any(secret in launched.stderr for secret in watched)

    plain = run_env(broker, "exec", sandbox_id, "--", "env", extra_env=INHERITED)
    assert plain.status == 0, plain.stderr
    consumer_only = run_env(broker, "exec", sandbox_id, "--consumer", CONSUMER, "--", "env", extra_env=INHERITED)
    assert consumer_only.status == 0, consumer_only.stderr
    inspected = broker.run("inspect", sandbox_id, "--json")
    assert inspected.status == 0, inspected.stderr
    listed = broker.run("list", "--json")
    record = (broker.sandbox_dir(sandbox_id) / "record.json").read_text()
    for what, text in (
        ("plain exec env", plain.stdout + plain.stderr),
        ("exec --consumer env", consumer_only.stdout + consumer_only.stderr),
        ("inspect --json", inspected.stdout + inspected.stderr),
        ("list --json", listed.stdout),
        ("record.json", record),
    ):
        for secret in watched:
            assert secret not in text, f"a provider value is in the {what}"

    leaked = files_holding(broker.state, [secret.encode() for secret in watched])
    assert leaked == [], f"provider values stored under the state dir: {leaked}"

    if broker.backend == "docker":
        container = record_of(broker, sandbox_id)["container_id"]
        shown = docker("inspect", container)
        for secret in watched:
            assert secret not in shown, "a provider value is in docker inspect"


def test_provider_launch_refusals(sbx_root: SandboxBroker, base: Path) -> None:
    broker = sbx_root
    run = make_run(base, broker)
    watched = [*run.secrets, *INHERITED.values()]
    sandbox_id = create(broker, run)

    refusals = {
        "wrong executable": provider_launch(broker, sandbox_id, executable="review-cli"),
        "unknown executable": provider_launch(broker, sandbox_id, executable="/bin/sh"),
        "wrong consumer": provider_launch(broker, sandbox_id, consumer="review-agent"),
        "unknown consumer": provider_launch(broker, sandbox_id, consumer="primary-tool"),
        "missing inherited": provider_launch(broker, sandbox_id, extra_env={"MODEL_ACCESS_TOKEN": "x-present-1"}),
    }
    for what, result in refusals.items():
        assert result.status == 125, (what, result.status, result.stdout, result.stderr)
        lines = result.stderr.splitlines()
        assert len(lines) == 1, (what, result.stderr)
        assert lines[0].startswith("sandboxer:"), (what, result.stderr)
        assert result.stdout == "", (what, result.stdout)
        for secret in watched:
            assert secret not in result.stderr, f"{what}: a secret is in the refusal"
    assert "MODEL_REGION" in refusals["missing inherited"].stderr

    granted = provider_launch(broker, sandbox_id)
    assert granted.status == 0, granted.stderr


def test_an_expired_lease_refuses_exec_and_create(sbx_root: SandboxBroker, base: Path) -> None:
    broker = sbx_root
    (base / "soon").mkdir()
    run = make_run(base / "soon", broker)
    deadline = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=12)
    run.doc["leases"][SHARED]["expires_at"] = rfc3339(deadline)
    run.save()
    sandbox_id = create(broker, run)

    before = broker.exec(sandbox_id, "true")
    if time.time() < deadline.timestamp() - 1:
        assert before.status == 0, before.stderr
    time.sleep(max(0.0, deadline.timestamp() - time.time()) + 1.5)

    for result in (
        broker.exec(sandbox_id, "true"),
        provider_launch(broker, sandbox_id),
    ):
        assert_refused(result, 125, "expired", "shared_exchange")
        assert result.stdout == ""

    (base / "past").mkdir()
    stale = make_run(base / "past", broker)
    stale.doc["leases"][SHARED]["expires_at"] = "2001-02-03T04:05:06Z"
    stale.save()
    volumes = volumes_now(broker)
    existing = sandboxes_on_disk(broker)
    refused = broker.run("create", "--profile", broker.profile, "--manifest", str(stale.assignment))
    assert_refused(refused, 3, "expire")
    assert sandboxes_on_disk(broker) == existing
    if broker.backend == "docker":
        assert volumes is not None
        assert spool_volumes(broker) - volumes == set()
    for lease in stale.doc["leases"]:
        for item in lease["materializations"]:
            assert os.path.lexists(item["source_path"]), "a refused create removed a source"


def test_a_source_swapped_for_a_symlink_after_check_is_refused(sbx_root: SandboxBroker, base: Path) -> None:
    broker = sbx_root
    (base / "run").mkdir()
    run = make_run(base / "run", broker)
    checked = broker.run("manifest", "check", str(run.assignment))
    assert checked.status == 0, checked.stderr

    credential = run.source(CREDENTIAL)
    data = credential.read_bytes()
    elsewhere = base / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    decoy = elsewhere / "credential.json"
    write_file(decoy, data, 0o644)
    credential.unlink()
    credential.symlink_to(decoy)

    volumes = volumes_now(broker)
    refused = broker.run("create", "--profile", broker.profile, "--manifest", str(run.assignment))
    assert_refused(refused, 2)
    assert not any(secret in refused.stderr for secret in run.secrets)
    assert_nothing_left(broker, volumes)
    assert decoy.read_bytes() == data
    assert credential.is_symlink()


def test_teardown_removes_spool_and_materializations(sbx_root: SandboxBroker, base: Path) -> None:
    broker = sbx_root
    run = make_run(base, broker)
    sources = [item["source_path"] for lease in run.doc["leases"] for item in lease["materializations"]]
    assert len(sources) == 8
    sandbox_id = create(broker, run)
    directory = broker.sandbox_dir(sandbox_id)
    spools = record_of(broker, sandbox_id)["manifest"]["spools"]
    assert len(spools) == 1
    spool = spools[0]["source"]
    if broker.backend == "docker":
        assert spool.startswith("sandboxer-spool-")
        labels = json.loads(docker("volume", "inspect", spool))[0]["Labels"]
        assert labels["io.sandboxer.sandbox"] == sandbox_id
    else:
        assert spool.startswith(str(directory) + "/")
        assert os.path.isdir(spool)
    filed = broker.exec(sandbox_id, "sh", "-c", f"echo pending > {SPOOL}/requests/q.json")
    assert filed.status == 0, filed.stderr

    teardown = broker.run("teardown", sandbox_id, "--json")
    assert teardown.status == 0, (teardown.stdout, teardown.stderr)
    receipt = teardown.json()
    assert receipt["residue"] == []
    removed = receipt["removed"]
    assert any(spool in item and "spool" in item for item in removed), removed
    for source in sources:
        assert any(item.startswith("materialization") and item.endswith(source) for item in removed), (
            source,
            removed,
        )
        assert not os.path.lexists(source), f"{source} is still there"

    assert not directory.exists()
    if broker.backend == "docker":
        gone = subprocess.run(["docker", "volume", "inspect", spool], capture_output=True, check=False)
        assert gone.returncode != 0, "the spool volume is still there"
        assert spool not in spool_volumes(broker)
    else:
        assert not os.path.lexists(spool)
        mountinfo = Path("/proc/self/mountinfo").read_text().splitlines()
        below = [line for line in mountinfo if str(directory) in line.split()[4]]
        assert below == [], below


def test_project_variables_and_workspace_revision(sbx_root: SandboxBroker, base: Path) -> None:
    broker = sbx_root
    signed = git_head(broker.repo)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost", "-C", str(broker.repo)]
    (broker.repo / "later.txt").write_text("after the signed revision\n")
    subprocess.run([*git, "add", "later.txt"], check=True)
    subprocess.run([*git, "commit", "-qm", "later"], check=True)
    assert git_head(broker.repo) != signed
    run = make_run(base, broker, revision=signed)
    project_file = run.source(PROJECT_ENV).read_bytes()
    project = env_of(project_file.decode())
    assert sorted(project) == ["ALPHA_MODE", "ZETA_LEVEL"]
    sandbox_id = create(broker, run)

    plain = broker.exec(sandbox_id, "env")
    assert plain.status == 0, plain.stderr
    env = env_of(plain.stdout)
    assert {name: env.get(name) for name in project} == project
    for marker in run.secrets:
        if marker.startswith("provsecret-") or "provsecret-" in marker:
            assert marker not in plain.stdout

    shown = broker.exec(sandbox_id, "cat", PROJECT_ENV_TARGET)
    assert shown.status == 0, shown.stderr
    assert shown.stdout.encode() == project_file
    for script in (
        f"echo EVIL=1 >> {PROJECT_ENV_TARGET}",
        f"rm -f {PROJECT_ENV_TARGET}",
        f"touch {PROJECT_ENV_TARGET}",
    ):
        written = broker.sh(sandbox_id, script)
        assert written.status != 0, f"{script!r} succeeded inside"
    again = broker.exec(sandbox_id, "cat", PROJECT_ENV_TARGET)
    assert again.stdout.encode() == project_file
    mounts = lease_mounts(broker, sandbox_id)
    assert mounts[PROJECT_ENV_TARGET]["present"] is True
    assert mounts[PROJECT_ENV_TARGET]["read_only"] is True

    branch = broker.exec(sandbox_id, "git", "-C", "/workspace", "rev-parse", "--abbrev-ref", "HEAD")
    assert branch.status == 0, branch.stderr
    assert branch.stdout.strip() == run.doc["task_branch"]
    head = broker.exec(sandbox_id, "git", "-C", "/workspace", "rev-parse", "HEAD")
    assert head.status == 0, head.stderr
    assert head.stdout.strip() == signed
    later = broker.exec(sandbox_id, "test", "-e", "/workspace/later.txt")
    assert later.status == 1, "the workspace holds a commit after the signed revision"


def test_create_refusals_leave_nothing(sbx_root: SandboxBroker, base: Path) -> None:
    broker = sbx_root
    other = make_repository(base / "other-repo", {"x.txt": b"other\n"}, "other")
    (base / "runs").mkdir()
    run = make_run(base / "runs", broker)
    good = json.loads(json.dumps(run.doc))
    volumes = volumes_now(broker)

    cases: list[tuple[str, int, dict[str, Any]]] = []
    doc = json.loads(json.dumps(good))
    doc["repository"] = {"path": str(other), "revision": git_head(other)}
    cases.append(("repository.path not the profile's", 3, doc))
    doc = json.loads(json.dumps(good))
    doc["repository"]["revision"] = "b" * 40
    cases.append(("revision not in the repository", 3, doc))
    doc = json.loads(json.dumps(good))
    doc["repository"]["revision"] = git_head(other)
    cases.append(("another repository's revision", 3, doc))
    doc = json.loads(json.dumps(good))
    doc["unexpected_field"] = True
    cases.append(("unknown field", 2, doc))
    doc = json.loads(json.dumps(good))
    doc["leases"][REQUEST]["consumer_uid"] = 1001
    cases.append(("tool-request consumer_uid not the sandbox user's", 3, doc))

    for what, status, document in cases:
        run.doc = document
        run.save()
        refused = broker.run("create", "--profile", broker.profile, "--manifest", str(run.assignment))
        assert refused.status == status, (what, refused.status, refused.stdout, refused.stderr)
        lines = refused.stderr.splitlines()
        assert len(lines) == 1, (what, refused.stderr)
        assert lines[0].startswith("sandboxer:"), (what, refused.stderr)
        assert not any(secret in refused.stderr for secret in run.secrets), what
        assert_nothing_left(broker, volumes)
        for lease in document["leases"]:
            for item in lease["materializations"]:
                assert os.path.lexists(item["source_path"]), f"{what}: a refused create removed a source"

    run.doc = good
    run.save()
    sandbox_id = create(broker, run)
    assert sandboxes_on_disk(broker) == [sandbox_id]


def test_v3_workspace_consumer_is_the_sandbox_user(sbx_root: SandboxBroker, base: Path) -> None:
    broker = sbx_root
    run = build_run(base, "3")
    prepare(run, broker)
    run.doc["workspace_consumer"] = {"uid": 2345, "gid": 2346}
    run.doc["leases"][REQUEST]["consumer_uid"] = 2345
    run.save()
    sandbox_id = create(broker, run)

    ids = broker.sh(sandbox_id, f"id -u; id -g; stat -c '%u %g' /workspace {SPOOL}/requests")
    assert ids.status == 0, ids.stderr
    assert ids.stdout.split("\n")[:4] == ["2345", "2346", "2345 2346", "2345 2346"], ids.stdout
    inspected = broker.run("inspect", sandbox_id, "--json")
    assert inspected.status == 0, inspected.stderr
    evidence = inspected.json()
    assert evidence["user"]["uid"] == 2345
    assert evidence["user"]["gid"] == 2346
    assert evidence["matches_plan"] is True, evidence["differences"]
    wrote = broker.sh(sandbox_id, "echo ok > /workspace/mine && echo ok > $HOME/mine && cat /workspace/mine")
    assert wrote.status == 0, wrote.stderr
    assert wrote.stdout == "ok\n"
    launched = provider_launch(broker, sandbox_id)
    assert launched.status == 0, launched.stderr
    assert env_of(launched.stdout)["SOURCE_DELIVERY_TOKEN"] == run.source(PROVIDER_ENV).read_bytes().decode()
