"""The egress decision (core/egress/policy.py, addresses.py): which names, IP literals and
ports a sandbox may reach, and which resolved addresses a connection may go to."""

from __future__ import annotations

import ipaddress
import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandboxer.core.egress.policy import EgressPolicy, EgressRule, Route, address_allowed, decide

RULES = (
    EgressRule(host="pypi.org", ports=(443,)),
    EgressRule(host="*.example.com", ports=(443, 80)),
    EgressRule(host="api.model.test", ports=(8443,), addresses=("127.0.0.1",)),
    EgressRule(host="93.184.216.34", ports=(443,)),
    EgressRule(host="v6.test", ports=(443,), addresses=("2001:db8::1",)),
)
POLICY = EgressPolicy(rules=RULES)


@pytest.mark.parametrize(
    ("host", "port", "reason"),
    [
        ("pypi.org", 443, "listed"),
        ("PyPI.ORG.", 443, "listed"),
        ("pypi.org", 80, "port not listed"),
        ("files.pypi.org", 443, "host not listed"),
        ("a.example.com", 443, "listed"),
        ("a.b.example.com", 80, "listed"),
        ("example.com", 443, "host not listed"),
        ("badexample.com", 443, "host not listed"),
        ("a.example.com", 8080, "port not listed"),
        ("api.model.test", 8443, "listed"),
        ("other.test", 443, "host not listed"),
        ("", 443, "malformed host"),
        ("a..example.com", 443, "malformed host"),
        ("a b.example.com", 443, "malformed host"),
        ("a.example.com%00", 443, "malformed host"),
        ("-a.example.com", 443, "malformed host"),
        ("é.example.com", 443, "malformed host"),
    ],
)
def test_names_and_ports(host: str, port: int, reason: str) -> None:
    decision = decide(POLICY, host, port)
    assert (decision.allowed, decision.reason) == (reason == "listed", reason)


@pytest.mark.parametrize(
    ("host", "reason"),
    [
        ("127.0.0.2", "IP literal not listed"),
        ("[::1]", "IP literal not listed"),
        ("::1", "IP literal not listed"),
        ("::ffff:127.0.0.1", "IP literal not listed"),
        ("169.254.169.254", "IP literal not listed"),
        ("0x7f.1", "non-canonical IP literal"),
        ("2130706433", "non-canonical IP literal"),
        ("127.1", "non-canonical IP literal"),
        ("0177.0.0.1", "non-canonical IP literal"),
        ("0x7f000001", "non-canonical IP literal"),
        ("example.0x10", "non-canonical IP literal"),
        ("example.123", "non-canonical IP literal"),
        ("fe80::1%eth0", "malformed host"),
        ("93.184.216.34", "listed"),
    ],
)
def test_ip_literals_only_when_a_rule_names_them(host: str, reason: str) -> None:
    decision = decide(POLICY, host, 443)
    assert (decision.allowed, decision.reason) == (reason == "listed", reason)


def test_a_literal_pinned_for_a_name_is_not_itself_allowed() -> None:
    """`addresses` says where a name goes; asking for the address itself is an IP literal that
    no rule names (the sandbox could otherwise reach the pinned upstream under any Host)."""
    assert not decide(POLICY, "127.0.0.1", 8443).allowed
    assert not decide(POLICY, "[2001:db8::1]", 443).allowed  # v6.test's pinned address
    assert decide(POLICY, "93.184.216.34", 443).allowed  # a rule whose host is that literal
    assert address_allowed(EgressRule(host="10.1.2.3", ports=(443,)), "10.1.2.3") is None  # its own host


def test_a_route_is_attached_by_host_and_refused_once_expired() -> None:
    route = Route(name="model", host="api.model.test", header="Authorization", secret_file="/nonexistent")
    policy = EgressPolicy(rules=RULES, routes={"model": route})
    assert decide(policy, "API.model.test", 8443).route == route
    assert decide(policy, "pypi.org", 443).route is None
    expiring = EgressPolicy(rules=RULES, routes={"model": Route(**{**_fields(route), "expires_at": 100.0})})
    assert decide(expiring, "api.model.test", 8443, now=99.0).allowed
    late = decide(expiring, "api.model.test", 8443, now=100.0)
    assert (late.allowed, late.reason) == (False, "route expired")


def _fields(route: Route) -> dict[str, object]:
    return {name: getattr(route, name) for name in Route.__slots__}


PUBLIC = EgressRule(host="x.test", ports=(443,))


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("93.184.216.34", None),
        ("2606:2800:220:1:248:1893:25c8:1946", None),
        ("127.0.0.1", "loopback address"),
        ("127.9.9.9", "loopback address"),
        ("::1", "loopback address"),
        ("10.1.2.3", "private address"),
        ("172.16.0.1", "private address"),
        ("192.168.1.1", "private address"),
        ("fd12:3456::1", "private address"),
        ("169.254.1.1", "link-local address"),
        ("fe80::1", "link-local address"),
        ("224.0.0.1", "multicast address"),
        ("ff02::1", "multicast address"),
        ("0.0.0.0", "unspecified address"),  # noqa: S104 -- an address judged, not bound
        ("::", "unspecified address"),
        ("240.0.0.1", "reserved address"),
        ("100.64.0.1", "carrier-grade NAT address"),
        ("169.254.169.254", "cloud metadata address"),
        ("fd00:ec2::254", "cloud metadata address"),
        ("::ffff:127.0.0.1", "loopback address (embedded in IPv6)"),
        ("::ffff:10.0.0.1", "private address (embedded in IPv6)"),
        ("::ffff:169.254.169.254", "cloud metadata address (embedded in IPv6)"),
        ("2002:7f00:1::", "loopback address (embedded in IPv6)"),
        ("64:ff9b::a9fe:a9fe", "cloud metadata address (embedded in IPv6)"),
        ("::ffff:93.184.216.34", None),
    ],
)
def test_address_classes(address: str, reason: str | None) -> None:
    found = address_allowed(PUBLIC, address)
    if reason is None:
        assert found is None
    else:
        assert found == f"{reason} not listed"


def test_an_address_listed_by_the_rule_is_exempt() -> None:
    rule = EgressRule(host="api.model.test", ports=(8443,), addresses=("127.0.0.1", "fd00:ec2::254"))
    assert address_allowed(rule, "127.0.0.1") is None
    assert address_allowed(rule, "fd00:ec2::254") is None
    assert address_allowed(rule, "127.0.0.2") is not None
    assert address_allowed(rule, "::ffff:127.0.0.1") is not None


LABEL = st.from_regex(r"[a-z][a-z0-9-]{0,10}[a-z]", fullmatch=True)


@given(st.lists(LABEL, min_size=1, max_size=4), st.sampled_from(["example.com", "pypi.org"]))
def test_a_wildcard_covers_every_name_strictly_below_it(labels: list[str], suffix: str) -> None:
    policy = EgressPolicy(rules=(EgressRule(host=f"*.{suffix}", ports=(443,)),))
    name = ".".join([*labels, suffix])
    assert decide(policy, name, 443).allowed
    assert decide(policy, name.upper() + ".", 443).allowed
    assert not decide(policy, suffix, 443).allowed
    assert not decide(policy, name + "x", 443).allowed


@given(st.integers(min_value=0, max_value=2**32 - 1))
def test_no_spelling_of_an_ipv4_address_is_allowed_without_a_rule(value: int) -> None:
    address = ipaddress.IPv4Address(value)
    spellings = [str(address), str(value), hex(value), f"[::ffff:{address}]"]
    spellings.append(".".join(hex(int(part)) for part in str(address).split(".")))
    for spelling in spellings:
        assert not decide(POLICY if value != 0x5DB8D822 else EgressPolicy(rules=()), spelling, 443).allowed


@given(st.text(max_size=30))
def test_anything_inet_aton_reads_as_an_address_is_a_literal_or_refused(text: str) -> None:
    decision = decide(EgressPolicy(rules=(EgressRule(host="*.test", ports=(443,)),)), text, 443)
    try:
        socket.inet_aton(text.strip().lower().removesuffix("."))
    except (OSError, ValueError):
        return
    assert not decision.allowed
