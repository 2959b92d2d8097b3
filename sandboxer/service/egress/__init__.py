"""The egress proxy engine (issue 33): what a sandbox may reach, enforced by the broker.

A sandbox keeps `lo` as its only interface; the service runs one `EgressProxy` per sandbox whose
listening socket sits in the sandbox's network namespace and whose upstream connections leave
from the host's. policy.py decides (names, ports, IP literals), addresses.py refuses what a name
resolves to (loopback, private, metadata, ...), heads.py reads and checks a request head with h11,
proxy.py serves clients (CONNECT tunnels, plain HTTP forwarding, limits, revocation),
exchange.py relays one HTTP exchange, routes.py terminates TLS for credential routes with the
sandbox's CA (ca.py), report.py writes the access report. docs/egress.md describes it.
"""
