"""One behavioural suite through every front end of the broker, on every backend.

The four front ends promise the same behaviour over one core: the CLI in-process
(SANDBOXER_NO_SERVICE=1), the CLI as a client of `sandboxer serve`, the HTTP client
`sandboxer.Client` and the embedded `sandboxer.Broker`. Each test runs once per front end and
backend (bwrap as root, Docker) against real sandboxes, and compares what the front end answers
with what the in-process CLI answers for the same case: the same exit statuses, the same output
bytes, the same one-line errors. Where the Python API raises instead of printing, the error is
compared as the (status, line) pair the CLI would print for it.
"""

from __future__ import annotations

import builtins
import contextlib
import datetime
import hashlib
import json
import os
import re
import signal
import stat
import subprocess
import tarfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import pytest

from sandboxer import Broker, Client
from sandboxer.api.sandbox import Sandbox
from sandboxer.clients.service import ClientSandbox
from sandboxer.errors import SandboxerError
from tests.integration.conftest import SandboxBroker, backend_profile_text
from tests.integration.services import Service

FRONTS = ["cli", "cli-service", "client", "embedded"]
UNKNOWN_ID = "0" * 24
ExecAnswer = tuple[int, bytes, bytes]


class Refused(Exception):
    """A verb the broker refused, as the CLI reports it: its exit status and its one line."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, message)
        self.status = status
        self.message = message

    @property
    def pair(self) -> tuple[int, str]:
        return self.status, self.message


class Front(Protocol):
    """What a test drives, whichever front end is behind it."""

    name: str
    # True when a broker failure of exec raises (the Python API), False when it is printed
    # on stderr with exit status 125 (the CLI).
    raises: bool

    def create(self, profile: str) -> str: ...

    def create_json(self, profile: str, *, ttl: float | None = None) -> dict[str, Any]: ...

    def exec(
        self,
        sandbox_id: str,
        argv: Sequence[str],
        stdin: bytes = b"",
        cwd: str | None = None,
        timeout: float | None = None,
    ) -> ExecAnswer: ...

    def inspect(self, sandbox_id: str) -> dict[str, Any]: ...

    def list(self) -> list[str]: ...

    def listing(self) -> builtins.list[dict[str, Any]]: ...

    def teardown(self, sandbox_id: str, *, discard: bool = False) -> builtins.list[str]: ...

    def export(self, sandbox_id: str, fmt: str, destination: str) -> dict[str, Any]: ...

    def put(self, sandbox_id: str, source: str, destination: str) -> None: ...

    def get(self, sandbox_id: str, source: str, destination: str) -> None: ...

    def gc(self) -> dict[str, Any]: ...

    def usage(self, sandbox_id: str) -> dict[str, Any]: ...

    def work(self, sandbox_id: str) -> dict[str, Any]: ...

    def extend(self, sandbox_id: str, seconds: int) -> dict[str, Any]: ...


class Cli:
    """`python -m sandboxer …` as a real process: in-process, or as a client of the service."""

    raises = False

    def __init__(self, broker: SandboxBroker, *, through_service: bool) -> None:
        self.broker = broker
        self.through_service = through_service
        self.name = "cli-service" if through_service else "cli"

    def run(self, *args: str, stdin: bytes = b"", timeout: float = 120) -> subprocess.CompletedProcess[bytes]:
        env = {k: v for k, v in self.broker.env().items() if k != "SANDBOXER_NO_SERVICE"}
        if not self.through_service:
            env["SANDBOXER_NO_SERVICE"] = "1"
        return subprocess.run(
            self.broker.argv(*args), input=stdin, capture_output=True, env=env, check=False, timeout=timeout
        )

    def checked(self, *args: str) -> bytes:
        """stdout of a verb that is not exec; a failure raises Refused with the stderr line."""
        done = self.run(*args)
        if done.returncode != 0:
            raise Refused(done.returncode, _one_line(done.stderr))
        return done.stdout

    def create(self, profile: str) -> str:
        return self.checked("create", "--profile", profile).decode().strip()

    def create_json(self, profile: str, *, ttl: float | None = None) -> dict[str, Any]:
        options = [] if ttl is None else [f"--ttl={ttl!r}"]  # with `=`: a negative value is no option
        document: dict[str, Any] = json.loads(self.checked("create", "--profile", profile, *options, "--json"))
        return document

    def exec(
        self,
        sandbox_id: str,
        argv: Sequence[str],
        stdin: bytes = b"",
        cwd: str | None = None,
        timeout: float | None = None,
    ) -> ExecAnswer:
        options: list[str] = []
        if cwd is not None:
            options += ["--cwd", cwd]
        if timeout is not None:
            options += ["--timeout", repr(float(timeout))]
        done = self.run("exec", sandbox_id, *options, "--", *argv, stdin=stdin)
        return done.returncode, done.stdout, done.stderr

    def inspect(self, sandbox_id: str) -> dict[str, Any]:
        document: dict[str, Any] = json.loads(self.checked("inspect", sandbox_id, "--json"))
        return document

    def list(self) -> list[str]:
        return [entry["id"] for entry in self.listing()]

    def listing(self) -> builtins.list[dict[str, Any]]:
        entries: list[dict[str, Any]] = json.loads(self.checked("list", "--json"))["sandboxes"]
        return entries

    def teardown(self, sandbox_id: str, *, discard: bool = False) -> builtins.list[str]:
        options = ["--discard"] if discard else []
        return list(json.loads(self.checked("teardown", sandbox_id, *options, "--json"))["residue"])

    def export(self, sandbox_id: str, fmt: str, destination: str) -> dict[str, Any]:
        document: dict[str, Any] = json.loads(self.checked("export", sandbox_id, f"--{fmt}", destination, "--json"))
        return document

    def put(self, sandbox_id: str, source: str, destination: str) -> None:
        self.checked("cp", source, f"{sandbox_id}:{destination}")

    def get(self, sandbox_id: str, source: str, destination: str) -> None:
        self.checked("cp", f"{sandbox_id}:{source}", destination)

    def gc(self) -> dict[str, Any]:
        document: dict[str, Any] = json.loads(self.checked("gc", "--json"))
        return document

    def usage(self, sandbox_id: str) -> dict[str, Any]:
        document: dict[str, Any] = json.loads(self.checked("usage", sandbox_id, "--json"))
        return document

    def work(self, sandbox_id: str) -> dict[str, Any]:
        document: dict[str, Any] = json.loads(self.checked("work", sandbox_id, "--json"))
        return document

    def extend(self, sandbox_id: str, seconds: int) -> dict[str, Any]:
        document: dict[str, Any] = json.loads(self.checked("extend", sandbox_id, str(seconds), "--json"))
        return document


class Api:
    """The Python API: the HTTP client of the service, or the embedded broker. A sandbox is the
    handle create returned; an id it never created is looked up as a program would."""

    raises = True

    def __init__(self, name: str, api: Broker | Client) -> None:
        self.name = name
        self.api = api
        self.handles: dict[str, Sandbox | ClientSandbox] = {}
        self.torn: set[str] = set()

    def sandbox(self, sandbox_id: str) -> Sandbox | ClientSandbox:
        with refused():
            return self.handles.get(sandbox_id) or self.api.sandbox(sandbox_id)

    def create(self, profile: str) -> str:
        return str(self.create_json(profile)["id"])

    def create_json(self, profile: str, *, ttl: float | None = None) -> dict[str, Any]:
        with refused():
            sandbox = self.api.create(profile, ttl=ttl)
        self.handles[sandbox.id] = sandbox
        assert sandbox.created is not None
        document: dict[str, Any] = sandbox.created.to_json()
        return document

    def exec(
        self,
        sandbox_id: str,
        argv: Sequence[str],
        stdin: bytes = b"",
        cwd: str | None = None,
        timeout: float | None = None,
    ) -> ExecAnswer:
        with refused():
            result = self.sandbox(sandbox_id).exec(argv, stdin=stdin, cwd=cwd, timeout=timeout)
        return result.status, result.stdout, result.stderr

    def inspect(self, sandbox_id: str) -> dict[str, Any]:
        with refused():
            document: dict[str, Any] = self.sandbox(sandbox_id).inspect().to_json()
        return document

    def list(self) -> list[str]:
        return [entry["id"] for entry in self.listing()]

    def listing(self) -> builtins.list[dict[str, Any]]:
        with refused():
            return [info.to_json() for info in self.api.list()]

    def teardown(self, sandbox_id: str, *, discard: bool = False) -> builtins.list[str]:
        # A second teardown names the id afresh: the handle would give its receipt again (docs/api.md).
        with refused():
            sandbox = self.sandbox(sandbox_id) if sandbox_id not in self.torn else self.api.sandbox(sandbox_id)
            residue = list(sandbox.teardown(discard=discard).residue)
            self.torn.add(sandbox_id)
            return residue

    def export(self, sandbox_id: str, fmt: str, destination: str) -> dict[str, Any]:
        with refused():
            document: dict[str, Any] = self.sandbox(sandbox_id).export(fmt, destination).to_json()
        return document

    def put(self, sandbox_id: str, source: str, destination: str) -> None:
        with refused():
            self.sandbox(sandbox_id).put(source, destination)

    def get(self, sandbox_id: str, source: str, destination: str) -> None:
        with refused():
            self.sandbox(sandbox_id).get(source, destination)

    def gc(self) -> dict[str, Any]:
        with refused():
            document: dict[str, Any] = self.api.gc().to_json()
        return document

    def usage(self, sandbox_id: str) -> dict[str, Any]:
        with refused():
            document: dict[str, Any] = self.sandbox(sandbox_id).usage().to_json()
        return document

    def work(self, sandbox_id: str) -> dict[str, Any]:
        with refused():
            document: dict[str, Any] = self.sandbox(sandbox_id).work_state().to_json()
        return document

    def extend(self, sandbox_id: str, seconds: int) -> dict[str, Any]:
        with refused():
            document: dict[str, Any] = self.sandbox(sandbox_id).extend(seconds).to_json()
        return document


class refused:
    """A SandboxerError as Refused: the status and the line the CLI prints for it."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, _tb: object) -> None:
        if isinstance(error, SandboxerError):
            raise Refused(error.status, f"sandboxer: {error}") from error


def _one_line(stderr: bytes) -> str:
    text = stderr.decode()
    assert text.endswith("\n"), f"not one line on stderr: {text!r}"
    assert text.count("\n") == 1, f"not one line on stderr: {text!r}"
    return text.rstrip("\n")


class Case:
    """One test's broker and front end, and the in-process CLI of the same broker as reference."""

    def __init__(self, broker: SandboxBroker, front: Front, service: Service | None) -> None:
        self.broker = broker
        self.front = front
        self.service = service
        self.reference = Cli(broker, through_service=False)

    @property
    def backend(self) -> str:
        return self.broker.backend

    def normal(self, value: Any, *ids: str) -> Any:
        """`value` with what differs between brokers and sandboxes (ids, temporary paths) named."""
        if isinstance(value, bytes):
            return self.normal(value.decode(errors="surrogateescape"), *ids).encode(errors="surrogateescape")
        if isinstance(value, str):
            for sandbox_id in ids:
                value = value.replace(sandbox_id, "<id>")
            return value.replace(str(self.broker.root), "<root>")
        if isinstance(value, tuple | list):
            return type(value)(self.normal(item, *ids) for item in value)
        if isinstance(value, dict):
            return {key: self.normal(item, *ids) for key, item in value.items()}
        return value


# What the in-process CLI answered, per backend and case: computed once (on the broker of
# whichever test needs it first), normalized so that brokers and sandboxes compare.
_REFERENCE: dict[tuple[str, str], Any] = {}


def same_as_cli(case: Case, key: str, answer: Any, compute: Callable[[Cli], Any], *ids: str) -> None:
    """Assert that the front's normalized `answer` is the in-process CLI's for this case."""
    answer = case.normal(answer, *ids)
    if case.front.name == "cli":
        _REFERENCE.setdefault((case.backend, key), answer)
    if (case.backend, key) not in _REFERENCE:
        _REFERENCE[(case.backend, key)] = case.normal(compute(case.reference), *ids)
    assert answer == _REFERENCE[(case.backend, key)], f"{case.front.name} differs from the in-process CLI"


def failure(front: Front, call: Callable[[], ExecAnswer]) -> tuple[int, str]:
    """An exec the broker cannot run: the (status, line) the front reports. The CLI prints it
    (status 125, nothing on stdout); the Python API raises it."""
    outcome: ExecAnswer | Refused
    try:
        outcome = call()
    except Refused as refused_:
        outcome = refused_
    if isinstance(outcome, Refused):
        assert front.raises, f"{front.name} raised instead of printing: {outcome.pair}"
        return outcome.pair
    status, stdout, stderr = outcome
    assert not front.raises, f"{front.name} printed instead of raising: {(status, stderr)!r}"
    assert stdout == b""
    return status, _one_line(stderr)


def refusal(call: Callable[[], object]) -> tuple[int, str]:
    """The (status, line) of a verb the broker refuses on every front."""
    with pytest.raises(Refused) as refused_:
        call()
    return refused_.value.pair


def audited_verbs(broker: SandboxBroker) -> list[str]:
    log = broker.state / "audit.log"
    return [json.loads(line)["verb"] for line in log.read_text().splitlines()] if log.exists() else []


@pytest.fixture(params=FRONTS)
def case(request: pytest.FixtureRequest, sbx_root: SandboxBroker) -> Iterator[Case]:
    """Every front end on every backend; fronts 2 and 3 with a service of their own."""
    kind: str = request.param
    service = None
    if kind in ("cli-service", "client"):
        service = Service(sbx_root, sbx_root.state / "broker.sock").start()
    front: Front
    if kind in ("cli", "cli-service"):
        front = Cli(sbx_root, through_service=kind == "cli-service")
    elif kind == "client":
        assert service is not None
        front = Api(kind, Client(str(service.socket)))
    else:
        front = Api(kind, Broker(config_dir=str(sbx_root.config), state_dir=str(sbx_root.state)))
    # The broker's own CLI (the fixtures' helpers) goes the way this front goes.
    sbx_root.through_service = kind == "cli-service"
    try:
        yield Case(sbx_root, front, service)
    finally:
        sbx_root.through_service = False
        if service is not None:
            service.stop()


@pytest.fixture
def sandbox(case: Case) -> str:
    """A sandbox created through the front (torn down with its broker at the end)."""
    sandbox_id = case.front.create(case.broker.profile)
    case.broker.created.append(sandbox_id)
    return sandbox_id


def test_the_front_reaches_the_broker_its_own_way(case: Case, sandbox: str) -> None:
    """The CLI client and the HTTP client are answered by the service (its audit log shows the
    requests); the in-process CLI and the embedded broker never go through one."""
    assert case.front.exec(sandbox, ["true"]) == (0, b"", b"")
    expected = {
        "cli": [],
        "embedded": [],
        "cli-service": ["cli create", "cli exec"],
        "client": ["create", "exec"],
    }[case.front.name]
    deadline = time.monotonic() + 10  # the service writes an exec's line once its stream has ended
    while len(audited_verbs(case.broker)) < len(expected) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert audited_verbs(case.broker) == expected


def test_exec_gives_its_status_and_exact_streams(case: Case, sandbox: str) -> None:
    """Status and both streams apart; NUL bytes, invalid UTF-8, no final newline and a large
    stderr come out as written; a signal gives 128 + its number."""
    calls: list[tuple[list[str], bytes]] = [
        (["sh", "-c", "cat; echo out; echo err >&2; exit 7"], b"in\n"),
        (["sh", "-c", "printf 'a\\000b\\377'; head -c 300000 /dev/zero | tr '\\0' e >&2"], b""),
        (["sh", "-c", "echo before; kill -TERM $$; echo after"], b""),
    ]
    answers = [case.front.exec(sandbox, argv, stdin=stdin) for argv, stdin in calls]
    assert answers == [
        (7, b"in\nout\n", b"err\n"),
        (0, b"a\x00b\xff", b"e" * 300_000),
        (143, b"before\n", b""),
    ]
    same_as_cli(
        case, "streams", answers, lambda cli: [cli.exec(sandbox, argv, stdin=stdin) for argv, stdin in calls], sandbox
    )


def test_cwd_is_honoured_and_a_bad_one_refused(case: Case, sandbox: str) -> None:
    assert case.front.exec(sandbox, ["pwd"], cwd="/workspace") == (0, b"/workspace\n", b"")
    assert case.front.exec(sandbox, ["pwd"], cwd="/") == (0, b"/\n", b"")
    # Every front answers a cwd missing inside the sandbox alike: status 125 and the CLI's line on
    # stderr, as the exec's result (the sandbox's entry step refuses it; docs/api.md, "exec").
    bad = case.front.exec(sandbox, ["pwd"], cwd="/no/such/dir")
    assert bad[:2] == (125, b"")
    assert bad[2].startswith(b"sandboxer: exec: --cwd /no/such/dir: not a directory inside the sandbox"), bad
    assert _one_line(bad[2])
    same_as_cli(case, "bad-cwd", bad, lambda cli: cli.exec(sandbox, ["pwd"], cwd="/no/such/dir"), sandbox)


def test_a_command_that_cannot_start(case: Case, sandbox: str) -> None:
    """127 for a missing program, 126 for a file that is not executable, with the CLI's line."""
    missing = case.front.exec(sandbox, ["no-such-program"])
    assert missing == (127, b"", b"sandboxer: exec: no-such-program: not found\n")
    plain = case.front.exec(sandbox, ["/workspace/README.md"])
    assert plain[:2] == (126, b"")
    assert plain[2].startswith(b"sandboxer: exec: /workspace/README.md: not executable"), plain
    same_as_cli(
        case,
        "cannot-start",
        [missing, plain],
        lambda cli: [cli.exec(sandbox, ["no-such-program"]), cli.exec(sandbox, ["/workspace/README.md"])],
        sandbox,
    )


def test_a_timeout_ends_the_exec_with_124(case: Case, sandbox: str) -> None:
    argv = ["sh", "-c", "echo started; exec sleep 60"]
    started = time.monotonic()
    answer = case.front.exec(sandbox, argv, timeout=1.0)
    assert time.monotonic() - started < 30
    assert answer == (124, b"started\n", b"sandboxer: exec: timed out after 1 s\n")
    same_as_cli(case, "timeout", answer, lambda cli: cli.exec(sandbox, argv, timeout=1.0), sandbox)


def test_the_environment_inside_is_the_plans(case: Case, sandbox: str) -> None:
    status, stdout, stderr = case.front.exec(sandbox, ["env", "-0"])
    assert (status, stderr) == (0, b"")
    names = sorted(item.split(b"=", 1)[0].decode() for item in stdout.split(b"\0") if item)
    assert names == sorted(case.front.inspect(sandbox)["env_names"])
    assert "PATH" in names
    assert "SANDBOXER_NO_SERVICE" not in names
    # The same names and values as the CLI's (in an order Docker does not keep from exec to exec).
    same_as_cli(
        case,
        "env",
        sorted(stdout.split(b"\0")),
        lambda cli: sorted(cli.exec(sandbox, ["env", "-0"])[1].split(b"\0")),
        sandbox,
    )


CONFINEMENT = """
import os, socket
def is_open(fd):
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True
inherited = [fd for fd in range(3, 1024) if is_open(fd)]  # before this script opens anything
with open("/proc/self/status") as stream:
    fields = dict(line.split(":", 1) for line in stream.read().splitlines())
keys = ("Seccomp", "NoNewPrivs", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")
print(os.getuid(), os.getgid(), inherited, os.getsid(0) == os.getpid())
print(" ".join(fields[key].strip() for key in keys))
print(sorted(name for _, name in socket.if_nameindex()))
"""


def test_the_command_is_confined_alike(case: Case, sandbox: str) -> None:
    """Whichever front starts it, the command is not root, holds no capability and no descriptor
    past 0-2, runs with no_new_privs under the syscall filter in a session of its own, and sees
    loopback only."""
    answer = case.front.exec(sandbox, ["python3", "-I", "-c", CONFINEMENT])
    assert answer[0::2] == (0, b""), answer
    ids, privileges, interfaces = answer[1].decode().splitlines()
    uid, gid, inherited = ids.split(" ", 2)
    assert "0" not in (uid, gid)
    assert inherited == "[] True"  # nothing inherited; the session's leader
    assert privileges == "2 1 " + " ".join(["0000000000000000"] * 5)
    assert interfaces == "['lo']"
    same_as_cli(case, "confined", answer, lambda cli: cli.exec(sandbox, ["python3", "-I", "-c", CONFINEMENT]), sandbox)


def test_inspect_says_the_sandbox_matches_its_plan(case: Case, sandbox: str) -> None:
    evidence = case.front.inspect(sandbox)
    assert (evidence["id"], evidence["backend"], evidence["status"]) == (sandbox, case.backend, "running")
    assert evidence["matches_plan"] is True, evidence["differences"]
    assert evidence["differences"] == []
    stable = ("profile", "backend", "status", "matches_plan", "env_names", "user", "limits")

    def observed(document: dict[str, Any]) -> list[Any]:
        mounts = sorted(json.dumps(mount, sort_keys=True) for mount in document["mounts"])
        return [*(document[key] for key in stable), mounts]

    same_as_cli(case, "inspect", observed(evidence), lambda cli: observed(cli.inspect(sandbox)), sandbox)


def test_a_large_stdin_round_trips_byte_exact(case: Case, sandbox: str) -> None:
    data = hashlib.shake_256(b"fronts").digest(8 * 1024 * 1024)
    answers: list[ExecAnswer | BaseException] = []

    def run() -> None:
        try:
            answers.append(case.front.exec(sandbox, ["cat"], stdin=data))
        except BaseException as exc:  # handed to the test's thread
            answers.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(20)  # the in-process CLI takes about a second
    if worker.is_alive() and case.service is not None and case.service.process is not None:
        case.service.process.kill()  # the service this test started: the only way to free the client
        worker.join(30)
    # `cat` writes while its input still comes: a front that sent all of stdin before reading
    # any output would wait on the command forever once the service's bounded output queue is full
    # (8 MiB is twice what it holds).
    assert not worker.is_alive(), f"{case.front.name}: the exec of an 8 MiB stdin never ended"
    assert answers[0] == (0, data, b"")
    status, digest, _ = case.front.exec(sandbox, ["sha256sum"], stdin=data)
    assert (status, digest) == (0, hashlib.sha256(data).hexdigest().encode() + b"  -\n")


def test_an_unknown_id_is_unknown_on_every_verb(case: Case) -> None:
    front = case.front
    answers = [
        failure(front, lambda: front.exec(UNKNOWN_ID, ["true"])),
        refusal(lambda: front.inspect(UNKNOWN_ID)),
        refusal(lambda: front.teardown(UNKNOWN_ID)),
        refusal(lambda: front.create("no-such-profile")),
    ]
    # A front difference the API documents: the embedded Broker looks an id up first
    # (Broker.sandbox raises NotFoundError, 4), where the CLI's exec and the Client's (whose
    # Client.sandbox checks nothing) answer the exec's 125 "exec: no such sandbox".
    unknown_exec = 4 if front.name == "embedded" else 125
    assert [status for status, _ in answers] == [unknown_exec, 4, 4, 2], answers
    assert all(UNKNOWN_ID in message for _, message in answers[:3]), answers
    assert "no-such-profile" in answers[3][1], answers
    same_as_cli(
        case,
        "unknown",
        answers[1:],
        lambda cli: [
            refusal(lambda: cli.inspect(UNKNOWN_ID)),
            refusal(lambda: cli.teardown(UNKNOWN_ID)),
            refusal(lambda: cli.create("no-such-profile")),
        ],
    )
    if front.name != "embedded":
        same_as_cli(case, "unknown-exec", answers[0], lambda cli: failure(cli, lambda: cli.exec(UNKNOWN_ID, ["true"])))
    assert case.reference.list() == []


def test_list_and_teardown_follow_the_sandboxs_life(case: Case) -> None:
    """list shows the sandbox, then not; teardown leaves no residue and no directory; the id is
    then unknown to exec, inspect, a second teardown and get (the Python API's handle of the
    sandbox too), with the same answers as the CLI's."""
    front = case.front
    assert front.list() == []
    sandbox_id = front.create(case.broker.profile)
    case.broker.created.append(sandbox_id)
    assert front.list() == [sandbox_id]
    assert case.broker.sandbox_dir(sandbox_id).is_dir()
    assert front.teardown(sandbox_id) == []
    assert not case.broker.sandbox_dir(sandbox_id).exists()
    assert front.list() == []
    copy = str(case.broker.root / "copy")
    after = [
        failure(front, lambda: front.exec(sandbox_id, ["true"])),
        refusal(lambda: front.inspect(sandbox_id)),
        refusal(lambda: front.get(sandbox_id, "/workspace/README.md", copy)),
        refusal(lambda: front.teardown(sandbox_id)),
    ]
    assert [status for status, _ in after] == [125, 4, 4, 4], after
    assert not os.path.lexists(copy)
    same_as_cli(
        case,
        "gone",
        after,
        lambda cli: [
            failure(cli, lambda: cli.exec(sandbox_id, ["true"])),
            refusal(lambda: cli.inspect(sandbox_id)),
            refusal(lambda: cli.get(sandbox_id, "/workspace/README.md", copy)),
            refusal(lambda: cli.teardown(sandbox_id)),
        ],
        sandbox_id,
    )
    assert case.reference.list() == []


def _commit_and_change(case: Case, sandbox: str) -> None:
    """An agent's work: one commit on the profile's branch, and a change not committed."""
    script = "echo new > new.txt && git add new.txt && git commit -qm 'Add new.txt' && echo more >> new.txt"
    assert case.front.exec(sandbox, ["sh", "-c", script])[0] == 0


def test_teardown_refuses_to_lose_work_until_it_is_exported(case: Case, sandbox: str, tmp_path: Path) -> None:
    """A commit and a change not committed: teardown says what would be lost (2, the same line
    on every front); a bundle takes out the commit (fetched into a fresh clone of the profile's
    repository), a tar the tree; then teardown removes the sandbox."""
    _commit_and_change(case, sandbox)
    lost = refusal(lambda: case.front.teardown(sandbox))
    assert lost[0] == 2
    assert "1 new commit on main (made from main) and changes not committed" in lost[1]
    same_as_cli(case, "unexported", lost, lambda cli: refusal(lambda: cli.teardown(sandbox)), sandbox)
    assert case.broker.sandbox_dir(sandbox).is_dir()
    bundle = tmp_path / "work.bundle"
    summary = case.front.export(sandbox, "bundle", str(bundle))
    assert (summary["format"], summary["ahead"], summary["dirty"], summary["branch"]) == ("bundle", 1, True, "main")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(case.broker.repo), str(clone)], check=True)
    subprocess.run(["git", "-C", str(clone), "fetch", "-q", str(bundle), "HEAD:exported"], check=True)
    log = subprocess.run(
        ["git", "-C", str(clone), "log", "-1", "--format=%s|%an|%H", "exported"], capture_output=True, check=True
    )
    assert log.stdout.decode().strip() == f"Add new.txt|Sandbox|{summary['head']}"
    still = refusal(lambda: case.front.teardown(sandbox))
    assert still[0] == 2
    assert "changes not committed" in still[1]
    assert "commit" not in still[1].split(":", 2)[2].replace("not committed", "")
    tree = tmp_path / "tree.tar"
    case.front.export(sandbox, "tar", str(tree))
    with tarfile.open(tree) as archive:
        names = sorted(archive.getnames())
        new = archive.extractfile("new.txt")
        assert new is not None
        assert new.read() == b"new\nmore\n"
    assert ".git" not in {name.split("/")[0] for name in names}
    assert case.front.teardown(sandbox) == []
    assert not case.broker.sandbox_dir(sandbox).exists()


def test_a_patch_series_of_the_new_commits(case: Case, sandbox: str, tmp_path: Path) -> None:
    """Three commits (an empty one between) as three patch files that git am applies to a fresh
    clone; a merge is refused (2: a patch series cannot carry one), and so is an export with
    nothing new, leaving no file behind."""
    script = (
        'echo 1 > f1 && git add f1 && git commit -qm "Step 1" && git commit -q --allow-empty -m "A note" && '
        'echo 2 > f2 && git add f2 && git commit -qm "Step 2"'
    )
    assert case.front.exec(sandbox, ["sh", "-c", script])[0] == 0
    patches = tmp_path / "patches"
    summary = case.front.export(sandbox, "patch", str(patches))
    assert summary["files"] == ["0001-Step-1.patch", "0002-A-note.patch", "0003-Step-2.patch"]
    assert sorted(os.listdir(patches)) == summary["files"]
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(case.broker.repo), str(clone)], check=True)
    git = ["git", "-C", str(clone), "-c", "user.name=t", "-c", "user.email=t@localhost"]
    subprocess.run([*git, "am", "-q", "--empty=keep", *(str(patches / name) for name in summary["files"])], check=True)
    assert (clone / "f2").read_text() == "2\n"
    log = subprocess.run([*git, "log", "--format=%s", "-3"], capture_output=True, text=True, check=True).stdout
    assert log.splitlines() == ["Step 2", "A note", "Step 1"]
    assert case.front.teardown(sandbox) == []  # the commits were exported, the tree is clean

    merging = case.front.create(case.broker.profile)
    case.broker.created.append(merging)
    merge = (
        "git checkout -qb side && echo s > s && git add s && git commit -qm side && git checkout -q main && "
        "echo m > m && git add m && git commit -qm main && git merge -q --no-ff side -m merged"
    )
    assert case.front.exec(merging, ["sh", "-c", merge])[0] == 0
    series = tmp_path / "merged"
    refused = refusal(lambda: case.front.export(merging, "patch", str(series)))
    assert refused[0] == 2
    assert "export: --patch cannot carry the merge commit " in refused[1]
    assert "export a bundle, which can" in refused[1]
    assert not series.exists()
    assert case.front.teardown(merging, discard=True) == []

    other = case.front.create(case.broker.profile)
    case.broker.created.append(other)
    empty = tmp_path / "none.bundle"
    nothing = refusal(lambda: case.front.export(other, "bundle", str(empty)))
    assert nothing[0] == 2
    assert "has no commits since main" in nothing[1]
    assert not empty.exists()
    same_as_cli(case, "nothing", nothing, lambda cli: refusal(lambda: cli.export(other, "bundle", str(empty))), other)
    assert case.front.teardown(other) == []  # nothing new in it: no --discard needed


def test_teardown_discard_removes_work_nobody_exported(case: Case, sandbox: str) -> None:
    _commit_and_change(case, sandbox)
    assert case.front.teardown(sandbox, discard=True) == []
    assert not case.broker.sandbox_dir(sandbox).exists()


def _tree(root: Path) -> dict[str, tuple[int, bytes | None]]:
    """Every path below `root` (itself as "."): its permission bits, and a file's bytes."""
    found: dict[str, tuple[int, bytes | None]] = {}
    for path in [root, *sorted(root.rglob("*"))]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        found[str(path.relative_to(root))] = (mode, path.read_bytes() if path.is_file() else None)
    return found


def test_put_and_get_round_trip_files_and_directories(case: Case, sandbox: str) -> None:
    """A directory (an executable script, binary data, a private subdirectory) and a single file
    go in with their bytes and modes, run there, and come out the same; a destination that is
    not a normalized path or not writable, a local source that does not exist, a source missing
    inside and a local destination that exists are refused (2) with the CLI's line, and no local
    file is left of them; an unknown id is unknown (4) to put and get alike."""
    front, local = case.front, case.broker.root / "local"
    tree = local / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "run.sh").write_bytes(b"#!/bin/sh\necho ran\n")
    (tree / "data.bin").write_bytes(hashlib.shake_256(b"put").digest(300_000) + b"\0\xff")
    (tree / "sub" / "deep.txt").write_bytes(b"deep\n")
    (local / "one.bin").write_bytes(b"one\0")
    modes = {"tree/run.sh": 0o750, "tree/data.bin": 0o640, "tree/sub/deep.txt": 0o600, "tree/sub": 0o700}
    for name, mode in {**modes, "tree": 0o750, "one.bin": 0o604}.items():
        (local / name).chmod(mode)

    front.put(sandbox, str(tree), "/workspace/in/tree")
    front.put(sandbox, str(local / "one.bin"), "/workspace/one.bin")
    script = "cd /workspace/in && find tree ../one.bin -printf '%m %p\\n' | LC_ALL=C sort && sha256sum tree/data.bin"
    inside = front.exec(sandbox, ["sh", "-c", script + " && tree/run.sh"])
    shown = sorted(f"{mode:o} {name}" for name, mode in {**modes, "tree": 0o750, "../one.bin": 0o604}.items())
    data_sum = hashlib.sha256((tree / "data.bin").read_bytes()).hexdigest()
    assert inside == (0, "".join(f"{line}\n" for line in [*shown, f"{data_sum}  tree/data.bin", "ran"]).encode(), b"")
    out = case.broker.root / "out"
    out.mkdir()
    front.get(sandbox, "/workspace/in/tree", str(out / "tree"))
    front.get(sandbox, "/workspace/one.bin", str(out / "one.bin"))
    assert _tree(out / "tree") == _tree(tree)
    assert _tree(out / "one.bin") == _tree(local / "one.bin")

    def refusals(front: Front) -> list[tuple[int, str]]:
        return [
            refusal(lambda: front.put(sandbox, str(local / "one.bin"), "/workspace/../etc/x")),
            refusal(lambda: front.put(sandbox, str(local / "one.bin"), "/usr/one.bin")),
            refusal(lambda: front.put(sandbox, str(local / "nothing"), "/workspace/nothing")),
            refusal(lambda: front.get(sandbox, "/workspace/nothing", str(out / "nothing"))),
            refusal(lambda: front.get(sandbox, "/workspace/one.bin", str(out / "one.bin"))),
        ]

    refused_ = refusals(front)
    tar_failed = "tar in the sandbox failed (tar"
    assert case.normal(refused_) == [
        (
            2,
            "sandboxer: put: '/workspace/../etc/x' must be a normalized absolute path inside the sandbox, other than /",
        ),
        (2, f"sandboxer: put: /usr/one.bin: {tar_failed}: one.bin: Cannot open: Read-only file system)"),
        (2, "sandboxer: put: <root>/local/nothing: no such file or directory"),
        (2, f"sandboxer: get: /workspace/nothing: {tar_failed}: nothing: Cannot stat: No such file or directory)"),
        (2, "sandboxer: get: <root>/out/one.bin: exists; give a path that does not"),
    ]
    assert sorted(os.listdir(out)) == ["one.bin", "tree"]
    same_as_cli(case, "put-get", refused_, refusals, sandbox)
    unknown = [
        refusal(lambda: front.put(UNKNOWN_ID, str(local / "one.bin"), "/workspace/x")),
        refusal(lambda: front.get(UNKNOWN_ID, "/workspace/one.bin", str(out / "x"))),
    ]
    assert unknown == [(4, f"sandboxer: no such sandbox: {UNKNOWN_ID}")] * 2


@contextlib.contextmanager
def _processes_killed(case: Case, sandbox_id: str) -> Iterator[str]:
    """The sandbox's processes killed under it, as an OOM kill or a host's kill -9 would: its
    init (bwrap), its container (Docker); it is then listed `dead`. Yields how a receipt names
    its container (or "")."""
    record = json.loads((case.broker.sandbox_dir(sandbox_id) / "record.json").read_text())
    if case.backend == "docker":
        subprocess.run(["docker", "kill", record["container_id"]], capture_output=True, check=True)
        namespace = None
    else:
        # Held open until gc is done, so that the kernel cannot give the dead pid namespace's
        # inode number to a new one (test_bwrap_lifecycle shows why that matters).
        namespace = os.open(f"/proc/{record['holder_pid']}/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        os.kill(record["init_pid"], signal.SIGKILL)
    try:
        deadline = time.monotonic() + 20
        while {e["id"]: e["status"] for e in case.reference.listing()}[sandbox_id] != "dead":
            assert time.monotonic() < deadline, f"{sandbox_id} never died"
            time.sleep(0.05)
        yield str(record.get("container_id") or "")[:12]
    finally:
        if namespace is not None:
            os.close(namespace)


def _gc_after_a_death(case: Case, front: Front, healthy: str) -> tuple[dict[str, Any], str]:
    """gc through `front` once a new sandbox's processes died: its report (ids named), and the
    dead sandbox's id."""
    dead = front.create(case.broker.profile)
    case.broker.created.append(dead)
    with _processes_killed(case, dead) as container:
        report = front.gc()
    return case.normal(report, *filter(None, (dead, healthy, container))), dead


def test_gc_collects_a_dead_sandbox_and_spares_a_running_one(case: Case, sandbox: str) -> None:
    """A sandbox whose processes died is collected with an empty residue and its directory gone;
    the running one is named healthy and still runs; a second gc finds nothing to collect. The
    report is the CLI's on every front."""
    report, dead = _gc_after_a_death(case, case.front, sandbox)
    assert [(receipt["id"], receipt["residue"]) for receipt in report["collected"]] == [("<id>", [])]
    assert (report["healthy"], report["busy"], report["warm"]) == (["<id>"], [], [])
    assert not case.broker.sandbox_dir(dead).exists()
    assert case.front.list() == [sandbox]
    assert case.front.gc() == {"collected": [], "healthy": [sandbox], "busy": [], "warm": [], "exports": []}
    assert case.front.exec(sandbox, ["true"]) == (0, b"", b"")
    same_as_cli(case, "gc", report, lambda cli: _gc_after_a_death(case, cli, sandbox)[0])


def _created_with_a_ttl(case: Case, front: Front, ttl: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """create --ttl through `front`: what create reports, and the sandbox's entry in list."""
    created = front.create_json(case.broker.profile, ttl=ttl)
    case.broker.created.append(created["id"])
    [entry] = [entry for entry in front.listing() if entry["id"] == created["id"]]
    return created, entry


def test_a_ttl_is_the_same_expiry_everywhere_and_a_bad_one_is_refused(case: Case) -> None:
    """create with a TTL reports when the sandbox expires, and list shows the same moment, TTL
    seconds after its creation, with the fields the CLI prints; a TTL of 0, below 0, below 1 or
    past 30 days is refused (2) with the CLI's line, and leaves no sandbox."""
    front = case.front
    created, entry = _created_with_a_ttl(case, front, 3600)
    assert entry["expires_at"] == created["expires_at"]
    lifetime = _moment(entry["expires_at"]) - _moment(entry["created_at"])
    assert lifetime in (3600, 3601), entry  # both to the second, taken one after the other
    assert entry["status"] == "running"

    def fields(created: dict[str, Any], entry: dict[str, Any]) -> list[list[str]]:
        return [sorted(created), sorted(entry)]

    same_as_cli(case, "ttl", fields(created, entry), lambda cli: fields(*_created_with_a_ttl(case, cli, 3600)))
    before = front.list()
    bad = [refusal(partial(front.create_json, case.broker.profile, ttl=ttl)) for ttl in (0, -5, 0.5, 2_592_001)]
    assert bad == [(2, "sandboxer: --ttl: must be between 1 and 2592000 seconds")] * 4
    assert front.list() == before


def _moment(text: str) -> int:
    return int(datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC).timestamp())


def test_list_and_work_show_whose_a_sandbox_is_and_its_work(case: Case, sandbox: str, tmp_path: Path) -> None:
    """list shows the caller, the age, no end (made without a TTL) and the work as its git
    reports it: clean, then one commit and a change not committed, then (both exported) all of
    it exported; `work` says the same, with what teardown would refuse for."""

    def entry() -> dict[str, Any]:
        (found,) = [item for item in case.front.listing() if item["id"] == sandbox]
        return found

    first = entry()
    assert (first["caller"], first["caller_uid"], first["seconds_left"]) == ("root", 0, None)
    assert 0 <= first["age_seconds"] < 600
    assert (first["work"]["commits"], first["work"]["dirty"], first["work"]["exported"]) == (0, False, False)
    _commit_and_change(case, sandbox)
    worked = entry()["work"]
    assert (worked["commits"], worked["dirty"], worked["exported"], worked["branch"]) == (1, True, False, "main")
    assert worked == case.front.work(sandbox)
    assert worked["unexported"] == ["1 new commit on main (made from main)", "changes not committed"]
    case.front.export(sandbox, "bundle", str(tmp_path / "work.bundle"))
    case.front.export(sandbox, "tar", str(tmp_path / "tree.tar"))
    done = case.front.work(sandbox)
    assert (done["commits"], done["dirty"], done["exported"], done["unexported"]) == (1, True, True, [])
    assert done["head"] == worked["head"]

    def stable(document: dict[str, Any]) -> dict[str, Any]:
        return {key: value for key, value in document.items() if key != "head"}  # a commit's time differs

    same_as_cli(case, "work", stable(done), lambda cli: stable(cli.work(sandbox)), sandbox)
    assert case.front.teardown(sandbox) == []


LOAD = """
import time
block = bytearray(96 << 20)  # touched: resident
for i in range(0, len(block), 4096):
    block[i] = 1
start = time.process_time()
while time.process_time() - start < 1.5:
    pass
open("/workspace/blob", "wb").write(b"x" * (8 << 20))
"""


def test_usage_rises_under_load(case: Case, sandbox: str) -> None:
    """CPU time, the memory peak and the workspace's space each rise with a command's load, as
    its cgroups count them; inspect carries the same usage."""
    before = case.front.usage(sandbox)
    assert before["source"] == "cgroup"
    assert before["memory_limit_bytes"] == 2048 << 20  # the profile's limits.memory_mib
    answer = case.front.exec(sandbox, ["python3", "-c", LOAD])
    assert answer[0] == 0, answer
    after = case.front.usage(sandbox)
    assert after["cpu_seconds"] - before["cpu_seconds"] >= 1.2
    assert after["memory_peak_bytes"] >= 96 << 20
    assert after["workspace_bytes"] - before["workspace_bytes"] >= 8 << 20
    assert after["pids"] >= 1
    assert after["pids_limit"] == before["pids_limit"]
    inspected = case.front.inspect(sandbox)["usage"]
    assert inspected["cpu_seconds"] >= after["cpu_seconds"]
    assert sorted(inspected) == sorted(after)
    same_as_cli(case, "usage-keys", sorted(after), lambda cli: sorted(cli.usage(sandbox)), sandbox)


def test_extend_moves_the_end_within_the_profiles_maximum(case: Case) -> None:
    """A profile with lifetime.max_seconds: extend moves a sandbox's end (list shows it), never
    earlier than it was; past the maximum it is refused (3) with the CLI's line; a sandbox made
    without a TTL has no end to move (2)."""
    broker = case.broker
    name = "bounded"
    text = backend_profile_text(broker, name, broker.repo, "lifetime:\n  max_seconds: 3600\n")
    if not (broker.config / "profiles" / f"{name}.yaml").exists():
        broker.write_profile(name, text)
        broker.approve(name)
    created = case.front.create_json(name, ttl=300)
    sandbox = created["id"]
    broker.created.append(sandbox)
    longer = case.front.extend(sandbox, 1800)
    assert 1790 <= longer["seconds_left"] <= 1800
    assert longer["expires_at"] == next(e["expires_at"] for e in case.front.listing() if e["id"] == sandbox)
    assert longer["max_expires_at"] is not None
    listed = next(e for e in case.front.listing() if e["id"] == sandbox)
    assert _moment(longer["max_expires_at"]) - _moment(listed["created_at"]) == 3600
    kept = case.front.extend(sandbox, 60)  # never earlier than it was
    assert kept["expires_at"] == longer["expires_at"]
    past = refusal(lambda: case.front.extend(sandbox, 7200))
    assert past[0] == 3
    assert "past the sandbox's latest end" in past[1]
    assert longer["max_expires_at"] in past[1]

    def timeless(pair: tuple[int, str]) -> tuple[int, str]:
        return pair[0], re.sub(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", "<time>", pair[1])

    same_as_cli(
        case, "extend-past", timeless(past), lambda cli: timeless(refusal(lambda: cli.extend(sandbox, 7200))), sandbox
    )
    endless = case.front.create(broker.profile)
    broker.created.append(endless)
    unbounded = refusal(lambda: case.front.extend(endless, 60))
    assert unbounded[0] == 2
    assert "has no end to its lifetime" in unbounded[1]
