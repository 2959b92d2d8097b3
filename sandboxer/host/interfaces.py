"""The addresses of this host's own network interfaces, for the egress proxy: a listed name that
resolves to one of them would have the proxy connect from the host to the host itself, past any
firewall between the host and its network (docs/egress.md). Read with psutil, again at most every
`seconds` (interfaces come and go; a connection must not wait on reading them)."""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
import time

import psutil

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
REFRESH_SECONDS = 10.0


class HostAddresses:
    """`address in HostAddresses()`: whether one of this host's interfaces has that address."""

    def __init__(self, seconds: float = REFRESH_SECONDS) -> None:
        self.seconds = seconds
        self._lock = threading.Lock()
        self._read_at = -seconds
        self._addresses: frozenset[IPAddress] = frozenset()

    def __contains__(self, address: object) -> bool:
        return address in self._current()

    def _current(self) -> frozenset[IPAddress]:
        with self._lock:
            if time.monotonic() - self._read_at >= self.seconds:
                self._addresses = _read()
                self._read_at = time.monotonic()
            return self._addresses


def _read() -> frozenset[IPAddress]:
    found: set[IPAddress] = set()
    for entries in psutil.net_if_addrs().values():
        for entry in entries:
            if entry.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                found.add(ipaddress.ip_address(entry.address.split("%", 1)[0]))
            except ValueError:
                continue
    return frozenset(found)


def own_listeners() -> frozenset[str]:
    """Every TCP socket this process listens on at the host's IPv4 loopback, as `127.0.0.1:PORT`
    (the published ports' evidence: the service's own listener, not another's on that port).
    psutil reads the calling process's network namespace: the host's, for the broker."""
    return frozenset(
        f"{conn.laddr.ip}:{conn.laddr.port}"
        for conn in psutil.net_connections(kind="tcp4")
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.ip == "127.0.0.1" and conn.pid == os.getpid()
    )
