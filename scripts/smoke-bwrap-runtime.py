"""Prove a runtime through the real broker (a thin wrapper over sandboxer.smoke): see `--help`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sandboxer.smoke import main

if __name__ == "__main__":
    sys.exit(main())
