"""The owner verbs and `dispatch-tool` through `sandboxer serve` and `sandboxer.Client`.

A real service as root, real accounts: an owner gets what the embedded `Broker.owner` gives; a
granted caller is refused every owner verb, and sees the owner's sandbox as an unknown id.
"""

from __future__ import annotations

import json
import pwd
from pathlib import Path

import pytest

from sandboxer import Broker, Client
from sandboxer.errors import NotFoundError, NotPendingError, UsageError
from tests.integration import test_service
from tests.integration.conftest import Endpoints, SandboxBroker, log_lines
from tests.integration.services import Service
from tests.integration.test_dispatch_tool import LEASE, envelope, setup, spool
from tests.integration.test_service import _as_account, _socket_dir

callers = test_service.callers  # the fixture making accounts A and B
UNKNOWN_ID = "0123456789abcdef01234567"

CALLS = """
import json
from sandboxer import Client
from sandboxer.errors import SandboxerError
client = Client(SOCKET)
seen = []
for call in CALLS:
    try:
        eval(call)
        seen.append("allowed")
    except SandboxerError as exc:
        seen.append([type(exc).__name__, exc.status, exc.message])
print(json.dumps(seen))
"""


def _as_caller(account: pwd.struct_passwd, service: Service, *calls: str) -> list[object]:
    """Each call (an expression over `client`, a Client of `service`) as the account: "allowed" or
    its error as [class, status, message]."""
    code = CALLS.replace("SOCKET", repr(str(service.socket))).replace("CALLS", repr(list(calls)))
    done = _as_account(account, code)
    assert done.returncode == 0, done.stderr
    results: list[object] = json.loads(done.stdout)
    return results


def _grant(broker: SandboxBroker, account: pwd.struct_passwd) -> None:
    """Account A may create the broker's profile (an approved grants.yaml)."""
    entry = f"  - users: [{account.pw_name}]\n    profiles: [{broker.profile}]\n"
    (broker.config / "grants.yaml").write_text("grants:\n" + entry + "    max_sandboxes: 1\n    max_ttl_seconds: 600\n")
    assert broker.run("ext", "approve", "grants").status == 0


def test_the_owner_verbs_through_the_client_answer_as_the_embedded_broker(sb_root: SandboxBroker) -> None:
    started = Service(sb_root, _socket_dir(sb_root) / "broker.sock").start()
    try:
        owner = Client(str(started.socket)).owner
        embedded = Broker(config_dir=str(sb_root.config), state_dir=str(sb_root.state)).owner
        assert owner.list() == embedded.list()
        assert {entry.name: entry.status for entry in owner.list()}[sb_root.profile] == "approved"

        revoked = owner.revoke(sb_root.profile)
        assert revoked.revoked is True
        assert owner.list() == embedded.list()
        assert {entry.name: entry.status for entry in embedded.list()}[sb_root.profile] == "unapproved"
        assert owner.revoke(sb_root.profile) == embedded.revoke(sb_root.profile)  # nothing left to revoke
        approved = owner.approve(sb_root.profile)
        assert approved.status == "approved"
        assert embedded.approve(sb_root.profile) == approved
        assert owner.list() == embedded.list()

        assert owner.runtime_digest(str(sb_root.runtime), full=True) == embedded.runtime_digest(
            str(sb_root.runtime), full=True
        )
        assert owner.runtime_digest(str(sb_root.runtime)).sha256 == embedded.runtime_digest(str(sb_root.runtime)).sha256
        profile_file = str(sb_root.config / "profiles" / f"{sb_root.profile}.yaml")
        assert owner.check(profile_file) == embedded.check(profile_file)
        assert owner.check(profile_file).valid is True
    finally:
        started.stop()
    verbs = [json.loads(line)["verb"] for line in (sb_root.state / "audit.log").read_text().splitlines()]
    assert {"ext-list", "ext-revoke", "ext-approve", "runtime-digest"} <= set(verbs)


def test_bad_owner_and_dispatch_bodies_get_status_2_and_change_nothing(sb_root: SandboxBroker) -> None:
    started = Service(sb_root, _socket_dir(sb_root) / "broker.sock").start()
    try:
        client = Client(str(started.socket))
        before = client.owner.list()
        runtime = str(sb_root.runtime)
        for path, body, message in (
            ("/v1/owner/revoke", {"name": sb_root.profile, "force": True}, "force: unknown field"),
            ("/v1/owner/revoke", {"name": [sb_root.profile]}, "name: must be a string"),
            ("/v1/owner/revoke", {}, "name: required"),
            ("/v1/owner/approve", {"name": 7}, "name: must be a string"),
            ("/v1/runtime/digest", {"path": runtime, "full": "yes"}, "full: must be true or false"),
            ("/v1/runtime/digest", {"path": "relative/runtime"}, "path: must be an absolute path"),
            ("/v1/runtime/digest", {"path": runtime, "cache": False}, "cache: unknown field"),
            (f"/v1/sandboxes/{UNKNOWN_ID}/dispatch", {"lease": LEASE, "request_id": 1}, "request_id: must be"),
            (
                f"/v1/sandboxes/{UNKNOWN_ID}/dispatch",
                {"lease": LEASE, "request_id": "r", "wait_seconds": "5"},
                "wait_seconds: must be a whole number",
            ),
        ):
            with pytest.raises(UsageError) as refused:
                client.service.request("POST", path, body)
            assert refused.value.status == 2
            assert refused.value.message.startswith(message), (path, body, refused.value.message)
        assert client.owner.list() == before  # the profile is still approved
    finally:
        started.stop()


def test_a_granted_caller_is_refused_every_owner_verb(
    sb_root: SandboxBroker, callers: tuple[pwd.struct_passwd, pwd.struct_passwd]
) -> None:
    a, _ = callers
    _grant(sb_root, a)
    started = Service(sb_root, _socket_dir(sb_root) / "broker.sock").start()
    try:
        before = Client(str(started.socket)).owner.list()
        seen = _as_caller(
            a,
            started,
            "client.owner.list()",
            f"client.owner.approve({sb_root.profile!r})",
            f"client.owner.revoke({sb_root.profile!r})",
            "client.owner.revoke('grants')",
            f"client.owner.runtime_digest({str(sb_root.runtime)!r})",
            "client.list()",
        )
        assert seen == [
            ["PolicyError", 3, "ext list is for the broker's owners"],
            ["PolicyError", 3, "ext approve is for the broker's owners"],
            ["PolicyError", 3, "ext revoke is for the broker's owners"],
            ["PolicyError", 3, "ext revoke is for the broker's owners"],
            ["PolicyError", 3, "runtime digest is for the broker's owners"],
            "allowed",  # A is admitted: only the owner verbs are refused
        ]
        assert Client(str(started.socket)).owner.list() == before
    finally:
        started.stop()


def test_dispatch_tool_through_the_client_for_its_owner_only(
    sb_root: SandboxBroker,
    base: Path,
    endpoints: Endpoints,
    callers: tuple[pwd.struct_passwd, pwd.struct_passwd],
) -> None:
    a, _ = callers
    _grant(sb_root, a)
    _, sandbox_id = setup(sb_root, base, endpoints)
    started = Service(sb_root, _socket_dir(sb_root) / "broker.sock").start()
    try:
        sandbox = Client(str(started.socket)).sandbox(sandbox_id)
        with pytest.raises(NotPendingError) as not_yet:
            sandbox.dispatch_tool(LEASE, "via-api", 0)
        assert not_yet.value.status == 75

        spool(sb_root, sandbox_id, "via-api", envelope("via-api"))
        dispatched = sandbox.dispatch_tool(LEASE, "via-api", 5)
        assert (dispatched.sandbox, dispatched.request_id, dispatched.cached) == (sandbox_id, "via-api", False)
        assert dispatched.response.endswith("/responses/via-api.json")
        assert len(log_lines(endpoints.log)) == 1
        embedded = Broker(config_dir=str(sb_root.config), state_dir=str(sb_root.state)).sandbox(sandbox_id)
        again = embedded.dispatch_tool(LEASE, "via-api")
        assert (again.cached, again.fingerprint) == (True, dispatched.fingerprint)

        # The owner's sandbox answers A exactly as an id nobody has.
        call = f"client.sandbox(ID).dispatch_tool({LEASE!r}, 'via-api', 0)"
        theirs, unknown = _as_caller(
            a, started, call.replace("ID", repr(sandbox_id)), call.replace("ID", repr(UNKNOWN_ID))
        )
        assert theirs == ["NotFoundError", 4, f"no such sandbox: {sandbox_id}"]
        assert unknown == ["NotFoundError", 4, f"no such sandbox: {UNKNOWN_ID}"]
        with pytest.raises(NotFoundError):
            Client(str(started.socket)).sandbox(UNKNOWN_ID).dispatch_tool(LEASE, "via-api", 0)
        assert len(log_lines(endpoints.log)) == 1
    finally:
        started.stop()
