"""Requests a proxy must not guess at are refused with a status and reported, and reach no
upstream: framing that two parsers could read differently, a Host that disagrees with the
target, oversized heads, garbage, requests that name no target."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import h11
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandboxer.service.egress.heads import MAX_HEAD, HttpPeer, Refusal, Target, request_target, split_authority
from tests.unit.egress_servers import (
    Holder,
    exchange,
    http_upstream,
    pinned,
    report_lines,
    report_text,
    running_proxy,
    wait_until,
)

CANARY = "X-Canary: s3cr3t-canary\r\n"


def _refused(tmp_path: Path, request: str | bytes) -> tuple[bytes, dict[str, object], list[bytes]]:
    """Send `request` (with {port} filled in) through a proxy allowing web.test at the upstream's
    port; the answer, the report's line, and what the upstream saw."""

    async def scenario() -> tuple[bytes, list[bytes]]:
        async with http_upstream() as upstream:
            holder = Holder(pinned("web.test", upstream.port))
            async with running_proxy(holder, tmp_path) as (_, port):
                data = request.replace("{port}", str(upstream.port)).encode() if isinstance(request, str) else request
                answer = await exchange(port, data)
                await wait_until(lambda: report_lines(tmp_path))
                return answer, upstream.seen

    answer, seen = asyncio.run(scenario())
    text = report_text(tmp_path)
    assert "s3cr3t-canary" not in text
    (line,) = [json.loads(item) for item in text.splitlines()]
    assert line["decision"] == "refused"
    return answer, line, seen


@pytest.mark.parametrize(
    ("request_text", "status", "reason"),
    [
        (
            "POST http://web.test:{port}/ HTTP/1.1\r\nHost: web.test:{port}\r\nTransfer-Encoding: chunked\r\n"
            "Content-Length: 4\r\n" + CANARY + "\r\n0\r\n\r\n",
            400,
            "Transfer-Encoding with Content-Length",
        ),
        (
            "GET http://web.test:{port}/ HTTP/1.1\r\nHost: web.test:{port}\r\nHost: evil.test\r\n" + CANARY + "\r\n",
            400,
            "two Host headers",
        ),
        (
            "GET http://web.test:{port}/ HTTP/1.0\r\nHost: web.test:{port}\r\nHost: evil.test\r\n\r\n",
            400,
            "two Host headers",
        ),
        (
            "GET http://web.test:{port}/ HTTP/1.1\r\nHost: evil.test\r\n" + CANARY + "\r\n",
            400,
            "absolute URI disagrees with Host",
        ),
        ("GET http://web.test:{port}/ HTTP/1.1\r\nHost: web.test\r\n\r\n", 400, "absolute URI disagrees with Host"),
        ("GET /index.html HTTP/1.1\r\nHost: web.test:{port}\r\n\r\n", 400, "no proxy target (origin-form request)"),
        ("CONNECT web.test:{port} HTTP/1.1\r\nHost: evil.test:443\r\n\r\n", 400, "CONNECT target disagrees with Host"),
        ("CONNECT web.test HTTP/1.1\r\nHost: web.test\r\n\r\n", 400, "no port in authority"),
        ("GET http://user@web.test:{port}/ HTTP/1.1\r\nHost: web.test:{port}\r\n\r\n", 400, "userinfo in authority"),
        (
            "GET https://web.test:{port}/ HTTP/1.1\r\nHost: web.test:{port}\r\n\r\n",
            400,
            "only http:// URIs are forwarded; use CONNECT for TLS",
        ),
        ("\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03garbage\r\n\r\n", 400, "malformed request"),
        (
            "GET http://web.test:{port}/ HTTP/1.1\r\nHost: web.test:{port}\r\nBad Header: x\r\n\r\n",
            400,
            "malformed request",
        ),
    ],
)
def test_ambiguous_requests_are_refused(tmp_path: Path, request_text: str, status: int, reason: str) -> None:
    answer, line, seen = _refused(tmp_path, request_text)
    assert answer.startswith(f"HTTP/1.1 {status} ".encode())
    assert line["reason"] == reason
    assert seen == []
    assert b"s3cr3t-canary" not in answer


def test_a_header_block_over_16_kib_is_refused(tmp_path: Path) -> None:
    padding = "".join(f"X-Pad-{i}: {'a' * 100}\r\n" for i in range(170))
    answer, line, seen = _refused(
        tmp_path, "GET http://web.test:{port}/ HTTP/1.1\r\nHost: web.test:{port}\r\n" + padding
    )
    assert answer.startswith(b"HTTP/1.1 431 ")
    assert line["reason"] == "header block too large"
    assert seen == []


def test_a_second_request_before_the_tunnel_is_refused(tmp_path: Path) -> None:
    pipelined = (
        "CONNECT web.test:{port} HTTP/1.1\r\nHost: web.test:{port}\r\n\r\nGET http://evil.test/ HTTP/1.1\r\n\r\n"
    )
    answer, line, seen = _refused(tmp_path, pipelined)
    assert answer.startswith(b"HTTP/1.1 400 ")
    assert line["reason"] == "data before the tunnel was established"
    assert seen == []


@pytest.mark.parametrize(
    ("text", "default", "expected"),
    [
        ("a.test:443", None, ("a.test", 443)),
        ("a.test", 80, ("a.test", 80)),
        ("[::1]:8443", None, ("[::1]", 8443)),
        ("[::1]", 80, ("[::1]", 80)),
    ],
)
def test_authorities(text: str, default: int | None, expected: tuple[str, int]) -> None:
    assert split_authority(text, default_port=default) == expected


@pytest.mark.parametrize(
    "text",
    ["a.test:", "a.test:0", "a.test:65536", "a.test:+1", "a.test:1:2", "::1:443", "[::1", "[::1]x", ":443", "a.test:٣"],
)
def test_malformed_authorities(text: str) -> None:
    with pytest.raises(Refusal):
        split_authority(text, default_port=80)


HEAD_PARTS = st.sampled_from(
    [
        b"GET ",
        b"CONNECT ",
        b"POST ",
        b"http://web.test",
        b"web.test:443",
        b"/x",
        b" HTTP/1.1\r\n",
        b" HTTP/1.0\r\n",
        b"Host: web.test\r\n",
        b"Host: evil.test:80\r\n",
        b"Transfer-Encoding: chunked\r\n",
        b"Content-Length: 3\r\n",
        b"X-Canary: s3cr3t-canary\r\n",
        b"\r\n",
        b":",
        b" ",
        b"\x00",
    ]
)


def _outcome(data: bytes) -> object:
    async def parse() -> object:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        peer = HttpPeer(reader, None, h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD), lambda _: None)  # type: ignore[arg-type]
        try:
            event = await peer.next_event()
            return request_target(event) if isinstance(event, h11.Request) else event
        except Refusal as refusal:
            return refusal

    return asyncio.run(parse())


@settings(max_examples=200, deadline=None)
@given(st.lists(HEAD_PARTS, max_size=12).map(b"".join) | st.binary(max_size=200))
def test_any_head_is_a_target_or_a_refusal_that_quotes_nothing(data: bytes) -> None:
    outcome = _outcome(data)
    if isinstance(outcome, Refusal):
        assert "canary" not in outcome.reason
        assert 400 <= outcome.status < 600
    elif isinstance(outcome, Target):
        assert outcome.host
        assert 0 < outcome.port < 65536
    else:
        assert isinstance(outcome, h11.ConnectionClosed)
