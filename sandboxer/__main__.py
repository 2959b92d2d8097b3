"""Entry point of the `sandboxer` console script and `python -m sandboxer`.

The caller's hot paths are dispatched before the owner CLI is imported: `exec` to
sandboxer.fastexec, the other caller commands to sandboxer.callercli. typer, ruamel.yaml and
pyroute2 together cost more start-up time than joining a namespace does.
"""

from __future__ import annotations

import sys


def _command_of(argv: list[str]) -> str | None:
    """The command word after the global options (which take a value unless written NAME=VALUE)."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--config-dir", "--state-dir"):
            i += 2
        elif arg.startswith(("--config-dir=", "--state-dir=")) or arg == "--debug":
            i += 1
        else:
            return arg
    return None


def main() -> None:
    """Run the CLI and exit with its status."""
    argv = sys.argv[1:]
    command = _command_of(argv)
    if command == "exec":
        from sandboxer.fastexec import main as run_exec

        sys.exit(run_exec(argv))
    if command in ("create", "inspect", "list", "teardown", "gc", "dispatch-tool", "warm"):
        from sandboxer.callercli import main as run_caller

        sys.exit(run_caller(argv))
    from sandboxer.cli import main as run

    sys.exit(run(argv))


if __name__ == "__main__":
    main()
