"""Entry point of the `sandboxer` console script and `python -m sandboxer`: every command goes to
the one typer table of sandboxer.cli."""

from __future__ import annotations

import sys


def main() -> None:
    """Run the CLI and exit with its status."""
    from sandboxer.cli import main as run

    sys.exit(run())


if __name__ == "__main__":
    main()
