"""The egress proxy of one sandbox: HTTP CONNECT tunnels and plain-HTTP forwarding, enforcing
its policy on every connection and request.

The service makes the listening socket (inside the sandbox's network namespace) and hands it to
`EgressProxy.start`; upstream connections are made by this process, in the host's namespace.
Per client connection: the request head is read with h11 and checked (heads.py), the target
decided (policy.py), the name resolved on the host (or pinned by the rule's `addresses`) and
every address checked (addresses.py), the upstream dialled by address (never by name again: no
second resolution for a rebinding DNS server to answer differently). A CONNECT is answered
`200 Connection established` and spliced both ways; to a host with a credential route it is
terminated with TLS instead (routes.py). A plain `GET http://host/...` is forwarded in
origin-form, one request per client connection. Limits (policy.limits): concurrent client
connections, total bytes both ways, seconds per connection; new connections are paced and those
past a limit turned away cheaply (admission.py). Each connection is one line in the access report
when it ends (repeated refusals counted: report.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Container, Sequence
from typing import Protocol

import h11

from sandboxer.core.egress.addresses import parse_address
from sandboxer.core.egress.policy import Decision, EgressPolicy, Limits, address_allowed, decide
from sandboxer.host.interfaces import HostAddresses
from sandboxer.service.egress.admission import Pace, TurnAway, accept, answer_and_linger, reading, server_streams
from sandboxer.service.egress.exchange import ResponseStarted, relay, upstream_connection, upstream_request
from sandboxer.service.egress.heads import MAX_HEAD, HttpPeer, LimitReached, Refusal, error_response
from sandboxer.service.egress.heads import request_target as read_target
from sandboxer.service.egress.report import REPEAT_SECONDS, Access, AccessLog
from sandboxer.service.egress.routes import Tunnel, serve_routed
from sandboxer.service.egress.session import Allowance, Session
from sandboxer.service.splice import splice

Resolver = Callable[[str, int], Awaitable[Sequence[str]]]
Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]
HEAD_SECONDS = 10.0  # for the request head: a client that says nothing holds a connection slot
CONNECT_SECONDS = 10.0  # resolution and each upstream connect
CLOSE_SECONDS = 1.0  # for a closed connection's last bytes to leave before it is aborted
RESOLVING = 4  # lookups one sandbox's proxy runs at once
ACCEPT_RETRY_SECONDS = 0.1  # after accept failed (no descriptor left): the connection stays queued


NOTHING = EgressPolicy(rules=(), limits=Limits(connections=0, mib=0, seconds=1))
_log = logging.getLogger("sandboxer.service")


class ServerContexts(Protocol):
    """What terminates a routed host's TLS: the sandbox's CA (ca.SandboxCA)."""

    def server_context(self, host: str) -> ssl.SSLContext:
        """A server context presenting a certificate for `host`."""
        ...


async def system_resolver(host: str, port: int) -> list[str]:
    """The host's resolver (getaddrinfo in the loop's executor): the addresses of `host`."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class EgressProxy:
    """One sandbox's proxy: `start` it on a listening socket, `revoke_check` when the owner's files
    change, `close` at the sandbox's end. `policy_source` is asked for every connection and
    request, so a revoked rule refuses the next one."""

    def __init__(
        self,
        policy_source: Callable[[], EgressPolicy],
        report: AccessLog,
        *,
        resolver: Resolver = system_resolver,
        upstream_ssl: ssl.SSLContext | None = None,
        ca: ServerContexts | None = None,
        host_addresses: Container[object] | None = None,
        head_seconds: float = HEAD_SECONDS,
        connect_seconds: float = CONNECT_SECONDS,
    ) -> None:
        self.policy_source = policy_source
        self.report = report
        self.resolver = resolver
        self.upstream_ssl = upstream_ssl if upstream_ssl is not None else ssl.create_default_context()
        self.ca = ca
        self.host_addresses = host_addresses if host_addresses is not None else HostAddresses()
        self.head_seconds = head_seconds
        self.connect_seconds = connect_seconds
        self.allowance = Allowance()
        self.pace = Pace()
        self.turn_away = TurnAway()
        self._flush: asyncio.TimerHandle | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._listener: socket.socket | None = None
        # The host's resolver runs on the service's shared executor: one sandbox's lookups (a slow
        # DNS server, a flood of names) take a few of its threads at most.
        self._resolving = asyncio.Semaphore(RESOLVING)
        self._sessions: set[Session] = set()

    async def start(self, listener: socket.socket) -> None:
        """Serve clients on `listener` (bound and listening; the proxy takes it over)."""
        listener.setblocking(False)
        self._listener = listener
        self._accepting = asyncio.create_task(self._accept(listener))

    async def close(self) -> None:
        """Stop listening and close every open connection (each is reported)."""
        if self._accepting is not None:
            self._accepting.cancel()
            await asyncio.gather(self._accepting, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
        tasks = [s.task for s in self._sessions if s.task is not None]
        for session in self._sessions:
            session.closing = session.closing or "proxy stopped"
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, self.turn_away.close(), return_exceptions=True)
        if self._flush is not None:
            self._flush.cancel()
        with contextlib.suppress(OSError):
            self.report.close()

    def revoke_check(self) -> int:
        """Re-read the policy and close every open connection it no longer allows (a revoked or
        changed rule, an expired or removed route); how many were closed."""
        policy = self._current_policy()
        closed = 0
        for session in list(self._sessions):
            if not session.host or session.decision != "allowed" or session.task is None:
                continue
            decision = decide(policy, session.host, session.port)
            reason = None if decision.allowed else decision.reason
            if reason is None and session.route is not None and decision.route is None:
                reason = "route removed"
            if reason is not None:
                session.closing = f"revoked ({reason})"
                session.task.cancel()
                closed += 1
        return closed

    @property
    def open_connections(self) -> int:
        """Client connections being served now."""
        return len(self._sessions)

    def _current_policy(self) -> EgressPolicy:
        """The policy now; when it cannot be had (the approved files unreadable, say), one that
        allows nothing: the proxy fails closed."""
        try:
            return self.policy_source()
        except Exception:
            _log.exception("egress policy unavailable; refusing everything")
            return NOTHING

    async def _accept(self, listener: socket.socket) -> None:
        """Take connections at the sandbox's pace; serve each, or turn it away past a limit."""
        while True:
            while (wait := self.pace.delay()) > 0:
                await asyncio.sleep(wait)
            try:
                conn = await accept(listener)
            except OSError as exc:
                _log.warning("egress proxy cannot accept: %s", exc.strerror)
                await asyncio.sleep(ACCEPT_RETRY_SECONDS)
                continue
            policy = self._current_policy()
            try:
                _admit(policy, len(self._sessions), self.allowance)
            except Refusal as exc:
                self.turn_away(conn, error_response(exc.status, exc.reason))
                self._record(Access(host="", port=0, decision="refused", reason=exc.reason))
                continue
            session = Session(self.allowance, policy.limits.mib, None)
            self._sessions.add(session)  # counted from now: the next accept sees it
            session.task = asyncio.create_task(self._client(session, policy, conn))
            session.task.add_done_callback(functools.partial(self._ended, conn, session))

    def _ended(self, conn: socket.socket, session: Session, _: object) -> None:
        """A client's task is done (even one cancelled before it ran): its socket is closed."""
        conn.close()
        self._sessions.discard(session)  # counted until its socket is gone

    def _record(self, access: Access) -> None:
        """Write `access` to the report; a refusal may only be counted, so a flush is due."""
        with contextlib.suppress(OSError):  # the report's failure never keeps a socket open
            self.report.write(access)
        if access.decision == "refused" and self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(REPEAT_SECONDS, self._flush_report)

    def _flush_report(self) -> None:
        self._flush = None
        with contextlib.suppress(OSError):
            if self.report.flush_due():
                self._flush = asyncio.get_running_loop().call_later(REPEAT_SECONDS, self._flush_report)

    async def _client(self, session: Session, policy: EgressPolicy, conn: socket.socket) -> None:
        reader, writer = await server_streams(conn, limit=MAX_HEAD * 2)
        try:
            await self._guarded(session, policy, reader, writer)
        finally:
            self._record(session.access())  # before any await: a cancelled close still reports
            writer.close()
            try:
                # A client that does not read holds our write buffer: give it a moment, then drop it.
                async with asyncio.timeout(CLOSE_SECONDS):
                    await writer.wait_closed()
            except TimeoutError:
                writer.transport.abort()
            except Exception:  # noqa: S110 - its end is all that is wanted of it
                pass

    async def _guarded(
        self, session: Session, policy: EgressPolicy, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Serve one connection, turning every way it can end into a reason and, while the
        client has no status line yet, an error answer."""
        try:
            async with asyncio.timeout(policy.limits.seconds):
                await self._serve(session, policy, reader, writer)
        except Refusal as exc:
            session.refuse(exc.reason)
            if not session.answered:
                await answer_and_linger(reader, writer, error_response(exc.status, exc.reason))
        except LimitReached:
            session.end("byte limit")
        except TimeoutError:
            session.end("time limit")
            if not session.answered:
                with contextlib.suppress(OSError, RuntimeError):
                    writer.write(error_response(504, "time limit"))
        except ResponseStarted as exc:
            session.end(str(exc))
        except asyncio.CancelledError:
            if session.closing is None:
                raise
            session.end(session.closing)
        except Exception as exc:  # a failure on either side, or a fault of ours: the connection ends
            session.end(_failure(exc))

    async def _serve(
        self, session: Session, policy: EgressPolicy, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        client = HttpPeer(
            reader, writer, h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD), session.count_sent
        )
        try:
            async with asyncio.timeout(self.head_seconds):
                request = await client.next_event()
        except TimeoutError:
            raise Refusal(408, "no request head in time") from None
        if not isinstance(request, h11.Request):
            raise Refusal(400, "closed before a request")
        target = read_target(request)
        session.host, session.port = target.host, target.port
        # The policy as it is now, not as it was when the connection was accepted: a client may
        # open connections ahead and send their heads after a revocation.
        decision = decide(self._current_policy(), target.host, target.port)
        session.host = decision.host
        if not decision.allowed:
            raise Refusal(403, decision.reason)
        session.route = decision.route.name if decision.route is not None else None
        session.allow(decision.reason)
        if target.connect:
            # Nothing more is read until the tunnel is made: bytes sent after the head stay in
            # the kernel (the lookup below takes time), so they cannot be taken for the
            # plaintext inside a routed host's TLS; what came with the head is h11's, refused.
            reading(writer, on=False)
        addresses = await self._addresses(decision, target.port)
        if not target.connect:
            upstream = await self._open(addresses, target.port)
            peer = HttpPeer(*upstream, upstream_connection(), session.count_received)
            try:
                outgoing = upstream_request(request, target.path, host=f"{target.host}:{target.port}")
                await relay(client, peer, outgoing, keep_alive=False)
            finally:
                upstream[1].close()
            return
        if client.conn.trailing_data[0] or reader.at_eof() or _buffered(reader):
            raise Refusal(400, "data before the tunnel was established")
        if decision.route is not None:
            await self._routed(session, client, decision)
            return
        upstream = await self._open(addresses, target.port)
        try:
            await self._established(client, session)
            reading(writer, on=True)
            await splice((reader, writer), upstream, sent=session.count_sent, received=session.count_received)
        finally:
            upstream[1].close()

    async def _established(self, client: HttpPeer, session: Session) -> None:
        await client.send(h11.Response(status_code=200, headers=[], reason=b"Connection established"))
        session.answered = True

    async def _routed(self, session: Session, client: HttpPeer, decision: Decision) -> None:
        if self.ca is None:
            raise Refusal(502, "credential routes need the sandbox's CA")
        host, port = decision.host, session.port

        def recheck() -> Decision:
            again = decide(self._current_policy(), host, port)
            if not again.allowed:
                raise Refusal(403, again.reason)
            if again.route is None:
                raise Refusal(403, "route removed")
            return again

        async def connect(now: Decision) -> Streams:
            return await self._open(await self._addresses(now, port), port, tls_host=host)

        tunnel = Tunnel(host=host, port=port, recheck=recheck, connect=connect, session=session)
        expires_at = decision.route.expires_at if decision.route is not None else None
        # An expiry is no change to the owner's files, so no watch calls revoke_check for it.
        timer = (
            None
            if expires_at is None
            else asyncio.get_running_loop().call_later(max(0.0, expires_at - time.time()), self.revoke_check)
        )
        try:
            await self._established(client, session)
            await serve_routed(tunnel, client.reader, client.writer, self.ca.server_context(host))
        finally:
            if timer is not None:
                timer.cancel()

    async def _addresses(self, decision: Decision, port: int) -> list[str]:
        """Where `decision`'s host may be dialled: the literal itself, the rule's pinned
        addresses, or what the host's resolver says; every one checked (addresses.py)."""
        rule = decision.rule
        if rule is None:  # an allowed decision names its rule
            raise Refusal(403, decision.reason)
        if parse_address(decision.host) is not None:
            candidates: Sequence[str] = [decision.host]
        elif rule.addresses:
            candidates = rule.addresses
        else:
            try:
                async with asyncio.timeout(self.connect_seconds), self._resolving:
                    candidates = await self.resolver(decision.host, port)
            except (OSError, TimeoutError):
                raise Refusal(502, "name did not resolve") from None
        if not candidates:
            raise Refusal(502, "name did not resolve")
        for address in candidates:
            refused = address_allowed(rule, address)
            if refused is not None:
                raise Refusal(403, refused)
            named = parse_address(address) in {parse_address(text) for text in (rule.host, *rule.addresses)}
            if not named and parse_address(address) in self.host_addresses:  # the host itself, by another name
                raise Refusal(403, "the host's own address not listed")
        return list(candidates)

    async def _open(self, addresses: Sequence[str], port: int, *, tls_host: str | None = None) -> Streams:
        """A connection to the first address that answers (TLS verified for `tls_host`)."""
        timed_out = False
        for address in addresses:
            try:
                async with asyncio.timeout(self.connect_seconds):
                    if tls_host is None:
                        return await asyncio.open_connection(address, port)
                    return await asyncio.open_connection(address, port, ssl=self.upstream_ssl, server_hostname=tls_host)
            except TimeoutError:
                timed_out = True
            except ssl.SSLCertVerificationError:
                raise Refusal(502, "upstream certificate not trusted") from None
            except OSError:
                continue
        raise Refusal(504, "upstream timed out") if timed_out else Refusal(502, "upstream unreachable")


def _failure(exc: Exception) -> str:
    """The report's reason for a connection that failed: the network's, or ours (logged)."""
    if isinstance(exc, (OSError, ssl.SSLError, h11.ProtocolError)):
        return "connection failed"
    _log.error("egress connection failed: %s", type(exc).__name__)  # never the message: it may quote a header
    return "internal error"


def _buffered(reader: asyncio.StreamReader) -> bool:
    """Whether the stream holds bytes nobody has read yet (read before reading was paused)."""
    return bool(getattr(reader, "_buffer", b""))  # asyncio keeps no public view of it


def _admit(policy: EgressPolicy, serving: int, allowance: Allowance) -> None:
    """`Refusal` when a new connection is past the sandbox's limits (or its policy unavailable)."""
    if policy is NOTHING:
        raise Refusal(503, "policy unavailable")
    if serving >= policy.limits.connections:
        raise Refusal(503, "connection limit")
    if allowance.spent(policy.limits.mib):
        raise Refusal(429, "byte limit")
