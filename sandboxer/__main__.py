"""Entry point of the `sandboxer` console script and `python -m sandboxer`: the small client that
hands the command line to the service, or runs it in-process (sandboxer.cliclient)."""

from __future__ import annotations

from sandboxer.cliclient import main

if __name__ == "__main__":
    main()
