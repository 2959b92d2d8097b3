"""What a sandbox with egress sees: where the broker's proxy listens inside its network namespace,
the variables that point at it, and where the trust bundle of its credential routes is mounted.

Fixed names, the same in every sandbox (each has its own network namespace, so one port serves
all): the plan sets them (sandboxer/core/plan.py) and reserves them from the owner and the caller;
the service makes the listener at `EGRESS_HOST`:`EGRESS_PORT` and fills the trust directory.
"""

from __future__ import annotations

EGRESS_HOST = "127.0.0.1"
EGRESS_PORT = 3128
EGRESS_PROXY_URL = f"http://{EGRESS_HOST}:{EGRESS_PORT}"
NO_PROXY = "localhost,127.0.0.1,::1"  # the sandbox's own loopback services stay direct

# The sandbox's trust directory (<state>/sandboxes/<id>/trust on the host: the CA certificate of
# its routes and the host's roots, never a key), bound read-only here.
TRUST_TARGET = "/etc/sandboxer/trust"
TRUST_BUNDLE = f"{TRUST_TARGET}/bundle.pem"

PROXY_ENV_NAMES = ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy", "all_proxy")
NO_PROXY_ENV_NAMES = ("NO_PROXY", "no_proxy")
# What TLS clients read for their roots: OpenSSL (Python's ssl, curl's OpenSSL builds), requests,
# Node, git, curl, pip.
TRUST_ENV_NAMES = (
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "NODE_EXTRA_CA_CERTS",
    "GIT_SSL_CAINFO",
    "CURL_CA_BUNDLE",
    "PIP_CERT",
)


def proxy_env() -> tuple[tuple[str, str], ...]:
    """The variables of a sandbox with egress: every proxy variable at the listener."""
    return (
        *((name, EGRESS_PROXY_URL) for name in PROXY_ENV_NAMES),
        *((name, NO_PROXY) for name in NO_PROXY_ENV_NAMES),
        ("SANDBOXER_NETWORK", "proxy"),
    )


def trust_env() -> tuple[tuple[str, str], ...]:
    """The variables of a sandbox whose profile uses credential routes: the trust bundle."""
    return tuple((name, TRUST_BUNDLE) for name in TRUST_ENV_NAMES)
