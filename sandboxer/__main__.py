"""Entry point of the `sandboxer` console script and `python -m sandboxer`: the small client that
hands the command line to the service, or runs it in-process (sandboxer.clients.cli)."""

from __future__ import annotations

from sandboxer.clients.cli import main

if __name__ == "__main__":
    main()
