"""`sandboxer doctor` reports the broker as well as the host: the service (answering, where), the
owner's approvals and grants (a grant naming a profile that is not approved is a warning), and,
run by a granted caller, what that caller may do — an account no grant names is told to ask the
owner. Real accounts, a real service."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import REPO, SandboxBroker
from tests.integration.services import Service
from tests.integration.test_service import _socket_dir

_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
GRANTED, UNGRANTED = f"sbxdocg{_WORKER}", f"sbxdocu{_WORKER}"


@pytest.fixture(scope="module")
def accounts() -> Iterator[tuple[pwd.struct_passwd, pwd.struct_passwd]]:
    if os.geteuid() != 0:
        pytest.skip("creating test accounts needs root (CI runs as root)")
    for name in (GRANTED, UNGRANTED):
        subprocess.run(["userdel", name], capture_output=True, check=False)
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
    try:
        yield pwd.getpwnam(GRANTED), pwd.getpwnam(UNGRANTED)
    finally:
        for name in (GRANTED, UNGRANTED):
            subprocess.run(["userdel", name], check=False)


def _doctor(
    socket: Path, *, account: pwd.struct_passwd | None = None, broker: SandboxBroker | None = None
) -> dict[str, Any]:
    """doctor --json, by `account` (a caller: its own default dirs) or by root for `broker`'s dirs."""
    argv = [sys.executable, "-m", "sandboxer"]
    if broker is not None:
        argv += ["--config-dir", str(broker.config), "--state-dir", str(broker.state)]
    argv += ["doctor", "--json"]
    if account is not None:
        ids = [str(account.pw_uid), str(account.pw_gid)]
        argv = ["setpriv", "--reuid", ids[0], "--regid", ids[1], "--clear-groups", "--", *argv]
    env = {"PATH": "/usr/bin:/bin", "HOME": "/", "LANG": "C.UTF-8", "PYTHONPATH": str(REPO)}
    env["SANDBOXER_SOCKET"] = str(socket)
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode in (0, 5), done.stderr
    document: dict[str, Any] = json.loads(done.stdout)
    return {check["name"]: check for check in document["checks"]} | {"ok": document["ok"]}


def test_doctor_reports_the_service_approvals_grants_and_a_callers_rights(
    sb_root: SandboxBroker, accounts: tuple[pwd.struct_passwd, pwd.struct_passwd]
) -> None:
    granted, ungranted = accounts
    (sb_root.config / "grants.yaml").write_text(
        f"grants:\n  - users: [{granted.pw_name}]\n    profiles: [{sb_root.profile}, not-yet]\n"
        "    max_sandboxes: 2\n    max_ttl_seconds: 3600\n"
        f"  - users: [sbxnoaccount]\n    groups: [sbxnogroup]\n    profiles: [{sb_root.profile}]\n"
        "    max_sandboxes: 1\n    max_ttl_seconds: 3600\n"
    )
    socket = _socket_dir(sb_root) / "broker.sock"
    assert not socket.exists()
    owner = _doctor(socket, broker=sb_root)
    assert owner["service"]["detail"] == f"none answers on {socket} yet: the first command starts one on demand"
    assert owner["grants"]["status"] == "warn"
    assert owner["grants"]["detail"] == "grants.yaml is unapproved: it admits nobody"
    assert sb_root.run("ext", "approve", "grants").status == 0

    started = Service(sb_root, socket).start()
    try:
        owner = _doctor(socket, broker=sb_root)
        assert (owner["service"]["status"], owner["service"]["detail"]) == ("ok", f"answers on {socket} (as an owner)")
        assert owner["approvals"]["status"] == "ok", owner["approvals"]
        assert sb_root.profile in owner["approvals"]["detail"]
        assert (owner["grants"]["status"], owner["grants"]["detail"]) == (
            "warn",
            f"grant 1 ({granted.pw_name}): profile not-yet is missing; "
            "grant 2: no account named sbxnoaccount on this host; grant 2: no group named sbxnogroup on this host",
        )
        assert "create the account or group" in owner["grants"]["fix"]
        with (sb_root.config / "profiles" / f"{sb_root.profile}.yaml").open("a") as profile:
            profile.write("# changed\n")
        owner = _doctor(socket, broker=sb_root)
        assert owner["approvals"]["status"] == "warn"
        assert f"changed-since-approval {sb_root.profile}" in owner["approvals"]["detail"]
        assert sb_root.run("ext", "approve", sb_root.profile).status == 0

        caller = _doctor(socket, account=granted)
        assert (caller["service"]["status"], caller["service"]["detail"]) == ("ok", f"answers on {socket}")
        assert "approvals" not in caller  # the owner's files are the owner's
        assert "grants" not in caller
        assert caller["access"] == {
            "name": "access",
            "status": "warn",
            "detail": (
                f"uid {granted.pw_uid} has 0 live sandbox(es); may create {sb_root.profile} (up to 2 live, "
                "lifetime up to 3600 s); granted but not usable now: not-yet (missing)"
            ),
            "fix": "ask the broker's owner to approve them",
        }

        stranger = _doctor(socket, account=ungranted)
        assert stranger["ok"] is False
        assert stranger["access"] == {
            "name": "access",
            "status": "fail",
            "detail": f"uid {ungranted.pw_uid} is not granted this broker",
            "fix": "ask the broker's owner to grant this account profiles in grants.yaml",
        }
    finally:
        started.stop()
