"""The audit log: one JSON line per request, owner-only, rotated by size (the oldest file goes, and
a line says whose requests it held), never following a link planted at its path; refusals of one
account past its rate are counted in one line per interval, not written one by one."""

from __future__ import annotations

import json
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from sandboxer.service.audit import AuditLog, RefusalLimiter


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
    lines = [line for name in ("audit.log.2", "audit.log.1", "audit.log") for line in _lines(tmp_path / name)]
    kept = [line["pid"] for line in lines if line["verb"] != "dropped"]
    assert kept == written[-len(kept) :]  # the newest lines, in order, none lost at a rotation
    # What rotation dropped is counted, by account, in the summary lines that remain.
    dropped = [line["dropped"] for line in lines if line["verb"] == "dropped"]
    assert sum(summary["1000"]["requests"] for summary in dropped) == len(written) - len(kept)
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


def _clock() -> tuple[list[float], Callable[[], float]]:
    now = [1000.0]
    return now, lambda: now[0]


def test_refusals_past_an_accounts_rate_are_counted_in_one_line_per_interval(tmp_path: Path) -> None:
    now, clock = _clock()
    log = AuditLog(str(tmp_path), exempt=(0,), burst=5, rate=1.0, summary_seconds=60, clock=clock)
    for pid in range(1000):  # one account's flood of refusals, all in one instant
        log.record(uid=1001, pid=pid, verb="refused", sandbox=None, outcome="PolicyError", status=3)
    log.record(uid=1002, pid=1, verb="list", sandbox=None, outcome="PolicyError", status=3)  # another's: its own rate
    log.record(uid=1001, pid=2, verb="create", sandbox="a" * 24, outcome="ok", status=0)  # a success: always
    for pid in range(20):  # the owners' refusals are never held back
        log.record(uid=0, pid=pid, verb="inspect", sandbox=None, outcome="NotFoundError", status=4)
    lines = _lines(tmp_path / "audit.log")
    assert [line["uid"] for line in lines] == [1001] * 5 + [1002, 1001] + [0] * 20
    now[0] += 59
    log.flush()
    assert len(_lines(tmp_path / "audit.log")) == len(lines)  # the interval is not over yet
    now[0] += 1
    log.flush()
    summary = _lines(tmp_path / "audit.log")[len(lines) :]
    assert summary == [
        {
            "time": summary[0]["time"],
            "uid": 1001,
            "pid": None,
            "verb": "refused",
            "sandbox": None,
            "outcome": "PolicyError",
            "status": 3,
            "suppressed": 995,
            "since": summary[0]["since"],  # the first suppressed one's time
        }
    ]
    assert lines[4]["time"] <= summary[0]["since"] <= summary[0]["time"]
    for pid in range(6):  # the bucket refilled meanwhile, up to its burst: five are written, one counted
        log.record(uid=1001, pid=pid, verb="refused", sandbox=None, outcome="PolicyError", status=3)
    log.flush(everything=True)  # the service stops: whatever is counted is written
    tail = _lines(tmp_path / "audit.log")[len(lines) + 1 :]
    assert [line.get("suppressed") for line in tail] == [None] * 5 + [1]


def test_a_flood_never_rotates_another_accounts_record_away_unnamed(tmp_path: Path) -> None:
    log = AuditLog(str(tmp_path), max_bytes=2000, keep=2, exempt=(0,))
    log.record(uid=1002, pid=7, verb="create", sandbox="b" * 24, outcome="ok", status=0)  # before the flood
    for pid in range(3000):  # refusals: held to the rate
        log.record(uid=1001, pid=pid, verb="refused", sandbox=None, outcome="PolicyError", status=3)
    for pid in range(300):  # successes: all written, and they rotate everything before them out
        log.record(uid=1001, pid=pid, verb="list", sandbox=None, outcome="ok", status=0)
    log.flush(everything=True)
    files = sorted(tmp_path.iterdir())
    assert [p.name for p in files] == ["audit.log", "audit.log.1", "audit.log.2"]
    assert sum(p.stat().st_size for p in files) < 3 * 2000 + 3000  # bounded: three files of about max_bytes
    lines = [line for p in files for line in _lines(p)]
    assert not any(line["uid"] == 1002 for line in lines)  # the record itself is gone...
    named = [line["dropped"]["1002"] for line in lines if line["verb"] == "dropped" and "1002" in line["dropped"]]
    assert named == [
        {
            "requests": 1,
            "from": named[0]["from"],
            "to": named[0]["to"],
            "verbs": {"create ok": 1},
            "created": ["b" * 24],
            "created_more": 0,
        }
    ]  # ...and a summary line names it, carried from file to file
    flooder = sum(line["dropped"]["1001"]["requests"] for line in lines if line["verb"] == "dropped")
    flooder += sum(line.get("suppressed", 1) for line in lines if line["uid"] == 1001)
    assert flooder == 3300  # every request of the flood is counted, once


def test_the_limiter_refills_at_its_rate_per_account() -> None:
    now, clock = _clock()
    limiter = RefusalLimiter(burst=3, rate=0.5, clock=clock)
    assert [limiter.allow(1) for _ in range(4)] == [True, True, True, False]
    assert limiter.allow(2)  # another account has a bucket of its own
    now[0] += 1.9
    assert not limiter.allow(1)  # less than one token back
    now[0] += 0.1
    assert limiter.allow(1)
    now[0] += 1000
    assert [limiter.allow(1) for _ in range(4)] == [True, True, True, False]  # never more than the burst
