"""Entry point of the `sandboxer` console script and `python -m sandboxer`.

The caller's hot paths are dispatched before the owner CLI is imported: `exec` to
sandboxer.fastexec, the other caller commands to sandboxer.callercli. typer, ruamel.yaml and
pyroute2 together cost more start-up time than joining a namespace does.
"""

from __future__ import annotations

import sys


def main() -> None:
    """Run the CLI and exit with its status."""
    argv = sys.argv[1:]
    from sandboxer.callercli import command_of

    command = command_of(argv)
    if command is None and "exec" in argv:
        from sandboxer.fastexec import is_exec

        if is_exec(argv):
            from sandboxer.fastexec import main as run_exec

            sys.exit(run_exec(argv))
    if command is not None:
        from sandboxer.callercli import main as run_caller

        sys.exit(run_caller(argv))
    from sandboxer.cli import main as run

    sys.exit(run(argv))


if __name__ == "__main__":
    main()
