"""The core's exec (sandboxer/commands/execute.py) on a fake backend (tests/unit/fake_backend.py),
through the Python API and on a caller's own descriptors: the command's status and output, its
input, the timeout (124 and the broker's line), a command not found (127), and refusals (125) by
the request, the sandbox's state, the backend and the stdio. A real record, config and clone; no
namespace or container, so each test takes a fraction of a second.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from sandboxer import Broker
from sandboxer.api.results import ExecResult
from sandboxer.backends import Backends
from sandboxer.commands.execute import execute
from sandboxer.core.exec_request import ExecRequest
from sandboxer.errors import ExecError, ExecUsage
from sandboxer.execio.stdio import TIMED_OUT, ClientStdio, OwnStdio, Program
from tests.conftest import make_repository, make_runtime
from tests.samples import profile_yaml
from tests.unit.fake_backend import FakeBackend


@pytest.fixture
def fake() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def broker(tmp_path: Path, fake: FakeBackend) -> Broker:
    """A config dir with an approved extension and a profile whose callers may set TASK_ID."""
    runtime = make_runtime(tmp_path / "runtime")
    repo = make_repository(tmp_path / "repo", {"README.md": b"workspace\n"})
    config = tmp_path / "config"
    (config / "extensions").mkdir(parents=True)
    (config / "profiles").mkdir()
    config.chmod(0o700)
    engines = Backends({"bwrap": fake, "docker": fake})  # given to the core, not patched in
    made = Broker(config_dir=str(config), state_dir=str(tmp_path / "state"), backends=engines)
    digest = made.owner.runtime_digest(str(runtime)).sha256
    (config / "extensions" / "ext.bwrap.yaml").write_text(
        f"extension: ext.bwrap\nconfig:\n  runtime:\n    path: {runtime}\n    sha256: {digest}\n"
    )
    (config / "profiles" / "p.yaml").write_text(profile_yaml("p", str(repo), "exec:\n  caller_env: [TASK_ID]\n"))
    made.owner.approve("ext.bwrap")
    made.owner.approve("p")
    return made


def test_exec_gives_the_commands_status_and_output(broker: Broker, fake: FakeBackend) -> None:
    sandbox = broker.create("p")
    assert sandbox.exec(["echo", "hello", "world"]) == ExecResult(status=0, stdout=b"hello world\n", stderr=b"")
    assert sandbox.exec(["say", "3", "it", "failed"]) == ExecResult(status=3, stdout=b"", stderr=b"it failed\n")
    request, env = fake.execs[0]
    assert (request.sandbox_id, request.argv, request.cwd, request.timeout) == (
        sandbox.id,
        ("echo", "hello", "world"),
        "/workspace",
        None,
    )
    assert env["SANDBOXER_SANDBOX_ID"] == sandbox.id  # the sandbox's own environment, from its record


def test_exec_feeds_the_command_its_input(broker: Broker) -> None:
    sandbox = broker.create("p")
    assert sandbox.exec(["cat"], stdin=b"given at once\n").stdout == b"given at once\n"
    assert sandbox.exec(["cat"], stdin=io.BytesIO(b"read from a file\n" * 1000)).stdout == b"read from a file\n" * 1000


def test_a_timeout_ends_the_exec_with_124_and_the_brokers_line(broker: Broker) -> None:
    sandbox = broker.create("p")
    assert sandbox.exec(["sleep", "30"], timeout=0.05) == ExecResult(
        status=TIMED_OUT, stdout=b"", stderr=b"sandboxer: exec: timed out after 0.05 s\n"
    )
    assert sandbox.exec(["sleep", "0.01"], timeout=5).status == 0


def test_a_command_that_is_not_found_ends_with_127_and_its_line(broker: Broker) -> None:
    sandbox = broker.create("p")
    assert sandbox.exec(["no-such-program"]) == ExecResult(
        status=127, stdout=b"", stderr=b"sandboxer: exec: no-such-program: not found\n"
    )


def test_refusals_are_exec_errors_with_status_125(broker: Broker, fake: FakeBackend) -> None:
    sandbox = broker.create("p")
    refusals: dict[str, Callable[[], object]] = {
        "exec: --cwd must be a normalized absolute path inside the sandbox": lambda: sandbox.exec(["true"], cwd="x"),
        "exec: --timeout must be between 0 and 604800 seconds": lambda: sandbox.exec(["true"], timeout=0),
        "exec: --env OTHER: not a name this sandbox's profile lets a caller set (exec.caller_env)": (
            lambda: sandbox.exec(["true"], env={"OTHER": "x"})
        ),
        "exec: no command": lambda: sandbox.exec([]),
    }
    for message, run in refusals.items():
        with pytest.raises(ExecError) as refused:
            run()
        assert (refused.value.status, refused.value.message) == (125, message)
    assert fake.execs == []  # none of them reached the backend
    fake.running.discard(sandbox.id)  # its processes died
    with pytest.raises(ExecError) as stopped:
        sandbox.exec(["true"])
    assert (stopped.value.status, stopped.value.message) == (
        125,
        f"exec: sandbox {sandbox.id} is not running: its processes are gone "
        f"(sandboxer teardown {sandbox.id} removes it)",
    )


def test_the_callers_variables_and_consumer_reach_the_command(broker: Broker, fake: FakeBackend) -> None:
    sandbox = broker.create("p")
    result = sandbox.exec(["env"], env={"TASK_ID": "42"}, consumer="tests")
    assert b"TASK_ID=42\n" in result.stdout
    assert b"SANDBOXER_CONSUMER=tests\n" in result.stdout
    request, _ = fake.execs[-1]
    assert request.values_apart  # a caller's values stay off command lines


def test_a_programs_stdio_is_refused_a_terminal(broker: Broker) -> None:
    sandbox = broker.create("p")
    request = ExecRequest.of(sandbox.id, ["echo"], tty=True)
    with pytest.raises(ExecUsage, match="a terminal is for a caller's own stdio"):
        execute(broker.dirs, request, Program(b"", lambda stream, chunk: None), backends=broker.backends, caller_env={})


def test_exec_on_this_processs_own_descriptors(broker: Broker, capfd: pytest.CaptureFixture[str]) -> None:
    """The CLI in-process: the command writes to fd 1, the broker's lines go to fd 2."""
    sandbox = broker.create("p")
    cli = ExecRequest.from_cli(
        sandbox.id, ["echo", "own"], cwd=None, consumer=None, executable=None, timeout=None, tty=False, env=[]
    )
    assert execute(broker.dirs, cli, OwnStdio(), backends=broker.backends, caller_env={}) == 0
    timed = ExecRequest.from_cli(
        sandbox.id, ["sleep", "9"], cwd=None, consumer=None, executable=None, timeout="0.05", tty=False, env=[]
    )
    assert execute(broker.dirs, timed, OwnStdio(), backends=broker.backends, caller_env={}) == TIMED_OUT
    assert capfd.readouterr() == ("own\n", "sandboxer: exec: timed out after 0.05 s\n")


def test_exec_on_a_clients_descriptors(broker: Broker) -> None:
    """The service for a CLI client: the command reads and writes the descriptors it passed."""
    sandbox = broker.create("p")
    pipes = [os.pipe() for _ in range(3)]
    try:
        os.write(pipes[0][1], b"typed\n")
        os.close(pipes[0][1])
        stdio = ClientStdio((pipes[0][0], pipes[1][1], pipes[2][1]), None)
        assert (
            execute(broker.dirs, ExecRequest.of(sandbox.id, ["cat"]), stdio, backends=broker.backends, caller_env={})
            == 0
        )
        assert (
            execute(
                broker.dirs,
                ExecRequest.of(sandbox.id, ["say", "1", "no"]),
                stdio,
                backends=broker.backends,
                caller_env={},
            )
            == 1
        )
        assert os.read(pipes[1][0], 100) == b"typed\n"
        assert os.read(pipes[2][0], 100) == b"no\n"
    finally:
        for read_end, write_end in pipes:
            os.close(read_end)
            if write_end != pipes[0][1]:
                os.close(write_end)
