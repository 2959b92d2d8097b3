"""Which resolved addresses a connection may go to: the SSRF defence of the egress proxy.

A name on the allowlist still must not lead into the host or its networks: a rebinding DNS
answer, a typo'd internal name or a provider's metadata service would otherwise be one CONNECT
away. Every address a name resolves to is checked here; the only exemption is a rule that names
the exact address in its `addresses` (the owner saying "this test server on 127.0.0.1"):
policy.address_allowed.
IPv6 forms that embed an IPv4 address (v4-mapped, v4-compatible, 6to4, Teredo, NAT64) are
judged by the address they carry, since the kernel or a relay may deliver them there.
"""

from __future__ import annotations

import ipaddress

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Cloud metadata services: instance credentials live there. Both are in refused classes anyway
# (link-local, unique-local); named so the report says why.
METADATA = frozenset(
    {
        ipaddress.ip_address("169.254.169.254"),  # AWS, GCP, Azure, OpenStack, ...
        ipaddress.ip_address("fd00:ec2::254"),  # AWS over IPv6
        ipaddress.ip_address("100.100.100.200"),  # Alibaba Cloud (carrier-grade NAT space)
    }
)
CARRIER_GRADE_NAT = ipaddress.ip_network("100.64.0.0/10")
NAT64 = ipaddress.ip_network("64:ff9b::/96")
V4_COMPATIBLE = ipaddress.ip_network("::/96")


def parse_address(text: str) -> IPAddress | None:
    """The address `text` spells in its one canonical form (dotted quad, or IPv6 without a zone),
    else None. Brackets around IPv6 are accepted."""
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    if "%" in text:  # a zone: link-local only, and a way to name an interface
        return None
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def embedded_v4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 form carries (v4-mapped, v4-compatible, 6to4, Teredo, NAT64)."""
    if isinstance(address, ipaddress.IPv4Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    if address in NAT64 or (address in V4_COMPATIBLE and int(address) > 1):
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def address_class(address: IPAddress) -> str | None:
    """Why `address` is no place for a sandbox's traffic (a short phrase), or None when it is a
    global unicast address."""
    if address in METADATA:
        return "cloud metadata address"
    inner = embedded_v4(address)
    if inner is not None:
        found = address_class(inner)
        return f"{found} (embedded in IPv6)" if found else None
    checks = (
        (address.is_unspecified, "unspecified address"),
        (address.is_loopback, "loopback address"),
        (address.is_link_local, "link-local address"),
        (isinstance(address, ipaddress.IPv6Address) and address.is_site_local, "site-local address"),
        (address.is_multicast, "multicast address"),
        (isinstance(address, ipaddress.IPv4Address) and address in CARRIER_GRADE_NAT, "carrier-grade NAT address"),
        (address.is_reserved, "reserved address"),
        (address.is_private, "private address"),
        (not address.is_global, "not a global address"),
    )
    return next((reason for refused, reason in checks if refused), None)
