"""The one command table through the real CLI: --version, --help naming every command, every
command's and subcommand's own --help, and exec's usage errors (one line, status 125)."""

from __future__ import annotations

import typer
from typer.core import TyperGroup

import sandboxer
from sandboxer.cli import app
from tests.conftest import Broker


def _command_paths(group: TyperGroup, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command and subcommand of the table, as the words that name it."""
    paths: list[tuple[str, ...]] = []
    for name, command in group.commands.items():
        paths.append((*prefix, name))
        if isinstance(command, TyperGroup):
            paths += _command_paths(command, (*prefix, name))
    return paths


def _root() -> TyperGroup:
    root = typer.main.get_command(app)
    assert isinstance(root, TyperGroup)
    return root


def _listed(help_text: str) -> list[str]:
    """The command names in the Commands section of a --help."""
    section = help_text.split("\nCommands:\n", 1)[1]
    return [line.split()[0] for line in section.splitlines() if line.startswith("  ") and line[2:3] != " "]


def test_version_prints_the_package_version(broker: Broker) -> None:
    result = broker.run("--version")
    assert result.status == 0, result.stderr
    assert result.stdout == f"sandboxer {sandboxer.__version__}\n"


def test_help_names_every_command(broker: Broker) -> None:
    result = broker.run("--help")
    assert result.status == 0, result.stderr
    root = _root()
    listed = _listed(result.stdout)
    assert sorted(listed) == sorted(root.commands)
    assert len(listed) == len(root.commands)
    callers = ("create", "exec", "inspect", "list", "usage", "work", "extend", "teardown", "gc", "dispatch-tool")
    for caller in (*callers, "warm"):
        assert caller in listed


def test_every_command_and_subcommand_has_help(broker: Broker) -> None:
    paths = _command_paths(_root())
    assert len(paths) > len(_root().commands), "no subcommand found"
    for path in paths:
        result = broker.run(*path, "--help")
        assert result.status == 0, (path, result.stderr)
        assert result.stdout.startswith(f"Usage: sandboxer {' '.join(path)} "), (path, result.stdout)


def test_exec_help_shows_the_command_after_the_separator(broker: Broker) -> None:
    result = broker.run("exec", "--help")
    assert result.status == 0, result.stderr
    assert result.stdout.startswith("Usage: sandboxer exec [OPTIONS] ")
    assert "-- ARGV..." in result.stdout.splitlines()[0]


ID = "0123456789abcdef01234567"


def test_exec_usage_errors_are_one_line_and_status_125(broker: Broker) -> None:
    cases = {
        ("exec",): "exec: put -- before the command: sandboxer exec ID [OPTIONS] -- ARGV...",
        ("exec", ID, "true"): "exec: put -- before the command: sandboxer exec ID [OPTIONS] -- ARGV...",
        ("exec", ID, "--"): "exec: no command after --",
        ("exec", ID, "--bogus", "--", "true"): "exec: no such option: --bogus",
        ("exec", ID, "--cwd"): "exec: put -- before the command: sandboxer exec ID [OPTIONS] -- ARGV...",
        ("exec", ID, "--cwd", "--", "true"): "exec: --cwd needs a value",
        ("exec", "--", "true"): "exec: exactly one sandbox ID is expected before --",
        ("exec", ID, ID, "--", "true"): "exec: exactly one sandbox ID is expected before --",
        ("exec", ID, "--cwd", "relative", "--", "true"): (
            "exec: --cwd must be a normalized absolute path inside the sandbox"
        ),
        ("exec", ID, "--timeout", "soon", "--", "true"): "exec: --timeout must be a number of seconds",
        ("exec", "../x", "--", "true"): "exec: no such sandbox (ids are 24 lowercase hex digits)",
        ("exec", ID, "--", "true"): f"exec: no such sandbox: {ID}",
    }
    for args, message in cases.items():
        result = broker.run(*args)
        assert (result.status, result.stderr, result.stdout) == (125, f"sandboxer: {message}\n", ""), args


def test_options_after_the_separator_belong_to_the_command(broker: Broker) -> None:
    """`--help` or `--json` after `--` is the command's: exec still looks for the sandbox."""
    for option in ("--help", "--json", "-c"):
        result = broker.run("exec", ID, "--", "sh", option)
        assert (result.status, result.stderr) == (125, f"sandboxer: exec: no such sandbox: {ID}\n"), option


def test_caller_usage_errors_are_one_line_and_status_2(broker: Broker) -> None:
    for args in (("create",), ("inspect",), ("teardown",), ("list", "--bogus"), ("gc", "extra"), ("nosuch",)):
        result = broker.run(*args)
        assert result.status == 2, (args, result.stderr)
        assert result.stderr.startswith("sandboxer: "), (args, result.stderr)
        assert result.stderr.count("\n") == 1, (args, result.stderr)
        assert result.stdout == "", args
    result = broker.run("create", "--json")
    assert result.status == 2
    assert result.json()["error"]["kind"] == "usage"
