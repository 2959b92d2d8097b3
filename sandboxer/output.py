"""Printing results and errors: one JSON document with --json, short human lines without."""

from __future__ import annotations

import json
import sys
from typing import Any


def emit_json(document: Any) -> None:
    """Print one JSON document on stdout."""
    sys.stdout.write(json.dumps(document, indent=2) + "\n")


def emit_error(*, kind: str, message: str, as_json: bool) -> None:
    """Report an error: always one `sandboxer:` line on stderr; with --json also an object on stdout."""
    sys.stderr.write(f"sandboxer: {message}\n")
    if as_json:
        emit_json({"error": {"kind": kind, "message": message}})
