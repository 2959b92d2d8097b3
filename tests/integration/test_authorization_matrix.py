"""Every verb, through every front end, for every kind of caller: authorization is decided once, in the core
(sandboxer.api.caller.Authority, reached through sandboxer.api.broker.Broker), so every front end answers
every kind of caller alike.

Kinds of caller: the owner (root), a granted caller on its own sandbox (A), a granted caller on
A's sandbox (B: another's sandbox answers as an unknown id), and an account no grant names (C:
refused before anything, 3). Front ends: the HTTP client (`sandboxer.Client`, run as the account),
the CLI client (`sandboxer ...` as the account, through the same service) and the embedded core
(`Broker.serving` with the caller the service would bind; an ungranted account never reaches the
core — admission refuses it — so that column is the service's only).

Real accounts (useradd), a real root service, real bwrap sandboxes.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sandboxer.api.broker import Broker
from sandboxer.api.caller import Caller
from sandboxer.clients.service import Client
from sandboxer.commands.services import Services
from sandboxer.dirs import Dirs
from sandboxer.errors import ExecError, SandboxerError
from sandboxer.grants import rights_of
from tests.integration.conftest import SandboxBroker
from tests.integration.services import Service

_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
NAMES = {kind: f"sbxmx{kind}{_WORKER}"[:32] for kind in ("a", "b", "c")}
UNKNOWN_EXPORT = "0123456789abcdef01234567"

# The verbs in the order they run (teardown last: it ends the sandbox the others used). Each
# cell is the exit status the verb ends with: 0 done, 3 refused by policy, 4 an unknown id (a
# sandbox of another caller's answers so), 125 exec's "no such sandbox"; "allowed" is any status
# but 3 and 4, the same for the owner and the granted caller (a dispatch to a lease the sandbox
# does not have is the command's own refusal).
ALLOWED = "allowed"
EXPECTED: dict[str, tuple[object, object, object, object]] = {
    #                 owner    granted  other  ungranted
    "list": (0, 0, 0, 3),
    "create": (0, 0, 0, 3),
    "inspect": (0, 0, 4, 3),
    "logs-network": (0, 0, 4, 3),
    "usage": (0, 0, 4, 3),
    "work": (0, 0, 4, 3),
    "extend": (0, 0, 4, 3),
    "exec": (0, 0, 125, 3),
    "export": (0, 0, 4, 3),
    "dispatch-tool": (ALLOWED, ALLOWED, 4, 3),
    "exports": (0, 0, 0, 3),
    "exports-rm": (4, 4, 4, 3),
    "gc": (0, 3, 3, 3),
    "warm": (0, 3, 3, 3),
    "ext-list": (0, 3, 3, 3),
    "ext-approve": (0, 3, 3, 3),
    "ext-revoke": (0, 3, 3, 3),
    "runtime-digest": (0, 3, 3, 3),
    "teardown": (0, 0, 4, 3),
}
KINDS = ("owner", "granted", "other", "ungranted")
# Verbs a front end does not have (the HTTP API has no warm: it is the owner's CLI command).
MISSING = {"http": {"warm"}}


@pytest.fixture(scope="module")
def accounts() -> Iterator[dict[str, pwd.struct_passwd]]:
    if os.geteuid() != 0:
        pytest.skip("creating test accounts needs root (CI runs as root)")
    for name in NAMES.values():
        subprocess.run(["userdel", name], capture_output=True, check=False)
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
    try:
        yield {kind: pwd.getpwnam(name) for kind, name in NAMES.items()}
    finally:
        for name in NAMES.values():
            subprocess.run(["userdel", name], check=False)


@pytest.fixture
def served(sb_root: SandboxBroker, accounts: dict[str, pwd.struct_passwd]) -> Iterator[Service]:
    """A root service whose grants name A and B (not C) for the test profile."""
    users = f"[{accounts['a'].pw_name}, {accounts['b'].pw_name}]"
    (sb_root.config / "grants.yaml").write_text(
        f"grants:\n  - users: {users}\n    profiles: [{sb_root.profile}]\n    max_sandboxes: 4\n"
        "    max_ttl_seconds: 3600\n"
    )
    assert sb_root.run("ext", "approve", "grants").status == 0
    directory = sb_root.root / "svc"
    directory.mkdir(exist_ok=True)
    directory.chmod(0o755)
    for path in (sb_root.root, sb_root.root / "scratch"):
        path.mkdir(exist_ok=True)
        path.chmod(0o755)
    (sb_root.root / "scratch").chmod(0o1777)  # where each account's exports are written
    service = Service(sb_root, directory / "broker.sock").start()
    try:
        yield service
    finally:
        owner = Client(str(service.socket))
        for info in owner.list():
            with contextlib.suppress(SandboxerError):
                owner.sandbox(info.id).teardown(discard=True)
        service.stop()


HTTP_DRIVER = """
import json, sys
from sandboxer import Client
from sandboxer.errors import SandboxerError
socket, sandbox, profile, scratch, runtime, ops = sys.argv[1:7]
client = Client(socket)
def run(op):
    if op == "list": return client.list()
    if op == "create": return client.create(profile)
    if op == "inspect": return client.sandbox(sandbox).inspect()
    if op == "logs-network": return client.sandbox(sandbox).network_log()
    if op == "usage": return client.sandbox(sandbox).usage()
    if op == "work": return client.sandbox(sandbox).work_state()
    if op == "extend": return client.sandbox(sandbox).extend(600)
    if op == "exec": return client.sandbox(sandbox).exec(["true"]).status
    if op == "export":
        return client.sandbox(sandbox).export("tar", f"{scratch}/http-{client.whoami().uid}.tar")
    if op == "dispatch-tool": return client.sandbox(sandbox).dispatch_tool("no-such-lease", "r1")
    if op == "exports": return client.exports()
    if op == "exports-rm": return client.remove_export("0123456789abcdef01234567")
    if op == "gc": return client.gc()
    if op == "ext-list": return client.owner.list()
    if op == "ext-approve": return client.owner.approve(profile)
    if op == "ext-revoke": return client.owner.revoke("never-approved")
    if op == "runtime-digest": return client.owner.runtime_digest(runtime)
    if op == "teardown": return client.sandbox(sandbox).teardown(discard=True)
    raise AssertionError(op)
statuses = {}
for op in json.loads(ops):
    try:
        result = run(op)
        statuses[op] = result if isinstance(result, int) else 0
    except SandboxerError as exc:
        statuses[op] = exc.status
print(json.dumps(statuses))
"""


def _as(account: pwd.struct_passwd | None, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`argv` run by `account` (None: root, this process's own account)."""
    if account is not None:
        ids = [str(account.pw_uid), str(account.pw_gid)]
        argv = ["setpriv", "--reuid", ids[0], "--regid", ids[1], "--clear-groups", "--", *argv]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, check=False, cwd="/")


def _env(service: Service) -> dict[str, str]:
    repo = str(Path(__file__).parents[2])
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": "/",
        "LANG": "C.UTF-8",
        "PYTHONPATH": repo,
        "SANDBOXER_SOCKET": str(service.socket),
    }


def _http(account: pwd.struct_passwd | None, service: Service, sandbox: str, ops: list[str]) -> dict[str, object]:
    broker = service.broker
    argv = [sys.executable, "-c", HTTP_DRIVER, str(service.socket), sandbox, broker.profile]
    argv += [str(broker.root / "scratch"), str(broker.runtime), json.dumps(ops)]
    done = _as(account, argv, _env(service))
    assert done.returncode == 0, done.stderr
    statuses: dict[str, object] = json.loads(done.stdout)
    return statuses


def _cli(account: pwd.struct_passwd | None, service: Service, sandbox: str, ops: list[str]) -> dict[str, object]:
    broker = service.broker
    scratch = broker.root / "scratch"
    name = "root" if account is None else account.pw_name
    commands = {
        "list": ["list"],
        "create": ["create", "--profile", broker.profile],
        "inspect": ["inspect", sandbox],
        "logs-network": ["logs", sandbox, "--network"],
        "usage": ["usage", sandbox],
        "work": ["work", sandbox],
        "extend": ["extend", sandbox, "600"],
        "exec": ["exec", sandbox, "--", "true"],
        "export": ["export", sandbox, "--tar", str(scratch / f"cli-{name}.tar")],
        "dispatch-tool": [
            "dispatch-tool",
            sandbox,
            "--lease",
            "no-such-lease",
            "--request-id",
            "r1",
            "--wait-seconds",
            "0",
        ],
        "exports": ["exports"],
        "exports-rm": ["exports", "rm", UNKNOWN_EXPORT],
        "gc": ["gc"],
        "warm": ["warm", broker.profile],
        "ext-list": ["ext", "list"],
        "ext-approve": ["ext", "approve", broker.profile],
        "ext-revoke": ["ext", "revoke", "never-approved"],
        "runtime-digest": ["runtime", "digest", str(broker.runtime)],
        "teardown": ["teardown", sandbox, "--discard"],
    }
    return {
        op: _as(account, [sys.executable, "-m", "sandboxer", *commands[op]], _env(service)).returncode for op in ops
    }


def _embedded(caller: Caller, service: Service, sandbox: str, ops: list[str]) -> dict[str, object]:
    broker_dirs = Dirs(config=str(service.broker.config), state=str(service.broker.state))
    broker = Broker.serving(broker_dirs, caller, Services.of())
    scratch = service.broker.root / "scratch"
    calls: dict[str, Callable[[], object]] = {
        "list": broker.list,
        "create": lambda: broker.create(service.broker.profile),
        "inspect": lambda: broker.sandbox(sandbox).inspect(),
        "logs-network": lambda: broker.sandbox(sandbox).network_log(),
        "usage": lambda: broker.sandbox(sandbox).usage(),
        "work": lambda: broker.sandbox(sandbox).work_state(),
        "extend": lambda: broker.sandbox(sandbox).extend(600),
        "exec": lambda: broker.sandbox(sandbox, unknown=ExecError("exec: no such sandbox")).exec(["true"]).status,
        "export": lambda: broker.sandbox(sandbox).export("tar", str(scratch / f"embedded-{caller.uid}.tar")),
        "dispatch-tool": lambda: broker.sandbox(sandbox).dispatch_tool("no-such-lease", "r1"),
        "exports": broker.exports,
        "exports-rm": lambda: broker.remove_export(UNKNOWN_EXPORT),
        "gc": broker.gc,
        "warm": lambda: broker.warm(service.broker.profile),
        "ext-list": broker.owner.listing,
        "ext-approve": lambda: broker.owner.approve(service.broker.profile),
        "ext-revoke": lambda: broker.owner.revoke("never-approved"),
        "runtime-digest": lambda: broker.owner.runtime_digest(str(service.broker.runtime)),
        "teardown": lambda: broker.sandbox(sandbox).teardown(discard=True),
    }
    statuses: dict[str, object] = {}
    for op in ops:
        try:
            result = calls[op]()
            statuses[op] = result if isinstance(result, int) else 0
        except SandboxerError as exc:
            statuses[op] = exc.status
    return statuses


def _expected(kind: str, statuses: dict[str, object]) -> dict[str, object]:
    """The expected cell of each verb for `kind`; an "allowed" cell is what the caller got when
    that is neither a refusal (3) nor an unknown id (4)."""
    column = KINDS.index(kind)
    expected: dict[str, object] = {}
    for op, status in statuses.items():
        cell = EXPECTED[op][column]
        expected[op] = status if cell == ALLOWED and status not in (3, 4) else cell
    return expected


@pytest.mark.parametrize("front", ["http", "cli", "embedded"])
def test_every_verb_answers_every_kind_of_caller_alike_through_every_front_end(
    served: Service, accounts: dict[str, pwd.struct_passwd], front: str
) -> None:
    broker = served.broker
    owner = Client(str(served.socket))
    a_sandbox = _http_create(accounts["a"], served)
    owners_sandbox = owner.create(broker.profile, ttl=900).id  # (extend needs a lifetime with an end)
    ops = [op for op in EXPECTED if op not in MISSING.get(front, set())]
    dirs = Dirs(config=str(broker.config), state=str(broker.state))

    def caller_of(kind: str) -> Caller:
        if kind == "owner":
            return Caller.this_process()
        account = accounts["a" if kind == "granted" else "b"]
        rights = rights_of(account.pw_uid, {account.pw_gid}, dirs)
        assert rights is not None, "the grants name A and B"
        return Caller(uid=account.pw_uid, gid=account.pw_gid, rights=rights)

    seen: dict[str, dict[str, object]] = {}
    # The refused kinds first: their teardown must leave A's sandbox for the granted caller's.
    for kind in ("other", "ungranted", "granted", "owner"):
        if front == "embedded" and kind == "ungranted":
            continue  # admission refuses it before the core (the service's columns test it)
        target = owners_sandbox if kind == "owner" else a_sandbox
        account = {"owner": None, "granted": accounts["a"], "other": accounts["b"], "ungranted": accounts["c"]}[kind]
        if front == "http":
            seen[kind] = _http(account, served, target, ops)
        elif front == "cli":
            seen[kind] = _cli(account, served, target, ops)
        else:
            seen[kind] = _embedded(caller_of(kind), served, target, ops)
    assert {kind: statuses for kind, statuses in seen.items()} == {
        kind: _expected(kind, statuses) for kind, statuses in seen.items()
    }
    # An allowed dispatch is the command's own refusal, the same for the owner and the caller.
    assert seen["owner"]["dispatch-tool"] == seen["granted"]["dispatch-tool"]
    assert seen["owner"]["dispatch-tool"] not in (0, 3, 4)


def _http_create(account: pwd.struct_passwd, service: Service) -> str:
    code = (
        "import sys\nfrom sandboxer import Client\n"
        f"print(Client({str(service.socket)!r}).create({service.broker.profile!r}).id)\n"
    )
    done = _as(account, [sys.executable, "-c", code], _env(service))
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_granted_caller_lists_its_own_sandboxes_and_no_one_elses(
    served: Service, accounts: dict[str, pwd.struct_passwd]
) -> None:
    mine = _http_create(accounts["a"], served)
    theirs = _http_create(accounts["b"], served)
    dirs = Dirs(config=str(served.broker.config), state=str(served.broker.state))
    for kind, own, other in (("a", mine, theirs), ("b", theirs, mine)):
        account = accounts[kind]
        rights = rights_of(account.pw_uid, {account.pw_gid}, dirs)
        assert rights is not None
        listed = [
            info.id for info in Broker.serving(dirs, Caller(uid=account.pw_uid, rights=rights), Services.of()).list()
        ]
        assert own in listed
        assert other not in listed
        cli = _as(account, [sys.executable, "-m", "sandboxer", "list", "--json"], _env(served))
        assert cli.returncode == 0, cli.stderr
        ids = [entry["id"] for entry in json.loads(cli.stdout)["sandboxes"]]
        assert own in ids
        assert other not in ids
    owner_ids = [info.id for info in Client(str(served.socket)).list()]
    assert mine in owner_ids
    assert theirs in owner_ids
