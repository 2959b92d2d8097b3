"""The egress proxy on loopback: CONNECT tunnels and plain HTTP reach allowed upstreams (pinned
to 127.0.0.1 by the rule's `addresses`), everything else is refused with a status and a line in
the access report; limits and revocation close what they must."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from collections.abc import Sequence
from pathlib import Path

import pytest

from sandboxer.core.egress.policy import EgressPolicy, EgressRule
from sandboxer.service.egress.admission import LINGERING, Pace
from sandboxer.service.egress.proxy import RESOLVING, EgressProxy, Streams
from tests.unit.egress_servers import (
    WAIT,
    Holder,
    access_log,
    connect_tunnel,
    echo_upstream,
    exchange,
    http_upstream,
    loopback_resolver,
    pinned,
    report_lines,
    running_proxy,
    wait_until,
)


def test_connect_to_an_allowed_name_reaches_the_upstream_and_counts_bytes(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with echo_upstream() as upstream:
            holder = Holder(pinned("echo.test", upstream.port))
            async with running_proxy(holder, tmp_path) as (_, port):
                reader, writer, head = await connect_tunnel(port, f"echo.test:{upstream.port}")
                assert head.startswith(b"HTTP/1.1 200 Connection established\r\n")
                writer.write(b"ping" * 100)
                writer.write_eof()
                async with asyncio.timeout(WAIT):
                    assert await reader.read(-1) == b"ping" * 100
                writer.close()
                await wait_until(lambda: report_lines(tmp_path))

    asyncio.run(scenario())
    (line,) = report_lines(tmp_path)
    assert (line["host"], line["decision"], line["reason"], line["route"]) == ("echo.test", "allowed", "listed", None)
    assert line["received"] == 400
    assert 400 < int(line["sent"]) < 500  # the CONNECT head and the payload
    assert str(line["time"]).endswith("Z")


def _refused(tmp_path: Path, holder: Holder, request: bytes, **options: object) -> tuple[bytes, dict[str, object]]:
    async def scenario() -> bytes:
        async with running_proxy(holder, tmp_path, **options) as (_, port):
            answer = await exchange(port, request)
            await wait_until(lambda: report_lines(tmp_path))
            return answer

    answer = asyncio.run(scenario())
    (line,) = report_lines(tmp_path)
    assert line["decision"] == "refused"
    return answer, line


def _connect(authority: str) -> bytes:
    return f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode()


def test_a_name_not_listed_is_refused(tmp_path: Path) -> None:
    answer, line = _refused(tmp_path, Holder(pinned("echo.test", 443)), _connect("other.test:443"))
    assert answer.startswith(b"HTTP/1.1 403 ")
    assert (line["host"], line["port"], line["reason"]) == ("other.test", 443, "host not listed")


def test_an_ip_literal_is_refused(tmp_path: Path) -> None:
    answer, line = _refused(tmp_path, Holder(pinned("echo.test", 443)), _connect("127.0.0.2:443"))
    assert answer.startswith(b"HTTP/1.1 403 ")
    assert line["reason"] == "IP literal not listed"


def test_an_obfuscated_ip_literal_is_refused(tmp_path: Path) -> None:
    answer, line = _refused(tmp_path, Holder(pinned("echo.test", 443)), _connect("0x7f.1:443"))
    assert answer.startswith(b"HTTP/1.1 403 ")
    assert line["reason"] == "non-canonical IP literal"


def test_an_allowed_name_on_another_port_is_refused(tmp_path: Path) -> None:
    answer, line = _refused(tmp_path, Holder(pinned("echo.test", 443)), _connect("echo.test:8443"))
    assert answer.startswith(b"HTTP/1.1 403 ")
    assert line["reason"] == "port not listed"


def test_a_name_resolving_to_loopback_without_the_explicit_address_is_refused(tmp_path: Path) -> None:
    holder = Holder(EgressPolicy(rules=(EgressRule(host="rebind.test", ports=(443,)),)))
    answer, line = _refused(tmp_path, holder, _connect("rebind.test:443"), resolver=loopback_resolver)
    assert answer.startswith(b"HTTP/1.1 403 ")
    assert line["reason"] == "loopback address not listed"  # the class, never the address


def test_plain_http_is_forwarded_in_origin_form(tmp_path: Path) -> None:
    async def scenario() -> bytes:
        async with http_upstream(b"hello") as upstream:
            holder = Holder(pinned("web.test", upstream.port))
            async with running_proxy(holder, tmp_path) as (_, port):
                authority = f"web.test:{upstream.port}"
                request = f"GET http://{authority}/simple/?q=1 HTTP/1.1\r\nHost: {authority}\r\n"
                answer = await exchange(port, request.encode() + b"Proxy-Connection: keep-alive\r\n\r\n")
                (seen,) = upstream.seen
                assert seen.startswith(b"GET /simple/?q=1 HTTP/1.1\r\n")
                assert b"proxy-connection" not in seen.lower()
                assert b"connection: close" in seen.lower()
                await wait_until(lambda: report_lines(tmp_path))
                return answer

    answer = asyncio.run(scenario())
    assert answer.startswith(b"HTTP/1.1 200 ")
    assert answer.endswith(b"\r\n\r\nhello")
    (line,) = report_lines(tmp_path)
    assert (line["decision"], line["host"]) == ("allowed", "web.test")
    assert int(line["received"]) > 5


def test_an_upstream_that_is_down_answers_502(tmp_path: Path) -> None:
    answer, line = _refused(tmp_path, Holder(pinned("down.test", 1)), _connect("down.test:1"))
    assert answer.startswith(b"HTTP/1.1 502 ")
    assert line["reason"] == "upstream unreachable"


def test_connections_past_the_limit_are_refused(tmp_path: Path) -> None:
    async def scenario() -> bytes:
        async with echo_upstream() as upstream:
            holder = Holder(pinned("echo.test", upstream.port, connections=1))
            async with running_proxy(holder, tmp_path) as (proxy, port):
                _, writer, head = await connect_tunnel(port, f"echo.test:{upstream.port}")
                assert b" 200 " in head
                answer = await exchange(port, _connect(f"echo.test:{upstream.port}"))
                await wait_until(lambda: proxy.open_connections == 1)
                writer.close()
                return answer

    answer = asyncio.run(scenario())
    assert answer.startswith(b"HTTP/1.1 503 ")
    assert [line["reason"] for line in report_lines(tmp_path) if line["decision"] == "refused"] == ["connection limit"]


def test_the_byte_limit_closes_the_tunnel_and_refuses_further_connections(tmp_path: Path) -> None:
    async def scenario() -> bytes:
        async with echo_upstream() as upstream:
            holder = Holder(pinned("echo.test", upstream.port, mib=1))
            async with running_proxy(holder, tmp_path) as (_, port):
                reader, writer, _ = await connect_tunnel(port, f"echo.test:{upstream.port}")
                writer.write(b"x" * (1024 * 1024))
                echoed = 0
                with contextlib.suppress(ConnectionResetError):  # closed with our bytes unread
                    async with asyncio.timeout(WAIT):
                        while data := await reader.read(65536):
                            echoed += len(data)
                assert echoed < 1024 * 1024
                writer.close()
                return await exchange(port, _connect(f"echo.test:{upstream.port}"))

    answer = asyncio.run(scenario())
    assert answer.startswith(b"HTTP/1.1 429 ")
    first, second = report_lines(tmp_path)
    assert first["reason"] == "closed: byte limit"
    assert second["reason"] == "byte limit"


def test_each_connection_has_its_time_limit(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with echo_upstream() as upstream:
            holder = Holder(pinned("echo.test", upstream.port, seconds=0.3))
            async with running_proxy(holder, tmp_path) as (_, port):
                reader, writer, _ = await connect_tunnel(port, f"echo.test:{upstream.port}")
                async with asyncio.timeout(WAIT):
                    assert await reader.read(-1) == b""
                writer.close()

    asyncio.run(scenario())
    assert report_lines(tmp_path)[0]["reason"] == "closed: time limit"


def test_a_revoked_rule_refuses_the_next_request_and_closes_open_tunnels(tmp_path: Path) -> None:
    async def scenario() -> bytes:
        async with echo_upstream() as upstream:
            holder = Holder(pinned("echo.test", upstream.port))
            async with running_proxy(holder, tmp_path) as (proxy, port):
                reader, writer, _ = await connect_tunnel(port, f"echo.test:{upstream.port}")
                assert proxy.revoke_check() == 0
                holder.policy = EgressPolicy(rules=())
                answer = await exchange(port, _connect(f"echo.test:{upstream.port}"))
                assert proxy.revoke_check() == 1
                async with asyncio.timeout(WAIT):
                    assert await reader.read(-1) == b""
                writer.close()
                await wait_until(lambda: len(report_lines(tmp_path)) == 2)
                return answer

    answer = asyncio.run(scenario())
    assert answer.startswith(b"HTTP/1.1 403 ")
    assert sorted((line["decision"], line["reason"]) for line in report_lines(tmp_path)) == [
        ("allowed", "closed: revoked (host not listed)"),
        ("refused", "host not listed"),
    ]


def test_the_policy_is_asked_for_every_connection(tmp_path: Path) -> None:
    holder = Holder(pinned("echo.test", 443))

    async def scenario() -> None:
        async with running_proxy(holder, tmp_path) as (_, port):
            for _ in range(3):
                await exchange(port, _connect("other.test:443"))

    asyncio.run(scenario())
    assert holder.asked == 6  # when each connection is accepted, and again once its head is read


def test_a_connection_opened_before_a_revocation_is_refused_when_it_asks(tmp_path: Path) -> None:
    """Sandboxed code may open connections ahead and send their heads later: the decision is
    made with the policy as it is when the head arrives, not when the connection was accepted."""

    async def scenario() -> bytes:
        async with echo_upstream() as upstream:
            holder = Holder(pinned("echo.test", upstream.port))
            async with running_proxy(holder, tmp_path) as (_, port):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                await wait_until(lambda: holder.asked >= 1)  # accepted under the old policy
                holder.policy = EgressPolicy(rules=())  # the owner revokes
                writer.write(_connect(f"echo.test:{upstream.port}"))
                await writer.drain()
                async with asyncio.timeout(5):
                    answer = await reader.read(-1)
                writer.close()
                return answer

    assert asyncio.run(scenario()).startswith(b"HTTP/1.1 403")


def test_an_unreadable_policy_refuses_everything_and_closes_open_tunnels(tmp_path: Path) -> None:
    async def scenario() -> bytes:
        async with echo_upstream() as upstream:
            holder = Holder(pinned("echo.test", upstream.port))
            async with running_proxy(holder, tmp_path) as (proxy, port):
                reader, writer, _ = await connect_tunnel(port, f"echo.test:{upstream.port}")

                def broken() -> EgressPolicy:
                    raise OSError("approved files unreadable")

                proxy.policy_source = broken
                answer = await exchange(port, _connect(f"echo.test:{upstream.port}"))
                assert proxy.revoke_check() == 1
                async with asyncio.timeout(WAIT):
                    assert await reader.read(-1) == b""
                writer.close()
                await wait_until(lambda: len(report_lines(tmp_path)) == 2)
                return answer

    answer = asyncio.run(scenario())
    assert answer.startswith(b"HTTP/1.1 503 ")
    assert sorted(line["reason"] for line in report_lines(tmp_path)) == [
        "closed: revoked (host not listed)",
        "policy unavailable",
    ]


def test_closing_the_proxy_closes_and_reports_open_tunnels(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with echo_upstream() as upstream:
            holder = Holder(pinned("echo.test", upstream.port))
            async with running_proxy(holder, tmp_path) as (proxy, port):
                reader, writer, _ = await connect_tunnel(port, f"echo.test:{upstream.port}")
                await proxy.close()
                async with asyncio.timeout(WAIT):
                    assert await reader.read(-1) == b""
                writer.close()

    asyncio.run(scenario())
    assert report_lines(tmp_path)[0]["reason"] == "closed: proxy stopped"


def test_a_request_body_is_forwarded_and_expect_continue_answered(tmp_path: Path) -> None:
    async def scenario() -> tuple[bytes, bytes]:
        async with http_upstream(b"stored") as upstream:
            holder = Holder(pinned("web.test", upstream.port))
            async with running_proxy(holder, tmp_path) as (_, port):
                authority = f"web.test:{upstream.port}"
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(
                    f"PUT http://{authority}/upload HTTP/1.1\r\nHost: {authority}\r\nContent-Length: 7\r\n"
                    "Expect: 100-continue\r\n\r\n".encode()
                )
                async with asyncio.timeout(WAIT):
                    continued = await reader.readuntil(b"\r\n\r\n")
                    writer.write(b"payload")
                    answer = await reader.read(-1)
                writer.close()
                (seen,) = upstream.seen
                assert continued.startswith(b"HTTP/1.1 100 ")
                return answer, seen

    answer, seen = asyncio.run(scenario())
    assert answer.startswith(b"HTTP/1.1 200 ")
    assert answer.endswith(b"stored")
    assert seen.startswith(b"PUT /upload HTTP/1.1\r\n")
    assert seen.endswith(b"\r\n\r\npayload")
    assert b"expect" not in seen.lower()


class _NeverDials(EgressProxy):
    """The proxy with its one way to the network replaced: a test of a refusal that must come
    before any connect fails here instead of dialling an address that is not the test's own."""

    async def _open(self, addresses: Sequence[str], port: int, *, tls_host: str | None = None) -> Streams:
        raise AssertionError(f"the proxy dialled {list(addresses)}")


def test_a_name_that_resolves_to_the_hosts_own_address_is_refused(tmp_path: Path) -> None:
    """A listed name whose DNS answer is one of this host's own (global) addresses would have the
    proxy connect to the host itself: refused unless the rule names that address."""
    own = ipaddress.ip_address("192.0.43.10")  # a global address, never dialled (_NeverDials)

    async def resolves_to_host(host: str, port: int) -> list[str]:
        return [str(own)]

    policy = EgressPolicy(rules=(EgressRule(host="listed.test", ports=(80,)),))

    async def scenario() -> bytes:
        listener = socket.create_server(("127.0.0.1", 0))
        proxy = _NeverDials(lambda: policy, access_log(tmp_path), resolver=resolves_to_host, host_addresses={own})
        await proxy.start(listener)
        try:
            return await exchange(listener.getsockname()[1], _connect("listed.test:80"))
        finally:
            await proxy.close()

    assert asyncio.run(scenario()).startswith(b"HTTP/1.1 403")
    line = report_lines(tmp_path)[-1]
    assert line["reason"] == "the host's own address not listed"


def test_one_sandbox_runs_few_lookups_at_once(tmp_path: Path) -> None:
    """Ten connections to a name that needs the host's resolver: at most RESOLVING lookups run
    at once (they share the service's executor with every other sandbox)."""
    running, most = 0, 0

    async def slow_resolver(host: str, port: int) -> list[str]:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.05)
        running -= 1
        return []  # no answer: refused as unresolved, nothing dialled

    holder = Holder(EgressPolicy(rules=(EgressRule(host="slow.test", ports=(80,)),)))

    async def scenario() -> list[bytes]:
        async with running_proxy(holder, tmp_path, resolver=slow_resolver) as (_, port):
            return await asyncio.gather(*(exchange(port, _connect("slow.test:80")) for _ in range(10)))

    answers = asyncio.run(scenario())
    assert all(answer.startswith(b"HTTP/1.1 502") for answer in answers)
    assert most == RESOLVING


def test_a_flood_past_the_connection_limit_is_turned_away_cheaply_and_counted(tmp_path: Path) -> None:
    flood = 90  # within the accept burst: none waits for the pace

    async def scenario() -> tuple[list[bytes], int]:
        async with echo_upstream() as upstream:
            holder = Holder(pinned("echo.test", upstream.port, connections=1))
            async with running_proxy(holder, tmp_path) as (proxy, port):
                _, writer, head = await connect_tunnel(port, f"echo.test:{upstream.port}")
                assert b" 200 " in head
                peak = 0

                async def one() -> bytes:
                    nonlocal peak
                    try:
                        answer = await exchange(port, _connect(f"echo.test:{upstream.port}"))
                    except ConnectionResetError:  # closed at once: the reset may overtake the answer
                        answer = b"reset"
                    peak = max(peak, proxy.turn_away.lingering, proxy.open_connections)
                    return answer

                answers = await asyncio.gather(*(one() for _ in range(flood)))
                assert proxy.open_connections == 1
                writer.close()
        return answers, peak

    answers, peak = asyncio.run(scenario())
    assert all(answer == b"reset" or answer.startswith(b"HTTP/1.1 503 ") for answer in answers)
    assert sum(answer.startswith(b"HTTP/1.1 503 ") for answer in answers) >= LINGERING
    assert peak <= LINGERING
    lines = report_lines(tmp_path)
    refused = [line for line in lines if line["decision"] == "refused"]
    assert {line["reason"] for line in refused} == {"connection limit"}
    assert sum(int(line["count"]) for line in refused) == flood
    assert len(refused) == 2  # the first, then one line counting the rest
    assert [line["host"] for line in lines if line["decision"] == "allowed"] == ["echo.test"]


def test_new_connections_are_paced() -> None:
    now = [0.0]
    pace = Pace(rate=10, burst=3, clock=lambda: now[0])
    assert [pace.delay() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert pace.delay() == pytest.approx(0.1)
    now[0] += 0.1
    assert pace.delay() == 0.0
    now[0] += 10  # a quiet spell refills no more than the burst
    assert [pace.delay() for _ in range(4)][-1] == pytest.approx(0.1)
