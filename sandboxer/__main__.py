"""Entry point of the `sandboxer` console script and `python -m sandboxer`.

`exec` is dispatched before the full CLI is imported: it is the hot path, and typer, ruamel.yaml
and pyroute2 together cost more start-up time than joining a namespace does.
"""

from __future__ import annotations

import sys


def main() -> None:
    """Run the CLI and exit with its status."""
    argv = sys.argv[1:]
    from sandboxer.fastexec import is_exec

    if is_exec(argv):
        from sandboxer.fastexec import main as run_exec

        sys.exit(run_exec(argv))
    from sandboxer.cli import main as run

    sys.exit(run(argv))


if __name__ == "__main__":
    main()
