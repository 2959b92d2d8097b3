"""Python mistakes at the API's edge, on the embedded broker and through the service's client:
each is TypeError before anything starts — no exec runs, nothing waits for input that never
comes, no sandbox is made — and a bare local name in put/get is the working directory's.

The checks are the front ends' own (sandboxer.api.verbs), so one backend shows them; the service's
audit log shows that the client sent nothing for them.
"""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath

import pytest

from sandboxer import Broker, Client
from sandboxer.api.sandbox import Sandbox
from sandboxer.clients.service import ClientSandbox
from sandboxer.errors import ExecError, UnexportedWorkError
from tests.integration.conftest import SandboxBroker
from tests.integration.services import Service

# What each mistaken exec would run if it ran: a trace the test then looks for.
TRACE = ["sh", "-c", "echo ran >> /workspace/ran"]


@pytest.fixture(params=["embedded", "client"])
def api(request: pytest.FixtureRequest, sb_root: SandboxBroker) -> Iterator[Broker | Client]:
    """The embedded broker, or the client of a service for the same directories."""
    if request.param == "embedded":
        yield Broker(config_dir=str(sb_root.config), state_dir=str(sb_root.state))
        return
    service = Service(sb_root, sb_root.state / "broker.sock").start()
    try:
        yield Client(str(service.socket))
    finally:
        service.stop()


@pytest.fixture
def box(api: Broker | Client, sb_root: SandboxBroker) -> Iterator[Sandbox | ClientSandbox]:
    sandbox = api.create(sb_root.profile)
    try:
        yield sandbox
    finally:
        sandbox.teardown(discard=True)


def refused_at_once(call: Callable[[], object]) -> str:
    """The TypeError `call` raises, within seconds (a mistake that got through might wait for
    input that never comes: the sandbox's lifetime)."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # judged below, in the test's thread
            raised.append(exc)

    caller = threading.Thread(target=run, daemon=True)
    caller.start()
    caller.join(timeout=20)
    assert not caller.is_alive(), "the call did not end: it was not refused before it started"
    assert raised, "the call was taken"
    assert isinstance(raised[0], TypeError), repr(raised[0])
    return str(raised[0])


def execs_audited(broker: SandboxBroker) -> int:
    log = broker.state / "audit.log"
    lines = log.read_text().splitlines() if log.exists() else []
    return sum(json.loads(line)["verb"].startswith("exec") for line in lines)


def test_exec_mistakes_are_type_errors_and_nothing_runs(
    box: Sandbox | ClientSandbox, sb_root: SandboxBroker, tmp_path: Path
) -> None:
    text_file = tmp_path / "input.txt"
    text_file.write_text("text\n")
    audited = execs_audited(sb_root)
    with text_file.open() as opened_as_text:
        mistakes: list[Callable[[], object]] = [
            # A str is a Sequence[str] to a type checker: only the check at the edge sees this one.
            lambda: box.exec("echo ran >> /workspace/ran"),  # would run `e`, each other character an argument
            lambda: box.exec(b"true"),  # type: ignore[arg-type]
            lambda: box.exec(["sh", "-c", b"echo ran >> /workspace/ran"]),  # type: ignore[list-item]
            lambda: box.exec(TRACE, stdin="text"),  # type: ignore[arg-type]  # hung a service exec until the sandbox expired
            lambda: box.exec(TRACE, stdin=io.StringIO("text")),  # type: ignore[arg-type]
            lambda: box.exec(TRACE, stdin=opened_as_text),  # type: ignore[arg-type]
            lambda: box.exec(TRACE, stdin=None),  # type: ignore[arg-type]
            lambda: box.exec(TRACE, env={"A": b"b"}),  # type: ignore[dict-item]
            lambda: box.exec(TRACE, env=[("A", "b")]),  # type: ignore[arg-type]
            lambda: box.exec(TRACE, timeout=True),
            lambda: box.exec(TRACE, timeout="5"),  # type: ignore[arg-type]
            lambda: box.exec(TRACE, cwd=b"/workspace"),  # type: ignore[arg-type]
            # exec_stream refuses at the call, before its thread or its request starts
            lambda: box.exec_stream("echo ran >> /workspace/ran"),
            lambda: box.exec_stream(TRACE, stdin="text"),  # type: ignore[arg-type]
            lambda: box.exec_stream(TRACE, stdin=io.StringIO("text")),  # type: ignore[arg-type]
        ]
        messages = [refused_at_once(mistake) for mistake in mistakes]
    assert messages[0] == 'exec: argv must be a list of str, one per argument (["ls", "-la"]), not str'
    assert messages[3] == "exec: stdin must be bytes or a binary file, not str: encode it (text.encode())"
    assert messages[5] == 'exec: stdin must be bytes or a binary file, not a text file (TextIOWrapper): open it "rb"'
    after = box.exec(["sh", "-c", "cat /workspace/ran 2>&1; echo end"])
    assert after.stdout.endswith(b"No such file or directory\nend\n"), after
    if isinstance(box, ClientSandbox):  # the last exec alone reached the service
        deadline = time.monotonic() + 10  # the service writes an exec's line once its stream has ended
        while execs_audited(sb_root) <= audited and time.monotonic() < deadline:
            time.sleep(0.05)
        assert execs_audited(sb_root) == audited + 1


def test_an_empty_argv_is_the_brokers_refusal_on_both_fronts(box: Sandbox | ClientSandbox) -> None:
    """As the CLI's `exec ID --`: ExecError, 125, "exec: no command" (embedded and through the
    service alike), and for exec_stream at the call."""
    for call in (lambda: box.exec([]), lambda: box.exec_stream(())):
        with pytest.raises(ExecError) as refused:
            call()
        assert (refused.value.status, refused.value.message) == (125, "exec: no command")


def test_a_teardown_refused_for_unexported_work_lists_it_on_both_fronts(box: Sandbox | ClientSandbox) -> None:
    """UnexportedWorkError.unexported: what teardown would lose, item by item, as the HTTP
    answer's `unexported` (embedded and through the service alike)."""
    work = "echo a > a && git add a && git commit -qm a && echo b > b"
    assert box.exec(["sh", "-c", work]).status == 0
    with pytest.raises(UnexportedWorkError) as refused:
        box.teardown()
    assert refused.value.status == 2
    assert refused.value.unexported == ("1 new commit on main (made from main)", "changes not committed")


def test_bytes_like_input_and_binary_files_are_taken(box: Sandbox | ClientSandbox, tmp_path: Path) -> None:
    assert box.exec(["cat"], stdin=bytearray(b"array")).stdout == b"array"
    assert box.exec(["cat"], stdin=memoryview(b"a view")[2:]).stdout == b"view"
    (tmp_path / "input").write_bytes(b"from a file")
    with (tmp_path / "input").open("rb") as binary:
        assert box.exec(["cat"], stdin=binary).stdout == b"from a file"


def test_other_verbs_refuse_the_wrong_types_before_they_start(
    api: Broker | Client, box: Sandbox | ClientSandbox, sb_root: SandboxBroker, tmp_path: Path
) -> None:
    (tmp_path / "f").write_bytes(b"f")
    listed = [info.id for info in api.list()]
    mistakes: list[Callable[[], object]] = [
        lambda: api.create(sb_root.profile.encode()),  # type: ignore[arg-type]
        lambda: api.create(sb_root.profile, ref=b"main"),  # type: ignore[arg-type]
        lambda: api.sandbox(box.id.encode()),  # type: ignore[arg-type]
        lambda: box.export(b"tar", str(tmp_path / "out.tar")),  # type: ignore[arg-type]
        lambda: box.export("tar", str(tmp_path / "out.tar").encode()),  # type: ignore[arg-type]
        lambda: box.put(str(tmp_path / "f").encode(), "/workspace/f"),  # type: ignore[arg-type]
        lambda: box.put(str(tmp_path / "f"), b"/workspace/f"),  # type: ignore[arg-type]
        lambda: box.get(b"/workspace/README.md", str(tmp_path / "g")),  # type: ignore[arg-type]
        lambda: box.get("/workspace/README.md", str(tmp_path / "g").encode()),  # type: ignore[arg-type]
        lambda: box.dispatch_tool("lease", "request", "5"),  # type: ignore[arg-type]
        lambda: box.dispatch_tool("lease", "request", True),
        lambda: api.get_export("0" * 24, str(tmp_path / "kept"), format=b"tar"),  # type: ignore[arg-type]
    ]
    for mistake in mistakes:
        refused_at_once(mistake)
    assert [info.id for info in api.list()] == listed
    assert sorted(path.name for path in tmp_path.iterdir()) == ["f"]
    assert box.exec(["test", "-e", "/workspace/f"]).status == 1


def test_put_and_get_take_bare_names_and_pathlib_paths(
    box: Sandbox | ClientSandbox, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "f").write_bytes(b"file\n")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "in.txt").write_bytes(b"in dir\n")
    box.put("f", "/workspace/f")
    box.put(Path("d"), PurePosixPath("/workspace/d"))
    box.get("/workspace/f", "g")
    box.get(PurePosixPath("/workspace/f"), Path("h"))
    box.get("/workspace/d", "e")
    assert (tmp_path / "g").read_bytes() == (tmp_path / "h").read_bytes() == b"file\n"
    assert (tmp_path / "e" / "in.txt").read_bytes() == b"in dir\n"
