"""The Python API's arguments checked at its edge (sandboxer.api.verbs): a Python mistake — a str
where a list of str is due, text where bytes are, bytes where a str is — is TypeError before
anything starts, on the embedded API and the service's client alike (both call these first;
tests/integration/test_api_arguments.py shows nothing starts)."""

from __future__ import annotations

import io
import tempfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from sandboxer.api.verbs import check_dispatch, checked_create, checked_exec, checked_export, checked_path
from sandboxer.errors import ExecError

NO_OPTIONS: dict[str, Any] = {"cwd": None, "timeout": None, "consumer": None, "executable": None, "env": None}


def _exec(argv: object = ("true",), stdin: object = b"", **options: object) -> tuple[list[str], object]:
    return checked_exec(argv, stdin, **{**NO_OPTIONS, **options})


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        ("ls -la", "argv must be a list of str, one per argument"),
        (b"ls", "argv must be a list of str, one per argument"),
        (iter(["ls"]), "argv must be a list of str"),
        ({"ls": 1}, "argv must be a list of str"),
        (None, "argv must be a list of str"),
        (["sh", "-c", b"echo"], "each argument in argv must be a str, not bytes"),
        (["sleep", 1], "each argument in argv must be a str, not int"),
        ([Path("/bin/true")], "each argument in argv must be a str, not PosixPath"),
    ],
)
def test_an_argv_that_is_not_a_list_of_str_is_refused(argv: object, says: str) -> None:
    with pytest.raises(TypeError, match=says):
        _exec(argv)


def test_argv_is_passed_on_as_a_list_and_empty_is_the_brokers_refusal() -> None:
    assert _exec(("ls", "-la"))[0] == ["ls", "-la"]
    with pytest.raises(ExecError) as refused:  # as the CLI's `exec ID --` says it, on every front
        _exec([])
    assert (refused.value.status, refused.value.message) == (125, "exec: no command")


def _text_files() -> Iterator[object]:
    yield io.StringIO("text")
    with tempfile.TemporaryFile("w+") as text:
        yield text
    with tempfile.NamedTemporaryFile("w+") as wrapped:  # a wrapper, not an io.TextIOBase itself
        yield wrapped


@pytest.mark.parametrize(
    ("stdin", "says"),
    [
        ("text", "stdin must be bytes or a binary file, not str: encode it"),
        (None, 'stdin must be bytes or a binary file, not None \\(no input: b""\\)'),
        (3, "stdin must be bytes or a binary file, not int"),
        ([b"a"], "stdin must be bytes or a binary file, not list"),
    ],
)
def test_stdin_that_is_not_bytes_or_a_binary_file_is_refused(stdin: object, says: str) -> None:
    with pytest.raises(TypeError, match=says):
        _exec(stdin=stdin)


def test_a_text_file_as_stdin_is_refused() -> None:
    for text in _text_files():
        with pytest.raises(TypeError, match=r'not a text file .*: open it "rb"'):
            _exec(stdin=text)


def test_bytes_like_stdin_is_bytes_and_a_binary_file_is_passed_as_it_is(tmp_path: Path) -> None:
    assert _exec(stdin=bytearray(b"ab"))[1] == b"ab"
    assert _exec(stdin=memoryview(b"abc")[1:])[1] == b"bc"
    data = b"data"
    assert _exec(stdin=data)[1] is data
    for binary in (io.BytesIO(b"x"), tempfile.NamedTemporaryFile("w+b")):  # noqa: SIM115
        with binary:
            assert _exec(stdin=binary)[1] is binary
    (tmp_path / "f").write_bytes(b"x")
    with (tmp_path / "f").open("rb") as opened:
        assert _exec(stdin=opened)[1] is opened


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"timeout": True}, "timeout must be a number of seconds .*, not bool"),
        ({"timeout": "5"}, "timeout must be a number of seconds .*, not str"),
        ({"cwd": b"/workspace"}, "cwd must be a str or None, not bytes"),
        ({"cwd": Path("/workspace")}, "cwd must be a str or None, not PosixPath"),
        ({"consumer": 1}, "consumer must be a str or None, not int"),
        ({"executable": b"sh"}, "executable must be a str or None, not bytes"),
        ({"env": [("A", "b")]}, "env must be a mapping of str to str or None, not list"),
        ({"env": {"A": b"b"}}, "env\\['A'\\] must be a str, not bytes"),
        ({"env": {b"A": "b"}}, "env's names must be str, not bytes"),
        ({"env": {"A": 1}}, "env\\['A'\\] must be a str, not int"),
    ],
)
def test_exec_options_of_the_wrong_type_are_refused(options: dict[str, object], says: str) -> None:
    with pytest.raises(TypeError, match=says):
        _exec(["true"], **options)


def test_a_refusal_never_shows_the_value() -> None:
    """An argument may be a secret (a token in argv, in env, on stdin): messages name types only."""
    secret = "hunter2-token"
    for call in (
        lambda: _exec(secret),
        lambda: _exec(stdin=secret),
        lambda: _exec(env={"TOKEN": secret.encode()}),
        lambda: _exec(["echo", secret.encode()]),
    ):
        with pytest.raises(TypeError) as raised:
            call()
        assert "hunter2" not in str(raised.value)


def test_good_options_pass() -> None:
    argv, stdin = _exec(["true"], timeout=1, cwd="/workspace", consumer="a", executable="sh", env={"A": "b"})
    assert (argv, stdin) == (["true"], b"")
    _exec(["true"], timeout=0.5)


def test_paths_are_str_or_pathlib_never_bytes() -> None:
    assert checked_path("get: destination", Path("out")) == "out"
    assert checked_path("put: destination", PurePosixPath("/workspace/x")) == "/workspace/x"
    assert checked_path("put: source", "f") == "f"
    with pytest.raises(TypeError, match=r"get: destination must be a path .*, not bytes"):
        checked_path("get: destination", b"out")
    with pytest.raises(TypeError, match="not int"):
        checked_path("put: source", 3)


def test_create_export_and_dispatch_refuse_the_wrong_types() -> None:
    good: dict[str, Any] = {"manifest": None, "bootstrap": None, "ref": None, "branch": None}
    assert checked_create("dev", **{**good, "manifest": Path("m.yaml")}) == ("m.yaml", None)
    for profile, options, says in [
        (b"dev", good, "create: profile must be a profile's name \\(str\\), not bytes"),
        ("dev", {**good, "bootstrap": b"b.yaml"}, "create: bootstrap must be a path .*, not bytes"),
        ("dev", {**good, "ref": b"main"}, "create: ref must be a str or None, not bytes"),
        ("dev", {**good, "branch": ["b"]}, "create: branch must be a str or None, not list"),
    ]:
        with pytest.raises(TypeError, match=says):
            checked_create(profile, **options)
    assert checked_export("export", "tar", Path("out.tar")) == "out.tar"
    with pytest.raises(TypeError, match=r"export: format must be a str .*, not bytes"):
        checked_export("export", b"tar", "out.tar")
    with pytest.raises(TypeError, match=r"export: destination must be a path .*, not bytes"):
        checked_export("export", "tar", b"out.tar")
    check_dispatch("lease", "req-1", 0)
    for args, says in [
        (("lease", "req-1", "5"), "wait_seconds must be a whole number of seconds \\(int\\), not str"),
        (("lease", "req-1", True), "wait_seconds must be .*, not bool"),
        (("lease", "req-1", 2.5), "wait_seconds must be .*, not float"),
        ((b"lease", "req-1", 0), "lease must be a str, not bytes"),
        (("lease", ["req-1"], 0), "request_id must be a str, not list"),
    ]:
        with pytest.raises(TypeError, match=says):
            check_dispatch(*args)
