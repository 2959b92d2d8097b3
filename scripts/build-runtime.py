"""Build a runtime from sources (a thin wrapper over sandboxer.build): see `--help`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sandboxer.build import main

if __name__ == "__main__":
    sys.exit(main())
