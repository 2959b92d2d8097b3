"""Credential routes: a CONNECT to a routed host is terminated with the sandbox's CA, each request
gets the route's header with the secret (the client sent only the placeholder) and goes to the
real upstream over verified TLS; the secret is in no report line and no answer; expiry and
revocation refuse the next request."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import ssl
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import h11
import pytest
import trustme
from cryptography import x509

from sandboxer.core.egress.policy import EgressPolicy, EgressRule, Route
from sandboxer.host.sandbox_ca import SandboxCA
from sandboxer.service.egress.heads import Refusal
from sandboxer.service.egress.proxy import EgressProxy
from sandboxer.service.egress.routes import Tunnel, _check_inner
from tests.unit.egress_servers import (
    WAIT,
    Holder,
    connect_tunnel,
    http_upstream,
    report_lines,
    report_text,
    running_proxy,
    wait_until,
)

HOST = "api.model.test"
SECRET = "s3cr3t-canary-route"


@pytest.fixture(scope="module")
def upstream_ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def sandbox_ca() -> SandboxCA:
    return SandboxCA.create("sbx-test")


def _policy(port: int, secret_file: Path, *, expires_at: float | None = None, routed: bool = True) -> EgressPolicy:
    route = Route(
        name="model",
        host=HOST,
        header="Authorization",
        format="Bearer {secret}",
        secret_file=str(secret_file),
        expires_at=expires_at,
    )
    rule = EgressRule(host=HOST, ports=(port,), addresses=("127.0.0.1",))
    return EgressPolicy(rules=(rule,), routes={"model": route} if routed else {})


def _request(port: int, *, close: bool = False) -> bytes:
    head = f"GET /v1/models HTTP/1.1\r\nHost: {HOST}:{port}\r\nAuthorization: Bearer sandboxer-route:model\r\n"
    return (head + ("Connection: close\r\n" if close else "") + "\r\n").encode()


async def _response(reader: asyncio.StreamReader) -> bytes:
    async with asyncio.timeout(WAIT):
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.lower().split(b"\r\n")
        length = next((int(line.split(b":")[1]) for line in lines if line.startswith(b"content-length:")), 0)
        return head + await reader.readexactly(length)


@dataclass
class Routed:
    """A client's TLS tunnel to the routed host through a running proxy."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    seen: list[bytes]
    holder: Holder
    port: int
    proxy: EgressProxy


@asynccontextmanager
async def _routed_tunnel(
    tmp_path: Path,
    upstream_ca: trustme.CA,
    sandbox_ca: SandboxCA,
    holder_of: object,
    respond: Callable[[bytes], Sequence[bytes]] | None = None,
) -> AsyncIterator[Routed]:
    upstream_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    upstream_ca.issue_cert(HOST).configure_cert(upstream_tls)
    trusting = ssl.create_default_context()
    upstream_ca.configure_trust(trusting)
    async with http_upstream(b"models", tls=upstream_tls, respond=respond) as upstream:
        holder = Holder(holder_of(upstream.port))  # type: ignore[operator]
        options = {"ca": sandbox_ca, "upstream_ssl": trusting}
        async with running_proxy(holder, tmp_path, **options) as (proxy, port):
            reader, writer, head = await connect_tunnel(port, f"{HOST}:{upstream.port}")
            assert head.startswith(b"HTTP/1.1 200 ")
            client = ssl.create_default_context(cadata=sandbox_ca.certificate_pem.decode())
            await writer.start_tls(client, server_hostname=HOST)
            try:
                yield Routed(reader, writer, upstream.seen, holder, upstream.port, proxy)
            finally:
                writer.close()
            await wait_until(lambda: proxy.open_connections == 0)


def _secret(tmp_path: Path) -> Path:
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    return path


def test_the_upstream_gets_the_secret_while_the_client_sent_the_placeholder(
    tmp_path: Path, upstream_ca: trustme.CA, sandbox_ca: SandboxCA
) -> None:
    secret = _secret(tmp_path)

    async def scenario() -> list[bytes]:
        async with _routed_tunnel(tmp_path, upstream_ca, sandbox_ca, lambda p: _policy(p, secret)) as tunnel:
            reader, writer, seen, port = tunnel.reader, tunnel.writer, tunnel.seen, tunnel.port
            for _ in range(2):  # the client's connection is kept alive across requests
                writer.write(_request(port))
                answer = await _response(reader)
                assert answer.startswith(b"HTTP/1.1 200 ")
                assert answer.endswith(b"models")
            return seen

    seen = asyncio.run(scenario())
    assert len(seen) == 2
    for request in seen:
        assert f"authorization: Bearer {SECRET}\r\n".encode() in request.lower().replace(b"bearer", b"Bearer")
        assert b"sandboxer-route:model" not in request
    text = report_text(tmp_path)
    assert SECRET not in text
    (line,) = [json.loads(item) for item in text.splitlines()]
    assert (line["route"], line["decision"], line["host"]) == ("model", "allowed", HOST)


def test_an_expired_route_refuses_the_connect(tmp_path: Path, upstream_ca: trustme.CA, sandbox_ca: SandboxCA) -> None:
    secret = _secret(tmp_path)
    policy = _policy(443, secret, expires_at=time.time() - 1)

    async def scenario() -> bytes:
        async with running_proxy(Holder(policy), tmp_path, ca=sandbox_ca) as (_, port):
            _, writer, head = await connect_tunnel(port, f"{HOST}:443")
            writer.close()
            return head

    assert asyncio.run(scenario()).startswith(b"HTTP/1.1 403 ")
    line = json.loads(report_text(tmp_path))
    assert (line["reason"], line["decision"]) == ("route expired", "refused")


def test_expiry_or_removal_while_the_tunnel_is_open_refuses_the_next_request(
    tmp_path: Path, upstream_ca: trustme.CA, sandbox_ca: SandboxCA
) -> None:
    secret = _secret(tmp_path)

    async def scenario() -> tuple[bytes, bytes]:
        async with _routed_tunnel(tmp_path, upstream_ca, sandbox_ca, lambda p: _policy(p, secret)) as tunnel:
            reader, writer, holder, port = tunnel.reader, tunnel.writer, tunnel.holder, tunnel.port
            holder.policy = _policy(port, secret, expires_at=time.time() - 1)
            writer.write(_request(port))
            expired = await _response(reader)
        async with _routed_tunnel(tmp_path, upstream_ca, sandbox_ca, lambda p: _policy(p, secret)) as tunnel:
            reader, writer, holder, port = tunnel.reader, tunnel.writer, tunnel.holder, tunnel.port
            holder.policy = _policy(port, secret, routed=False)
            writer.write(_request(port))
            removed = await _response(reader)
        return expired, removed

    expired, removed = asyncio.run(scenario())
    assert expired.startswith(b"HTTP/1.1 403 ")
    assert b"route expired" in expired
    assert removed.startswith(b"HTTP/1.1 403 ")
    assert b"route removed" in removed
    text = report_text(tmp_path)
    assert SECRET not in text
    assert [json.loads(line)["reason"] for line in text.splitlines()] == ["route expired", "route removed"]


def test_revoke_check_closes_an_open_routed_tunnel(
    tmp_path: Path, upstream_ca: trustme.CA, sandbox_ca: SandboxCA
) -> None:
    secret = _secret(tmp_path)

    async def scenario() -> None:
        async with _routed_tunnel(tmp_path, upstream_ca, sandbox_ca, lambda p: _policy(p, secret)) as tunnel:
            tunnel.writer.write(_request(tunnel.port))
            assert (await _response(tunnel.reader)).startswith(b"HTTP/1.1 200 ")
            assert tunnel.proxy.revoke_check() == 0
            tunnel.holder.policy = _policy(tunnel.port, secret, routed=False)
            assert tunnel.proxy.revoke_check() == 1
            async with asyncio.timeout(WAIT):
                assert await tunnel.reader.read(-1) == b""

    asyncio.run(scenario())
    line = json.loads(report_text(tmp_path))
    assert (line["decision"], line["reason"]) == ("allowed", "closed: revoked (route removed)")


def test_an_open_routed_tunnel_is_closed_when_its_route_expires(
    tmp_path: Path, upstream_ca: trustme.CA, sandbox_ca: SandboxCA
) -> None:
    secret = _secret(tmp_path)
    expires_at = time.time() + 0.3

    async def scenario() -> None:
        policy_of = lambda p: _policy(p, secret, expires_at=expires_at)  # noqa: E731
        async with _routed_tunnel(tmp_path, upstream_ca, sandbox_ca, policy_of) as tunnel:
            tunnel.writer.write(_request(tunnel.port))
            assert (await _response(tunnel.reader)).startswith(b"HTTP/1.1 200 ")
            async with asyncio.timeout(WAIT):
                assert await tunnel.reader.read(-1) == b""

    asyncio.run(scenario())
    line = json.loads(report_text(tmp_path))
    assert line["reason"] == "closed: revoked (route expired)"


@pytest.mark.parametrize("content", [f"{SECRET}\r\nX-Injected: yes\n", f"{SECRET}\x01\n", "\n"])
def test_a_bad_secret_file_is_reported_by_the_routes_name_only(
    tmp_path: Path, upstream_ca: trustme.CA, sandbox_ca: SandboxCA, content: str
) -> None:
    secret = tmp_path / "secret"
    secret.write_text(content)

    async def scenario() -> bytes:
        async with _routed_tunnel(tmp_path, upstream_ca, sandbox_ca, lambda p: _policy(p, secret)) as tunnel:
            reader, writer, seen, port = tunnel.reader, tunnel.writer, tunnel.seen, tunnel.port
            writer.write(_request(port))
            answer = await _response(reader)
            assert seen == []
            return answer

    answer = asyncio.run(scenario())
    assert answer.startswith(b"HTTP/1.1 502 ")
    assert SECRET.encode() not in answer
    assert SECRET not in report_text(tmp_path)
    assert "route model: secret malformed" in report_text(tmp_path)


def test_an_upstream_the_trust_store_does_not_know_is_refused(
    tmp_path: Path, upstream_ca: trustme.CA, sandbox_ca: SandboxCA
) -> None:
    secret = _secret(tmp_path)
    upstream_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    upstream_ca.issue_cert(HOST).configure_cert(upstream_tls)

    async def scenario() -> bytes:
        async with http_upstream(tls=upstream_tls) as upstream:
            holder = Holder(_policy(upstream.port, secret))
            async with running_proxy(holder, tmp_path, ca=sandbox_ca) as (_, port):
                reader, writer, _ = await connect_tunnel(port, f"{HOST}:{upstream.port}")
                await writer.start_tls(
                    ssl.create_default_context(cadata=sandbox_ca.certificate_pem.decode()), server_hostname=HOST
                )
                writer.write(_request(upstream.port))
                answer = await _response(reader)
                writer.close()
                assert upstream.seen == []
                return answer

    answer = asyncio.run(scenario())
    assert answer.startswith(b"HTTP/1.1 502 ")
    assert b"upstream certificate not trusted" in answer


def test_the_sandbox_ca_signs_leaves_for_routed_hosts_only_as_a_ca_of_path_length_0(sandbox_ca: SandboxCA) -> None:
    constraints = sandbox_ca.certificate.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert (constraints.ca, constraints.path_length) == (True, 0)
    assert sandbox_ca.server_context(HOST) is sandbox_ca.server_context(HOST)
    reloaded = SandboxCA.load(sandbox_ca.certificate_pem, sandbox_ca.key_pem())
    assert reloaded.certificate == sandbox_ca.certificate


def test_plaintext_sent_before_the_tunnel_never_reaches_the_routed_upstream(
    tmp_path: Path, upstream_ca: trustme.CA, sandbox_ca: SandboxCA
) -> None:
    secret = _secret(tmp_path)
    upstream_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    upstream_ca.issue_cert(HOST).configure_cert(upstream_tls)
    trusting = ssl.create_default_context()
    upstream_ca.configure_trust(trusting)

    async def scenario() -> tuple[bytes, list[bytes]]:
        async with http_upstream(tls=upstream_tls) as upstream:
            holder = Holder(_policy(upstream.port, secret))
            options = {"ca": sandbox_ca, "upstream_ssl": trusting}
            async with running_proxy(holder, tmp_path, **options) as (_, port):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                authority = f"{HOST}:{upstream.port}"
                writer.write(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
                await writer.drain()
                writer.write(_request(upstream.port, close=True))  # no TLS: must not pass for its plaintext
                async with asyncio.timeout(WAIT):
                    answer = await reader.read(-1)
                writer.close()
                return answer, upstream.seen

    answer, seen = asyncio.run(scenario())
    assert seen == []
    assert SECRET.encode() not in answer
    assert b"models" not in answer


@pytest.mark.parametrize("method", ["TRACE", "TRACK", "trace"])
def test_an_inner_request_that_would_echo_the_secret_is_refused(method: str) -> None:
    """TRACE (and TRACK) would echo the request, the route's header with it, into the sandbox.
    (Two Host headers never get this far: h11 refuses to parse them.)"""
    hosts, status = [b"api.model.test:443"], 405
    tunnel = Tunnel(host="api.model.test", port=443, recheck=lambda: None, connect=None, session=None)  # type: ignore[arg-type]
    request = h11.Request(method=method, target="/", headers=[("Host", host) for host in hosts], http_version="1.0")
    with pytest.raises(Refusal) as refused:
        _check_inner(request, tunnel)
    assert refused.value.status == status


async def _read_to_end(reader: asyncio.StreamReader) -> bytes:
    """What the client receives until the proxy closes (or cuts) the tunnel."""
    received = b""
    with contextlib.suppress(ConnectionError, ssl.SSLError):
        async with asyncio.timeout(WAIT):
            while data := await reader.read(65536):
                received += data
    return received


def _echo_in_header(request: bytes) -> list[bytes]:
    """An upstream that sends the request's Authorization back in a header."""
    value = next(
        line.split(b":", 1)[1].strip() for line in request.split(b"\r\n") if line.lower().startswith(b"authorization:")
    )
    return [b"HTTP/1.1 200 OK\r\nX-Echo: " + value.upper() + b"\r\nContent-Length: 2\r\n\r\nok"]


def _echo_in_body(request: bytes) -> list[bytes]:
    """An upstream that sends the request head back as its body, in chunks that cut the secret
    in two (each sent on its own)."""
    cut = request.index(SECRET.encode()) + len(SECRET) // 2
    first, second = request[:cut], request[cut:]
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    return [
        head + b"%x\r\n%s\r\n" % (len(first), first),
        b"%x\r\n%s\r\n" % (len(second), second) + b"0\r\n\r\n",
    ]


@pytest.mark.parametrize("respond", [_echo_in_header, _echo_in_body], ids=["header", "body"])
def test_an_upstream_sending_the_secret_back_is_cut_off_before_the_client_sees_it(
    tmp_path: Path, upstream_ca: trustme.CA, sandbox_ca: SandboxCA, respond: Callable[[bytes], list[bytes]]
) -> None:
    secret = _secret(tmp_path)

    async def scenario() -> tuple[bytes, list[bytes]]:
        async with _routed_tunnel(tmp_path, upstream_ca, sandbox_ca, lambda p: _policy(p, secret), respond) as tunnel:
            tunnel.writer.write(_request(tunnel.port))
            return await _read_to_end(tunnel.reader), tunnel.seen

    received, seen = asyncio.run(scenario())
    assert SECRET.encode() in seen[0]  # the upstream had it, and sent it back
    assert SECRET.lower().encode() not in received.lower()
    assert SECRET[: len(SECRET) // 2].encode() in received or respond is _echo_in_header  # the body's first half came
    text = report_text(tmp_path)
    assert SECRET not in text
    # The upstream's bytes had come: the line stays an allowed connection's, closed by the cut.
    assert [(line["decision"], line["reason"]) for line in report_lines(tmp_path)] in (
        [("allowed", "closed: refused (upstream sent the route's secret back)")],
        [("allowed", "closed: upstream sent the route's secret back")],
    )


def _echo_gzipped(request: bytes) -> list[bytes]:
    """An upstream that compresses its echo of the request (as one would when asked to)."""
    body = gzip.compress(request)
    return [b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)]


def test_a_routed_request_asks_for_a_plain_whole_response_and_an_encoded_one_is_cut(
    tmp_path: Path, upstream_ca: trustme.CA, sandbox_ca: SandboxCA
) -> None:
    secret = _secret(tmp_path)

    async def scenario() -> tuple[bytes, list[bytes]]:
        async with _routed_tunnel(
            tmp_path, upstream_ca, sandbox_ca, lambda p: _policy(p, secret), _echo_gzipped
        ) as tunnel:
            head = f"GET /v1 HTTP/1.1\r\nHost: {HOST}:{tunnel.port}\r\nAccept-Encoding: gzip\r\nRange: bytes=0-9\r\n"
            tunnel.writer.write((head + "If-Range: x\r\n\r\n").encode())
            return await _read_to_end(tunnel.reader), tunnel.seen

    received, seen = asyncio.run(scenario())
    asked = seen[0].lower()
    assert b"accept-encoding: identity\r\n" in asked
    assert b"gzip" not in asked
    assert b"range:" not in asked
    assert received.startswith(b"HTTP/1.1 502 ")
    assert [line["reason"] for line in report_lines(tmp_path)] == [
        "closed: refused (upstream sent an encoded response to a routed request)"
    ]
