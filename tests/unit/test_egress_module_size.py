"""The egress engine stays in small modules (docs/egress.md): each under MAX_LINES, so a reader
finds "where is the address check" or "where is smuggling refused" from the file names alone and
reads it whole."""

from __future__ import annotations

from pathlib import Path

EGRESS = Path(__file__).resolve().parents[2] / "sandboxer" / "service" / "egress"
MAX_LINES = 400


def test_every_egress_module_is_small() -> None:
    sizes = {path.name: len(path.read_text().splitlines()) for path in EGRESS.glob("*.py")}
    assert "proxy.py" in sizes
    assert {name: lines for name, lines in sizes.items() if lines >= MAX_LINES} == {}
