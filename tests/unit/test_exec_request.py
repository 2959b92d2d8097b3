"""What an exec asks (sandboxer.core.exec_request.ExecRequest), checked once where it is made: the
CLI's strings and the Python API's keywords become the same request, and each refusal is the one
line exec has always printed (ExecUsage, status 125)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from sandboxer.core.exec_request import ExecRequest
from sandboxer.errors import ExecUsage

ID = "0123456789abcdef01234567"


def _cli(*, timeout: str | None = None, env: tuple[str, ...] = (), **options: str) -> ExecRequest:
    given = {"cwd": None, "consumer": None, "executable": None, **options}
    return ExecRequest.from_cli(ID, ["true"], timeout=timeout, tty=False, env=list(env), **given)


def test_the_cli_and_the_python_api_make_the_same_request() -> None:
    cli = ExecRequest.from_cli(
        ID, ["sh", "-c", "x"], cwd="/tmp", consumer="c", executable=None, timeout="2.5", tty=True, env=["A=1", "B=x=y"]
    )
    api = ExecRequest.of(
        ID, ["sh", "-c", "x"], cwd="/tmp", consumer="c", timeout=2.5, tty=True, env={"A": "1", "B": "x=y"}
    )
    assert cli == api
    assert (cli.argv, cli.timeout, dict(cli.env)) == (("sh", "-c", "x"), 2.5, {"A": "1", "B": "x=y"})
    assert ExecRequest.of(ID, ["true"]).cwd == "/workspace"


def test_a_request_is_frozen() -> None:
    request = ExecRequest.of(ID, ["true"], env={"A": "1"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.timeout = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        request.env["A"] = "2"  # type: ignore[index]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"cwd": "relative"}, "exec: --cwd must be a normalized absolute path inside the sandbox"),
        ({"cwd": "/workspace/../etc"}, "exec: --cwd must be a normalized absolute path inside the sandbox"),
        ({"consumer": "a b"}, "exec: --consumer must be 1-128 characters without whitespace, '=' or '//'"),
        ({"consumer": "x" * 129}, "exec: --consumer must be 1-128 characters without whitespace, '=' or '//'"),
        ({"executable": ""}, "exec: --executable must be a program name or an absolute path"),
        ({"timeout": "soon"}, "exec: --timeout must be a number of seconds"),
        ({"timeout": "0"}, "exec: --timeout must be between 0 and 604800 seconds"),
        ({"timeout": "604801"}, "exec: --timeout must be between 0 and 604800 seconds"),
        ({"timeout": "nan"}, "exec: --timeout must be between 0 and 604800 seconds"),
        ({"env": ("NAME",)}, "exec: --env must be NAME=VALUE"),
        ({"env": ("=value",)}, "exec: --env must be NAME=VALUE"),
        ({"env": ("A=1", "A=2")}, "exec: --env A: given twice"),
    ],
)
def test_each_cli_refusal_is_exec_s_one_line(options: dict[str, object], message: str) -> None:
    with pytest.raises(ExecUsage) as refused:
        _cli(**options)  # type: ignore[arg-type]
    assert str(refused.value) == message


def test_the_id_is_checked_after_the_options() -> None:
    with pytest.raises(ExecUsage, match=r"^exec: no such sandbox \(ids are 24 lowercase hex digits\)$"):
        ExecRequest.of("../x", ["true"])
    with pytest.raises(ExecUsage, match="--cwd"):
        ExecRequest.of("../x", ["true"], cwd="x")


def test_the_python_apis_values_are_checked_for_their_type() -> None:
    bad: dict[str, Callable[[], object]] = {
        "exec: no command": lambda: ExecRequest.of(ID, []),
        "exec: the command must be strings without NUL characters": lambda: ExecRequest.of(ID, ["a\0b"]),
        "exec: --timeout must be a number of seconds": lambda: ExecRequest.of(ID, ["true"], timeout="soon"),  # type: ignore[arg-type]
        "exec: --env A: a value must be a string without NUL bytes": lambda: ExecRequest.of(ID, ["true"], env={"A": 1}),  # type: ignore[dict-item]
    }
    for message, make in bad.items():
        with pytest.raises(ExecUsage) as refused:
            make()
        assert str(refused.value) == message


def test_whose_values_stay_off_command_lines() -> None:
    assert not ExecRequest.of(ID, ["true"], consumer="c").values_apart
    assert ExecRequest.of(ID, ["true"], consumer="c", executable="tool").values_apart
    assert ExecRequest.of(ID, ["true"], env={"A": "1"}).values_apart
