"""Files a caller names for create, through a root service: read with the caller's own rights.

The CLI client opens `--bootstrap FILE` itself and passes the descriptor; the HTTP client reads
the file and sends its bytes. Either way a root service never opens a path another account
chose: a file the caller cannot read stays unread even though root could read it, and a lease
manifest (host paths the broker binds and removes) is taken from the service's own account only.
Real accounts, a real root service, real sandboxes.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxer import Client
from sandboxer.errors import SandboxerError
from tests.integration.conftest import SandboxBroker
from tests.integration.services import Service
from tests.integration.test_bootstrap_cli_and_delivery import TARGET, document, new_credential, rendered
from tests.integration.test_service import _as_account, callers  # noqa: F401 - a fixture
from tests.integration.test_service_cli import _cli_as


@pytest.fixture
def granted(
    sb_root: SandboxBroker,
    callers: tuple[pwd.struct_passwd, pwd.struct_passwd],  # noqa: F811 - the fixture
) -> Iterator[tuple[SandboxBroker, pwd.struct_passwd, Service, Path]]:
    """A root service that grants account A the profile, and a private directory of A's."""
    a, _ = callers
    grants = f"grants:\n  - users: [{a.pw_name}]\n    profiles: [{sb_root.profile}]\n"
    (sb_root.config / "grants.yaml").write_text(grants + "    max_sandboxes: 2\n    max_ttl_seconds: 3600\n")
    sb_root.approve("grants")
    home = Path(tempfile.mkdtemp(prefix="sandboxer-caller-"))
    os.chown(home, a.pw_uid, a.pw_gid)
    started = Service(sb_root, sb_root.state / "broker.sock").start()
    try:
        yield sb_root, a, started, home
    finally:
        started.stop()
        shutil.rmtree(home)


def _owned_by(account: pwd.struct_passwd, path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    path.chmod(0o600)
    os.chown(path, account.pw_uid, account.pw_gid)
    return path


def _delivered(broker: SandboxBroker, sandbox_id: str) -> bytes:
    shown = broker.exec(sandbox_id, "cat", TARGET)
    assert shown.status == 0, shown.stderr
    return shown.stdout.encode()


def _live(broker: SandboxBroker) -> list[str]:
    return [entry["id"] for entry in json.loads(broker.run("list", "--json").stdout)["sandboxes"]]


def test_the_cli_client_passes_its_own_open_of_a_bootstrap_file(
    granted: tuple[SandboxBroker, pwd.struct_passwd, Service, Path],
) -> None:
    broker, a, started, home = granted
    data = rendered(document(new_credential()))
    mine = _owned_by(a, home / "runtime-bootstrap.json", data)
    created = _cli_as(a, started.socket, "create", "--profile", broker.profile, "--bootstrap", str(mine))
    assert created.returncode == 0, created.stderr
    sandbox_id = created.stdout.strip()
    broker.created.append(sandbox_id)
    assert _delivered(broker, sandbox_id) == data  # byte for byte, as A read it

    # Root could read this file; A cannot, and neither may the service on A's behalf.
    roots = broker.root / "root-only.json"
    roots.write_bytes(rendered(document(new_credential())))
    roots.chmod(0o600)
    link = home / "link.json"
    link.symlink_to(mine)
    os.lchown(link, a.pw_uid, a.pw_gid)
    cases = [
        (str(roots), f"sandboxer: {roots}: the bootstrap file cannot be read (Permission denied)"),
        (str(link), f"sandboxer: {link}: the bootstrap file is a symlink"),
        (str(home / "absent.json"), f"sandboxer: {home / 'absent.json'}: the bootstrap file cannot be read (No such"),
    ]
    for named, line in cases:
        refused = _cli_as(a, started.socket, "create", "--profile", broker.profile, f"--bootstrap={named}")
        assert refused.returncode == 2, refused
        assert refused.stderr.startswith(line), refused.stderr
        assert len(refused.stderr.splitlines()) == 1
    assert _live(broker) == [sandbox_id]  # nothing else was made


def test_a_lease_manifest_is_taken_from_the_services_own_account_only(
    granted: tuple[SandboxBroker, pwd.struct_passwd, Service, Path],
) -> None:
    broker, a, started, home = granted
    named = str(_owned_by(a, home / "assignment.json", b"{}"))
    refused = _cli_as(a, started.socket, "create", "--profile", broker.profile, "--manifest", named)
    assert (refused.returncode, refused.stderr) == (
        3,
        "sandboxer: --manifest: a lease manifest names host paths the broker binds into the sandbox and later "
        "removes: the service takes one from its own account only\n",
    )
    code = (
        "from sandboxer import Client\nfrom sandboxer.errors import SandboxerError\n"
        f"try:\n    Client({str(started.socket)!r}).create({broker.profile!r}, manifest={named!r})\n"
        "except SandboxerError as exc:\n    print(type(exc).__name__, exc.status)\n"
    )
    through_api = _as_account(a, code)
    assert through_api.stdout == "PolicyError 3\n", through_api
    assert _live(broker) == []


def test_the_http_client_sends_the_bootstrap_it_read(
    granted: tuple[SandboxBroker, pwd.struct_passwd, Service, Path],
) -> None:
    broker, a, started, home = granted
    data = rendered(document(new_credential()))
    mine = _owned_by(a, home / "runtime-bootstrap.json", data)
    code = (
        "from sandboxer import Client\n"
        f"print(Client({str(started.socket)!r}).create({broker.profile!r}, bootstrap={str(mine)!r}).id)\n"
    )
    created = _as_account(a, code)
    assert created.returncode == 0, created.stderr
    sandbox_id = created.stdout.strip()
    broker.created.append(sandbox_id)
    assert _delivered(broker, sandbox_id) == data

    # The owner's client, in its own account: the same; a file that breaks the rules is refused
    # by the client before anything is sent, with the broker's own message.
    owner = Client(str(started.socket))
    root_file = broker.root / "owner-bootstrap.json"
    root_file.write_bytes(data)
    root_file.chmod(0o600)
    with owner.create(broker.profile, bootstrap=str(root_file)) as sandbox:
        assert _delivered(broker, sandbox.id) == data
    root_file.chmod(0o644)
    with pytest.raises(SandboxerError) as raised:
        owner.create(broker.profile, bootstrap=str(root_file))
    assert raised.value.status == 2
    assert str(root_file) in raised.value.message
    assert "owner-only" in raised.value.message
    assert _live(broker) == [sandbox_id]


def test_a_callers_export_is_written_with_its_own_rights(
    granted: tuple[SandboxBroker, pwd.struct_passwd, Service, Path],
) -> None:
    """The CLI client makes the export's file (or directory) itself, as its account may, and the
    root service writes only into that: the files are the caller's; a directory the caller may
    read but does not own, or a place it cannot write, is refused with nothing written there; a
    failed export leaves nothing of what the client made."""
    broker, a, started, home = granted
    created = _cli_as(a, started.socket, "create", "--profile", broker.profile)
    assert created.returncode == 0, created.stderr
    sandbox_id = created.stdout.strip()
    broker.created.append(sandbox_id)
    script = "echo x > x && git add x && git commit -qm 'Add x'"
    assert _cli_as(a, started.socket, "exec", sandbox_id, "--", "sh", "-c", script).returncode == 0
    bundle = home / "work.bundle"
    done = _cli_as(a, started.socket, "export", sandbox_id, "--bundle", str(bundle))
    assert done.returncode == 0, done.stderr
    assert bundle.stat().st_uid == a.pw_uid
    assert bundle.read_bytes().startswith(b"# v2 git bundle\n")
    patches = home / "patches"
    done = _cli_as(a, started.socket, "export", sandbox_id, "--patch", str(patches))
    assert done.returncode == 0, done.stderr
    assert [(p.name, p.stat().st_uid) for p in patches.iterdir()] == [("0001-Add-x.patch", a.pw_uid)]

    roots = broker.root / "roots-directory"
    roots.mkdir(mode=0o755)
    refused = _cli_as(a, started.socket, "export", sandbox_id, "--patch", str(roots))
    assert (refused.returncode, refused.stderr) == (
        2,
        f"sandboxer: export: {roots}: must be a directory of the caller's own\n",
    )
    refused = _cli_as(a, started.socket, "export", sandbox_id, "--bundle", str(roots / "x.bundle"))
    assert (refused.returncode, refused.stderr) == (
        2,
        f"sandboxer: export: {roots / 'x.bundle'}: cannot be created (Permission denied)\n",
    )
    assert list(roots.iterdir()) == []

    other = _cli_as(a, started.socket, "create", "--profile", broker.profile).stdout.strip()
    broker.created.append(other)
    nothing = _cli_as(a, started.socket, "export", other, "--bundle", str(home / "none.bundle"))
    assert (nothing.returncode, nothing.stderr) == (
        2,
        f"sandboxer: export: sandbox {other} has no commits since main\n",
    )
    assert not (home / "none.bundle").exists()
    empty_dir = _cli_as(a, started.socket, "export", other, "--patch", str(home / "none"))
    assert empty_dir.returncode == 2
    assert not (home / "none").exists()


def test_cp_reads_and_writes_local_files_as_the_caller(
    granted: tuple[SandboxBroker, pwd.struct_passwd, Service, Path],
) -> None:
    """`cp` runs in the caller's own process: what it copies in is read, and what it copies out
    written, with the caller's rights; a root-only file stays unread."""
    broker, a, started, home = granted
    sandbox_id = _cli_as(a, started.socket, "create", "--profile", broker.profile).stdout.strip()
    broker.created.append(sandbox_id)
    mine = _owned_by(a, home / "notes.txt", b"notes\n")
    assert _cli_as(a, started.socket, "cp", str(mine), f"{sandbox_id}:/workspace/notes.txt").returncode == 0
    out = home / "out.txt"
    copied = _cli_as(a, started.socket, "cp", f"{sandbox_id}:/workspace/notes.txt", str(out))
    assert copied.returncode == 0, copied.stderr
    assert (out.read_bytes(), out.stat().st_uid) == (b"notes\n", a.pw_uid)
    secret = broker.root / "root-only.txt"
    secret.write_bytes(b"root's\n")
    secret.chmod(0o600)
    refused = _cli_as(a, started.socket, "cp", str(secret), f"{sandbox_id}:/workspace/secret.txt")
    assert refused.returncode != 0
    assert "Permission denied" in refused.stderr
    assert _cli_as(a, started.socket, "exec", sandbox_id, "--", "test", "-e", "/workspace/secret.txt").returncode == 1
