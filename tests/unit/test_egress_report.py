"""The access report: one JSON line per connection with exactly the named fields, owner-only,
never following a planted link, rotated by size with one generation kept; refusals in a file of
their own (a flood of them never rotates away where the sandbox did connect), repeats counted in
one line; no header value of a forwarded request reaches it."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import time
from pathlib import Path

import pytest

from sandboxer.service.egress import report
from sandboxer.service.egress.report import Access, AccessLog
from tests.unit.egress_servers import (
    Holder,
    access_log,
    exchange,
    http_upstream,
    pinned,
    report_lines,
    report_text,
    running_proxy,
    wait_until,
)

ALLOWED = Access(host="pypi.org", port=443, decision="allowed", reason="listed", sent=10, received=20)


def _refused(host: str = "evil.test", port: int = 443) -> Access:
    return Access(host=host, port=port, decision="refused", reason="host not listed")


def _file(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_line_has_the_named_fields_and_the_files_are_owner_only(tmp_path: Path) -> None:
    log = access_log(tmp_path)
    log.write(ALLOWED)
    log.write(_refused())
    for name in ("network.jsonl", "network-refused.jsonl"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600
    (allowed,) = _file(tmp_path / "network.jsonl")
    (refused,) = _file(tmp_path / "network-refused.jsonl")
    assert sorted(allowed) == ["count", "decision", "host", "port", "reason", "received", "route", "sent", "time"]
    assert (allowed["sent"], allowed["received"], allowed["route"], allowed["count"]) == (10, 20, None, 1)
    assert (refused["decision"], refused["host"]) == ("refused", "evil.test")
    assert [line["decision"] for line in report_lines(tmp_path)] == ["allowed", "refused"]


def test_repeated_refusals_are_written_once_then_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    log = access_log(tmp_path)
    for _ in range(500):
        log.write(_refused())
    log.write(_refused("other.test"))  # another refusal is its own line at once
    assert [line["count"] for line in _file(tmp_path / "network-refused.jsonl")] == [1, 1]
    assert log.flush_due()  # both still counting
    now[0] += report.REPEAT_SECONDS
    assert log.flush_due() is False
    lines = _file(tmp_path / "network-refused.jsonl")
    assert [(line["host"], line["count"]) for line in lines] == [
        ("evil.test", 1),
        ("other.test", 1),
        ("evil.test", 499),
    ]
    log.write(_refused())  # a new window: written at once again
    log.close()
    assert [line["count"] for line in _file(tmp_path / "network-refused.jsonl")][-1] == 1


def test_closing_the_log_writes_the_counts_still_open(tmp_path: Path) -> None:
    log = access_log(tmp_path)
    for _ in range(3):
        log.write(_refused())
    log.close()
    assert [line["count"] for line in report_lines(tmp_path)] == [1, 2]


def test_distinct_refusals_past_the_bound_write_the_oldest_count(tmp_path: Path) -> None:
    log = access_log(tmp_path)
    for _ in range(2):
        log.write(_refused("first.test"))
    for index in range(report.MAX_REPEATING):
        log.write(_refused(f"h{index}.test"))
    hosts = [(line["host"], line["count"]) for line in _file(tmp_path / "network-refused.jsonl")]
    assert ("first.test", 1) in hosts  # the bound reached: the oldest count is written
    log.close()


def test_a_flood_of_refusals_never_rotates_the_allowed_lines_away(tmp_path: Path) -> None:
    log = AccessLog(str(tmp_path / "network.jsonl"), str(tmp_path / "network-refused.jsonl"), max_bytes=1000)
    log.write(ALLOWED)
    for port in range(1, 200):  # each one distinct: none is merged
        log.write(_refused(port=port))
    log.close()
    assert _file(tmp_path / "network.jsonl")[0]["host"] == "pypi.org"
    assert (tmp_path / "network-refused.jsonl").stat().st_size <= 1000
    assert (tmp_path / "network-refused.jsonl.1").stat().st_size <= 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "network-refused.jsonl",
        "network-refused.jsonl.1",
        "network.jsonl",
    ]
    assert _file(tmp_path / "network-refused.jsonl")[-1]["port"] == 199


def test_a_link_planted_at_the_path_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("")
    os.symlink(target, tmp_path / "network-refused.jsonl")
    log = access_log(tmp_path)
    with pytest.raises(OSError, match="symbolic links"):  # ELOOP: O_NOFOLLOW
        log.write(_refused())
    assert target.read_text() == ""


def test_no_header_value_of_a_forwarded_request_is_reported(tmp_path: Path) -> None:
    async def scenario() -> list[bytes]:
        async with http_upstream() as upstream:
            holder = Holder(pinned("web.test", upstream.port))
            async with running_proxy(holder, tmp_path) as (_, port):
                authority = f"web.test:{upstream.port}"
                request = (
                    f"GET http://{authority}/path-s3cr3t-canary HTTP/1.1\r\nHost: {authority}\r\n"
                    "X-Canary: s3cr3t-canary\r\nAuthorization: Bearer s3cr3t-canary\r\n\r\n"
                )
                answer = await exchange(port, request.encode())
                assert answer.startswith(b"HTTP/1.1 200 ")
                await wait_until(lambda: report_lines(tmp_path))
                return upstream.seen

    (seen,) = asyncio.run(scenario())
    assert b"x-canary: s3cr3t-canary" in seen.lower()  # it was forwarded: the canary could have leaked
    assert "s3cr3t-canary" not in report_text(tmp_path)
