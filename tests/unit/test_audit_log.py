"""The audit log: one JSON line per request, owner-only, rotated by size (the oldest file goes),
never following a link planted at its path."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from sandboxer.service.audit import AuditLog


def _lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _record(log: AuditLog, pid: int) -> None:
    log.record(uid=1000, pid=pid, verb="exec", sandbox="sbx-1", outcome="ok", status=0)


def test_lines_are_owner_only_json_with_the_named_fields(tmp_path: Path) -> None:
    log = AuditLog(str(tmp_path))
    _record(log, 7)
    log.record(uid=0, pid=8, verb="reaped", sandbox="sbx-2", outcome="ok", status=0, kept="/kept/sbx-2")
    path = tmp_path / "audit.log"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    first, second = _lines(path)
    assert sorted(first) == ["outcome", "pid", "sandbox", "status", "time", "uid", "verb"]
    assert (first["uid"], first["pid"], first["verb"], first["sandbox"]) == (1000, 7, "exec", "sbx-1")
    assert second["kept"] == "/kept/sbx-2"


def test_a_full_log_is_rotated_and_the_oldest_goes(tmp_path: Path) -> None:
    log = AuditLog(str(tmp_path), max_bytes=400, keep=2)
    written = list(range(100, 160))  # about 110 bytes a line: many rotations
    for pid in written:
        _record(log, pid)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["audit.log", "audit.log.1", "audit.log.2"]  # keep=2
    kept = [line["pid"] for name in ("audit.log.2", "audit.log.1", "audit.log") for line in _lines(tmp_path / name)]
    assert kept == written[-len(kept) :]  # the newest lines, in order, none lost at a rotation
    for name in ("audit.log.1", "audit.log.2"):  # each rotated as soon as it reached max_bytes
        data = (tmp_path / name).read_bytes()
        last = data.splitlines(keepends=True)[-1]
        assert len(data) >= 400 > len(data) - len(last)


def test_a_link_planted_at_the_logs_path_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("untouched\n")
    (tmp_path / "audit.log").symlink_to(target)
    with pytest.raises(OSError, match="symbolic links"):  # O_NOFOLLOW: ELOOP
        _record(AuditLog(str(tmp_path)), 1)
    assert target.read_text() == "untouched\n"
