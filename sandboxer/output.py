"""Printing results and errors: one JSON document with --json, short human lines without."""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from sandboxer.errors import SandboxerError


def emit_json(document: Any) -> None:
    """Print one JSON document on stdout."""
    sys.stdout.write(json.dumps(document, indent=2) + "\n")


def emit_error(*, kind: str, message: str, as_json: bool) -> None:
    """Report an error: always one `sandboxer:` line on stderr; with --json also an object on stdout."""
    sys.stderr.write(f"sandboxer: {message}\n")
    if as_json:
        emit_json({"error": {"kind": kind, "message": message}})


def print_result(document: dict[str, Any], human: str, as_json: bool) -> None:
    """Print a command's result: the JSON document, or the human text."""
    if as_json:
        emit_json(document)
    elif human:
        sys.stdout.write(human if human.endswith("\n") else human + "\n")


def report_failure(exc: Exception, *, as_json: bool, debug: bool) -> int:
    """Report an error as the contract wants and return its exit status.

    A SandboxerError carries its status and a message fit to show; anything else is a bug,
    reported by type only (its text or a traceback could hold values) unless --debug.
    """

    if debug:
        traceback.print_exception(exc)
    if isinstance(exc, SandboxerError):
        emit_error(kind=exc.kind, message=str(exc), as_json=as_json)
        return exc.exit_status
    emit_error(kind="internal", message=f"internal error ({type(exc).__name__}); rerun with --debug", as_json=as_json)
    return 1


def flatten(value: Any, prefix: str = "") -> list[tuple[str, str]]:
    """Nested data as (dotted.key, text) pairs for human output: a list of objects as key[i].sub,
    a list of plain values on one line, true/false, and "-" for nothing (never a Python repr)."""
    if isinstance(value, dict):
        pairs: list[tuple[str, str]] = []
        for key, item in value.items():
            pairs += flatten(item, f"{prefix}.{key}" if prefix else str(key))
        return pairs
    if isinstance(value, list) and any(isinstance(item, dict | list) for item in value):
        return [pair for i, item in enumerate(value) for pair in flatten(item, f"{prefix}[{i}]")]
    if isinstance(value, list):
        return [(prefix, "[" + ", ".join(_plain(item) for item in value) + "]")]
    return [(prefix, _plain(value))]


def _plain(value: Any) -> str:
    if value is None:
        return "-"
    return str(value).lower() if isinstance(value, bool) else str(value)


def table(rows: Sequence[tuple[str, ...]]) -> str:
    """Rows as columns padded to their widest cell."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)
