"""Runtime bootstrap through the real CLI: `bootstrap check FILE [--json]`, and
`create --bootstrap FILE` on bwrap (as root) and Docker: the file delivered byte for byte at
/run/sandboxer/state/home/runtime-bootstrap.json (0600, the sandbox user's), the suspend
control's directory exactly when asked, the credential in no argv, environment, registry,
receipt or inspect output, refusals that leave nothing, and nothing left after teardown."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Broker, Result
from tests.integration.conftest import SandboxBroker
from tests.integration.scan import files_holding
from tests.integration.test_manifest_sandboxes import assert_nothing_left, make_run, volumes_now

TARGET = "/run/sandboxer/state/home/runtime-bootstrap.json"
SUSPEND = "/run/sandboxer/state/suspend"
SANDBOX_UID = 1000
NON_SECRET = ("version", "core_url", "device_id", "environment_id", "session_id", "workspace", "suspend_control")


def new_credential() -> str:
    """A distinctive credential for one test."""
    return "bcred_" + secrets.token_hex(20)


def document(credential: str, **changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "version": "1",
        "core_url": "https://core.example.com/prefix/api/v1",
        "device_id": "0f6e8a3c-5b1d-4c2e-9a7f-1e2d3c4b5a69",
        "credential": credential,
        "environment_id": "8c1d2e3f-4a5b-4c6d-8e7f-90a1b2c3d4e5",
        "session_id": "b2c3d4e5-f6a7-4b8c-9d0e-1f2a3b4c5d6e",
        "workspace": "/workspace",
        "suspend_control": False,
    }
    doc.update(changes)
    return doc


def rendered(doc: dict[str, Any]) -> bytes:
    """Deliberately unusual formatting (indent 3, escaped slashes, a final newline) so that a
    re-serialized copy would not be byte-identical."""
    return json.dumps(doc, indent=3).replace("/", "\\/").encode() + b"\n"


def write_bootstrap(path: Path, data: bytes, mode: int = 0o600) -> Path:
    path.write_bytes(data)
    path.chmod(mode)
    return path


def one_error_line(result: Result, status: int, *words: str) -> str:
    assert result.status == status, (result.status, result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("sandboxer:"), result.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def files_containing(root: Path, needle: bytes) -> list[str]:
    """Every regular file below `root` (symlinks not followed) whose content holds `needle`."""
    return files_holding(root, [needle])


def host_processes_holding(needle: bytes) -> list[str]:
    """Host processes whose argv or environment holds `needle`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        for part in ("cmdline", "environ"):
            try:
                if needle in (entry / part).read_bytes():
                    found.append(f"{entry.name}/{part}")
            except OSError:
                continue
    return found


def docker_out(*args: str) -> str:
    out = subprocess.run(["docker", *args], capture_output=True, text=True, check=False, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


# ------------------------------------------------------------------------------------ the CLI


@pytest.fixture
def cli(broker: Broker) -> Broker:
    return broker


@pytest.mark.parametrize("suspend", [False, True])
def test_check_a_valid_file(cli: Broker, tmp_path: Path, suspend: bool) -> None:
    credential = new_credential()
    doc = document(credential, suspend_control=suspend)
    path = write_bootstrap(tmp_path / "runtime-bootstrap.json", rendered(doc))

    human = cli.run("bootstrap", "check", str(path))
    assert human.status == 0, human.stderr
    assert credential not in human.stdout + human.stderr
    assert human.stdout.strip(), "nothing printed for a valid file"

    shown = cli.run("bootstrap", "check", str(path), "--json")
    assert shown.status == 0, shown.stderr
    assert credential not in shown.stdout + shown.stderr
    result = shown.json()
    assert result["valid"] is True
    assert "credential" not in result
    for key in NON_SECRET:
        assert result[key] == doc[key], key
    assert path.read_bytes() == rendered(doc), "check changed the file"


def test_check_a_relative_path(cli: Broker, tmp_path: Path) -> None:
    credential = new_credential()
    write_bootstrap(tmp_path / "b.json", rendered(document(credential)))
    argv = [sys.executable, "-m", "sandboxer", "--config-dir", str(cli.config), "--state-dir", str(cli.state)]
    proc = subprocess.run(
        [*argv, "bootstrap", "check", "b.json", "--json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["valid"] is True
    assert credential not in proc.stdout + proc.stderr


def _raw_member(credential: str, member: str) -> bytes:
    text = json.dumps(document(credential))
    return (text[:-1] + ", " + member + "}").encode()


def invalid_files(credential: str) -> list[tuple[str, bytes, int, str]]:
    """(name, content, mode, the field the error names or "" for a whole-file problem)."""
    return [
        ("unknown key", rendered({**document(credential), "token": credential}), 0o600, "token"),
        (
            "alias Credential next to credential",
            rendered({**document(credential), "Credential": credential}),
            0o600,
            "Credential",
        ),
        ("alias CORE_URL alone", _alias(credential, "core_url", "CORE_URL"), 0o600, "CORE_URL"),
        ("duplicate credential", _raw_member(credential, f'"credential": "{credential}"'), 0o600, "credential"),
        ("credential with a space", rendered(document(credential[:10] + " " + credential[10:])), 0o600, "credential"),
        ("credential with a NUL", rendered(document(credential + "\x00")), 0o600, "credential"),
        (
            "core_url with userinfo",
            rendered(document(credential, core_url=f"https://{credential}:pw@core.example.com/api/v1")),
            0o600,
            "core_url",
        ),
        (
            "core_url with a query",
            rendered(document(credential, core_url=f"https://core.example.com/api/v1?token={credential}")),
            0o600,
            "core_url",
        ),
        (
            "device_id uppercase",
            rendered(document(credential, device_id="0F6E8A3C-5B1D-4C2E-9A7F-1E2D3C4B5A69")),
            0o600,
            "device_id",
        ),
        (
            "session_id all zero",
            rendered(document(credential, session_id="00000000-0000-0000-0000-000000000000")),
            0o600,
            "session_id",
        ),
        ("version number 1", rendered(document(credential, version=1)), 0o600, "version"),
        ("workspace with ..", rendered(document(credential, workspace="/a/../workspace")), 0o600, "workspace"),
        ("suspend_control 1", rendered(document(credential, suspend_control=1)), 0o600, "suspend_control"),
        (
            "missing session_id",
            rendered({k: v for k, v in document(credential).items() if k != "session_id"}),
            0o600,
            "session_id",
        ),
        ("16385 bytes", _padded(credential, 16385), 0o600, ""),
        ("trailing data", json.dumps(document(credential)).encode() + f' "{credential}"'.encode(), 0o600, ""),
        ("NaN", _raw_member(credential, '"x": NaN'), 0o600, ""),
        ("top-level array", json.dumps([document(credential)]).encode(), 0o600, ""),
        ("mode 0644", rendered(document(credential)), 0o644, ""),
        ("mode 0640", rendered(document(credential)), 0o640, ""),
    ]


def _alias(credential: str, key: str, alias: str) -> bytes:
    return rendered({alias if k == key else k: v for k, v in document(credential).items()})


def _padded(credential: str, size: int) -> bytes:
    text = json.dumps(document(credential)).encode()
    return b"{" + b" " * (size - len(text)) + text[1:]


def test_padded_sizes() -> None:
    assert len(_padded(new_credential(), 16385)) == 16385


def test_check_a_16384_byte_file(cli: Broker, tmp_path: Path) -> None:
    credential = new_credential()
    path = write_bootstrap(tmp_path / "b.json", _padded(credential, 16384))
    result = cli.run("bootstrap", "check", str(path), "--json")
    assert result.status == 0, result.stderr
    assert credential not in result.stdout + result.stderr


@pytest.mark.parametrize("name", [name for name, *_ in invalid_files("x" * 46)])
def test_check_an_invalid_file(cli: Broker, tmp_path: Path, name: str) -> None:
    credential = new_credential()
    data, mode, field = next((d, m, f) for n, d, m, f in invalid_files(credential) if n == name)
    path = write_bootstrap(tmp_path / "runtime-bootstrap.json", data, mode)

    human = cli.run("bootstrap", "check", str(path))
    line = one_error_line(human, 2, *([f"{field}:"] if field else []))
    assert str(path) in line
    assert human.stdout == ""
    assert credential not in human.stdout + human.stderr

    shown = cli.run("bootstrap", "check", str(path), "--json")
    line = one_error_line(shown, 2, *([f"{field}:"] if field else []))
    assert credential not in shown.stdout + shown.stderr
    error = shown.json()
    assert set(error) == {"error"}
    assert isinstance(error["error"], dict)
    assert error["error"]["message"] in line
    if field:
        assert field in error["error"]["message"]


def test_check_refuses_special_files(cli: Broker, tmp_path: Path) -> None:
    credential = new_credential()
    real = write_bootstrap(tmp_path / "real.json", rendered(document(credential)))
    link = tmp_path / "link.json"
    link.symlink_to(real)
    directory = tmp_path / "dir.json"
    directory.mkdir(mode=0o700)
    for path in (link, directory, tmp_path / "missing.json"):
        for extra in ((), ("--json",)):
            result = cli.run("bootstrap", "check", str(path), *extra)
            one_error_line(result, 2)
            assert credential not in result.stdout + result.stderr
            if extra:
                assert set(result.json()) == {"error"}
    assert cli.run("bootstrap", "check", str(real)).status == 0


# ------------------------------------------------------------------------------------ delivery


@pytest.fixture
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bs")


def create_with(broker: SandboxBroker, path: Path, *extra: str) -> Result:
    result = broker.run("create", "--profile", broker.profile, "--bootstrap", str(path), *extra)
    if result.status == 0:
        sandbox_id = result.json()["id"] if "--json" in extra else result.stdout.strip()
        broker.created.append(sandbox_id)
    return result


def sandboxes(broker: SandboxBroker) -> list[str]:
    registry = broker.state / "sandboxes"
    return sorted(p.name for p in registry.iterdir() if not p.name.startswith(".")) if registry.is_dir() else []


INSIDE_PROCS = 'for f in /proc/[0-9]*/cmdline /proc/[0-9]*/environ; do cat "$f" 2>/dev/null; echo; done'


def test_delivery_byte_identical_private_and_nowhere_else(sbx_root: SandboxBroker, base: Path) -> None:
    broker = sbx_root
    credential = new_credential()
    data = rendered(document(credential))
    path = write_bootstrap(base / "runtime-bootstrap.json", data)

    created = create_with(broker, path, "--json")
    assert created.status == 0, created.stderr
    assert credential not in created.stdout + created.stderr
    sandbox_id = created.json()["id"]

    first = broker.sh(
        sandbox_id, f"stat -c '%a %u %s' {TARGET}; if [ -e {SUSPEND} ]; then echo present; else echo absent; fi"
    )
    assert first.status == 0, first.stderr
    assert first.stdout.splitlines() == [f"600 {SANDBOX_UID} {len(data)}", "absent"], first.stdout

    shown = broker.exec(sandbox_id, "cat", TARGET)
    assert shown.status == 0, shown.stderr
    assert shown.stdout.encode() == data

    env = broker.exec(sandbox_id, "env")
    assert env.status == 0, env.stderr
    assert credential not in env.stdout
    procs = broker.sh(sandbox_id, INSIDE_PROCS)
    assert credential not in procs.stdout
    assert host_processes_holding(credential.encode()) == []

    for args in (("inspect", sandbox_id, "--json"), ("inspect", sandbox_id), ("list", "--json"), ("list",)):
        result = broker.run(*args)
        assert result.status == 0, (args, result.stderr)
        assert credential not in result.stdout + result.stderr, args
    record = broker.sandbox_dir(sandbox_id) / "record.json"
    assert record.is_file()
    assert credential.encode() not in record.read_bytes()
    assert files_containing(broker.state, credential.encode()) == []
    if broker.backend == "docker":
        label = f"label=io.sandboxer.state-dir={broker.state}"
        for container in docker_out("ps", "-aq", "--filter", label).split():
            assert credential not in docker_out("inspect", container)

    # it survives between execs, as the runtime's own file
    again = broker.exec(sandbox_id, "cat", TARGET)
    assert again.stdout.encode() == data

    teardown = broker.run("teardown", sandbox_id, "--json")
    assert teardown.status == 0, (teardown.stdout, teardown.stderr)
    assert credential not in teardown.stdout + teardown.stderr
    assert teardown.json()["residue"] == []
    assert sandboxes(broker) == []
    assert files_containing(broker.state, credential.encode()) == []
    assert host_processes_holding(credential.encode()) == []
    if broker.backend == "docker":
        label = f"label=io.sandboxer.state-dir={broker.state}"
        assert docker_out("ps", "-aq", "--filter", label).split() == []
        assert docker_out("volume", "ls", "-q", "--filter", label).split() == []
    assert path.read_bytes() == data, "the caller's bootstrap file was changed"


def test_a_16384_byte_bootstrap_is_delivered_whole(sbx_root: SandboxBroker, base: Path) -> None:
    broker = sbx_root
    credential = new_credential()
    short = json.dumps(document(credential)).encode()
    data = json.dumps(document(credential + "k" * (16384 - len(short)))).encode()
    assert len(data) == 16384
    path = write_bootstrap(base / "runtime-bootstrap.json", data)
    created = create_with(broker, path)
    assert created.status == 0, created.stderr
    sandbox_id = created.stdout.strip()
    sized = broker.exec(sandbox_id, "stat", "-c", "%a %u %s", TARGET)
    assert sized.stdout.strip() == f"600 {SANDBOX_UID} 16384", sized.stdout
    shown = broker.exec(sandbox_id, "cat", TARGET)
    assert shown.stdout.encode() == data
    teardown = broker.run("teardown", sandbox_id, "--json")
    assert teardown.status == 0, teardown.stderr
    assert files_containing(broker.state, credential.encode()) == []


def test_suspend_control_directory(sbx_root: SandboxBroker, base: Path) -> None:
    broker = sbx_root
    credential = new_credential()
    data = rendered(document(credential, suspend_control=True))
    path = write_bootstrap(base / "runtime-bootstrap.json", data)
    created = create_with(broker, path)
    assert created.status == 0, created.stderr
    assert credential not in created.stdout + created.stderr
    sandbox_id = created.stdout.strip()

    first = broker.sh(sandbox_id, f"stat -c '%a %u %F' {SUSPEND}; stat -c '%a %u %s' {TARGET}")
    assert first.status == 0, first.stderr
    assert first.stdout.splitlines() == [f"700 {SANDBOX_UID} directory", f"600 {SANDBOX_UID} {len(data)}"]
    published = broker.sh(sandbox_id, f"echo ready > {SUSPEND}/control && cat {SUSPEND}/control")
    assert published.status == 0, published.stderr
    assert published.stdout == "ready\n"
    shown = broker.exec(sandbox_id, "cat", TARGET)
    assert shown.stdout.encode() == data

    teardown = broker.run("teardown", sandbox_id, "--json")
    assert teardown.status == 0, teardown.stderr
    assert credential not in teardown.stdout + teardown.stderr
    assert sandboxes(broker) == []
    assert files_containing(broker.state, credential.encode()) == []


def test_no_suspend_directory_without_a_bootstrap(sbx_root: SandboxBroker) -> None:
    broker = sbx_root
    sandbox_id = broker.create()
    seen = broker.sh(sandbox_id, f"if [ -e {SUSPEND} ]; then echo present; else echo absent; fi; ls -A $HOME")
    assert seen.status == 0, seen.stderr
    assert seen.stdout.splitlines()[0] == "absent"
    assert "runtime-bootstrap.json" not in seen.stdout


@pytest.mark.parametrize("workspace", ["/home/runtime/workspace", "/", "/workspace/sub", "/srv/workspace"])
def test_a_workspace_other_than_workspace_is_refused(sbx_root: SandboxBroker, base: Path, workspace: str) -> None:
    broker = sbx_root
    credential = new_credential()
    volumes = volumes_now(broker)
    path = write_bootstrap(base / "runtime-bootstrap.json", rendered(document(credential, workspace=workspace)))
    refused = create_with(broker, path)
    one_error_line(refused, 3, "workspace")
    assert credential not in refused.stdout + refused.stderr
    assert_nothing_left(broker, volumes)
    if broker.state.exists():
        assert files_containing(broker.state, credential.encode()) == []


def test_bad_bootstrap_files_are_refused_and_leave_nothing(sbx_root: SandboxBroker, base: Path) -> None:
    broker = sbx_root
    credential = new_credential()
    volumes = volumes_now(broker)
    real = write_bootstrap(base / "real.json", rendered(document(credential)))
    link = base / "link.json"
    link.symlink_to(real)
    wide = write_bootstrap(base / "wide.json", rendered(document(credential)), 0o644)
    group = write_bootstrap(base / "group.json", rendered(document(credential)), 0o640)
    directory = base / "dir.json"
    directory.mkdir(mode=0o700)
    cases: list[tuple[Path, str]] = [(link, ""), (wide, ""), (group, ""), (directory, ""), (base / "absent.json", "")]
    for name, data, mode, field in invalid_files(credential):
        if name in (
            "unknown key",
            "alias Credential next to credential",
            "credential with a space",
            "16385 bytes",
            "trailing data",
            "top-level array",
        ):
            cases.append((write_bootstrap(base / f"{len(cases)}.json", data, mode), field))
    for path, field in cases:
        for extra in ((), ("--json",)):
            refused = create_with(broker, path, *extra)
            one_error_line(refused, 2, *([f"{field}:"] if field else []))
            assert credential not in refused.stdout + refused.stderr, path
            if extra:
                assert set(refused.json()) == {"error"}, refused.stdout
            assert_nothing_left(broker, volumes)
    assert real.read_bytes() == rendered(document(credential))
    if broker.state.exists():
        assert files_containing(broker.state, credential.encode()) == []


def _manifest_without(base: Path, broker: SandboxBroker, scopes: set[str]) -> Path:
    base.mkdir()
    run = make_run(base, broker)
    run.doc["leases"] = [lease for lease in run.doc["leases"] if lease["scope"] not in scopes]
    run.save()
    return run.assignment


@pytest.mark.parametrize(
    "dropped",
    [set(), {"provider-environment"}, {"provider-credential"}],
    ids=["both provider leases", "a provider-credential lease", "a provider-environment lease"],
)
def test_a_manifest_with_a_provider_lease_is_refused(sbx_root: SandboxBroker, base: Path, dropped: set[str]) -> None:
    broker = sbx_root
    credential = new_credential()
    volumes = volumes_now(broker)
    manifest = _manifest_without(base / "r", broker, dropped)
    checked = broker.run("manifest", "check", str(manifest))
    assert checked.status == 0, checked.stderr
    path = write_bootstrap(base / "runtime-bootstrap.json", rendered(document(credential)))
    refused = create_with(broker, path, "--manifest", str(manifest))
    one_error_line(refused, 3)
    assert credential not in refused.stdout + refused.stderr
    assert_nothing_left(broker, volumes)


def test_a_manifest_without_provider_leases_is_accepted(sbx_root: SandboxBroker, base: Path) -> None:
    broker = sbx_root
    credential = new_credential()
    manifest = _manifest_without(base / "r", broker, {"provider-environment", "provider-credential"})
    checked = broker.run("manifest", "check", str(manifest))
    if checked.status != 0:
        pytest.skip(f"the sample manifest without provider leases is not valid here: {checked.stderr.strip()}")
    data = rendered(document(credential))
    path = write_bootstrap(base / "runtime-bootstrap.json", data)
    created = create_with(broker, path, "--manifest", str(manifest))
    assert created.status == 0, created.stderr
    sandbox_id = created.stdout.strip()
    shown = broker.sh(sandbox_id, f"stat -c '%a %u' {TARGET} && cat {TARGET}")
    assert shown.status == 0, shown.stderr
    assert shown.stdout.encode() == f"600 {SANDBOX_UID}\n".encode() + data
    teardown = broker.run("teardown", sandbox_id, "--json")
    assert teardown.status == 0, teardown.stderr
    assert credential not in teardown.stdout
    assert files_containing(broker.state, credential.encode()) == []
