"""The access report: one JSON line per connection with exactly the named fields, owner-only,
never following a planted link, rotated by size with one generation kept; no header value of a
forwarded request reaches it."""

from __future__ import annotations

import asyncio
import json
import os
import stat
from pathlib import Path

import pytest

from sandboxer.service.egress.report import Access, AccessLog, Counters
from tests.unit.egress_servers import Holder, exchange, http_upstream, pinned, running_proxy, wait_until


def test_a_line_has_the_named_fields_and_the_file_is_owner_only(tmp_path: Path) -> None:
    log = AccessLog(str(tmp_path / "network.jsonl"))
    log.write(Access(host="pypi.org", port=443, decision="allowed", reason="listed", sent=10, received=20))
    log.write(Access(host="evil.test", port=443, decision="refused", reason="host not listed"))
    path = tmp_path / "network.jsonl"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    first, second = (json.loads(line) for line in path.read_text().splitlines())
    assert sorted(first) == ["decision", "host", "port", "reason", "received", "route", "sent", "time"]
    assert (first["sent"], first["received"], first["route"]) == (10, 20, None)
    assert second["decision"] == "refused"
    assert log.counters() == Counters(allowed=1, refused=1, bytes=30)


def test_the_report_is_rotated_with_one_generation_kept(tmp_path: Path) -> None:
    log = AccessLog(str(tmp_path / "network.jsonl"), max_bytes=1000)
    for port in range(1, 60):
        log.write(Access(host="a.test", port=port, decision="refused", reason="port not listed"))
    assert (tmp_path / "network.jsonl").stat().st_size <= 1000
    assert (tmp_path / "network.jsonl.1").stat().st_size <= 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["network.jsonl", "network.jsonl.1"]
    last = json.loads((tmp_path / "network.jsonl").read_text().splitlines()[-1])
    assert last["port"] == 59


def test_a_link_planted_at_the_path_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("")
    os.symlink(target, tmp_path / "network.jsonl")
    log = AccessLog(str(tmp_path / "network.jsonl"))
    with pytest.raises(OSError, match="symbolic links"):  # ELOOP: O_NOFOLLOW
        log.write(Access(host="a.test", port=1, decision="refused", reason="x"))
    assert target.read_text() == ""


def test_no_header_value_of_a_forwarded_request_is_reported(tmp_path: Path) -> None:
    async def scenario() -> list[bytes]:
        async with http_upstream() as upstream:
            holder = Holder(pinned("web.test", upstream.port))
            async with running_proxy(holder, tmp_path / "network.jsonl") as (_, port):
                authority = f"web.test:{upstream.port}"
                request = (
                    f"GET http://{authority}/path-s3cr3t-canary HTTP/1.1\r\nHost: {authority}\r\n"
                    "X-Canary: s3cr3t-canary\r\nAuthorization: Bearer s3cr3t-canary\r\n\r\n"
                )
                answer = await exchange(port, request.encode())
                assert answer.startswith(b"HTTP/1.1 200 ")
                await wait_until((tmp_path / "network.jsonl").exists)
                return upstream.seen

    (seen,) = asyncio.run(scenario())
    assert b"x-canary: s3cr3t-canary" in seen.lower()  # it was forwarded: the canary could have leaked
    assert "s3cr3t-canary" not in (tmp_path / "network.jsonl").read_text()
